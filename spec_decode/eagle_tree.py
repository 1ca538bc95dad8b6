"""Static token trees (vLLM's `speculative_token_tree`) drafted by an EAGLE or EAGLE-3 head, eagerly.

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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attention_zoo import CacheLayer, CommonAttentionMetadata
from research_lm.worker.spec import Drafts
from research_lm.worker.token_tree import TokenTree
from spec_decode.heads import draft_metadata

# The head's forward over (ids [T], positions [T], metadata, features [T, H]) -> (output, next feature), each [T, H];
# and its logits over the target vocabulary, [n, H] -> [n, >= vocab] fp32.
HeadForward = Callable[[torch.Tensor, torch.Tensor, dict[str, Any], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
HeadLogits = Callable[[torch.Tensor], torch.Tensor]


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
        self.nodes = tree.on(device)
        self.forward, self.logits, self.layers, self.vocab_size = forward, logits, layers, vocab_size
        self.levels = _levels(tree, device)
        self.real_nodes = self.nodes.within.tolist()  # [depth + 1]: real nodes under a chain budget of b drafts
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
        n = len(rows)
        tokens = torch.zeros(n, self.tree.num_drafts, dtype=torch.int64, device=root_out.device)
        out, carry = root_out[:, None], root_carry[:, None]  # [n, 1 + M, H]: the root's, then nodes 1..M
        for depth, level in enumerate(self.levels, start=1):
            if depth > 1:
                block_out, block_carry = self._run_block(step, rows, root_positions, tokens, carry,
                                                         self.real_nodes[depth - 1])
                out = torch.cat([root_out[:, None], block_out], dim=1)
                carry = torch.cat([root_carry[:, None], block_carry], dim=1)
            parents = out[:, level.parents]  # [n, P, H]
            logits = self.logits(parents.flatten(0, 1))[:, : self.vocab_size].view(n, parents.shape[1], -1)
            top = logits.topk(level.width, dim=-1).indices  # [n, P, width]
            tokens[:, level.columns] = top[:, level.parent_of, level.ranks]
        return Drafts(rows, tokens, [self.real_nodes[b] for b in budgets])

    def _run_block(self, step: CommonAttentionMetadata, rows: list[int], root_positions: Sequence[int],
                   tokens: torch.Tensor, carry: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over nodes 1..num_nodes of every request (tokens [n, N] int64 holds theirs); carry [n, 1 + M', H]
        their parents' features, the root's first (M' < num_nodes: the previous block's). Returns the nodes' (output,
        next feature), each [n, num_nodes, H]."""
        n, device = len(rows), tokens.device
        nodes = slice(1, num_nodes + 1)
        features = carry[:, self.nodes.parents[nodes]]  # [n, num_nodes, H]
        roots = torch.tensor(root_positions, dtype=torch.int64, device=device)
        positions = (roots[:, None] + self.nodes.depths[nodes]).view(-1)
        bits = (self.nodes.bits[nodes] >> 1).repeat(n)  # the root, bit 0, is in the cached context
        # KV at slots root + 1, + 2, ...; each block masked to its ancestors
        _, metadata = draft_metadata(step, rows, [p + 1 for p in root_positions], [num_nodes] * n, self.layers, bits)
        out, nxt = self.forward(tokens[:, : num_nodes].reshape(-1), positions, metadata, features.flatten(0, 1))
        return out.view(n, num_nodes, -1), nxt.view(n, num_nodes, -1)
