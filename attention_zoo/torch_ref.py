"""The readable oracle: gather each request's pages, build its causal (windowed, tree) mask, softmax in fp32.

Slow by design (a Python loop over requests); every other backend is tested against it.
"""

from __future__ import annotations

import torch

from attention_zoo.base import AttentionBackend, AttentionImpl, AttentionSpec, BackendCapabilities
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.registry import register_backend


def write_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, not written
) -> None:
    num_tokens = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_flat = kv_cache[0].view(-1, *kv_cache.shape[-2:])
    v_flat = kv_cache[1].view(-1, *kv_cache.shape[-2:])
    k_flat[slots] = k[:num_tokens][valid].to(kv_cache.dtype)
    v_flat[slots] = v[:num_tokens][valid].to(kv_cache.dtype)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_ids: torch.Tensor,  # [max_blocks_per_req] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_size]
    num_blocks = -(-seq_len // cache.shape[1])
    return cache[block_ids[:num_blocks].long()].flatten(0, 1)[:seq_len]


def causal_mask(
    q_positions: torch.Tensor, seq_len: int, sliding_window: int | None
) -> torch.Tensor:  # [q_len, seq_len] bool, True = attend
    k_positions = torch.arange(seq_len, device=q_positions.device)
    mask = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        mask &= k_positions[None, :] > q_positions[:, None] - sliding_window
    return mask


def tree_mask(tree_bits: torch.Tensor) -> torch.Tensor:
    """[q_len] int64 bits of one request's query tokens -> [q_len, q_len] bool: token t attends to query token j."""
    j = torch.arange(tree_bits.shape[0], device=tree_bits.device)
    return ((tree_bits[:, None] >> j[None, :]) & 1) == 1


def reference_attention(
    q: torch.Tensor,  # [q_len, num_heads, head_size]
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_size]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_size_v]
    mask: torch.Tensor,  # [q_len, seq_len] bool
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_size_v], fp32
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


class TorchRefImpl(AttentionImpl):
    def forward(self, q, k, v, kv_cache, metadata: CommonAttentionMetadata):
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = torch.zeros_like(q)
        qsl = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        for i in range(metadata.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            if end == start:
                continue
            ctx_k = gather_context(kv_cache[0], metadata.block_table[i], seq_len)
            ctx_v = gather_context(kv_cache[1], metadata.block_table[i], seq_len)
            q_positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            mask = causal_mask(q_positions, seq_len, self.spec.sliding_window)
            if metadata.tree_bits is not None:  # among the step's own tokens: ancestors and itself only
                mask[:, seq_len - (end - start) :] &= tree_mask(metadata.tree_bits[start:end])
            out[start:end] = reference_attention(q[start:end], ctx_k, ctx_v, mask, self.spec.scale).to(q.dtype)
        return out


@register_backend("torch_ref")
class TorchRefBackend(AttentionBackend):
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kinds=frozenset({"attention"}),
        sliding_window=True,
        cuda_graphs=False,
        eager_plans_on_host=True,
        token_trees=True,
        # Not batch_invariant: on CUDA its einsums are cuBLAS batched GEMMs whose kernel (and split of the key sum)
        # follows the request's query length, so a decode row and the same row in a verify step can differ.
        batch_invariant=False,
    )

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, spec: AttentionSpec) -> tuple[int, ...]:
        return (2, num_blocks, block_size, spec.num_kv_heads, spec.head_size)

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl:
        return TorchRefImpl(spec)
