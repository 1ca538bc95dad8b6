"""The rejection sampler's device work in one Triton kernel: one program per request.

Why: `rejection_sample`'s torch path is ~30 small kernels (gathers, the acceptance test, cumprod, the residual,
the race, the output scatter), each ~10-15 µs of launch time on the host of the H100 device machine. At batch 1
that was ~0.5 ms of every temperature-1 verify step, about as long as the whole greedy step's verify
(PERFORMANCE.md, tenth pass).

The rule and the numbers are the torch path's (research_lm/worker/rejection_sampler.py, the reference), token for token:
- draft j of request i passes when u[i, j] * q(x) < p(x) (float32; q = 1 without draft probs), or, for a greedy
  request, when it is the argmax of its target row; n_acc is the leading run of passes;
- the extra token races (`research_lm.ops.exponential_race`'s noise, IEEE division, torch's argmax rule) over
  max(0, p - q) after a rejection (p with the draft removed without q), or over p when all were accepted or the
  residual is all zero; a greedy request takes the argmax of its row instead.
"all zero" is tested as "no positive entry", which is the reference's "sum > 0" for non-negative entries.

Inputs: the drafts, [n, K] int32 or int64 (K = k_max; a request's slots past its count are never read), and one
host-packed int64 row of width 3K + 6 per request: acceptance uniforms [K] (float32 bits), the noise keys of a
recovery per n_acc [K + 1] (RECOVER stream), those of the bonus per n_acc [K + 1] (SAMPLE stream), then k_i, its first
draft row, its first target row and its greedy flag. With `num_valid` (on the device) only the first
min(num_valid[i], k_i) slots are drafts: the bonus falls at n_acc = that count, so the kernel picks the key there.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2, num_warps_for
from research_lm.ops.exponential_race import _argmax_combine, exponential_noise

_MAX_BLOCK = 1024
_NO_INDEX = tl.constexpr(2**31 - 1)  # the column of a lane that saw none: loses every tie


@triton.jit
def _lane_better(v, best, best_col):
    """torch's argmax order within a lane whose columns come in increasing order: NaN wins, ties keep the older."""
    return (v > best) | (best_col == _NO_INDEX) | ((v != v) & (best == best))


@triton.jit
def _weights(p_row, q_row, cols, mask, x_rej, RESIDUAL: tl.constexpr, HAS_Q: tl.constexpr):
    p = tl.load(p_row + cols, mask=mask, other=0.0)
    if RESIDUAL:
        if HAS_Q:
            p = tl.maximum(p - tl.load(q_row + cols, mask=mask, other=0.0), 0.0)
        else:
            p = tl.where(cols == x_rej, 0.0, p)
    return p


@triton.jit
def _row_argmax(p_row, q_row, x_rej, key, V, RESIDUAL: tl.constexpr, HAS_Q: tl.constexpr, RACE: tl.constexpr,
                BLOCK: tl.constexpr):
    """torch's argmax over the row's weights w (p, or the residual), or (RACE) over w(v) / E_v, the race with
    the noise of `key`."""
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.full([BLOCK], _NO_INDEX, tl.int32)
    for c0 in range(0, V, BLOCK):
        cols = c0 + lanes
        mask = cols < V
        v = _weights(p_row, q_row, cols, mask, x_rej, RESIDUAL, HAS_Q)
        if RACE:
            v = tl.math.div_rn(v, exponential_noise(key, cols))
        better = _lane_better(v, best, best_col) & mask
        best = tl.where(better, v, best)
        best_col = tl.where(better, cols, best_col)
    _, col = tl.reduce((best, best_col), 0, _argmax_combine)
    return col.to(tl.int64)


@triton.jit
def _any_positive(p_row, q_row, x_rej, V, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    seen = tl.zeros([BLOCK], tl.int32)
    for c0 in range(0, V, BLOCK):
        cols = c0 + lanes
        mask = cols < V
        w = _weights(p_row, q_row, cols, mask, x_rej, True, HAS_Q)
        seen |= ((w > 0.0) & mask).to(tl.int32)
    return tl.max(seen, 0) > 0


@triton.jit(do_not_specialize=["K", "ids_stride", "host_stride"],
            do_not_specialize_on_alignment=["ids_ptr", "host_ptr", "valid_ptr"])
def _rejection_kernel(
    target_ptr,  # [rows, V] float32 p
    q_ptr,  # [drafts, V] float32 q (unused without HAS_Q)
    ids_ptr,  # [n, K] int32 or int64 draft tokens
    host_ptr,  # [n, 3K + 6] int64 (row stride host_stride), the module docstring's layout
    valid_ptr,  # [n] int32 or int64 real drafts per request (unused without HAS_VALID)
    out_ptr,  # [n, K + 1] int64
    target_stride,
    q_stride,
    ids_stride,
    host_stride,
    V,
    K,
    HAS_Q: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    row = host_ptr + i * host_stride
    ids = ids_ptr + i * ids_stride
    k_i = tl.load(row + 3 * K + 2)
    cu_draft = tl.load(row + 3 * K + 3)
    cu_target = tl.load(row + 3 * K + 4)
    greedy = tl.load(row + 3 * K + 5) != 0
    n_real = k_i
    if HAS_VALID:  # clamped to the layout: a larger count would read the next request's rows
        n_real = tl.minimum(tl.maximum(tl.load(valid_ptr + i).to(tl.int64), 0), k_i)
    n_acc = k_i * 0
    alive = n_real > 0
    for j in range(0, K):
        live = alive & (j < n_real)
        ok = live & False
        if live:  # slots past n_real hold no draft; rows past k_i belong to the next request (or to nobody)
            x = tl.load(ids + j).to(tl.int64)
            p_row = target_ptr + (cu_target + j) * target_stride
            if greedy:
                ok = _row_argmax(p_row, p_row, -1, 0, V, False, False, False, BLOCK) == x
            else:
                p = tl.load(p_row + x)
                q = 1.0
                if HAS_Q:
                    q = tl.load(q_ptr + (cu_draft + j) * q_stride + x)
                u = tl.load(row + j).to(tl.int32).to(tl.float32, bitcast=True)
                ok = u * q < p
        alive = live & ok
        n_acc += alive.to(tl.int64)
    p_row = target_ptr + (cu_target + n_acc) * target_stride
    if greedy:
        final = _row_argmax(p_row, p_row, -1, 0, V, False, False, False, BLOCK)
    else:
        key_recover = tl.load(row + K + n_acc)
        key_bonus = tl.load(row + 2 * K + 1 + n_acc)
        key = tl.where(n_acc == n_real, key_bonus, key_recover).to(tl.uint64, bitcast=True)
        q_row = q_ptr + (cu_draft + n_acc) * q_stride
        use_residual = n_acc < n_real
        x_rej = tl.load(ids + n_acc, mask=use_residual, other=-1).to(tl.int64)
        if use_residual:
            use_residual = _any_positive(p_row, q_row, x_rej, V, HAS_Q, BLOCK)
        if use_residual:
            final = _row_argmax(p_row, q_row, x_rej, key, V, True, HAS_Q, True, BLOCK)
        else:
            final = _row_argmax(p_row, q_row, x_rej, key, V, False, HAS_Q, True, BLOCK)
    for j in range(0, K + 1):
        x = tl.load(ids + j, mask=j < n_acc, other=-1).to(tl.int64)
        tok = tl.where(j < n_acc, x, tl.where(j == n_acc, final, -1))
        tl.store(out_ptr + i * (K + 1) + j, tok)


def pack_host(u: np.ndarray, recover_keys: np.ndarray, sample_keys: np.ndarray, num_drafts: np.ndarray,
              cu_draft: np.ndarray, cu_target: np.ndarray, greedy: np.ndarray) -> np.ndarray:  # [n, 3K + 6] int64
    """The kernel's per-request row (module docstring), from the reference's host arrays."""
    n = len(num_drafts)
    u_bits = np.ascontiguousarray(u, dtype=np.float32).view(np.int32).astype(np.int64)
    cols = [u_bits, recover_keys.view(np.int64), sample_keys.view(np.int64)] + [
        a.reshape(n, 1).astype(np.int64) for a in (num_drafts, cu_draft, cu_target, greedy)]
    return np.concatenate([c.reshape(n, -1) for c in cols], axis=1)


def fused_rejection_sample(
    target_probs: torch.Tensor,  # [rows, V] float32
    draft_probs: torch.Tensor | None,  # [drafts, V] float32, or None: one-hot q
    draft_ids: torch.Tensor,  # [n, k_max] int32 or int64 on the device, unit column stride
    host: torch.Tensor,  # [n, 3 k_max + 6] int64 on the device, `pack_host`'s rows, unit column stride
    num_valid: torch.Tensor | None,  # [n] int32 or int64 contiguous on the device, or None: every slot to k_i
    k_max: int,
) -> torch.Tensor:  # [n, k_max + 1] int64, -1 in slots not emitted
    n, V = host.shape[0], target_probs.shape[-1]
    assert host.shape == (n, 3 * k_max + 6) and host.dtype == torch.int64 and host.stride(1) == 1, host.shape
    assert draft_ids.shape == (n, k_max) and draft_ids.dtype in (torch.int32, torch.int64), draft_ids.shape
    assert k_max == 0 or draft_ids.stride(1) == 1, draft_ids.stride()
    assert num_valid is None or (num_valid.shape == (n,) and num_valid.is_contiguous()), num_valid
    assert target_probs.dtype == torch.float32 and target_probs.stride(-1) == 1, target_probs.dtype
    assert draft_probs is None or (draft_probs.dtype == torch.float32 and draft_probs.stride(-1) == 1)
    out = torch.empty(n, k_max + 1, dtype=torch.int64, device=target_probs.device)
    if n == 0:
        return out
    block = min(_MAX_BLOCK, next_power_of_2(V))  # tests shrink _MAX_BLOCK
    q = draft_probs if draft_probs is not None else target_probs
    _rejection_kernel[(n,)](
        target_probs, q, draft_ids, host, num_valid if num_valid is not None else host, out,
        target_probs.stride(0), q.stride(0), draft_ids.stride(0), host.stride(0), V, k_max,
        HAS_Q=draft_probs is not None, HAS_VALID=num_valid is not None, BLOCK=block, num_warps=num_warps_for(block),
    )
    return out
