"""Shared helpers for the kernel tests: dtypes, seeded inputs, tolerances, poisoned allocations."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernels round where torch rounds; what is left is fp32 arithmetic order (reductions, fma, cos/sin
# implementations): at most one step of the output dtype, and only on a few elements.
ULP = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device())


def assert_matches(got: torch.Tensor, want: torch.Tensor, max_mismatch_frac: float = 0.02) -> None:
    """Same shape and dtype; every element within one output-dtype rounding step (relative); and in 16-bit
    dtypes all but a few elements bit-identical, so a kernel that skips a rounding torch does still fails
    (fp32 outputs carry the arithmetic-order noise in their last bits)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert torch.isfinite(got).all(), "non-finite output (unwritten or poisoned elements?)"
    tol = ULP[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if want.dtype == torch.float32:
        return
    mismatched = (got != want).float().mean().item()
    assert mismatched <= max_mismatch_frac, f"{mismatched:.1%} of elements differ from the reference"


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Make torch.empty return NaN-filled tensors, so an element a kernel forgets to write shows up."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real_empty
