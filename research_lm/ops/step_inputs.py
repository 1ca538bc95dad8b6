"""A step's forward inputs gathered from the runner's per-request device tables, and the step's results folded back.

Why: the host never needs a token value that is still in flight on the device. Each request owns a stable row r of
`token_ids` [R, W] (prompt, outputs, then the drafts its next step verifies) with `num_tokens` [R] and `num_computed`
[R] beside it (research_lm/worker/request_state.py). The host stages only each request's row and its query start; these
kernels read every token and position from the tables, so a step launched before the previous one's tokens reached the
host reads the right values, whatever the host guessed about its accepted drafts.

- `gather_step_inputs`: one step's input_ids, positions, slot_mapping, seq_lens, query_start_loc and request_rows,
  padding included (the numbers are `research_lm.ops.reference.gather_step_inputs_ref`'s, value for value). Grid
  (b, token blocks of the longest query): a batch-1 decode is one program. Padding tokens are spread over every
  program. `StepInputWriter` replays the launch from a small CUDA graph once a (b, t_pad, grid) recurs
  (`RecurringLaunches`): a Triton launch costs ~50-70 µs of host time on the device machine's host.
- `advance_rows`: a step's emitted tokens appended to each row, num_tokens and num_computed advanced.
- `write_drafts`: a proposer's drafts written right after each row's tokens, where the next step verifies them. A
  kernel even though it is one scatter: torch cannot skip rows < 0 or columns >= W without a boolean mask (a host
  sync) or a clamped index (colliding writes).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2, num_warps_for
from research_lm.ops.reference import gather_step_inputs_ref

# Token-block widths: decode and verify queries fit the small one; prompt chunks loop over token blocks of the large
# one along the grid's second axis. Two widths, so a new prompt length never compiles a kernel.
_SMALL_BLOCK, _LARGE_BLOCK = 16, 256


@triton.jit(do_not_specialize=["b", "t_pad"], do_not_specialize_on_alignment=["staging_ptr"])
def _gather_step_inputs_kernel(
    tok_ptr, tok_stride, computed_ptr, bt_ptr, bt_stride, last_block, staging_ptr,
    ids_ptr, pos_ptr, slots_ptr, seq_lens_ptr, qsl_ptr, rows_ptr,
    b, t_pad, bs,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    tb = tl.program_id(1).to(tl.int64)
    num_tb = tl.num_programs(1).to(tl.int64)
    row = tl.load(staging_ptr + i)
    start = tl.load(staging_ptr + b + i)
    end = tl.load(staging_ptr + b + i + 1)
    real = row >= 0
    r = tl.maximum(row, 0)
    computed = tl.load(computed_ptr + r, mask=real, other=0).to(tl.int64)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    j = tb * BLOCK + lanes
    # a block mask, not `jm & real`: triton 3.9's interpreter widens a block & scalar of bools to int64
    live = j < tl.where(real, end - start, 0)
    pos = computed + j
    t = start + j
    ids = tl.load(tok_ptr + r * tok_stride + pos, mask=live, other=0)
    block = tl.load(bt_ptr + i * bt_stride + tl.minimum(pos // bs, last_block), mask=live, other=0)
    tl.store(ids_ptr + t, ids.to(tl.int64), mask=live)
    tl.store(pos_ptr + t, pos, mask=live)
    tl.store(slots_ptr + t, block.to(tl.int64) * bs + pos % bs, mask=live)
    first = tb == 0
    tl.store(seq_lens_ptr + i, tl.where(real, computed + end - start, 0).to(tl.int32), mask=first)
    tl.store(rows_ptr + i, tl.where(real, row, -1).to(tl.int32), mask=first)
    tl.store(qsl_ptr + i, start.to(tl.int32), mask=first)
    tl.store(qsl_ptr + b, end.to(tl.int32), mask=first & (i == b - 1))
    # Padding tokens [T, t_pad): program p takes blocks p, p + P, ... (P programs); the trip count needs only t_pad.
    total = tl.load(staging_ptr + 2 * b)
    stride = tl.num_programs(0).to(tl.int64) * num_tb * BLOCK
    for c in range(0, tl.cdiv(t_pad, stride)):
        t = total + c * stride + (i * num_tb + tb) * BLOCK + lanes
        pad = t < t_pad
        tl.store(ids_ptr + t, tl.zeros([BLOCK], tl.int64), mask=pad)
        tl.store(pos_ptr + t, tl.zeros([BLOCK], tl.int64), mask=pad)
        tl.store(slots_ptr + t, tl.full([BLOCK], -1, tl.int64), mask=pad)


def _grid(max_query_len: int) -> tuple[int, int]:
    """(token block width, token blocks per request) for queries of at most max_query_len tokens."""
    block = _SMALL_BLOCK if max_query_len <= _SMALL_BLOCK else _LARGE_BLOCK
    return block, triton.cdiv(max(max_query_len, 1), block)


def gather_step_inputs(
    token_ids: torch.Tensor,  # int32 [R, W]: per request row, prompt + outputs + drafts
    num_computed: torch.Tensor,  # int32 [R]: tokens of each row whose KV is cached
    block_table: torch.Tensor,  # int32 [>= b, blocks], in batch order
    staging: torch.Tensor,  # int64 [>= 2b + 1]: request rows [b] (-1: padding), query_start_loc [b + 1]
    input_ids: torch.Tensor,  # int64 [>= t_pad]
    positions: torch.Tensor,  # int64 [>= t_pad]
    slot_mapping: torch.Tensor,  # int64 [>= t_pad]
    seq_lens: torch.Tensor,  # int32 [>= b]
    query_start_loc: torch.Tensor,  # int32 [>= b + 1]
    request_rows: torch.Tensor,  # int32 [>= b]
    *, b: int, t_pad: int, max_query_len: int, block_size: int,
) -> None:
    """Write one step's inputs for b requests (padding ones included) and t_pad tokens from the tables; no sync.
    max_query_len bounds every request's query length (it sizes the grid only)."""
    assert token_ids.dtype == num_computed.dtype == block_table.dtype == torch.int32
    assert staging.dtype == input_ids.dtype == positions.dtype == slot_mapping.dtype == torch.int64
    assert seq_lens.dtype == query_start_loc.dtype == request_rows.dtype == torch.int32
    assert token_ids.dim() == block_table.dim() == 2 and token_ids.stride(1) == block_table.stride(1) == 1
    assert num_computed.dim() == staging.dim() == 1 and num_computed.stride(0) == staging.stride(0) == 1
    assert b >= 1 and block_table.shape[0] >= b and staging.numel() >= 2 * b + 1, (b, block_table.shape, staging.shape)
    assert min(len(input_ids), len(positions), len(slot_mapping)) >= t_pad, t_pad
    assert min(len(seq_lens), len(request_rows), len(query_start_loc) - 1) >= b, b
    block, num_tb = _grid(max_query_len)
    _gather_step_inputs_kernel[(b, num_tb)](
        token_ids, token_ids.stride(0), num_computed, block_table, block_table.stride(0), block_table.shape[1] - 1,
        staging, input_ids, positions, slot_mapping, seq_lens, query_start_loc, request_rows,
        b, t_pad, block_size, BLOCK=block, num_warps=num_warps_for(block),
    )


@triton.jit(do_not_specialize=["m"], do_not_specialize_on_alignment=["rows_ptr", "delta_ptr", "src_ptr", "count_ptr"])
def _write_row_tokens_kernel(
    tok_ptr, tok_stride, width, num_tokens_ptr, computed_ptr,
    rows_ptr, delta_ptr, src_ptr, src_stride, count_ptr, m,
    ADVANCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Request i's first e tokens of src row i into its table row after num_tokens (e = count[i], or m); with ADVANCE,
    the row's counts move past them."""
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64)
    real = row >= 0
    r = tl.maximum(row, 0)
    filled = tl.load(num_tokens_ptr + r, mask=real, other=0).to(tl.int64)
    if ADVANCE:
        e = tl.load(count_ptr + i).to(tl.int64)
    else:
        e = m.to(tl.int64)
    j = tl.arange(0, BLOCK_M).to(tl.int64)
    live = j < tl.where(real, tl.minimum(e, width - filled), 0)  # never past the row's width W
    tokens = tl.load(src_ptr + i * src_stride + j, mask=live, other=0)
    tl.store(tok_ptr + r * tok_stride + filled + j, tokens.to(tl.int32), mask=live)
    if ADVANCE:
        # the last emitted token (the sampled one) has no KV yet; every accepted draft before it has
        delta = tl.load(delta_ptr + i).to(tl.int64)
        computed = tl.load(computed_ptr + r, mask=real, other=0).to(tl.int64)
        tl.store(num_tokens_ptr + r, (filled + e).to(tl.int32), mask=real)
        tl.store(computed_ptr + r, (computed + delta + tl.maximum(e - 1, 0)).to(tl.int32), mask=real)


def _check_rows(token_ids: torch.Tensor, num_tokens: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    assert token_ids.dtype == num_tokens.dtype == torch.int32, (token_ids.dtype, num_tokens.dtype)
    assert token_ids.dim() == 2 and token_ids.stride(1) == 1 and num_tokens.dim() == 1 and num_tokens.stride(0) == 1
    assert rows.dtype in (torch.int32, torch.int64) and rows.dim() == 1 and rows.stride(0) == 1, rows.dtype
    # (one column: any column stride, as a transposed [1, n] tensor's; session 31's MTP k = 1 graphs failed here)
    assert src.dtype == torch.int64 and src.dim() == 2 and len(src) == len(rows), src.shape
    assert src.stride(1) == 1 or src.shape[1] == 1, src.stride()


def advance_rows(
    token_ids: torch.Tensor,  # int32 [R, W]
    num_tokens: torch.Tensor,  # int32 [R]
    num_computed: torch.Tensor,  # int32 [R]
    rows: torch.Tensor,  # int32 or int64 [n]: each request's table row; < 0: skipped; no row twice
    delta: torch.Tensor,  # int [n]: num_new_tokens - scheduled drafts
    emitted: torch.Tensor,  # int64 [n, m]: the step's output tokens, the first num_emitted[i] of row i valid
    num_emitted: torch.Tensor,  # int [n], 0..m (0: a prompt chunk that emitted nothing)
) -> None:
    """Fold a step's results into the tables (`advance_rows_ref`'s numbers); no sync."""
    _check_rows(token_ids, num_tokens, rows, emitted)
    assert num_computed.dtype == torch.int32 and num_computed.dim() == 1 and num_computed.stride(0) == 1
    assert delta.shape == num_emitted.shape == rows.shape, (delta.shape, num_emitted.shape, rows.shape)
    assert not delta.is_floating_point() and not num_emitted.is_floating_point()
    n, m = emitted.shape
    if n == 0:
        return
    _write_row_tokens_kernel[(n,)](
        token_ids, token_ids.stride(0), token_ids.shape[1], num_tokens, num_computed,
        rows, delta.contiguous(), emitted, emitted.stride(0), num_emitted.contiguous(), m,
        ADVANCE=True, BLOCK_M=next_power_of_2(m), num_warps=1,
    )


def write_drafts(
    token_ids: torch.Tensor,  # int32 [R, W]
    num_tokens: torch.Tensor,  # int32 [R]
    rows: torch.Tensor,  # int32 or int64 [n]: < 0 skipped
    drafts: torch.Tensor,  # int64 [n, k]
) -> None:
    """token_ids[row, num_tokens[row] + j] = drafts[i, j] for j < k, never past W; counts unchanged; no sync."""
    _check_rows(token_ids, num_tokens, rows, drafts)
    n, k = drafts.shape
    if n == 0 or k == 0:
        return
    _write_row_tokens_kernel[(n,)](
        token_ids, token_ids.stride(0), token_ids.shape[1], num_tokens, num_tokens,
        rows, rows, drafts, drafts.stride(0), rows, k,
        ADVANCE=False, BLOCK_M=next_power_of_2(k), num_warps=1,
    )


class StepInputWriter:
    """`gather_step_inputs` over persistent tables and step buffers. On CUDA a (b, t_pad, grid) seen a second time is
    captured into a CUDA graph of this one kernel and replayed from then on (its inputs are all device reads, so the
    replay serves any staged rows, query starts and table contents); at most `max_graphs` are kept, other keys launch.
    Elsewhere the torch reference runs."""

    def __init__(
        self,
        token_ids: torch.Tensor,  # int32 [R, W]
        num_computed: torch.Tensor,  # int32 [R]
        block_table: torch.Tensor,  # int32 [>= max b, blocks]
        staging: torch.Tensor,  # int64 [>= 2 max b + 1]
        input_ids: torch.Tensor,  # int64 [max tokens]
        positions: torch.Tensor,  # int64 [max tokens]
        slot_mapping: torch.Tensor,  # int64 [max tokens]
        seq_lens: torch.Tensor,  # int32 [max b]
        query_start_loc: torch.Tensor,  # int32 [max b + 1]
        request_rows: torch.Tensor,  # int32 [max b]
        block_size: int,
        max_graphs: int = 16,
    ):
        self.tensors = (token_ids, num_computed, block_table, staging, input_ids, positions, slot_mapping, seq_lens,
                        query_start_loc, request_rows)
        self.block_size = block_size
        self.cuda = token_ids.device.type == "cuda"
        self.launches = RecurringLaunches(max_graphs)

    def __call__(self, b: int, t_pad: int, max_query_len: int) -> None:
        def write() -> None:
            fn = gather_step_inputs if self.cuda else gather_step_inputs_ref
            fn(*self.tensors, b=b, t_pad=t_pad, max_query_len=max_query_len, block_size=self.block_size)

        if not self.cuda:
            write()
            return
        self.launches((b, t_pad, *_grid(max_query_len)), write)  # max_query_len matters only through its grid


class RecurringLaunches:
    """Launches replayed from small CUDA graphs: a key seen a second time is captured (its launch recorded, not run)
    and replayed from then on; at most `max_graphs` are kept, other keys launch. A key must name everything the launch
    depends on: its shapes and, for tensors that are not persistent buffers, their addresses (`launch_key`)."""

    def __init__(self, max_graphs: int = 16):
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, Callable[[], None]] = {}
        self.misses: collections.Counter[tuple] = collections.Counter()

    def __call__(self, key: tuple, launch: Callable[[], None]) -> None:
        if (replay := self.graphs.get(key)) is not None:
            replay()
            return
        launch()  # also compiles the kernel for this key's specialization before any capture
        if len(self.graphs) < self.max_graphs:  # once full, fresh keys are no longer counted
            if len(self.misses) > 4096:  # keys of short-lived tensors' addresses: forget them
                self.misses.clear()
            self.misses[key] += 1
            if self.misses[key] > 1:
                self.graphs[key] = _capture(launch)


def launch_key(*tensors: torch.Tensor) -> tuple:
    """What a kernel launch over `tensors` depends on: each one's address, shape, strides and dtype."""
    return tuple((x.data_ptr(), x.shape, x.stride(), x.dtype) for x in tensors)


def _capture(fn: Callable[[], None]) -> Callable[[], None]:
    """fn recorded (not run) into a CUDA graph on a side stream; its replay."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        fn()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay
