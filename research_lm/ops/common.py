"""What the kernels share: dtype rounding as torch does it, block and warp sizes."""

from __future__ import annotations

import triton
import triton.language as tl


def num_warps_for(block: int) -> int:
    """One warp per 256 elements of the tile, 1 to 8."""
    return min(max(block // 256, 1), 8)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype` (to nearest, ties to even) and held in fp32: what torch stores when the
    same op runs in `dtype`. Kernels round every value torch would round, so they match it bit for bit
    up to fp32 arithmetic order.

    NOTE: bf16 rounds with integer ops because the Triton interpreter truncates fp32 -> bf16 casts (the
    GPU rounds to nearest even); the rounded value is exact in bf16, so the store's cast cannot change it."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float32:
        y = x
    else:
        y = x.to(dtype).to(tl.float32)
    return y
