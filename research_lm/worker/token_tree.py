"""A static token tree of drafts (vLLM's `speculative_token_tree`), and what a verify step needs of it on the device.

vLLM's format lists every draft node as the path of child ranks from the root: `[(0,), (1,), (0, 0), (0, 1)]` is the
root's best and second-best child, then two children of the best. Node 0 is the root, the request's newest token (not a
draft); the drafts are nodes 1..N in breadth-first order (by depth, then by path), so a node's parent comes before it.
A verify step runs a request's N + 1 nodes as its query tokens, in that order, in consecutive KV slots:
- node j's position is the root's plus its depth (`positions`), not plus j;
- it attends to the context and to its ancestors only (`bits`: bit i set = it sees node i);
- after verification the accepted path's KV and hidden rows move to where plain decoding would have put them
  (depth d to slot d), so everything after the verification sees a chain.
A chain of k drafts is the tree `[(0,), (0, 0), ...]`: node j at depth j, every bit below it set.

A dynamic tree (EAGLE-2, SGLang's `topk` and `num_draft_tokens`; suffix decoding's speculation trees) has the same
layout, but each request drafts its own shape each step (`OwnTrees`): the runner keeps every request row's tables on
the device (`DeviceTree`), a static tree's in all rows, an own tree's written with its drafts (`Drafts.tree_parents`).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from attention_zoo import CommonAttentionMetadata
from research_lm.worker.rng import to_device

if TYPE_CHECKING:
    from research_lm.worker.sampler import SamplingBatch
    from research_lm.worker.step_inputs import StepInputs

MAX_NODES = 62  # + the root: a node's ancestor mask fits one int64 (bit 63 stays clear)


@dataclass(frozen=True)
class TokenTree:
    paths: tuple[tuple[int, ...], ...]  # the draft nodes 1..N, breadth-first

    @classmethod
    def parse(cls, value: str | Sequence[Sequence[int]]) -> TokenTree:
        """A tree from vLLM's `speculative_token_tree` (a list of rank tuples, or its string form); errors say what is
        wrong with which path."""
        if isinstance(value, str):
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError) as e:
                raise ValueError(f"speculative_token_tree={value!r} is not a list of tuples of child ranks") from e
        if not isinstance(value, Sequence) or not value:
            raise ValueError(f"speculative_token_tree must be a non-empty list of tuples of child ranks, got {value!r}")
        paths = []
        for path in value:
            if (not isinstance(path, Sequence) or isinstance(path, str) or not path
                    or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
                raise ValueError(f"speculative_token_tree: {path!r} is not a non-empty tuple of child ranks >= 0")
            paths.append(tuple(path))
        if len(paths) > MAX_NODES:
            raise ValueError(f"speculative_token_tree has {len(paths)} nodes; at most {MAX_NODES} are supported")
        if len(set(paths)) != len(paths):
            raise ValueError("speculative_token_tree lists a path twice")
        known = set(paths)
        for path in paths:
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"speculative_token_tree: {path} has no parent {path[:-1]} in the tree")
            if path[-1] > 0 and (*path[:-1], path[-1] - 1) not in known:
                raise ValueError(f"speculative_token_tree: {path} has no elder sibling {(*path[:-1], path[-1] - 1)}: "
                                 "a node's child ranks are 0, 1, ... in order")
        return cls(tuple(sorted(paths, key=lambda p: (len(p), p))))

    @classmethod
    def of_config(cls, speculative_config: dict) -> TokenTree | None:
        """The config's speculative_token_tree, or None; with a tree, num_speculative_tokens may be left out or be its
        node count (vLLM's meaning) or its depth, nothing else."""
        tree = speculative_config.get("speculative_token_tree")
        if tree is None:
            return None
        tree, k = cls.parse(tree), speculative_config.get("num_speculative_tokens")
        if k not in (None, tree.depth, tree.num_drafts):
            raise ValueError(f"num_speculative_tokens={k} is neither the node count {tree.num_drafts} (vLLM's meaning) "
                             f"nor the depth {tree.depth} of speculative_token_tree; leave it out with a tree")
        return tree

    @classmethod
    def chain(cls, k: int) -> TokenTree:
        return cls(tuple((0,) * d for d in range(1, k + 1)))

    @property
    def num_drafts(self) -> int:  # N
        return len(self.paths)

    @property
    def depth(self) -> int:  # the longest path: what one verify step can emit at most, less the bonus token
        return len(self.paths[-1])

    @cached_property
    def real_nodes(self) -> tuple[int, ...]:  # [depth + 1]: the nodes of depth <= b, a prefix of 1..N (breadth-first)
        return tuple(sum(d <= b for d in self.depths[1:]) for b in range(self.depth + 1))

    @property
    def is_chain(self) -> bool:
        return self == TokenTree.chain(self.num_drafts)

    @cached_property
    def parents(self) -> tuple[int, ...]:  # [N + 1]: node 0's is -1
        index = {path: j for j, path in enumerate(self.paths, start=1)}
        return (-1, *(index.get(path[:-1], 0) for path in self.paths))

    @cached_property
    def depths(self) -> tuple[int, ...]:  # [N + 1]
        return (0, *(len(path) for path in self.paths))

    @cached_property
    def ranks(self) -> tuple[int, ...]:  # [N + 1]: each node's rank among its siblings (the root's: 0)
        return (0, *(path[-1] for path in self.paths))

    @cached_property
    def bits(self) -> tuple[int, ...]:  # [N + 1]: node j's ancestors and itself, bit i = node i
        out = [1]
        for j, parent in enumerate(self.parents[1:], start=1):
            out.append(out[parent] | 1 << j)
        return tuple(out)


@dataclass(frozen=True)
class OwnTrees:
    """Trees each request drafts for itself, step by step: at most `num_drafts` nodes, at most `depth` deep. The
    proposer returns each request's shape with its drafts (`Drafts.tree_parents`)."""

    depth: int
    num_drafts: int  # N

    @property
    def placeholder(self) -> TokenTree:  # what a row holds before its first drafts: N children of the root
        return TokenTree(tuple((r,) for r in range(self.num_drafts)))


@dataclass(frozen=True)
class DynamicTree(OwnTrees):
    """EAGLE-2's dynamic tree, SGLang's meaning: `depth` levels (num_speculative_tokens) of the `topk` best children of
    the `topk` best nodes by cumulative draft probability, of which the `num_drafts` best (num_draft_tokens - 1: SGLang
    counts the root) are verified (spec_decode/eagle_tree.py)."""

    topk: int = 1

    @classmethod
    def of_config(cls, speculative_config: dict) -> DynamicTree | None:
        """The config's `topk` / `num_draft_tokens` tree, or None; errors name the field. topk = 1 is a chain (None
        here: the caller drafts num_speculative_tokens as a chain)."""
        topk, total = speculative_config.get("topk"), speculative_config.get("num_draft_tokens")
        if topk is None and total is None:
            return None
        if topk is None or total is None:
            raise ValueError(f"a dynamic token tree needs both topk and num_draft_tokens (got topk={topk}, "
                             f"num_draft_tokens={total})")
        if speculative_config.get("speculative_token_tree") is not None:
            raise ValueError("give either speculative_token_tree (a static tree) or topk/num_draft_tokens (a dynamic "
                             "one), not both")
        depth = speculative_config.get("num_speculative_tokens")
        if depth is None:
            raise ValueError("a dynamic token tree needs num_speculative_tokens: the tree's depth")
        if topk == 1:
            if total != depth + 1:
                raise ValueError(f"topk=1 drafts a chain of num_speculative_tokens={depth}: num_draft_tokens must be "
                                 f"{depth + 1} (the root and its drafts), got {total}")
            return None
        tree = cls(depth, total - 1, topk)
        candidates = topk + (depth - 1) * topk * topk
        if not 2 <= total <= min(MAX_NODES, candidates) + 1:
            raise ValueError(f"num_draft_tokens={total} must be in [2, {min(MAX_NODES, candidates) + 1}]: the root and "
                             f"at most {min(MAX_NODES, candidates)} of the {candidates} nodes topk={topk} drafts over "
                             f"depth {depth}")
        if tree.block > MAX_NODES:
            raise ValueError(f"topk={topk} at depth {depth} drafts {tree.block} nodes in its last level's block; at "
                             f"most {MAX_NODES} are supported")
        return tree

    @property
    def block(self) -> int:  # the nodes the head reruns at the last depth: topk per level above it
        return (self.depth - 1) * self.topk

    def real_nodes(self, budget: int) -> int:
        """Nodes among the N that lie within a chain budget of b >= 1 drafts: the selection ranks deeper ones last."""
        return min(self.num_drafts, self.topk + (budget - 1) * self.topk * self.topk)


TreeShape = TokenTree | OwnTrees


def tree_tables(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths, bits) [n, N + 1] int64 of trees given by parents [n, N + 1] int64 (parents[:, j] < j; column 0 -1),
    by pointer jumping: a handful of ops per doubling of the depth, not per node (each an eager launch)."""
    width = parents.shape[1]
    up = parents.clamp(min=0)  # the root points at itself
    depths = (parents >= 0).long()  # the edges from each node up to `up`
    bits = 1 << torch.arange(width, device=parents.device).expand_as(parents)  # the nodes from each up to `up`, excl.
    for _ in range((width - 1).bit_length()):  # 2^rounds >= the deepest path: every `up` reaches the root
        depths = depths + depths.gather(1, up)
        bits = bits | bits.gather(1, up)
        up = up.gather(1, up)
    return depths, bits | 1


class DeviceTree:
    """Every request row's tree on the device: what the input gather, the attention mask, verification and the
    path's compaction read. A static tree fills all rows once; a dynamic one's rows are written with their drafts."""

    def __init__(self, shape: TreeShape, num_rows: int, device: torch.device):
        self.num_drafts, self.depth = shape.num_drafts, shape.depth
        tree = shape if isinstance(shape, TokenTree) else shape.placeholder
        self.parents = torch.tensor(tree.parents, dtype=torch.int64, device=device).repeat(num_rows, 1)  # [rows, N+1]
        self.depths = torch.tensor(tree.depths, dtype=torch.int64, device=device).repeat(num_rows, 1)
        self.bits = torch.tensor(tree.bits, dtype=torch.int64, device=device).repeat(num_rows, 1)
        self.shifts, self.masks = _step_tables(self.depths, self.bits)  # [rows, N + 2] each

    def set_rows(self, rows: torch.Tensor, parents: torch.Tensor) -> None:
        """Rows [n] int64 take the trees parents [n, N + 1] int64 (their next verify step's)."""
        depths, bits = tree_tables(parents)
        self.parents[rows], self.depths[rows], self.bits[rows] = parents, depths, bits
        self.shifts[rows], self.masks[rows] = _step_tables(depths, bits)

    def of_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parents, depths, ancestor masks) [n, N + 1] of rows [n]: what verification reads."""
        return self.parents[rows], self.depths[rows], self.bits[rows]

    def write_step_inputs(self, positions: torch.Tensor, tree_bits: torch.Tensor, num_tokens: torch.Tensor,
                          common: CommonAttentionMetadata) -> None:
        """After the gather: each draft node's position becomes its root's plus its depth and its mask its ancestors'
        (tree_bits, -1 = causal for every other token). A draft sits at a row's token index num_tokens - 1 + j (j >=
        1: node j) in the step, so this reads only device tables: right ahead of an unverified step too.
        positions [>= T] int64, tree_bits [>= T] int64, num_tokens [R] int32 (the token table's counts)."""
        t = common.num_tokens
        pos = positions[:t]
        token = torch.arange(t, dtype=torch.int32, device=pos.device)
        row = common.request_rows[torch.searchsorted(common.query_start_loc[1:], token, right=True)]
        col = (pos - num_tokens[row]).clamp_(-1, self.num_drafts)  # node - 1; columns -1 and N: no draft
        pos.add_(self.shifts[row, col])
        tree_bits[:t] = self.masks[row, col]

    @staticmethod
    def moves(path: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What moves each request's accepted path to a chain's rows: row first + j takes row first + path[j].
        path [n, m] int64 (-1 after the path), first [n] int64 -> (src, dst), each [n * m]. Fixed shapes, no mask (a
        host sync): an entry off the path copies the root onto itself, one on it that stays (path[j] = j) copies its
        row onto itself, and no row is both a moved one's destination and another's (depth j's row takes only the
        path's node of depth j, whose index is >= j)."""
        node = path.clamp(min=0)
        j = torch.arange(path.shape[1], device=path.device)
        rows = first[:, None] + torch.stack([node, torch.minimum(node, j)])  # [2, n, m]
        return rows.view(2, -1).unbind()


class TreeSteps:
    """The runner's two token-tree hooks: before the forward, draft nodes get their depth's positions and their
    ancestors' mask; after verification, each request's accepted path moves to a chain's rows and KV slots."""

    def __init__(self, shape: TreeShape, target_layers: list, backends: list, max_num_tokens: int, num_rows: int,
                 device: torch.device):
        unable = [b.name for b in backends if not b.capabilities.token_trees]
        if unable:
            raise ValueError(f"a token tree needs attention that masks it; backend(s) {unable} cannot (torch_ref and "
                             "triton can)")
        if any(getattr(layer.spec, "sliding_window", None) for layer in target_layers):
            raise ValueError("a token tree does not combine with sliding-window attention")
        self.tree = DeviceTree(shape, num_rows, device)
        self.target_layers = target_layers
        self.bits = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)

    def replays_with_bits(self, graph_key: tuple[int, int] | None) -> bool:
        """Whether a step replays a verify graph, which reads `bits` whatever the step (DecodeGraphs tree_bits)."""
        return graph_key is not None and graph_key[1] == self.tree.num_drafts + 1

    def prepare(self, common: CommonAttentionMetadata, positions: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """A step that verifies drafts, or replays a verify graph: positions [>= T] rewritten in place (draft nodes
        only), `bits` written (-1, causal, for every other token) and common.tree_bits set."""
        self.tree.write_step_inputs(positions, self.bits, num_tokens, common)
        common.tree_bits = self.bits[: common.num_tokens]

    def compact(self, path: torch.Tensor, inputs: StepInputs, hidden: list[torch.Tensor], logits: torch.Tensor,
                batch: SamplingBatch | None) -> None:
        """After verification: path [n_s, m] of the step's sampling requests, whose node 0 sits at qsl[i + 1] - d_i
        - 1 of the step and at logits row sum of (d + 1) before it. hidden: [T, ...] tensors read after the step (the
        final and tapped hidden states); the logits [rows, V] move too where the batch reads logprobs from them."""
        qsl, drafts, sampling = inputs.common.query_start_loc_cpu.numpy(), inputs.drafts, inputs.sampling
        slot_mapping = inputs.common.slot_mapping
        logits = logits if batch is not None and batch.max_num_logprobs is not None else None
        d = drafts[sampling]
        first = qsl[1:][sampling] - d - 1
        if logits is not None:
            first = np.concatenate([first, np.cumsum(d + 1) - d - 1])
        first = to_device(torch.from_numpy(first), torch.int64, path.device)
        src, dst = self.tree.moves(path, first[: len(d)])
        for x in hidden:
            x.index_copy_(0, dst, x[src])
        if logits is not None:
            lsrc, ldst = self.tree.moves(path, first[len(d) :])
            logits.index_copy_(0, ldst, logits[lsrc])
        src_slots, dst_slots = slot_mapping[src], slot_mapping[dst]  # rows on a path or roots: real tokens, with slots
        for layer in self.target_layers:
            layer.backend.move_slots(layer.kv_cache, src_slots, dst_slots)


def _step_tables(depths: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `write_step_inputs` reads at column node - 1 of a row: (depth - node, the node's mask) for a draft node;
    columns N and N + 1 (-1), for every other token, (0, -1 = causal). depths, bits [n, N + 1] -> [n, N + 2] each."""
    nodes = torch.arange(1, depths.shape[1], device=depths.device)
    pad = torch.nn.functional.pad
    return pad(depths[:, 1:] - nodes, (0, 2)), pad(bits[:, 1:], (0, 2), value=-1)
