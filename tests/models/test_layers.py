"""Building blocks: RoPE variants equal transformers' tables, norms fuse the residual, stacked loaders
route shards to the right rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from research_lm.models.base import CheckpointError, load_params
from research_lm.models.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    apply_rotary,
    rope_parameters,
)
from tests.conftest import TINY_SHAPE

ROPES = {
    "default": dict(rope_type="default", rope_theta=500000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128),
    "yarn-mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                        mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2),
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rotary_embedding_matches_transformers(kind):
    config = LlamaConfig(**TINY_SHAPE, rope_parameters=dict(ROPES[kind]))
    hf = LlamaRotaryEmbedding(config=config)
    ours = RotaryEmbedding(16, rope_parameters(config), config.max_position_embeddings)
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq.float(), rtol=1e-6, atol=0)
    assert ours.attention_scaling == pytest.approx(hf.attention_scaling)

    positions = torch.tensor([0, 1, 7, 63, 200, 511])
    rope = ours(positions)
    cos, sin = rope.cos, rope.sin
    q = torch.randn(len(positions), 4, 16)
    k = torch.randn(len(positions), 2, 16)
    hf_cos, hf_sin = hf(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    ours_q, ours_k = apply_rope(rope, q, k)  # what attention layers call
    torch.testing.assert_close((ours_q, ours_k), (ref_q[0].transpose(0, 1), ref_k[0].transpose(0, 1)),
                               atol=1e-5, rtol=1e-5)


def test_rope_parameters_reads_pre_v5_configs():
    old = SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(old) == {"type": "linear", "factor": 2.0, "rope_theta": 1e6, "rope_type": "linear"}
    assert rope_parameters(SimpleNamespace()) == {"rope_theta": 10000.0, "rope_type": "default"}


def test_unsupported_rope_type_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"'longrope' is not supported.*llama3"):
        RotaryEmbedding(16, {"rope_type": "longrope", "rope_theta": 1e4}, 512)


def test_partial_rotary_leaves_the_tail_unrotated():
    rope = RotaryEmbedding(16, {"rope_theta": 1e4, "partial_rotary_factor": 0.5}, 512)
    x = torch.randn(3, 2, 16)
    out, _ = apply_rope(rope(torch.tensor([0, 5, 9])), x)
    assert rope.rotary_dim == 8
    torch.testing.assert_close(out[..., 8:], x[..., 8:], atol=0, rtol=0)
    torch.testing.assert_close(out[0], x[0], atol=0, rtol=0)  # position 0: identity
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation


def test_rmsnorm_fuses_the_residual_add():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    out, residual = norm(x, r)
    torch.testing.assert_close(residual, x + r)
    s = x + r
    torch.testing.assert_close(out, norm.weight * s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())


def test_stacked_loading_routes_shards_and_requires_all_of_them():
    model = _Wrapped(torch.nn.Module())
    model.m.qkv_proj = QKVParallelLinear(hidden_size=8, head_size=2, num_heads=2, num_kv_heads=1, bias=True)
    model.m.gate_up_proj = MergedColumnParallelLinear(8, [3, 3])
    stacked = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    q, k, v = torch.randn(4, 8), torch.randn(2, 8), torch.randn(2, 8)
    gate, up = torch.randn(3, 8), torch.randn(3, 8)
    weights = [("m.q_proj.weight", q), ("m.k_proj.weight", k), ("m.v_proj.weight", v),
               ("m.q_proj.bias", torch.ones(4)), ("m.gate_proj.weight", gate), ("m.up_proj.weight", up),
               ("m.unused.weight", torch.ones(1))]
    loaded = load_params(model, weights, stacked)
    assert loaded == {"m.qkv_proj.weight", "m.gate_up_proj.weight"}  # the bias lacks its k and v shards
    torch.testing.assert_close(model.m.qkv_proj.weight.data, torch.cat([q, k, v]))
    torch.testing.assert_close(model.m.gate_up_proj.weight.data, torch.cat([gate, up]))
    stacked_bias = torch.arange(8.0)  # a checkpoint that stores qkv_proj already stacked
    assert load_params(model, [("m.qkv_proj.bias", stacked_bias)], stacked) == {"m.qkv_proj.bias"}
    torch.testing.assert_close(model.m.qkv_proj.bias.data, stacked_bias)


def test_shape_mismatch_names_the_tensor():
    model = _Wrapped(torch.nn.Module())
    model.m.gate_up_proj = MergedColumnParallelLinear(8, [3, 3])
    with pytest.raises(CheckpointError, match=r"m\.up_proj\.weight.*\(4, 8\).*\(3, 8\)"):
        load_params(model, [("m.up_proj.weight", torch.zeros(4, 8))], (("gate_up_proj", "up_proj", 1),))


class _Wrapped(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.m = inner
