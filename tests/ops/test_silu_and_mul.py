"""The fused SiLU-and-mul kernel equals `silu_and_mul_ref` (F.silu(gate) * up from the merged gate_up output)
for every dtype, odd widths, and widths spanning several column blocks.

Runs under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from research_lm.ops import silu_and_mul_ref
from research_lm.ops.silu_and_mul import silu_and_mul
from tests.ops.cases import DTYPES, assert_matches, poison_outputs, randn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, intermediate", [(1, 64), (4, 37), (2, 1500)])
def test_silu_and_mul_matches_reference(dtype, rows, intermediate):
    gen = torch.Generator().manual_seed(rows * 10_000 + intermediate)
    x = randn((rows, 2 * intermediate), dtype, gen) * 4  # reaches silu's saturated tails
    x_before = x.clone()
    with poison_outputs():
        got = silu_and_mul(x)
    assert_matches(got, silu_and_mul_ref(x))
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)


def test_silu_and_mul_keeps_leading_dims():
    gen = torch.Generator().manual_seed(1)
    x = randn((2, 3, 2 * 10), torch.float16, gen)
    got = silu_and_mul(x)
    assert got.shape == (2, 3, 10)
    assert_matches(got, silu_and_mul_ref(x))
