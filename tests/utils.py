"""Drive a model through paged attention without the runner: KV caches, block tables, metadata.

    logits = forward_prefill(model, [[1, 2, 3], [4, 5]], block_size=4)   # one prefill per sequence

    batch = PagedBatch(model, capacities=[32, 32], block_size=4)          # chunked prefill / decode
    first = batch.step([[1, 2, 3], [4, 5]])
    nxt = batch.step([[7], [8]])

Sequence i owns a contiguous run of blocks (block 0 is the reserved null block), sized for its
capacity in tokens, and a state slot (`slots`, default i; Mamba layers keep their state there, so
tests can reuse and poison slots). Every `CacheLayer` gets its cache from its backend's
`allocate_cache`. Each step appends a chunk of tokens per sequence (empty is allowed) at the
positions after those already in the cache; `restart(i)` starts sequence i over in the same slot.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attention_zoo import CacheLayer, CommonAttentionMetadata


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedBatch:
    def __init__(
        self, model: nn.Module, capacities: list[int], block_size: int, slots: list[int] | None = None,
        num_slots: int | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.capacities = list(capacities)
        self.slots = list(slots) if slots is not None else list(range(len(capacities)))
        self.layers = [m for m in model.modules() if isinstance(m, CacheLayer)]
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        blocks = [_cdiv(c, block_size) for c in capacities]
        table = torch.zeros(len(capacities), max(blocks), dtype=torch.int32)
        start = 1
        for i, n in enumerate(blocks):
            table[i, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        self.block_table = table.to(self.device)  # [num_seqs, max_blocks]
        num_slots = num_slots or max(self.slots) + 1
        self.kv_caches = [
            layer.backend.allocate_cache(layer.spec, num_blocks=start, block_size=block_size, num_slots=num_slots,
                                         dtype=self.dtype, device=self.device)
            for layer in self.layers
        ]
        self.num_computed = [0] * len(capacities)

    def restart(self, seq: int) -> None:
        self.num_computed[seq] = 0

    def _slots(self, seq: int, positions: list[int]) -> list[int]:
        table = self.block_table[seq].tolist()
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in positions]

    def prepare(
        self, chunks: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:  # input_ids [T], positions [T], attn_metadata
        """The model inputs for appending `chunks[i]` to sequence i. Does not advance the batch."""
        assert len(chunks) == len(self.capacities)
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for i, chunk in enumerate(chunks):
            start = self.num_computed[i]
            assert start + len(chunk) <= self.capacities[i], f"sequence {i} exceeds its capacity"
            pos = list(range(start, start + len(chunk)))
            ids += chunk
            positions += pos
            slots += self._slots(i, pos)
            query_lens.append(len(chunk))
            seq_lens.append(start + len(chunk))
        qsl = torch.zeros(len(chunks) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(self.device), query_start_loc_cpu=qsl,
            seq_lens=seq_lens_cpu.to(self.device), seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=torch.tensor(self.num_computed, dtype=torch.int32),
            block_table=self.block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            request_rows=torch.tensor(self.slots, dtype=torch.int32, device=self.device),
            num_reqs=len(chunks), num_tokens=len(ids), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), block_size=self.block_size,
        )
        backends = {layer.backend.name: layer.backend for layer in self.layers}
        attn_metadata = {name: backend.build_metadata(common) for name, backend in backends.items()}
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return input_ids, torch.tensor(positions, dtype=torch.int64, device=self.device), attn_metadata

    @torch.no_grad()
    def forward(self, chunks: list[list[int]]) -> Any:
        """Run the model on the chunks and advance; returns what `model.forward` returned."""
        for layer, cache in zip(self.layers, self.kv_caches):
            layer.kv_cache = cache
        out = self.model(*self.prepare(chunks))
        for i, chunk in enumerate(chunks):
            self.num_computed[i] += len(chunk)
        return out

    def step(self, chunks: list[list[int]]) -> list[torch.Tensor]:  # per sequence [len(chunk_i), vocab] fp32
        hidden = self.forward(chunks)
        with torch.no_grad():
            logits = self.model.compute_logits(hidden)
        return list(logits.split([len(c) for c in chunks]))


def forward_prefill(
    model: nn.Module, token_ids_list: list[list[int]], block_size: int
) -> list[torch.Tensor]:  # per sequence [len_i, vocab] fp32
    """Prefill every sequence in one batched forward; the logits at every position."""
    return PagedBatch(model, [len(t) for t in token_ids_list], block_size).step(token_ids_list)


def greedy_decode(
    model: nn.Module, prompts: list[list[int]], max_new_tokens: int, block_size: int
) -> list[list[int]]:
    """Batched greedy generation: one prefill, then one decode step per new token."""
    batch = PagedBatch(model, [len(p) + max_new_tokens for p in prompts], block_size)
    logits = batch.step(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        nxt = [int(seq_logits[-1].argmax()) for seq_logits in logits]
        for seq, token in zip(out, nxt):
            seq.append(token)
        if step + 1 < max_new_tokens:
            logits = batch.step([[t] for t in nxt])
    return out


def assert_greedy_agrees_up_to_near_ties(want: list, got: list, num_tokens: int, tol: float = 0.05) -> None:
    """Two bf16 paths' greedy completions (CompletionOutputs with logprobs): each sequence matches token for token,
    its logprobs within `tol`, until it may part at a near-tie of the reference's top two tokens (`tol` apart);
    all but at most one sequence match to the end."""
    same = 0
    for w_out, g_out in zip(want, got, strict=True):
        assert len(g_out.token_ids) == len(w_out.token_ids) == num_tokens
        for j, (w, g) in enumerate(zip(w_out.token_ids, g_out.token_ids)):
            if w != g:  # parted: only at a near-tie in the reference
                top = w_out.logprobs[j]
                assert g in top and abs(top[w].logprob - top[g].logprob) < tol, (j, w, g, top)
                break
            assert abs(w_out.logprobs[j][w].logprob - g_out.logprobs[j][g].logprob) < tol
        else:
            same += 1
    assert same >= len(want) - 1
