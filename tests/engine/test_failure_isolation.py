"""One bad request does not poison the engine: an exception inside a step fails only the request that causes it
(finish_reason "error" and the message), the other requests of its batch emit exactly the tokens of a run without
it, every KV block goes back to the pool, and later `generate` calls work. Sync, async scheduling and speculative
engines; failures injected before the forward, after it, in the drafter, in the stop checks and in the outputs.
At the scheduler level, a property test drives random workloads with random failures through `Scheduler.recover`."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from research_lm import LLM, SamplingParams
from research_lm.engine.kv_cache import KVCacheManager
from research_lm.engine.request import Request
from research_lm.engine.scheduler import Scheduler
from research_lm.worker.runner import ModelRunner
from research_lm.worker.sampler import SamplingBatch, SamplingRow
from tests.test_kv_cache import assert_kv_invariants
from tests.test_scheduler import _PROPERTY, FakeRunner, check_step, reference_output, workloads

KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
             max_model_len=64, enable_prefix_caching=True)
BAD = 255  # the bad request's prompt starts with it; the good prompts never hold it
AFTER = 3  # it fails once it has this many output tokens: mid-generation


def _good(n: int = 6) -> tuple[list[list[int]], list[SamplingParams]]:
    """n prompts of 3 .. 30 tokens (some share a prefix: prefix cache hits), greedy and seeded T=1 in turn."""
    rng = random.Random(0)
    shared = [rng.randrange(1, 200) for _ in range(9)]
    lens = [3, 30, 8, 13, 21, 5]
    prompts = [(shared if i % 2 else []) + [rng.randrange(1, 200) for _ in range(lens[i % 6])] for i in range(n)]
    params = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=9 + i, ignore_eos=True) if i % 2
              else SamplingParams(temperature=0.0, max_tokens=12 - i, ignore_eos=True) for i in range(n)]
    return prompts, params


BAD_PROMPT = [BAD, 17, 42, 99, 7, 3, 150, 8, 61, 12, 5]
BAD_PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _is_bad(request: Request) -> bool:
    return request.prompt_token_ids[0] == BAD and len(request.output_token_ids) >= AFTER  # known ones


def _inject(monkeypatch, llm: LLM, where: str, fails=_is_bad) -> None:
    """Raise RuntimeError("injected failure") in every step that holds a request `fails` selects: at the end of
    scheduling (its allocations made, its output lost), in the runner's input preparation (before the forward), the
    sampling batch (after it), or the proposer (after verification)."""

    def check(requests) -> None:
        if any(fails(r) for r in requests):
            raise RuntimeError("injected failure")

    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    if where == "schedule":
        schedule = scheduler.schedule

        def failing_schedule():
            out = schedule()
            check([s.request for s in out.scheduled])
            return out

        monkeypatch.setattr(scheduler, "schedule", failing_schedule)
    elif where == "inputs":
        import research_lm.worker.runner as runner_module

        prepare = runner_module.prepare_step_inputs
        monkeypatch.setattr(runner_module, "prepare_step_inputs", lambda buf, state, scheduled, *a: check(
            [s.request for s in scheduled]) or prepare(buf, state, scheduled, *a))
    elif where == "sampling":
        build = SamplingBatch.build.__func__
        monkeypatch.setattr(SamplingBatch, "build", classmethod(
            lambda cls, rows, *a, **k: check([r.request for r in rows if isinstance(r, SamplingRow)])
            or build(cls, rows, *a, **k)))
    else:  # both ways a proposer drafts: at collect, or on the device at launch
        for name in ("propose", "propose_on_device"):
            if (draft := getattr(runner.proposer, name, None)) is not None:
                monkeypatch.setattr(runner.proposer, name,
                                    lambda outcome, draft=draft: check(outcome.requests) or draft(outcome))


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv_cache.num_free_blocks == engine.num_blocks - 1, "every block back in the pool"
    assert not engine.scheduler.requests and not engine.scheduler.suspects and engine._in_flight is None
    # the runner holds rows only of requests whose end the next step tells it: none leaks
    assert set(engine.runner.state.rows.row_of) <= engine.scheduler._finished_since_schedule


def _bad_request_fails_alone(monkeypatch, llm: LLM, where: str, prompts, params) -> None:
    """The scenario: a clean run of the good prompts, the same with the bad one appended (and failing), again clean."""
    clean = llm.generate(prompts, params, use_tqdm=False)
    with monkeypatch.context() as m:
        _inject(m, llm, where)
        outs = llm.generate(prompts + [BAD_PROMPT], params + [BAD_PARAMS], use_tqdm=False)
    bad = outs[-1]
    assert bad.outputs[0].finish_reason == "error" and bad.finished
    assert "RuntimeError: injected failure" in bad.error
    assert len(bad.outputs[0].token_ids) >= AFTER, "it failed mid-generation, keeping the tokens it had"
    assert _tokens(outs[:-1]) == _tokens(clean)
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs[:-1])
    _assert_clean(llm)
    assert llm.engine.metrics.num_failed_steps >= 2  # the batch's, then the bad request's alone
    assert llm.engine.metrics.summary()["num_failed_requests"] == 1
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == _tokens(clean)
    _assert_clean(llm)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["schedule", "inputs", "sampling"])
def test_bad_request_fails_alone_and_the_batch_is_untouched(tiny_checkpoint, monkeypatch, asynchronous, where):
    llm = LLM(str(tiny_checkpoint("llama")), async_scheduling=asynchronous, **KNOBS)
    _bad_request_fails_alone(monkeypatch, llm, where, *_good())


@pytest.mark.parametrize("where", ["inputs", "proposer"])
def test_speculative_engine(tiny_checkpoint, monkeypatch, where):
    """ngram drafts (greedy: a rolled-back request's drafts may differ, its tokens may not)."""
    llm = LLM(str(tiny_checkpoint("llama")), speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              **KNOBS)
    prompts, _ = _good()
    prompts = [p + p[:6] for p in prompts]  # repeats for ngram to draft from
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(prompts)
    _bad_request_fails_alone(monkeypatch, llm, where, prompts, params)
    assert llm.engine.metrics.summary()["draft_acceptance_rate"] > 0


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_failure_in_every_step_fails_everyone_and_ends(tiny_checkpoint, monkeypatch, asynchronous):
    llm = LLM(str(tiny_checkpoint("llama")), async_scheduling=asynchronous, **(KNOBS | dict(max_num_seqs=4)))
    prompts, params = _good()
    clean = llm.generate(prompts, params, use_tqdm=False)
    with monkeypatch.context() as m:
        _inject(m, llm, "inputs", fails=lambda r: True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "error" and "injected failure" in o.error for o in outs)
    assert all(o.outputs[0].token_ids == [] for o in outs)
    _assert_clean(llm)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == _tokens(clean)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["schedule", "sampling"])
def test_a_transient_failure_fails_no_one(tiny_checkpoint, monkeypatch, asynchronous, where):
    """One step fails once, mid-generation: every request recomputes and ends with the tokens of a clean run. In
    scheduling, the failure loses the step's output, which named the requests that finished before: the runner
    still drops their rows."""
    llm = LLM(str(tiny_checkpoint("llama")), async_scheduling=asynchronous, **KNOBS)
    prompts, params = _good()
    clean = llm.generate(prompts + [BAD_PROMPT], params + [BAD_PARAMS], use_tqdm=False)
    calls = []
    with monkeypatch.context() as m:
        if where == "schedule":  # in the first step after some request finished
            schedule = llm.engine.scheduler.schedule

            def failing():
                out = schedule()
                if out.finished_req_ids and not calls:
                    calls.append(out)
                    raise RuntimeError("injected failure")
                return out

            m.setattr(llm.engine.scheduler, "schedule", failing)
        else:
            _inject(m, llm, "sampling", fails=lambda r: _is_bad(r) and not calls and not calls.append(r))
        outs = llm.generate(prompts + [BAD_PROMPT], params + [BAD_PARAMS], use_tqdm=False)
    assert len(calls) == 1
    assert all(o.error is None for o in outs) and _tokens(outs) == _tokens(clean)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the failed step's requests were rolled back"
    _assert_clean(llm)


def test_a_failing_stop_check_fails_that_request_alone(tiny_checkpoint, monkeypatch):
    """A failure folding one request's tokens (its stop checks: detokenizing, for stop strings) is its own."""
    llm = LLM(str(tiny_checkpoint("llama")), **KNOBS)
    prompts, params = _good()
    clean = llm.generate(prompts, params, use_tqdm=False)
    check_stop = llm.engine.scheduler._check_stop

    def failing(request, token, num_output):
        if _is_bad(request):
            raise ValueError("cannot detokenize")
        return check_stop(request, token, num_output)

    monkeypatch.setattr(llm.engine.scheduler, "_check_stop", failing)
    outs = llm.generate(prompts + [BAD_PROMPT], params + [BAD_PARAMS], use_tqdm=False)
    assert outs[-1].outputs[0].finish_reason == "error" and outs[-1].error == "ValueError: cannot detokenize"
    assert _tokens(outs[:-1]) == _tokens(clean) and llm.engine.metrics.num_failed_steps == 0
    _assert_clean(llm)


def test_a_failing_output_fails_that_request_alone(tiny_checkpoint, monkeypatch):
    llm = LLM(str(tiny_checkpoint("llama")), **KNOBS)
    prompts, params = _good()
    make_output = llm.engine.make_output

    def failing(request):
        if request.prompt_token_ids[0] == BAD and request.error is None:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return make_output(request)

    monkeypatch.setattr(llm.engine, "make_output", failing)
    outs = llm.generate(prompts + [BAD_PROMPT], params + [BAD_PARAMS], use_tqdm=False)
    assert outs[-1].outputs[0].finish_reason == "error" and "UnicodeDecodeError" in outs[-1].error
    assert len(outs[-1].outputs[0].token_ids) == BAD_PARAMS.max_tokens and outs[-1].outputs[0].text == ""
    assert all(o.error is None for o in outs[:-1])
    _assert_clean(llm)


def test_runner_reset_forgets_every_request(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), async_scheduling=True, **KNOBS)
    engine = llm.engine
    prompts, params = _good()
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(p, sp)
    for _ in range(3):
        engine.step()
    runner: ModelRunner = engine.runner
    assert runner.state.rows.row_of and engine._in_flight is not None and runner._latest is not None
    runner.reset()
    assert not runner.state.rows.row_of and len(runner.state.rows.free) == engine.config.max_num_seqs
    assert runner._latest is None


# ---- the scheduler alone: random workloads, random failures ---------------------------------------------------


def run_with_failures(w: dict, p_fail: float, bad: str | None, max_steps: int = 20000) -> dict[str, Request]:
    """Drive a workload (tests/test_scheduler.py) through schedule -> FakeRunner -> update, where a step fails with
    probability p_fail (not while suspects run alone: a random failure there would blame an innocent) and whenever
    request `bad` is in it with an output; a failure comes before or after the runner wrote the step's KV. A failed
    step goes through `recover`, the runner forgetting every request, as `ModelRunner.reset` does."""
    kv = KVCacheManager(w["num_blocks"], w["block_size"], enable_prefix_caching=w["caching"])
    sched = Scheduler(kv, max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
                      max_model_len=w["max_model_len"], enable_chunked_prefill=w["chunked"],
                      sliding_window=w["window"], separate_prefill_tokens=w["separate"])
    runner = FakeRunner(kv, num_spec=w["num_spec"], p_wrong=w["p_wrong"], seed=w["seed"], sliding_window=w["window"])
    rng = random.Random(w["seed"])
    pending = sorted(w["arrivals"], key=lambda a: a[0])
    reqs = {r.request_id: r for _, r in pending}
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[1])
        isolating = bool(sched.suspects)
        running_before = [r.request_id for r in sched.running]
        so = sched.schedule()
        if not isolating:
            check_step(sched, so, running_before)
        else:
            assert len(so.scheduled) == 1 and so.scheduled[0].request.request_id in sched.suspects
        fail = (not isolating and rng.random() < p_fail) or any(
            s.request.request_id == bad and s.request.num_output_tokens for s in so.scheduled)
        try:
            if fail and rng.random() < 0.5:
                raise RuntimeError("before")
            ro = runner.execute(so)
            if fail:
                raise RuntimeError("after")
            finished = sched.update_from_output(so, ro)
            assert all(r.finish_reason in ("stop", "length") for r in finished)
        except RuntimeError as e:
            runner.rows.clear()
            runner.drafts.clear()
            finished = sched.recover(str(e))
            assert [r.request_id for r in finished] == ([so.scheduled[0].request.request_id] if isolating else [])
            assert all(r.finish_reason == "error" and r.error == str(e) for r in finished)
            assert not sched.running
        assert_kv_invariants(kv, {r.request_id: r for r in sched.running})
        step += 1
        assert step < max_steps
    assert kv.num_free_blocks == kv.num_blocks - 1 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    return reqs


@_PROPERTY
@given(w=workloads(), p_fail=st.sampled_from([0.0, 0.1, 0.3]), bad=st.sampled_from([None, "r0", "r1"]))
def test_random_failures_fail_only_the_bad_request(w, p_fail, bad):
    w = w | {"aborts": []}
    reqs = run_with_failures(w, p_fail, bad)
    for req in reqs.values():
        assert req.is_finished
        if req.request_id == bad and req.finish_reason == "error":
            assert req.num_output_tokens >= 1
            continue
        tokens, reason, stop_reason = reference_output(req, w["max_model_len"])
        assert req.output_token_ids == tokens, req.request_id
        assert (req.finish_reason, req.stop_reason) == (reason, stop_reason)
        assert len(req.output_logprobs) == req.num_output_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("method", [None, "eagle3"])
@pytest.mark.parametrize("where", ["inputs", "after"])
def test_on_cuda_with_graphs_and_async_scheduling(monkeypatch, method, where):
    """CUDA graphs, async scheduling, and with EAGLE-3 drafts on the device and verification deferred to `collect`:
    the failed steps' values in flight (sampled ids, drafts, next inputs) are dropped with them. "after": the
    sampling batch, or with drafts the proposer."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spec = {"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": 3} if method else None
    llm = LLM("tiny-llama", **(KNOBS | dict(device="cuda", attention_backend="triton", cuda_graphs=True,
                                            async_scheduling=True, speculative_config=spec)))
    assert llm.engine.runner.cuda_graphs is not None
    prompts, params = _good()
    if method:  # greedy: a rolled-back request's drafts may differ, its tokens may not
        params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(prompts)
    _bad_request_fails_alone(monkeypatch, llm, ("proposer" if method else "sampling") if where == "after" else where,
                             prompts, params)
