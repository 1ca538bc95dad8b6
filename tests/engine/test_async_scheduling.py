"""Async scheduling (step N + 1 scheduled and launched before step N is collected) emits exactly what the
synchronous engine emits: the same tokens, logprobs and finish reasons, under chunked prefill, prefix
caching, preemption, stop tokens, max_tokens, seeded sampling and penalties (which fall back to
synchronous steps), and it really runs ahead."""

from __future__ import annotations

import random

import pytest
import torch

from research_lm import LLM, SamplingParams

KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
             max_model_len=64, enable_prefix_caching=True)


def _prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    """n prompts of 3 .. 30 tokens; every other one starts with a shared 9-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(9)]
    lens = [3, 5, 8, 13, 17, 21, 26, 30]
    return [(shared if i % 2 else []) + [rng.randrange(vocab) for _ in range(lens[i % 8])] for i in range(n)]


def _params(eos_stop: int | None = None, **kw) -> list[SamplingParams]:
    """A mix: greedy and seeded random rows, different max_tokens, logprobs, a stop token, min_tokens, penalties."""
    base = [
        dict(temperature=0.0, max_tokens=12, ignore_eos=True),
        dict(temperature=1.0, seed=7, max_tokens=9, ignore_eos=True, logprobs=2),
        dict(temperature=0.8, top_k=5, top_p=0.9, max_tokens=1, ignore_eos=True),
        dict(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0),
        dict(temperature=1.0, max_tokens=7, ignore_eos=True, min_tokens=3),
        dict(temperature=0.0, max_tokens=20, stop_token_ids=[] if eos_stop is None else [eos_stop]),
        dict(temperature=0.5, seed=3, max_tokens=2, ignore_eos=True),
        dict(temperature=0.0, max_tokens=5, ignore_eos=True),
        dict(temperature=0.7, seed=11, max_tokens=10, ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.3),
    ]
    return [SamplingParams(**(b | kw)) for b in base]


def _run(path, params, *, asynchronous: bool, **knobs):
    llm = LLM(str(path), async_scheduling=asynchronous, **(KNOBS | knobs))
    outs = llm.generate(_prompts(llm.engine.info.vocab_size, len(params)), params, use_tqdm=False)
    return llm, outs


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        cx, cy = x.outputs[0], y.outputs[0]
        assert cx.token_ids == cy.token_ids
        assert cx.finish_reason == cy.finish_reason and cx.stop_reason == cy.stop_reason
        assert (cx.logprobs is None) == (cy.logprobs is None)
        for lx, ly in zip(cx.logprobs or [], cy.logprobs or [], strict=True):
            assert lx.keys() == ly.keys()
            assert [v.logprob for v in lx.values()] == pytest.approx([v.logprob for v in ly.values()], abs=1e-6)


def _stop_token(path) -> tuple[int, int]:
    """A token the greedy request 5 first emits at output position j >= 2, and j: as a stop token it ends
    that request early."""
    _, outs = _run(path, _params(), asynchronous=False)
    tokens = outs[5].outputs[0].token_ids
    j = next(j for j in range(2, len(tokens)) if tokens[j] not in tokens[:j])
    return tokens[j], j


def test_async_matches_sync_with_chunked_prefill_prefix_caching_and_stops(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    stop, j = _stop_token(path)
    params = _params(eos_stop=stop)
    sync_llm, want = _run(path, params, asynchronous=False)
    llm, got = _run(path, params, asynchronous=True)
    _same(got, want)
    assert got[5].outputs[0].finish_reason == "stop" and len(got[5].outputs[0].token_ids) == j + 1
    assert sum(o.metrics.num_cached_tokens for o in got) > 0, "shared prefixes should hit the prefix cache"
    engine = llm.engine
    assert engine.kv_cache.num_free_blocks == engine.num_blocks - 1, "every block returned"
    assert engine.metrics.num_output_tokens == sum(len(o.outputs[0].token_ids) for o in got)
    assert engine.metrics.num_output_tokens == sync_llm.engine.metrics.num_output_tokens


def test_async_matches_sync_under_preemption(tiny_checkpoint):
    """A KV budget that forces preemption: the engine collects before it schedules then, never preempting
    a request whose token is still in flight."""
    path = tiny_checkpoint("llama")
    sync_llm, want = _run(path, _params(), asynchronous=False, num_gpu_blocks=22)
    llm = LLM(str(path), async_scheduling=True, **(KNOBS | dict(num_gpu_blocks=22)))
    engine, preempt = llm.engine, llm.engine.scheduler._preempt

    def checked_preempt(request, out):  # only from a synchronous schedule: no token of anyone in flight
        assert not any(r.num_output_placeholders for r in engine.scheduler.running)
        preempt(request, out)

    engine.scheduler._preempt = checked_preempt
    got = llm.generate(_prompts(engine.info.vocab_size, 9), _params(), use_tqdm=False)
    _same(got, want)
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget should force preemption"
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_blocks - 1


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=0.4)])
def test_penalties_count_the_token_in_flight(tiny_checkpoint, penalty):
    """Penalties read the outputs, whose last token is still on the device when the next step is launched:
    the sampling batch counts it there. Same tokens as the synchronous engine, and the steps still run ahead."""
    path = tiny_checkpoint("llama")
    params = [p if i % 2 else SamplingParams(**(vars(p) | penalty)) for i, p in enumerate(_params())]
    _, want = _run(path, params, asynchronous=False)
    llm = LLM(str(path), async_scheduling=True, **KNOBS)
    collect, ahead = llm.engine.runner.collect, []
    llm.engine.runner.collect = lambda pending: ahead.append(llm.engine._in_flight is not None) or collect(pending)
    got = llm.generate(_prompts(llm.engine.info.vocab_size, len(params)), params, use_tqdm=False)
    _same(got, want)
    assert sum(ahead) > len(ahead) // 2, "most steps should have the next one launched before they are collected"


def test_the_next_step_is_launched_before_the_last_is_collected(tiny_checkpoint):
    """Order of runner calls: after the first launch, every launch comes before the previous step's collect,
    and the launched step reads the in-flight token from the device (the host only counts it)."""
    llm = LLM(str(tiny_checkpoint("llama")), async_scheduling=True, **KNOBS)
    runner, events, holes = llm.engine.runner, [], []
    launch, collect = runner.launch, runner.collect

    def spy_launch(sched):
        if sched.scheduled:
            events.append("launch")
            holes.append(sum(s.request.num_output_placeholders > 0 for s in sched.scheduled))
        return launch(sched)

    runner.launch = spy_launch
    runner.collect = lambda pending: events.append("collect") or collect(pending)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)
    assert events[:3] == ["launch", "launch", "collect"]
    assert events.count("launch") == events.count("collect")
    assert max(holes) == 2, "decode steps should read both requests' tokens from the device"
    assert llm.engine._in_flight is None and not llm.engine.has_unfinished_requests()


def test_abort_while_in_flight(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), async_scheduling=True, **KNOBS)
    engine = llm.engine
    keep = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    drop = engine.add_request([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finished = engine.step() + engine.step()
    engine.abort_request(drop.request_id)
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [o.request_id for o in finished] == [keep.request_id]
    assert keep.finish_reason == "length" and len(keep.output_token_ids) == 8
    assert drop.finish_reason == "abort" and drop.num_output_placeholders == 0 and len(drop.output_token_ids) <= 8
    assert engine.kv_cache.num_free_blocks == engine.num_blocks - 1


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
                                  {"method": "draft_model", "num_speculative_tokens": 3}])
def test_async_with_a_proposer_matches_sync(tiny_checkpoint, spec):
    """ngram drafts on the device at launch, so once every request is plain greedy the engine launches the next
    step before collecting this one; a draft model needs each step's tokens on the host, so each of its steps is
    collected first. Either way verify steps go through `assume_launched` (an output in flight per token the step may
    emit) and `update_from_output` (the rejected ones dropped): the same outputs, draft counts and blocks as the
    synchronous engine, with chunked prefill, prefix caching and a stop token."""
    path = tiny_checkpoint("llama")
    spec = spec | ({"model": str(path)} if spec["method"] == "draft_model" else {})
    stop, _ = _stop_token(path)
    params = [p for p in _params(eos_stop=stop) if p.temperature == 0.0 or p.seed is not None]
    _, want = _run(path, params, asynchronous=False, speculative_config=spec)
    llm = LLM(str(path), async_scheduling=True, speculative_config=spec, **KNOBS)
    collect, ahead = llm.engine.runner.collect, []
    llm.engine.runner.collect = lambda pending: ahead.append(llm.engine._in_flight is not None) or collect(pending)
    got = llm.generate(_prompts(llm.engine.info.vocab_size, len(params)), params, use_tqdm=False)
    _same(got, want)
    assert [o.metrics.num_draft_tokens for o in got] == [o.metrics.num_draft_tokens for o in want]
    assert [o.metrics.num_accepted_tokens for o in got] == [o.metrics.num_accepted_tokens for o in want]
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0 and ahead
    assert spec["method"] == "ngram" or not any(ahead)


def test_ngram_steps_are_launched_ahead_of_their_verification(tiny_checkpoint):
    """All greedy: every ngram step drafts on the device at launch, so the engine launches the next (verify) step
    before collecting this one, from counts that assume every draft accepted; the tokens, draft and acceptance counts
    are the synchronous engine's."""
    path = tiny_checkpoint("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (14, 9, 20, 6)]
    prompts = [p + p for p in _prompts(256, len(params))]  # repeats for the lookup to draft from
    want = LLM(str(path), speculative_config=spec, **KNOBS).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(path), async_scheduling=True, speculative_config=spec, **KNOBS)
    collect, ahead = llm.engine.runner.collect, []
    llm.engine.runner.collect = lambda pending: ahead.append(llm.engine._in_flight is not None) or collect(pending)
    got = llm.generate(prompts, params, use_tqdm=False)
    _same(got, want)
    assert [o.metrics.num_draft_tokens for o in got] == [o.metrics.num_draft_tokens for o in want]
    assert [o.metrics.num_accepted_tokens for o in got] == [o.metrics.num_accepted_tokens for o in want]
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0 and sum(ahead) > len(ahead) // 2
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_blocks - 1
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_blocks - 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_matches_sync_on_cuda_with_graphs(tiny_checkpoint, dtype):
    """On CUDA (the default there): graph replays read the in-flight tokens from the device, the host ids
    arrive through pinned buffers, and the outputs equal the synchronous engine's, preemption included."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = tiny_checkpoint("llama")
    knobs = dict(device="cuda", dtype=dtype, attention_backend="triton", cuda_graphs=True)
    sync_llm, want = _run(path, _params(), asynchronous=False, num_gpu_blocks=22, **knobs)
    llm, got = _run(path, _params(), asynchronous=None, num_gpu_blocks=22, **knobs)
    assert llm.engine.async_scheduling and llm.engine.runner.cuda_graphs is not None
    _same(got, want)
    assert llm.engine.scheduler.num_preemptions > 0
    _, want = _run(path, _params(), asynchronous=False, **knobs)
    _, got = _run(path, _params(), asynchronous=None, **knobs)
    _same(got, want)


@pytest.mark.parametrize("arch", ["mistral", "mamba2", "bamba", "deepseek-v3"])
def test_async_matches_sync_across_families(tiny_checkpoint, arch):
    """Sliding window (blocks freed behind the window while a step is in flight), Mamba state, the hybrid,
    MLA + MoE: the same outputs with and without async scheduling."""
    path = tiny_checkpoint(arch)
    params = _params()[:4]
    _, want = _run(path, params, asynchronous=False, num_gpu_blocks=40)
    _, got = _run(path, params, asynchronous=True, num_gpu_blocks=40)
    _same(got, want)
