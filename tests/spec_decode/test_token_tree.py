"""Token trees through the engine (issue 29): `speculative_token_tree`, one verify forward per tree, the accepted path
moved to where plain decoding would have put it.

Invariants:
- The tree's bookkeeping: breadth-first order, parents, depths, ancestor bits; a malformed tree is refused naming
  the bad path.
- Greedy tree decoding is token-identical to plain greedy under chunked prefill, preemption and prefix caching,
  with an oracle whose correct path changes rank and depth every step: a wrong position, mask, KV move or hidden-row
  move changes the tokens. Its tau shows the path was taken.
- Medusa with a tree: identical greedy outputs; a chain written as a tree gives the chain's exact tokens and tau.
- Sampled requests with trees are seeded and do not depend on the rest of the batch.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml

from research_lm import LLM, SamplingParams
from research_lm.worker.cuda_graphs import eager_capture
from research_lm.worker.spec import _METHOD_KEYS, PROPOSERS, Drafts, Proposer, StepOutcome, register_proposer
from research_lm.worker.token_tree import TokenTree
from tests.spec_decode.spying import context
from tests.spec_decode.test_spec_formats import V, medusa_tensors, write_medusa

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0), (0, 0, 0, 0)]
KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=24, max_num_seqs=4,
             max_model_len=96, attention_backend="torch_ref")


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 17, 30, 9, 12)]
    return prompts + [prompts[1][:12] + [7, 7]]  # shares a prefix with another (prefix caching)


def test_tree_bookkeeping_and_refusals():
    tree = TokenTree.parse(str(TREE[::-1]))  # any order, or vLLM's string form: kept breadth-first
    assert tree.paths == tuple(TREE) and tree.num_drafts == 9 and tree.depth == 4
    assert tree.parents == (-1, 0, 0, 0, 1, 1, 2, 4, 6, 7)
    assert tree.depths == (0, 1, 1, 1, 2, 2, 2, 3, 3, 4)
    assert tree.bits[7] == 0b10010011 and tree.bits[9] == (1 | 1 << 1 | 1 << 4 | 1 << 7 | 1 << 9)
    assert TokenTree.parse([(0,), (0, 0)]).is_chain and not tree.is_chain
    for bad, match in (([(0, 0)], r"\(0, 0\) has no parent \(0,\)"), ([(0,), (2,)], r"no elder sibling \(1,\)"),
                       ([(0,), (0,)], "lists a path twice"), ("[(0,), (", "not a list of tuples"),
                       ([()], "not a non-empty tuple"), ([(0,)] * 0, "non-empty list")):
        with pytest.raises(ValueError, match=match):
            TokenTree.parse(bad)


class OracleTree(Proposer):
    """Drafts `tree` with the plain greedy continuation (`truth`, per prompt) along one leaf's path, drawn afresh each
    step, and wrong tokens on every other node: only the right path's positions, mask and KV give the plain tokens."""

    def __init__(self, tree: TokenTree, truth: dict[tuple[int, ...], list[int]]):
        self.token_tree, self.truth = tree, truth
        self.num_speculative_tokens = tree.num_drafts
        self.rng = random.Random(0)
        self.paths_taken = []

    def propose(self, outcome: StepOutcome) -> Drafts:
        tree, index, drafts = self.token_tree, [], []
        leaves = [j for j in range(1, tree.num_drafts + 1) if j not in tree.parents]
        for i, request in enumerate(outcome.requests):
            if not outcome.emitted[i]:
                continue
            tokens = context(outcome, i)
            future = self.truth[tuple(tokens[: request.num_prompt_tokens])][len(tokens) - request.num_prompt_tokens:]
            on_path, j = set(), self.rng.choice(leaves)
            while j > 0:
                on_path.add(j)
                j = tree.parents[j]
            self.paths_taken.append(max(on_path))
            right = [future[d - 1] if d <= len(future) else 0 for d in tree.depths[1:]]
            drafts.append([t if j in on_path else (t + 1) % V for j, t in enumerate(right, start=1)])
            index.append(i)
        return Drafts.from_lists(index, drafts, tree.num_drafts, outcome.input_ids.device)


@pytest.fixture
def oracle_method():
    made = []

    @register_proposer("oracle_tree")
    def build(speculative_config, target):
        made.append(OracleTree(TokenTree.parse(TREE), ORACLE_TRUTH))
        return made[-1]

    try:
        yield made
    finally:
        PROPOSERS.entries.pop("oracle_tree", None)
        _METHOD_KEYS.pop("oracle_tree", None)


ORACLE_TRUTH: dict[tuple[int, ...], list[int]] = {}


@pytest.mark.parametrize("case", ["chunked", "preempted", "prefix_cached"])
def test_greedy_tree_decoding_is_plain_greedy(case, tiny_checkpoint, oracle_method):
    path = str(tiny_checkpoint("llama"))
    knobs = dict(KNOBS, enable_prefix_caching=case == "prefix_cached")
    if case == "preempted":
        knobs["num_gpu_blocks"] = 26  # fewer than the batch's contexts need: requests preempt and recompute
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    prompts = _prompts()
    plain = LLM(path, **knobs).generate(prompts, params, use_tqdm=False)
    ORACLE_TRUTH.clear()
    ORACLE_TRUTH.update({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)})
    llm = LLM(path, **knobs, speculative_config={"method": "oracle_tree"})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    oracle = oracle_method[-1]
    assert len(set(oracle.paths_taken)) == 4  # every leaf's path, of depth 2, 3 and 4, was the right one
    steps = sum(o.metrics.num_draft_tokens for o in outs) / TokenTree.parse(TREE).num_drafts
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert accepted / steps > 2.0  # the right path, depth 2-4, is taken nearly every step
    if case == "preempted":
        assert sum(o.metrics.num_preemptions for o in outs) > 0


def _medusa(tmp_path, **spec):
    head = write_medusa(tmp_path / "medusa", medusa_tensors(31, num_heads=4))
    return {"method": "medusa", "model": str(head), **spec}


def test_medusa_tree_is_plain_greedy_and_a_chain_tree_is_the_chain(tiny_checkpoint, tmp_path):
    path, prompts = str(tiny_checkpoint("llama")), _prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **KNOBS).generate(prompts, params, use_tqdm=False)]
    tree = LLM(path, **KNOBS, speculative_config=_medusa(tmp_path, speculative_token_tree=TREE))
    assert tree.engine.runner.proposer.num_speculative_tokens == 9
    assert [o.outputs[0].token_ids for o in tree.generate(prompts, params, use_tqdm=False)] == want
    chain, as_tree = (LLM(path, **KNOBS, speculative_config=_medusa(tmp_path, **spec)).generate(
        prompts, params, use_tqdm=False) for spec in ({"num_speculative_tokens": 3},
                                                      {"speculative_token_tree": "[(0,), (0, 0), (0, 0, 0)]"}))
    for a, b, w in zip(chain, as_tree, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == w
        assert (a.metrics.num_draft_tokens, a.metrics.num_accepted_tokens) == (
            b.metrics.num_draft_tokens, b.metrics.num_accepted_tokens)


def test_sampled_tree_requests_do_not_depend_on_the_batch(tiny_checkpoint, tmp_path):
    path, prompts = str(tiny_checkpoint("llama")), _prompts(5)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=11)
    # a token budget that holds every request's whole tree: trimmed to fit a smaller one, the nodes verified (and so
    # the sampled tokens) would depend on the batch, as a chain's would (issue 35)
    knobs = dict(KNOBS, max_num_batched_tokens=64)
    llm = LLM(path, **knobs, speculative_config=_medusa(tmp_path, speculative_token_tree=TREE))
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:3]]
    assert alone == together[:3]


def test_tree_config_errors_name_the_field(tiny_checkpoint, tmp_path):
    path = str(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match=r"num_speculative_tokens=2 is neither the node count 9 \(vLLM's meaning\) "
                                         r"nor the depth 4 of speculative_token_tree"):
        LLM(path, **KNOBS, speculative_config=_medusa(tmp_path, speculative_token_tree=TREE,
                                                      num_speculative_tokens=2))
    with pytest.raises(ValueError, match=r"unknown speculative_config key\(s\) \['speculative_token_tree'\]"):
        LLM(path, **KNOBS, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                               "speculative_token_tree": TREE})
    with pytest.raises(ValueError, match=r"\(1, 1\) has no elder sibling \(1, 0\)"):
        LLM(path, **KNOBS, speculative_config=_medusa(tmp_path, speculative_token_tree=[(0,), (1,), (1, 1)]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter variant; the GPU tests cover CUDA")
def test_tree_verify_graphs_match_eager_on_cpu(tiny_checkpoint, tmp_path):
    """Verify graphs of the tree's N + 1 tokens (captured by the re-run stand-in, Triton under its interpreter) read
    the masks the runner writes before each replay: the tokens are the eager run's, which are plain greedy's."""
    path, prompts = str(tiny_checkpoint("llama")), _prompts(6)[:3]
    knobs = dict(KNOBS, attention_backend="triton", max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **knobs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, **knobs, speculative_config=_medusa(tmp_path, speculative_token_tree=TREE))
    assert llm.engine.runner.capture_cuda_graphs([1, 2, 4], prefill_sizes=[], capture=eager_capture) is None
    graphs, keys = llm.engine.runner.cuda_graphs, []
    replay = graphs.replay
    graphs.replay = lambda key, common: keys.append(key) or replay(key, common)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert (4, 10) in keys  # three requests' verify steps, padded to four


@pytest.mark.gpu
def test_trees_on_cuda_keep_greedy_outputs():
    """On CUDA (triton, verify graphs reading the masks in place, launch-ahead where it applies): the built-in pair's
    EAGLE-3 head drafting spec_tree's 16-node static tree and its dynamic EAGLE-2 tree (15 nodes, per-row tables)
    gives plain greedy's tokens, and each accepts more per verification than the depth-4 chain."""
    import research_lm

    assets = Path(research_lm.__file__).parent / "assets"
    target, head = str(assets / "tiny-llama"), str(assets / "tiny-llama-eagle3")
    tree16, dynamic = (yaml.safe_load((Path(__file__).parents[2] / f"conf/spec_tree/{name}.yaml").read_text())
                       for name in ("tree16", "dynamic"))
    prompts = [f.read_text(errors="ignore")[:600] for f in sorted(Path(random.__file__).parent.glob("*.py"))[:6]]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    knobs = dict(dtype="float32", device="cuda", max_num_seqs=4)
    want = [o.outputs[0].token_ids for o in LLM(target, **knobs).generate(prompts, params, use_tqdm=False)]
    taus = {}
    for name, spec in (("chain", {"num_speculative_tokens": 4}), ("tree", tree16), ("dynamic", dynamic)):
        llm = LLM(target, **knobs, speculative_config={"method": "eagle3", "model": head, **spec})
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, name
        steps = sum(o.metrics.num_draft_tokens for o in outs) / llm.engine.runner.proposer.num_speculative_tokens
        taus[name] = 1 + sum(o.metrics.num_accepted_tokens for o in outs) / steps
    assert taus["tree"] > taus["chain"] and taus["dynamic"] > taus["chain"], taus
