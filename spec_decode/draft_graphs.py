"""CUDA graphs for the chained drafting steps of the model-based proposers (EAGLE, EAGLE-3, draft model).

After draft 1 (from the eager forward over the verified rows), drafts 2 .. k of a greedy draft batch are
k - 1 single-token steps that depend only on each other: feed draft j at position last + j, take the
argmax as draft j + 1. One graph per padded batch size A holds the whole chain, so a step drafts with one
replay and one device -> host copy of the drafts, instead of k - 1 eager forwards each closed by a sync.

Persistent buffers (rows 0 .. A, allocated once; a replay reads them where the capture did):
    ids [A] int64          the token each row feeds next (draft 1 on entry)
    positions [A] int64    its position (last + 1 on entry); += 1 per chained step
    limit [A] int64        rows feed (and write KV) only at positions < limit = last + budget: the
                           scheduler allocated slots for the drafts the request asked for, no more
    carry [A, H]           EAGLE's feature for the next step (the head's own output); none for a draft model
    block_table [A, B]     the request's rows of the target step's block table (the KV is shared)
    query_start_loc [A+1], seq_lens [A], slot_mapping [A], request_rows [A]: the attention record
                           (request_rows stays -1: only state layers read it, and drafters have none)
    drafts [A, k-1] int64  drafts 2 .. k
Each chained step, inside the graph: seq_lens = positions + 1 on real rows (0 on padding), slot =
block_table[row, pos // block_size] * block_size + pos % block_size (-1 past limit or on padding), the
forward, logits, argmax -> drafts[:, j], ids; positions += 1. Padded rows (n .. A) have query length 0,
as in `research_lm.cuda_graphs`. Rows past their limit still compute (their drafts are dropped on the
host), at position 0 so no rotary table is read out of range.

Used only when every drafting request is greedy with nothing that changes the argmax (no penalties or
min_tokens ban; logprobs do not matter, drafts never return them) and the batch fits the largest size;
otherwise `Drafting.chain` runs its eager steps. Not captured at all for a drafter with a layer that syncs
with the host in forward (`research_lm.cuda_graphs.uncapturable_reason`: the runner checks only the
target). The attention launch plan is fixed at capture with max_seq_len = max_model_len +
num_lookahead_tokens, the longest any draft row reaches.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attention_zoo import CacheLayer, CommonAttentionMetadata
from research_lm.cuda_graphs import Capture

# (ids [A], positions [A], metadata, carry [A, H] | None) -> (logits [A, >= vocab] fp32, next carry | None)
DraftStep = Callable[[torch.Tensor, torch.Tensor, dict[str, Any], torch.Tensor | None],
                     tuple[torch.Tensor, torch.Tensor | None]]


class DraftChainGraphs:
    def __init__(
        self,
        step: DraftStep,
        layers: Sequence[CacheLayer],  # the drafter's attention layers (their backends build the metadata)
        *,
        num_speculative_tokens: int,
        vocab_size: int,
        sizes: Sequence[int],
        block_size: int,
        max_blocks_per_req: int,
        max_seq_len: int,
        carry_shape: tuple[int, ...] | None,  # (H,) with the dtype below, or None: no carry
        carry_dtype: torch.dtype,
        device: torch.device,
        capture: Capture,
    ):
        self.k, self.vocab_size, self.block_size = num_speculative_tokens, vocab_size, block_size
        self.sizes = sorted(s for s in set(sizes) if s >= 1)
        a = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.ids, self.positions, self.limit = (torch.zeros(a, **i64) for _ in range(3))
        self.carry = torch.zeros(a, *carry_shape, dtype=carry_dtype, device=device) if carry_shape else None
        self.block_table = torch.zeros(a, max_blocks_per_req, **i32)
        self.query_start_loc = torch.zeros(a + 1, **i32)
        self.seq_lens = torch.zeros(a, **i32)
        self.slot_mapping = torch.full((a,), -1, **i64)
        self.request_rows = torch.full((a,), -1, **i32)
        self.drafts = torch.zeros(a, self.k - 1, **i64)  # built only for k >= 2
        self._replay: dict[int, Callable[[], Any]] = {}
        backends = {layer.backend.name: layer.backend for layer in layers}
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            self._fill_entry(size, num_reqs=size)  # capture: every row real, position 0, writing no KV
            self.positions.zero_()
            self.limit.zero_()
            common = CommonAttentionMetadata(
                query_start_loc=self.query_start_loc[: size + 1], query_start_loc_cpu=torch.zeros(size + 1),
                seq_lens=self.seq_lens[:size], seq_lens_cpu=torch.ones(size, dtype=torch.int32),
                num_computed_tokens_cpu=torch.zeros(size, dtype=torch.int32), block_table=self.block_table[:size],
                slot_mapping=self.slot_mapping[:size], request_rows=self.request_rows[:size], num_reqs=size,
                num_tokens=size, max_query_len=1, max_seq_len=max_seq_len, block_size=block_size,
            )
            metadata = {name: b.build_metadata(common) for name, b in backends.items()}
            self._replay[size] = capture(self._chain_fn(step, size, metadata), pool)

    def _chain_fn(self, step: DraftStep, size: int, metadata: dict[str, Any]) -> Callable[[], None]:
        ids, positions, limit = self.ids[:size], self.positions[:size], self.limit[:size]
        carry = None if self.carry is None else self.carry[:size]
        block_table, bs = self.block_table[:size], self.block_size
        qsl = self.query_start_loc[: size + 1]
        seq_lens, slots, drafts = self.seq_lens[:size], self.slot_mapping[:size], self.drafts[:size]
        last_block = block_table.shape[1] - 1

        @torch.inference_mode()
        def chain() -> None:
            real = qsl[1:] > qsl[:-1]  # [size] bool: padding rows have query length 0
            for j in range(self.k - 1):
                feeds = real & (positions < limit)
                seq_lens.copy_(torch.where(real, positions + 1, 0))
                block = block_table.gather(1, (positions // bs).clamp(max=last_block)[:, None])[:, 0]
                slots.copy_(torch.where(feeds, block.long() * bs + positions % bs, -1))
                logits, nxt_carry = step(ids, torch.where(feeds, positions, 0), metadata, carry)
                torch.argmax(logits[:, : self.vocab_size], dim=-1, out=drafts[:, j])
                ids.copy_(drafts[:, j])
                positions.add_(1)
                if carry is not None:
                    carry.copy_(nxt_carry)

        return chain

    def _fill_entry(self, size: int, num_reqs: int) -> None:
        """Query lengths: 1 for rows < num_reqs, 0 after (padding)."""
        qsl = torch.arange(size + 1, dtype=torch.int32).clamp_(max=num_reqs)
        self.query_start_loc[: size + 1].copy_(qsl, non_blocking=True)

    def padded_size(self, num_reqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    @torch.inference_mode()
    def run(
        self,
        block_table: torch.Tensor,  # [step's requests, >= blocks] the target step's block table
        rows: Sequence[int],  # [n] each draft request's row in it
        first: torch.Tensor,  # [n] int64 draft 1 of each request (device)
        last_positions: Sequence[int],  # [n] position of each request's newest verified token
        budgets: Sequence[int],  # [n] drafts each request wants (>= 1)
        carry: torch.Tensor | None,  # [n, H] EAGLE's feature after draft 1's row
    ) -> list[list[int]]:  # per request, drafts 2 .. budget
        n = len(budgets)
        size = self.padded_size(n)
        assert size is not None and (carry is None) == (self.carry is None)
        self._fill_entry(size, n)
        host = torch.tensor([[p + 1 for p in last_positions],
                             [p + b for p, b in zip(last_positions, budgets, strict=True)], list(rows)])
        entry = host.to(self.ids.device)  # one copy: positions, limits, block table rows
        self.positions[:n].copy_(entry[0])
        self.limit[:n].copy_(entry[1])
        cols = min(block_table.shape[1], self.block_table.shape[1])
        self.block_table[:n, :cols].copy_(block_table[:, :cols].index_select(0, entry[2]))
        self.ids[:n].copy_(first)
        self.positions[n:size].zero_()
        if carry is not None:
            self.carry[:n].copy_(carry)
        self._replay[size]()
        drafted = self.drafts[:n].tolist()
        return [row[: b - 1] for row, b in zip(drafted, budgets, strict=True)]
