"""KV write: scatter this step's K/V rows into the paged cache at their slots (vLLM's reshape_and_cache)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _reshape_and_cache_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_size]
    v_ptr,  # [num_tokens, num_kv_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64; -1 = skip
    num_tokens,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # power of 2 >= NUM_KV_HEADS
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # power of 2 >= HEAD_SIZE
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block (page)
    BLOCK_T: tl.constexpr,  # tokens per program
):
    # Rows of the [BLOCK_T * HEADS_PAD, HEAD_PAD] tile: row r is (token r // HEADS_PAD, head r % HEADS_PAD).
    rows = tl.arange(0, BLOCK_T * HEADS_PAD)
    tok = tl.program_id(0) * BLOCK_T + rows // HEADS_PAD
    head = rows % HEADS_PAD
    tok_valid = tok < num_tokens
    slot = tl.load(slot_mapping_ptr + tok, mask=tok_valid, other=-1)
    d = tl.arange(0, HEAD_PAD)
    mask = ((slot >= 0) & (head < NUM_KV_HEADS))[:, None] & (d < HEAD_SIZE)[None, :]
    tok = tok.to(tl.int64)
    src_k = tok[:, None] * stride_k_tok + head[:, None] * stride_k_head + d[None, :]
    src_v = tok[:, None] * stride_v_tok + head[:, None] * stride_v_head + d[None, :]
    dst = (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot + head * stride_c_head
    dst = dst[:, None] + d[None, :]
    k = tl.load(k_ptr + src_k, mask=mask)
    v = tl.load(v_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,  # [>= num_tokens, num_kv_heads, head_size]
    v: torch.Tensor,  # [>= num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, not written
) -> None:
    """Write k[t], v[t] to flat slot slot_mapping[t] (= block * block_size + offset) for every t."""
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_tokens = slot_mapping.shape[0]
    assert k.shape[1:] == (num_kv_heads, head_size) and v.shape[1:] == k.shape[1:], (k.shape, v.shape)
    assert k.shape[0] >= num_tokens and v.shape[0] >= num_tokens
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    assert k.device == kv_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    heads_pad = triton.next_power_of_2(num_kv_heads)
    head_pad = triton.next_power_of_2(head_size)
    # ~4k elements per program on a GPU, whatever the token count (a tile that followed it would compile a kernel
    # per power of 2 mid-run); the interpreter pays per operation, so it takes more tokens and trims the tile.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    block_t = triton.next_power_of_2(max(1, (1 << 16 if interpreted else 4096) // (heads_pad * head_pad)))
    if interpreted:
        block_t = min(block_t, triton.next_power_of_2(num_tokens))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=heads_pad, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_T=block_t, num_warps=4,
    )  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"])
def _rope_and_cache_kernel(
    q_ptr,  # [num_tokens, num_heads, head_size], dim stride 1
    k_ptr,  # [num_tokens, num_kv_heads, head_size], dim stride 1
    v_ptr,  # [num_tokens, num_kv_heads, head_size], dim stride 1
    q_out_ptr,  # [num_tokens, num_heads, head_size] contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64; -1 = skip
    positions_ptr,  # [num_tokens] int
    inv_freq_ptr,  # [half] fp32
    attention_scaling,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    BLOCK_HQ: tl.constexpr,  # powers of 2 >= NUM_HEADS, NUM_KV_HEADS, HALF, HEAD_SIZE
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: cos/sin once (fp32, as `rope_cos_sin`), q's heads rotated into q_out, k's rotated and
    # v's copied straight into the token's cache slot.
    tok = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    freqs = tl.load(positions_ptr + tok).to(tl.float32) * tl.load(inv_freq_ptr + r, mask=r < HALF, other=0.0)
    cos = (tl.cos(freqs) * attention_scaling)[None, :]
    sin = (tl.sin(freqs) * attention_scaling)[None, :]
    d = tl.arange(0, BLOCK_D)[None, :]
    r = r[None, :]
    # q: the rotated halves, then the unrotated tail (partial rotary)
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    src = q_ptr + tok * stride_q_tok + hq * stride_q_head
    dst = q_out_ptr + tok * NUM_HEADS * HEAD_SIZE + hq * HEAD_SIZE
    heads, rot = hq < NUM_HEADS, r < HALF
    x1 = tl.load(src + r, mask=heads & rot, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + r, mask=heads & rot, other=0.0).to(tl.float32)
    dtype = q_out_ptr.dtype.element_ty
    tl.store(dst + r, (x1 * cos - x2 * sin).to(dtype), mask=heads & rot)
    tl.store(dst + HALF + r, (x2 * cos + x1 * sin).to(dtype), mask=heads & rot)
    tail = heads & (d >= 2 * HALF) & (d < HEAD_SIZE)
    tl.store(dst + d, tl.load(src + d, mask=tail, other=0.0), mask=tail)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot >= 0:
        hk = tl.arange(0, BLOCK_HK)[:, None]
        kv_heads = hk < NUM_KV_HEADS
        # (names of their own: Triton refuses a variable that the branch redefines with another shape)
        k_src = k_ptr + tok * stride_k_tok + hk * stride_k_head
        cache = (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot + hk * stride_c_head
        k1 = tl.load(k_src + r, mask=kv_heads & rot, other=0.0).to(tl.float32)
        k2 = tl.load(k_src + HALF + r, mask=kv_heads & rot, other=0.0).to(tl.float32)
        ctype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + cache + r, (k1 * cos - k2 * sin).to(dtype).to(ctype), mask=kv_heads & rot)
        tl.store(k_cache_ptr + cache + HALF + r, (k2 * cos + k1 * sin).to(dtype).to(ctype), mask=kv_heads & rot)
        k_tail = kv_heads & (d >= 2 * HALF) & (d < HEAD_SIZE)
        tl.store(k_cache_ptr + cache + d, tl.load(k_src + d, mask=k_tail, other=0.0).to(ctype), mask=k_tail)
        all_d = kv_heads & (d < HEAD_SIZE)
        v = tl.load(v_ptr + tok * stride_v_tok + hk * stride_v_head + d, mask=all_d, other=0.0)
        tl.store(v_cache_ptr + cache + d, v.to(v_cache_ptr.dtype.element_ty), mask=all_d)


def rope_and_cache(
    q: torch.Tensor,  # [num_tokens, num_heads, head_size], dim stride 1
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], q's dtype, dim stride 1
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, not written
    positions: torch.Tensor,  # [num_tokens] int
    inv_freq: torch.Tensor,  # [rotary_dim // 2] fp32
    attention_scaling: float,
) -> torch.Tensor:  # q rotated, [num_tokens, num_heads, head_size] contiguous
    """Rotary embedding (GPT-NeoX halves, cos/sin from positions and inv_freq in fp32) of q and k, and the KV write,
    in one launch: k rotated and v go straight to their slots. The numbers of `research_lm.ops.reference.rotary_ref`
    (rounded to q's dtype) followed by `reshape_and_cache`."""
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_tokens, num_heads, _ = q.shape
    half = inv_freq.shape[0]
    assert k.shape == (num_tokens, num_kv_heads, head_size) and v.shape == k.shape and 0 < 2 * half <= head_size
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and kv_cache.stride(-1) == 1 and k.dtype == q.dtype
    assert slot_mapping.shape[0] >= num_tokens and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    assert positions.shape[0] >= num_tokens and positions.is_contiguous() and inv_freq.dtype == torch.float32
    q_out = torch.empty((num_tokens, num_heads, head_size), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _rope_and_cache_kernel[(num_tokens,)](
        q, k, v, q_out, k_cache, v_cache, slot_mapping, positions, inv_freq, float(attention_scaling),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_R=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(head_size), BLOCK_SIZE=block_size,
        num_warps=4 if num_heads * head_size >= 1024 else 1,
    )  # fmt: skip
    return q_out
