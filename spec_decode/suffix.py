"""Suffix decoding (SuffixDecoding, Oliaro et al., NeurIPS 2025; vLLM's method "suffix", after Snowflake
ArcticInference): model-free drafts from suffix trees of bounded depth, with vLLM's four keys and defaults.

Each live request has a tree over its own prompt + output, extended by every token it emits; one global tree holds the
outputs of the last `suffix_decoding_max_cached_requests` finished requests (FIFO eviction; 0: no global tree). A tree
holds every substring of at most `suffix_decoding_max_tree_depth` tokens, each node counting its occurrences. Every
step, for each match length m (the request's last m tokens found in a tree, m < depth), the drafts follow the most
frequent child below the match, a token kept while its empirical probability (the product of count(child) /
count(parent) along the path) is >= `suffix_decoding_min_token_prob`, at most min(k, floor(m *
`suffix_decoding_max_spec_factor`)) of them. Of all (tree, m), the path with the highest score (the sum of its
probabilities: the expected number of accepted drafts) wins; ties go to the request's own tree, then to the longer
match. Drafts are that one path (a chain), vLLM's behaviour.

With `suffix_decoding_tree: true` (ArcticInference's `use_tree_spec`) each (tree, m) drafts a speculation tree
instead: best first below the match node, the most probable unexpanded node next (probability as above; ties: the
shallower, then the smaller tokens from the match down), while >= min_token_prob, at most min(k, floor(m x factor))
nodes; its score is again the sum of its nodes' probabilities, and the best (tree, m) wins by the same rules. Where
every node has one child this is the path. The runner verifies each request's tree in one target forward
(`OwnTrees`: nodes 1..N breadth-first, `Drafts.tree_parents`); k <= 62 then (a node's ancestor mask is one int64).

Host cost per step: `max_tree_depth` dict lookups per emitted token (own tree) and per live request (its match in
the global tree, redone in full only after the global tree changed), plus the path walks (a speculation tree's: a
visit of every child of each of its at most k nodes and a heap push per child kept); a request's own tree is built
once, from its prompt, when it first emits (vectorized: ~12 ms for 2k tokens on one core). Unlike ArcticInference's
path-compressed tree, every substring has a node: up to max_tree_depth nodes per token (a 2k-token code prompt: ~40k
nodes, ~4 MB). Speculation trees need each node's children linked (two arrays more: ~+30% append time on novel text),
which the global tree always keeps and a request's own tree keeps only then.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from research_lm.engine.request import Request
from research_lm.worker.rng import to_device
from research_lm.worker.spec import Drafts, DraftTarget, Proposer, StepOutcome, register_proposer
from research_lm.worker.token_tree import MAX_NODES, OwnTrees

_NONE = -1  # best child: the node has no children
_STALE = -2  # best child: a child's count went down; recounted from the children when next needed


class SuffixTree:
    """Every substring of at most `max_depth` tokens of the sequences appended to it, as a trie whose node for a
    string w counts the positions w starts at, and knows its most frequent child (ties: the smaller token).

    Nodes are ints (0: the root, the empty string) indexing flat arrays; a child is found in one dict keyed by
    parent << 32 | token. A sequence is held by the caller as its suffix nodes (index m - 1: the node of its last m
    tokens, m <= max_depth), which `append` moves one token on: max_depth lookups per token, never a rebuild."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.children: dict[int, int] = {}
        self.count = array("q", [0])
        self.token = array("q", [-1])
        self.best = array("q", [_NONE])

    def __len__(self) -> int:
        return len(self.count)

    def append(self, suffixes: list[int], token: int) -> list[int]:
        """A sequence with suffix nodes `suffixes`, extended by `token`: its new suffix nodes."""
        children, count, tok, best = self.children, self.count, self.token, self.best
        out = []
        for parent in (0, *suffixes[: self.max_depth - 1]):
            key = parent << 32 | token
            node = children.get(key)
            if node is None:
                node = children[key] = self._new(parent, token)
            n = count[node] = count[node] + 1
            b = best[parent]
            if b == _NONE or b >= 0 and (n > count[b] or n == count[b] and token < tok[b]):
                best[parent] = node
            out.append(node)
        count[0] += 1
        return out

    def extend(self, tokens: list[int], suffixes: list[int] = ()) -> list[int]:
        """`append` each token in turn."""
        suffixes = list(suffixes)
        for token in tokens:
            suffixes = self.append(suffixes, token)
        return suffixes

    def build(self, tokens: list[int]) -> list[int]:
        """`extend` an empty tree by `tokens`, vectorized (one np.unique per depth): the same nodes, counts and best
        children, numbered by depth."""
        assert len(self.count) == 1, "build fills an empty tree"
        seq = np.asarray(tokens, dtype=np.int64)  # [L]
        length = seq.shape[0]
        node = np.zeros(length, dtype=np.int64)  # per start i: the node of seq[i : i + m - 1], then of seq[i : i + m]
        keys, counts, suffixes, num_nodes = [], [], [], 1
        for m in range(1, min(self.max_depth, length) + 1):
            level, inverse, level_counts = np.unique(node[: length - m + 1] << 32 | seq[m - 1 :], return_inverse=True,
                                                     return_counts=True)
            node = num_nodes + inverse.reshape(-1)
            num_nodes += level.shape[0]
            keys.append(level)
            counts.append(level_counts)
            suffixes.append(int(node[-1]))  # start length - m: the last m tokens
        if not keys:
            return []
        key, count = np.concatenate(keys), np.concatenate(counts)  # node i + 1 is entry i
        parent, token = key >> 32, key & 0xFFFFFFFF
        order = np.lexsort((token, -count, parent))  # per parent: the most frequent child first, then the smaller token
        new_parent = np.r_[True, parent[order][1:] != parent[order][:-1]]
        first = order[new_parent]
        best = np.full(num_nodes, _NONE, dtype=np.int64)
        best[parent[first]] = first + 1
        self.children = dict(zip(key.tolist(), range(1, num_nodes)))
        self.count = array("q", np.r_[length, count].astype(np.int64).tobytes())
        self.token = array("q", np.r_[-1, token].astype(np.int64).tobytes())
        self.best = array("q", best.tobytes())
        self._link_built(order + 1, new_parent, best)
        return suffixes

    def match(self, tokens: list[int]) -> list[int]:
        """The nodes of the suffixes of `tokens` present in the tree, shortest first (each suffix of a present
        string is present too, so they stop at the first one missing)."""
        children, out = self.children, []
        for m in range(1, len(tokens) + 1):
            node = 0
            for token in tokens[len(tokens) - m :]:
                node = children.get(node << 32 | token, -1)
                if node < 0:
                    return out
            out.append(node)
        return out

    def best_child(self, node: int) -> int:
        return self.best[node]

    def path(self, node: int, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """Up to `max_tokens` tokens below `node` along the most frequent children, while the path's probability
        (product of count(child) / count(parent)) stays >= min_prob; and its score, the sum of those probabilities."""
        count, tok = self.count, self.token
        drafts: list[int] = []
        prob, score = 1.0, 0.0
        while len(drafts) < max_tokens:
            child = self.best_child(node)
            if child < 0:
                break
            prob *= count[child] / count[node]
            if prob < min_prob:
                break
            drafts.append(tok[child])
            score += prob
            node = child
        return drafts, score

    def _new(self, parent: int, token: int) -> int:
        self.count.append(0)
        self.token.append(token)
        self.best.append(_NONE)
        return len(self.count) - 1

    def _link_built(self, nodes: np.ndarray, first: np.ndarray, best: np.ndarray) -> None:
        """`build`'s hook: nodes [num_nodes - 1] int64 grouped by parent (first [num_nodes - 1] bool: a group's
        first, its parent's best child); best [num_nodes] int64. A plain tree keeps no child links."""


class LinkedSuffixTree(SuffixTree):
    """A `SuffixTree` whose nodes also link their children, in no order (first_child, next_sibling; -1 ends), for
    the walks that visit them all: speculation trees, a best child's recount. Two array appends more per new node,
    which a path-only proposer does not pay."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        self.first_child = array("q", [-1])
        self.next_sibling = array("q", [-1])

    def speculation_tree(self, node: int, max_nodes: int, min_prob: float) -> tuple[list[int], list[int], float]:
        """Up to `max_nodes` nodes below `node`, best first: each step takes the most probable node not yet taken
        whose parent is `node` or taken (probability: the product of count(child) / count(parent) from `node`;
        ties: the shallower, then the smaller tokens from `node` down), while it is >= min_prob. Returns its tokens
        and parents in breadth-first order (by depth, then as taken): node j's (j >= 1) parent is parents[j - 1] <
        j, 0 being `node`; and the score, the sum of their probabilities. A probability never grows downwards, so
        this takes the max_nodes best of all nodes by (probability, depth, tokens)."""
        count, tok, first_child, next_sibling = self.count, self.token, self.first_child, self.next_sibling
        frontier: list[tuple[float, int, tuple[int, ...], int, int]] = []  # (-prob, depth, tokens, node, parent's pick)
        taken: list[tuple[int, int, int]] = []  # (depth, parent's pick, token); pick i is taken[i - 1]
        at, prob, depth, path, score = node, 1.0, 0, (), 0.0
        while len(taken) < max_nodes:
            child, total = first_child[at], count[at]  # the newest taken node's children join the frontier
            while child >= 0:
                p = prob * (count[child] / total)
                if p >= min_prob:
                    heapq.heappush(frontier, (-p, depth + 1, (*path, tok[child]), child, len(taken)))
                child = next_sibling[child]
            if not frontier:
                break
            neg_prob, depth, path, at, parent = heapq.heappop(frontier)
            prob = -neg_prob
            score += prob
            taken.append((depth, parent, path[-1]))
        order = sorted(range(1, len(taken) + 1), key=lambda i: taken[i - 1][0])  # stable: as taken within a depth
        index = [0] * (len(taken) + 1)  # pick -> its node number
        for j, pick in enumerate(order, start=1):
            index[pick] = j
        return [taken[i - 1][2] for i in order], [index[taken[i - 1][1]] for i in order], score

    def _new(self, parent: int, token: int) -> int:
        self.count.append(0)  # SuffixTree._new's, inline: a new node is most of `append`'s cost
        self.token.append(token)
        self.best.append(_NONE)
        first_child = self.first_child
        first_child.append(-1)
        self.next_sibling.append(first_child[parent])
        node = first_child[parent] = len(first_child) - 1
        return node

    def _link_built(self, nodes: np.ndarray, first: np.ndarray, best: np.ndarray) -> None:
        next_sibling = np.full(len(best), -1, dtype=np.int64)  # each group linked in its order
        next_sibling[nodes[:-1]] = np.where(first[1:], -1, nodes[1:])
        self.first_child = array("q", best.tobytes())  # a group's first is its parent's best child (_NONE: -1)
        self.next_sibling = array("q", next_sibling.tobytes())


class CachedOutputsTree(LinkedSuffixTree):
    """A `LinkedSuffixTree` whose sequences can also be removed (the global tree): a best child whose count went down is
    recounted from the linked children, and removed nodes are reused."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        self._free: list[int] = []

    def remove(self, tokens: list[int]) -> None:
        """Take out one occurrence of a sequence appended before: its substrings' counts go down, nodes left at 0
        go, and a parent whose best child lost a count recounts it when next asked."""
        children, count, best = self.children, self.count, self.best
        dead: list[tuple[int, int]] = []  # (parent, node) at count 0, dropped once every count is down
        suffixes: list[int] = []
        for token in tokens:
            out = []
            for parent in (0, *suffixes[: self.max_depth - 1]):
                node = children[parent << 32 | token]
                count[node] -= 1
                if best[parent] == node:
                    best[parent] = _STALE
                if count[node] == 0:
                    dead.append((parent, node))
                out.append(node)
            count[0] -= 1
            suffixes = out
        for parent, node in dead:
            del children[parent << 32 | self.token[node]]
            if parent == 0 or count[parent] > 0:
                self._unlink(parent, node)
            self._free.append(node)

    def best_child(self, node: int) -> int:
        b = self.best[node]
        if b != _STALE:
            return b
        count, tok = self.count, self.token
        child, b = self.first_child[node], _NONE
        while child >= 0:
            if b < 0 or count[child] > count[b] or count[child] == count[b] and tok[child] < tok[b]:
                b = child
            child = self.next_sibling[child]
        self.best[node] = b
        return b

    def _new(self, parent: int, token: int) -> int:
        if not self._free:
            return super()._new(parent, token)
        node = self._free.pop()
        self.count[node], self.token[node], self.best[node], self.first_child[node] = 0, token, _NONE, -1
        self.next_sibling[node] = self.first_child[parent]
        self.first_child[parent] = node
        return node

    def _unlink(self, parent: int, node: int) -> None:
        child = self.first_child[parent]
        if child == node:
            self.first_child[parent] = self.next_sibling[node]
            return
        while self.next_sibling[child] != node:
            child = self.next_sibling[child]
        self.next_sibling[child] = self.next_sibling[node]


class FinishedOutputs:
    """The global tree: the outputs of the last `max_requests` finished requests, evicted first in, first out.
    `version` changes with every change of the tree (a live request's match in it is then redone)."""

    def __init__(self, max_depth: int, max_requests: int) -> None:
        self.tree = CachedOutputsTree(max_depth)
        self.max_requests = max_requests
        self.outputs: OrderedDict[str, list[int]] = OrderedDict()
        self.version = 0

    def add(self, request_id: str, tokens: list[int]) -> None:
        if self.max_requests == 0 or not tokens:
            return
        if request_id in self.outputs:  # an id used again: its newer output replaces the older
            self.tree.remove(self.outputs.pop(request_id))
        self.outputs[request_id] = tokens
        self.tree.extend(tokens)
        while len(self.outputs) > self.max_requests:
            self.tree.remove(self.outputs.popitem(last=False)[1])
        self.version += 1


@dataclass
class _Live:
    """A live request's drafting state."""

    request: Request
    tree: SuffixTree  # its prompt + output
    suffixes: list[int]  # its nodes there: index m - 1 holds its last m tokens
    tail: list[int]  # its last max_depth - 1 tokens: the longest pattern matched in the global tree
    num_tokens: int  # tokens in `tree`
    cached: list[int]  # the global tree's nodes of its last 1 .. M tokens, as of `version`
    version: int


class SuffixProposer(Proposer):
    """The `Proposer` for suffix decoding: needs no hidden states or q (see the module docstring). With
    `speculation_trees` each request drafts its own token tree (`token_tree` = OwnTrees(k, k)), else a path."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int, max_cached_requests: int,
                 max_spec_factor: float, min_token_prob: float, speculation_trees: bool = False) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.token_tree = OwnTrees(num_speculative_tokens, num_speculative_tokens) if speculation_trees else None
        self.finished = FinishedOutputs(max_tree_depth, max_cached_requests)
        self._live: dict[str, _Live] = {}

    def propose(self, outcome: StepOutcome) -> Drafts:
        # `emitted` is not yet appended to the requests; a request that emitted nothing (a prompt chunk short of the
        # end) gets no drafts.
        index, drafted = [], []
        for i, (req, emitted) in enumerate(zip(outcome.requests, outcome.emitted, strict=True)):
            if not emitted:
                continue
            live = self._live.get(req.request_id)
            if live is None or live.num_tokens != req.num_known_tokens:  # first drafts (again, after a preemption)
                live = self._live[req.request_id] = self._start(req)
            for token in emitted:
                self._append(live, token)
            index.append(i)
            drafted.append(self._draft(live))
        k, device = self.num_speculative_tokens, outcome.input_ids.device
        if self.token_tree is None:
            return Drafts.from_lists(index, [tokens for tokens, _ in drafted], k, device)
        return tree_drafts(index, drafted, k, device)

    def on_requests_removed(self, req_ids: set[str]) -> None:
        """A finished request's output goes to the global tree (a preempted one's comes back when it finishes)."""
        for req_id in req_ids:
            live = self._live.pop(req_id, None)
            if live is not None and live.request.is_finished and live.request.finish_reason != "error":
                self.finished.add(req_id, list(live.request.output_token_ids))

    def _start(self, req: Request) -> _Live:
        tokens = req.all_token_ids
        tree = SuffixTree(self.max_tree_depth) if self.token_tree is None else LinkedSuffixTree(self.max_tree_depth)
        tail = tokens[max(0, len(tokens) - self.max_tree_depth + 1) :]
        return _Live(req, tree, tree.build(tokens), tail, len(tokens), [], -1)

    def _append(self, live: _Live, token: int) -> None:
        live.suffixes = live.tree.append(live.suffixes, token)
        live.num_tokens += 1
        live.tail.append(token)
        del live.tail[: max(0, len(live.tail) - self.max_tree_depth + 1)]
        if live.version == self.finished.version:  # one token on in the global tree too (else `_draft` matches anew)
            children = self.finished.tree.children
            cached = []
            for parent in (0, *live.cached[: self.max_tree_depth - 2]):
                node = children.get(parent << 32 | token, -1)
                if node < 0:
                    break
                cached.append(node)
            live.cached = cached

    def _draft(self, live: _Live) -> tuple[list[int], list[int] | None]:
        """The best-scoring drafts over every (tree, match length): tokens, and a speculation tree's parents (node j's
        is parents[j - 1]; 0: the request's newest token) or None for a path."""
        finished = self.finished
        if live.version != finished.version:
            live.cached, live.version = finished.tree.match(live.tail), finished.version
        k, factor, min_prob = self.num_speculative_tokens, self.max_spec_factor, self.min_token_prob
        best: tuple[list[int], list[int] | None] = ([], None if self.token_tree is None else [])
        best_score = 0.0
        for tree, nodes in ((live.tree, live.suffixes), (finished.tree, live.cached)):
            for m in range(min(len(nodes), self.max_tree_depth - 1), 0, -1):  # longest match first
                limit = min(k, int(m * factor + 1e-6))
                if limit <= best_score:  # its score is at most `limit`: it cannot win
                    continue
                if self.token_tree is None:
                    tokens, score = tree.path(nodes[m - 1], limit, min_prob)
                    parents = None
                else:
                    tokens, parents, score = tree.speculation_tree(nodes[m - 1], limit, min_prob)
                if score > best_score:
                    best, best_score = (tokens, parents), score
        return best


def tree_drafts(index: list[int], trees: list[tuple[list[int], list[int]]], k: int, device: torch.device) -> Drafts:
    """Drafts of speculation trees (`index[i]` drafted trees[i] = (tokens, parents), nodes 1..n_i <= k breadth-first):
    token_ids [len(index), k] int64 and tree_parents [len(index), k + 1] int64 on `device`, padded with token 0 and
    parent 0 (column 0: -1, the root)."""
    tokens = np.zeros((len(index), k), dtype=np.int64)
    parents = np.zeros((len(index), k + 1), dtype=np.int64)
    parents[:, 0] = -1
    for i, (ids, up) in enumerate(trees):
        tokens[i, : len(ids)] = ids
        parents[i, 1 : len(up) + 1] = up
    return Drafts(index, to_device(torch.from_numpy(tokens), torch.int64, device), [len(ids) for ids, _ in trees],
                  tree_parents=to_device(torch.from_numpy(parents), torch.int64, device))


_DEFAULTS = {  # vLLM's SpeculativeConfig defaults
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}


@register_proposer("suffix", suffix_decoding_max_tree_depth="posint?", suffix_decoding_max_cached_requests="count?",
                   suffix_decoding_max_spec_factor="number?", suffix_decoding_min_token_prob="number?",
                   suffix_decoding_tree="bool?")
def build_proposer(speculative_config: dict[str, Any], target: DraftTarget) -> SuffixProposer:
    """vLLM's keys and defaults; num_speculative_tokens defaults to the tree depth (the most a path can hold).
    `suffix_decoding_tree` (ours, default False) drafts speculation trees."""
    value = {key: default if speculative_config.get(key) is None else speculative_config[key]
             for key, default in _DEFAULTS.items()}
    depth, factor, min_prob = (value[f"suffix_decoding_{k}"] for k in ("max_tree_depth", "max_spec_factor",
                                                                           "min_token_prob"))
    if factor < 0:
        raise ValueError(f"speculative_config['suffix_decoding_max_spec_factor'] must be >= 0, got {factor}")
    if not 0 <= min_prob <= 1:
        raise ValueError(f"speculative_config['suffix_decoding_min_token_prob'] must be in [0, 1], got {min_prob}")
    k = speculative_config.get("num_speculative_tokens")
    k = depth if k is None else int(k)
    if k < 1:  # as the other proposers: zero drafts is no speculation, i.e. no speculative_config
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    trees = bool(speculative_config.get("suffix_decoding_tree"))
    if trees and k > MAX_NODES:
        raise ValueError(f"suffix_decoding_tree verifies at most {MAX_NODES} draft nodes a step: "
                         f"num_speculative_tokens (or, left out, the tree depth) must be <= {MAX_NODES}, got {k}")
    return SuffixProposer(k, int(depth), int(value["suffix_decoding_max_cached_requests"]), float(factor),
                          float(min_prob), trees)
