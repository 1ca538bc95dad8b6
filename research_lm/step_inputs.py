"""A step's inputs on the device, the general path (`ModelRunner._prepare_inputs`): any step that is not a uniform
graph step (research_lm/uniform_inputs.py), i.e. prompts, chunks, mixed batches, eager steps.

Host cost grows with the batch (256 decodes on every step of a throughput run), so the per-request loop only
gathers lists; positions, slots and sample rows are computed in whole-batch numpy, and each buffer is copied once
(padded to the graph's size when a CUDA graph will replay the step). Tokens still on the device (PLACEHOLDER: async
scheduling's in-flight token, a proposer's pending drafts) are written as 0 and returned as `holes`, which the runner
fills on the device from where they wait.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from attention_zoo import CommonAttentionMetadata
from research_lm.buffers import StepBuffers
from research_lm.cuda_graphs import DecodeGraphs, pad_step_inputs
from research_lm.outputs import ScheduledRequest
from research_lm.request import PLACEHOLDER


class StepInputs(NamedTuple):
    common: CommonAttentionMetadata
    sample_rows: list[tuple[int, int]]  # (request index, draft offset) per row to sample
    graph_key: tuple[int, int] | None  # the CUDA graph that replays the step (inputs padded to its size)
    logits_indices: torch.Tensor | None  # token row of each sampled row on the device; None: every row, in order
    holes: np.ndarray  # token rows whose input is still on the device
    hole_reqs: np.ndarray  # the request index of each


def prepare_step_inputs(
    buf: StepBuffers, scheduled: list[ScheduledRequest], rows, block_size: int, graphs: DecodeGraphs | None
) -> StepInputs:
    """Fill the step buffers and copy them to the device; rows is the runner's `RequestRows`."""
    bs = block_size
    num_reqs = len(scheduled)
    tokens: list[int] = []
    num_new = np.empty(num_reqs, dtype=np.int64)
    starts = np.empty(num_reqs, dtype=np.int64)
    num_drafts = np.empty(num_reqs, dtype=np.int64)
    samples = np.empty(num_reqs, dtype=bool)  # the chunk reaches the newest token: sample it
    block_table = buf.block_table.np
    max_blocks = 0
    for i, s in enumerate(scheduled):
        req, n, drafts = s.request, s.num_new_tokens, s.spec_token_ids
        start = req.num_computed_tokens
        num_real = n - len(drafts)
        tokens += req.token_ids_slice(start, start + num_real)
        tokens += drafts
        num_new[i], starts[i], num_drafts[i] = n, start, len(drafts)
        samples[i] = start + num_real >= req.num_tokens
        block_table[i, : len(s.block_ids)] = s.block_ids
        max_blocks = max(max_blocks, len(s.block_ids))
        buf.request_rows.np[i] = rows.add(req.request_id)
    qsl = buf.query_start_loc.np[: num_reqs + 1]
    qsl[0] = 0
    np.cumsum(num_new, out=qsl[1:])
    t = int(qsl[-1])
    req_of_token = np.repeat(np.arange(num_reqs), num_new)  # [t]
    positions = np.arange(t) - np.repeat(qsl[:-1] - starts, num_new)  # [t]: start .. start + n per request
    buf.input_ids.np[:t] = tokens
    buf.positions.np[:t] = positions
    blocks = block_table[req_of_token, positions // bs].astype(np.int64)
    np.add(blocks * bs, positions % bs, out=buf.slot_mapping.np[:t])
    buf.seq_lens.np[:num_reqs] = starts + num_new
    buf.num_computed.np[:num_reqs] = starts
    # Sampled rows: the last real token and each draft of every sampling request, in token order.
    sampling = np.flatnonzero(samples)
    num_rows = num_drafts[sampling] + 1
    req_of_row = np.repeat(sampling, num_rows)
    offset = np.arange(len(req_of_row)) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    logits_idx = qsl[1:][req_of_row] - np.repeat(num_drafts[sampling], num_rows) - 1 + offset
    buf.logits_indices.np[: len(logits_idx)] = logits_idx
    sample_rows = list(zip(req_of_row.tolist(), offset.tolist(), strict=True))
    # Tokens still on the device: 0 here, filled by the runner from where they wait.
    holes = np.flatnonzero(buf.input_ids.np[:t] == PLACEHOLDER)
    buf.input_ids.np[holes] = 0
    max_query_len = int(num_new.max())
    graph_key = graphs.key_for(num_reqs, max_query_len) if graphs is not None else None
    nr, nt = num_reqs, t  # rows to copy: the step's, or the padded graph batch's
    if graph_key is not None:
        nr, nt = graph_key[0], graph_key[0] * graph_key[1]
        pad_step_inputs(buf, num_reqs, t, nr, nt)
    common = CommonAttentionMetadata(
        query_start_loc=buf.query_start_loc.copy_to_gpu(nr + 1)[: num_reqs + 1],
        query_start_loc_cpu=buf.query_start_loc.cpu[: num_reqs + 1],
        seq_lens=buf.seq_lens.copy_to_gpu(nr)[:num_reqs],
        seq_lens_cpu=buf.seq_lens.cpu[:num_reqs],
        num_computed_tokens_cpu=buf.num_computed.cpu[:num_reqs],
        block_table=buf.copy_block_table(num_reqs, max_blocks),
        slot_mapping=buf.slot_mapping.copy_to_gpu(nt)[:t],
        request_rows=buf.request_rows.copy_to_gpu(nr)[:num_reqs],
        num_reqs=num_reqs,
        num_tokens=t,
        max_query_len=max_query_len,
        max_seq_len=int(buf.seq_lens.np[:num_reqs].max()),
        block_size=bs,
    )
    buf.input_ids.copy_to_gpu(nt)
    buf.positions.copy_to_gpu(nt)
    logits_indices = None
    if len(logits_idx) < t:
        logits_indices = buf.logits_indices.copy_to_gpu(len(logits_idx))
    return StepInputs(common, sample_rows, graph_key, logits_indices, holes, req_of_token[holes])
