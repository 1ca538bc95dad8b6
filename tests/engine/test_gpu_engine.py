"""The engine on CUDA: the Triton backend generates the same greedy tokens as the torch reference
and as transformers (fp32, so the comparison is exact)."""

from __future__ import annotations

import pytest
import torch

from research_lm import LLM, SamplingParams
from tests.engine.test_generate_parity import _hf_greedy, _prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_triton_engine_matches_torch_ref_and_transformers(arch, tiny_checkpoint):
    path = str(tiny_checkpoint(arch))
    knobs = dict(dtype="float32", device="cuda", block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                 num_gpu_blocks=20, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = LLM(path, attention_backend="torch_ref", **knobs)
    prompts = _prompts(ref.engine.info.vocab_size)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    tri = LLM(path, attention_backend="triton", **knobs)
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert want == _hf_greedy(path, prompts, 10)
    assert tri.engine.scheduler.num_preemptions > 0


def test_memory_derived_kv_budget_on_cuda():
    llm = LLM("tiny-llama", device="cuda", gpu_memory_utilization=0.3, max_model_len=256)
    out = llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in out)
    assert llm.engine.num_blocks > 1000  # a fraction of an H100/H200 holds many tiny-llama blocks


def test_parallel_sampling_and_stop_strings_match_the_cpu_engine():
    """n > 1, seeded temperature sampling, a stop string and logit_bias give the same completions on CUDA (graphs,
    async scheduling, Triton attention) as on the CPU: the noise is counter-based and device-independent."""
    prompts = ["def parse(", "import os\n", "class Node:"]
    free = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    cpu = LLM("tiny-llama", device="cpu", dtype="float32")
    texts = [c.text for o in cpu.generate(prompts, free, use_tqdm=False) for c in o.outputs]
    stop = next(t[8:10] for t in texts if len(t) >= 10 and t[8:10].strip())
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, stop=[stop],
                            logit_bias={5: 2.0})
    want = [(c.token_ids, c.text, c.finish_reason) for o in cpu.generate(prompts, params, use_tqdm=False)
            for c in o.outputs]
    gpu = LLM("tiny-llama", device="cuda", dtype="float32", attention_backend="triton")
    got = [(c.token_ids, c.text, c.finish_reason) for o in gpu.generate(prompts, params, use_tqdm=False)
           for c in o.outputs]
    assert got == want
    assert any(reason == "stop" for _, _, reason in want)
