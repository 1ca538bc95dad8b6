"""EAGLE-2 dynamic token trees (`topk`, `num_draft_tokens`; token_tree.DynamicTree, eagle_tree.DynamicEagleTree).

Invariants:
- Greedy dynamic-tree decoding is token-identical to plain greedy under chunked prefill, preemption and prefix caching
  (the shipped EAGLE-3 pair), and each request's tree reaches the runner's per-row tables (deep paths are accepted).
- Each EAGLE-1 tree is the one EAGLE-2's rule picks, recomputed from scratch by a plain-torch head on the context:
  the top-k children of the top-k frontier at each depth by cumulative draft probability, then the N best nodes.
- topk = 1 is the chain: the chain proposer's exact tokens and counts, on its fast path (no tree).
- Seeded sampled requests do not depend on the batch; bad configs name the field.
"""

from __future__ import annotations

import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.worker.token_tree import DynamicTree, tree_tables
from tests.spec_decode.spying import context
from tests.spec_decode.test_eagle import target_features
from tests.spec_decode.test_eagle_tree import (
    CASES,
    GREEDY,
    KNOBS,
    SHIPPED,
    TEXTS,
    WHOLE_TREES,
    _check_case,
    _eagle1_logits,
    _random_prompts,
    _tokens,
)
from tests.spec_decode.test_spec_formats import V, eagle1_tensors, write_eagle1

DYNAMIC = {"num_speculative_tokens": 4, "topk": 3, "num_draft_tokens": 10}


@pytest.mark.parametrize("case", CASES)
def test_shipped_eagle3_dynamic_tree_is_plain_greedy(case):
    knobs = KNOBS | CASES[case]
    want = _tokens(LLM("tiny-llama", **knobs).generate(TEXTS, GREEDY, use_tqdm=False))
    llm = LLM("tiny-llama", **knobs, speculative_config={**SHIPPED, **DYNAMIC})
    proposer = llm.engine.runner.proposer
    assert (proposer.num_speculative_tokens, proposer.num_lookahead_tokens) == (9, 9)  # N; (depth - 1) x topk
    outs = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want
    _check_case(outs, case)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 100


def _record_trees(proposer) -> list[tuple[list[int], list[int], list[int], int]]:
    """(context, node tokens, node parents, real nodes) of every drafted tree."""
    records, propose = [], proposer.propose

    def spy(outcome):
        drafts = propose(outcome)
        for row, i in enumerate(drafts.index):
            records.append((context(outcome, i), drafts.token_ids[row].tolist(), drafts.tree_parents[row].tolist(),
                            drafts.num[row]))
        return drafts

    proposer.propose = spy
    return records


def _eagle2_paths(probs_after, tree: DynamicTree) -> set[tuple[int, ...]]:
    """EAGLE-2's selection from scratch: probs_after(path) [V] is the head's distribution after the draft path."""
    def children(score, path):
        top = probs_after(path).topk(tree.topk)
        return [(score * p, (*path, t)) for p, t in zip(top.values.tolist(), top.indices.tolist())]

    frontier = children(1.0, ())
    candidates = list(frontier)
    for _ in range(2, tree.depth + 1):
        level = [c for score, path in frontier for c in children(score, path)]
        candidates += level
        frontier = sorted(level, key=lambda c: -c[0])[: tree.topk]  # stable: the first of a tie
    return {path for _, path in sorted(candidates, key=lambda c: -c[0])[: tree.num_drafts]}


def _paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    paths = {0: ()}
    for j, token in enumerate(tokens, start=1):
        paths[j] = (*paths[parents[j]], token)
    return set(list(paths.values())[1:])


def test_eagle1_dynamic_tree_is_eagle2s_selection(tiny_checkpoint, hf_model, tmp_path):
    path, prompts = str(tiny_checkpoint("llama")), _random_prompts()
    spec = {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}
    want = _tokens(LLM(path, **KNOBS).generate(prompts, GREEDY, use_tqdm=False))
    tensors = eagle1_tensors(21)
    head = write_eagle1(tmp_path / "eagle", tensors)
    llm = LLM(path, **KNOBS, speculative_config={"method": "eagle", "model": str(head), **spec})
    records = _record_trees(llm.engine.runner.proposer)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    hf = hf_model("llama")
    w = {k: v.float() for k, v in tensors.items()}
    embed, lm_head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    tree = DynamicTree(depth=3, num_drafts=5, topk=2)
    full = [r for r in records if r[3] == tree.num_drafts]
    assert len(full) > 20
    same = 0
    for ctx, tokens, parents, _ in full[::2]:
        final, _ = target_features(hf, ctx[:-1], [])
        want_paths = _eagle2_paths(
            lambda p, ctx=ctx, final=final: _eagle1_logits(w, embed, lm_head, ctx, final, p)[:V].softmax(-1), tree)
        same += _paths(tokens, parents) == want_paths
    assert same >= 0.9 * len(full[::2]), (same, len(full[::2]))  # a near tie may rank two nodes either way


def test_topk_one_is_the_chain():
    chain, topk1 = (LLM("tiny-llama", **KNOBS, speculative_config={**SHIPPED, **extra})
                    for extra in ({"num_speculative_tokens": 3},
                                  {"num_speculative_tokens": 3, "topk": 1, "num_draft_tokens": 4}))
    assert topk1.engine.runner.proposer.token_tree is None
    a, b = (llm.generate(TEXTS, GREEDY, use_tqdm=False) for llm in (chain, topk1))
    assert [(o.outputs[0].token_ids, o.metrics.num_accepted_tokens) for o in a] == [
        (o.outputs[0].token_ids, o.metrics.num_accepted_tokens) for o in b]


def test_dynamic_tree_accepts_more_than_the_chain():
    from tests.spec_decode.test_eagle_tree import _accepted_per_verification

    chain = _accepted_per_verification({"num_speculative_tokens": 4})
    tree = _accepted_per_verification(DYNAMIC)
    assert tree > chain + 0.25, (chain, tree)


def test_sampled_dynamic_tree_requests_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=11)
    llm = LLM("tiny-llama", **WHOLE_TREES, speculative_config={**SHIPPED, **DYNAMIC})
    together = _tokens(llm.generate(TEXTS, params, use_tqdm=False))
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in TEXTS[:3]]
    assert alone == together[:3]


@pytest.mark.parametrize(("extra", "message"), [
    ({"topk": 2}, r"needs both topk and num_draft_tokens \(got topk=2, num_draft_tokens=None\)"),
    ({"topk": 2, "num_draft_tokens": 5, "speculative_token_tree": [(0,)]}, "not both"),
    ({"topk": 2, "num_draft_tokens": 8, "num_speculative_tokens": 2}, r"num_draft_tokens=8 must be in \[2, 7\]"),
    ({"topk": 1, "num_draft_tokens": 3}, "num_draft_tokens must be 5"),
    ({"topk": 0, "num_draft_tokens": 3}, r"speculative_config\['topk'\] must be a positive integer"),
    ({"topk": 21, "num_draft_tokens": 8}, "drafts 63 nodes in its last level's block; at most 62"),
])
def test_dynamic_tree_config_errors_name_the_field(extra, message):
    spec = {**SHIPPED, "num_speculative_tokens": 4, **extra}
    with pytest.raises(ValueError, match=message):
        LLM("tiny-llama", **KNOBS, speculative_config=spec)


def test_tree_tables_follow_parents():
    parents = torch.tensor([[-1, 0, 0, 1, 3], [-1, 0, 1, 2, 0]])
    depths, bits = tree_tables(parents)
    assert depths.tolist() == [[0, 1, 1, 2, 3], [0, 1, 2, 3, 1]]
    assert bits.tolist() == [[1, 3, 5, 11, 27], [1, 3, 7, 15, 17]]
