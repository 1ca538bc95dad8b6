"""Greedy speculative decoding is token-identical to greedy decoding without speculation, under
chunked prefill, preemption, prefix caching and mixed batches (drafts accepted and rejected)."""

from __future__ import annotations

import random

from research_lm import LLM, SamplingParams


def _repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts with repeats (so ngram drafts often) and without (so some requests draft nothing)."""
    rng = random.Random(1)
    motif = [rng.randrange(vocab) for _ in range(6)]
    prompts = [motif * 4, motif * 2 + [rng.randrange(vocab) for _ in range(9)]]
    prompts += [[rng.randrange(vocab) for _ in range(n)] for n in (5, 11, 17, 23)]
    return prompts


def test_ngram_greedy_identical_under_pressure(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    knobs = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
                 num_gpu_blocks=24, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = LLM(path, **knobs)
    prompts = _repetitive_prompts(base.engine.info.vocab_size)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]

    spec = LLM(path, **knobs, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)  # some accepted, some rejected
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.kv_cache.num_free_blocks == spec.engine.num_blocks - 1


def test_greedy_verification_skips_the_rejection_sampler_and_agrees_with_it(tiny_checkpoint, monkeypatch):
    """An all-greedy verify step takes the argmax rule directly; a batch with a sampling or penalised request
    goes through the rejection sampler. The greedy requests' tokens are the same either way."""
    import research_lm.worker.verification as verification_module

    path = str(tiny_checkpoint("llama"))
    knobs = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=32, max_num_seqs=6,
                 max_model_len=64)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    llm = LLM(path, speculative_config=spec, **knobs)
    prompts = _repetitive_prompts(llm.engine.info.vocab_size)
    want = [o.outputs[0].token_ids for o in LLM(path, **knobs).generate(prompts, greedy, use_tqdm=False)]

    calls = []
    real = verification_module.rejection_sample
    monkeypatch.setattr(verification_module, "rejection_sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0 and not calls  # verified, never rejection-sampled
    mixed = llm.generate(prompts, [greedy, sampled] * 3, use_tqdm=False)
    assert calls, "a batch with a sampling request needs the rejection sampler"
    assert [o.outputs[0].token_ids for o in mixed][::2] == want[::2]


def test_logprobs_under_speculation_match_plain_decoding(tiny_checkpoint):
    """Every emitted token carries its logprobs (the target's raw ones, top-n + the token) whether it came
    from a decode step or a verify step that emitted several; greedy and sampled requests side by side."""
    import pytest

    path = str(tiny_checkpoint("llama"))
    knobs = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=32, max_num_seqs=6,
                 max_model_len=64)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=n) for n in (2, 0, 3)]
    params += [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]  # asks for none
    prompts = _repetitive_prompts(LLM(path, **knobs).engine.info.vocab_size)[:4]
    want = LLM(path, **knobs).generate(prompts, params, use_tqdm=False)
    got = LLM(path, speculative_config=spec, **knobs).generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0  # some verify steps emitted several tokens
    for g, w, p in zip(got, want, params, strict=True):
        gc, wc = g.outputs[0], w.outputs[0]
        assert gc.token_ids == wc.token_ids
        if p.logprobs is None:
            assert gc.logprobs is None and gc.cumulative_logprob is None
            continue
        assert len(gc.logprobs) == len(gc.token_ids)
        for gl, wl, t in zip(gc.logprobs, wc.logprobs, gc.token_ids, strict=True):
            assert list(gl) == list(wl) and t in gl and len(gl) <= p.logprobs + 1
            assert [x.logprob for x in gl.values()] == pytest.approx([x.logprob for x in wl.values()], abs=1e-5)
            assert [x.rank for x in gl.values()] == [x.rank for x in wl.values()]
        assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-4)
    # A sampling request (through the rejection sampler) gets one dict per token too, its token in it.
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, logprobs=1)
    out = LLM(path, speculative_config=spec, **knobs).generate(prompts[:2], [sampled, params[0]], use_tqdm=False)
    for o in out:
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) and all(t in d for t, d in zip(c.token_ids, c.logprobs))
