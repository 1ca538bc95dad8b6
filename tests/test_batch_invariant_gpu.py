"""Batch invariance on the GPU: bf16, the triton attention backend, CUDA graphs and async scheduling on (defaults).

With `batch_invariant=True` a request's tokens and logprobs are the same bits alone, in a batch of 64 others,
under chunked prefill and under preemption; greedy speculative decoding (ngram, EAGLE-3) gives plain greedy's
tokens at batch 1 and 32; seeded sampling gives the same tokens alone and in a batch. The first test shows that
the default path (cuBLAS) does depend on M, so these tests could fail. The kernels themselves are tested against
their references in tests/ops/test_batch_invariant.py.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
import torch.nn.functional as F

from research_lm import LLM, SamplingParams
from research_lm.api.outputs import RequestOutput
from research_lm.ops import batch_invariant as bi

pytestmark = pytest.mark.gpu

KNOBS = dict(dtype="bfloat16", device="cuda", attention_backend="triton", batch_invariant=True, max_model_len=512)
VOCAB = 1024  # tiny-llama's
NUM_OTHERS = 64


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _llm(**knobs) -> LLM:
    """An engine with the switch on and a fixed KV budget (several engines share the GPU in one test)."""
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM("tiny-llama", **{**KNOBS, "num_gpu_blocks": 4096, **knobs})
    assert llm.engine.runner.cuda_graphs is not None, "CUDA graphs must stay on"
    return llm


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(10, 200))] for _ in range(n)]


def _results(outputs: list[RequestOutput]) -> list[tuple[list[int], list[dict[int, tuple[float, int]]] | None]]:
    """Per request: its tokens and, where asked, every logprob entry (token -> (logprob, rank)), as exact floats."""
    out = []
    for o in outputs:
        c = o.outputs[0]
        logprobs = None if c.logprobs is None else [{t: (lp.logprob, lp.rank) for t, lp in d.items()}
                                                    for d in c.logprobs]
        out.append((list(c.token_ids), logprobs))
    return out


def test_the_default_linear_depends_on_m_and_the_invariant_one_does_not():
    """cuBLAS picks its kernel by M: the first rows of x W^T change with the number of rows (Thinking Machines'
    demonstration). The invariant kernel's do not."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2048, 4096, device="cuda", generator=gen).bfloat16()
    w = torch.randn(4096, 4096, device="cuda", generator=gen).bfloat16()
    sizes = [1, 2, 3, 4, 8, 16, 31, 64, 128, 256, 512]
    full = F.linear(x, w)
    differs = [m for m in sizes if not torch.equal(F.linear(x[:m], w), full[:m])]
    assert differs, "cuBLAS gave every M the same rows here: this test needs another shape on this GPU"
    full = bi.linear(x, w)
    assert [m for m in sizes if not torch.equal(bi.linear(x[:m], w), full[:m])] == []


def test_a_request_is_the_same_alone_in_a_batch_chunked_and_preempted():
    """Greedy, logprobs asked: one request alone, then among 64 others (its prompt now partly a cached prefix);
    every request of that batch again under chunked prefill (32-token steps) and under preemption (40 KV blocks)."""
    target = _prompts(1, seed=1)[0]
    others = _prompts(NUM_OTHERS, seed=2)
    prompts = others[: NUM_OTHERS // 2] + [target] + others[NUM_OTHERS // 2 :]
    rng = random.Random(3)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(5, 60), ignore_eos=True, logprobs=5)
              for _ in prompts]
    where = NUM_OTHERS // 2
    params[where] = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5)

    llm = _llm(max_num_seqs=80)
    assert llm.engine.async_scheduling
    alone = _results(llm.generate([target], params[where], use_tqdm=False))[0]
    batch = _results(llm.generate(prompts, params, use_tqdm=False))
    assert batch[where] == alone
    del llm

    chunked = _llm(max_num_batched_tokens=32, max_num_seqs=16)
    assert _results(chunked.generate(prompts, params, use_tqdm=False)) == batch
    del chunked

    tight = _llm(max_num_seqs=80, num_gpu_blocks=40)
    assert _results(tight.generate(prompts, params, use_tqdm=False)) == batch
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_speculative_decoding_gives_plain_greedys_tokens(method):
    """At batch 1 and 32: the verify forward (k + 1 tokens per request) scores each position as decode does."""
    spec = {"method": method, "num_speculative_tokens": 3}
    spec |= {"model": "tiny-llama-eagle3"} if method == "eagle3" else {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = [f"def function_{i}(values):\n    total = 0\n    for value in values:\n" for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = _llm(max_num_seqs=32)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    llm = _llm(max_num_seqs=32, speculative_config=spec)
    one = llm.generate(prompts[:1], params, use_tqdm=False)
    many = llm.generate(prompts, params, use_tqdm=False)
    assert one[0].outputs[0].token_ids == want[0]
    assert [o.outputs[0].token_ids for o in many] == want
    assert sum(o.metrics.num_draft_tokens for o in many) > 0
    if method == "eagle3":
        assert sum(o.metrics.num_accepted_tokens for o in many) > 0


def test_seeded_sampling_is_the_same_alone_and_in_a_batch():
    """Temperature, top-k and top-p with a seed, logprobs asked: the same tokens and logprobs beside 64 other
    requests (greedy and sampled, with seeds of their own)."""
    target = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=11, max_tokens=48, ignore_eos=True,
                            logprobs=3)
    rng = random.Random(4)
    others = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), seed=rng.randrange(1000),
                             max_tokens=rng.randrange(5, 60), ignore_eos=True) for _ in range(NUM_OTHERS)]
    prompt = _prompts(1, seed=5)[0]
    llm = _llm(max_num_seqs=80)
    alone = _results(llm.generate([prompt], target, use_tqdm=False))[0]
    batch = _results(llm.generate([*_prompts(NUM_OTHERS, seed=6), prompt], [*others, target], use_tqdm=False))
    assert batch[-1] == alone
