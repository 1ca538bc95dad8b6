"""Shared fixtures: tiny random Hugging Face checkpoints, written by `transformers` itself.

    def test_something(tiny_checkpoint, hf_model):
        path = tiny_checkpoint("qwen2")      # a directory: config.json + model.safetensors
        oracle = hf_model("qwen2")           # transformers' model loaded from that directory (eager, fp32)

Names are the keys of `TINY_MODELS` (llama, llama-tied, llama-sharded, llama-bin, qwen2, qwen3,
mistral, ...). Each checkpoint is built once per test session, from a fixed seed, with weights
drawn large enough (std 0.1, norm weights around 1, random biases) that a wrong layer shows up in
the logits well above fp32 noise. Shapes: hidden 64, 4 heads of 16, 2 KV heads, vocab 256.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

# CI must be green or red for the code, not for the draw: property tests run a fixed set of examples (a
# local search for new counterexamples: HYPOTHESIS_PROFILE=explore).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tests run tiny ops in parallel pytest workers: intra-op threads only add spin-wait overhead.
torch.set_num_threads(1)
# Without CUDA every Triton kernel runs in the interpreter; set before any test module defines a
# kernel (triton.jit reads it at decoration time), whichever module pytest imports first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6,
)
SLIDING_WINDOW = 8  # smaller than the sequences the tests run, so the window matters


@dataclass(frozen=True)
class TinyModel:
    config_class: str  # a transformers config class
    overrides: dict[str, Any] = field(default_factory=dict)  # on top of TINY_SHAPE
    max_shard_size: str | None = None  # save sharded with an index
    pickled: bool = False  # pytorch_model.bin instead of safetensors


TINY_MODELS: dict[str, TinyModel] = {
    "llama": TinyModel("LlamaConfig"),
    "llama-gqa1": TinyModel("LlamaConfig", dict(num_key_value_heads=1, num_hidden_layers=3)),
    "llama-mha": TinyModel("LlamaConfig", dict(num_key_value_heads=4)),
    "llama-bias": TinyModel("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "llama-tied": TinyModel("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama-sharded": TinyModel("LlamaConfig", max_shard_size="20KB"),
    "llama-bin": TinyModel("LlamaConfig", pickled=True),
    "llama-rope-llama3": TinyModel("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "llama-rope-yarn": TinyModel("LlamaConfig", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128))),
    "mistral": TinyModel("MistralConfig", dict(sliding_window=SLIDING_WINDOW)),
    "qwen2": TinyModel("Qwen2Config"),
    # window on layers >= max_window_layers, as transformers derives `layer_types`
    "qwen2-sliding": TinyModel("Qwen2Config", dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1)),
    "qwen3": TinyModel("Qwen3Config"),
    "qwen3-layer-types": TinyModel("Qwen3Config", dict(
        use_sliding_window=True, sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"])),
    # Mamba2: 8 SSM heads of 16 (expand 2), state 16, conv 4; SSD chunks of 8 so prompts span several. One
    # B/C group, like Mamba2-2.7B and Bamba-9B (transformers < 5.2x normalizes the gated norm over all groups).
    "mamba2": TinyModel("Mamba2Config", dict(
        num_heads=8, head_dim=16, expand=2, n_groups=1, state_size=16, conv_kernel=4, chunk_size=8)),
    # Two B/C groups (tensor parallelism: a group per rank at N = 2, a group split over 2 ranks at N = 4); not for
    # transformers parity, whose gated norm is over all groups (above)
    "mamba2-groups": TinyModel("Mamba2Config", dict(
        num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16, conv_kernel=4, chunk_size=8)),
    # Bamba: Mamba2 layers 0 and 2, attention (half-rotary GQA) at layer 1, a SwiGLU MLP in every layer
    "bamba": TinyModel("BambaConfig", dict(
        num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_chunk_size=8)),
    # MLA: 4 heads, latent 32 + rope 8, nope 16, v 12 (!= nope); every layer dense (first_k_dense_replace).
    # V3 keeps an explicit head_dim (TINY_SHAPE: 16) as its RoPE size: set it to qk_rope_head_dim.
    "deepseek-v2": TinyModel("DeepseekV2Config", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, first_k_dense_replace=2, attention_bias=True, mlp_bias=True)),
    "deepseek-v2-no-q-lora": TinyModel("DeepseekV2Config", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, first_k_dense_replace=2)),
    "deepseek-v3": TinyModel("DeepseekV3Config", dict(
        head_dim=8, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, first_k_dense_replace=2, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
            mscale=1.0, mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0))),
    "deepseek-v3-no-interleave": TinyModel("DeepseekV3Config", dict(
        head_dim=8, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, first_k_dense_replace=3, num_hidden_layers=3, rope_interleave=False)),
    # DeepSeek MoE (MLA as above): 8 routed experts of 32 in 4 groups of 2, top-3 from the best 2 groups, shared
    # experts. V2: softmax, group_limited_greedy, scaled, every layer routed, biased shared experts (mlp_bias).
    # V3: sigmoid, noaux_tc (e_score_correction_bias: a buffer, saved as zeros; tests/models/test_deepseek_moe.py
    # writes random values), renormalised and scaled, layer 0 dense.
    "deepseek-v2-moe": TinyModel("DeepseekV2Config", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, first_k_dense_replace=0, mlp_bias=True, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5)),
    "deepseek-v3-moe": TinyModel("DeepseekV3Config", dict(
        head_dim=8, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5)),
    # MoE: 8 experts, top-2. Mixtral renormalises the top-k; Qwen2-MoE adds a gated shared expert and
    # keeps layer 1 dense (mlp_only_layers); Qwen3-MoE renormalises (norm_topk_prob) and has q/k norms.
    "mixtral": TinyModel("MixtralConfig", dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2-moe": TinyModel("Qwen2MoeConfig", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3-moe": TinyModel("Qwen3MoeConfig", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise)


def build_tiny_checkpoint(name: str, out_dir: Path) -> Path:
    """Write TINY_MODELS[name] to out_dir with `save_pretrained` and return out_dir."""
    import transformers
    from safetensors.torch import load_file

    spec = TINY_MODELS[name]
    config = getattr(transformers, spec.config_class)(**{**TINY_SHAPE, **spec.overrides})
    seed = zlib.crc32(name.encode())
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    if spec.pickled:
        weights = out_dir / "model.safetensors"
        torch.save(load_file(weights), out_dir / "pytorch_model.bin")
        weights.unlink()
    return out_dir


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """Factory: name in TINY_MODELS -> checkpoint directory (built once per session). Treat as read-only;
    copy it (shutil.copytree) before breaking it."""
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            cache[name] = build_tiny_checkpoint(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return make


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint) -> Callable[[str], torch.nn.Module]:
    """Factory: name -> transformers' model reloaded from the tiny checkpoint (fp32, eager attention, eval)."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, torch.nn.Module] = {}

    def load(name: str) -> torch.nn.Module:
        if name not in cache:
            model = AutoModelForCausalLM.from_pretrained(
                tiny_checkpoint(name), dtype=torch.float32, attn_implementation="eager"
            )
            cache[name] = model.eval()
        return cache[name]

    return load
