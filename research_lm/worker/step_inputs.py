"""A step's inputs: the host stages counts, the device gathers the rest (research_lm/ops/step_inputs.py).

Per scheduled request the host knows its row in the device tables (research_lm/worker/request_state.py), how many tokens
it runs (drafts included), how many of them are drafts and whether the step samples it. Those counts, the query
starts and the logits rows reach the device in one copy, with the block table's live corner; one kernel then writes
every buffer the forward reads, padding to the CUDA graph's size included, from the tables: ids and positions come
from the row's tokens and its `num_computed` there. A step launched before the last one's tokens reached the host
(async scheduling) therefore reads them where they are, whatever step it is.
The host's record (`CommonAttentionMetadata`'s *_cpu mirrors) carries the host's counts: exact, except ahead of a
step whose drafts may be rejected, where they are upper bounds (a backend that plans on them, FlashInfer's
`graphs_plan_on_host`, is then never launched ahead: `ModelRunner.continues_on_device`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from attention_zoo import CommonAttentionMetadata
from research_lm.api.outputs import ScheduledRequest
from research_lm.worker.buffers import StepBuffers
from research_lm.worker.cuda_graphs import DecodeGraphs
from research_lm.worker.request_state import RequestState


class StepInputs(NamedTuple):
    common: CommonAttentionMetadata
    sample_rows: list[tuple[int, int]]  # (request index, draft offset) per logits row
    sampling: list[int]  # the requests that sample (reach their last token), in batch order
    graph_key: tuple[int, int] | None  # the CUDA graph that replays the step (inputs padded to its size)
    logits_indices: torch.Tensor | None  # token row of each logits row, on the device; None: every row, in order
    rows: torch.Tensor  # [b] int64 on the device: each request's table row (-1 on padding)
    delta: torch.Tensor  # [n] int64 on the device: num_new_tokens - drafts (what num_computed gains, rejections aside)
    samples: torch.Tensor  # [n] int64 on the device: 1 where the request samples
    drafts: np.ndarray  # [n] int64 on the host: each request's draft slots


def prepare_step_inputs(buf: StepBuffers, state: RequestState, scheduled: list[ScheduledRequest], block_size: int,
                        graphs: DecodeGraphs | None, write) -> StepInputs:
    """Stage the step's counts, copy them and have `write(b, t_pad, max_query_len)` (the gather kernel over the
    step buffers) fill the forward's inputs."""
    n = len(scheduled)
    rows = [state.row(s.request) for s in scheduled]
    state.flush()  # rows taken this step: their tokens reach the table before the gather reads them
    num_new = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=n)
    drafts = np.fromiter((s.num_spec_tokens for s in scheduled), dtype=np.int64, count=n)
    starts = np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=n)
    lengths = np.fromiter((s.request.num_tokens for s in scheduled), dtype=np.int64, count=n)
    samples = starts + num_new - drafts >= lengths  # the chunk reaches the request's last token
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(num_new, out=qsl[1:])
    t, max_query_len = int(qsl[-1]), int(num_new.max())
    graph_key = graphs.key_for(n, max_query_len) if graphs is not None else None
    b, t_pad = (graph_key[0], graph_key[0] * graph_key[1]) if graph_key is not None else (n, t)

    # Logits rows: each sampling request's last real token and each of its drafts, in token order.
    sampling = np.flatnonzero(samples)
    num_rows = drafts[sampling] + 1
    req_of_row = np.repeat(sampling, num_rows)
    offset = np.arange(len(req_of_row)) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    logits_idx = qsl[1:][req_of_row] - np.repeat(drafts[sampling], num_rows) - 1 + offset
    s = len(logits_idx)

    if buf.copied is not None:  # the last step's copies must have left the host buffers (done, as a rule)
        buf.copied.synchronize()
    stage = buf.staging.np
    stage[:n] = rows
    stage[n:b] = -1
    stage[b : b + n + 1] = qsl
    stage[b + n + 1 : 2 * b + 1] = t
    stage[2 * b + 1 : 2 * b + 1 + n] = num_new - drafts
    stage[3 * b + 1 : 3 * b + 1 + n] = samples
    stage[4 * b + 1 : 4 * b + 1 + s] = logits_idx
    dev = buf.staging.copy_to_gpu(4 * b + 1 + s)
    max_blocks = 0
    for i, sr in enumerate(scheduled):
        buf.block_table.np[i, : len(sr.block_ids)] = sr.block_ids
        max_blocks = max(max_blocks, len(sr.block_ids))
    block_table = buf.copy_block_table(n, max_blocks)
    if buf.copied is not None:
        buf.copied.record()
    seq_lens = starts + num_new  # the host's counts: guesses ahead of a verify step in flight
    buf.query_start_loc.np[: n + 1] = qsl  # host mirrors; on CPU the very buffers the gather then writes, exactly
    buf.seq_lens.np[:n] = seq_lens
    buf.num_computed.np[:n] = starts
    write(b, t_pad, max_query_len)
    common = CommonAttentionMetadata(
        query_start_loc=buf.query_start_loc.gpu[: n + 1], query_start_loc_cpu=buf.query_start_loc.cpu[: n + 1],
        seq_lens=buf.seq_lens.gpu[:n], seq_lens_cpu=buf.seq_lens.cpu[:n],
        num_computed_tokens_cpu=buf.num_computed.cpu[:n], block_table=block_table,
        slot_mapping=buf.slot_mapping.gpu[:t], request_rows=buf.request_rows.gpu[:n], num_reqs=n, num_tokens=t,
        max_query_len=max_query_len, max_seq_len=int(seq_lens.max()), block_size=block_size,
    )
    sample_rows = list(zip(req_of_row.tolist(), offset.tolist(), strict=True))
    logits_indices = None if s == t else dev[4 * b + 1 : 4 * b + 1 + s]
    return StepInputs(common, sample_rows, sampling.tolist(), graph_key, logits_indices, dev[:b],
                      dev[2 * b + 1 : 2 * b + 1 + n], dev[3 * b + 1 : 3 * b + 1 + n], drafts)
