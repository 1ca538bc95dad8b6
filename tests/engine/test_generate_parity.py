"""Greedy generation through the whole engine is token-identical to `transformers.generate`,
under block_size=4, chunked prefill, preemption and prefix caching with shared prefixes."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from research_lm import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
MAX_TOKENS = 10


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """8 prompts of different lengths; half share a 9-token prefix (2 full blocks of 4 + 1)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(9)]
    prompts = []
    for i, n in enumerate([3, 5, 8, 13, 17, 21, 26, 30]):
        tail = [rng.randrange(vocab) for _ in range(n)]
        prompts.append(shared + tail if i % 2 else tail)
    return prompts


def _hf_greedy(path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_tokens, like ignore_eos
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_under_pressure(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    llm = LLM(
        str(path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
        max_num_seqs=8, num_gpu_blocks=20, enable_prefix_caching=True, max_model_len=64,
    )
    prompts = _prompts(llm.engine.info.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected = _hf_greedy(path, prompts, MAX_TOKENS)
    for out, want in zip(outs, expected, strict=True):
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget should force preemption"
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0, "shared prefixes should hit the prefix cache"
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_blocks - 1  # all returned (block 0 is null)


def test_sliding_window_sequences_longer_than_window(tiny_checkpoint):
    """Mistral's window (8) is much shorter than prompt + output here; decode crosses it many times."""
    path = tiny_checkpoint("mistral")
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=64)
    prompts = [list(range(5, 45)), list(range(100, 123))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(path, prompts, 20)


def test_blocks_out_of_the_window_return_to_the_pool(tiny_checkpoint):
    """Mistral (window 8, every layer): a 60-token sequence never holds more than the window's blocks
    plus one step's worth, and greedy output is unchanged by the freeing."""
    path = tiny_checkpoint("mistral")
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=8, max_model_len=64)
    assert llm.engine.scheduler.sliding_window == 8
    prompt = list(range(7, 47))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == _hf_greedy(path, [prompt], 20)[0]
    peak_blocks = max(s["kv_cache_usage"] for s in llm.engine.metrics.steps) * (llm.engine.num_blocks - 1)
    assert round(peak_blocks) <= (8 + 8) // 4 + 2  # vs 15 blocks for 60 tokens without freeing
