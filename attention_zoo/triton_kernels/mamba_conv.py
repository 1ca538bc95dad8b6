"""Causal depthwise conv1d over a ragged batch with per-request conv state (Mamba2's conv over xBC).

Two launches: `_causal_conv1d_kernel` computes silu(bias + sum_k w[k] x[t - K + 1 + k]) for every token,
reading the inputs before the chunk from the request's conv state (zeros for a new request); then
`_conv_state_update_kernel` stores the last K - 1 inputs of (old state, chunk) back into the slot.
The split is what lets the first kernel run all (request, token tile, channel tile) programs at once
without racing the state it reads. A request of state slot -1 (a CUDA graph's padding, or its capture's batch)
reads and writes no state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,  # [num_tokens, conv_dim], row stride stride_x
    w_ptr,  # [conv_dim, KERNEL] contiguous
    b_ptr,  # [conv_dim] (unused without HAS_BIAS)
    conv_state_ptr,  # [num_slots, KERNEL - 1, conv_dim]
    out_ptr,  # [num_tokens, conv_dim], row stride stride_out
    query_start_loc_ptr,  # [num_reqs + 1] int32
    state_slots_ptr,  # [num_reqs] int32
    has_initial_ptr,  # [num_reqs] bool
    conv_dim,
    stride_x,
    stride_out,
    stride_s_slot,
    stride_s_t,
    KERNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(query_start_loc_ptr + req)
    n = tl.load(query_start_loc_ptr + req + 1) - start
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # position in this step's chunk
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = t < n
    c_ok = c < conv_dim
    slot = tl.load(state_slots_ptr + req).to(tl.int64)  # -1: a CUDA graph's padding request, no state
    # NOTE: conditions enter masks as integer bounds, not as scalar booleans: the interpreter rejects
    # a block mask and-ed with a scalar bool. Inputs from the state: src in [first_src, 0).
    first_src = -(KERNEL - 1) * (tl.load(has_initial_ptr + req).to(tl.int32) * (slot >= 0).to(tl.int32))
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(KERNEL):
        src = t - (KERNEL - 1) + k  # < 0: an input from before the chunk, row KERNEL - 1 + src of the state
        in_chunk = src >= 0
        xv = tl.load(
            x_ptr + (start + src).to(tl.int64)[:, None] * stride_x + c[None, :],
            mask=(t_ok & in_chunk)[:, None] & c_ok[None, :], other=0.0,
        ).to(tl.float32)
        sv = tl.load(
            conv_state_ptr + slot * stride_s_slot + (KERNEL - 1 + src)[:, None] * stride_s_t + c[None, :],
            mask=(t_ok & ~in_chunk & (src >= first_src))[:, None] & c_ok[None, :], other=0.0,
        ).to(tl.float32)
        w = tl.load(w_ptr + c * KERNEL + k, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    out = acc / (1.0 + tl.exp(-acc))  # silu
    tl.store(
        out_ptr + (start + t).to(tl.int64)[:, None] * stride_out + c[None, :],
        out.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :],
    )


@triton.jit
def _conv_state_update_kernel(
    x_ptr,  # [num_tokens, conv_dim], row stride stride_x
    conv_state_ptr,  # [num_slots, KERNEL - 1, conv_dim]
    query_start_loc_ptr,  # [num_reqs + 1] int32
    state_slots_ptr,  # [num_reqs] int32
    has_initial_ptr,  # [num_reqs] bool
    conv_dim,
    stride_x,
    stride_s_slot,
    stride_s_t,
    KERNEL: tl.constexpr,
    KM1_PAD: tl.constexpr,  # power of 2 >= KERNEL - 1
    BLOCK_C: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(query_start_loc_ptr + req)
    n = tl.load(query_start_loc_ptr + req + 1) - start
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(state_slots_ptr + req).to(tl.int64)
    first_src = -(KERNEL - 1) * tl.load(has_initial_ptr + req).to(tl.int32)  # as in _causal_conv1d_kernel
    num_rows = tl.where((n > 0) & (slot >= 0), KERNEL - 1, 0)  # an empty chunk or slot -1 leaves every state alone
    # Row j takes input src = n - K + 1 + j of (old state, chunk): old row j + n if src < 0. In place:
    # the barrier keeps every thread's store after every thread's load (rows can sit in different warps).
    j = tl.arange(0, KM1_PAD)
    src = n - (KERNEL - 1) + j
    mask = (j < num_rows)[:, None] & (c < conv_dim)[None, :]
    state = conv_state_ptr + slot * stride_s_slot + c[None, :]
    xv = tl.load(x_ptr + (start + src).to(tl.int64)[:, None] * stride_x + c[None, :],
                 mask=mask & (src >= 0)[:, None], other=0.0)
    from_state = (src < 0) & (src >= first_src)
    sv = tl.load(state + (KERNEL - 1 + src)[:, None] * stride_s_t, mask=mask & from_state[:, None], other=0.0)
    v = xv.to(tl.float32) + sv.to(tl.float32)
    tl.debug_barrier()
    tl.store(state + j[:, None] * stride_s_t, v.to(conv_state_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_varlen(
    x: torch.Tensor,  # [>= num_tokens, conv_dim]; rows may be strided (a column slice of in_proj's output)
    weight: torch.Tensor,  # [conv_dim, kernel] contiguous
    bias: torch.Tensor | None,  # [conv_dim]
    conv_state: torch.Tensor,  # [num_slots, kernel - 1, conv_dim], updated in place
    out: torch.Tensor,  # [>= num_tokens, conv_dim]: silu(conv(x)) for every token of the batch
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    state_slots: torch.Tensor,  # [num_reqs] int32; -1 (graph padding): the request reads and writes no state
    has_initial_state: torch.Tensor,  # [num_reqs] bool
    *,
    num_reqs: int,
    max_query_len: int,
    interpret: bool = False,
) -> torch.Tensor:
    conv_dim, kernel = weight.shape
    assert x.shape[1] == conv_dim and out.shape[1] == conv_dim, (x.shape, out.shape, weight.shape)
    assert conv_state.shape[1:] == (kernel - 1, conv_dim), (conv_state.shape, weight.shape)
    assert x.stride(1) == 1 and out.stride(1) == 1 and weight.is_contiguous() and conv_state.stride(2) == 1
    assert bias is None or (bias.shape == (conv_dim,) and bias.is_contiguous())
    assert query_start_loc.dtype == state_slots.dtype == torch.int32 and has_initial_state.dtype == torch.bool
    if num_reqs == 0 or max_query_len == 0:
        return out
    block_t = 16 if interpret else 32
    block_c = min(triton.next_power_of_2(conv_dim), 256 if interpret else 128)  # interpreter: few, big programs
    grid = (num_reqs, triton.cdiv(max_query_len, block_t), triton.cdiv(conv_dim, block_c))
    _causal_conv1d_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, out,
        query_start_loc, state_slots, has_initial_state,
        conv_dim, x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1),
        KERNEL=kernel, HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_C=block_c,
    )  # fmt: skip
    if kernel > 1:
        _conv_state_update_kernel[(num_reqs, triton.cdiv(conv_dim, block_c))](
            x, conv_state, query_start_loc, state_slots, has_initial_state,
            conv_dim, x.stride(0), conv_state.stride(0), conv_state.stride(1),
            KERNEL=kernel, KM1_PAD=triton.next_power_of_2(kernel - 1), BLOCK_C=block_c,
        )  # fmt: skip
    return out
