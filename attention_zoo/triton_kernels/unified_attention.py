"""One varlen paged-attention kernel for prefill, decode and mixed batches, plus its split-KV reduction.

Grid `(num_q_tiles, num_kv_heads, num_splits)`. A program owns BLOCK_Q query tokens of one request
and all GROUP = num_heads // num_kv_heads query heads that share one KV head, so each K/V tile is
loaded once per KV head; the BLOCK_Q * GROUP (query token, head) pairs are the rows of the
[BLOCK_M, HEAD_PAD] Q tile (row r -> token r // GROUP, head r % GROUP). Request i's tiles start at
global tile `query_start_loc[i] // BLOCK_Q + i` (or `query_start_loc[i]` when BLOCK_Q == 1), so the
grid depends only on host integers (num_tokens, num_reqs) and a binary search over query_start_loc
finds a program's request: no per-step host work and no host sync, which keeps launches
CUDA-graph safe. Programs past the end of their request exit at once.

Each program walks TILE_N-key tiles of the paged cache (a tile may span several pages: the page of
every key is looked up in the block table), from the first key the tile's earliest query can see
(0, or the window start) to the last key its latest query can see (causal: query j of a request
with `ctx = seq_len - query_len` cached tokens sits at position ctx + j). Softmax is online in
fp32 in base 2 (scale * log2(e) folded into the scores).

Token-tree steps (USE_TREE, a constexpr: the causal path compiles as without it) also give each query
token a 64-bit mask over its request's query tokens (`tree_bits`): a key at position ctx + j is seen
only where bit j of the row's mask is set. Only tiles wholly inside the cached context skip the mask.

With NUM_SPLITS > 1 (flash-decoding) the program's key range is cut into NUM_SPLITS contiguous
pieces of at least `min_split_tokens` keys (the pieces past the range stay empty), one per program
along grid axis 2; each writes its unnormalised accumulator and its running max / sum to a
workspace, and `_reduce_splits_kernel` merges them:
    m = max_s m_s,  out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _find_request(
    query_start_loc_ptr,  # [num_reqs + 1] int32
    tile,
    num_reqs,
    BLOCK_Q: tl.constexpr,
):
    """The largest request i whose first tile is <= tile."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid)
        if BLOCK_Q > 1:
            first = first // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, HEAD_PAD]
    m_i,  # [BLOCK_M] fp32 running max (base 2)
    l_i,  # [BLOCK_M] fp32 running sum
    acc,  # [BLOCK_M, HEAD_PAD] fp32
    t,  # key tile index: keys t * TILE_N ...
    kv_lo,
    kv_hi,
    row_valid,
    q_pos,
    sliding_window,
    ctx_len,
    row_bits,  # [BLOCK_M] int64: each row's tree mask over its request's query tokens (USE_TREE)
    kv_ptrs,  # (k_cache_ptr, v_cache_ptr, this request's block table row)
    strides,  # (stride_c_blk, stride_c_slot, stride_c_head)
    kv_head,
    scale_log2,
    d_valid,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row
    USE_WINDOW: tl.constexpr,
    USE_TREE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    k_cache_ptr, v_cache_ptr, bt_row = kv_ptrs
    stride_c_blk, stride_c_slot, stride_c_head = strides
    k_idx = t * TILE_N + tl.arange(0, TILE_N)
    d = tl.arange(0, HEAD_PAD)
    if MASKED:
        # Loads stay inside [kv_lo, kv_hi): pages outside the window may be freed (null block 0).
        k_valid = (k_idx >= kv_lo) & (k_idx < kv_hi)
        blk = tl.load(bt_row + k_idx // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        kv_mask = k_valid[:, None] & d_valid[None, :]  # [TILE_N, HEAD_PAD]
    else:
        blk = tl.load(bt_row + k_idx // BLOCK_SIZE).to(tl.int64)
        kv_mask = (k_idx >= 0)[:, None] & d_valid[None, :]
    kv_off = blk * stride_c_blk + (k_idx % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head
    k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=tl.trans(kv_mask), other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
    if MASKED:
        attend = row_valid[:, None] & k_valid[None, :] & (k_idx[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            attend = attend & (k_idx[None, :] > q_pos[:, None] - sliding_window)
        if USE_TREE:
            # the key at ctx_len + j (one of the step's own tokens) needs bit j; clamped so every shift is defined
            j = tl.minimum(tl.maximum(k_idx - ctx_len, 0), 63).to(tl.int64)
            in_tree = ((row_bits[:, None] >> j[None, :]) & 1) != 0
            attend = attend & ((k_idx < ctx_len)[None, :] | in_tree)
        s = tl.where(attend, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_reqs"])
def _unified_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    q_ptr,  # [num_tokens, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] fp32 (NUM_SPLITS > 1 only)
    part_m_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, running max (base 2)
    part_l_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, running sum
    tree_bits_ptr,  # [num_tokens] int64 (USE_TREE only)
    num_reqs,
    scale_log2,  # softmax scale * log2(e)
    sliding_window,  # used when USE_WINDOW
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_blk,
    stride_c_slot,
    stride_c_head,
    stride_bt_req,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # power of 2 >= max(HEAD_SIZE, 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # power of 2 >= max(BLOCK_Q * GROUP, 16)
    TILE_N: tl.constexpr,  # keys per inner iteration
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,  # >= 1: the fewest key tiles a split takes
    USE_WINDOW: tl.constexpr,
    USE_TREE: tl.constexpr,  # tree_bits masks the step's own keys (token-tree verify)
    UPCAST: tl.constexpr,  # compute in fp32 (fp32 inputs, or the interpreter, which garbles bf16 math)
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if BLOCK_Q > 1:
        q_first = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    else:
        q_first = tile - q_start
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_local = q_first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = ctx_len + q_local  # [BLOCK_M] absolute position of each row's query
    tok = (q_start + q_local).to(tl.int64)
    d = tl.arange(0, HEAD_PAD)
    d_valid = d < HEAD_SIZE

    # Keys any row of this tile may attend to: [kv_lo, kv_hi). Tiles wholly outside are never visited.
    kv_hi = tl.minimum(seq_len, ctx_len + q_first + BLOCK_Q)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx_len + q_first - sliding_window + 1, 0)
    t_begin = kv_lo // TILE_N
    t_end = tl.cdiv(kv_hi, TILE_N)
    if NUM_SPLITS > 1:
        # at least MIN_SPLIT_TILES a split: a plan fixed for the longest context (a CUDA graph's) leaves the splits
        # a short context does not need empty (they exit at once and weigh 0) instead of cutting it into slivers
        per_split = tl.maximum(tl.cdiv(t_end - t_begin, NUM_SPLITS), MIN_SPLIT_TILES)
        t_begin = t_begin + split * per_split
        t_end = tl.minimum(t_end, t_begin + per_split)
        if t_begin >= t_end:  # an empty split: weight 0 in the reduction, which then skips its accumulator
            part = (tok * NUM_HEADS + head) * NUM_SPLITS + split
            tl.store(part_m_ptr + part, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=row_valid)
            tl.store(part_l_ptr + part, tl.zeros([BLOCK_M], dtype=tl.float32), mask=row_valid)
            return

    q_mask = row_valid[:, None] & d_valid[None, :]
    q_off = tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)  # zero pad lanes: they meet zero-padded K lanes
    if UPCAST:
        q = q.to(tl.float32)
    row_bits = tl.zeros([BLOCK_M], dtype=tl.int64)
    if USE_TREE:
        row_bits = tl.load(tree_bits_ptr + tok, mask=row_valid, other=0)

    # Tiles every valid row sees whole (below the diagonal, inside the window) skip the mask:
    # [t_begin, f_lo) masked, [f_lo, f_hi) unmasked, [f_hi, t_end) masked.
    q_last = tl.minimum(q_first + BLOCK_Q, q_len) - 1
    full_lo = 0
    if USE_WINDOW:
        full_lo = tl.cdiv(tl.maximum(ctx_len + q_last - sliding_window + 1, 0), TILE_N)
    f_lo = tl.minimum(tl.maximum(full_lo, t_begin), t_end)
    full_hi = ctx_len + q_first + 1  # keys every row sees causally
    if USE_TREE:
        full_hi = ctx_len  # the step's own keys need each row's bits
    f_hi = tl.minimum(tl.maximum(full_hi // TILE_N, f_lo), t_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt_req
    kv_ptrs = (k_cache_ptr, v_cache_ptr, bt_row)
    strides = (stride_c_blk, stride_c_slot, stride_c_head)
    for t in range(t_begin, f_lo):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t, kv_lo, kv_hi, row_valid, q_pos, sliding_window, ctx_len, row_bits, kv_ptrs, strides,
            kv_head, scale_log2, d_valid, HEAD_PAD, BLOCK_SIZE, TILE_N, True, USE_WINDOW, USE_TREE, UPCAST,
            DOT_PRECISION,
        )  # fmt: skip
    for t in range(f_lo, f_hi):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t, kv_lo, kv_hi, row_valid, q_pos, sliding_window, ctx_len, row_bits, kv_ptrs, strides,
            kv_head, scale_log2, d_valid, HEAD_PAD, BLOCK_SIZE, TILE_N, False, USE_WINDOW, USE_TREE, UPCAST,
            DOT_PRECISION,
        )  # fmt: skip
    for t in range(f_hi, t_end):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t, kv_lo, kv_hi, row_valid, q_pos, sliding_window, ctx_len, row_bits, kv_ptrs, strides,
            kv_head, scale_log2, d_valid, HEAD_PAD, BLOCK_SIZE, TILE_N, True, USE_WINDOW, USE_TREE, UPCAST,
            DOT_PRECISION,
        )  # fmt: skip

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (tok * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M] row of the workspace
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_reqs"])
def _reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] fp32
    part_m_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    part_l_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_reqs,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    if tok >= tl.load(query_start_loc_ptr + num_reqs):
        return  # padding token past the batch: no partials were written for it
    s = tl.arange(0, SPLITS_PAD)
    s_valid = s < NUM_SPLITS
    part = (tok.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + s
    m = tl.load(part_m_ptr + part, mask=s_valid, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s_valid, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits (m = -inf) weigh 0
    d = tl.arange(0, HEAD_PAD)
    live = s_valid & (m > float("-inf"))  # an empty split wrote no accumulator
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], mask=live[:, None], other=0.0)
    denom = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    o_off = tok.to(tl.int64) * stride_o_tok + head * stride_o_head + d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)


@dataclass(frozen=True)
class TileConfig:
    block_q: int  # query tokens per program
    tile_n: int  # keys per inner iteration (a power of 2 >= 16)
    num_warps: int = 4
    num_stages: int = 2


def default_tile_config(max_query_len: int, group: int, head_size: int, interpret: bool) -> TileConfig:
    """Decode (every query length 1): one token per program, its GROUP heads as rows; else ~64 rows.

    Measured on an H200 (32 q / 8 kv heads, d 128, bf16): decode at 64 x 8k moves 4.3 TB/s with
    tile_n 64 and 2 warps, 3 stages; prefill 1 x 8k is best at 64 rows, tile_n 64, 4 warps, 3 stages.
    """
    if interpret:  # the interpreter's cost is per operation, so fewer, bigger steps are faster
        return TileConfig(block_q=1 if max_query_len == 1 else max(1, 16 // group), tile_n=16)
    if max_query_len == 1:
        return TileConfig(block_q=1, tile_n=64, num_warps=2, num_stages=3)
    return TileConfig(block_q=max(1, 64 // group), tile_n=64, num_warps=4, num_stages=3)


def batch_invariant_tile_config(group: int, head_size: int, interpret: bool) -> TileConfig:
    """One tile for every step (decode, verify, prefill chunk): the Q tile's rows BLOCK_M, the key tile and the
    warps depend on the head shape only, so each (query token, head) row goes through the same dot shapes and
    the same key tiles, at absolute boundaries t * tile_n, whatever the step (`batch_invariant` plans).

    BLOCK_M = max(16, group rounded up to a power of 2) rows, as `default_tile_config` gives decode (one token's
    GROUP heads, padded), here filled with more tokens for longer queries: decode keeps its tile, prefill gives up
    its 64-row tiles.
    """
    block_q = max(1, 16 // group)
    if interpret:
        return TileConfig(block_q=block_q, tile_n=16)
    return TileConfig(block_q=block_q, tile_n=64, num_warps=2, num_stages=3)


def unified_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    out: torch.Tensor,  # [num_tokens, num_heads, head_size], written for tokens < query_start_loc[-1]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length including this step's tokens
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    *,
    num_reqs: int,
    scale: float,
    sliding_window: int | None,
    config: TileConfig,
    num_splits: int = 1,
    min_split_tokens: int = 0,  # keys a split takes at least (rounded down to tiles): the rest of the splits idle
    upcast: bool = False,
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64: token-tree masks (see CommonAttentionMetadata)
) -> torch.Tensor:
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    num_tokens, num_heads, _ = q.shape
    assert q.shape[2] == head_size and out.shape == q.shape, (q.shape, out.shape, kv_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.dtype == kv_cache.dtype == out.dtype, (q.dtype, kv_cache.dtype, out.dtype)
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert block_table.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    assert block_table.stride(-1) == 1 and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
    assert query_start_loc.shape[0] >= num_reqs + 1 and seq_lens.shape[0] >= num_reqs
    assert tree_bits is None or (tree_bits.dtype == torch.int64 and tree_bits.is_contiguous()), tree_bits
    assert num_splits >= 1 and config.tile_n >= 16 and triton.next_power_of_2(config.tile_n) == config.tile_n
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    block_m = max(16, triton.next_power_of_2(config.block_q * group))
    num_q_tiles = num_tokens if config.block_q == 1 else num_tokens // config.block_q + num_reqs
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if num_splits > 1:
        # One allocation (eager launches are host-bound at small batches): [acc | m | l] per row.
        rows = num_tokens * num_heads * num_splits
        workspace = torch.empty(rows * (head_pad + 2), dtype=torch.float32, device=q.device)
        part_acc = workspace[: rows * head_pad]
        part_m = workspace[rows * head_pad : rows * (head_pad + 1)]
        part_l = workspace[rows * (head_pad + 1) :]
    else:
        part_acc = part_m = part_l = out  # unused when NUM_SPLITS == 1
    _unified_attention_kernel[(num_q_tiles, num_kv_heads, num_splits)](
        out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        part_acc, part_m, part_l, out if tree_bits is None else tree_bits,
        num_reqs, scale * math.log2(math.e), sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        BLOCK_Q=config.block_q, BLOCK_M=block_m, TILE_N=config.tile_n, NUM_SPLITS=num_splits,
        MIN_SPLIT_TILES=max(1, min_split_tokens // config.tile_n),
        USE_WINDOW=sliding_window is not None, USE_TREE=tree_bits is not None,
        UPCAST=upcast or q.dtype == torch.float32,
        DOT_PRECISION="ieee" if (upcast or q.dtype == torch.float32) else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_m, part_l, query_start_loc, num_reqs, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, num_warps=4,
        )  # fmt: skip
    return out
