"""A linear layer over a few rows (decode at small batch) with its neighbours fused in: the RMSNorm before it, the
SwiGLU after the gate/up projection, the residual add after the output projections.

Why: at batch 1 a decoder layer was ~10 kernels (norm, qkv GEMM, rotary + KV write, attention, o_proj GEMM and
cuBLAS's split-K reduce, norm, gate_up GEMM, SwiGLU, down GEMM), each a few microseconds of launch and tail on
an H200 for a GEMV that moves 2-67 MB (PERFORMANCE.md: ~0.28 ms of a 1.26 ms step were gaps between kernels).
Here the norm is recomputed by every program from the row (hidden_size values, from L2) and applied as the
weights stream in, SwiGLU and the residual add run on the finished accumulators: a layer is 6 kernels, the
same count as the megakernel's instruction set (norm + QKV, attention, O + residual, norm + gate/up + SwiGLU,
down + residual; the rotary embedding rides in the KV write).

Numbers: every value torch would round (the normed row, the GEMM output, silu's output, the residual sum) is
rounded to the activation dtype in the same place, so the only difference from the per-op path
(`skinny_linear_ref`) is the fp32 summation order of the dot products. Each program computes one row in an
order that depends on neither M nor the other rows; or, with `rows_per_program` = SKINNY_MAX_ROWS, every row of
the step (the weights read once), each row again reduced by code that does not depend on M.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from research_lm.assets import ASSETS
from research_lm.ops import SKINNY_MAX_ROWS
from research_lm.ops.common import gpu_model, next_power_of_2, round_to, tuned_entries

# Tiles measured per GPU model (experiments/bench_skinny_linear.py --sweep --tune writes them)
TUNED_TILES = ASSETS / "tuned" / "skinny_linear.json"


@triton.jit(do_not_specialize=["M"])
def _skinny_linear_kernel(
    x_ptr,  # [M, K], row stride x_stride
    w_ptr,  # [N or 2N, K] contiguous: with SILU_MUL the gate rows, then the up rows
    bias_ptr,  # [N or 2N]; unused without HAS_BIAS
    norm_ptr,  # [K]: the RMSNorm weight applied to x first; unused without NORM
    res_ptr,  # [M, N] contiguous: added to the output; unused without RESIDUAL
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    x_stride,
    eps,
    NORM: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One row per program, its neighbours in the grid the other rows of the same columns (they read the same
    # weights while they are in L2): every row is computed by the same code whatever M is, so a token's output
    # does not depend on how many rows the step has (as cuBLAS's small-M kernels, which async scheduling's
    # padded steps and the tests rely on).
    row = tl.program_id(0) % M
    cols = (tl.program_id(0) // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + row.to(tl.int64) * x_stride
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    if NORM:  # the row's rms, recomputed by every program: K values from L2 instead of a kernel of its own
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    # products summed elementwise per lane, reduced over the tile's K once at the end
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:  # rms_norm_ref: the normed row rounded to x's dtype, times the weight, rounded again
            g = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = round_to(round_to(x * rstd, dtype) * g, dtype)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
        acc += x[None, :] * w
        if SILU_MUL:
            w_up = tl.load(w_rows + N * K + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
            acc_up += x[None, :] * w_up
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = round_to(y, dtype)  # the GEMM's output, as F.linear stores it
    if SILU_MUL:  # silu_and_mul_ref on the rounded gate and up
        up = tl.sum(acc_up, axis=1)
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)
        up = round_to(up, dtype)
        y = round_to(round_to(y / (1.0 + tl.exp(-y)), dtype) * up, dtype)
    out = row.to(tl.int64) * N + cols
    if RESIDUAL:
        y = round_to(y + tl.load(res_ptr + out, mask=col_ok, other=0.0).to(tl.float32), dtype)
    tl.store(out_ptr + out, y, mask=col_ok)


@triton.jit(do_not_specialize=["M"])
def _skinny_rows_kernel(
    x_ptr,  # [M, K], row stride x_stride
    w_ptr,  # [N or 2N, K] contiguous: with SILU_MUL the gate rows, then the up rows
    bias_ptr,  # [N or 2N]; unused without HAS_BIAS
    norm_ptr,  # [K]: the RMSNorm weight applied to x first; unused without NORM
    res_ptr,  # [M, N] contiguous: added to the output; unused without RESIDUAL
    out_ptr,  # [M, N] contiguous
    M,
    N,
    K,
    x_stride,
    eps,
    NORM: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,  # rows held (>= M): rows M .. ROWS - 1 are zeros, never stored
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Every row of the step in one program, so each weight tile is read once for all of them (one row per program
    # reads it M times, from L2: 1.48x cuBLAS at M = 4 on an H200). Row r of each [ROWS, ...] tensor depends on x's
    # row r alone and is reduced by the same code whatever M is: a token's numbers do not depend on the step's
    # other rows. Each K block is reduced to [ROWS, BLOCK_N] before the next (the one-row kernel reduces once at the
    # end): a [ROWS, BLOCK_N, BLOCK_K] product must fit in registers.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + rows[:, None].to(tl.int64) * x_stride  # [ROWS, 1]
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K  # [BLOCK_N, 1]
    if NORM:  # each row's rms, recomputed by every program
        squares = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)  # [ROWS]
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if NORM:  # rms_norm_ref's roundings, as in the one-row kernel
            g = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = round_to(round_to(x * rstd[:, None], dtype) * g[None, :], dtype)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if SILU_MUL:
            w_up = tl.load(w_rows + N * K + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
            acc_up += tl.sum(x[:, None, :] * w_up[None, :, :], axis=2)
    y = acc
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = round_to(y, dtype)
    if SILU_MUL:
        up = acc_up
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up = round_to(up, dtype)
        y = round_to(round_to(y / (1.0 + tl.exp(-y)), dtype) * up, dtype)
    out = rows[:, None].to(tl.int64) * N + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        y = round_to(y + tl.load(res_ptr + out, mask=mask, other=0.0).to(tl.float32), dtype)
    tl.store(out_ptr + out, y, mask=mask)


class SkinnyTile(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int = 4


@functools.cache
def tuned_tiles(device_name: str) -> dict[tuple[int, int, int], SkinnyTile]:
    """(N, K, rows per program) -> the tile measured fastest on this GPU model (16-bit weights); {} for a GPU never
    tuned. A key "NxK" is the one-row kernel's, "NxKxR" the R-row kernel's."""
    shapes = tuned_entries(TUNED_TILES, device_name)
    return {(*map(int, key.split("x")), 1)[:3]: SkinnyTile(*entry["tile"]) for key, entry in shapes.items()}


def skinny_tiles(n: int, k: int, device_name: str | None = None, rows_per_program: int = 1) -> SkinnyTile:
    """The tuned tile for this GPU, shape and kernel, else: the whole of K (up to 2048) per load, as a warp-per-row
    GEMV reads it, and few enough output columns per program that ~8K products stay in registers and N / BLOCK_N
    programs fill the GPU several times over (the R-row kernel: 8K products over its R rows, K blocks of at most
    256). Never a function of M: a row's numbers must not depend on it."""
    tuned = tuned_tiles(device_name) if device_name is not None else {}
    if (n, k, rows_per_program) in tuned:
        return tuned[(n, k, rows_per_program)]
    block_k = min(next_power_of_2(k), 2048 if rows_per_program == 1 else 256)
    return SkinnyTile(min(max(8192 // (block_k * rows_per_program), 1), next_power_of_2(n)), block_k)



def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= SKINNY_MAX_ROWS, last dim contiguous
    weight: torch.Tensor,  # [N, K], or [2N, K] (gate rows, then up rows) with silu_mul
    bias: torch.Tensor | None = None,  # [N] or [2N]
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: rms-normalize x with it first
    eps: float = 0.0,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,  # [M, N]: added to the output
    tile: SkinnyTile | None = None,  # default: skinny_tiles' (the benchmark's sweep passes its candidates)
    rows_per_program: int = 1,  # 1: a program per row and column block; SKINNY_MAX_ROWS: all rows in one program
) -> torch.Tensor:  # [M, N], x's dtype
    """`skinny_linear_ref` in one kernel. The two kernels round the same values but sum each dot product in another
    order, so a run keeps one of them for every M (`Linear.skinny`)."""
    m, k = x.shape
    assert 1 <= m <= SKINNY_MAX_ROWS and x.stride(1) == 1, (x.shape, x.stride())
    assert rows_per_program in (1, SKINNY_MAX_ROWS), rows_per_program
    assert weight.shape[1] == k and weight.is_contiguous() and weight.dtype == x.dtype, (weight.shape, weight.dtype)
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous())
    assert norm_weight is None or (norm_weight.shape == (k,) and norm_weight.dtype == x.dtype)
    assert residual is None or (residual.shape == (m, n) and residual.is_contiguous() and residual.dtype == x.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if tile is None:
        tuned = x.device.type == "cuda" and x.dtype.itemsize == 2
        tile = skinny_tiles(n, k, gpu_model(x.device.index or 0) if tuned else None, rows_per_program)
    args = (x, weight, x if bias is None else bias, x if norm_weight is None else norm_weight,
            x if residual is None else residual, out, m, n, k, x.stride(0), eps)
    flags = dict(NORM=norm_weight is not None, SILU_MUL=silu_mul, HAS_BIAS=bias is not None,
                 RESIDUAL=residual is not None, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps)
    if rows_per_program == 1:
        _skinny_linear_kernel[(triton.cdiv(n, tile.block_n) * m,)](*args, **flags)
    else:
        _skinny_rows_kernel[(triton.cdiv(n, tile.block_n),)](*args, ROWS=rows_per_program, **flags)
    return out
