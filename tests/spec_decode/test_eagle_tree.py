"""Static token trees drafted by EAGLE and EAGLE-3 heads (`speculative_token_tree`, spec_decode/eagle_tree.py).

Invariants:
- Greedy tree decoding is token-identical to plain greedy under chunked prefill, preemption and prefix caching: with
  the shipped EAGLE-3 pair (tiny-llama + tiny-llama-eagle3, whose drafts are often right, so deep paths are accepted
  and the head drafts on after the verify step's compaction) and with an EAGLE-1 head.
- Every EAGLE-1 node is the rank-r token of the head's distribution at its parent, as an independent plain-torch head
  recomputes it from scratch on the context and the node's ancestors: the levels' positions, ancestor masks, KV slots
  and parent features are right, and stay so after rejections, preemption and prefix-cache hits.
- A chain written as a tree gives the chain proposer's exact tokens, draft count and accepted count.
- On the shipped pair a branching tree accepts more tokens per verification than the depth-4 chain.
- Sampled requests (seeded) with a tree do not depend on the rest of the batch.
"""

from __future__ import annotations

import random

import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.worker.token_tree import TokenTree
from tests.spec_decode.spying import record_drafts
from tests.spec_decode.test_eagle import _attn, _mlp, _rms, target_features
from tests.spec_decode.test_spec_formats import V, eagle1_tensors, write_eagle1

SHIPPED = {"method": "eagle3", "model": "tiny-llama-eagle3"}
# 3 children at depth 1, then a Medusa-like shape: 13 nodes, depth 4
BRANCHING = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
             (0, 0, 0, 0), (0, 0, 1, 0)]
CHAIN3 = [(0,), (0, 0), (0, 0, 0)]
KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=24, max_num_seqs=4,
             max_model_len=64, attention_backend="torch_ref")
# A token budget for every running request's whole tree (4 x 14): one that cuts trees cuts them per batch.
WHOLE_TREES = KNOBS | {"max_num_batched_tokens": 64}
CASES = {"chunked": {}, "preempted": {"num_gpu_blocks": 22}, "prefix_cached": {"enable_prefix_caching": True}}
TEXTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
         "for i in range(10):\n    print(", "    def __repr__(self):\n        return ",
         "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push"]  # the last: a prefix hit
GREEDY = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)


def _random_prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 17, 30, 9)]
    return prompts + [prompts[1][:12] + [7, 7]]  # shares a prefix with another (prefix caching)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _count_verifications(llm: LLM) -> list[int]:
    """Per drafting call, the requests given real drafts: each is verified next step (no preemption here)."""
    proposer, counts = llm.engine.runner.proposer, []
    propose = proposer.propose

    def counted(outcome):
        drafts = propose(outcome)
        counts.append(sum(1 for n in drafts.num if n))
        return drafts

    proposer.propose = counted
    return counts


def _check_case(outs, case: str) -> None:
    if case == "preempted":
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    if case == "prefix_cached":
        assert sum(o.metrics.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("case", CASES)
def test_shipped_eagle3_tree_is_plain_greedy(case):
    knobs = KNOBS | CASES[case]
    want = _tokens(LLM("tiny-llama", **knobs).generate(TEXTS, GREEDY, use_tqdm=False))
    llm = LLM("tiny-llama", **knobs, speculative_config={**SHIPPED, "speculative_token_tree": BRANCHING})
    assert llm.engine.runner.proposer.num_speculative_tokens == 13
    assert llm.engine.runner.proposer.num_lookahead_tokens == 11  # the nodes of depth < 4: the largest block
    outs = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want
    _check_case(outs, case)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 100  # deep paths, not only the bonus token


def _eagle1_logits(w, embed, lm_head, context, feats, path):
    """EAGLE-1 (cnets1.py) from scratch: its logits [V] after the context and then the draft tokens `path`, each fed
    with the head's own output at the row before it as its feature."""
    rows, features = embed[torch.tensor(context[1:])], feats
    for token in [*path, None]:
        h = torch.cat([rows, features], -1) @ w["fc.weight"].T + w["fc.bias"]
        h = h + _attn(h, w, "layers.0")
        out = h + _mlp(_rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0")
        if token is None:
            return out[-1] @ lm_head.T
        rows, features = torch.cat([rows, embed[token][None]]), torch.cat([features, out[-1:]])


def _check_nodes_against_reference(records, tree: TokenTree, logits_after) -> int:
    """Each real node's token has the rank-r logit of the reference at its parent's path (a near tie may pick either
    of the tied tokens: its children then follow the token drafted). Returns the nodes compared."""
    compared = 0
    for context, nodes in records:
        at_parent = {}
        for j, token in enumerate(nodes, start=1):
            parent, path = tree.parents[j], []
            while parent > 0:
                path.insert(0, nodes[parent - 1])
                parent = tree.parents[parent]
            key = tuple(path)
            if key not in at_parent:
                at_parent[key] = logits_after(context, path)
            logits = at_parent[key]
            rank_value = logits.sort(descending=True).values[tree.ranks[j]]
            assert abs(float(logits[token]) - float(rank_value)) < 1e-3, (context, nodes, j)
            compared += 1
    return compared


@pytest.mark.parametrize("case", CASES)
def test_eagle1_tree_is_plain_greedy_and_drafts_the_reference(case, tiny_checkpoint, hf_model, tmp_path):
    path, prompts, knobs = str(tiny_checkpoint("llama")), _random_prompts(), KNOBS | CASES[case]
    want = _tokens(LLM(path, **knobs).generate(prompts, GREEDY, use_tqdm=False))
    tensors = eagle1_tensors(21)
    head = write_eagle1(tmp_path / "eagle", tensors)
    llm = LLM(path, **knobs, speculative_config={"method": "eagle", "model": str(head),
                                                 "speculative_token_tree": BRANCHING})
    records, _ = record_drafts(llm.engine.runner.proposer)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(outs) == want
    _check_case(outs, case)
    hf = hf_model("llama")
    w = {k: v.float() for k, v in tensors.items()}
    embed, lm_head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()

    def logits_after(context, draft_path):
        final, _ = target_features(hf, context[:-1], [])
        return _eagle1_logits(w, embed, lm_head, context, final, draft_path)

    tree = TokenTree.parse(BRANCHING)
    assert _check_nodes_against_reference(records[::3], tree, logits_after) > 100
    assert any(len(nodes) == tree.num_drafts for _, nodes in records)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_a_chain_written_as_a_tree_is_the_chain(method, tiny_checkpoint, tmp_path):
    if method == "eagle3":
        path, prompts, spec = "tiny-llama", TEXTS, SHIPPED
    else:
        head = write_eagle1(tmp_path / "eagle", eagle1_tensors(21))
        path, prompts, spec = str(tiny_checkpoint("llama")), _random_prompts(), {"method": "eagle", "model": str(head)}
    chain, as_tree = (LLM(path, **KNOBS, speculative_config={**spec, **extra}).generate(prompts, GREEDY, use_tqdm=False)
                      for extra in ({"num_speculative_tokens": 3}, {"speculative_token_tree": str(CHAIN3)}))
    for a, b in zip(chain, as_tree, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (a.metrics.num_draft_tokens, a.metrics.num_accepted_tokens) == (
            b.metrics.num_draft_tokens, b.metrics.num_accepted_tokens)
    assert sum(o.metrics.num_accepted_tokens for o in as_tree) > 0


def _accepted_per_verification(spec) -> float:
    llm = LLM("tiny-llama", **WHOLE_TREES, speculative_config={**SHIPPED, **spec})
    verifications = _count_verifications(llm)
    outs = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    return sum(o.metrics.num_accepted_tokens for o in outs) / sum(verifications)


def test_a_branching_tree_accepts_more_than_the_chain():
    chain = _accepted_per_verification({"num_speculative_tokens": 4})
    tree = _accepted_per_verification({"speculative_token_tree": BRANCHING})
    assert tree > chain + 0.25, (chain, tree)


def test_sampled_tree_requests_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=11)
    llm = LLM("tiny-llama", **WHOLE_TREES, speculative_config={**SHIPPED, "speculative_token_tree": BRANCHING})
    together = _tokens(llm.generate(TEXTS, params, use_tqdm=False))
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in TEXTS[:3]]
    assert alone == together[:3]


def test_tree_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"num_speculative_tokens=2 is neither the node count 13 \(vLLM's meaning\) "
                                         r"nor the depth 4 of speculative_token_tree"):
        LLM("tiny-llama", **KNOBS, speculative_config={**SHIPPED, "speculative_token_tree": BRANCHING,
                                                       "num_speculative_tokens": 2})
    for k in (4, 13):
        llm = LLM("tiny-llama", **KNOBS, speculative_config={**SHIPPED, "speculative_token_tree": BRANCHING,
                                                             "num_speculative_tokens": k})
        assert llm.engine.runner.proposer.num_speculative_tokens == 13


def test_triton_drafts_the_tree_as_torch_ref_does():
    """The drafter's levels through the triton backend's tree mask (the interpreter on CPU): torch_ref's tokens and
    acceptance."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {**SHIPPED, "speculative_token_tree": BRANCHING}
    reference, triton = (LLM("tiny-llama", **WHOLE_TREES | {"attention_backend": backend}, speculative_config=spec)
                         .generate(TEXTS[:3], params, use_tqdm=False) for backend in ("torch_ref", "triton"))
    assert _tokens(triton) == _tokens(reference)
    assert [o.metrics.num_accepted_tokens for o in triton] == [o.metrics.num_accepted_tokens for o in reference]
