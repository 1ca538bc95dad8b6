"""The model runner: the thin orchestrator every ablation shares.

One step = update rows → prepare inputs → attention metadata → forward (CUDA graph or eager) → logits →
sample or verify → propose. `launch` enqueues a plain-decoding step and returns without waiting for the
device; `collect` waits for its tokens (the step's one sync), so the engine can prepare and launch the next
step while this one runs (async scheduling). Tokens the next step needs before they reach the host
(`PLACEHOLDER`s in its input) are copied on the device from the launched step's sampled ids.
Speculative steps run inside `launch` (drafting needs the emitted tokens), except the drafts themselves: a
proposer may leave them on the device (`PendingDrafts`), and the next step reads them there, the host
waiting for their values only to verify them, so drafting overlaps the host's work between the steps. A
proposer with `propose_before_verification` may even launch its drafting right behind the verify graph, from the
graph's argmax on the device; the host then waits for that argmax alone, or (async scheduling,
`defer_verification`) for nothing: `collect` verifies, and the drafting left the next verify step's inputs and
start corrections on the device (`ahead_inputs`), so the engine can launch that step first.
A decode or verify step covered by a CUDA graph replays forward, logits and their argmax in one graph;
an all-greedy decode batch without penalties, min_tokens or logprobs then takes the graph's argmax as its
tokens (one replay, one device -> host copy of the ids), and an all-greedy verify step checks its drafts
against that argmax; any other batch samples (or rejection-samples) from the graph's logits.
Inputs: a graph step whose requests all run their newest token plus q - 1 drafts (a decode, a verify step) stages
each token (or where on the device it waits), each request's start and row in one pinned buffer, copies it once,
and one kernel writes the graph's buffers (`_prepare_uniform`); any other step fills the buffers in numpy and
copies each (research_lm/step_inputs.py), the path `uniform_inputs = False` forces for A/B runs.
Each stage lives in a sibling module and enters here in one line; keep it that way.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from attention_zoo import CacheLayer, CommonAttentionMetadata
from research_lm.buffers import DeviceTokens, HostIds, StepBuffers
from research_lm.compilation import compile_forward
from research_lm.cuda_graphs import (
    Capture,
    DecodeGraphs,
    cuda_graph_capture,
    default_capture_sizes,
    default_prefill_sizes,
    gc_frozen,
    uncapturable_reason,
    unsupported_reason,
)
from research_lm.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from research_lm.request import PLACEHOLDER, Request
from research_lm.rng import to_device
from research_lm.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingRow
from research_lm.spec import Proposal, Proposer, StepOutcome
from research_lm.step_inputs import prepare_step_inputs
from research_lm.taps import HiddenStateTaps
from research_lm.uniform_inputs import UniformInputs, uniform_graph_key
from research_lm.verification import verify_drafts


class RequestRows:
    """Stable row per live request in the persistent state tables (block table, Mamba state slots)."""

    def __init__(self, max_num_reqs: int):
        self.free = list(range(max_num_reqs - 1, -1, -1))
        self.row_of: dict[str, int] = {}

    def add(self, req_id: str) -> int:
        if req_id not in self.row_of:
            self.row_of[req_id] = self.free.pop()
        return self.row_of[req_id]

    def remove(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.free.append(row)


@dataclass
class PendingStep:
    """A launched step: its output when already known (most speculative steps, empty steps), else the sampled
    ids (a deferred verify step: the verify's argmax) on their way to `host_ids` (ready when `copied` has fired)
    and what `collect` needs to finish."""

    sched: SchedulerOutput
    output: RunnerOutput | None = None
    host_ids: torch.Tensor | None = None  # [num_sample_rows] int64, pinned on CUDA
    copied: torch.cuda.Event | None = None
    sample_rows: list[tuple[int, int]] | None = None
    sampled: SamplerOutput | None = None
    batch: SamplingBatch | None = None
    # A deferred verify step (`defer_verification`): what the proposer drafted from, the step's input ids on their
    # way to the host (its drafts' values), and when its launch began.
    verifying: tuple[StepOutcome, torch.Tensor, float] | None = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        vocab_size: int,
        proposer: Proposer | None = None,
        compile: bool = False,
    ):
        self.model = model
        # What eager steps and CUDA-graph captures call: the model, or its torch.compile'd forward.
        self.forward = compile_forward(model) if compile else model
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.proposer = proposer
        # The target's cache layers, then the drafter's (draft model / EAGLE KV shares the block table).
        self.cache_layers = [m for m in model.modules() if isinstance(m, CacheLayer)]
        self.cache_layers += list(proposer.cache_layers if proposer is not None else [])
        self.backends = list({layer.backend.name: layer.backend for layer in self.cache_layers}.values())
        # A backend that plans each replay from the host's lengths cannot serve a step launched on guessed ones.
        self._plans_on_host = any(b.capabilities.graphs_plan_on_host for b in self.backends)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.cuda_graphs: DecodeGraphs | None = None  # set by capture_cuda_graphs
        # A drafter's lookahead slots may reach past max_model_len.
        lookahead = proposer.num_lookahead_tokens if proposer is not None else 0
        max_blocks_per_req = -(-(max_model_len + lookahead) // block_size)
        self.buffers = StepBuffers(max_num_batched_tokens, max_num_seqs, max_blocks_per_req, device)
        self.rows = RequestRows(max_num_seqs)
        self.sampler = Sampler()
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, vocab] q of pending drafts
        # The last launched step's sampled ids on the device: the source of the next step's PLACEHOLDER
        # inputs under async scheduling (and of the penalties' view of them).
        self._last_sampled: DeviceTokens | None = None
        # The last proposal while its drafts are still on the device (`PendingDrafts`), and the requests it
        # drafted for: the source of PLACEHOLDER drafts in the next step's input.
        self._pending: tuple[Proposal, list[Request]] | None = None
        self._host_ids = HostIds(max_num_batched_tokens, device)
        # Graph steps whose requests all run q tokens stage their inputs in one copy (`_prepare_uniform`);
        # False sends them through the general path (the A/B switch of the tests and benchmarks).
        self.uniform_inputs = True
        # How many small graphs may replay `_prepare_uniform`'s kernel (0: always launch it; the benchmarks' A/B)
        self.input_graphs = 16
        self._uniform: UniformInputs | None = None  # made at the first uniform step
        # Fires when a step's inputs have left the pinned host buffers, which the next step overwrites.
        self._inputs_copied = torch.cuda.Event() if device.type == "cuda" else None
        # Async scheduling (the engine sets it): a verify step that drafts behind its verify forward leaves its
        # verification to `collect`, and the next step's inputs on the device (`_ahead`), so that the engine may
        # launch that step before this one's tokens reach the host.
        self.defer_verification = False
        self._ahead: DeviceTokens | None = None  # the last deferred step's next inputs, while it is the latest
        self._latest: PendingStep | None = None  # the last launched step
        self._host_inputs = HostIds(max_num_batched_tokens, device)  # a deferred step's input ids, to the host
        # The residual streams the proposer reads (EAGLE-3), recorded by hooks: the model knows nothing of them.
        self.taps = None
        if proposer is not None and proposer.aux_hidden_state_layers:
            self.taps = HiddenStateTaps(model, proposer.aux_hidden_state_layers, max_num_batched_tokens)

    # ---- KV cache -------------------------------------------------------------------------------
    def page_size_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one KV block costs summed over all paged layers."""
        return sum(layer.spec.page_size_bytes(self.block_size, dtype) for layer in self.cache_layers)

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of per-request state (one slot per request row) summed over all state layers."""
        return self.max_num_seqs * sum(layer.spec.state_bytes_per_slot(dtype) for layer in self.cache_layers)

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        for layer in self.cache_layers:
            layer.kv_cache = layer.backend.allocate_cache(
                layer.spec, num_blocks=num_blocks, block_size=self.block_size, num_slots=self.max_num_seqs,
                dtype=dtype, device=self.device,
            )

    def capture_cuda_graphs(self, sizes: list[int] | None = None, prefill_sizes: list[int] | None = None,
                            capture: Capture = cuda_graph_capture) -> str | None:
        """Capture decode graphs (forward, logits, argmax) over the KV cache (allocated, and never again
        after), verify graphs of k + 1 tokens per request with a proposer whose backends allow it, batch-1
        prefill graphs (forward only) where they allow it too, and the proposer's own draft graphs (with its
        prefill ones); None, or why not. prefill_sizes None: `default_prefill_sizes`; [] captures none."""
        if capture is cuda_graph_capture:
            reason = unsupported_reason(self.model, self.backends, self.device)
        else:  # a stand-in capture (tests: `eager_capture` on CPU) needs no CUDA device
            reason = uncapturable_reason(self.model, self.backends)
        if reason is not None:
            return reason
        sizes = sizes or default_capture_sizes(self.max_num_seqs)
        query_lens = [1]
        multi_token = all(b.capabilities.cuda_graphs_multi_token for b in self.backends)
        if self.proposer is not None and multi_token:
            query_lens.append(self.proposer.num_speculative_tokens + 1)
        if prefill_sizes is None:
            prefill_sizes = default_prefill_sizes(self.buffers.max_num_tokens)
        with gc_frozen() if capture is cuda_graph_capture else nullcontext():
            self._capture(sizes, query_lens, prefill_sizes if multi_token else (), capture)
        return None

    def _capture(self, sizes: list[int], query_lens: list[int], prefill_sizes: list[int], capture: Capture) -> None:
        self.cuda_graphs = DecodeGraphs(
            self.forward, self.buffers, self.backends, sizes=sizes, query_lens=query_lens,
            block_size=self.block_size, max_seq_len=self.max_model_len,
            compute_logits=self.model.compute_logits, vocab_size=self.vocab_size,
            prefill_sizes=prefill_sizes, capture=capture,
        )
        if self.proposer is not None:  # the drafter's prompt graphs: the lengths the target's serve
            self.proposer.capture_cuda_graphs(
                sizes=sizes, prefill_sizes=self.cuda_graphs.prefill, capture=capture, block_size=self.block_size,
                max_blocks_per_req=self.buffers.block_table.gpu.shape[1],
                verified_inputs=None if self.cuda_graphs.greedy_ids is None
                else (self.cuda_graphs.greedy_ids, self.buffers.input_ids.gpu, self.buffers.positions.gpu))

    # ---- one step -------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step to the end (launch, then collect)."""
        return self.collect(self.launch(sched))

    def launch(self, sched: SchedulerOutput) -> PendingStep:
        """Enqueue one step; a plain-decoding step (and a deferred verify step) returns before its tokens reach the
        host."""
        self._latest = self._launch(sched)
        return self._latest

    def reset(self) -> None:
        """Forget every request and every launched step, after a step failed on the host (the scheduler preempts
        its requests: `Scheduler.recover`): their rows, draft q and the proposer's state go, and the next step
        reads nothing a failed or dropped step left (its sampled ids, drafts or next inputs on the device)."""
        if self.device.type == "cuda":  # a dropped step may still write the blocks the scheduler frees
            torch.cuda.synchronize(self.device)
        gone = set(self.rows.row_of) | set(self.draft_probs)
        self.rows.remove(gone)
        self.draft_probs.clear()
        if self.proposer is not None and gone:
            self.proposer.on_requests_removed(gone)
        self._pending = self._last_sampled = self._ahead = self._latest = None

    def continues_on_device(self, step: PendingStep) -> bool:
        """Whether the next step of `step`'s requests can be launched before `step` is collected: it is a deferred
        verify step, nothing was launched after it, and its requests' next inputs wait on the device."""
        return step.verifying is not None and step is self._latest and self._ahead is not None and self.uniform_inputs

    @torch.inference_mode()
    def _launch(self, sched: SchedulerOutput) -> PendingStep:
        gone = sched.finished_req_ids | sched.preempted_req_ids
        self.rows.remove(gone)
        for req_id in gone:
            self.draft_probs.pop(req_id, None)
        if self.proposer is not None and gone:
            self.proposer.on_requests_removed(gone)
        if not sched.scheduled:
            return PendingStep(sched, output=RunnerOutput(req_ids=[], sampled_token_ids=[]))

        t0 = time.perf_counter()  # host spans are honest on GPU: each phase ends in a `.tolist()` sync
        common, sample_rows, graph_key, logits_indices = self._prepare_inputs(sched.scheduled)
        input_ids = self.buffers.input_ids.gpu[: common.num_tokens]
        positions = self.buffers.positions.gpu[: common.num_tokens]
        graph = None
        if graph_key is not None:
            graph = self.cuda_graphs.replay(graph_key, common)  # inputs already padded and copied
            out = graph.out
        else:
            out = self.forward(input_ids, positions, {b.name: b.build_metadata(common) for b in self.backends})
        hidden = out
        aux = self.taps.values(common.num_tokens) if self.taps is not None else None

        greedy_ids = None  # [num_sample_rows] int64, argmax of logits, when the graph computed it
        if graph is not None and graph.logits is not None and logits_indices is None:
            logits, greedy_ids = graph.logits, graph.greedy_ids  # every token sampled: logits_indices = arange
        elif graph is not None and graph.logits is not None:  # the graph computed every row's logits
            logits = graph.logits[logits_indices]
        else:  # [num_sample_rows, vocab]
            logits = self.model.compute_logits(hidden if logits_indices is None else hidden[logits_indices])
        if self.proposer is None:  # plain decoding: no drafts to verify, none to propose
            return self._launch_sampling(sched, sample_rows, logits, greedy_ids)
        scheduled = sched.scheduled
        outcome = StepOutcome(
            requests=[s.request for s in scheduled], emitted=[], input_ids=input_ids, positions=positions,
            query_start_loc_cpu=common.query_start_loc_cpu, hidden_states=hidden, aux_hidden_states=aux,
            num_rejected=[], common=common, greedy_ids=greedy_ids,
        )
        if not any(s.spec_token_ids for s in scheduled):
            output = self.collect(self._launch_sampling(sched, sample_rows, logits, greedy_ids))
            num_rejected = [0] * len(scheduled)
        elif (deferred := self._defer_verification(sched, outcome, sample_rows, t0)) is not None:
            return deferred
        else:
            assert self._ahead is None, "a verify step launched ahead of the last one's verification must defer its own"
            if self._pending is not None:
                self._fill_drafts(scheduled)  # waits for the drafts' copy, queued before this step's forward
            greedy_ids = self._drafting_before_verification(outcome)
            emitted, num_rejected, logprobs = verify_drafts(scheduled, sample_rows, logits, greedy_ids,
                                                            self.draft_probs, self.vocab_size, self.device)
            output = RunnerOutput(req_ids=[s.request.request_id for s in scheduled], sampled_token_ids=emitted,
                                  logprobs=logprobs, num_draft_tokens=[len(s.spec_token_ids) for s in scheduled])
            output.verify_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        outcome.emitted, outcome.num_rejected = output.sampled_token_ids, num_rejected
        if self._pending is not None:  # the next proposal overwrites the last one's device drafts
            self._fill_drafts(scheduled)
        proposal: Proposal = self.proposer.propose(outcome)
        # draft_ms is the host's time in the proposer: with drafts left on the device (the draft graphs), their
        # GPU time overlaps the next step's host work, and what remains of it is in that step's verify_ms.
        output.draft_ms = (time.perf_counter() - t1) * 1e3
        output.draft_token_ids = proposal.token_ids
        if proposal.pending is not None:
            self._pending = (proposal, outcome.requests)
        self.draft_probs.update(proposal.probs)
        return PendingStep(sched, output=output)

    def _defer_verification(self, sched: SchedulerOutput, outcome: StepOutcome, sample_rows: list[tuple[int, int]],
                            t0: float) -> PendingStep | None:
        """With `defer_verification`, a verify step whose proposer drafts behind the verify forward
        (`propose_before_verification`) launches that drafting and returns without waiting for anything: the
        verify's argmax and input ids are on their way to the host, where `collect` verifies, and the drafting
        left each request's next inputs on the device (`ahead_inputs`). None where the step does not qualify (also
        where a request asks for logprobs: `collect` verifies from the argmax alone, without the logits)."""
        if not self.defer_verification or outcome.greedy_ids is None or self._plans_on_host:
            return None
        if any(r.sampling_params.logprobs is not None for r in outcome.requests):
            return None
        launch = self.proposer.propose_before_verification(outcome)
        if not launch:
            return None
        if self._pending is not None:  # this step's drafts: `collect` reads their values from its input ids
            here = {s.request.request_id for s in sched.scheduled}
            if any(r.request_id not in here and PLACEHOLDER in r.spec_token_ids for r in self._pending[1]):
                self._fill_drafts(sched.scheduled)  # an unscheduled request holds some: resolve them before the
                # drafting below overwrites their host copy
            self._pending = None
        t = outcome.common.num_tokens
        host_ids, _ = self._host_ids.start_copy(outcome.greedy_ids[:t])
        host_inputs, copied = self._host_inputs.start_copy(outcome.input_ids[:t])  # fires after both copies
        launch()
        self._ahead = self.proposer.ahead_inputs(outcome)
        return PendingStep(sched, host_ids=host_ids, copied=copied, sample_rows=sample_rows,
                           verifying=(outcome, host_inputs, t0))

    def _collect_deferred(self, pending: PendingStep) -> RunnerOutput:
        """Verify a deferred step on the host; the latest launched step then also hands out its proposal (nothing
        was launched after it, so the next step starts from these drafts, as a synchronous step would)."""
        outcome, host_inputs, t0 = pending.verifying
        if pending.copied is not None:
            pending.copied.synchronize()
        scheduled, q = pending.sched.scheduled, outcome.common.max_query_len
        inputs = host_inputs.tolist()
        for i, s in enumerate(scheduled):
            s.spec_token_ids = inputs[i * q + 1 : (i + 1) * q]  # the drafts it verified, as the device held them
        emitted, num_rejected, _ = verify_drafts(scheduled, pending.sample_rows, None, pending.host_ids,
                                                 self.draft_probs, self.vocab_size, self.device)
        output = RunnerOutput(req_ids=[s.request.request_id for s in scheduled], sampled_token_ids=emitted,
                              num_draft_tokens=[q - 1] * len(scheduled))
        output.verify_ms = (time.perf_counter() - t0) * 1e3
        outcome.emitted, outcome.num_rejected = emitted, num_rejected
        if pending is self._latest:
            self._ahead = None
            t1 = time.perf_counter()
            proposal = self.proposer.propose(outcome)
            output.draft_ms = (time.perf_counter() - t1) * 1e3
            output.draft_token_ids = proposal.token_ids
            if proposal.pending is not None:
                self._pending = (proposal, outcome.requests)
        return output

    def _drafting_before_verification(self, outcome: StepOutcome) -> torch.Tensor | None:
        """Where the proposer can draft behind the verify forward (`propose_before_verification`), the verify's
        argmax [num_sample_rows] on the host, its copy queued before the drafting: the host waits for it alone
        while the drafter runs. Else the argmax as it came (on the device, or None)."""
        greedy_ids = outcome.greedy_ids
        launch = self.proposer.propose_before_verification(outcome) if greedy_ids is not None else None
        if not launch:
            return greedy_ids
        host, copied = self._host_ids.start_copy(greedy_ids)
        launch()
        if copied is not None:
            copied.synchronize()
        return host

    def resolve_drafts(self) -> None:
        """Wait for the last proposal's drafts and put their values in its token lists (the step output's
        draft_token_ids), for a caller that must see them now."""
        if self._pending is not None:
            self._pending[0].resolve()

    def _fill_drafts(self, scheduled: list[ScheduledRequest]) -> None:
        """Replace the PLACEHOLDER drafts of the last proposal by their values (waiting for them once): in this
        step's scheduled requests, and in requests that still hold some (not scheduled since, or cut short)."""
        proposal, requests = self._pending
        self._pending = None
        for s in scheduled:
            s.spec_token_ids = proposal.fill(s.spec_token_ids, s.request.request_id)
        for req in requests:
            req.spec_token_ids = proposal.fill(req.spec_token_ids, req.request_id)

    def _launch_sampling(
        self,
        sched: SchedulerOutput,
        sample_rows: list[tuple[int, int]],  # (request index, 0) per logits row: one per sampling request
        logits: torch.Tensor,  # [num_sample_rows, vocab]
        greedy_ids: torch.Tensor | None,  # [num_sample_rows] int64: logits.argmax(-1), from the graph
    ) -> PendingStep:
        """Sample one token per row and start copying the ids to the host; no sync.

        greedy_ids stand in for the sampler where it would return exactly them (`batch.argmax_only`)."""
        scheduled = sched.scheduled
        requests = [scheduled[i].request for i, _ in sample_rows]
        in_flight = None  # rows whose last output is still on the device: penalties count it there
        waiting = [row for row, r in enumerate(requests) if r.num_output_placeholders and r.sampling_params.penalized]
        if waiting:
            in_flight = (waiting, self._in_flight_ids([requests[row].request_id for row in waiting]))
        batch = SamplingBatch.build([SamplingRow(r) for r in requests], self.vocab_size, self.device, in_flight)
        if greedy_ids is not None and batch.argmax_only:
            sampled = SamplerOutput(greedy_ids)  # what the sampler returns here, computed in the graph
        else:
            sampled = self.sampler(logits, batch)
        ids = sampled.token_ids
        self._last_sampled = DeviceTokens(ids, {scheduled[i].request.request_id: row
                                                for row, (i, _) in enumerate(sample_rows)})
        host, copied = self._host_ids.start_copy(ids)
        return PendingStep(sched, host_ids=host, copied=copied, sample_rows=sample_rows, sampled=sampled,
                           batch=batch)

    def _in_flight_ids(self, request_ids: list[str]) -> torch.Tensor:  # [n] int64 on the device
        """The tokens the last launched step sampled for these requests, which the host does not know yet."""
        last = self._last_sampled
        return last.ids.index_select(0, to_device([last.first[r] for r in request_ids], torch.int64, self.device))

    def collect(self, pending: PendingStep) -> RunnerOutput:
        """Wait for a launched step's tokens; its RunnerOutput."""
        if pending.output is not None:
            return pending.output
        if pending.verifying is not None:
            return self._collect_deferred(pending)
        if pending.copied is not None:
            pending.copied.synchronize()
        scheduled = pending.sched.scheduled
        emitted: list[list[int]] = [[] for _ in scheduled]
        for (i, _), token in zip(pending.sample_rows, pending.host_ids.tolist(), strict=True):
            emitted[i] = [token]
        logprobs = None
        if pending.sampled.logprobs is not None:
            logprobs = [[] for _ in scheduled]
            for (i, _), lp in zip(pending.sample_rows, pending.sampled.logprob_dicts(pending.batch), strict=True):
                logprobs[i] = [lp] if lp is not None else []
        return RunnerOutput(
            req_ids=[s.request.request_id for s in scheduled], sampled_token_ids=emitted, logprobs=logprobs,
            num_draft_tokens=[0] * len(scheduled),
        )

    def _prepare_inputs(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[CommonAttentionMetadata, list[tuple[int, int]], tuple[int, int] | None, torch.Tensor | None]:
        """Fill the step buffers and copy them to the device; return the attention record, (request index,
        draft offset) per row to sample (one row for a decode, k+1 for verified drafts, none for a mid-prompt
        chunk), the CUDA graph that will replay the step (its inputs are then padded to its size), and the
        token row of each sampled row on the device (None when every token row is sampled: arange). A uniform
        step takes `_prepare_uniform`, any other research_lm/step_inputs.py's general path."""
        if self._inputs_copied is not None:  # the previous step's copies must have left the host buffers
            self._inputs_copied.synchronize()
        if (self.uniform_inputs and self.cuda_graphs is not None
                and (key := uniform_graph_key(self.cuda_graphs, scheduled)) is not None):
            return self._prepare_uniform(scheduled, key)
        assert self._ahead is None, "a step launched ahead of a deferred verify step must be uniform"
        step = prepare_step_inputs(self.buffers, scheduled, self.rows, self.block_size, self.cuda_graphs)
        if len(step.holes):
            qsl = self.buffers.query_start_loc.np[: len(scheduled) + 1]
            self._fill_holes(self.buffers.input_ids.gpu, step.holes, step.hole_reqs, qsl, scheduled)
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        return step.common, step.sample_rows, step.graph_key, step.logits_indices

    def _prepare_uniform(
        self, scheduled: list[ScheduledRequest], key: tuple[int, int]
    ) -> tuple[CommonAttentionMetadata, list[tuple[int, int]], tuple[int, int], None]:
        """`_prepare_inputs` for a uniform step (research_lm/uniform_inputs.py): one staged copy, one kernel."""
        if self._uniform is None:
            self._uniform = UniformInputs(self.buffers, self.block_size, max_graphs=self.input_graphs)
        source = self._held_tokens()
        common = self._uniform(scheduled, key, source, self.rows)
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        q = key[1]
        return common, [(i, j) for i in range(len(scheduled)) for j in range(q)], key, None

    def _held_tokens(self) -> DeviceTokens | None:
        """Where a step's PLACEHOLDER inputs wait on the device: the last proposal's drafts; or else (async
        scheduling) the next inputs a deferred verify step left, or the last launched step's sampled ids."""
        if self._pending is not None and self._pending[0].pending is not None:  # (resolved: its drafts are values)
            return self._pending[0].pending.tokens
        return self._ahead if self._ahead is not None else self._last_sampled

    def _fill_holes(self, input_ids: torch.Tensor, holes: np.ndarray, reqs: np.ndarray, qsl: np.ndarray,
                    scheduled: list[ScheduledRequest]) -> None:
        """Copy PLACEHOLDER inputs (token rows `holes` of requests `reqs`) from the device: the last proposal's
        drafts, or else (async scheduling) the last launched step's sampled ids. A request's placeholders are
        the last tokens of its chunk, in order: its j-th is its j-th token there."""
        source = self._held_tokens()
        count = np.bincount(reqs, minlength=len(scheduled))
        j = holes - (qsl[1:][reqs] - count[reqs])
        first = [source.first[scheduled[r].request.request_id] for r in reqs.tolist()]
        h, buf = len(holes), self.buffers.holes
        buf.np[:h] = holes
        buf.np[h : 2 * h] = np.asarray(first, dtype=np.int64) + j * source.stride
        dst_src = buf.copy_to_gpu(2 * h)
        input_ids.index_copy_(0, dst_src[:h], source.ids.index_select(0, dst_src[h:]))
