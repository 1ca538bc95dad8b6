"""A graph step's inputs from one host -> device copy: the runner's fast path for uniform steps.

Why: a batch-1 decode or verify step replays a graph of ~0.2 ms on the reference target, and its host input
preparation took about as long (PERFORMANCE.md, twelfth pass): ~40 small numpy ops, eight host -> device
copies and, for tokens still on the device (async scheduling's sampled token, a proposer's pending drafts),
a gather and a scatter. When every request runs q tokens (one real token, then q - 1 drafts), the host only
stages each token's value (or where on the device it is), each request's start position and its row, and n,
copies that once, and this kernel writes every buffer the graph reads, padding included. `GraphStepInputs`
launches it, from a small CUDA graph once a (b, q, source) recurs: a Triton launch cost ~50-70 µs of host time
on the device machine's host, as much as the rest of the staging.

The numbers are `research_lm.ops.reference.graph_step_inputs_ref`'s, value for value: for request i < b and
j < q, token t = i*q + j, real when i < n: input id staging[t] (when >= 0) or source[-1 - staging[t]], else 0;
position start_i + j, else 0; slot block_table[i, pos // bs] * bs + pos % bs, else -1; seq len start_i + q,
else 0; query_start_loc[i] = min(i, n) * q for i <= b; request row staged, else -1. With a `shift` tensor (a
speculative step launched before the previous one was verified: the host staged each start as if every draft
were accepted), start_i is the staged start plus shift[staging[b*q + 2b + 1 + i]] where that index is >= 0.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from research_lm.ops.common import next_power_of_2
from research_lm.ops.reference import graph_step_inputs_ref


@triton.jit(do_not_specialize=["b", "q"], do_not_specialize_on_alignment=["source_ptr", "shift_ptr"])
def _graph_step_inputs_kernel(
    staging_ptr, source_ptr, shift_ptr, bt_ptr, bt_stride, last_block,
    ids_ptr, pos_ptr, slots_ptr, seq_lens_ptr, qsl_ptr, rows_ptr,
    b, q, bs,
    HAS_SOURCE: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    n = tl.load(staging_ptr + b * q + 2 * b)
    real = i < n
    j = tl.arange(0, BLOCK_Q).to(tl.int64)
    jm = j < q
    t = i * q + j
    value = tl.load(staging_ptr + t, mask=jm, other=0)
    ids = tl.maximum(value, 0)
    if HAS_SOURCE:
        held = jm & (value < 0)
        ids = tl.where(value < 0, tl.load(source_ptr + tl.maximum(-1 - value, 0), mask=held, other=0), ids)
    start = tl.load(staging_ptr + b * q + i)
    if HAS_SHIFT:
        at = tl.load(staging_ptr + b * q + 2 * b + 1 + i)
        start += tl.load(shift_ptr + tl.maximum(at, 0), mask=real & (at >= 0), other=0)
    pos = start + j
    # a block mask, not `jm & real`: triton 3.9's interpreter widens a block & scalar of bools to int64
    live = j < tl.where(real, q, 0)
    block = tl.load(bt_ptr + i * bt_stride + tl.minimum(pos // bs, last_block), mask=live, other=0)
    tl.store(ids_ptr + t, tl.where(real, ids, 0), mask=jm)
    tl.store(pos_ptr + t, tl.where(real, pos, 0), mask=jm)
    tl.store(slots_ptr + t, tl.where(real, block.to(tl.int64) * bs + pos % bs, -1), mask=jm)
    tl.store(seq_lens_ptr + i, tl.where(real, start + q, 0).to(tl.int32))
    row = tl.load(staging_ptr + b * q + b + i)
    tl.store(rows_ptr + i, tl.where(real, row, -1).to(tl.int32))
    tl.store(qsl_ptr + i, (tl.minimum(i, n) * q).to(tl.int32))
    tl.store(qsl_ptr + b, (n * q).to(tl.int32), mask=i == 0)


def graph_step_inputs(
    staging: torch.Tensor,  # int64 [>= b*q + 2b + 1 (+ b with a shift)], on the device
    source: torch.Tensor | None,  # int64, 1-D
    block_table: torch.Tensor,  # int32 [>= b, blocks]
    input_ids: torch.Tensor,  # int64 [>= b*q]
    positions: torch.Tensor,  # int64 [>= b*q]
    slot_mapping: torch.Tensor,  # int64 [>= b*q]
    seq_lens: torch.Tensor,  # int32 [>= b]
    query_start_loc: torch.Tensor,  # int32 [>= b + 1]
    request_rows: torch.Tensor,  # int32 [>= b]
    *, b: int, q: int, block_size: int,
    shift: torch.Tensor | None = None,  # int64, 1-D: start corrections, at the staged indices
) -> None:
    """Write the step buffers of n requests (staged after the rows) of q tokens each, padded to b (module docstring);
    no sync. n lives on the device so that a captured launch serves every n <= b."""
    assert staging.dtype == input_ids.dtype == positions.dtype == slot_mapping.dtype == torch.int64
    assert block_table.dtype == seq_lens.dtype == query_start_loc.dtype == request_rows.dtype == torch.int32
    assert block_table.stride(1) == 1
    assert all(x is None or (x.dtype == torch.int64 and x.dim() == 1) for x in (source, shift))
    src = source if source is not None else staging  # unread without HAS_SOURCE
    _graph_step_inputs_kernel[(b,)](
        staging, src, shift if shift is not None else staging, block_table, block_table.stride(0),
        block_table.shape[1] - 1, input_ids, positions, slot_mapping, seq_lens, query_start_loc, request_rows,
        b, q, block_size, HAS_SOURCE=source is not None, HAS_SHIFT=shift is not None,
        BLOCK_Q=max(8, next_power_of_2(q)), num_warps=1,
    )


class GraphStepInputs:
    """`graph_step_inputs` over the runner's step buffers. On CUDA a (b, q, source address) seen a second time is
    captured into a CUDA graph of this one kernel and replayed from then on (the tokens a step still holds on the
    device sit in a persistent buffer: a graph's argmax, a draft graph's drafts); at most `max_graphs` are kept,
    other keys (a sampler's fresh outputs) launch. Elsewhere the torch reference runs."""

    def __init__(self, buffers: Any, block_size: int, max_graphs: int = 16):
        self.buffers, self.block_size, self.max_graphs = buffers, block_size, max_graphs
        self.cuda = buffers.staging.gpu.device.type == "cuda"
        self.graphs: dict[tuple[int, ...], Callable[[], None]] = {}
        self.misses: collections.Counter[tuple[int, ...]] = collections.Counter()

    def __call__(self, source: torch.Tensor | None, b: int, q: int, shift: torch.Tensor | None = None) -> None:
        buf = self.buffers

        def write() -> None:
            fn = graph_step_inputs if self.cuda else graph_step_inputs_ref
            fn(buf.staging.gpu, source, buf.block_table.gpu, buf.input_ids.gpu[: b * q], buf.positions.gpu[: b * q],
               buf.slot_mapping.gpu[: b * q], buf.seq_lens.gpu[:b], buf.query_start_loc.gpu[: b + 1],
               buf.request_rows.gpu[:b], b=b, q=q, block_size=self.block_size, shift=shift)

        key = (b, q, *(0 if x is None else x.data_ptr() for x in (source, shift)))
        if (replay := self.graphs.get(key)) is not None:
            replay()
            return
        write()  # also compiles the kernel for this key's specialization before any capture
        if self.cuda and len(self.graphs) < self.max_graphs:  # once full, fresh keys are no longer counted
            self.misses[key] += 1
            if self.misses[key] > 1:
                self.graphs[key] = _capture(write)


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
