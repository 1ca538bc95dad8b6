"""A draft graph's bookkeeping in one Triton kernel: the entry's and the chain's attention records.

Why: a draft graph's forwards are small (a one-layer head over a handful of rows), so on the GPU its time follows
its kernel count, ~1.7 µs each on an H200. Of the 165 kernels of a batch-1 EAGLE-3 step (k = 5), ~40 were
bookkeeping before the forwards: the acceptance of the "verified" rule, the entry's slots, each chain step's
positions, seq lens and slots, and the chain's query_start_loc (PERFORMANCE.md, eleventh pass). They depend on
nothing the forwards compute, so one program computes them all before the entry forward.

The numbers are `spec_decode.draft_graphs`' torch path (the reference), value for value:
- per request row r < b: the "argmax" / "sample" rules read the staged query starts (real = qsl[r + 1] > qsl[r]),
  last rows, budgets and entry seq lens. "verified" stages nothing: the step's n requests (`num_reqs`, on the device)
  are rows r < n, each with q entry rows; its table row t = rows[r]; n_acc = the leading run of x[r*q + j + 1] ==
  g[r*q + j] over j < num_drafts[t] (the real drafts the verify step verified); last row r*q + n_acc; budget
  `spec_decode.heads.draft_budget` from the table, which holds this step's tokens: 0 where num_tokens[t] >=
  stop_at[t], else clamp(max_model_len - num_tokens[t] - 1, 0, K), written to num_drafts[t]; the rows the drafts go
  to, t or -1; entry seq len pos[r*q + q - 1] + 1 on real rows (else 0).
  Positions `pos` are the entry rows' (staged, or "verified" the verify step's own, shifted for a draft model).
  Chain step j = 1 .. K-1 sits at p = pos[last] + j, feeds (and writes KV) when real and p < pos[last] + budget,
  with seq len p + 1 on real rows (else 0), position p where it feeds (else 0), slot
  block_table[r, min(p // bs, last block)] * bs + p % bs where it feeds (else -1); the chain's query_start_loc is the
  running count of real rows;
- per entry token i < b*q: its request row (staged; "verified" i // q for i < n*q, else -1); it writes KV when that is
  >= 0 (and, "verified", i % q <= n_acc of that request), at block_table[row, min(pos // bs, last block)] * bs +
  pos % bs, else -1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2, num_warps_for

if TYPE_CHECKING:
    from spec_decode.draft_graphs import Verified

_MAX_BLOCK_T = 1024


@triton.jit
def _slot(bt_ptr, bt_stride, row, pos, writes, mask, bs, last_block):
    block = tl.load(bt_ptr + row * bt_stride + tl.minimum(pos // bs, last_block), mask=mask & writes, other=0)
    return tl.where(writes, block.to(tl.int64) * bs + pos % bs, -1)


@triton.jit
def _bookkeeping_kernel(
    staging_ptr,  # int64, `draft_graphs._Layout` offsets below (unread by VERIFIED)
    pos_ptr,  # int64 [>= b*q]: the entry rows' positions
    g_ptr,  # int64 [>= b*q]: the verify's argmax g (VERIFIED)
    x_ptr,  # int64 [>= b*q]: its input x (VERIFIED)
    num_reqs_ptr,  # int64 [1]: n (VERIFIED)
    rows_ptr,  # int32 [>= b]: each request's table row (VERIFIED)
    num_tokens_ptr,  # int32 [R] (VERIFIED)
    num_drafts_ptr,  # int32 [R]: read, then the budgets written (VERIFIED)
    stop_at_ptr,  # int64 [R] (VERIFIED)
    table_rows_ptr,  # int64 [b]: out, each request's table row or -1 (VERIFIED)
    max_model_len,
    bt_ptr,  # int32 [A, blocks]
    bt_stride,
    last_block,
    entry_qsl_ptr,  # int32 [b + 1]
    entry_seq_lens_ptr,  # int32 [b]
    entry_slots_ptr,  # int64 [b * q]
    last_ptr,  # int64 [b]: each request's last entry row
    qsl_ptr,  # int32 [b + 1]: the chain's query_start_loc
    positions_ptr,  # int64 [K - 1, chain_stride]
    seq_lens_ptr,  # int32 [K - 1, chain_stride]
    slots_ptr,  # int64 [K - 1, chain_stride]
    chain_stride,
    req_off, qsl_off, seq_off, last_off, budget_off,  # staging offsets
    b,
    q,
    bs,
    K: tl.constexpr,
    VERIFIED: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    r = tl.arange(0, BLOCK_B).to(tl.int64)
    rm = r < b
    if VERIFIED:
        n = tl.load(num_reqs_ptr)
        real = rm & (r < n)
        lo, hi = tl.minimum(r, n) * q, tl.minimum(r + 1, n) * q
        trow = tl.load(rows_ptr + r, mask=real, other=0).to(tl.int64)  # its row in the token table
        num_real = tl.load(num_drafts_ptr + trow, mask=real, other=0)
        n_acc = tl.zeros([BLOCK_B], tl.int64)
        alive = real
        for j in tl.static_range(K):
            g = tl.load(g_ptr + r * q + j, mask=rm, other=0)
            x = tl.load(x_ptr + r * q + j + 1, mask=rm, other=-1)
            alive = alive & (x == g) & (j < num_real)
            n_acc += alive.to(tl.int64)
        last = r * q + n_acc
        filled = tl.load(num_tokens_ptr + trow, mask=real, other=0).to(tl.int64)
        stop = tl.load(stop_at_ptr + trow, mask=real, other=0)
        budget = tl.where(filled >= stop, 0, tl.minimum(tl.maximum(max_model_len - filled - 1, 0), K))
        tl.store(num_drafts_ptr + trow, budget.to(tl.int32), mask=real)
        tl.store(table_rows_ptr + r, tl.where(real, trow, -1), mask=rm)
        seq = tl.where(real, tl.load(pos_ptr + r * q + q - 1, mask=rm, other=0) + 1, 0)
    else:
        lo = tl.load(staging_ptr + qsl_off + r, mask=rm, other=0)
        hi = tl.load(staging_ptr + qsl_off + r + 1, mask=rm, other=0)
        real = (hi > lo) & rm
        budget = tl.load(staging_ptr + budget_off + r, mask=rm, other=0)
        last = tl.load(staging_ptr + last_off + r, mask=rm, other=0)
        seq = tl.load(staging_ptr + seq_off + r, mask=rm, other=0)
    tl.store(last_ptr + r, last, mask=rm)
    tl.store(entry_qsl_ptr + r, lo.to(tl.int32), mask=rm)
    tl.store(entry_qsl_ptr + r + 1, hi.to(tl.int32), mask=rm)
    tl.store(entry_seq_lens_ptr + r, seq.to(tl.int32), mask=rm)
    # The chain's records, one row per step.
    tl.store(qsl_ptr + r + 1, tl.cumsum(real.to(tl.int32), 0), mask=rm)
    tl.store(qsl_ptr + r, tl.zeros([BLOCK_B], tl.int32), mask=r == 0)
    last_pos = tl.load(pos_ptr + last, mask=rm, other=0)
    for j in tl.static_range(K - 1):
        p = last_pos + 1 + j
        feeds = real & (p < last_pos + budget)
        tl.store(positions_ptr + j * chain_stride + r, tl.where(feeds, p, 0), mask=rm)
        tl.store(seq_lens_ptr + j * chain_stride + r, tl.where(real, p + 1, 0).to(tl.int32), mask=rm)
        tl.store(slots_ptr + j * chain_stride + r, _slot(bt_ptr, bt_stride, r, p, feeds, rm, bs, last_block), mask=rm)
    if VERIFIED:
        tl.debug_barrier()  # the token rows below read the last rows stored above
    # The entry's slots, token row by token row.
    for t0 in range(0, b * q, BLOCK_T):
        i = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        im = i < b * q
        if VERIFIED:
            row = tl.where(i < n * q, i // q, -1)
        else:
            row = tl.load(staging_ptr + req_off + i, mask=im, other=-1)
        pos = tl.load(pos_ptr + i, mask=im, other=0)
        writes = row >= 0
        row = tl.maximum(row, 0)
        if VERIFIED:
            acc = tl.load(last_ptr + row, mask=im & writes, other=0) - row * q
            writes = writes & (i % q <= acc)
        tl.store(entry_slots_ptr + i, _slot(bt_ptr, bt_stride, row, pos, writes, im, bs, last_block), mask=im)


def draft_bookkeeping(
    staging: torch.Tensor,  # int64, a `_Layout(b, q)`'s size
    offsets: dict[str, int],  # staging offsets: "req" (token rows), "qsl", "seq", "last", "budget"
    pos: torch.Tensor,  # int64 [>= b*q]: the entry rows' positions
    verified: Verified | None,  # the "verified" rule's inputs and table, else None
    block_table: torch.Tensor,  # [>= b, blocks] int32
    entry_qsl: torch.Tensor,  # [b + 1] int32
    entry_seq_lens: torch.Tensor,  # [b] int32
    entry_slots: torch.Tensor,  # [b * q] int64
    last_rows: torch.Tensor,  # [b] int64
    qsl: torch.Tensor,  # [b + 1] int32
    positions: torch.Tensor,  # [K - 1, >= b] int64
    seq_lens: torch.Tensor,  # [K - 1, >= b] int32
    slots: torch.Tensor,  # [K - 1, >= b] int64
    *, b: int, q: int, k: int, block_size: int,
) -> None:
    """Fill the entry's and the chain's records and the last rows (module docstring); "verified", the budgets into
    the table's num_drafts and the rows the drafts go to; no sync."""
    assert staging.dtype == torch.int64 and block_table.dtype == torch.int32 and block_table.stride(1) == 1
    assert positions.stride() == slots.stride() == seq_lens.stride() and positions.stride(1) == 1
    assert entry_qsl.dtype == entry_seq_lens.dtype == qsl.dtype == seq_lens.dtype == torch.int32
    assert pos.dtype == torch.int64 and pos.is_contiguous()
    if verified is not None:
        v = verified
        assert v.g.dtype == v.x.dtype == v.num_reqs.dtype == v.stop_at.dtype == v.table_rows.dtype == torch.int64
        assert v.rows.dtype == v.num_tokens.dtype == v.num_drafts.dtype == torch.int32
        assert v.g.is_contiguous() and v.x.is_contiguous() and len(v.rows) >= b and len(v.table_rows) >= b
        tables = (v.g, v.x, v.num_reqs, v.rows, v.num_tokens, v.num_drafts, v.stop_at, v.table_rows, v.max_model_len)
    else:  # unread without VERIFIED
        tables = (staging,) * 8 + (0,)
    block_t = min(_MAX_BLOCK_T, next_power_of_2(b * q))
    _bookkeeping_kernel[(1,)](
        staging, pos, *tables, block_table, block_table.stride(0), block_table.shape[1] - 1, entry_qsl,
        entry_seq_lens, entry_slots, last_rows, qsl, positions, seq_lens, slots, positions.stride(0), offsets["req"],
        offsets["qsl"], offsets["seq"], offsets["last"], offsets["budget"], b, q, block_size,
        K=k, VERIFIED=verified is not None, BLOCK_B=next_power_of_2(b), BLOCK_T=block_t,
        num_warps=num_warps_for(block_t),
    )
