"""A uniform graph step's inputs in one host -> device copy (the runner's `_prepare_uniform`).

A graph step is uniform when every request runs its newest token and q - 1 drafts for the q its graph was
captured with: a decode (q = 1) or a verify step. Its host work is then only: per token its value, or
-1 - its index in the device tokens holding it (async scheduling's in-flight token, a proposer's pending
drafts); per request its start position and row; and n, in `StepBuffers.staging`, copied once with the block
table. research_lm/ops/graph_step_inputs.py writes every buffer the graph reads from that, padding included.
A verify step launched before the previous one was verified (async scheduling) holds all q tokens of a request
on the device, and its start is the host's guess (every draft accepted): the kernel adds the device's
correction (`DeviceTokens.start_shift`). The host's record then carries the guesses; the graph's buffers are exact.
Any other step takes the runner's general path (numpy over the batch, a copy per buffer).
"""

from __future__ import annotations

import numpy as np

from attention_zoo import CommonAttentionMetadata
from research_lm.buffers import DeviceTokens, StepBuffers
from research_lm.cuda_graphs import DecodeGraphs
from research_lm.outputs import ScheduledRequest
from research_lm.request import PLACEHOLDER


def uniform_graph_key(graphs: DecodeGraphs, scheduled: list[ScheduledRequest]) -> tuple[int, int] | None:
    """The captured (B, q) of a uniform step (module docstring); None for any other step."""
    q = scheduled[0].num_new_tokens
    for s in scheduled:
        req = s.request
        if s.num_new_tokens != q or len(s.spec_token_ids) != q - 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return None
    key = graphs.key_for(len(scheduled), q)
    return key if key is not None and key[1] == q else None


class UniformInputs:
    """Stages a uniform step and has the kernel write the step buffers; `max_graphs` small graphs may replay the
    kernel (research_lm.ops.graph_step_inputs.GraphStepInputs, made at the first step: Triton loads with it)."""

    def __init__(self, buffers: StepBuffers, block_size: int, max_graphs: int):
        self.buffers, self.block_size, self.max_graphs = buffers, block_size, max_graphs
        self._write = None

    def __call__(
        self, scheduled: list[ScheduledRequest], key: tuple[int, int], source: DeviceTokens | None, rows
    ) -> CommonAttentionMetadata:
        """The step's record over the written buffers; rows is the runner's `RequestRows`."""
        buf, bs = self.buffers, self.block_size
        (b, q), n = key, len(scheduled)
        t = n * q
        staging, block_table = buf.staging.np, buf.block_table.np
        shifted = source is not None and source.start_shift is not None
        tokens, starts, req_rows, shifts, max_blocks = [], [], [], [], 0
        for i, s in enumerate(scheduled):
            req = s.request
            tokens.append(req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1])
            tokens += s.spec_token_ids
            shift = -1
            if tokens[-1] == PLACEHOLDER:  # the request's last `held` tokens are on the device, in order
                held = tokens[-q:].count(PLACEHOLDER)
                first = source.first[req.request_id]
                tokens[-held:] = [-1 - (first + j * source.stride) for j in range(held)]
                shift = first if shifted and held == q else -1  # its newest token unseen: its start a guess
            starts.append(req.num_computed_tokens)
            shifts.append(shift)
            req_rows.append(rows.add(req.request_id))
            block_table[i, : len(s.block_ids)] = s.block_ids
            max_blocks = max(max_blocks, len(s.block_ids))
        staging[:t] = tokens
        staging[t : b * q] = 0
        staging[b * q : b * q + n] = starts
        staging[b * q + n : b * q + b] = 0
        staging[b * q + b : b * q + b + n] = req_rows
        staging[b * q + b + n : b * q + 2 * b] = -1
        staging[b * q + 2 * b] = n
        size = b * q + 2 * b + 1
        if shifted:
            staging[size : size + n] = shifts
            staging[size + n : size + b] = -1
            size += b
        buf.query_start_loc.np[: n + 1] = np.arange(0, t + 1, q)
        buf.num_computed.np[:n] = starts
        np.add(buf.num_computed.np[:n], q, out=buf.seq_lens.np[:n])
        buf.staging.copy_to_gpu(size)
        block_table_gpu = buf.copy_block_table(n, max_blocks)
        if self._write is None:
            from research_lm.ops.graph_step_inputs import GraphStepInputs  # Triton, imported when it runs

            self._write = GraphStepInputs(buf, bs, max_graphs=self.max_graphs)
        self._write(source.ids if source is not None else None, b, q, source.start_shift if shifted else None)
        return CommonAttentionMetadata(
            query_start_loc=buf.query_start_loc.gpu[: n + 1], query_start_loc_cpu=buf.query_start_loc.cpu[: n + 1],
            seq_lens=buf.seq_lens.gpu[:n], seq_lens_cpu=buf.seq_lens.cpu[:n],
            num_computed_tokens_cpu=buf.num_computed.cpu[:n], block_table=block_table_gpu,
            slot_mapping=buf.slot_mapping.gpu[:t], request_rows=buf.request_rows.gpu[:n], num_reqs=n,
            num_tokens=t, max_query_len=q, max_seq_len=max(starts) + q, block_size=bs,
        )
