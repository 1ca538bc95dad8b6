"""RMSNorm, optionally after the residual add, in one pass over each row.

Why: in torch an RMSNorm is ~7 kernels (float cast, pow, mean, add eps + rsqrt, mul, cast, weight mul; one
more for the residual add), each reading and writing the whole row. At batch-1 decode they are all launch
bound; one kernel per norm keeps the row in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2, num_warps_for, round_to


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, hidden] as (outer, inner) strides; see _row_layout
    residual_ptr,  # like x; unused without HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [rows, hidden] contiguous
    sum_ptr,  # [rows, hidden] contiguous: x + residual; unused without HAS_RESIDUAL
    inner,  # rows = outer * inner
    x_stride_outer,
    x_stride_inner,
    r_stride_outer,
    r_stride_inner,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # power of 2 >= hidden
):
    row = tl.program_id(0).to(tl.int64)
    outer, inner_i = row // inner, row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + outer * x_stride_outer + inner_i * x_stride_inner + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + outer * r_stride_outer + inner_i * r_stride_inner + cols, mask=mask, other=0.0)
        x = round_to(x + r.to(tl.float32), dtype)  # the residual stream, stored in x's dtype
        tl.store(sum_ptr + row * hidden + cols, x, mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = round_to(x * rstd, dtype) * w
    tl.store(out_ptr + row * hidden + cols, round_to(y, out_ptr.dtype.element_ty), mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[int, int, int]:
    """(inner, outer stride, inner stride) addressing the rows of a 1-3 dim tensor: row = outer * inner + i."""
    if t.dim() == 1:
        return 1, 0, 0
    if t.dim() == 2:
        return 1, t.stride(0), 0
    return t.shape[1], t.stride(0), t.stride(1)


def rms_norm(
    x: torch.Tensor,  # [..., hidden], 1-3 dims, last dim contiguous (e.g. per-head q/k views)
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # x's shape and dtype, last dim contiguous
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_ref` in one kernel; outputs are new contiguous tensors (inputs are never written)."""
    hidden = x.shape[-1]
    assert 1 <= x.dim() <= 3 and x.stride(-1) == 1, (x.shape, x.stride())
    assert weight.shape == (hidden,) and weight.is_contiguous() and weight.device == x.device, weight.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = out
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        assert residual.stride(-1) == 1 and residual.device == x.device
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // hidden if hidden else 0
    if rows:
        inner, x_outer, x_inner = _row_layout(x)
        _, r_outer, r_inner = _row_layout(residual) if residual is not None else (1, 0, 0)
        block = next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, summed, inner, x_outer, x_inner,
            r_outer, r_inner, hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=num_warps_for(block),
        )
    return out if residual is None else (out, summed)
