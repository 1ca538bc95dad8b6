"""The sampler's exponential race, argmax_c probs[c] / q[c] with q ~ Exp(1) from `rng`, in one pass.

Why: `rng.exponential_rows` builds the [N, V] noise with ~20 elementwise int64 kernels and a float64 log, then
the race divides and takes an argmax: ~2 ms per step at 256 rows x 128k vocab on an H200. Here each program
hashes its columns' SplitMix64 words in registers, so probs is read once and nothing [N, V] is written.

Bit-identical to `sampler.random_sample`'s torch path: the same 64-bit words (uint64 arithmetic wraps, `>>` on
uint64 is logical), the same exact float64 uniform, q = float32(-log(u)), an IEEE-rounded float32 division
(`div_rn`: Triton's `/` is approximate on GPUs), and torch's argmax rule (NaN beats everything, the first index
wins ties). The one possible difference: the float64 `log` of the libm at hand against torch's, which may
differ by an ulp; after rounding to float32 that changes q about once in 2^29 draws, and a token almost never.

Layout: the grid is (rows, splits), each program racing `chunk` columns of one row; with more than one split a
second kernel reduces the [rows, splits] partial winners in column order, so the tie rule holds across splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2, num_warps_for

_MAX_BLOCK = 1024  # columns per loop iteration
_MAX_CHUNK = 8192  # columns per program
_TARGET_PROGRAMS = 1024  # fewer rows -> smaller chunks, so a small batch still fills the GPU
_NO_INDEX = tl.constexpr(2**31 - 1)  # the column of a lane that saw none: loses every tie


@triton.jit
def _fmix64(z):  # uint64 -> uint64, `rng._fmix64_`
    z ^= z >> 30
    z *= 0xBF58476D1CE4E5B9
    z ^= z >> 27
    z *= 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def uniform53(key, cols):
    """`rng.exponential_rows`' float64 uniforms in (0, 1) at columns `cols` (int32) of the row whose
    `rng.row_keys` word is `key` (uint64)."""
    z = _fmix64(key + (cols + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)  # `rng._bits`
    k = z.to(tl.int64, bitcast=True) >> 12  # arithmetic, as torch's `z >>= 12`: in [-2^51, 2^51)
    # torch: k * 2^-52 + (0.5 + 2^-53) = (2k + 2^52 + 1) * 2^-53, exact both ways; integers keep every
    # constant exact (a Python float literal would be typed fp32 here).
    return (2 * k + (2**52 + 1)).to(tl.float64) * 2.0**-53


@triton.jit
def exponential_noise(key, cols):
    """`rng.exponential_rows` at columns `cols`: float32 Exp(1) variates, -log(u) rounded from float64."""
    return (-tl.log(uniform53(key, cols))).to(tl.float32)


@triton.jit
def _argmax_combine(v1, i1, v2, i2):
    """torch's argmax order: NaN is the largest value, equal values go to the lower index."""
    nan1 = v1 != v1
    nan2 = v2 != v2
    first = tl.where(nan1, ~nan2 | (i1 < i2), tl.where(v1 == v2, i1 < i2, v1 > v2))
    return tl.where(first, v1, v2), tl.where(first, i1, i2)


@triton.jit(do_not_specialize=["chunk", "splits"], do_not_specialize_on_alignment=["keys_ptr"])
def _race_kernel(
    probs_ptr,  # [rows, V] float32, columns contiguous
    keys_ptr,  # [rows] int64, rng.row_keys
    value_ptr,  # [rows, splits] float32: each split's winning ratio; unused when SPLIT is False
    index_ptr,  # [rows, splits] int64: its column (with one split: the output tokens)
    probs_stride,
    V,
    chunk,  # columns per program, a multiple of BLOCK
    splits,
    SPLIT: tl.constexpr,  # splits > 1
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    lanes = tl.arange(0, BLOCK)
    # Per lane, the best column so far; a lane's columns come in increasing order, so keeping the older one
    # on ties keeps the first.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.full([BLOCK], _NO_INDEX, tl.int32)
    start = split * chunk
    end = tl.minimum(start + chunk, V)
    for c0 in range(start, end, BLOCK):
        cols = c0 + lanes
        mask = cols < end
        p = tl.load(probs_ptr + row * probs_stride + cols, mask=mask, other=0.0)
        ratio = tl.math.div_rn(p, exponential_noise(key, cols))
        better = (ratio > best) | (best_col == _NO_INDEX) | ((ratio != ratio) & (best == best))
        better &= mask
        best = tl.where(better, ratio, best)
        best_col = tl.where(better, cols, best_col)
    value, col = tl.reduce((best, best_col), 0, _argmax_combine)
    tl.store(index_ptr + row * splits + split, col.to(tl.int64))
    if SPLIT:
        tl.store(value_ptr + row * splits + split, value)


@triton.jit(do_not_specialize=["splits"])
def _reduce_splits_kernel(
    value_ptr,  # [rows, splits] float32
    index_ptr,  # [rows, splits] int64
    out_ptr,  # [rows] int64
    splits,
    BLOCK: tl.constexpr,  # power of 2 >= splits
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK)
    mask = s < splits
    value = tl.load(value_ptr + row * splits + s, mask=mask, other=float("-inf"))
    col = tl.load(index_ptr + row * splits + s, mask=mask, other=_NO_INDEX).to(tl.int32)
    _, best = tl.reduce((value, col), 0, _argmax_combine)
    tl.store(out_ptr + row, best.to(tl.int64))


def exponential_race(
    probs: torch.Tensor,  # [N, V] float32, non-negative weights, columns contiguous
    keys: torch.Tensor,  # [N] int64 on probs' device: rng.row_keys(seeds, positions, stream)
    *,
    block: int | None = None,  # columns per iteration (power of 2); tests shrink it
    chunk: int | None = None,  # columns per program (a multiple of block); tests shrink it
) -> torch.Tensor:  # [N] int64
    """`(probs / q).argmax(-1)` with q the rows' `rng.exponential_rows` noise, without materialising q."""
    assert probs.dim() == 2 and probs.dtype == torch.float32 and probs.stride(-1) == 1, (
        probs.shape, probs.dtype, probs.stride())
    rows, V = probs.shape
    assert 0 < V < _NO_INDEX.value, V
    assert keys.shape == (rows,) and keys.dtype == torch.int64 and keys.device == probs.device, (
        keys.shape, keys.dtype, keys.device)
    keys = keys.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    block = block or min(_MAX_BLOCK, next_power_of_2(V))
    if chunk is None:
        chunk = min(_MAX_CHUNK, max(block, next_power_of_2(triton.cdiv(rows * V, _TARGET_PROGRAMS))))
    assert block & (block - 1) == 0 and chunk % block == 0, (block, chunk)
    splits = triton.cdiv(V, chunk)
    if splits == 1:
        value = index = out
    else:
        value = torch.empty(rows, splits, dtype=torch.float32, device=probs.device)
        index = torch.empty(rows, splits, dtype=torch.int64, device=probs.device)
    _race_kernel[(rows, splits)](
        probs, keys, value, index, probs.stride(0), V, chunk, splits, SPLIT=splits > 1, BLOCK=block,
        num_warps=num_warps_for(block),
    )
    if splits > 1:
        _reduce_splits_kernel[(rows,)](value, index, out, splits, BLOCK=next_power_of_2(splits))
    return out

