"""Static token trees (vLLM's `speculative_token_tree`) drafted by an EAGLE or EAGLE-3 head: eagerly, or (the levels
below the root) from CUDA graphs (spec_decode/tree_graphs.py).

Node (r1, ..., rd) holds the rank-rd token of the head's distribution at its parent node: top-k of the head's logits
over the target vocabulary (EAGLE-3's draft ids mapped to target ids, as the chain maps them). Node 0, the root, is
the request's newest token; the head's output at the request's last verified row (the entry forward's, unchanged:
after the verify step's compaction the accepted path is a chain) gives the depth-1 children.

Depth d >= 2 runs the head over the nodes of depth < d, nodes 1..M (a breadth-first prefix of the tree), as one
query block per request:
- node j reads its own token and its parent's head output (the root's: the entry's output at the last verified row);
- its position is the root's plus its depth, its KV slot the root's plus j: M slots past the verified ones, which the
  scheduler reserves (`num_lookahead_tokens`, the most any level runs);
- it attends to the cached context, the root included, and to its ancestors within the block (`TokenTree.bits[j] >>
  1`: bit 0, the root, sits before the block).
The outputs at the depth-(d - 1) nodes give the depth-d children. Rerunning the shallower nodes at each depth
rewrites their KV from the same inputs, so every entry a node reads is its own ancestors', and no cached key needs a
mask. A chain written as a tree runs the chain's rows: node j at position and slot root + j, causally masked.

A dynamic tree (EAGLE-2, `DynamicEagleTree`; SGLang's `topk`, `num_draft_tokens`) grows each request's own tree by
cumulative draft probability (the product of the head's softmax along the path):
- depth 1: the root's top-k tokens, the first frontier;
- depth d >= 2: the head runs over the frontiers of depths 1..d-1 as one block (the static tree's rule: positions root
  + depth, slots root + 1 + block index, ancestor masks), the top-k children of each depth-(d - 1) frontier node are
  candidates, and the k best of those k^2 become the next frontier;
- the N best candidates of every depth (N = num_draft_tokens - 1) are the drafts, breadth-first. A child scores no
  more than its parent and ranks after it on a tie (a stable sort over candidates laid out depth-major), so the N
  best always include every kept node's parent: they form a tree. Candidates deeper than a request's chain budget are
  ranked last, so its real nodes are a prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from attention_zoo import CacheLayer, CommonAttentionMetadata
from research_lm.worker.rng import to_device
from research_lm.worker.spec import Drafts
from research_lm.worker.token_tree import DynamicTree, TokenTree, tree_tables
from spec_decode.heads import draft_metadata

# The head's forward over (ids [T], positions [T], metadata, features [T, H]) -> (output, next feature), each [T, H];
# and its logits over the target vocabulary, [n, H] -> [n, >= vocab] fp32.
HeadForward = Callable[[torch.Tensor, torch.Tensor, dict[str, Any], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
HeadLogits = Callable[[torch.Tensor], torch.Tensor]
# A level's block of m nodes per request: (their tokens [n, m], their parents' features [n, m, H], their depths and
# ancestor masks within the block [n, m]) -> the head's (output, next feature) at them, each [n, m, H] (eagerly:
# `run_block` over the step; in a graph: spec_decode/tree_graphs.py).
Block = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Level:
    """The nodes of one depth and where their tokens come from."""

    columns: slice  # their draft columns (node j is column j - 1)
    parents: torch.Tensor  # [P] int64: their distinct parents' node indices (0 = the root)
    parent_of: torch.Tensor  # [len] int64: each node's parent, as an index into `parents`
    ranks: torch.Tensor  # [len] int64: each node's rank among its siblings
    width: int  # the top-k the parents' logits need: the highest rank + 1


def _levels(tree: TokenTree, device: torch.device) -> list[_Level]:  # depth 1 .. tree.depth
    levels = []
    for depth in range(1, tree.depth + 1):
        nodes = [j for j in range(1, tree.num_drafts + 1) if tree.depths[j] == depth]  # contiguous: breadth-first
        parents = sorted({tree.parents[j] for j in nodes})
        levels.append(_Level(
            columns=slice(nodes[0] - 1, nodes[-1]),
            parents=torch.tensor(parents, dtype=torch.int64, device=device),
            parent_of=torch.tensor([parents.index(tree.parents[j]) for j in nodes], dtype=torch.int64, device=device),
            ranks=torch.tensor([tree.ranks[j] for j in nodes], dtype=torch.int64, device=device),
            width=max(tree.ranks[j] for j in nodes) + 1,
        ))
    return levels


class EagleTree:
    """Drafts a static token tree with an EAGLE / EAGLE-3 head, level by level (module docstring)."""

    def __init__(self, tree: TokenTree, forward: HeadForward, logits: HeadLogits, layers: Sequence[CacheLayer],
                 vocab_size: int, device: torch.device):
        self.tree = tree
        self.parents, self.depths, self.bits = (torch.tensor(t, dtype=torch.int64, device=device)
                                                for t in (tree.parents, tree.depths, tree.bits))  # [N + 1] each
        self.forward, self.logits, self.layers, self.vocab_size = forward, logits, layers, vocab_size
        self.levels = _levels(tree, device)
        self.real_nodes = tree.real_nodes  # [depth + 1]: real nodes under a chain budget of b drafts
        self.num_lookahead_tokens = self.real_nodes[tree.depth - 1]  # the nodes of depth < D: the largest block

    def draft(
        self,
        step: CommonAttentionMetadata,  # the target step's batch: block tables, block size
        rows: list[int],  # [n] each drafting request's row in the step
        budgets: Sequence[int],  # [n] the drafts each may emit as a chain (>= 1): its real nodes are within them
        root_positions: Sequence[int],  # [n] the position of its last verified row
        root_out: torch.Tensor,  # [n, H] the head's output at that row (what the logits read)
        root_carry: torch.Tensor,  # [n, H] and its next feature there (what the children read)
    ) -> Drafts:
        """The tree's nodes 1..N as each request's drafts, [n, N] int64, with its real node count."""
        tokens, _ = self.grow(root_out, root_carry, partial(run_block, self.forward, self.layers, step, rows,
                                                             root_positions))
        return Drafts(rows, tokens, self.real_counts(budgets))

    def real_counts(self, budgets: Sequence[int]) -> list[int]:
        return [self.real_nodes[b] for b in budgets]

    def block_sizes(self) -> list[int]:
        """The node counts of the blocks the levels run (nodes 1..M_d, those of depth < d, for d = 2 .. D)."""
        return list(self.real_nodes[1 : self.tree.depth])

    def grow(self, root_out: torch.Tensor, root_carry: torch.Tensor, block: Block,
             budget: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """Depth by depth from the roots' head outputs root_out and root_carry [n, H]: the tree's nodes 1..N, tokens
        [n, N] (node j in column j - 1), and no parents (the tree is static). `block` runs the head over nodes 1..M,
        those of depth < d. (budget: unused, `DynamicEagleTree.grow`'s.)"""
        n = root_out.shape[0]
        tokens = torch.zeros(n, self.tree.num_drafts, dtype=torch.int64, device=root_out.device)
        out, carry = root_out[:, None], root_carry[:, None]  # [n, 1 + M, H]: the root's, then nodes 1..M
        for depth, level in enumerate(self.levels, start=1):
            if depth > 1:
                m = self.real_nodes[depth - 1]
                nodes = slice(1, m + 1)  # the root, bit 0, is in the cached context
                block_out, block_carry = block(tokens[:, :m], carry[:, self.parents[nodes]],
                                               self.depths[nodes].expand(n, -1), (self.bits[nodes] >> 1).expand(n, -1))
                out = torch.cat([root_out[:, None], block_out], dim=1)
                carry = torch.cat([root_carry[:, None], block_carry], dim=1)
            parents = out[:, level.parents]  # [n, P, H]
            logits = self.logits(parents.flatten(0, 1))[:, : self.vocab_size].view(n, parents.shape[1], -1)
            top = logits.topk(level.width, dim=-1).indices  # [n, P, width]
            tokens[:, level.columns] = top[:, level.parent_of, level.ranks]
        return tokens, None


class DynamicEagleTree:
    """Drafts each request's own EAGLE-2 tree with an EAGLE / EAGLE-3 head (module docstring)."""

    def __init__(self, tree: DynamicTree, forward: HeadForward, logits: HeadLogits, layers: Sequence[CacheLayer],
                 vocab_size: int, device: torch.device):
        self.tree = tree
        self.forward, self.logits, self.layers, self.vocab_size = forward, logits, layers, vocab_size
        self.num_lookahead_tokens = tree.block  # the last depth's block: topk nodes per level above it
        k = tree.topk  # each candidate's depth, candidates laid out depth-major
        self.depth_of = torch.tensor([1] * k + [d for d in range(2, tree.depth + 1) for _ in range(k * k)],
                                     dtype=torch.int64, device=device)

    def draft(self, step: CommonAttentionMetadata, rows: list[int], budgets: Sequence[int],
              root_positions: Sequence[int], root_out: torch.Tensor, root_carry: torch.Tensor) -> Drafts:
        """Arguments as `EagleTree.draft`'s. Each request's N nodes as its drafts [n, N] int64, its real node count
        and its tree (`Drafts.tree_parents` [n, N + 1])."""
        budget = to_device(list(budgets), torch.int64, root_out.device)
        tokens, parents = self.grow(root_out, root_carry, partial(run_block, self.forward, self.layers, step, rows,
                                                                  root_positions), budget)
        return Drafts(rows, tokens, self.real_counts(budgets), tree_parents=parents)

    def real_counts(self, budgets: Sequence[int]) -> list[int]:
        return [self.tree.real_nodes(b) for b in budgets]

    def block_sizes(self) -> list[int]:
        """The node counts of the blocks the levels run: topk per level above the one drafted."""
        return [(d - 1) * self.tree.topk for d in range(2, self.tree.depth + 1)]

    def grow(self, root_out: torch.Tensor, root_carry: torch.Tensor, block: Block,
             budget: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's tree from the roots' head outputs root_out and root_carry [n, H], within its chain budget
        [n] int64: its nodes' tokens [n, N] and parents [n, N + 1] (column 0: -1). `block` runs the head over the
        frontiers of the depths above."""
        k, n, device = self.tree.topk, root_out.shape[0], root_out.device
        scores, tokens = self._top(root_out[:, None])  # [n, 1, k]: the root's children, the first frontier
        scores, tokens = scores.view(n, k), tokens.view(n, k)
        cand_scores, cand_tokens = [scores], [tokens]
        cand_parents = [torch.full((n, k), -1, dtype=torch.int64, device=device)]  # candidate index, -1 the root
        frontier = torch.arange(k, device=device).expand(n, k)  # candidate index of each frontier node
        block_tokens, block_parents = tokens, torch.full((n, k), -1, dtype=torch.int64, device=device)
        carry = root_carry[:, None]  # [n, 1 + M, H]: the root's, then the block's nodes
        for depth in range(2, self.tree.depth + 1):
            level = (depth - 2) * k  # the block index of the depth-(d - 1) frontier, the block's last k nodes
            features = carry[torch.arange(n, device=device)[:, None], block_parents + 1]  # [n, M, H]
            # the block as a tree under the root (node = block index + 1); the root, bit 0, is in the cached context
            depths, bits = tree_tables(torch.nn.functional.pad(block_parents + 1, (1, 0), value=-1))
            out, block_carry = block(block_tokens, features, depths[:, 1:], bits[:, 1:] >> 1)
            carry = torch.cat([root_carry[:, None], block_carry], dim=1)
            probs, child_tokens = self._top(out[:, level:])  # [n, k, k] each: row i, the children of frontier i
            child_scores = (scores[:, :, None] * probs).view(n, k * k)
            cand_scores.append(child_scores)
            cand_tokens.append(child_tokens.view(n, k * k))
            cand_parents.append(frontier.repeat_interleave(k, dim=1))
            best = child_scores.sort(dim=1, descending=True, stable=True).indices[:, :k]  # the next frontier
            base = k + (depth - 2) * k * k  # the first candidate index of this depth
            scores, tokens, frontier = child_scores.gather(1, best), cand_tokens[-1].gather(1, best), base + best
            block_tokens = torch.cat([block_tokens, tokens], dim=1)
            block_parents = torch.cat([block_parents, level + best // k], dim=1)
        return self._select(torch.cat(cand_scores, 1), torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1), budget)

    def _top(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n, m, H] -> [n, m, k] probs, tokens
        """The head's top-k tokens and their draft probabilities (softmax over the target vocabulary) at each node."""
        n, m, _ = out.shape
        logits = self.logits(out.flatten(0, 1))[:, : self.vocab_size].float()
        top = logits.softmax(dim=-1).topk(self.tree.topk, dim=-1)
        return top.values.view(n, m, -1), top.indices.view(n, m, -1)

    def _select(self, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                budget: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The N best candidates (scores, tokens, parents [n, C], laid out depth-major) as breadth-first trees:
        (tokens [n, N], parents [n, N + 1])."""
        n, num_candidates = scores.shape
        device = scores.device
        within = self.depth_of <= budget[:, None]  # [n, C]
        ranked = torch.where(within, scores, -1.0).sort(dim=1, descending=True, stable=True).indices
        chosen = ranked[:, : self.tree.num_drafts].sort(dim=1).values  # [n, N]: parents before children
        node_of = torch.zeros(n, num_candidates + 1, dtype=torch.int64, device=device)  # candidate + 1 -> node
        node_of.scatter_(1, chosen + 1, torch.arange(1, self.tree.num_drafts + 1, device=device).expand(n, -1))
        node_parents = node_of.gather(1, parents.gather(1, chosen) + 1)  # the root (-1) and unkept ones: 0
        tree_parents = torch.cat([torch.full((n, 1), -1, dtype=torch.int64, device=device), node_parents], dim=1)
        return tokens.gather(1, chosen), tree_parents


def run_block(forward: HeadForward, layers: Sequence[CacheLayer], step: CommonAttentionMetadata, rows: list[int],
              root_positions: Sequence[int], tokens: torch.Tensor, features: torch.Tensor, depths: torch.Tensor,
              bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over a block of M tree nodes per request, tokens [n, M] int64 with their parents' features [n, M, H],
    depths [n, M] and masks over the block [n, M] int64 (bit i: block node i; the root sits before the block, in the
    cached context). KV at slots root + 1 .. root + M. Returns the nodes' (output, next feature), each [n, M, H]."""
    n, m = tokens.shape
    roots = to_device(root_positions, torch.int64, tokens.device)
    positions = (roots[:, None] + depths).view(-1)
    _, metadata = draft_metadata(step, rows, [p + 1 for p in root_positions], [m] * n, layers, bits.reshape(-1))
    out, nxt = forward(tokens.reshape(-1), positions, metadata, features.flatten(0, 1))
    return out.view(n, m, -1), nxt.view(n, m, -1)
