"""Mamba2's SSM over a ragged batch with per-request state slots: a chunked SSD scan for prefill chunks
and the single-step state update for decodes.

Per head h (A < 0 scalar, B/C of its group g = h // (heads / groups)) and token t:
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        [head_dim, state]
    y_t = h_t C_t + D x_t
`_ssd_chunk_scan_kernel` (one program per request, head and head_dim tile) walks the request's tokens
in chunks of BLOCK_L with the state in registers. With cum_l = sum_{i <= l} dt_i A inside a chunk:
    y_l     = exp(cum_l) C_l h_in                                   the state entering the chunk
            + sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s  within the chunk (a masked matmul)
    h_out   = exp(cum_L) h_in + sum_s exp(cum_L - cum_s) dt_s x_s B_s^T
four `tl.dot`s per chunk. Chunks run one after another (the state is the carried dependency); the
parallelism is requests x heads x head_dim tiles, as in the recurrent form but with matmul-sized
work per step. `_selective_state_update_kernel` is the one-token case without the matmuls. Both skip the state
of a request of slot -1 or no tokens (a CUDA graph's padding), and the decode kernel its output row too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus_clamped(x, dt_min, dt_max):
    sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's softplus threshold
    return tl.minimum(tl.maximum(sp, dt_min), dt_max)


@triton.jit
def _ssd_chunk_scan_kernel(
    xbc_ptr,  # [num_tokens, conv_dim] after the conv: x (H * P) | B (G * N) | C (G * N)
    dt_ptr,  # [num_tokens, H], raw
    A_log_ptr,  # [H]
    D_ptr,  # [H]
    dt_bias_ptr,  # [H]
    y_ptr,  # [num_tokens, H * P]
    ssm_state_ptr,  # [num_slots, H, P, N]
    query_start_loc_ptr,  # [num_reqs + 1] int32
    state_slots_ptr,  # [num_reqs] int32
    has_initial_ptr,  # [num_reqs] bool
    req_idx_ptr,  # [grid 0] int32: the requests this launch serves
    stride_xbc,
    stride_dt,
    stride_y,
    stride_s_slot,
    stride_s_head,
    stride_s_p,
    dt_min,
    dt_max,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.load(req_idx_ptr + tl.program_id(0))
    h = tl.program_id(1)
    start = tl.load(query_start_loc_ptr + req)
    n = tl.load(query_start_loc_ptr + req + 1) - start
    slot = tl.load(state_slots_ptr + req).to(tl.int64)
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    D = tl.load(D_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    g = h // HEADS_PER_GROUP
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    s = tl.arange(0, BLOCK_N)
    p_ok = p < HEAD_DIM
    s_ok = s < STATE
    x_col = h * HEAD_DIM + p
    b_col = NUM_HEADS * HEAD_DIM + g * STATE + s
    c_col = b_col + (NUM_HEADS // HEADS_PER_GROUP) * STATE
    state_ptrs = ssm_state_ptr + slot * stride_s_slot + h * stride_s_head + p[:, None] * stride_s_p + s[None, :]
    # A new request starts from zero, whatever its slot holds; a CUDA graph's padding requests (no tokens, slot -1)
    # read and write no state. NOTE: integer bounds, not scalar bools and-ed into the masks, which the interpreter
    # rejects.
    p_live = HEAD_DIM * ((n > 0) & (slot >= 0)).to(tl.int32)
    p_init = p_live * tl.load(has_initial_ptr + req).to(tl.int32)
    state = tl.load(state_ptrs, mask=(p < p_init)[:, None] & s_ok[None, :], other=0.0).to(tl.float32)
    pos = tl.arange(0, BLOCK_L)
    causal = pos[:, None] >= pos[None, :]
    for c0 in range(0, n, BLOCK_L):
        t_ok = c0 + pos < n
        rows = (start + c0 + pos).to(tl.int64)
        dt = tl.load(dt_ptr + rows * stride_dt + h, mask=t_ok, other=0.0).to(tl.float32)
        dt = tl.where(t_ok, _softplus_clamped(dt + dt_bias, dt_min, dt_max), 0.0)  # [BLOCK_L]
        a = dt * A
        cum = tl.cumsum(a, axis=0)
        x = tl.load(xbc_ptr + rows[:, None] * stride_xbc + x_col[None, :], mask=t_ok[:, None] & p_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_L, BLOCK_P]
        B = tl.load(xbc_ptr + rows[:, None] * stride_xbc + b_col[None, :], mask=t_ok[:, None] & s_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_L, BLOCK_N]
        C = tl.load(xbc_ptr + rows[:, None] * stride_xbc + c_col[None, :], mask=t_ok[:, None] & s_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_L, BLOCK_N]
        y = tl.dot(C, tl.trans(state), input_precision=DOT_PRECISION) * tl.exp(cum)[:, None]
        scores = tl.dot(C, tl.trans(B), input_precision=DOT_PRECISION)  # [BLOCK_L, BLOCK_L]
        decay = tl.where(causal, tl.exp(tl.minimum(cum[:, None] - cum[None, :], 0.0)), 0.0)
        y += tl.dot(scores * decay * dt[None, :], x, input_precision=DOT_PRECISION)
        y += D * x
        tl.store(y_ptr + rows[:, None] * stride_y + x_col[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & p_ok[None, :])
        total = tl.sum(a, axis=0)
        w = tl.exp(total - cum) * dt  # 0 on padding rows
        state = state * tl.exp(total) + tl.dot(tl.trans(x * w[:, None]), B, input_precision=DOT_PRECISION)
    tl.store(state_ptrs, state.to(ssm_state_ptr.dtype.element_ty), mask=(p < p_live)[:, None] & s_ok[None, :])


@triton.jit
def _selective_state_update_kernel(
    xbc_ptr,  # [num_tokens, conv_dim] after the conv: x | B | C
    dt_ptr,  # [num_tokens, H], raw
    A_log_ptr,  # [H]
    D_ptr,  # [H]
    dt_bias_ptr,  # [H]
    y_ptr,  # [num_tokens, H * P]
    ssm_state_ptr,  # [num_slots, H, P, N]
    query_start_loc_ptr,  # [num_reqs + 1] int32
    state_slots_ptr,  # [num_reqs] int32
    has_initial_ptr,  # [num_reqs] bool
    req_idx_ptr,  # [grid 0] int32: requests with exactly one token this step
    stride_xbc,
    stride_dt,
    stride_y,
    stride_s_slot,
    stride_s_head,
    stride_s_p,
    dt_min,
    dt_max,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    req = tl.load(req_idx_ptr + tl.program_id(0))
    h = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + req).to(tl.int64)
    n = tl.load(query_start_loc_ptr + req + 1) - row  # 1, or 0 for a CUDA graph's padding request (slot -1)
    slot = tl.load(state_slots_ptr + req).to(tl.int64)
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    D = tl.load(D_ptr + h).to(tl.float32)
    g = h // HEADS_PER_GROUP
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    s = tl.arange(0, BLOCK_N)
    p_ok = p < HEAD_DIM
    s_ok = s < STATE
    b_col = NUM_HEADS * HEAD_DIM + g * STATE + s
    c_col = b_col + (NUM_HEADS // HEADS_PER_GROUP) * STATE
    state_ptrs = ssm_state_ptr + slot * stride_s_slot + h * stride_s_head + p[:, None] * stride_s_p + s[None, :]
    # As in _ssd_chunk_scan_kernel: zero state for a new request, none read or written for padding (its token row
    # is a padding row of the graph's buffers, read but not written).
    p_live = HEAD_DIM * ((n > 0) & (slot >= 0)).to(tl.int32)
    p_init = p_live * tl.load(has_initial_ptr + req).to(tl.int32)
    state = tl.load(state_ptrs, mask=(p < p_init)[:, None] & s_ok[None, :], other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * stride_dt + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = _softplus_clamped(dt, dt_min, dt_max)
    x = tl.load(xbc_ptr + row * stride_xbc + h * HEAD_DIM + p, mask=p_ok, other=0.0).to(tl.float32)
    B = tl.load(xbc_ptr + row * stride_xbc + b_col, mask=s_ok, other=0.0).to(tl.float32)
    C = tl.load(xbc_ptr + row * stride_xbc + c_col, mask=s_ok, other=0.0).to(tl.float32)
    state = state * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
    y = tl.sum(state * C[None, :], axis=1) + D * x
    tl.store(y_ptr + row * stride_y + h * HEAD_DIM + p, y.to(y_ptr.dtype.element_ty), mask=p < p_live)
    tl.store(state_ptrs, state.to(ssm_state_ptr.dtype.element_ty), mask=(p < p_live)[:, None] & s_ok[None, :])


def _check_ssm_args(xbc, dt, A_log, D, dt_bias, y, ssm_state, n_groups):
    _, num_heads, head_dim, state = ssm_state.shape
    assert num_heads % n_groups == 0, (num_heads, n_groups)
    assert xbc.shape[1] == num_heads * head_dim + 2 * n_groups * state, (xbc.shape, ssm_state.shape, n_groups)
    assert dt.shape[1] == num_heads and y.shape[1] == num_heads * head_dim, (dt.shape, y.shape)
    assert A_log.shape == D.shape == dt_bias.shape == (num_heads,), (A_log.shape, D.shape, dt_bias.shape)
    assert xbc.stride(1) == 1 and dt.stride(1) == 1 and y.stride(1) == 1 and ssm_state.stride(3) == 1
    return num_heads, head_dim, state


def ssd_chunk_scan(
    xbc: torch.Tensor,  # [>= num_tokens, conv_dim], after the conv
    dt: torch.Tensor,  # [>= num_tokens, num_heads], raw; rows may be strided
    A_log: torch.Tensor,  # [num_heads]
    D: torch.Tensor,  # [num_heads]
    dt_bias: torch.Tensor,  # [num_heads]
    y: torch.Tensor,  # [>= num_tokens, num_heads * head_dim]: written for the served requests' tokens
    ssm_state: torch.Tensor,  # [num_slots, num_heads, head_dim, state], updated in place
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    state_slots: torch.Tensor,  # [num_reqs] int32; -1 (graph padding, no tokens): no state read or written
    has_initial_state: torch.Tensor,  # [num_reqs] bool
    req_idx: torch.Tensor,  # [num_served] int32: indices into the batch's requests
    *,
    n_groups: int,
    time_step_limit: tuple[float, float],
    interpret: bool = False,
) -> torch.Tensor:
    num_heads, head_dim, state = _check_ssm_args(xbc, dt, A_log, D, dt_bias, y, ssm_state, n_groups)
    assert req_idx.dtype == query_start_loc.dtype == state_slots.dtype == torch.int32
    if req_idx.shape[0] == 0:
        return y
    block_p = min(max(16, triton.next_power_of_2(head_dim)), 32 if interpret else 64)
    block_l = 16 if interpret else 32
    exact = interpret or xbc.dtype == torch.float32
    grid = (req_idx.shape[0], num_heads, triton.cdiv(head_dim, block_p))
    _ssd_chunk_scan_kernel[grid](
        xbc, dt, A_log, D, dt_bias, y, ssm_state, query_start_loc, state_slots, has_initial_state, req_idx,
        xbc.stride(0), dt.stride(0), y.stride(0), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        float(time_step_limit[0]), float(time_step_limit[1]),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, STATE=state, HEADS_PER_GROUP=num_heads // n_groups,
        BLOCK_L=block_l, BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(state)),
        DOT_PRECISION="ieee" if exact else "tf32", num_warps=4,
    )  # fmt: skip
    return y


def selective_state_update(
    xbc: torch.Tensor,  # [>= num_tokens, conv_dim], after the conv
    dt: torch.Tensor,  # [>= num_tokens, num_heads], raw
    A_log: torch.Tensor,  # [num_heads]
    D: torch.Tensor,  # [num_heads]
    dt_bias: torch.Tensor,  # [num_heads]
    y: torch.Tensor,  # [>= num_tokens, num_heads * head_dim]
    ssm_state: torch.Tensor,  # [num_slots, num_heads, head_dim, state], updated in place
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    state_slots: torch.Tensor,  # [num_reqs] int32; -1 (graph padding, no tokens): no state read or written
    has_initial_state: torch.Tensor,  # [num_reqs] bool
    req_idx: torch.Tensor,  # [num_decodes] int32: requests with exactly one token this step
    *,
    n_groups: int,
    time_step_limit: tuple[float, float],
) -> torch.Tensor:
    num_heads, head_dim, state = _check_ssm_args(xbc, dt, A_log, D, dt_bias, y, ssm_state, n_groups)
    assert req_idx.dtype == query_start_loc.dtype == state_slots.dtype == torch.int32
    if req_idx.shape[0] == 0:
        return y
    block_p = min(triton.next_power_of_2(head_dim), 32)
    grid = (req_idx.shape[0], num_heads, triton.cdiv(head_dim, block_p))
    _selective_state_update_kernel[grid](
        xbc, dt, A_log, D, dt_bias, y, ssm_state, query_start_loc, state_slots, has_initial_state, req_idx,
        xbc.stride(0), dt.stride(0), y.stride(0), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        float(time_step_limit[0]), float(time_step_limit[1]),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, STATE=state, HEADS_PER_GROUP=num_heads // n_groups,
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state), num_warps=4,
    )  # fmt: skip
    return y
