"""What the kernels share: dtype rounding as torch does it, block and warp sizes, tiles tuned per GPU model."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl


@functools.cache
def gpu_model(index: int) -> str:
    """The GPU model a tuned-tiles file keys its entries by."""
    return torch.cuda.get_device_name(index)


def tuned_entries(path: Path, device_name: str) -> dict[str, dict[str, Any]]:
    """One GPU model's entries (shape key -> entry) of a tuned-tiles JSON that a sweep wrote
    (experiments/bench_common.merge_tuned); {} for a GPU never tuned or no file."""
    if not path.exists():
        return {}
    return json.loads(path.read_text())["devices"].get(device_name, {})


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
