"""MLA decode over the paged latent cache: the latent write and the absorbed-attention kernel.

The absorbed decode is multi-query attention with one "KV head" of width L + R shared by all H
query heads: scores use q_lat [H, L] (q_nope folded through W_UK) against the latent c and q_pe
[H, R] against k_pe; values are the latents c themselves, so the kernel returns o_lat [H, L] and
the caller applies W_UV. Grid `(num_decode_tokens, cdiv(H, BLOCK_H), NUM_SPLITS)`: a program owns
BLOCK_H heads of one decode row, so each latent tile is read once per BLOCK_H heads (H / BLOCK_H
times per token in all, vs H times for per-head K/V). Each decode row has a request (block table
row) and its own key count, so a request with several query tokens (draft verification, a prompt)
is several rows, each causal. `mla_decode` reads them from per-row index tensors; `mla_decode_tokens`
makes every token row of a batch a row and finds both on the device from query_start_loc and
seq_lens (a binary search per program), so a CUDA graph replays it for any step of its shape; rows
past the batch's tokens (padding) see 0 keys and return 0. Softmax is online in fp32, base 2.

With NUM_SPLITS > 1 (few rows, long contexts) the key range is cut into contiguous pieces of at
least MIN_SPLIT_TILES tiles, one per program on grid axis 2; each stores its normalised partial
output and its log2-sum-exp, and `merge_splits` combines them: out = sum_s 2^(lse_s - lse) o_s,
lse = log2 sum_s 2^lse_s.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from attention_zoo.triton_kernels.unified_attention import _find_request


@triton.jit
def _write_latent_kernel(
    cache_ptr,  # [num_blocks, block_size, L + R]
    kv_c_ptr,  # [num_tokens, L]
    k_pe_ptr,  # [num_tokens, R]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    stride_c_slot,  # one slot's stride (= stride of dim 1; blocks are contiguous slots)
    stride_kv_c,
    stride_k_pe,
    L: tl.constexpr,
    L_PAD: tl.constexpr,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    dst = cache_ptr + slot * stride_c_slot
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    c = tl.load(kv_c_ptr + tok * stride_kv_c + dl, mask=dl < L)
    tl.store(dst + dl, c.to(cache_ptr.dtype.element_ty), mask=dl < L)
    pe = tl.load(k_pe_ptr + tok * stride_k_pe + dr, mask=dr < R)
    tl.store(dst + L + dr, pe.to(cache_ptr.dtype.element_ty), mask=dr < R)


def write_latent(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    kv_c: torch.Tensor,  # [num_tokens (+ pad), L]
    k_pe: torch.Tensor,  # [num_tokens (+ pad), R]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, not written
) -> None:
    num_blocks, block_size, width = kv_cache.shape
    num_tokens = slot_mapping.shape[0]
    L, R = kv_c.shape[-1], k_pe.shape[-1]
    assert width == L + R and kv_c.shape[0] >= num_tokens and k_pe.shape[0] >= num_tokens, (
        kv_cache.shape, kv_c.shape, k_pe.shape, num_tokens)  # fmt: skip
    assert kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1 and kv_cache.is_contiguous()
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    _write_latent_kernel[(num_tokens,)](
        kv_cache, kv_c, k_pe, slot_mapping, kv_cache.stride(1), kv_c.stride(0), k_pe.stride(0),
        L=L, L_PAD=triton.next_power_of_2(L), R=R, R_PAD=triton.next_power_of_2(R),
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_reqs"])
def _mla_decode_kernel(
    out_ptr,  # [N, H, NUM_SPLITS, L] (fp32 partials) or [N, H, L] (NUM_SPLITS == 1, q's dtype)
    lse_ptr,  # [N, H, NUM_SPLITS] fp32, log2-sum-exp of each split (NUM_SPLITS > 1 only)
    q_lat_ptr,  # [N, H, L]: W_UK^T q_nope
    q_pe_ptr,  # [N, H, R]
    cache_ptr,  # [num_blocks, block_size, L + R]
    block_table_ptr,  # [num_reqs, max_blocks_per_req] int32
    req_idx_ptr,  # [N] int32 (ROWS_FROM_QSL: query_start_loc [num_reqs + 1] int32)
    kv_lens_ptr,  # [N] int32 (ROWS_FROM_QSL: seq_lens [num_reqs] int32)
    num_reqs,  # ROWS_FROM_QSL only
    num_heads,
    scale_log2,  # softmax scale * log2(e)
    stride_ql_tok,
    stride_ql_head,
    stride_qp_tok,
    stride_qp_head,
    stride_o_tok,
    stride_o_head,
    stride_o_split,
    stride_c_blk,
    stride_c_slot,
    stride_bt_req,
    L: tl.constexpr,
    L_PAD: tl.constexpr,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # heads per program, >= 16 (tl.dot)
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,  # >= 1: the fewest key tiles a split takes
    ROWS_FROM_QSL: tl.constexpr,  # row = token: its request and key count found from query_start_loc / seq_lens
    UPCAST: tl.constexpr,  # compute in fp32 (fp32 inputs, or the interpreter, which garbles bf16 math)
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_valid = heads < num_heads
    if ROWS_FROM_QSL:
        # token `row` of request req (query ending at q_end) sits at position seq_len - (q_end - row):
        # it sees that many keys + 1. Rows past the last request's query (padding) see none.
        req32 = _find_request(req_idx_ptr, row, num_reqs, 1)
        q_end = tl.load(req_idx_ptr + req32 + 1)
        kv_len = tl.load(kv_lens_ptr + req32) - q_end + row + 1
        kv_len = tl.where(row < tl.load(req_idx_ptr + num_reqs), kv_len, 0)
        req = req32.to(tl.int64)
    else:
        req = tl.load(req_idx_ptr + row).to(tl.int64)
        kv_len = tl.load(kv_lens_ptr + row)

    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    row64 = row.to(tl.int64)
    q_lat = tl.load(q_lat_ptr + row64 * stride_ql_tok + heads[:, None] * stride_ql_head + dl[None, :],
                    mask=h_valid[:, None] & (dl < L)[None, :], other=0.0)  # [BLOCK_H, L_PAD]
    q_pe = tl.load(q_pe_ptr + row64 * stride_qp_tok + heads[:, None] * stride_qp_head + dr[None, :],
                   mask=h_valid[:, None] & (dr < R)[None, :], other=0.0)  # [BLOCK_H, R_PAD]
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    t_end = tl.cdiv(kv_len, BLOCK_N)
    t_begin = 0
    if NUM_SPLITS > 1:
        # a split count fixed for the longest context (a CUDA graph's) leaves the splits a short row does not
        # need empty (weight 0 in the merge) instead of cutting it into slivers
        per_split = tl.maximum(tl.cdiv(t_end, NUM_SPLITS), MIN_SPLIT_TILES)
        t_begin = split * per_split
        t_end = tl.minimum(t_end, t_begin + per_split)

    bt_row = block_table_ptr + req * stride_bt_req
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], dtype=tl.float32)
    for t in range(t_begin, t_end):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = n < kv_len
        blk = tl.load(bt_row + n // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
        slot = blk * stride_c_blk + (n % PAGE_SIZE) * stride_c_slot  # [BLOCK_N]
        c = tl.load(cache_ptr + slot[:, None] + dl[None, :], mask=n_valid[:, None] & (dl < L)[None, :],
                    other=0.0)  # [BLOCK_N, L_PAD]
        pe_t = tl.load(cache_ptr + slot[None, :] + L + dr[:, None], mask=n_valid[None, :] & (dr < R)[:, None],
                       other=0.0)  # [R_PAD, BLOCK_N]
        if UPCAST:
            c = c.to(tl.float32)
            pe_t = pe_t.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, pe_t, input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds >= 1 valid key
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty split or a row of 0 keys stores 0 (and lse -inf)
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + row64 * stride_o_tok + heads[:, None] * stride_o_head + split * stride_o_split + dl[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & (dl < L)[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + (row64 * num_heads + heads) * NUM_SPLITS + split, lse, mask=h_valid)


def merge_splits(
    part_out: torch.Tensor,  # [N, H, S, L] fp32, each split's normalised output
    part_lse: torch.Tensor,  # [N, H, S] fp32, log2-sum-exp; -inf for an empty split
) -> torch.Tensor:  # [N, H, L] fp32; 0 for a row of 0 keys (every lse -inf)
    lse_max = part_lse.amax(dim=-1, keepdim=True)  # finite where the row has keys: split 0 holds some
    lse_max = lse_max.masked_fill(lse_max == float("-inf"), 0.0)  # padding rows: weights 0, not NaN
    w = torch.exp2(part_lse - lse_max)  # [N, H, S]
    # the largest weight of a row with keys is 1, so the clamp only turns a padding row's 0 / 0 into 0
    return (w[..., None] * part_out).sum(dim=2) / w.sum(dim=-1).clamp_min(1.0)[..., None]


def mla_decode(
    q_lat: torch.Tensor,  # [N, H, L], any row/head strides
    q_pe: torch.Tensor,  # [N, H, R], any row/head strides
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    req_idx: torch.Tensor,  # [N] int32: each row's request
    kv_lens: torch.Tensor,  # [N] int32: keys each row attends to (0: none, the row's output is 0)
    *,
    scale: float,
    num_splits: int = 1,
    min_split_tokens: int = 0,  # keys a split takes at least (rounded down to tiles): the rest of the splits idle
    block_h: int = 16,
    block_n: int = 16,
    upcast: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:  # o_lat [N, H, L] in q's dtype: sum_t p_t c_t, before W_UV
    assert req_idx.dtype == kv_lens.dtype == torch.int32 and req_idx.is_contiguous() and kv_lens.is_contiguous()
    assert req_idx.shape[0] == kv_lens.shape[0] == q_lat.shape[0], (req_idx.shape, kv_lens.shape, q_lat.shape)
    return _launch(
        q_lat, q_pe, kv_cache, block_table, req_idx, kv_lens, 0, rows_from_qsl=False, scale=scale,
        num_splits=num_splits, min_split_tokens=min_split_tokens, block_h=block_h, block_n=block_n, upcast=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def mla_decode_tokens(
    q_lat: torch.Tensor,  # [N, H, L], any row/head strides: row t = token t of the batch (N >= its tokens)
    q_pe: torch.Tensor,  # [N, H, R], any row/head strides
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length including this step's tokens
    *,
    num_reqs: int,
    scale: float,
    num_splits: int = 1,
    min_split_tokens: int = 0,
    block_h: int = 16,
    block_n: int = 16,
    upcast: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:  # o_lat [N, H, L] in q's dtype; rows >= query_start_loc[num_reqs] are 0
    """`mla_decode` with every token row a causal decode row of its request, found on the device: token t of
    a request whose query ends at token e sees seq_len - (e - t) + 1 keys. Reads no host value of the step."""
    assert query_start_loc.dtype == seq_lens.dtype == torch.int32
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    assert query_start_loc.shape[0] >= num_reqs + 1 and seq_lens.shape[0] >= num_reqs >= 1
    return _launch(
        q_lat, q_pe, kv_cache, block_table, query_start_loc, seq_lens, num_reqs, rows_from_qsl=True, scale=scale,
        num_splits=num_splits, min_split_tokens=min_split_tokens, block_h=block_h, block_n=block_n, upcast=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def _launch(
    q_lat, q_pe, kv_cache, block_table, rows_a, rows_b, num_reqs, *, rows_from_qsl, scale, num_splits,
    min_split_tokens, block_h, block_n, upcast, num_warps, num_stages,
) -> torch.Tensor:
    """Both launchers': rows_a, rows_b are req_idx, kv_lens, or (rows_from_qsl) query_start_loc, seq_lens."""
    num_rows, num_heads, L = q_lat.shape
    R = q_pe.shape[-1]
    assert q_pe.shape[:2] == (num_rows, num_heads) and kv_cache.shape[-1] == L + R, (
        q_lat.shape, q_pe.shape, kv_cache.shape)  # fmt: skip
    assert q_lat.dtype == q_pe.dtype == kv_cache.dtype, (q_lat.dtype, q_pe.dtype, kv_cache.dtype)
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and kv_cache.is_contiguous()
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert block_h >= 16 and block_n >= 16 and num_splits >= 1
    out = torch.empty(num_rows, num_heads, L, dtype=q_lat.dtype, device=q_lat.device)
    if num_rows == 0:
        return out
    upcast = upcast or q_lat.dtype == torch.float32
    if num_splits > 1:
        part = torch.empty(num_rows, num_heads, num_splits, L, dtype=torch.float32, device=q_lat.device)
        lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=q_lat.device)
        o, o_strides = part, (part.stride(0), part.stride(1), part.stride(2))
    else:
        lse = out  # unused
        o, o_strides = out, (out.stride(0), out.stride(1), 0)
    grid = (num_rows, triton.cdiv(num_heads, block_h), num_splits)
    _mla_decode_kernel[grid](
        o, lse, q_lat, q_pe, kv_cache, block_table, rows_a, rows_b, num_reqs,
        num_heads, scale * math.log2(math.e),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), *o_strides,
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        L=L, L_PAD=max(16, triton.next_power_of_2(L)), R=R, R_PAD=max(16, triton.next_power_of_2(R)),
        PAGE_SIZE=kv_cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        MIN_SPLIT_TILES=max(1, min_split_tokens // block_n), ROWS_FROM_QSL=rows_from_qsl,
        UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        out.copy_(merge_splits(part, lse))
    return out
