"""Acceptance replay's greedy verification in one Triton kernel: one program per request of a verify graph.

Why: under replay a verify graph computes each request's replayed count and emitted tokens itself
(`AcceptanceReplay.accept_greedily`). Its torch path is ~20 small kernels (the trace lookups or the uniforms, the
correction's gather, scatter and argmax, the layout, the forged argmax rows, the packing); on the GPU reference
pair a replayed step took 4 % longer than a real one for it (spec_replay_validation_h200, PERFORMANCE.md twenty-sixth
pass), where the graph's own greedy acceptance is a handful.

The numbers are the torch path's (research_lm/worker/acceptance_replay.py: `counts`, `replay_greedy`), token for
token. Request i of b, q = k + 1 rows each (drafts at input rows i*q + 1 .. i*q + k, table row `rows[i]`, -1 on
padding, read as row 0):
- its replayed count c: with traces, entry cursor[row] mod len of trace trace_of[row]; else the leading run of j
  with u_j < rate_j, u_j the REPLAY stream's uniforms at (seed[row], num_tokens[row]) (`rng.uniform_rows`);
- n = min(c, real), real = num_drafts[row];
- emitted: drafts 1 .. n, then the argmax (torch's rule: NaN largest, ties to the lower index) of logits row i*q + n
  with draft n + 1 excluded where n < real (with echo P: the token at table position num_tokens[row] + n - P where
  that is >= 0), then -1; argmax rows i*q .. i*q + n are overwritten with them;
- packed (`GraphStep.accepted`): emitted [b*q], n + 1 [b], real [b].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2
from research_lm.ops.exponential_race import _argmax_combine, _fmix64
from research_lm.worker import rng

_MAX_BLOCK = 1024
_NO_INDEX = tl.constexpr(2**31 - 1)  # the column of a lane that saw none: loses every tie


@triton.jit
def _replay_accept_kernel(
    logits_ptr,  # [b*q, V] float32, columns contiguous
    greedy_ptr,  # [b*q] int64: argmax rows, rows 0 .. n of each request overwritten
    ids_ptr,  # [b*q] int64: the step's input ids (request i: its newest token, then its k drafts)
    rows_ptr,  # [b] int32: table rows, -1 on padding
    num_drafts_ptr,  # [R] int32: real drafts per table row
    traces_ptr,  # [T, L] int64 (TRACES)
    trace_lens_ptr,  # [T] int64
    trace_of_ptr,  # [R] int64
    cursor_ptr,  # [R] int64
    seeds_ptr,  # [R] int64 (rates)
    num_tokens_ptr,  # [R] int: tokens before the step (rates, echo)
    tokens_ptr,  # [R, W] int: the token table (echo)
    rates_ptr,  # [k] float32 (rates)
    packed_ptr,  # [b*q + 2b] int64: emitted, n + 1, real
    logits_stride,
    tokens_stride,
    V,
    L,
    stream_term,  # int64: rng's stream * C, as its bits
    b,
    q: tl.constexpr,
    Q_POW2: tl.constexpr,  # next power of 2 >= q
    TRACES: tl.constexpr,
    ECHO: tl.constexpr,  # P > 0: row n's token repeats the one P positions back (0: off)
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    row = tl.maximum(tl.load(rows_ptr + i).to(tl.int64), 0)
    real = tl.load(num_drafts_ptr + row).to(tl.int64)
    if TRACES:
        which = tl.load(trace_of_ptr + row)
        place = tl.load(cursor_ptr + row) % tl.load(trace_lens_ptr + which)
        count = tl.load(traces_ptr + which * L + place)
    else:
        seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
        position = tl.load(num_tokens_ptr + row).to(tl.int64).to(tl.uint64, bitcast=True)
        stream = stream_term.to(tl.uint64, bitcast=True)
        key = _fmix64(seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream)  # `rng.row_keys`
        count = tl.zeros((), dtype=tl.int64)
        alive = tl.full((), 1, dtype=tl.int64)
        for j in tl.static_range(q - 1):
            col = tl.full((), j + 1, dtype=tl.uint64)
            z = _fmix64(key + col * 0x9E3779B97F4A7C15).to(tl.int64, bitcast=True) >> 41
            u = (z.to(tl.float32) + 4194304.5) * 1.1920928955078125e-07  # (z + 2^22 + 1/2) / 2^23, exact
            alive = alive * (u < tl.load(rates_ptr + j)).to(tl.int64)
            count += alive
    n = tl.minimum(count, real)
    first = i * q
    rejected = tl.load(ids_ptr + first + 1 + tl.minimum(n, q - 2))
    rejected = tl.minimum(tl.maximum(rejected, 0), V - 1)
    hide = n < real
    # the correction: argmax of row n, draft n + 1 excluded where it is real
    logits_row = logits_ptr + (first + n) * logits_stride
    best = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    best_col = tl.full((BLOCK,), _NO_INDEX, dtype=tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        v = tl.load(logits_row + cols, mask=mask, other=float("-inf"))
        v = tl.where(hide & (cols == rejected), float("-inf"), v)
        better = mask & ((v > best) | (best_col == _NO_INDEX) | ((v != v) & (best == best)))
        best = tl.where(better, v, best)
        best_col = tl.where(better, cols, best_col)
    _, correction = tl.reduce((best, best_col), 0, _argmax_combine)
    last = correction.to(tl.int64)
    if ECHO > 0:
        at = tl.load(num_tokens_ptr + row).to(tl.int64) + n - ECHO
        echoed = tl.load(tokens_ptr + row * tokens_stride + tl.maximum(at, 0)).to(tl.int64)
        last = tl.where(at >= 0, echoed, last)
    j = tl.arange(0, Q_POW2)
    in_row = j < q
    drafts = tl.load(ids_ptr + first + 1 + j, mask=in_row & (j < q - 1), other=0)
    emitted = tl.where(j < n, drafts, tl.where(j == n, last, -1))
    tl.store(packed_ptr + first + j, emitted, mask=in_row)
    tl.store(greedy_ptr + first + j, emitted, mask=in_row & (j <= n))
    tl.store(packed_ptr + b * q + i, n + 1)
    tl.store(packed_ptr + b * q + b + i, real)


def replay_accept(
    replay,  # the engine's AcceptanceReplay: its device tables
    rows: torch.Tensor,  # [b] int32 or int64: each request's table row, -1 on padding
    num_tokens: torch.Tensor,  # [R] int: every table row's tokens before the step
    token_ids: torch.Tensor,  # [R, W] int: the token table (read with the replay's echo)
    num_drafts: torch.Tensor,  # [R] int32: every table row's real drafts
    input_ids: torch.Tensor,  # [>= b*q] int64: the step's input ids
    greedy: torch.Tensor,  # [>= b*q] int64: their argmax rows (overwritten: rows 0 .. n of each request)
    logits: torch.Tensor,  # [>= b*q, V] float32
    packed: torch.Tensor,  # [>= b*q + 2b] int64: written (GraphStep.accepted's layout)
    b: int,
    q: int,
) -> None:
    V = logits.shape[1]
    assert q >= 2 and logits.dtype == torch.float32 and logits.stride(1) == 1, (q, logits.dtype)
    assert q - 1 <= replay.rates.shape[0] and greedy.dtype == input_ids.dtype == packed.dtype == torch.int64
    traces = replay.traces is not None
    dummy = replay.cursor
    _replay_accept_kernel[(b,)](
        logits, greedy, input_ids, rows, num_drafts,
        replay.traces if traces else dummy, replay.trace_lens if traces else dummy, replay.trace_of, replay.cursor,
        replay.seeds, num_tokens, token_ids, replay.rates, packed,
        logits.stride(0), token_ids.stride(0), V, replay.traces.shape[1] if traces else 1,
        rng.int64_bits(rng.REPLAY * rng._C), b,
        q=q, Q_POW2=next_power_of_2(q), TRACES=traces, ECHO=replay.echo, BLOCK=min(_MAX_BLOCK, next_power_of_2(V)),
    )
