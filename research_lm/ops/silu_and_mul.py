"""SwiGLU's activation: silu(gate) * up from the merged gate_up projection, in one kernel.

Why: in torch this is chunk + silu + mul (2 kernels, plus a copy when the chunk is not contiguous for the
next GEMM); one kernel reads gate_up once and writes the [.., intermediate] input of down_proj.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2, round_to


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [rows, 2 * n]: gate | up
    out_ptr,  # [rows, n] contiguous
    x_stride,
    n,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)  # F.silu stores in x's dtype before the multiply
    tl.store(out_ptr + row * n + cols, round_to(act * up, dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2 * I], rows at any stride, dim stride 1 -> [..., I]
    """`silu_and_mul_ref` in one kernel."""
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1, (x.shape, x.stride())
    n = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])  # a view for the [num_tokens, 2 * I] GEMM outputs models pass
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if x2d.shape[0] and n:
        block = min(next_power_of_2(n), 1024)
        _silu_and_mul_kernel[(x2d.shape[0], triton.cdiv(n, block))](
            x2d, out, x2d.stride(0), n, BLOCK=block, num_warps=4 if block >= 512 else 1,
        )
    return out
