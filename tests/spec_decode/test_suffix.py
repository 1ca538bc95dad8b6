"""Suffix decoding (spec_decode/suffix.py).

Invariants:
- A tree counts every substring of at most max_depth tokens (its occurrences) and knows each node's most frequent
  child (ties: the smaller token); removing a sequence leaves the tree of the rest. A request's own text finds where
  its last m tokens end (the trie node it stands for).
- Drafts equal a brute-force reference: for every match length m of the request's last tokens in its own tree or the
  global one, the most-frequent-child path while its probability (count ratios) >= min_token_prob, at most
  min(k, floor(m * max_spec_factor)) tokens; the highest sum of probabilities wins (ties: own tree, longer match).
- The global tree holds the last max_cached_requests finished outputs (FIFO); preempted requests add nothing.
- Speculation trees (suffix_decoding_tree) equal a brute-force reference: the `limit` most probable strings below the
  match (ties: shallower, then smaller tokens) whose probability is >= min_token_prob, breadth-first; the best (tree,
  m) as for paths. Where every node has one child they are the path, token for token.
- Greedy suffix decoding, with paths or trees, is token-identical to plain greedy decoding under chunked prefill,
  preemption and prefix caching; seeded sampling is the same with async scheduling on or off and, without a global
  tree, whatever the batch around a request. A tree holding the path's drafts and their siblings accepts more.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from research_lm import LLM, SamplingParams
from research_lm.engine.request import Request, RequestStatus
from research_lm.worker.spec import Drafts, StepOutcome, check_speculative_config
from research_lm.worker.token_tree import OwnTrees
from spec_decode.suffix import OwnText, SuffixTree, build_proposer
from tests.engine.test_spec_greedy_identity import _repetitive_prompts

seqs = st.lists(st.integers(0, 3), min_size=0, max_size=30)


def canonical(tree: SuffixTree) -> dict[tuple[int, ...], tuple[int, int | None]]:
    """Every live node as (its string) -> (count, its best child's token)."""
    kids = defaultdict(list)
    for key, node in tree.children.items():
        kids[key >> 32].append((key & 0xFFFFFFFF, node))
    out, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        best = tree.best_child(node)
        out[path] = (tree.count[node], None if best < 0 else tree.token[best])
        stack += [(child, (*path, token)) for token, child in kids[node]]
    return out


def brute_force(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], tuple[int, int | None]]:
    count = defaultdict(int)
    count[()] = sum(len(s) for s in sequences)
    for s in sequences:
        for i in range(len(s)):
            for m in range(1, min(depth, len(s) - i) + 1):
                count[tuple(s[i : i + m])] += 1
    children = defaultdict(list)
    for w, n in count.items():
        if w:
            children[w[:-1]].append((-n, w[-1]))
    return {w: (n, min(children[w])[1] if children[w] else None) for w, n in count.items()}


@settings(max_examples=150, deadline=None)
@given(sequences=st.lists(seqs, min_size=1, max_size=3), depth=st.integers(1, 6))
def test_tree_counts_substrings_and_best_children(sequences, depth):
    tree = SuffixTree(depth)
    for i, s in enumerate(sequences):
        suffixes = tree.extend(s)
        so_far = brute_force(sequences[: i + 1], depth)
        assert [tree.count[n] for n in suffixes] == [so_far[tuple(s[len(s) - m :])][0]
                                                     for m in range(1, min(depth, len(s)) + 1)]
    assert canonical(tree) == brute_force(sequences, depth)


@settings(max_examples=150, deadline=None)
@given(text=st.lists(st.integers(0, 3), min_size=1, max_size=30), more=seqs, depth=st.integers(1, 6))
def test_own_text_finds_where_its_suffixes_end(text, more, depth):
    """The ends of the last m tokens (m < depth), each set a prefix of one list, however the text grew."""
    own = OwnText(text, depth)
    for token in more:
        own.extend([token])
        text = [*text, token]
    ends, num = own.matches()
    assert len(num) == min(len(text), depth - 1) + 1
    for m in range(1, len(num)):
        want = [e for e in range(m - 1, len(text)) if text[e - m + 1 : e + 1] == text[len(text) - m :]]
        assert sorted(ends[: num[m]]) == want


@settings(max_examples=150, deadline=None)
@given(sequences=st.lists(seqs, min_size=1, max_size=5), removed=st.lists(st.integers(0, 4), max_size=4),
       depth=st.integers(1, 5))
def test_removing_sequences_leaves_the_tree_of_the_rest(sequences, removed, depth):
    tree = SuffixTree(depth)
    for s in sequences:
        tree.extend(s)
    gone = sorted({i % len(sequences) for i in removed})
    for i in gone:
        tree.remove(sequences[i])
    rest = [s for i, s in enumerate(sequences) if i not in gone]
    assert canonical(tree) == brute_force(rest, depth)
    for s in sequences:  # freed nodes are reused and counted right
        tree.extend(s)
    assert canonical(tree) == brute_force(rest + sequences, depth)


def _request(request_id: str, tokens: list[int], finished: bool = False) -> Request:
    req = Request(request_id, list(tokens), SamplingParams(), seed=0)
    req.status = RequestStatus.FINISHED if finished else RequestStatus.RUNNING
    return req


def _outcome(requests: list[Request], emitted: list[list[int]]) -> StepOutcome:
    empty = torch.zeros(0, dtype=torch.int64)
    return StepOutcome(requests=requests, emitted=emitted, input_ids=empty, positions=empty,
                       query_start_loc_cpu=torch.zeros(len(requests) + 1, dtype=torch.int32), hidden_states=None,
                       aux_hidden_states=None, num_rejected=[0] * len(requests), common=None, tokens=None,
                       emitted_ids=None, num_emitted=None)


def _propose(proposer, requests: list[Request], emitted: list[list[int]]) -> dict[str, list[int]]:
    """The proposer's drafts per request id ([] for a request it did not draft for)."""
    drafts = proposer.propose(_outcome(requests, emitted))
    out = {r.request_id: [] for r in requests}
    for i, row, n in zip(drafts.index, drafts.token_ids.tolist(), drafts.num, strict=True):
        out[requests[i].request_id] = row[:n]
    return out


def _proposer(k: int, depth: int = 24, cached: int = 10000, factor: float = 1.0, min_prob: float = 0.1,
              tree: bool = False):
    return build_proposer({"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth": depth,
                           "suffix_decoding_max_cached_requests": cached, "suffix_decoding_max_spec_factor": factor,
                           "suffix_decoding_min_token_prob": min_prob, "suffix_decoding_tree": tree}, None)


def reference_drafts(own: list[int], cached: list[list[int]], depth: int, k: int, factor: float,
                     min_prob: float) -> list[int]:
    """Suffix decoding by brute force over the sequences themselves (no tree)."""
    best, best_score = [], 0.0
    for sources in ([own], cached):
        count = brute_force(sources, depth)
        for m in range(min(len(own), depth - 1), 0, -1):
            node = tuple(own[len(own) - m :])
            if node not in count:
                continue
            drafts, prob, score = [], 1.0, 0.0
            while len(drafts) < min(k, math.floor(m * factor + 1e-6)):
                token = count[node][1]
                if token is None:
                    break
                prob *= count[(*node, token)][0] / count[node][0]
                if prob < min_prob:
                    break
                drafts.append(token)
                score += prob
                node = (*node, token)
            if score > best_score:
                best, best_score = drafts, score
    return best


def reference_tree(sources: list[list[int]], match: tuple[int, ...], depth: int, limit: int,
                   min_prob: float) -> tuple[list[int], list[int], float]:
    """A speculation tree by brute force: of every string below `match` (the sources' substrings of at most `depth`
    tokens) with probability >= min_prob, the `limit` best by (-probability, depth, tokens), breadth-first; node j's
    parent (0: the match); the sum of their probabilities."""
    count = brute_force(sources, depth)
    below = []
    for w in count:
        if len(w) > len(match) and w[: len(match)] == match:
            prob = 1.0
            for i in range(len(match), len(w)):
                prob *= count[w[: i + 1]][0] / count[w[:i]][0]
            if prob >= min_prob:
                below.append((-prob, len(w) - len(match), w[len(match) :]))
    kept = sorted(below)[:limit]
    breadth_first = sorted(kept, key=lambda node: node[1])
    number = {(): 0} | {path: j for j, (_, _, path) in enumerate(breadth_first, start=1)}
    return ([path[-1] for _, _, path in breadth_first], [number[path[:-1]] for _, _, path in breadth_first],
            sum(-p for p, _, _ in kept))


def reference_tree_drafts(own: list[int], cached: list[list[int]], depth: int, k: int, factor: float,
                          min_prob: float) -> tuple[list[int], list[int]]:
    """`reference_drafts` with speculation trees: (tokens, parents) of the best-scoring (tree, m)."""
    best, best_score = ([], []), 0.0
    for sources in ([own], cached):
        count = brute_force(sources, depth)
        for m in range(min(len(own), depth - 1), 0, -1):
            match = tuple(own[len(own) - m :])
            if match not in count:
                continue
            tokens, parents, score = reference_tree(sources, match, depth, min(k, math.floor(m * factor + 1e-6)),
                                                    min_prob)
            if score > best_score:
                best, best_score = (tokens, parents), score
    return best


def test_speculation_tree_takes_nodes_best_first():
    """Below [1] in 1 2 5 1 2 6 1 3 7 1 2 5: 2 (3/4), 2 5 (1/2), then four at 1/4: 3, 2 6 and 3 7 (depth 2: the
    smaller tokens first), 2 5 1; nodes breadth-first, each parent before its children."""
    tree = SuffixTree(24)
    tree.extend([1, 2, 5, 1, 2, 6, 1, 3, 7, 1, 2, 5])
    node = tree.children[1]  # the root's child 1: key 0 << 32 | 1
    for limit, min_prob, want in [(5, 0.2, ([2, 3, 5, 6, 7], [0, 0, 1, 1, 2], 2.0)),
                                  (3, 0.2, ([2, 3, 5], [0, 0, 1], 1.5)),
                                  (5, 0.3, ([2, 5], [0, 1], 1.25)),
                                  (8, 0.0, ([2, 3, 5, 6, 7, 1, 1, 1], [0, 0, 1, 1, 2, 3, 4, 5], 2.75)),
                                  (0, 0.0, ([], [], 0.0))]:
        assert tree.speculation_tree(node, limit, min_prob) == want


@settings(max_examples=150, deadline=None)
@given(sequences=st.lists(seqs, min_size=1, max_size=4), removed=st.lists(st.integers(0, 3), max_size=2),
       depth=st.integers(1, 5), limit=st.integers(0, 8), min_prob=st.sampled_from([0.0, 0.1, 0.3]))
def test_speculation_trees_equal_the_brute_force_reference(sequences, removed, depth, limit, min_prob):
    """Below every string of a tree grown token by token, a global tree after removals (its children relinked and
    freed nodes reused), and a request's own text (the string's ends in it, the tree at most depth - |string| deep)."""
    extended, cached = SuffixTree(depth), SuffixTree(depth)
    for s in sequences:
        extended.extend(s)
        cached.extend(s)
    gone = {i % len(sequences) for i in removed}
    for i in sorted(gone):
        cached.remove(sequences[i])
    cached.extend(sequences[0])
    rest = [s for i, s in enumerate(sequences) if i not in gone] + sequences[:1]
    for tree, sources in ((extended, sequences), (cached, rest)):
        for match in brute_force(sources, depth):
            node = 0
            for token in match:
                node = tree.children[node << 32 | token]
            assert tree.speculation_tree(node, limit, min_prob) == reference_tree(sources, match, depth, limit,
                                                                                  min_prob)
    text = sequences[0]
    own = OwnText(text, depth)
    for match in filter(None, brute_force([text], depth)):  # the proposer matches one token at least
        ends = [e for e in range(len(match) - 1, len(text)) if text[e - len(match) + 1 : e + 1] == list(match)]
        assert own.speculation_tree(ends, limit, depth - len(match), min_prob) == reference_tree([text], match, depth,
                                                                                                 limit, min_prob)


def _drafts(proposer, requests: list[Request], emitted: list[list[int]]) -> dict[str, tuple[list[int], list[int]]]:
    """Per request id: its draft tokens and, from a tree proposer, node 1.. n's parents ([] for a path)."""
    drafts: Drafts = proposer.propose(_outcome(requests, emitted))
    out = {r.request_id: ([], []) for r in requests}
    parents = drafts.tree_parents.tolist() if drafts.tree_parents is not None else [None] * len(drafts.index)
    for i, row, n, up in zip(drafts.index, drafts.token_ids.tolist(), drafts.num, parents, strict=True):
        assert up is None or up[0] == -1 and not any(up[n + 1 :])  # nodes past n: parent 0
        out[requests[i].request_id] = (row[:n], [] if up is None else up[1 : n + 1])
    return out


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20), steps=st.lists(seqs, max_size=3),
       cached=st.lists(seqs, max_size=2), depth=st.integers(1, 6), k=st.integers(1, 6),
       factor=st.sampled_from([0.5, 1.0, 2.0]), min_prob=st.sampled_from([0.0, 0.1, 0.4]))
def test_tree_drafts_equal_the_brute_force_reference(prompt, steps, cached, depth, k, factor, min_prob):
    proposer = _proposer(k, depth, factor=factor, min_prob=min_prob, tree=True)
    assert proposer.token_tree == OwnTrees(k, k)
    req, outputs = _request("r", prompt), []
    for i, emitted in enumerate([[prompt[-1]], *[s for s in steps if s]]):
        if i < len(cached):
            proposer.finished.add(f"done{i}", cached[i])
            outputs.append(cached[i])
        drafts = _drafts(proposer, [req], [emitted])["r"]
        req.output_token_ids += emitted
        assert drafts == reference_tree_drafts(req.all_token_ids, [o for o in outputs if o], depth, k, factor,
                                               min_prob)


@settings(max_examples=100, deadline=None)
@given(successor=st.lists(st.integers(0, 5), min_size=6, max_size=6), starts=st.lists(st.integers(0, 5), min_size=2,
       max_size=2), prompt_len=st.integers(1, 15), output_len=st.integers(1, 20), finished_len=st.integers(1, 20),
       depth=st.integers(2, 8), k=st.integers(1, 6), factor=st.sampled_from([0.5, 1.0, 3.0]),
       min_prob=st.sampled_from([0.0, 0.1]))
def test_trees_with_one_child_per_node_are_the_path(successor, starts, prompt_len, output_len, finished_len, depth, k,
                                                    factor, min_prob):
    """Text where each token fixes the next (token t is followed by successor[t]) gives every node one child."""
    def text(start: int, n: int) -> list[int]:
        out = [start]
        while len(out) < n:
            out.append(successor[out[-1]])
        return out

    request = text(starts[0], prompt_len + output_len)
    proposers = [_proposer(k, depth, factor=factor, min_prob=min_prob, tree=tree) for tree in (False, True)]
    reqs = [_request("r", request[:prompt_len]) for _ in proposers]
    for proposer in proposers:
        proposer.finished.add("done", text(starts[1], finished_len))
    for token in request[prompt_len:]:
        (path, _), (tokens, parents) = (_drafts(p, [r], [[token]])["r"] for p, r in zip(proposers, reqs, strict=True))
        assert tokens == path and parents == list(range(len(path)))
        for r in reqs:
            r.output_token_ids.append(token)


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=25), steps=st.lists(seqs, max_size=3),
       cached=st.lists(seqs, max_size=3), depth=st.integers(1, 7), k=st.integers(1, 6),
       factor=st.sampled_from([0.5, 1.0, 2.0]), min_prob=st.sampled_from([0.0, 0.1, 0.4]))
def test_drafts_equal_the_brute_force_reference(prompt, steps, cached, depth, k, factor, min_prob):
    """The request emits one batch of tokens per step (its own tree and its global match move on incrementally);
    the global tree changes between steps (its match is redone)."""
    proposer = _proposer(k, depth, factor=factor, min_prob=min_prob)
    req, outputs = _request("r", prompt), []
    for i, emitted in enumerate([[prompt[-1]], *[s for s in steps if s]]):
        if i < len(cached):
            proposer.finished.add(f"done{i}", cached[i])
            outputs.append(cached[i])
        drafts = _propose(proposer, [req], [emitted])["r"]
        req.output_token_ids += emitted
        want = reference_drafts(req.all_token_ids, [o for o in outputs if o], depth, k, factor, min_prob)
        assert drafts == want


def test_spec_factor_scales_drafts_with_the_match_length():
    """With the emitted 3 the request ends in [1, 2, 3], seen once before: a 3-token match whose path
    probabilities are 1/2 each (the current occurrence counts too). floor(3 * factor) drafts, at most k."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    for k, factor, want in [(6, 1.0, [4, 5, 6]), (6, 0.5, [4]), (6, 4.0, [4, 5, 6, 7, 8, 9]), (2, 4.0, [4, 5]),
                            (6, 0.3, [])]:
        assert _propose(_proposer(k, factor=factor), [_request("a", prompt)], [[3]])["a"] == want


def test_min_token_prob_stops_the_path_where_continuations_split():
    """The request ends in [7, 8], seen 5 times (this one included): followed by 9 three times (probability 3/5),
    then 1, 2 or 3 once each (the smaller token: 3/5 * 1/3 = 0.2), then by one continuation (0.2 stays)."""
    prompt = [7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 9, 3, 7, 8, 5, 4, 7]
    for min_prob, want in [(0.1, [9, 1, 7, 8]), (0.19, [9, 1, 7, 8]), (0.21, [9]), (0.7, [])]:
        proposer = _proposer(4, factor=2.0, min_prob=min_prob)
        assert _propose(proposer, [_request("a", prompt)], [[8]])["a"] == want
        assert reference_drafts(prompt + [8], [], 24, 4, 2.0, min_prob) == want


def test_the_global_tree_keeps_the_last_finished_outputs_first_in_first_out():
    proposer = _proposer(4, cached=2)
    outputs = {"a": [10, 11, 12, 13, 14], "b": [20, 21, 22, 23, 24], "c": [30, 31, 32, 33, 34]}
    live = {r: _request(r, [1, 2]) for r in outputs}
    _propose(proposer, list(live.values()), [[3]] * 3)
    preempted = _request("p", [1, 2])
    _propose(proposer, [preempted], [[3]])
    for r, tokens in outputs.items():
        live[r].output_token_ids = [3, *tokens]
        live[r].status = RequestStatus.FINISHED
        proposer.on_requests_removed({r, "p"})
    assert list(proposer.finished.outputs) == ["b", "c"]  # a was evicted first; p was preempted, not finished
    assert canonical(proposer.finished.tree) == brute_force([[3, *outputs["b"]], [3, *outputs["c"]]], 24)
    new = [_request(r, [9, 9]) for r in ("x", "y", "z")]
    drafts = _propose(proposer, new, [[3, 10], [3, 20], [3, 30]])
    assert drafts == {"x": [], "y": [21, 22], "z": [31, 32]}  # two tokens matched: two drafts
    proposer.finished.add("c", [40, 41])  # an id again: its new output replaces the old one, at the back
    assert list(proposer.finished.outputs) == ["b", "c"]
    assert canonical(proposer.finished.tree) == brute_force([[3, *outputs["b"]], [40, 41]], 24)
    none = _proposer(4, cached=0)
    none.finished.add("a", [1, 2, 3])
    assert not none.finished.outputs and len(none.finished.tree) == 1


def test_config_defaults_and_errors():
    proposer = build_proposer({"method": "suffix"}, None)  # vLLM's defaults; k defaults to the tree depth
    assert (proposer.num_speculative_tokens, proposer.max_tree_depth, proposer.finished.max_requests,
            proposer.max_spec_factor, proposer.min_token_prob) == (24, 24, 10000, 1.0, 0.1)
    for key, value, why in [("suffix_decoding_max_spec_factor", -1.0, "must be >= 0"),
                            ("suffix_decoding_min_token_prob", 1.5, r"must be in \[0, 1\]"),
                            ("suffix_decoding_max_tree_depth", 0, "must be a positive integer"),
                            ("suffix_decoding_max_cached_requests", -1, "must be a non-negative integer")]:
        with pytest.raises(ValueError, match=rf"speculative_config\['{key}'\] {why}"):
            build_proposer(check_speculative_config({"method": "suffix", key: value}), None)
    with pytest.raises(ValueError, match=r"unknown speculative_config key\(s\) \['suffix_decoding_depth'\]"):
        check_speculative_config({"method": "suffix", "suffix_decoding_depth": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        build_proposer({"method": "suffix", "num_speculative_tokens": 0}, None)
    assert proposer.token_tree is None  # a path, vLLM's behaviour, unless suffix_decoding_tree
    assert build_proposer({"method": "suffix", "suffix_decoding_tree": True}, None).token_tree == OwnTrees(24, 24)
    with pytest.raises(ValueError, match=r"speculative_config\['suffix_decoding_tree'\] must be True or False"):
        check_speculative_config({"method": "suffix", "suffix_decoding_tree": 1})
    with pytest.raises(ValueError, match="num_speculative_tokens .* must be <= 62, got 63"):
        build_proposer({"method": "suffix", "suffix_decoding_tree": True, "suffix_decoding_max_tree_depth": 63}, None)


# ---- the engine ----------------------------------------------------------------------------------

KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
             num_gpu_blocks=24, max_model_len=64)
SPEC = {"method": "suffix", "num_speculative_tokens": 3}


TREES = {"suffix_decoding_tree": True}
TREE_KNOBS = KNOBS | dict(attention_backend="torch_ref")  # attention that masks a token tree


@pytest.mark.parametrize("trees", [False, True], ids=["path", "tree"])
def test_greedy_identical_under_chunked_prefill_preemption_and_prefix_caching(tiny_checkpoint, trees):
    path = str(tiny_checkpoint("llama"))
    knobs = TREE_KNOBS if trees else KNOBS
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = LLM(path, **knobs)
    prompts = _repetitive_prompts(base.engine.info.vocab_size)
    prompts += [prompts[0], prompts[3]]  # repeats: prefix-cache hits, and the global tree drafts from their outputs
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    bushy = {"suffix_decoding_max_spec_factor": 4.0}  # a 1-token match drafts up to k nodes: ~1 in 10 trees branch
    spec = LLM(path, **knobs, speculative_config=SPEC | TREES | bushy if trees else SPEC)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)
    assert spec.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert spec.engine.kv_cache.num_free_blocks == spec.engine.num_blocks - 1
    # The same prompts again: their earlier outputs (now in the global tree) draft, and more is accepted.
    again = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    assert sum(o.metrics.num_accepted_tokens for o in again) > accepted


def test_seeded_sampling_is_the_same_with_async_scheduling_and_whatever_the_batch(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    knobs = KNOBS | dict(num_gpu_blocks=64, enable_prefix_caching=True)
    prompts = _repetitive_prompts(LLM(path, **knobs).engine.info.vocab_size)
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    sync = LLM(path, **knobs, speculative_config=SPEC).generate(prompts, params, use_tqdm=False)
    got = LLM(path, **knobs, async_scheduling=True, speculative_config=SPEC).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in sync]
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    # Without a global tree a request drafts from itself alone: its seeded tokens do not depend on the others.
    alone = {**SPEC, "suffix_decoding_max_cached_requests": 0}
    llm = LLM(path, **knobs, speculative_config=alone)
    batch = llm.generate(prompts, params, use_tqdm=False)
    for i in random.Random(0).sample(range(len(prompts)), 3):
        one = llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0]
        assert one.outputs[0].token_ids == batch[i].outputs[0].token_ids


def test_a_tree_of_the_paths_siblings_accepts_more(tiny_checkpoint):
    """Depth 2 matches one token and drafts its successors seen so far: the path the most frequent one, the tree (k,
    factor 4) up to 4 of them, that one first. Each verification accepts at most one draft, so a request's accepted
    drafts are the most non-adjacent positions found by scanning the positions a draft hits; the tree hits wherever
    the path does (the same text, no global tree), and more where the tiny model's greedy text revisits a token with
    another successor (its outputs branch: 158 is followed by 158, 212, 72 and 175 in the first)."""
    path = str(tiny_checkpoint("llama"))
    knobs = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=6, max_model_len=64,
                 attention_backend="torch_ref")  # no token budget or KV pressure: each request's drafts all verified
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = _repetitive_prompts(LLM(path, **knobs).engine.info.vocab_size)
    fan = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 2,
           "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 4.0}
    chain, tree = (LLM(path, **knobs, speculative_config=config).generate(prompts, params, use_tqdm=False)
                   for config in (fan, fan | TREES))
    assert [o.outputs[0].token_ids for o in tree] == [o.outputs[0].token_ids for o in chain]
    accepted = [[o.metrics.num_accepted_tokens for o in outs] for outs in (chain, tree)]
    assert all(t >= c for c, t in zip(*accepted, strict=True)) and sum(accepted[1]) > sum(accepted[0]), accepted


def test_seeded_sampling_with_trees_does_not_depend_on_the_batch(tiny_checkpoint):
    """Sampled requests (temperature 0.1: the tiny model's text repeats enough to accept) verify their trees by the
    multi-draft rule, greedy ones by the argmax rule, with async scheduling on or off; a request alone gets its tokens
    in the batch."""
    path = str(tiny_checkpoint("llama"))
    knobs = TREE_KNOBS | dict(num_gpu_blocks=64, enable_prefix_caching=True)
    prompts = _repetitive_prompts(LLM(path, **knobs).engine.info.vocab_size)
    params = [SamplingParams(temperature=0.1 if i % 2 else 0.0, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    spec = SPEC | TREES | {"num_speculative_tokens": 4, "suffix_decoding_max_cached_requests": 0,
                           "suffix_decoding_max_spec_factor": 4.0, "suffix_decoding_min_token_prob": 0.0}
    llm = LLM(path, **knobs, speculative_config=spec)
    batch = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in batch[1::2]) > 0
    for i in range(len(prompts)):
        one = llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0]
        assert one.outputs[0].token_ids == batch[i].outputs[0].token_ids
    got = LLM(path, **knobs, async_scheduling=True, speculative_config=spec).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in batch]
