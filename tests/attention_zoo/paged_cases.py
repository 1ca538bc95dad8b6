"""Random ragged batches over a paged KV cache, shared by the attention backends' tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention_zoo.base import AttentionSpec
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.registry import get_backend


@dataclass
class PagedCase:
    q: torch.Tensor  # [num_tokens + pad, num_heads, head_size]
    k: torch.Tensor  # [num_tokens + pad, num_kv_heads, head_size]
    v: torch.Tensor  # [num_tokens + pad, num_kv_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size], context pre-filled
    common: CommonAttentionMetadata
    spec: AttentionSpec

    @property
    def num_real_tokens(self) -> int:
        return int(self.common.query_start_loc_cpu[-1])


def make_case(
    query_lens: list[int],
    seq_lens: list[int],  # context length after this step, >= query length
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    pad_tokens: int = 0,  # extra rows past the batch (CUDA-graph padding), slot -1
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedCase:
    """Each request's pages are a random set of blocks (block 0 is the null block); the cache is noise."""
    assert all(s >= q for q, s in zip(query_lens, seq_lens))
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(query_lens)
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 2
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    block_table = torch.zeros(num_reqs, max(pages) + 1, dtype=torch.int32)
    slots: list[int] = []
    for r, n in enumerate(pages):
        block_table[r, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        for p in range(seq_lens[r] - query_lens[r], seq_lens[r]):
            slots.append(int(block_table[r, p // block_size]) * block_size + p % block_size)
    num_tokens = len(slots) + pad_tokens
    slots += [-1] * pad_tokens

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(device),
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=seq - torch.tensor(query_lens, dtype=torch.int32),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        request_rows=torch.arange(num_reqs, dtype=torch.int32, device=device),
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    spec = AttentionSpec(num_heads, num_kv_heads, head_size, head_size**-0.5, sliding_window)
    return PagedCase(
        q=randn(num_tokens, num_heads, head_size),
        k=randn(num_tokens, num_kv_heads, head_size),
        v=randn(num_tokens, num_kv_heads, head_size),
        kv_cache=randn(2, num_blocks, block_size, num_kv_heads, head_size),
        common=common,
        spec=spec,
    )


def run_backend(name: str, case: PagedCase, kv_cache: torch.Tensor | None = None, **build_kwargs):
    """(output, cache after the step) of backend `name` on a copy of the case's cache."""
    backend = get_backend(name)
    cache = (case.kv_cache if kv_cache is None else kv_cache).clone()
    metadata = backend.build_metadata(case.common, **build_kwargs)
    out = backend.make_impl(case.spec).forward(case.q, case.k, case.v, cache, metadata)
    return out, cache
