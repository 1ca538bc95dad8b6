"""The batch-aware speculation policy (`speculative_config["speculation_policy"]`, research_lm/engine/spec_policy.py).

Invariants:
- Per batch bucket the adaptive policy measures both ways, then drafts where drafting's tokens per second are the
  higher, re-trying the other way one step in `explore_every`; buckets do not share their measurements.
- Through the engine: greedy outputs are the plain ones whatever it decides; steps it keeps from drafting verify
  nothing; an unknown policy is refused naming the choices.
"""

from __future__ import annotations

import pytest

from research_lm import LLM, SamplingParams
from research_lm.engine.spec_policy import AdaptivePolicy


def _feed(policy: AdaptivePolicy, batch: int, plain_rate: float, spec_rate: float, steps: int) -> list[bool]:
    """Run `steps` decisions in one bucket, each step measured at the rate of the way it took."""
    chosen = []
    for _ in range(steps):
        way = policy.drafts(batch)
        chosen.append(way)
        policy.record(batch, way, 100, 100 / (spec_rate if way else plain_rate))
    return chosen


def test_adaptive_policy_follows_the_faster_way_per_bucket():
    policy = AdaptivePolicy(warmup=3, explore_every=10)
    slow = _feed(policy, 32, plain_rate=2000.0, spec_rate=1500.0, steps=66)
    assert slow[:6].count(True) == 3  # warm-up: both ways measured
    assert slow[6:].count(True) == 6  # then plain, re-trying speculation one step in 10
    fast = _feed(policy, 1, plain_rate=100.0, spec_rate=250.0, steps=36)
    assert fast[6:].count(False) == 3 and policy.bucket(1) != policy.bucket(32)
    assert [policy.bucket(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    # a change of acceptance is seen through the exploring steps' measurements
    later = _feed(policy, 32, plain_rate=2000.0, spec_rate=4000.0, steps=60)
    assert later[-20:].count(True) >= 18


def test_engine_with_adaptive_policy_keeps_greedy_outputs(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    knobs = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                 max_model_len=96)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 7, 9, 11], [4, 4, 4, 4, 4], [8, 1, 8, 1, 8]]
    want = [o.outputs[0].token_ids for o in LLM(path, **knobs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, **knobs, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "speculation_policy": "adaptive"})
    policy = llm.engine.spec_policy
    assert isinstance(policy, AdaptivePolicy)
    policy.warmup, policy.explore_every = 2, 4
    decisions = []
    real = policy.drafts
    policy.drafts = lambda batch: decisions.append(real(batch)) or decisions[-1]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert True in decisions and False in decisions
    assert sum(b.steps[0] for b in policy.buckets.values()) > 0 and sum(b.steps[1] for b in policy.buckets.values()) > 0


def test_a_policy_that_never_drafts_verifies_nothing(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    knobs = dict(dtype="float32", device="cpu", max_num_seqs=2, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 5, 5, 5, 5, 5]]
    want = [o.outputs[0].token_ids for o in LLM(path, **knobs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, **knobs, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.spec_policy.drafts = lambda batch: False
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) == 0


def test_unknown_policy_lists_the_choices(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"unknown speculation_policy 'smart'; choose one of \['adaptive', 'always'\]"):
        LLM(str(tiny_checkpoint("llama")), device="cpu",
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "speculation_policy": "smart"})


def test_adaptive_policy_is_refused_across_ranks():
    from research_lm.engine.spec_policy import build_policy

    with pytest.raises(ValueError, match="ranks could decide apart; with several ranks"):
        build_policy("adaptive", distributed=True)
    assert isinstance(build_policy("adaptive"), AdaptivePolicy) and not isinstance(build_policy(None), AdaptivePolicy)
