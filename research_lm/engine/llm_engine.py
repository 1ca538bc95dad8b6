"""The engine: requests in, `RequestOutput`s out; owns scheduler, KV cache manager and runner."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from research_lm import ops
from research_lm.api.config import EngineConfig
from research_lm.api.outputs import CompletionOutput, RequestMetrics, RequestOutput
from research_lm.api.sampling_params import SamplingParams
from research_lm.engine.distributed import setup_ranks, sharded_experts
from research_lm.engine.kv_cache import KVCacheManager
from research_lm.engine.memory import num_kv_blocks, profile_peak_activation_bytes
from research_lm.engine.metrics import EngineMetrics
from research_lm.engine.request import Request, RequestStatus
from research_lm.engine.scheduler import Scheduler
from research_lm.engine.spec_policy import build_policy
from research_lm.engine.stop_strings import StopStrings
from research_lm.eplb.controller import build_eplb_controller
from research_lm.models.loader import load_config, load_model, load_tokenizer, resolve_model_path
from research_lm.ops import set_batch_invariant, set_fused_ops, set_skinny_rows
from research_lm.worker.acceptance_replay import AcceptanceReplay, load_profile
from research_lm.worker.pending_step import PendingStep
from research_lm.worker.rng import mix_seed
from research_lm.worker.runner import ModelRunner
from research_lm.worker.spec import DraftTarget, build_proposer

_SEED_STREAM = 7  # derives per-request seeds from the engine seed
logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    path: str
    vocab_size: int
    eos_token_id: int | None
    max_model_len: int
    dtype: torch.dtype
    device: torch.device


class LLMEngine:
    def __init__(self, config: EngineConfig):
        device = config.resolve_device()
        self.config = config = config.for_device(device)
        if config.host_threads is not None:
            torch.set_num_threads(config.host_threads)
        # tensor_parallel_size > 1 or eplb.expert_parallel, under torchrun
        self.ranks = setup_ranks(config.tensor_parallel_size, config.eplb_config, device, config.distributed_timeout_s)
        extra, eplb_config, tp = config.model_extra(), config.eplb_config, None
        if self.ranks is not None:  # a MoE model's experts shard over the ranks (EP); under TP every layer does
            device, extra["ep_group"], tp = self.ranks.device, self.ranks.group, self.ranks.tp
            if tp is not None:
                extra["eplb"] = sharded_experts(eplb_config, tp.size)
                eplb_config = extra["eplb"] if eplb_config is not None else None  # the controller's view of it
        path = resolve_model_path(config.model)
        hf_config = load_config(path, trust_remote_code=config.trust_remote_code)
        dtype = config.resolve_dtype(getattr(hf_config, "dtype", None), device)
        torch.manual_seed(config.seed)
        self.model, self.hf_config = load_model(
            path, device=device, dtype=dtype, attention_backend=config.attention_backend,
            trust_remote_code=config.trust_remote_code, extra=extra, load_format=config.load_format, tp=tp,
        )
        self.tokenizer = load_tokenizer(config.tokenizer or path)
        max_len = config.max_model_len or getattr(self.hf_config, "max_position_embeddings", 2048)
        self.info = ModelInfo(
            path=str(path), vocab_size=self.hf_config.vocab_size, eos_token_id=self._eos_token_id(),
            max_model_len=max_len, dtype=dtype, device=device,
        )
        proposer = None
        # The drafter is replicated: built without `tp`, it holds whole weights on every rank (where it reads the
        # target's embedding or LM head, their collectives run on every rank alike)
        if config.speculative_config:
            target = DraftTarget(
                device=device, dtype=dtype, vocab_size=self.info.vocab_size, hidden_size=self.hf_config.hidden_size,
                num_hidden_layers=self.hf_config.num_hidden_layers, max_model_len=max_len,
                attention_backend=config.attention_backend, model_extra={**config.model_extra(), "eplb": None},
                trust_remote_code=config.trust_remote_code, embed_tokens=self.model.get_input_embeddings(),
                compute_logits=self.model.compute_logits, model_path=path)
            proposer = build_proposer(dict(config.speculative_config), target)
        models = (self.model, *(proposer.drafters() if proposer else []))
        for module in models:  # fused_ops, skinny_rows and batch_invariant reach the drafter too
            set_fused_ops(module, config.fused_ops)
            set_skinny_rows(module, config.skinny_rows)
            set_batch_invariant(module, config.batch_invariant)
        if config.batch_invariant and device.type in ops.FUSED_DEVICE_TYPES:  # on CPU the switch changes nothing
            from research_lm.ops.batch_invariant import check_batch_invariant

            check_batch_invariant(models)
        self.acceptance_replay = self._acceptance_replay(proposer, device)
        self.runner = ModelRunner(
            self.model, device=device, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_len,
            vocab_size=self.info.vocab_size, proposer=proposer, compile=config.compile,
            acceptance_replay=self.acceptance_replay,
        )
        # Per-request state (Mamba) summarizes the whole prefix: cached KV blocks cannot restore it, and
        # rejected draft tokens cannot be taken back out of it. Prefix caching goes off, drafting is refused.
        has_state = self.runner.state_bytes(dtype) > 0
        if has_state and proposer is not None:
            raise ValueError("speculative decoding is not supported for models with Mamba (per-request state) layers")
        if has_state and config.enable_prefix_caching:
            logger.warning("prefix caching is disabled: this model has Mamba layers, whose per-request state "
                           "a cached prefix cannot restore (pass enable_prefix_caching=False to silence this)")
        self.num_blocks = self._size_kv_cache()
        if self.ranks is not None:  # the ranks' schedules must match: the same KV budget everywhere
            self.num_blocks = self.ranks.agree_min(self.num_blocks)
        self.runner.allocate_kv_cache(self.num_blocks, dtype)
        # what "auto" chose: layer kind -> backend name (the drafter's layers included)
        self.backends = {layer.spec.kind: layer.backend.name for layer in self.runner.cache_layers}
        logger.info("attention backends: %s", self.backends)
        capture = config.cuda_graphs and device.type == "cuda"  # CPU runs are always eager
        if capture and (reason := self.runner.capture_cuda_graphs(config.cuda_graph_sizes, config.prefill_graph_sizes)):
            logger.warning("CUDA graphs are off: %s; every step runs eagerly", reason)
        # after the KV sizing (its profiling forward must not count as expert load)
        self.eplb = build_eplb_controller(self.model, eplb_config)
        self.kv_cache = KVCacheManager(
            self.num_blocks, config.block_size, config.enable_prefix_caching and not has_state,
            recompute_last_hit_block=proposer is not None and proposer.needs_last_hit_block_recomputed,
        )
        self.scheduler = Scheduler(
            self.kv_cache, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_lookahead_tokens=proposer.num_lookahead_tokens if proposer is not None else 0,
            sliding_window=self._shared_sliding_window(),
            stop_strings=StopStrings(self.tokenizer) if self.tokenizer is not None else None,
            separate_prefill_tokens=self._separate_prefill_tokens(config.separate_prefills),
            disable_by_batch_size=(config.speculative_config or {}).get("disable_by_batch_size"),
        )
        k = proposer.num_speculative_tokens if proposer is not None else 0
        tree = proposer.token_tree if proposer is not None else None
        self.spec_policy = build_policy((config.speculative_config or {}).get("speculation_policy"), k,
                                        distributed=self.ranks is not None, depth=tree.depth if tree else None)
        self._draft_cap = k  # the cap of the drafts the last launched step wrote: the next step verifies under it
        self.async_scheduling = self._resolve_async_scheduling(config.async_scheduling, device)
        self._in_flight: PendingStep | None = None  # async scheduling: the launched, uncollected step
        self.metrics = EngineMetrics()
        self._ids = itertools.count()
        self._rejected: list[Request] = []  # failed validation: reported at the next step
        self._prompt_text: dict[str, str] = {}  # request id -> the prompt string, when one was given

    def _acceptance_replay(self, proposer, device: torch.device) -> AcceptanceReplay | None:
        """The replay of `acceptance_replay`'s profile (a chain's k drafts at most), announced in the log."""
        if self.config.acceptance_replay is None:
            return None
        if proposer.token_tree is not None:
            raise ValueError("acceptance_replay replays chains only: drop the token tree (speculative_token_tree, "
                             "topk, suffix_decoding_tree) or the replay")
        replay = AcceptanceReplay(load_profile(self.config.acceptance_replay), proposer.num_speculative_tokens, device,
                                  self.config.max_num_seqs, echo=self.config.acceptance_replay_echo)
        logger.warning("acceptance is replayed from %r: verify steps keep the profile's draft counts, so the outputs "
                       "are not the model's; only timing and counts mean anything", replay.source)
        return replay

    def _resolve_async_scheduling(self, asked: bool | None, device: torch.device) -> bool:
        """Expert parallelism alone runs synchronously; tensor parallelism launches ahead too (the ranks agree on
        rank 0's output of each step when it is collected, over a gloo group that does not wait on the device)."""
        expert_parallel_only = self.ranks is not None and self.ranks.tp is None
        if asked and expert_parallel_only:
            raise ValueError("async_scheduling=True does not combine with expert parallelism (rank 0's tokens are "
                             "broadcast every step); leave it unset or False")
        return not expert_parallel_only and (asked if asked is not None else device.type == "cuda")

    def _separate_prefill_tokens(self, asked: bool | None) -> int:
        """The scheduler's `separate_prefill_tokens`: the longest captured prefill graph (None: only where there
        is one; True: else any prompt within the step budget, to ablate the policy eagerly), 0 when off."""
        graphs = self.runner.cuda_graphs
        longest = max(graphs.prefill, default=0) if graphs is not None else 0
        if asked is None:
            return longest
        return (longest or self.config.max_num_batched_tokens) if asked else 0

    def _shared_sliding_window(self) -> int | None:
        """The window, if every layer reading the block table uses the same one: then blocks that fall
        wholly out of it go back to the pool (the drafter's layers count: they share the table)."""
        windows = {layer.spec.sliding_window if layer.spec.kind == "attention" else -1
                   for layer in self.runner.cache_layers}
        window = windows.pop() if len(windows) == 1 else None
        return window if window is not None and window > 0 else None

    def _eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
        return eos[0] if isinstance(eos, list | tuple) else eos

    def _size_kv_cache(self) -> int:
        c, info = self.config, self.info
        activation = 0
        if info.device.type == "cuda" and c.num_gpu_blocks is None:
            activation = profile_peak_activation_bytes(self._dummy_forward)
        return num_kv_blocks(
            page_size_bytes=self.runner.page_size_bytes(info.dtype), device=info.device,
            gpu_memory_utilization=c.gpu_memory_utilization, num_gpu_blocks=c.num_gpu_blocks,
            max_num_seqs=c.max_num_seqs, max_model_len=info.max_model_len, block_size=c.block_size,
            activation_bytes=activation, state_bytes=self.runner.state_bytes(info.dtype),
            num_lookahead_tokens=self.runner.proposer.num_lookahead_tokens if self.runner.proposer else 0,
        )

    def _dummy_forward(self) -> None:
        """One prefill of max_num_batched_tokens on a scratch cache, to measure peak activations."""
        from research_lm.api.outputs import ScheduledRequest, SchedulerOutput

        c = self.config
        n = min(c.max_num_batched_tokens, self.info.max_model_len)
        blocks = -(-n // c.block_size)
        self.runner.allocate_kv_cache(blocks + 1, self.info.dtype)
        req = Request("profile", [0] * n, SamplingParams(temperature=0.0, max_tokens=1), seed=0)
        for sched in (SchedulerOutput([ScheduledRequest(req, n, list(range(1, blocks + 1)))]),
                      SchedulerOutput([], finished_req_ids={"profile"})):
            self.runner.collect(self.runner.launch(sched))
        self.runner.allocate_kv_cache(0, self.info.dtype)

    # ---- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """Queue one request. A request that fails validation is reported as an error output alone."""
        index = next(self._ids)
        seed = params.seed if params.seed is not None else mix_seed(self.config.seed, index, _SEED_STREAM)
        req = Request(
            request_id=request_id or str(index), prompt_token_ids=[], sampling_params=params, seed=seed,
            eos_token_id=self.info.eos_token_id, arrival_time=time.perf_counter(),
        )
        if isinstance(prompt, str):
            self._prompt_text[req.request_id] = prompt
        try:
            req.prompt_token_ids = self.tokenize(prompt)
            self._validate_prompt(req.prompt_token_ids)
            if params.n != 1:
                raise ValueError(f"SamplingParams.n={params.n}: the engine takes one completion per request; "
                                 "LLM.generate runs n > 1 as n requests (SamplingParams.children)")
            if bad := [t for t in params.token_ids_used() if t >= self.info.vocab_size]:
                raise ValueError(f"SamplingParams.logit_bias / allowed_token_ids name token ids {bad[:5]} outside "
                                 f"the vocabulary [0, {self.info.vocab_size})")
            if params.stop and self.tokenizer is None:
                raise ValueError("SamplingParams.stop needs a tokenizer and this model has none; use stop_token_ids")
        except ValueError as e:
            req.status, req.finish_reason, req.error = RequestStatus.FINISHED, "error", str(e)
            req.finish_time = req.arrival_time
            self._rejected.append(req)
            return req
        self.scheduler.add_request(req)
        return req

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.info.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, longer than max_model_len={self.info.max_model_len}"
            )
        bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.info.vocab_size})")

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, update requests; return the requests that finished.

        A host-side exception in the step fails only the requests it concerns (`_recover`); CUDA errors, which
        poison the context, are out of reach."""
        finished, self._rejected = self._rejected, []
        try:
            finished += self._step()
        except Exception as e:
            if self.ranks is not None:  # the ranks keep one schedule: a recovery on one rank alone would split them
                raise
            finished += self._recover(e)
        outputs = [self._output(r) for r in finished]
        self.metrics.record_finished(outputs)
        return outputs

    def _recover(self, error: Exception) -> list[Request]:
        """After a step failed: drop the step in flight, make the runner forget every request (`ModelRunner.reset`)
        and let the scheduler roll the requests back and find the culprit by running each suspect alone
        (`Scheduler.recover`). Returns the requests that failed: finished with "error" and the message."""
        message = f"{type(error).__name__}: {error}"
        self._in_flight = None
        self.runner.reset()
        failed = self.scheduler.recover(message)
        self.metrics.num_failed_steps += 1
        if failed:
            logger.warning("request %r failed in a step of its own and finishes with error: %s",
                           failed[0].request_id, message, exc_info=error)
        else:
            logger.warning("a step failed (%s): its requests recompute, each alone first, to find the one that fails",
                           message)
        return failed

    def _output(self, req: Request) -> RequestOutput:
        """`make_output`, or where that fails (e.g. its tokens do not detokenize) the request's error output."""
        try:
            return self.make_output(req)
        except Exception as e:
            req.finish_reason, req.error, req.output_text = "error", f"{type(e).__name__}: {e}", ""
            logger.warning("request %r failed and finishes with error: %s", req.request_id, req.error, exc_info=e)
            return self.make_output(req)

    def _step(self) -> list[Request]:
        """One step protocol: launch a step (unless one is in flight), optionally launch the next, then collect.
        With async scheduling the host's scheduling and input preparation of step N + 1 run while the device
        computes step N; nothing is scheduled ahead when that could preempt or needs token values
        (`_can_launch_ahead`): then this step only collects, and the next one starts from a fully known state.
        Synchronous execution (and expert parallelism) is the same path with no look-ahead."""
        t0 = time.perf_counter()
        if self._in_flight is None:
            if not self.scheduler.has_unfinished_requests():
                return []
            self._in_flight = self._launch()
        collecting, self._in_flight = self._in_flight, None
        if self.async_scheduling and self._can_launch_ahead(collecting):
            ahead = self._launch()
            self._in_flight = ahead if ahead.sched.scheduled else None  # an empty step ran whole in launch
        out = self.runner.collect(collecting)
        if self.ranks is not None:  # rank 0's tokens: the ranks' schedules cannot drift apart
            out = self.ranks.from_rank0(out)
        finished = self.scheduler.update_from_output(collecting.sched, out)
        seconds = time.perf_counter() - t0
        self.metrics.record_step(collecting.sched, out, self.scheduler.stats(), seconds)
        scheduled = collecting.sched.scheduled
        if self.spec_policy.measures and scheduled and all(s.num_new_tokens == s.num_spec_tokens + 1
                                                           for s in scheduled):  # decoding alone
            arm = collecting.sched.verify_cap if collecting.verifies else 0
            drafting = (out.draft_ms or 0.0) / 1e3  # (for the next step, under this step's cap)
            self.spec_policy.record(len(scheduled), arm, sum(map(len, out.sampled_token_ids)), seconds - drafting)
            self.spec_policy.charge(len(scheduled), collecting.sched.max_drafts, drafting)
        return finished

    def _can_launch_ahead(self, step: PendingStep) -> bool:
        """When the runner's step left the host nothing to do first (`ModelRunner.continues_on_device`) and
        scheduling cannot preempt; with a proposer, the scheduler's rules for a step ahead of verification too."""
        if not self.scheduler.has_unfinished_requests() or not self.runner.continues_on_device(step):
            return False
        proposer = self.runner.proposer
        cap = step.sched.max_drafts
        if step.verifies and cap is not None and cap < proposer.num_speculative_tokens:
            # the next step verifies capped drafts (eagerly) and drafts at collect, from host counts this step's
            # acceptance may still change (a negative entry length followed: session 31's failed adaptive steps)
            return False
        drafts_pending = proposer is not None and (step.verifies or step.num_proposed)
        return self.scheduler.can_schedule_ahead(step.sched if drafts_pending else None)

    def _launch(self) -> PendingStep:
        sched = self.scheduler.schedule()
        cap = self.spec_policy.choose(len(sched.scheduled))
        sched.draft, sched.max_drafts, sched.verify_cap = cap != 0, cap, self._draft_cap
        if self.runner.proposer is not None:
            self._draft_cap = self.runner.proposer.num_speculative_tokens if cap is None else cap
        pending = self.runner.launch(sched)
        if self.eplb is not None:
            self.eplb.step()
        self.scheduler.assume_launched(sched, pending.num_proposed)
        return pending

    def make_output(self, req: Request) -> RequestOutput:
        text = ""
        if req.output_text is not None:  # a stop string ended it: the text stops before it
            text = req.output_text
        elif self.tokenizer is not None and req.output_token_ids:
            skip = req.sampling_params.skip_special_tokens
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=skip)
        logprobs = req.output_logprobs if req.sampling_params.logprobs is not None else None
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids), finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=None if logprobs is None else sum(
                lp[t].logprob for t, lp in zip(req.output_token_ids, logprobs, strict=True)),
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time, first_token_time=req.first_token_time,
            finish_time=req.finish_time, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens, num_cached_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions, num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
        )
        return RequestOutput(
            request_id=req.request_id, prompt=self._prompt_text.pop(req.request_id, None),
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=[completion], finished=True, metrics=metrics, error=req.error,
            acceptance_replayed=self.acceptance_replay.source if self.acceptance_replay is not None else None,
        )
