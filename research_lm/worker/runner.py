"""The model runner: the thin orchestrator every ablation shares.

Per-request state lives in device tables (research_lm/worker/request_state.py); the host stages counts only. A step:
1. `launch`: gather the inputs from the tables (research_lm/worker/step_inputs.py) → forward (a CUDA graph, or eager) →
   logits → sample, or verify the drafts, on the device → append what each request emitted to the tables → the
   proposer drafts on the device where it can, writing the drafts after the tokens → start copying the emitted
   tokens to the host. Nothing waits for the device.
2. `collect`: wait for that copy (the step's one sync); a proposer that needs the tokens on the host drafts now.
The engine may launch step N + 1 between the two (async scheduling) when step N left nothing for the host to do
first (`continues_on_device`): every value N + 1 reads is in the tables already.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from attention_zoo import CacheLayer
from research_lm.api.outputs import RunnerOutput, SchedulerOutput
from research_lm.ops.step_inputs import StepInputWriter
from research_lm.worker.acceptance_replay import AcceptanceReplay
from research_lm.worker.buffers import HostIds, StepBuffers
from research_lm.worker.compilation import compile_forward
from research_lm.worker.cuda_graphs import (
    Capture,
    DecodeGraphs,
    GraphPool,
    cuda_graph_capture,
    default_capture_sizes,
    default_prefill_sizes,
    gc_frozen,
    uncapturable_reason,
    unsupported_reason,
)
from research_lm.worker.pending_step import PendingStep
from research_lm.worker.request_state import RequestState
from research_lm.worker.rng import to_device
from research_lm.worker.sampler import Sampler, plain_greedy
from research_lm.worker.spec import Drafts, Proposer, StepOutcome
from research_lm.worker.step_inputs import prepare_step_inputs
from research_lm.worker.step_tokens import sample_or_verify
from research_lm.worker.taps import HiddenStateTaps
from research_lm.worker.token_tree import TreeSteps
from research_lm.worker.verification import emitted_logprobs


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
        acceptance_replay: AcceptanceReplay | None = None,  # verify steps keep the profile's counts
    ):
        self.model = model
        self.acceptance_replay = acceptance_replay
        # What eager steps and CUDA-graph captures call: the model, or its torch.compile'd forward.
        self.forward = compile_forward(model) if compile else model
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.proposer = proposer
        # The target's cache layers, then the drafter's (draft model / EAGLE KV shares the block table).
        target_layers = [m for m in model.modules() if isinstance(m, CacheLayer)]
        self.cache_layers = target_layers + list(proposer.cache_layers if proposer is not None else [])
        self.backends = list({layer.backend.name: layer.backend for layer in self.cache_layers}.values())
        # Planning on the host's lengths rules out steps launched on guessed ones (on CPU the gather writes them).
        self._plans_on_host = device.type != "cpu" and any(
            b.capabilities.graphs_plan_on_host or b.capabilities.eager_plans_on_host for b in self.backends)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.cuda_graphs: DecodeGraphs | None = None  # set by capture_cuda_graphs
        # A drafter's lookahead slots may reach past max_model_len.
        k, lookahead = (proposer.num_speculative_tokens, proposer.num_lookahead_tokens) if proposer else (0, 0)
        max_blocks_per_req = -(-(max_model_len + lookahead) // block_size)
        self.buffers = buf = StepBuffers(max_num_batched_tokens, max_num_seqs, max_blocks_per_req, device)
        self.state = RequestState(max_num_seqs, max_model_len, k, device)
        self._write_inputs = StepInputWriter(
            self.state.token_ids, self.state.num_computed, buf.block_table.gpu, buf.staging.gpu, buf.input_ids.gpu,
            buf.positions.gpu, buf.slot_mapping.gpu, buf.seq_lens.gpu, buf.query_start_loc.gpu, buf.request_rows.gpu,
            block_size=block_size)
        tree = proposer.token_tree if proposer is not None else None  # a tree's two hooks (worker/token_tree.py)
        self.tree = (TreeSteps(tree, target_layers, self.backends, max_num_batched_tokens, max_num_seqs, device)
                     if tree else None)
        self.sampler = Sampler()
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, vocab] q of its drafts
        self._host = HostIds(max_num_seqs * (k + 3), device)
        self._latest: PendingStep | None = None  # the last launched step
        # The residual streams the proposer reads (EAGLE-3), recorded by hooks: the model knows nothing of them.
        self.taps = (HiddenStateTaps(model, proposer.aux_hidden_state_layers, max_num_batched_tokens)
                     if proposer is not None and proposer.aux_hidden_state_layers else None)

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
            capture = GraphPool(capture)  # one memory pool for the target's graphs and the drafter's
            self.cuda_graphs = DecodeGraphs(
                self.forward, self.buffers, self.backends, sizes=sizes, query_lens=query_lens,
                block_size=self.block_size, max_seq_len=self.max_model_len,
                compute_logits=self.model.compute_logits, vocab_size=self.vocab_size,
                prefill_sizes=prefill_sizes if multi_token else (), capture=capture,
                num_drafts=self.state.num_drafts if self.proposer is not None and self.tree is None else None,
                replay_accept=self.acceptance_replay and (lambda *a: self.acceptance_replay.accept_greedily(
                    self.state.num_tokens, self.state.token_ids, *a)),
                tree_bits=self.tree.bits if self.tree is not None else None)
            if self.proposer is not None:  # the drafter's prompt graphs: the lengths the target's serve
                graphs = self.cuda_graphs
                self.proposer.capture_cuda_graphs(
                    sizes=sizes, prefill_sizes=graphs.prefill, capture=capture, block_size=self.block_size,
                    max_blocks_per_req=self.buffers.block_table.gpu.shape[1],
                    **({} if graphs.greedy_ids is None else dict(  # what a "verified" draft graph reads and writes
                        verified_inputs=(graphs.greedy_ids, self.buffers.input_ids.gpu, self.buffers.positions.gpu),
                        tokens=self.state.table(self.buffers.request_rows.gpu))))
        return None

    # ---- one step -------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every request and every launched step, after a step failed on the host (the scheduler preempts
        its requests: `Scheduler.recover`): their rows, draft q and the proposer's state go."""
        if self.device.type == "cuda":  # a dropped step may still write the blocks the scheduler frees
            torch.cuda.synchronize(self.device)
        gone = set(self.state.rows.row_of) | set(self.draft_probs)
        self.state.clear()
        self.draft_probs.clear()
        if self.proposer is not None and gone:
            self.proposer.on_requests_removed(gone)
        self._latest = None

    def continues_on_device(self, step: PendingStep) -> bool:
        """Whether the next step may be launched before `step` is collected: nothing was launched after it, and it
        leaves the host nothing to do first. Plain decoding always; with a proposer, where the drafts were made on
        the device and every request is plain greedy without logprobs (the next step's sampling then reads no count
        that the drafts' acceptance may change), and no backend plans on the host's (then guessed) lengths."""
        if step is not self._latest or step.output is not None:
            return False
        if self.proposer is None or (not step.verifies and step.drafted is not None and not step.drafted.index):
            return True  # plain decoding on both sides (no proposer, or a policy that skipped drafting)
        requests = step.outcome.requests
        return (step.drafted is not None and not self._plans_on_host
                and all(plain_greedy(r) and r.sampling_params.logprobs is None for r in requests))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingStep:
        """Enqueue one step (module docstring) and return without waiting for the device. sched.draft False: the
        proposer drafts nothing for the next step, which then runs as plain decoding (the engine's speculation
        policy)."""
        gone = sched.finished_req_ids | sched.preempted_req_ids
        self.state.remove(gone)
        for req_id in gone:
            self.draft_probs.pop(req_id, None)
        if self.proposer is not None and gone:
            self.proposer.on_requests_removed(gone)
        if not sched.scheduled:
            self._latest = PendingStep(sched, output=RunnerOutput(req_ids=[], sampled_token_ids=[]))
            return self._latest
        t0 = time.perf_counter()
        inputs = prepare_step_inputs(self.buffers, self.state, sched.scheduled, self.block_size, self.cuda_graphs,
                                     self._write_inputs)
        if self.acceptance_replay is not None:  # (before the forward: verify graphs read its tables)
            self.acceptance_replay.admit(gone, [s.request for s in sched.scheduled], self.state.rows.row_of)
        common = inputs.common
        verifies = any(s.num_spec_tokens for s in sched.scheduled)
        if self.tree is not None and (verifies or self.tree.replays_with_bits(inputs.graph_key)):
            self.tree.prepare(common, self.buffers.positions.gpu, self.state.num_tokens)
        input_ids, positions = (x.gpu[: common.num_tokens] for x in (self.buffers.input_ids, self.buffers.positions))
        graph = None
        if inputs.graph_key is not None:
            graph = self.cuda_graphs.replay(inputs.graph_key, common)  # inputs already padded on the device
            hidden = graph.out
        else:
            hidden = self.forward(input_ids, positions, {b.name: b.build_metadata(common) for b in self.backends})
        greedy_ids = None  # [num_sample_rows] int64, argmax of logits, when the graph computed it
        if graph is not None and graph.logits is not None and inputs.logits_indices is None:
            logits, greedy_ids = graph.logits, graph.greedy_ids  # every token sampled: logits_indices = arange
        elif graph is not None and graph.logits is not None:  # the graph computed every row's logits
            logits = graph.logits[inputs.logits_indices]
        else:  # [num_sample_rows, vocab]
            li = inputs.logits_indices
            logits = self.model.compute_logits(hidden if li is None else hidden[li])

        step = PendingStep(sched, inputs=inputs, logits=logits, t0=t0, verifies=verifies)
        emitted, num_emitted, _, step.batch, step.sampled, packed, step.packed_rows, path = sample_or_verify(
            inputs, sched.scheduled, logits, greedy_ids, input_ids, verifies=step.verifies, state=self.state,
            sampler=self.sampler, draft_probs=self.draft_probs, vocab_size=self.vocab_size,
            accepted=graph.accepted if graph is not None else None, tree=self.tree and self.tree.tree,
            replay=self.acceptance_replay)
        taps = self.taps.values(common.num_tokens) if self.taps is not None else None
        if path is not None:  # a token tree's accepted paths, moved to where a chain's would be
            self.tree.compact(path, inputs, [hidden, *(taps or [])], logits, step.batch)
        self.state.advance(inputs.rows[: common.num_reqs], inputs.delta, emitted, num_emitted)
        if self.proposer is not None:
            step.outcome = StepOutcome(
                requests=[s.request for s in sched.scheduled], input_ids=input_ids, positions=positions,
                query_start_loc_cpu=common.query_start_loc_cpu, hidden_states=hidden,
                aux_hidden_states=taps,
                common=common, tokens=self.state.table(common.request_rows),
                emitted_ids=emitted, num_emitted=num_emitted, greedy_ids=greedy_ids)
            t1 = time.perf_counter()
            step.drafted = self.proposer.propose_on_device(step.outcome) if sched.draft else Drafts([], emitted[:0])
            if step.drafted is not None:
                step.num_proposed = self._write_drafts(step.outcome, step.drafted, sched.max_drafts)
                step.draft_ms = (time.perf_counter() - t1) * 1e3
        # To the host: a plain step's sampled ids (the host knows its counts), a verify step's tokens and counts.
        step.host, step.copied = self._host.start_copy(packed)
        self._latest = step
        return step

    def _write_drafts(self, outcome: StepOutcome, drafts: Drafts, cap: int | None) -> dict[str, int]:
        """The drafts into the token table, at most `cap` per request; request id -> its next step's draft slots."""
        drafts = drafts.capped(cap)
        self.draft_probs.update(drafts.probs)
        if drafts.tree_parents is not None:  # each request's own token tree (a dynamic one)
            rows = outcome.common.request_rows[to_device(drafts.index, torch.int64, drafts.tree_parents.device)]
            self.tree.tree.set_rows(rows.long(), drafts.tree_parents)
        slots = self.state.write_drafts(outcome.common.request_rows, drafts, cap)
        return {outcome.requests[i].request_id: c for i, c in zip(drafts.index, slots, strict=True)}

    def collect(self, step: PendingStep) -> RunnerOutput:
        """Wait for a launched step's tokens; its RunnerOutput."""
        if step.output is not None:
            return step.output
        if step.copied is not None:
            step.copied.synchronize()
        scheduled = step.sched.scheduled
        n = len(scheduled)
        host = step.host.numpy()
        if step.verifies:  # [b * m emitted | b counts | b real drafts], b >= n (a graph's padded requests)
            b = step.packed_rows
            m = (len(host) - 2 * b) // b
            counts, real = host[b * m : b * m + n], host[b * m + b : b * m + b + n].tolist()
            emitted = [row[:c].tolist() for row, c in zip(host[: n * m].reshape(n, m), counts, strict=True)]
        else:  # one sampled id per request that samples
            real, ids, emitted = [0] * n, host.tolist(), [[] for _ in scheduled]
            for i in step.inputs.sampling:
                emitted[i] = [ids[i]]
        logprobs = None
        if step.batch is not None and step.batch.max_num_logprobs is not None:
            if step.verifies:
                logprobs = emitted_logprobs(step.logits, step.inputs.sample_rows, step.batch, emitted)
            else:
                logprobs = [[] for _ in scheduled]
                for i, lp in zip(step.inputs.sampling, step.sampled.logprob_dicts(step.batch), strict=True):
                    logprobs[i] = [lp] if lp is not None else []
        output = RunnerOutput(req_ids=[s.request.request_id for s in scheduled], sampled_token_ids=emitted,
                              logprobs=logprobs, num_draft_tokens=real)
        if self.proposer is None:
            return output
        output.num_proposed, output.draft_ms = step.num_proposed, step.draft_ms
        if step.drafted is None:
            outcome = step.outcome
            outcome.emitted = emitted
            outcome.num_rejected = [s.num_spec_tokens + 1 - len(e) if e else 0 for s, e in zip(scheduled, emitted)]
            t1 = time.perf_counter()
            output.num_proposed = self._write_drafts(outcome, self.proposer.propose(outcome), step.sched.max_drafts)
            output.draft_ms = (time.perf_counter() - t1) * 1e3
        if any(real):  # it verified real drafts (a step of draft slots an n-gram lookup left empty did not)
            output.verify_ms = (time.perf_counter() - step.t0) * 1e3 - (output.draft_ms or 0.0)
        return output
