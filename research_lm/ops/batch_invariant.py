"""Batch-invariant kernels and the check that a model can run batch-invariantly.

Why: cuBLAS picks its GEMM kernel (tile shape, split-K) from the problem size, so a token's row of x W^T is
reduced in an order that depends on how many other rows share the step (decode vs verify vs a prefill chunk,
batch 1 vs 64). A near-tie of the top two logits then flips a greedy token. `linear` fixes the reduction: its
tile, K loop and K split come from (N, K, dtype) alone, never from M (a long K is cut into a fixed number of
ranges whose fp32 partial sums a second kernel adds in order), so each row's dot products run over the same K
tiles in the same order whatever else is in the batch (Thinking Machines, "Defeating
Nondeterminism in LLM Inference", 2025; vLLM's `VLLM_BATCH_INVARIANT`).

The rest of the model path is already row-wise with a fixed config: the Triton RMSNorm (one program per row,
its block from the hidden size), rotary and SiLU * mul (elementwise), the embedding (a gather). The sampler's
argmax, sort, top-k and the exponential race are exact in any order (max is associative; ties go to the lowest
index). torch's CUDA (log_)softmax and cumsum reduce or scan each row inside one block or warp sized from the row
length alone; softmax's vectorized loads follow a row's 16-byte alignment, the same for every row when the row
stride is a multiple of 16 bytes (fp32 vocab sizes divisible by 4: 1024, 128256). The `triton` attention backend plans a
batch-invariant launch (`attention_zoo/triton_attn.py`). What cannot be made invariant is refused when the
engine is built (`check_batch_invariant`).

On CPU, layers never take these kernels (`research_lm.ops.use_batch_invariant`): CPU torch kernels run as
before, and tests reach the kernels under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from research_lm.assets import ASSETS
from research_lm.ops.common import gpu_model, next_power_of_2, round_to, tuned_entries

# Tiles measured per GPU and 16-bit weight shape (experiments/bench_invariant_gemm.py --tune writes them): a tuned
# tile is still a function of (device, N, K) alone, so a row's bits do not depend on M on that device.
TUNED_CONFIGS = ASSETS / "tuned" / "batch_invariant_gemm.json"

_TARGET_N_TILES = 128  # output-column tiles aimed at, so a batch-1 step still spreads over many programs
_MAX_BLOCK_N = 128
_MIN_BLOCK = 16  # tl.dot's smallest operand side
_K_PER_SPLIT = 2048  # a K longer than this is split: ceil(K / 2048) partial sums, so K alone sets the splits
_MAX_SPLIT_K = 8


@dataclass(frozen=True)
class LinearConfig:
    block_m: int  # rows (tokens) per program
    block_n: int  # output columns per program
    block_k: int  # the K step of the reduction
    split_k: int = 1  # K cut into this many consecutive ranges, their fp32 partial sums added in order
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def tuned_configs(device_name: str) -> dict[tuple[int, int], LinearConfig]:
    """(N, K) -> the tile measured fastest on this GPU model for 16-bit weights; {} for a GPU never tuned."""
    shapes = tuned_entries(TUNED_CONFIGS, device_name)
    return {tuple(map(int, nk.split("x"))): LinearConfig(**entry["config"]) for nk, entry in shapes.items()}


def linear_config(n: int, k: int, dtype: torch.dtype, device_name: str | None = None) -> LinearConfig:
    """The tile for a [*, k] x [n, k]^T product: from the weight's shape and dtype (and the GPU model, where
    TUNED_CONFIGS has this shape for it) only, never from M. The rule's long K is split (a fixed count from K alone:
    a batch-1 step of down_proj otherwise walks K serially on few programs)."""
    if device_name is not None and dtype.itemsize == 2 and (n, k) in tuned_configs(device_name):
        return tuned_configs(device_name)[(n, k)]
    block_n = min(_MAX_BLOCK_N, max(_MIN_BLOCK, next_power_of_2(triton.cdiv(n, _TARGET_N_TILES))))
    block_k = min(32 if dtype == torch.float32 else 64, max(_MIN_BLOCK, next_power_of_2(k)))
    split_k = min(_MAX_SPLIT_K, triton.cdiv(k, _K_PER_SPLIT))
    return LinearConfig(block_m=64, block_n=block_n, block_k=block_k, split_k=split_k)


@triton.jit(do_not_specialize=["M", "stride_xm"], do_not_specialize_on_alignment=["x_ptr", "out_ptr"])
def _linear_kernel(
    x_ptr,  # [M, K], rows at stride_xm, columns contiguous
    w_ptr,  # [N, K] contiguous
    bias_ptr,  # [N]; unused without HAS_BIAS
    out_ptr,  # [M, N] contiguous: x's dtype, or with SPLIT_K > 1 [SPLIT_K, M, N] fp32 partial sums
    M,
    N,
    K,
    stride_xm,
    K_PER_SPLIT,  # a multiple of BLOCK_K: program_id(2)'s range of K
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 (fp32 inputs, or the interpreter, which garbles 16-bit math)
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    col_valid = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_start = tl.program_id(2) * K_PER_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):  # one fixed order over the split's K: never depends on M
        k = k_start + k0 + ks
        k_valid = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_valid[:, None] & k_valid[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    store = row_valid[:, None] & col_valid[None, :]
    if SPLIT_K > 1:  # the partial sum, added to the others in order by _sum_splits_kernel
        tl.store(out_ptr + tl.program_id(2) * M * N + rows[:, None] * N + cols[None, :], acc, mask=store)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], round_to(acc, out_ptr.dtype.element_ty), mask=store)


@triton.jit(do_not_specialize=["numel"])
def _sum_splits_kernel(
    part_ptr,  # [SPLIT_K, M, N] fp32
    bias_ptr,  # [N]; unused without HAS_BIAS
    out_ptr,  # [M, N]
    numel,  # M * N
    N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = ((p_0 + p_1) + ...) + bias, rounded once: the same order for every element, whatever M."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    acc = tl.load(part_ptr + offs, mask=valid, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, round_to(acc, out_ptr.dtype.element_ty), mask=valid)


def linear(
    x: torch.Tensor,  # [M, K], any row stride, columns contiguous
    weight: torch.Tensor,  # [N, K] contiguous, x's dtype and device
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: LinearConfig | None = None,  # tests shrink it; None: `linear_config`
) -> torch.Tensor:  # [M, N] contiguous, x's dtype
    """x W^T + b with fp32 accumulation: each row's result is the same bits whatever M and the other rows."""
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    n, k = weight.shape
    assert x.shape[1] == k and weight.is_contiguous(), (x.shape, weight.shape, weight.stride())
    assert weight.dtype == x.dtype and weight.device == x.device, (weight.dtype, x.dtype, weight.device, x.device)
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous() and bias.device == x.device), bias
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    c = config or linear_config(n, k, x.dtype, gpu_model(x.device.index or 0) if x.is_cuda else None)
    upcast = x.device.type == "cpu" or x.dtype == torch.float32  # CPU: the interpreter (TRITON_INTERPRET=1)
    k_per_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    split_k = triton.cdiv(k, k_per_split)  # (a K shorter than split_k tiles has fewer ranges)
    target = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else weight
    _linear_kernel[(triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), split_k)](
        x, weight, bias_arg, target, m, n, k, x.stride(0), k_per_split, SPLIT_K=split_k,
        HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32", num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, bias_arg, out, m * n, n, SPLIT_K=split_k,
                                                          HAS_BIAS=bias is not None, BLOCK=block)
    return out


def invariant_attention_backends(kind: str) -> list[str]:
    """The attention backends for layers of `kind` that claim `batch_invariant` (those installed here)."""
    from attention_zoo.registry import available_backends, get_backend

    names = []
    for name in available_backends():
        try:
            caps = get_backend(name).capabilities
        except ValueError:  # not installed (FlashInfer)
            continue
        if kind in caps.kinds and caps.batch_invariant:
            names.append(name)
    return names


def batch_invariant_refusal(modules: Iterable[nn.Module]) -> str | None:
    """Why these models (the target, its drafters) cannot run batch-invariantly on CUDA, in one sentence; None
    when they can. Refused: attention backends whose capabilities do not claim `batch_invariant` (their kernels
    pick splits or GEMMs by the step's shape), and fused MoE experts (grouped GEMMs whose tiles follow the tokens
    routed to each expert)."""
    from attention_zoo.layer import CacheLayer
    from research_lm.moe.layer import FusedMoE

    for model in modules:
        for m in model.modules():
            if isinstance(m, CacheLayer) and not m.backend.capabilities.batch_invariant:
                kind = m.spec.kind
                return (f"attention backend {m.backend.name!r} ({kind} layers) is not batch-invariant; backends that "
                        f"are, for {kind} layers: {invariant_attention_backends(kind) or 'none'}")
            if isinstance(m, FusedMoE):
                return ("fused MoE experts are not batch-invariant (their grouped GEMMs follow the tokens routed to "
                        "each expert)")
    return None


def check_batch_invariant(modules: Iterable[nn.Module]) -> None:
    """Raise a one-line ValueError if `batch_invariant_refusal` finds something."""
    if (reason := batch_invariant_refusal(modules)) is not None:
        raise ValueError(f"batch_invariant=True: {reason}")
