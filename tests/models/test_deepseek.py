"""DeepSeek-V2/V3 dense configs (MoE: test_deepseek_moe.py) over the MLA backends match transformers.

Oracle: transformers' eager model on the same tiny checkpoint, one sequence at a time, fp32.
Ours: `load_model` with `mla_backend` = mla_torch_ref or mla_triton (Triton interpreter on CPU),
many sequences per forward, latents in blocks of 4; and the whole engine through `research_lm.LLM`
under chunked prefill, preemption and prefix caching.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attention_zoo import AttentionSpec, CacheLayer  # noqa: E402
from attention_zoo.mla import MLAAttention  # noqa: E402
from research_lm import LLM, SamplingParams  # noqa: E402
from research_lm.models import build_model, load_config, load_model  # noqa: E402
from tests.utils import PagedBatch  # noqa: E402

ATOL = 1e-4
MODELS = ["deepseek-v2", "deepseek-v2-no-q-lora", "deepseek-v3", "deepseek-v3-no-interleave"]
BACKENDS = ["mla_torch_ref", "mla_triton"]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _load(tiny_checkpoint, name: str, backend: str = "mla_torch_ref"):
    model, _ = load_model(tiny_checkpoint(name), device="cpu", dtype=torch.float32, attention_backend="torch_ref",
                          extra={"mla_backend": backend})  # fmt: skip
    return model


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("name", MODELS)
def test_batched_prefill_matches_transformers(name, tiny_checkpoint, hf_model):
    """q_lora on/off, biases, YaRN with mscale (V3), interleaved and half-split RoPE, v_head_dim != nope."""
    model = _load(tiny_checkpoint, name)
    seqs = [_tokens(n, seed) for seed, n in enumerate([19, 5, 1])]
    for tokens, logits in zip(seqs, PagedBatch(model, [len(s) for s in seqs], block_size=4).step(seqs)):
        torch.testing.assert_close(logits, _hf_logits(hf_model(name), tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v3"])
def test_chunked_prefill_and_decode_match_transformers(name, backend, tiny_checkpoint, hf_model):
    """Uneven chunks (prefill pieces after cached context, decodes, idle steps) in mixed batches: every
    chunk's logits equal the full-sequence logits at its positions."""
    model = _load(tiny_checkpoint, name, backend)
    seqs = [_tokens(17, 10), _tokens(9, 11)]
    schedule = [(6, 3), (5, 4), (1, 1), (1, 0), (3, 1), (1, 0)]  # tokens per sequence per step
    batch = PagedBatch(model, [len(s) for s in seqs], block_size=4)
    done, got = [0, 0], [[], []]
    for step in schedule:
        chunks = [seq[d:d + n] for seq, d, n in zip(seqs, done, step)]
        for i, logits in enumerate(batch.step(chunks)):
            got[i].append(logits)
        done = [d + n for d, n in zip(done, step)]
    for tokens, pieces in zip(seqs, got):
        torch.testing.assert_close(torch.cat(pieces), _hf_logits(hf_model(name), tokens), atol=ATOL, rtol=0)


def _hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, pad_token_id=0, eos_token_id=None)  # fmt: skip
        outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("name, backend", [("deepseek-v2", "mla_torch_ref"), ("deepseek-v3", "mla_triton")])
def test_greedy_generation_matches_transformers_under_pressure(name, backend, tiny_checkpoint, hf_model):
    """block_size 4, 8-token steps (chunked prefill), 14 blocks (preemption), shared prefixes (prefix cache)."""
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(9)]
    prompts = [([rng.randrange(256) for _ in range(n)] if i % 2 else shared + [rng.randrange(256) for _ in range(n)])
               for i, n in enumerate([3, 12, 6, 1, 10])]  # fmt: skip
    llm = LLM(str(tiny_checkpoint(name)), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=8,
              max_num_seqs=4, num_gpu_blocks=14, enable_prefix_caching=True, max_model_len=48, mla_backend=backend)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    expected = _hf_greedy(hf_model(name), prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget should force preemption"
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0, "shared prefixes should hit the prefix cache"


def test_layers_carry_the_mla_spec_and_transformers_softmax_scale(tiny_checkpoint, hf_model):
    """V3 with YaRN: scale = (nope + rope)^-0.5 * mscale(4, 0.8)^2, as transformers computes it."""
    model = _load(tiny_checkpoint, "deepseek-v3")
    layers = [m for m in model.modules() if isinstance(m, CacheLayer)]
    assert len(layers) == 2 and all(isinstance(layer, MLAAttention) for layer in layers)
    hf_scale = hf_model("deepseek-v3").model.layers[0].self_attn.scaling
    assert hf_scale != pytest.approx(24**-0.5)  # the mscale matters in this config
    for layer in layers:
        spec = layer.spec
        assert (spec.kind, spec.num_heads, spec.num_kv_heads, spec.head_size) == ("mla", 4, 1, 32 + 8)
        assert (spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim) == (32, 16, 8, 12)
        assert spec.scale == pytest.approx(hf_scale, rel=1e-12)


def test_latent_cache_page_is_smaller_than_dense_attention(tiny_checkpoint):
    """Per token and layer: L + R = 40 values, vs 2 * 4 heads * (16 + 8) for the same heads unabsorbed."""
    model = _load(tiny_checkpoint, "deepseek-v2")
    spec = next(m for m in model.modules() if isinstance(m, CacheLayer)).spec
    assert spec.page_size_bytes(4, torch.float32) == 4 * (32 + 8) * 4
    dense = AttentionSpec(num_heads=4, num_kv_heads=4, head_size=16 + 8, scale=1.0)
    assert spec.page_size_bytes(4, torch.float32) < dense.page_size_bytes(4, torch.float32) == 2 * 4 * 4 * 24 * 4


def test_load_weights_reports_every_parameter(tiny_checkpoint):
    from research_lm.models.loader import checkpoint_files, iter_checkpoint

    for name in ["deepseek-v2", "deepseek-v2-no-q-lora"]:
        model = _load(tiny_checkpoint, name)
        loaded = model.load_weights(iter_checkpoint(checkpoint_files(tiny_checkpoint(name))))
        assert loaded == {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.weight" in loaded  # no q_lora: nothing fused
    model = _load(tiny_checkpoint, "deepseek-v2")
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.1.self_attn.fused_qkv_a_proj.bias", "model.layers.1.mlp.gate_up_proj.bias"} <= names


def test_routed_layers_are_moe_and_dense_backends_fail_at_build_with_a_sentence(tiny_checkpoint):
    from research_lm.moe.layer import MoeBlock

    config = load_config(tiny_checkpoint("deepseek-v3"))
    config.first_k_dense_replace = 1  # layer 1 is routed
    model = build_model(config, device="cpu", dtype=torch.float32, attention_backend="torch_ref")
    assert isinstance(model.model.layers[1].mlp, MoeBlock)
    config.first_k_dense_replace, config.n_routed_experts = 0, 0  # no routed experts: all dense
    build_model(config, device="cpu", dtype=torch.float32, attention_backend="torch_ref")
    with pytest.raises(ValueError, match=r"'torch_ref' does not implement mla layers.*mla_torch_ref"):
        build_model(config, device="cpu", dtype=torch.float32, attention_backend="torch_ref",
                    extra={"mla_backend": "torch_ref"})  # fmt: skip
