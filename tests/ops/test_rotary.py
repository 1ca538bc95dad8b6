"""The fused rotary kernel equals `rotary_ref` (cos/sin from positions and inv_freq, GPT-NeoX halves):
q and k in one launch, every dtype, partial rotary, attention scaling, strided q/k views, positions up to 128k.

Runs under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from research_lm.models.layers import rope_inv_freq
from research_lm.ops import rotary_ref
from research_lm.ops.rotary import rotary_embedding
from tests.ops.cases import DTYPES, assert_matches, device, poison_outputs, randn


def _inv_freq(rotary_dim: int, rope_type: str = "default") -> tuple[torch.Tensor, float]:
    params = {"rope_theta": 500000.0, "rope_type": rope_type}
    if rope_type == "yarn":
        params.update(factor=4.0, original_max_position_embeddings=128)
    inv_freq, scaling = rope_inv_freq(params, rotary_dim, 512)
    return inv_freq.to(device()), scaling


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("heads, head_size, rotary_dim", [((4, 2), 16, 16), ((3, 1), 24, 12), ((5, 5), 20, 16)])
def test_rotary_matches_reference(dtype, num_tokens, heads, head_size, rotary_dim):
    """Odd head counts (non powers of 2), MQA (1 KV head), partial rotary (the tail passes through)."""
    gen = torch.Generator().manual_seed(num_tokens * 100 + head_size)
    q = randn((num_tokens, heads[0], head_size), dtype, gen)
    k = randn((num_tokens, heads[1], head_size), dtype, gen)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(device())
    inv_freq, scaling = _inv_freq(rotary_dim)
    q_before, k_before = q.clone(), k.clone()
    with poison_outputs():
        got_q, got_k = rotary_embedding(q, k, positions, inv_freq, scaling)
    want_q, want_k = rotary_ref(q, k, positions, inv_freq, scaling)
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)
    torch.testing.assert_close(got_q[..., rotary_dim:], q[..., rotary_dim:], atol=0, rtol=0)
    torch.testing.assert_close((q, k), (q_before, k_before), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_attention_scaling_on_qkv_views(dtype):
    """YaRN scales cos and sin; q and k are views into one qkv GEMM output (token stride = q + 2 kv sizes)."""
    gen = torch.Generator().manual_seed(11)
    num_tokens, hq, hk, d = 4, 4, 2, 16
    qkv = randn((num_tokens, (hq + 2 * hk) * d), dtype, gen)
    q = qkv[:, : hq * d].view(num_tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(num_tokens, hk, d)
    positions = torch.tensor([0, 1, 300, 131071], device=device())  # 128k: cos/sin range reduction matters
    inv_freq, scaling = _inv_freq(d, "yarn")
    assert scaling != 1.0
    got_q, got_k = rotary_embedding(q, k, positions, inv_freq, scaling)
    want_q, want_k = rotary_ref(q, k, positions, inv_freq, scaling)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)


def test_rotary_without_k_and_at_position_zero():
    """k=None rotates q alone (DeepSeek's MLA calls); position 0 with scaling 1 is the identity."""
    gen = torch.Generator().manual_seed(5)
    q = randn((2, 3, 8), torch.float32, gen)
    inv_freq, _ = _inv_freq(8)
    got_q, got_k = rotary_embedding(q, None, torch.zeros(2, dtype=torch.int64, device=device()), inv_freq, 1.0)
    assert got_k is None
    torch.testing.assert_close(got_q, q, atol=0, rtol=0)
    moved, _ = rotary_embedding(q, None, torch.tensor([3, 9], device=device()), inv_freq, 1.0)
    assert_matches(moved, rotary_ref(q, None, torch.tensor([3, 9], device=device()), inv_freq, 1.0)[0])
    assert not torch.allclose(moved, q)
