"""Suffix decoding (SuffixDecoding, Oliaro et al., NeurIPS 2025; vLLM's method "suffix", after Snowflake
ArcticInference): model-free drafts from suffix trees of bounded depth, with vLLM's four keys and defaults.

Each live request has a tree over its own prompt + output, extended by every token it emits (kept as the text itself,
see "Host cost" below); one global tree holds the
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

Host cost per step: a request's own tree is never built. Its text is searched instead (`OwnText`): the node of a
string is the set of positions it ends at, so an emitted token is a list append (a trie took max_tree_depth dict
lookups / node creations per token, and ~12 ms to build from a 2k-token prompt), and each step finds the ends of the
text's last 1 .. max_tree_depth - 1 tokens with one vectorized comparison of the windows ending at each occurrence of
its last token (~30 us at 1.4k tokens); the match lengths that end at the same positions share one path walk. The
global tree stays a trie (path-uncompressed: up to max_tree_depth nodes per token, children linked): max_tree_depth
dict lookups per token of each finished output, and per live request its match there (advanced token by token,
redone in full after the global tree changed), plus the path walks (a speculation tree's: a visit of every child of
each of its at most k nodes and a heap push per child kept). experiments/bench_suffix_host.py (tiny-llama's agentic
steps replayed on this CPU, k = 5, paths): 0.18 / 1.03 / 3.20 ms a step at batch 1 / 8 / 32, against the trie's
0.32 / 1.83 / 5.65 (1.8x; speculation trees 1.2-1.4x); at batch 32 ~0.9 ms of it is the global tree's appends of
finished outputs, ~0.7 ms `matches`.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable
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
    """Every substring of at most `max_depth` tokens of the sequences appended to it (the global tree), as a trie
    whose node for a string w counts the positions w starts at, and knows its most frequent child (ties: the smaller
    token); a sequence appended before can be removed again.

    Nodes are ints (0: the root, the empty string) indexing flat arrays; a child is found in one dict keyed by
    parent << 32 | token, and each node links its children, in no order (first_child, next_sibling; -1 ends), for
    the walks that visit them all: speculation trees, a best child's recount. A sequence is held by the caller as its
    suffix nodes (index m - 1: the node of its last m tokens, m <= max_depth), which `append` moves one token on:
    max_depth lookups per token, never a rebuild. Removed nodes are reused."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.children: dict[int, int] = {}
        self.count = array("q", [0])
        self.token = array("q", [-1])
        self.best = array("q", [_NONE])
        self.first_child = array("q", [-1])
        self.next_sibling = array("q", [-1])
        self._free: list[int] = []

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

    def speculation_tree(self, node: int, max_nodes: int, min_prob: float) -> tuple[list[int], list[int], float]:
        """`best_first` below `node`."""
        count, tok, first_child, next_sibling = self.count, self.token, self.first_child, self.next_sibling

        def children(at: int) -> list[tuple[int, int, int]]:
            out, child = [], first_child[at]
            while child >= 0:
                out.append((tok[child], count[child], child))
                child = next_sibling[child]
            return out

        return best_first(node, count[node], children, max_nodes, max_nodes, min_prob)

    def _new(self, parent: int, token: int) -> int:
        first_child = self.first_child
        if self._free:
            node = self._free.pop()
            self.count[node], self.token[node], self.best[node], first_child[node] = 0, token, _NONE, -1
            self.next_sibling[node] = first_child[parent]
        else:
            self.count.append(0)
            self.token.append(token)
            self.best.append(_NONE)
            first_child.append(-1)
            self.next_sibling.append(first_child[parent])
            node = len(first_child) - 1
        first_child[parent] = node
        return node

    def _unlink(self, parent: int, node: int) -> None:
        child = self.first_child[parent]
        if child == node:
            self.first_child[parent] = self.next_sibling[node]
            return
        while self.next_sibling[child] != node:
            child = self.next_sibling[child]
        self.next_sibling[child] = self.next_sibling[node]


def best_first(root: Any, root_count: int, children: Callable[[Any], list[tuple[int, int, Any]]], max_nodes: int,
               max_depth: int, min_prob: float) -> tuple[list[int], list[int], float]:
    """A speculation tree: up to `max_nodes` nodes below `root`, at most `max_depth` deep, best first: each step
    takes the most probable node not yet taken whose parent is `root` or taken (probability: the product of
    count(child) / count(parent) from `root`; ties: the shallower, then the smaller tokens from `root` down), while
    it is >= min_prob. `children(node)` lists a node's children as (token, count, node), in any order. Returns its
    tokens and parents in breadth-first order (by depth, then as taken): node j's (j >= 1) parent is parents[j - 1]
    < j, 0 being `root`; and the score, the sum of their probabilities. A probability never grows downwards, so this
    takes the max_nodes best of all nodes by (probability, depth, tokens)."""
    frontier: list[tuple[float, int, tuple[int, ...], int, Any, int]] = []  # (-prob, depth, tokens, count, node, pick)
    taken: list[tuple[int, int, int]] = []  # (depth, parent's pick, token); pick i is taken[i - 1]
    at, total, prob, depth, path, score = root, root_count, 1.0, 0, (), 0.0
    while len(taken) < max_nodes:
        if depth < max_depth:  # the newest taken node's children join the frontier
            for token, n, child in children(at):
                p = prob * (n / total)
                if p >= min_prob:
                    heapq.heappush(frontier, (-p, depth + 1, (*path, token), n, child, len(taken)))
        if not frontier:
            break
        neg_prob, depth, path, total, at, parent = heapq.heappop(frontier)
        prob = -neg_prob
        score += prob
        taken.append((depth, parent, path[-1]))
    order = sorted(range(1, len(taken) + 1), key=lambda i: taken[i - 1][0])  # stable: as taken within a depth
    index = [0] * (len(taken) + 1)  # pick -> its node number
    for j, pick in enumerate(order, start=1):
        index[pick] = j
    return [taken[i - 1][2] for i in order], [index[taken[i - 1][1]] for i in order], score


class OwnText:
    """A request's own prompt + output, searched directly instead of kept as a trie of its substrings: the trie node
    of a string w (at most max_depth tokens) is the set of positions w ends at, its count their number, its children
    the tokens that follow them (so best children, counts and probabilities are the trie's). An emitted token is a
    list append, not max_depth node lookups; `matches` finds the text's suffixes once a step, vectorized."""

    def __init__(self, tokens: list[int], max_depth: int) -> None:
        self.max_depth = max_depth
        self.tokens = list(tokens)
        # max_depth sentinels (-1, never a token) before the text: a window reaching past its start matches nothing
        self._array = np.full(max_depth + 2 * len(tokens) + 64, -1, dtype=np.int64)
        self._array[max_depth : max_depth + len(tokens)] = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        start = self.max_depth + len(self.tokens)
        if start + len(tokens) > len(self._array):
            self._array = np.r_[self._array[:start], np.full(start + 2 * len(tokens), -1, dtype=np.int64)]
        self._array[start : start + len(tokens)] = tokens
        self.tokens += tokens

    def matches(self) -> tuple[list[int], list[int]]:
        """The positions the text's last m tokens end at, for each m in 1 .. M = min(len, max_depth - 1): `ends`, the
        ends of its last token ordered by how many tokens before them match too, most first, and `num` [M + 1]: the
        last m tokens end at ends[: num[m]]."""
        length, depth, text = len(self.tokens), self.max_depth, self._array
        most = min(length, depth - 1)
        if most == 0:  # depth 1: no match length to draft from
            return [], [0]
        ends = np.flatnonzero(text[depth : depth + length] == self.tokens[-1])  # [E], positions in the text
        back = np.arange(most)
        window = text[depth + ends[:, None] - back]  # [E, M]: the tokens ending at each, newest first
        same = window == text[depth + length - 1 - back]
        matched = np.where(same.all(axis=1), most, same.argmin(axis=1))  # [E]: how many of the last tokens match
        order = np.argsort(-matched, kind="stable")
        num = np.cumsum(np.bincount(matched, minlength=most + 1)[::-1])[::-1]  # num[m]: how many match >= m
        return ends[order].tolist(), num.tolist()

    def path(self, ends: list[int], max_tokens: int, min_prob: float) -> tuple[list[int], list[float]]:
        """`SuffixTree.path` below the string ending at `ends`: its tokens, and the score of each prefix of them
        (scores[j]: of the first j, summed in order as `SuffixTree.path` sums)."""
        tokens, length = self.tokens, len(self.tokens)
        drafts: list[int] = []
        scores = [0.0]
        prob = 1.0
        while len(drafts) < max_tokens:
            follow = self._children(ends, tokens, length)
            if not follow:
                break
            token = min(follow, key=lambda t: (-len(follow[t]), t))  # the most frequent, then the smaller token
            prob *= len(follow[token]) / len(ends)
            if prob < min_prob:
                break
            drafts.append(token)
            scores.append(scores[-1] + prob)
            ends = follow[token]
        return drafts, scores

    def speculation_tree(self, ends: list[int], max_nodes: int, max_depth: int,
                         min_prob: float) -> tuple[list[int], list[int], float]:
        """`best_first` below the string ending at `ends`."""
        tokens, length = self.tokens, len(self.tokens)

        def children(at: list[int]) -> list[tuple[int, int, list[int]]]:
            return [(token, len(below), below) for token, below in self._children(at, tokens, length).items()]

        return best_first(ends, len(ends), children, max_nodes, max_depth, min_prob)

    @staticmethod
    def _children(ends: list[int], tokens: list[int], length: int) -> dict[int, list[int]]:
        """The children of the string ending at `ends`: token -> where the string extended by it ends."""
        follow: dict[int, list[int]] = {}
        for end in ends:
            if end + 1 < length:
                follow.setdefault(tokens[end + 1], []).append(end + 1)
        return follow


class FinishedOutputs:
    """The global tree: the outputs of the last `max_requests` finished requests, evicted first in, first out.
    `version` changes with every change of the tree (a live request's match in it is then redone)."""

    def __init__(self, max_depth: int, max_requests: int) -> None:
        self.tree = SuffixTree(max_depth)
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
    text: OwnText  # its prompt + output
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
        # per match length m: at most min(k, floor(m * factor)) drafts
        self._limits = [min(num_speculative_tokens, int(m * max_spec_factor + 1e-6)) for m in range(max_tree_depth)]

    def propose(self, outcome: StepOutcome) -> Drafts:
        # `emitted` is not yet appended to the requests; a request that emitted nothing (a prompt chunk short of the
        # end) gets no drafts.
        index, drafted = [], []
        for i, (req, emitted) in enumerate(zip(outcome.requests, outcome.emitted, strict=True)):
            if not emitted:
                continue
            live = self._live.get(req.request_id)
            if live is None or len(live.text) != req.num_known_tokens:  # first drafts (again, after a preemption)
                live = self._live[req.request_id] = _Live(req, OwnText(req.all_token_ids, self.max_tree_depth), [], -1)
            self._append(live, emitted)
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

    def _append(self, live: _Live, tokens: list[int]) -> None:
        live.text.extend(tokens)
        if live.version != self.finished.version:  # `_draft` matches anew
            return
        children = self.finished.tree.children
        for token in tokens:  # the global match moves on token by token
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
        finished, text, depth = self.finished, live.text, self.max_tree_depth
        if live.version != finished.version:
            tail = text.tokens[max(0, len(text) - depth + 1) :]  # the longest pattern matched in the global tree
            live.cached, live.version = finished.tree.match(tail), finished.version
        limits, min_prob = self._limits, self.min_token_prob
        best: tuple[list[int], list[int] | None] = ([], None if self.token_tree is None else [])
        best_score = 0.0
        ends, num = text.matches()
        low = list(range(len(num)))  # low[m]: the shortest match length whose ends are those of m
        for m in range(2, len(num)):
            if num[m] == num[m - 1]:
                low[m] = low[m - 1]
        walks: dict[int, tuple[list[int], list[float]]] = {}  # num[m] -> the path below those ends, shared by those m
        for m in range(len(num) - 1, 0, -1):  # own text, longest match first
            limit = limits[m]
            if limit <= best_score:  # its score is at most `limit`: it cannot win
                continue
            if self.token_tree is None:
                if num[m] not in walks:  # as long as any shorter m of these ends can take (the trie: depth - m)
                    walks[num[m]] = text.path(ends[: num[m]], min(limit, depth - low[m]), min_prob)
                tokens, scores = walks[num[m]]
                n = min(limit, depth - m, len(tokens))
                tokens, parents, score = tokens[:n], None, scores[n]
            else:
                tokens, parents, score = text.speculation_tree(ends[: num[m]], limit, depth - m, min_prob)
            if score > best_score:
                best, best_score = (tokens, parents), score
        for m in range(min(len(live.cached), depth - 1), 0, -1):  # the global tree, longest match first
            limit = limits[m]
            if limit <= best_score:
                continue
            node = live.cached[m - 1]
            if self.token_tree is None:
                (tokens, score), parents = finished.tree.path(node, limit, min_prob), None
            else:
                tokens, parents, score = finished.tree.speculation_tree(node, limit, min_prob)
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
