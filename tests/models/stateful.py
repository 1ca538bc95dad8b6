"""Helpers for models with per-request state (Mamba): check the whole engine's greedy output against
transformers. (`tests.utils.PagedBatch` drives them without the runner, in chosen state slots.)"""

from __future__ import annotations

import copy
import random
from typing import Any

import torch
from torch import nn

from research_lm import LLM, SamplingParams


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """8 prompts of 3..39 tokens; the odd ones share a 9-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(9)]
    prompts = []
    for i, n in enumerate([3, 5, 8, 13, 17, 21, 26, 30]):
        tail = [rng.randrange(256) for _ in range(n)]
        prompts.append(shared + tail if i % 2 else tail)
    return prompts


def hf_greedy(hf: nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers.generate, greedy, exactly max_tokens each (no EOS, so no EOS masking either)."""
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, do_sample=False,
                              max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs


def engine_greedy_matches_transformers(path, hf: nn.Module, max_tokens: int = 10, **knobs: Any) -> LLM:
    """Greedy through `LLM` under chunked prefill (16 tokens a step) and preemption (20 blocks of 4 for
    8 requests of up to 49 tokens) equals transformers.generate, token for token."""
    knobs = {"dtype": "float32", "device": "cpu", "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 8,
             "num_gpu_blocks": 20, "max_model_len": 64, "enable_prefix_caching": False, **knobs}
    llm = LLM(str(path), **knobs)
    prompts = shared_prefix_prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    for out, want in zip(outs, hf_greedy(hf, prompts, max_tokens), strict=True):
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.scheduler.num_preemptions > 0, "the block budget should force preemption"
    return llm
