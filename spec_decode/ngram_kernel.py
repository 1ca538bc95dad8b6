"""The device n-gram lookup (`spec_decode.ngram_device.ngram_drafts`) in one Triton kernel: one program per row.

Why: the torch reference (`ngram_drafts_ref`) launches ~50 small kernels per call (four per step back, times max_n);
at batch 1 on a tiny model that host launch time (~0.25 ms) was most of a speculative step.

A program scans its row's candidate positions p < L - 1 in blocks. A candidate's match length is how many tokens
ending at p equal the ones ending at L - 1 (up to max_n, never before position 0); each lane keeps its longest one
(its earliest on ties, as positions grow along the scan), then the block reduction takes the longest and, among
those, the smallest position. The loads of the max_n steps back do not wait for each other's comparisons: the row
stays in L1/L2, so the extra reads cost less than serialized load latency. Nothing is allocated but the outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2, num_warps_for

_BLOCK = 1024  # candidate positions per scan step (tests shrink it so that short rows span several)


@triton.jit(do_not_specialize=["width"], do_not_specialize_on_alignment=["rows_ptr"])
def _ngram_kernel(
    tok_ptr,  # [R, W] token table, row stride tok_stride
    tok_stride,
    num_tokens_ptr,  # [R] prompt + output tokens per row
    rows_ptr,  # [n] int64 table rows
    drafts_ptr,  # [n, k] int64 out
    count_ptr,  # [n] int32 out
    width,  # positions a row may hold: min(host bound, W)
    min_n,
    max_n,
    k,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i).to(tl.int64)
    seq = tok_ptr + r * tok_stride
    length = tl.minimum(tl.load(num_tokens_ptr + r).to(tl.int64), width)
    last = length - 1
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    best = tl.zeros([BLOCK], tl.int32)  # longest match each lane has seen
    best_pos = tl.zeros([BLOCK], tl.int64)  # its earliest position
    for p0 in range(0, last, BLOCK):
        p = p0 + lanes
        candidate = p < last
        run = candidate  # candidates whose match is still running
        match = tl.zeros([BLOCK], tl.int32)
        for d in range(0, max_n):
            reach = p >= d  # the match cannot reach before position 0; p - d >= 0 implies last - d > 0
            a = tl.load(seq + p - d, mask=candidate & reach, other=0)
            s = tl.load(seq + last - d, mask=last - d >= 0, other=0)
            run = run & reach & (a == s)
            match += run.to(tl.int32)
        better = match > best  # strictly: a later position never displaces an equal match
        best = tl.where(better, match, best)
        best_pos = tl.where(better, p, best_pos)
    longest = tl.max(best, 0)
    pos = tl.min(tl.where(best == longest, best_pos, length), 0)
    start = pos + 1  # the drafts follow the earlier occurrence
    count = tl.where(longest >= min_n, tl.minimum(length - start, k), 0)  # >= 1 when matched (p < L - 1)
    j = tl.arange(0, BLOCK_K).to(tl.int64)
    taken = tl.load(seq + start + j, mask=j < count, other=0)
    tl.store(drafts_ptr + i * k + j, taken.to(tl.int64), mask=j < k)
    tl.store(count_ptr + i, count.to(tl.int32))


def ngram_drafts_kernel(
    token_ids: torch.Tensor,  # [R, W] int: row r = prompt, outputs, then next step's drafts
    num_tokens: torch.Tensor,  # [R] int: prompt + output tokens in row r
    rows: torch.Tensor,  # [n] int64: the table rows to draft for
    *,
    min_n: int,
    max_n: int,
    k: int,
    width: int,  # min(host bound, W), >= min_n + 1
) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [n, k] int64 (0 past the count), num_drafts [n] int32
    """`ngram_drafts_ref`'s outputs in one launch; bounds are checked by the caller, k and n are >= 1; no sync."""
    assert token_ids.dim() == 2 and token_ids.stride(1) == 1, (token_ids.shape, token_ids.stride())
    assert num_tokens.shape == token_ids.shape[:1] and num_tokens.stride(0) == 1, (num_tokens.shape, token_ids.shape)
    assert not token_ids.is_floating_point() and not num_tokens.is_floating_point()
    assert rows.dim() == 1 and rows.stride(0) == 1 and rows.dtype == torch.int64, (rows.shape, rows.dtype)
    n = rows.shape[0]
    drafts = torch.empty(n, k, dtype=torch.int64, device=token_ids.device)
    count = torch.empty(n, dtype=torch.int32, device=token_ids.device)
    _ngram_kernel[(n,)](
        token_ids, token_ids.stride(0), num_tokens, rows, drafts, count, width, min_n, max_n, k,
        BLOCK=_BLOCK, BLOCK_K=next_power_of_2(k), num_warps=num_warps_for(_BLOCK),
    )
    return drafts, count
