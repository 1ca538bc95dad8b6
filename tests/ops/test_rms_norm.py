"""The fused RMSNorm kernel equals `rms_norm_ref` (transformers' LlamaRMSNorm numbers), with and without the
residual add, for every dtype, odd widths, one and several rows, strided per-head views; inputs stay intact.

Runs under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from research_lm.ops import rms_norm_ref
from research_lm.ops.rms_norm import rms_norm
from tests.ops.cases import DTYPES, assert_matches, device, poison_outputs, randn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 67), (3, 200)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = randn((rows, hidden), dtype, gen) * 3
    residual = randn((rows, hidden), dtype, gen) if with_residual else None
    weight = (1 + 0.5 * randn((hidden,), torch.float32, gen)).to(dtype)
    x_before = x.clone()
    with poison_outputs():
        got = rms_norm(x, weight, 1e-5, residual)
    want = rms_norm_ref(x, weight, 1e-5, residual)
    if with_residual:
        assert_matches(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the residual stream: one rounded add
    else:
        assert_matches(got, want)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_strided_head_views(dtype):
    """Qwen3's q/k norm: [tokens, heads, head_size] views into the qkv output (token stride != heads * size)."""
    gen = torch.Generator().manual_seed(7)
    qkv = randn((3, 4 * 16 + 2 * 16), dtype, gen)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    weight = (1 + 0.5 * randn((16,), torch.float32, gen)).to(dtype)
    got = rms_norm(q, weight, 1e-6)
    assert got.shape == q.shape and got.is_contiguous()
    assert_matches(got, rms_norm_ref(q, weight, 1e-6))


def test_rms_norm_promotes_like_torch_for_an_fp32_weight():
    gen = torch.Generator().manual_seed(3)
    x, weight = randn((2, 33), torch.bfloat16, gen), 1 + randn((33,), torch.float32, gen)
    got, want = rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    assert_matches(got, want)


def test_rms_norm_of_zero_rows():
    x = torch.empty(0, 8, device=device())
    assert rms_norm(x, torch.ones(8, device=device()), 1e-6).shape == (0, 8)
