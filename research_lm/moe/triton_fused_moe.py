"""Fused MoE experts as a Triton grouped GEMM (the layout of vLLM's fused_moe, written for this repo).

    pairs (t, j) ──moe_align──▶ sorted by slot, each slot's run padded to BLOCK_M ──▶
    launch 1: act[p]  = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)      p = t * k + j
    launch 2: out[p]  = w[p] * (act[p] @ w2[e].T)
    y[t] = Σ_j out[t * k + j]                                                    (torch, fixed order)

A program owns one BLOCK_M tile of sorted pairs (all of one expert slot, read from `expert_ids`) and one
BLOCK_N tile of outputs. The sorted buffer is allocated at its worst-case length, so nothing here
syncs with the host; tiles past `num_tokens_post_padded` exit at once.

Under the Triton interpreter (CPU tests) only fp32/fp16 are correct (bf16 is garbled there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from research_lm.moe.experts import check_expert_args


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [num_a_rows, K]: hidden [T, H] (launch 1) or act [T*k, I] (launch 2)
    b_ptr,  # [num_slots, N_total, K]: w13 or w2
    c_ptr,  # [T*k, N]
    topk_weights_ptr,  # [T*k] fp32
    sorted_ids_ptr,  # [EM] int64: pair index, or num_pairs for padding
    expert_ids_ptr,  # [EM // BLOCK_M] int64: slot of each tile
    num_post_padded_ptr,  # [1] int64: used length of sorted_ids
    N,  # outputs per row (I for launch 1, H for launch 2)
    K,
    EM,
    num_pairs,
    up_offset,  # rows of b between gate row n and up row n (I); unused unless GATED
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    A_ROW_DIV: tl.constexpr,  # a row = pair // A_ROW_DIV (top_k for launch 1, 1 for launch 2)
    GATED: tl.constexpr,  # epilogue silu(gate) * up (launch 1)
    MUL_ROUTED_WEIGHT: tl.constexpr,  # epilogue * topk weight (launch 2)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), else "tf32" (ignored for 16-bit)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M consecutive m-tiles share n-tiles: neighbouring programs reuse weight tiles in L2.
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)  # int64
    pair_mask = pair < num_pairs
    slot = tl.load(expert_ids_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + (pair // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + slot * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + up_offset * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=pair_mask, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def choose_tile_config(num_pairs: int, num_slots: int, interpret: bool = False) -> MoeTileConfig:
    """Small tiles when experts get few rows (decode); the minimum (16) under the interpreter.

    NOTE: untuned heuristics (no GPU sweep yet); tl.dot needs every block dim >= 16."""
    if interpret:
        return MoeTileConfig(16, 16, 16, 1, 1, 1)
    if num_pairs <= 2 * num_slots:  # about one row per expert: weight-bandwidth bound
        return MoeTileConfig(16, 64, 128, 1, 4, 4)
    if num_pairs <= 64 * num_slots:
        return MoeTileConfig(32, 64, 64, 8, 4, 3)
    return MoeTileConfig(64, 128, 64, 8, 4, 3)


def moe_align(
    topk_ids: torch.Tensor,  # [T, k] int64 physical slots
    num_slots: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the T*k pairs by slot and pads each slot's run to a multiple of block_m, without a host sync.

    Returns sorted_ids [EM] int64 (pair index, or T*k for padding), expert_ids [EM // block_m] int64 (the
    slot of each tile; tiles past the used length point at the last slot) and num_post_padded [1] int64
    (the used length). EM = the worst case, T*k + min(T*k, num_slots) * (block_m - 1), rounded up to block_m.
    """
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_slots, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    sorted_slots, order = flat.sort(stable=True)
    rank = torch.arange(num_pairs, device=flat.device) - count_start[sorted_slots]
    em = num_pairs + min(num_pairs, num_slots) * (block_m - 1)
    em = -(-em // block_m) * block_m
    sorted_ids = torch.full((em,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_ids[padded_start[sorted_slots] + rank] = order
    tile_start = torch.arange(0, em, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, tile_start, right=True).clamp_(max=num_slots - 1)
    return sorted_ids, expert_ids, padded_end[-1:]


def _launch(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor, sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor, num_post_padded: torch.Tensor, *, n: int, a_row_div: int, gated: bool,
    mul_routed_weight: bool, cfg: MoeTileConfig,
) -> None:
    k = a.shape[1]
    em = sorted_ids.numel()
    grid = (triton.cdiv(em, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_post_padded,
        n, k, em, c.shape[0], n if gated else 0,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_ROUTED_WEIGHT=mul_routed_weight,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def fused_experts_triton(
    hidden: torch.Tensor,  # [T, H] fp32 / fp16 / bf16 (bf16 only compiled, not interpreted)
    w13: torch.Tensor,  # [P, 2I, H]
    w2: torch.Tensor,  # [P, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64 physical slots
    cfg: MoeTileConfig | None = None,
) -> torch.Tensor:  # [T, H]
    check_expert_args(hidden, w13, w2, topk_weights, topk_ids)
    assert hidden.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "rows must be contiguous"
    num_tokens, top_k = topk_ids.shape
    num_slots, two_i, hidden_size = w13.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return hidden.new_zeros(num_tokens, hidden_size)
    if cfg is None:
        cfg = choose_tile_config(num_pairs, num_slots, interpret=hidden.device.type != "cuda")
    sorted_ids, expert_ids, num_post_padded = moe_align(topk_ids, num_slots, cfg.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    act = hidden.new_empty(num_pairs, inter)
    _launch(hidden, w13, act, weights, sorted_ids, expert_ids, num_post_padded, n=inter, a_row_div=top_k,
            gated=True, mul_routed_weight=False, cfg=cfg)
    out = hidden.new_empty(num_pairs, hidden_size)
    _launch(act, w2, out, weights, sorted_ids, expert_ids, num_post_padded, n=hidden_size, a_row_div=1,
            gated=False, mul_routed_weight=True, cfg=cfg)
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)
