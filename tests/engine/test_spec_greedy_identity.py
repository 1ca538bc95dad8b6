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
    import research_lm.runner as runner_module

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
    real = runner_module.load_rejection_sampler
    monkeypatch.setattr(runner_module, "load_rejection_sampler", lambda: calls.append(1) or real())
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0 and not calls  # verified, never rejection-sampled
    mixed = llm.generate(prompts, [greedy, sampled] * 3, use_tqdm=False)
    assert calls, "a batch with a sampling request needs the rejection sampler"
    assert [o.outputs[0].token_ids for o in mixed][::2] == want[::2]
