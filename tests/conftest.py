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

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

# Tests run tiny ops in parallel pytest workers: intra-op threads only add spin-wait overhead.
torch.set_num_threads(1)

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
