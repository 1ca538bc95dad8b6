"""CUDA graphs of a token tree's levels (`EagleTree.grow`, static; `DynamicEagleTree.grow`, EAGLE-2's): depths
1 .. D of a drafting step in one replay per padded batch size B, the same numbers as the eager levels. The entry
forward before them stays eager (its rows vary with acceptance); its head output and next feature at each request's
last verified row, the root, are the graph's inputs.

Each level runs the head over a block of M nodes per request (a static tree: nodes 1 .. M_d, those of depth < d; a
dynamic one: the frontiers of the depths above), as `run_block` does: block node j at position root + its depth,
its KV at the slot of position root + j, attending to the cached context and to its ancestors in the block.
Eagerly each level builds its metadata from host lists; here a level's records are computed inside the graph from
the roots, into persistent buffers that the level's metadata (built once at capture) reads:

    staging [2A + 1] int64       the roots (each request's last verified position; 0 on padding), n, then the chain
                                 budgets (what a dynamic tree's real nodes fit in): one copy
    block_table [A, blocks]      each request's row of the target step's block table
    root_out, root_carry [A, H]  the head's output and next feature at the roots
    per (B, M): positions, slot_mapping, tree_bits [B * M] int64, seq_lens [B] int32, query_start_loc [B + 1]
                                 (query_start_loc fixed at capture)

A replay returns the drafts [B, N] int64 (node j in column j - 1) and, for a dynamic tree, their parents [B, N + 1]
(the graph's outputs, until the next replay). Padding rows (n .. B - 1) compute at root 0 and write no KV (slot -1);
their drafts are noise. A graph needs attention that takes multi-token queries in graphs and masks token trees
(triton); elsewhere the tree drafts eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from attention_zoo import CacheLayer
from research_lm.worker.cuda_graphs import Capture, GraphPool
from research_lm.worker.rng import to_device
from spec_decode.draft_graphs import graph_metadata
from spec_decode.eagle_tree import DynamicEagleTree, EagleTree


class TreeGraphs:
    def __init__(self, tree: EagleTree | DynamicEagleTree, *, layers: Sequence[CacheLayer], sizes: Sequence[int],
                 hidden: int, dtype: torch.dtype, block_size: int, max_blocks_per_req: int, max_seq_len: int,
                 device: torch.device, capture: Capture | GraphPool):
        self.tree, self.block_size, self.max_seq_len = tree, block_size, max_seq_len
        self.sizes = sorted(s for s in set(sizes) if s >= 1)
        a = self.sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.staging = torch.zeros(2 * a + 1, **i64)
        self.block_table = torch.zeros(a, max_blocks_per_req, **i32)
        self.request_rows = torch.full((a,), -1, **i32)  # only state layers read it; drafters have none
        self.root_out = torch.zeros(a, hidden, dtype=dtype, device=device)
        self.root_carry = torch.zeros(a, hidden, dtype=dtype, device=device)
        self.rows = torch.arange(a, **i64)
        self.offsets = torch.arange(1, max(tree.block_sizes(), default=0) + 1, **i64)  # block node j's KV: root + j
        self._backends = {layer.backend.name: layer.backend for layer in layers}
        self._replay: dict[int, Callable[[], tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._keep: dict[int, tuple[Any, ...]] = {}
        pool = GraphPool.of(capture)
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            self.staging.zero_()  # all padding: a warm-up run writes no KV
            self._replay[b] = pool(self._draft_fn(b))

    def _draft_fn(self, b: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor | None]]:
        tree, bs = self.tree, self.block_size
        # views: a replay reads what the host staged
        roots, num_reqs, budget = self.staging[:b], self.staging[b], self.staging[b + 1 : 2 * b + 1]
        real = torch.zeros(b, dtype=torch.bool, device=roots.device)  # rows < n, computed in the graph
        block_table, last_block = self.block_table[:b], self.block_table.shape[1] - 1
        records = {m: self._level(b, m) for m in tree.block_sizes()}
        self._keep[b] = (real, records)  # a capture keeps the graph, not this function: its buffers must outlive it

        def block(tokens: torch.Tensor, features: torch.Tensor, depths: torch.Tensor,
                  bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            m = tokens.shape[1]
            positions, slots, seq_lens, tree_bits, metadata = records[m]
            kv = roots[:, None] + self.offsets[:m]  # [b, m] the positions whose slots hold the nodes' KV
            slot = block_table.gather(1, (kv // bs).clamp(max=last_block)).long() * bs + kv % bs
            slots.copy_(torch.where(real[:, None], slot, -1).view(-1))
            positions.copy_((roots[:, None] + depths).view(-1))
            tree_bits.copy_(bits.reshape(-1))
            seq_lens.copy_(torch.where(real, roots + 1 + m, m))  # padding: the block alone
            out, carry = tree.forward(tokens.reshape(-1), positions, metadata, features.flatten(0, 1))
            return out.view(b, m, -1), carry.view(b, m, -1)

        @torch.inference_mode()
        def draft() -> tuple[torch.Tensor, torch.Tensor | None]:  # a graph's outputs stay allocated for its replays
            torch.lt(self.rows[:b], num_reqs, out=real)
            return tree.grow(self.root_out[:b], self.root_carry[:b], block, budget)

        return draft

    def _level(self, b: int, m: int) -> tuple[torch.Tensor, ...]:
        """A block of m nodes per request for b requests: (positions, slot_mapping, seq_lens, tree_bits, metadata)."""
        device = self.staging.device
        positions = torch.zeros(b * m, dtype=torch.int64, device=device)
        slots = torch.full((b * m,), -1, dtype=torch.int64, device=device)
        seq_lens = torch.full((b,), m, dtype=torch.int32, device=device)
        qsl = torch.arange(0, b * m + 1, m, dtype=torch.int32, device=device)
        bits = torch.ones(b * m, dtype=torch.int64, device=device)
        metadata = graph_metadata(self._backends, qsl, seq_lens, slots, self.block_table[:b], self.request_rows[:b],
                                  b * m, m, self.max_seq_len, self.block_size, tree_bits=bits)
        return positions, slots, seq_lens, bits, metadata

    def serves(self, num_reqs: int) -> bool:
        return 0 < num_reqs <= self.sizes[-1]

    @torch.inference_mode()
    def run(
        self,
        block_table: torch.Tensor,  # [step's requests, >= blocks] the target step's block table
        rows: Sequence[int],  # [n] each drafting request's row in it
        root_positions: Sequence[int],  # [n] the position of its last verified row
        budgets: Sequence[int],  # [n] its chain budget
        root_out: torch.Tensor,  # [n, H] the head's output there
        root_carry: torch.Tensor,  # [n, H] and its next feature
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [n, N] int64 tokens; a dynamic tree's parents [n, N + 1]
        """Replay the graph of the smallest size that holds the n requests; the host issues only copies."""
        n = len(rows)
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        staged = [*root_positions, *[0] * (b - n), n, *budgets, *[0] * (b - n)]
        self.staging[: 2 * b + 1].copy_(to_device(staged, torch.int64, self.staging.device))
        cols = min(block_table.shape[1], self.block_table.shape[1])
        if list(rows) == list(range(n)):  # the step's first n rows, in order: no gather
            self.block_table[:n, :cols].copy_(block_table[:n, :cols])
        else:
            index = to_device(list(rows), torch.int64, block_table.device)
            self.block_table[:n, :cols].copy_(block_table[:, :cols].index_select(0, index))
        self.root_out[:n].copy_(root_out)
        self.root_carry[:n].copy_(root_carry)
        tokens, parents = self._replay[b]()
        # copies: the next replay overwrites the graph's outputs
        return tokens[:n].clone(), None if parents is None else parents[:n].clone()
