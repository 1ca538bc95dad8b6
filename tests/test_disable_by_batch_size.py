"""disable_by_batch_size (vLLM's speculative_config key): a step whose batch, running plus waiting requests, is larger
than the value verifies no drafts.

Invariants:
- The scheduler schedules no drafts in such a step (the requests drop theirs) and drafts again once the batch is
  small enough; `stats().spec_disabled` marks the step, and the run summary counts those steps.
- Outputs are those of plain decoding, for every proposer (drafts left on the device included), with speculation
  switching off and on within a run, under chunked prefill, preemption and prefix caching; seeded sampling in steps
  without drafts samples what plain decoding samples.
- Async scheduling never launches a step ahead that would skip speculation: the verify steps launched ahead (EAGLE)
  stay identical to plain decoding.
"""

from __future__ import annotations

import random

import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.worker.cuda_graphs import eager_capture
from research_lm.worker.spec import check_speculative_config
from tests.spec_decode.test_draft_graphs import KNOBS as GRAPH_KNOBS
from tests.spec_decode.test_draft_graphs import _spec
from tests.spec_decode.test_spec_formats import V
from tests.test_scheduler import FakeRunner, assert_matches_reference, make_request, make_scheduler


def test_the_scheduler_verifies_no_drafts_while_the_batch_is_over_the_limit():
    sched = make_scheduler(max_model_len=64, disable_by_batch_size=2)
    runner = FakeRunner(sched.kv_cache, num_spec=3, p_wrong=0.3, seed=1)
    reqs = {r.request_id: r for r in (make_request(i, list(range(i, i + 5)), max_tokens=4 + 6 * i) for i in range(4))}
    for req in reqs.values():
        sched.add_request(req)
    flags = []
    while sched.has_unfinished_requests():
        batch = len(sched.running) + len(sched.waiting)
        so = sched.schedule()
        drafts = sum(s.num_spec_tokens for s in so.scheduled)
        sched.update_from_output(so, runner.execute(so))
        assert sched.stats().spec_disabled == (batch > 2)
        assert not (batch > 2 and drafts), "a step over the limit verifies no drafts"
        flags.append((batch > 2, drafts > 0))
    assert (True, False) in flags and (False, True) in flags  # off while 3-4 requests run, on for the last two
    assert_matches_reference(reqs, 64)


def test_the_key_is_checked_for_every_method():
    assert check_speculative_config({"method": "ngram", "disable_by_batch_size": 4})["disable_by_batch_size"] == 4
    with pytest.raises(ValueError, match=r"speculative_config\['disable_by_batch_size'\] must be a positive integer"):
        check_speculative_config({"method": "suffix", "disable_by_batch_size": 0})


KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
             num_gpu_blocks=24, max_model_len=64)


def _prompts() -> list[list[int]]:
    """Six prompts with repeats (ngram and suffix draft from them), two sharing a prefix (prefix-cache hits)."""
    rng = random.Random(3)
    motif = [rng.randrange(V) for _ in range(5)]
    prompts = [motif * 3, motif * 2 + [rng.randrange(V) for _ in range(7)]]
    prompts += [[rng.randrange(V) for _ in range(n)] for n in (6, 13, 17)]
    return prompts + [prompts[0] + motif]


def _method(kind: str, tmp_path, checkpoint) -> dict:
    if kind in ("ngram", "suffix"):
        return {"method": kind, **({"prompt_lookup_min": 1, "prompt_lookup_max": 3} if kind == "ngram" else {})}
    return _spec(kind, tmp_path, checkpoint)


@pytest.mark.parametrize("kind", ["ngram", "suffix", "draft_model", "eagle", "eagle3"])
def test_outputs_equal_plain_decoding_as_speculation_switches_off_and_on(kind, tiny_checkpoint, tmp_path):
    """Six requests of 4 .. 24 tokens, limit 3: no drafts while four or more are left, drafts after; the KV cache is
    small enough to preempt, and prompts arrive in chunks."""
    checkpoint = tiny_checkpoint("llama")
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in LLM(str(checkpoint), **KNOBS).generate(prompts, params, use_tqdm=False)]
    spec = {**_method(kind, tmp_path, checkpoint), "num_speculative_tokens": 3, "disable_by_batch_size": 3}
    llm = LLM(str(checkpoint), **KNOBS, speculative_config=spec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    steps, summary = llm.engine.metrics.steps, llm.engine.metrics.summary()
    assert all(s["num_draft_tokens"] == 0 for s in steps if s["spec_disabled"])
    assert summary["num_spec_disabled_steps"] == sum(s["spec_disabled"] for s in steps) > 0
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0  # speculation came back on
    assert llm.engine.scheduler.num_preemptions > 0 or kind == "ngram"  # (ngram's tiny run fits)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_blocks - 1


def test_seeded_sampling_without_drafts_samples_what_plain_decoding_samples(tiny_checkpoint):
    """Limit 1: the seeded sampling requests decode plainly while the long greedy one runs beside them, and draw the
    same tokens as without speculation; the greedy one drafts once alone."""
    checkpoint = str(tiny_checkpoint("llama"))
    prompts = _prompts()
    params = [SamplingParams(temperature=1.0, top_k=20, seed=i, max_tokens=10, ignore_eos=True) for i in range(5)]
    params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    want = [o.outputs[0].token_ids for o in LLM(checkpoint, **KNOBS).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "suffix", "num_speculative_tokens": 3, "disable_by_batch_size": 1}
    llm = LLM(checkpoint, **KNOBS, speculative_config=spec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.metrics.num_draft_tokens > 0 for o in outs] == [False] * 5 + [True]
    assert 0 < llm.engine.metrics.summary()["num_spec_disabled_steps"] < len(llm.engine.metrics.steps)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant (graphs re-run on CPU)")
def test_async_verify_steps_are_not_launched_ahead_of_a_step_without_speculation(tiny_checkpoint, tmp_path):
    """EAGLE-3 with verify graphs and drafting behind them (re-run on CPU), async scheduling, two seats, limit 2:
    two requests verify, with steps launched ahead of their verification; a third arrives (waiting: no seat) and the
    batch of three skips speculation, so no step is launched ahead of it; then it is admitted as one finishes and
    speculation resumes. Tokens equal plain decoding's; every block comes back."""
    checkpoint = tiny_checkpoint("llama")
    knobs = GRAPH_KNOBS | dict(max_model_len=32, max_num_seqs=2)
    spec = {**_spec("eagle3", tmp_path, checkpoint), "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    rng = random.Random(7)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 9, 7)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 6, 6)]
    want = LLM(str(checkpoint), device="cpu", **(knobs | dict(attention_backend="torch_ref"))).generate(
        prompts, params, use_tqdm=False)
    llm = LLM(str(checkpoint), device="cpu", cuda_graphs=False, async_scheduling=True, speculative_config=spec,
              **knobs)
    _with_verify_graphs(llm, sizes=[1, 2])
    engine, collected = llm.engine, []
    collect = engine.runner.collect
    engine.runner.collect = lambda pending: collected.append((engine._in_flight is not None,
                                                              len(engine.scheduler.waiting))) or collect(pending)
    reqs = [engine.add_request(p, q) for p, q in zip(prompts[:2], params[:2])]
    while not any(ahead for ahead, _ in collected):  # run until a verify step is launched ahead of another
        assert engine.has_unfinished_requests(), "no step was launched ahead"
        engine.step()
    reqs.append(engine.add_request(prompts[2], params[2]))
    arrival = len(collected)
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids for r in reqs] == [o.outputs[0].token_ids for o in want]
    assert not any(ahead for ahead, waiting in collected if waiting), "no step ahead while the batch is over 2"
    assert engine.metrics.summary()["num_spec_disabled_steps"] > 0
    assert reqs[2].num_draft_tokens > 0 and any(ahead for ahead, _ in collected[arrival:])  # speculation resumed
    assert engine.kv_cache.num_free_blocks == engine.num_blocks - 1


def _with_verify_graphs(llm: LLM, sizes: list[int]) -> None:
    """The runner's graphs, re-run on CPU: verify graphs (query length k + 1) and the "verified" draft graphs behind
    them, which read the verify graphs' argmax and inputs in place and write the drafts into the token table."""
    runner = llm.engine.runner
    assert runner.capture_cuda_graphs(sizes, prefill_sizes=[], capture=eager_capture) is None
    assert runner.proposer.graphs.verified_in_place and runner.proposer.graphs.drafts_verified
