"""CUDA graphs of a token tree's whole drafting step: the entry forward over the rows the target just verified,
then the tree's levels (`EagleTree.grow`, static; `DynamicEagleTree.grow`, EAGLE-2's), depths 1 .. D, in one
replay per padded batch size B, the same numbers as the eager step.

The entry is `DraftGraphs`' (spec_decode/draft_graphs.py), its "tree" rule: the same staging of the entry rows,
whose spans vary with acceptance (at most q = D + 1 rows per request), the same bookkeeping (on CUDA its Triton
kernel, with k = 1: no chain), the same prompt graphs of B = 1 and the same `split` of entries longer than a graph
serves (their first rows run eagerly, `run`'s catch_up). In place of the chain, the graph grows the tree from each
request's last entry row, its root: the head's output and next feature there, at the root's position. Every entry
request of the step is a graph row; only those with a chain budget (staged with the entry's) grow a real tree, the
others (budget 0: no drafts this step) and the padding rows grow theirs at root 0, writing no KV.

Each level runs the head over a block of M nodes per request (a static tree: nodes 1 .. M_d, those of depth < d; a
dynamic one: the frontiers of the depths above), as `run_block` does: block node j at position root + its depth,
its KV at the slot of position root + j, attending to the cached context and to its ancestors in the block.
Eagerly each level builds its metadata from host lists; here a level's records are computed inside the graph from
the roots, into persistent buffers that the level's metadata (built once at capture) reads:

    per (B, M): positions, slot_mapping, tree_bits [B * M] int64, seq_lens [B] int32, query_start_loc [B + 1]
                (query_start_loc fixed at capture); the block table is the entry's (`DraftGraphs.block_table`)

A replay gives the drafts [B, N] int64 (node j in column j - 1) and, for a dynamic tree, their parents [B, N + 1]
(the graph's outputs, until the next replay); `run` gathers the drafting requests' rows. A graph needs attention
that takes multi-token queries in graphs and masks token trees (triton); elsewhere, and for a step of more
requests than the largest size, the whole step drafts eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from attention_zoo import CacheLayer
from research_lm.worker.cuda_graphs import Capture, GraphPool
from research_lm.worker.rng import to_device
from spec_decode.draft_graphs import DraftForward, DraftGraphs, graph_metadata
from spec_decode.eagle_tree import DynamicEagleTree, EagleTree


class TreeGraphs:
    def __init__(self, tree: EagleTree | DynamicEagleTree, *, entry: DraftForward, layers: Sequence[CacheLayer],
                 sizes: Sequence[int], query_len: int, block_size: int, max_blocks_per_req: int, max_seq_len: int,
                 features: tuple[int, torch.dtype], device: torch.device, capture: Capture | GraphPool,
                 prefill_sizes: Sequence[int] = ()):
        self.tree, self.block_size, self.max_seq_len = tree, block_size, max_seq_len
        a = max(s for s in sizes if s >= 1)
        self.request_rows = torch.full((a,), -1, dtype=torch.int32, device=device)  # only state layers read it
        self.offsets = torch.arange(1, max(tree.block_sizes(), default=0) + 1, dtype=torch.int64, device=device)
        self._backends = {layer.backend.name: layer.backend for layer in layers}
        self._records: dict[int, dict[int, tuple[torch.Tensor, ...]]] = {}  # b -> m -> a level's records
        self.graphs = DraftGraphs(
            entry=entry, step=tree.forward, logits=tree.logits, argmax=None, layers=layers, num_speculative_tokens=1,
            vocab_size=tree.vocab_size, sizes=sizes, query_len=query_len, block_size=block_size,
            max_blocks_per_req=max_blocks_per_req, max_seq_len=max_seq_len, features=features, device=device,
            capture=capture, prefill_sizes=prefill_sizes, levels=self._levels)
        self.sizes = self.graphs.sizes

    def _levels(self, b: int, block_table: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
        """At capture, for b requests: the tree's levels as `DraftGraphs` runs them after the entry."""
        tree, bs, last_block = self.tree, self.block_size, block_table.shape[1] - 1
        if b not in self._records:  # persistent: a capture keeps the graph, not this function
            self._records[b] = {m: self._level(b, m, block_table) for m in tree.block_sizes()}
        records = self._records[b]

        def grow(root_out: torch.Tensor, root_carry: torch.Tensor, roots: torch.Tensor,
                 budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            real = budgets > 0  # [b] a drafting request's row (not padding, nor a request that drafts nothing)
            roots = torch.where(real, roots, 0)

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

            return tree.grow(root_out, root_carry, block, budgets)

        return grow

    def _level(self, b: int, m: int, block_table: torch.Tensor) -> tuple[Any, ...]:
        """A block of m nodes per request for b requests: (positions, slot_mapping, seq_lens, tree_bits, metadata)."""
        device = block_table.device
        positions = torch.zeros(b * m, dtype=torch.int64, device=device)
        slots = torch.full((b * m,), -1, dtype=torch.int64, device=device)
        seq_lens = torch.full((b,), m, dtype=torch.int32, device=device)
        qsl = torch.arange(0, b * m + 1, m, dtype=torch.int32, device=device)
        bits = torch.ones(b * m, dtype=torch.int64, device=device)
        metadata = graph_metadata(self._backends, qsl, seq_lens, slots, block_table, self.request_rows[:b],
                                  b * m, m, self.max_seq_len, self.block_size, tree_bits=bits)
        return positions, slots, seq_lens, bits, metadata

    def serves(self, num_reqs: int) -> bool:
        """Does a graph fit a step of this many entry requests?"""
        return self.graphs.serves(num_reqs)

    @torch.inference_mode()
    def run(
        self,
        block_table: torch.Tensor,  # [step's requests, >= blocks] the target step's block table
        rows: Sequence[int],  # [n] each entry request's row in it
        starts: Sequence[int],  # [n] position of each request's first entry row
        lens: Sequence[int],  # [n] its entry rows
        tokens: Sequence[int],  # the entry rows' tokens (x[t + 1]), request after request
        feature_rows: Sequence[int],  # each entry row's row in the target step
        budgets: Sequence[int],  # [n] each request's chain budget (0: it drafts nothing)
        drafting: Sequence[int],  # the drafting requests' rows in the step (their budgets > 0)
        catch_up: Callable[..., Any],  # (rows, starts, lens, tokens, feature_rows): an eager entry forward
        features: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],  # `DraftGraphs.run`'s
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [len(drafting), N] int64 tokens; a dynamic tree's parents
        """Replay the step's graph (entry and levels); the host issues only copies, and the eager entry forward of
        the first rows of entries longer than the graphs serve (`DraftGraphs.split`)."""
        drafts, parents = self.graphs.enter(block_table, rows, starts, lens, tokens, budgets, catch_up,
                                            features=features, feature_rows=feature_rows)
        by_row = {r: i for i, r in enumerate(rows)}
        index = [by_row[r] for r in drafting]
        # copies: the next replay overwrites the graph's outputs
        if index == list(range(len(index))):
            return drafts[: len(index)].clone(), None if parents is None else parents[: len(index)].clone()
        select = to_device(index, torch.int64, drafts.device)
        return drafts.index_select(0, select), None if parents is None else parents.index_select(0, select)
