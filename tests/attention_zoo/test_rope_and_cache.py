"""`rope_and_cache` (attention_zoo/triton_kernels/kv_write.py): the rotary embedding of q and k and the KV write in
one kernel gives `rotary_ref` (research_lm's torch reference) followed by `reshape_and_cache`, within a rounding step
as the rotary kernel does (cos/sin in fp32 on either side), v and untouched slots bit for bit: padding slots left
alone, partial rotary's tail copied, strided q/k/v views of a fused qkv output. And a model on the triton
backend gives the same greedy tokens with its attention rotating k into the cache as with the model rotating first.
Under the Triton interpreter on CPU (fp32 and fp16: the interpreter truncates bf16 casts); bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch

import research_lm.ops
from attention_zoo.triton_kernels import reshape_and_cache, rope_and_cache
from research_lm import LLM, SamplingParams
from research_lm.models.layers import rope_inv_freq
from research_lm.ops.reference import rotary_ref
from tests.ops.cases import assert_matches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(dtype: torch.dtype, rotary_dim: int, device: str = DEVICE):
    gen = torch.Generator().manual_seed(rotary_dim)
    t, hq, hk, d, blocks, bs = 5, 4, 2, 32, 6, 4
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = (x.view(t, -1, d).to(device) for x in (q, k, v))  # strided views, as the model hands them over
    cache = torch.randn(2, blocks, bs, hk, d, generator=gen).to(dtype).to(device)
    slots = torch.tensor([3, 9, -1, 17, 22], device=device)  # one padding token
    positions = torch.tensor([3, 9, 0, 130, 4000], device=device)
    inv_freq, scaling = rope_inv_freq({"rope_theta": 10000.0}, rotary_dim, 8192)
    return q, k, v, cache, slots, positions, inv_freq.float().to(device), scaling


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
def test_rope_and_cache_is_rotary_then_the_kv_write(dtype, rotary_dim):
    q, k, v, cache, slots, positions, inv_freq, scaling = _case(dtype, rotary_dim)
    want_q, want_k = rotary_ref(q, k, positions, inv_freq, scaling)
    want_cache = cache.clone()
    reshape_and_cache(want_k, v, want_cache, slots)
    got_cache = cache.clone()
    got_q = rope_and_cache(q, k, v, got_cache, slots, positions, inv_freq, scaling)
    assert_matches(got_q, want_q)
    assert_matches(got_cache, want_cache)
    written = slots[slots >= 0]
    untouched = torch.ones(cache[0].numel() // cache.shape[-1] // cache.shape[-2], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    flat = (cache.flatten(1, 2), got_cache.flatten(1, 2))
    assert torch.equal(flat[1][:, untouched], flat[0][:, untouched])  # padding wrote nothing
    assert torch.equal(got_cache[1].flatten(0, 1)[written], want_cache[1].flatten(0, 1)[written])  # v copied


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_rope_and_cache_in_bf16():
    test_rope_and_cache_is_rotary_then_the_kv_write(torch.bfloat16, 32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant (fused ops on CPU)")
def test_a_model_decodes_the_same_with_k_rotated_into_the_cache(monkeypatch):
    monkeypatch.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))  # the kernels' path on CPU
    calls = []
    import attention_zoo.triton_attn as triton_attn

    real = triton_attn.rope_and_cache
    monkeypatch.setattr(triton_attn, "rope_and_cache", lambda *a: calls.append(1) or real(*a))
    knobs = dict(device="cpu", dtype="float32", attention_backend="triton", max_model_len=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["def add(a, b):\n", "import os\n"]
    fused = [o.outputs[0].token_ids for o in LLM("tiny-llama", **knobs).generate(prompts, params, use_tqdm=False)]
    assert calls
    monkeypatch.setattr(triton_attn.TritonAttentionBackend, "capabilities",
                        triton_attn.TritonAttentionBackend.capabilities.__class__(
                            **{**vars(triton_attn.TritonAttentionBackend.capabilities), "rope_in_kv_write": False}))
    calls.clear()
    apart = [o.outputs[0].token_ids for o in LLM("tiny-llama", **knobs).generate(prompts, params, use_tqdm=False)]
    assert not calls and fused == apart
