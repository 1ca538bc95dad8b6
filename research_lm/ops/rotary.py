"""Rotary position embedding (GPT-NeoX halves layout) for q and k in one kernel, cos/sin computed in-kernel.

Why: in torch, rotating one tensor is ~10 kernels (slice, float casts, four multiplies, add, sub, cat, cast;
another cat for partial rotary), twice per layer, plus ~6 more per step for the cos/sin table. The kernel
reads positions and inv_freq, computes cos/sin in fp32 as `rope_cos_sin` does, and writes rotated copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2, round_to


@triton.jit
def _rotate_heads(
    x_ptr,  # [num_tokens, num_heads, head_size] at (token, head) strides, dim stride 1
    out_ptr,  # [num_tokens, num_heads, head_size] contiguous
    token,  # int64
    stride_t,
    stride_h,
    num_heads,
    head_size,
    half,  # rotary_dim // 2
    cos,  # [BLOCK_R] fp32, scaled
    sin,  # [BLOCK_R] fp32, scaled
    BLOCK_H: tl.constexpr,  # power of 2 >= num_heads
    BLOCK_R: tl.constexpr,  # power of 2 >= half
    BLOCK_P: tl.constexpr,  # power of 2 >= head_size - rotary_dim; 0 when every dim rotates
):
    h = tl.arange(0, BLOCK_H)[:, None]
    r = tl.arange(0, BLOCK_R)[None, :]
    mask = (h < num_heads) & (r < half)
    src = x_ptr + token * stride_t + h * stride_h
    dst = out_ptr + token * num_heads * head_size + h * head_size
    x1 = tl.load(src + r, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + r, mask=mask, other=0.0).to(tl.float32)
    c, s = cos[None, :], sin[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(dst + r, round_to(x1 * c - x2 * s, dtype), mask=mask)
    tl.store(dst + half + r, round_to(x2 * c + x1 * s, dtype), mask=mask)
    if BLOCK_P > 0:  # partial rotary: copy the tail
        p = 2 * half + tl.arange(0, BLOCK_P)[None, :]
        pmask = (h < num_heads) & (p < head_size)
        tl.store(dst + p, tl.load(src + p, mask=pmask, other=0.0), mask=pmask)


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _rotary_kernel(
    q_ptr,
    k_ptr,  # unused without HAS_K
    q_out_ptr,
    k_out_ptr,
    positions_ptr,  # [num_tokens] int
    inv_freq_ptr,  # [half] fp32
    attention_scaling,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    num_q_heads,
    num_k_heads,
    head_size,
    half,
    HAS_K: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # One program per token: cos/sin once, then every q head and every k head.
    token = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    freqs = tl.load(positions_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + r, mask=r < half, other=0.0)
    cos = tl.cos(freqs) * attention_scaling
    sin = tl.sin(freqs) * attention_scaling
    _rotate_heads(q_ptr, q_out_ptr, token, q_stride_t, q_stride_h, num_q_heads, head_size, half, cos, sin,
                  BLOCK_HQ, BLOCK_R, BLOCK_P)
    if HAS_K:
        _rotate_heads(k_ptr, k_out_ptr, token, k_stride_t, k_stride_h, num_k_heads, head_size, half, cos, sin,
                      BLOCK_HK, BLOCK_R, BLOCK_P)


def rotary_embedding(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_size], dim stride 1 (views into a qkv output are fine)
    k: torch.Tensor | None,  # [num_tokens, num_k_heads, head_size], q's dtype, dim stride 1
    positions: torch.Tensor,  # [num_tokens] int64
    inv_freq: torch.Tensor,  # [rotary_dim // 2] fp32
    attention_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # rotated copies of q and k, contiguous
    """`rotary_ref` in one kernel launch for q and k."""
    num_tokens, num_q_heads, head_size = q.shape
    half = inv_freq.shape[0]
    assert q.stride(-1) == 1 and 0 < 2 * half <= head_size, (q.shape, q.stride(), inv_freq.shape)
    assert positions.shape == (num_tokens,) and not positions.is_floating_point(), positions.shape
    assert inv_freq.dtype == torch.float32 and inv_freq.is_contiguous() and positions.is_contiguous()
    assert positions.device == q.device == inv_freq.device
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = None
    if k is not None:
        assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_size, (k.shape, q.shape)
        assert k.dtype == q.dtype and k.stride(-1) == 1 and k.device == q.device
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        num_k_heads = k.shape[1] if k is not None else 1
        pass_dims = head_size - 2 * half
        _rotary_kernel[(num_tokens,)](
            q, k if k is not None else q, q_out, k_out if k is not None else q_out, positions, inv_freq,
            float(attention_scaling), q.stride(0), q.stride(1), *(k.stride()[:2] if k is not None else (0, 0)),
            num_q_heads, num_k_heads, head_size, half,
            HAS_K=k is not None, BLOCK_HQ=next_power_of_2(num_q_heads), BLOCK_HK=next_power_of_2(num_k_heads),
            BLOCK_R=next_power_of_2(half), BLOCK_P=next_power_of_2(pass_dims) if pass_dims else 0,
            num_warps=4 if num_q_heads * head_size >= 1024 else 1,
        )
    return q_out, k_out
