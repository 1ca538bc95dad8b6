"""Prompt-lookup (n-gram) drafting on the device, read from the runner's persistent token table.

The rule is `spec_decode.ngram.find_ngram_proposals`' (vLLM's prompt lookup): for a row's sequence a[0:L], find
the longest suffix n-gram a[L-n:L], n in [min_n, max_n], that also occurs at an earlier start s < L - n (overlaps
allowed); on ties the earliest occurrence wins; the drafts are a[s+n : s+n+k], fewer than k near the end of the
sequence. No match: no drafts.

Why on the device: async scheduling launches step t + 1 before the host has seen step t's tokens, and the host's
counts may be guesses (it assumes every draft was accepted). The drafts for step t + 1 must therefore come from the
token table the device has already written, not from host token values, and computing them must not make the host
wait: every shape here follows from host ints (n, k, max_n, max_len, the table width), never from a device value.

On CUDA (`research_lm.ops.FUSED_DEVICE_TYPES`, outside torch.compile) one Triton kernel does the whole lookup
(spec_decode/ngram_kernel.py, one launch, nothing allocated but the outputs); elsewhere `ngram_drafts_ref`, its
reference, runs: vectorized torch, ~50 small kernels per call (four per step back, times max_n).

The reference's memory: besides the outputs, the live temporaries are the gathered rows and the match lengths (turned
in place into ranking keys), int32 [n, max_len] each, the running match mask and one comparison or fill mask, bool
[n, max_len] each: 10 bytes per (row, position), 21 MB at n = 256, max_len = 8192, whatever max_n (a loop of max_n
element-wise passes over the same buffers).
"""

from __future__ import annotations

import torch

import research_lm.ops


def ngram_drafts(
    token_ids: torch.Tensor,  # [R, W] int32: row r = prompt, outputs, then next step's drafts
    num_tokens: torch.Tensor,  # [R] int32: prompt + output tokens in row r
    rows: torch.Tensor,  # [n] int64: the table rows to draft for
    *,
    min_n: int,
    max_n: int,
    k: int,
    max_len: int,  # host bound: >= num_tokens[rows] (may exceed it)
) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [n, k] int64 (0 past the count), num_drafts [n] int32
    """`find_ngram_proposals`' drafts and counts for each row's sequence, without a host sync: the kernel where the
    fused ops run, the reference elsewhere."""
    _check_bounds(min_n, max_n, k)
    width = min(max_len, token_ids.shape[1])
    fused = token_ids.device.type in research_lm.ops.FUSED_DEVICE_TYPES and not torch.compiler.is_compiling()
    if not fused or k == 0 or rows.shape[0] == 0 or width < min_n + 1:  # the last three: nothing to launch
        return ngram_drafts_ref(token_ids, num_tokens, rows, min_n=min_n, max_n=max_n, k=k, max_len=max_len)
    from spec_decode.ngram_kernel import ngram_drafts_kernel

    return ngram_drafts_kernel(token_ids, num_tokens, rows, min_n=min_n, max_n=max_n, k=k, width=width)


def _check_bounds(min_n: int, max_n: int, k: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"ngram_drafts needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 0:
        raise ValueError(f"ngram_drafts needs k >= 0, got k={k}")


def ngram_drafts_ref(
    token_ids: torch.Tensor,  # [R, W] int32: row r = prompt, outputs, then next step's drafts
    num_tokens: torch.Tensor,  # [R] int32: prompt + output tokens in row r
    rows: torch.Tensor,  # [n] int64: the table rows to draft for
    *,
    min_n: int,
    max_n: int,
    k: int,
    max_len: int,  # host bound: >= num_tokens[rows] (may exceed it)
) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [n, k] int64 (0 past the count), num_drafts [n] int32
    """Every row at once: the same drafts and counts `find_ngram_proposals` gives for each row's sequence.

    A candidate is a position p < L - 1 of the row; its match length is how many tokens ending at p equal the ones
    ending at L - 1 (up to max_n, never before position 0), built one step back at a time. The best candidate
    maximizes match * P + (P - 1 - p) (longest, then earliest; P = positions scanned), if its match is >= min_n.
    """
    _check_bounds(min_n, max_n, k)
    assert token_ids.dim() == 2 and num_tokens.shape == token_ids.shape[:1], (token_ids.shape, num_tokens.shape)
    assert rows.dim() == 1 and rows.dtype == torch.int64, (rows.shape, rows.dtype)
    device, n = token_ids.device, rows.shape[0]
    width = min(max_len, token_ids.shape[1])  # positions scanned; the device's true lengths never exceed either
    if k == 0 or n == 0 or width < min_n + 1:  # a match needs min_n tokens and one more after them
        return torch.zeros(n, k, dtype=torch.int64, device=device), torch.zeros(n, dtype=torch.int32, device=device)
    assert (max_n + 1) * width < 2**31, "int32 ranking keys would overflow"

    seq = token_ids[:, :width].index_select(0, rows)  # [n, width]
    length = num_tokens.index_select(0, rows).long()  # [n]
    pos = torch.arange(width, device=device)  # [width]
    back = torch.arange(max_n, device=device)  # [max_n]
    # suffix[i, d] = a[L-1-d]; clamped reads are only compared where p - d >= 0, which implies L - 1 - d > 0.
    suffix = seq.gather(1, (length[:, None] - 1 - back).clamp_(min=0))  # [n, max_n]
    run = pos < (length - 1)[:, None]  # [n, width]: candidates p < L - 1 whose match is still running
    key = torch.zeros(n, width, dtype=torch.int32, device=device)  # match lengths, then ranking keys
    for d in range(min(max_n, width)):
        run[:, :d] = False  # p - d < 0: the match cannot reach before the sequence's start
        run[:, d:] &= seq[:, : width - d] == suffix[:, d : d + 1]
        key += run
    # match * width + (width - 1 - p): longest first, then earliest; >= min_n * width exactly when match >= min_n.
    key.mul_(width).add_((width - 1 - pos).to(torch.int32))
    key.masked_fill_(key < min_n * width, -1)
    best_key, best = key.max(dim=1)  # [n], [n]
    start = best + 1  # the drafts follow the earlier occurrence
    count = torch.where(best_key >= 0, (length - start).clamp(max=k), 0)  # [n]; >= 1 when matched (p < L - 1)
    offsets = torch.arange(k, device=device)  # [k]
    taken = seq.gather(1, (start[:, None] + offsets).clamp_(max=width - 1))  # [n, k]
    drafts = torch.where(offsets < count[:, None], taken.long(), 0)
    return drafts, count.to(torch.int32)
