"""Token-budget scheduling in the style of vLLM v1: no prefill/decode phases, just how many new
tokens each request computes this step.

Invariants (asserted by tests/test_scheduler.py):
- Per step: `sum(num_new_tokens) <= max_num_batched_tokens`, `len(running) <= max_num_seqs`, and
  every scheduled request gets >= 1 token. Running requests come first, in admission order.
- A running request's table covers `num_computed_tokens + num_new_tokens` (+ lookahead) slots.
- `num_computed_tokens` counts tokens whose KV is in the cache and real: after a step it is
  `num_tokens - 1` once the request has emitted (the last sampled token is computed next step).
- With `separate_prefill_tokens`, a short prompt arriving while others decode gets a step of its own (the
  decodes wait one step), so that on a GPU both replay CUDA graphs instead of one eager mixed step.
- `disable_by_batch_size` (vLLM's speculative_config key): a step whose batch, running plus waiting requests, is
  larger than it verifies no drafts (the requests drop theirs and decode one token; the proposer drafts anew after
  the step); `stats().spec_disabled` says so for the step just folded.
- Preemption is by recompute and always takes the newest running request (the last admitted); a
  preempted request keeps its output tokens, frees its blocks and recomputes prompt + outputs. In
  a step that preempts, no waiting request is admitted.
- `finished_req_ids` / `preempted_req_ids` name every request whose runner row must go since the
  previous step (a runner ignores ids it does not hold, e.g. a request aborted while waiting).
- Failure isolation: a request whose tokens fail to fold (`update_from_output`) finishes alone with "error". After
  a step failed elsewhere (`recover`: the engine caught an exception and made the runner forget every request),
  every running request is preempted and becomes a suspect; while there are suspects each step is one of them
  alone, until it emits a token; a suspect that fails alone finishes with "error".

One update path: every launched step N is announced with `assume_launched(N)` and folded back by
`update_from_output(N)`; async scheduling (`LLMEngine` with `async_scheduling`) only launches step N + 1 between
the two. `assume_launched(N)` advances N's requests as if each emitted all it can: one token, or
with d drafts all d + 1 (every draft accepted): `num_computed_tokens` moves on, `num_output_placeholders` counts
the outputs still on the device (their values live only in the runner's device tables, which step N + 1 reads), and
a request that verified d drafts expects d again for its next step (drafted on the device).
`update_from_output(N)` then appends the real tokens, drops the count of rejected drafts (and their computed count)
and checks stops; a request that stopped had step N + 1 compute for nothing, which is dropped. Only known tokens are
hashed for prefix caching. Scheduling ahead never preempts: `can_schedule_ahead` holds only when the free blocks
cover every running request's next step; otherwise the engine collects first. Ahead of a verify step it also
needs the same requests to verify all their drafts again (no admission, room below max_model_len).

Runner contract: a scheduled request computes positions [num_computed_tokens, num_computed_tokens +
num_new_tokens) of its tokens followed by its `num_spec_tokens` drafts (both in the runner's device token table),
reading `request.num_computed_tokens` before `update_from_output`; it emits tokens only when that range reaches its
last token.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from research_lm.api.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from research_lm.engine.kv_cache import KVCacheManager
from research_lm.engine.request import Logprob, Request, RequestStatus
from research_lm.engine.stop_strings import StopStrings

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of non-null blocks in use
    num_preemptions: int  # total since start
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens found computed
    prefix_cache_hit_rate: float
    # The step just folded skipped speculation (disable_by_batch_size). The latest scheduled step's flag: the engine
    # folds it before reading this, except a verify step scheduled ahead (async), which never skips.
    spec_disabled: bool


class Scheduler:
    """Decides, each step, which requests compute how many tokens, and folds the runner's sampled
    tokens back into the requests (stop checks, spec-decode accounting, prefix caching)."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        num_lookahead_tokens: int = 0,
        sliding_window: int | None = None,
        stop_strings: StopStrings | None = None,
        separate_prefill_tokens: int = 0,
        disable_by_batch_size: int | None = None,
    ) -> None:
        """`num_lookahead_tokens`: extra slots a proposer writes past the verified tokens (EAGLE).
        `sliding_window`: free blocks out of the window; only when every layer uses that window.
        `stop_strings`: checks `SamplingParams.stop` (needs the tokenizer); None: requests may not set it.
        `separate_prefill_tokens`: a waiting prompt with at most this many tokens to compute, arriving while
        others decode, is admitted alone in a step of its own (the decodes resume next step) instead of
        joining theirs; 0: it joins them (`_schedule_alone`).
        `disable_by_batch_size`: a step whose running plus waiting requests outnumber it verifies no drafts; None:
        every step may."""
        if kv_cache.max_num_tokens < max_model_len + num_lookahead_tokens:
            raise ValueError(
                f"the KV cache holds {kv_cache.max_num_tokens} tokens ({kv_cache.num_blocks - 1} blocks of "
                f"{kv_cache.block_size}), fewer than max_model_len={max_model_len} + "
                f"{num_lookahead_tokens} lookahead: lower max_model_len or give the cache more memory"
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                f"max_model_len ({max_model_len}), or a long prompt never fits a step"
            )
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_lookahead_tokens = num_lookahead_tokens
        self.sliding_window = sliding_window
        self.stop_strings = stop_strings
        self.separate_prefill_tokens = separate_prefill_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.spec_disabled = False  # the latest scheduled step skipped speculation (`SchedulerStats.spec_disabled`)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0
        self._finished_since_schedule: set[str] = set()
        # Requests of a failed step not yet cleared, by id in admission order (`recover`), and the one the latest
        # step ran alone: it is the culprit if that step fails.
        self.suspects: dict[str, Request] = {}
        self._isolating: Request | None = None

    # ---- queue API ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if not 0 < request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {request.num_prompt_tokens} tokens, "
                f"must be 1..max_model_len ({self.max_model_len})"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str, finish_reason: str = "abort") -> Request | None:
        """Finish an unfinished request with `finish_reason` ("abort", or "error" when it failed
        alone); returns it, or None if unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, finish_reason)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> SchedulerStats:
        pc = self.kv_cache.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            prefix_cache_hit_rate=pc.hit_rate,
            spec_disabled=self.spec_disabled,
        )

    # ---- schedule ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step's batch: running requests first, then admissions (none if anyone was preempted)."""
        out = SchedulerOutput(scheduled=[], finished_req_ids=self._finished_since_schedule)
        self._finished_since_schedule = set()
        self.spec_disabled = self._speculation_disabled()
        if self.spec_disabled:
            for request in self.running:  # none verified this step (the proposer drafts again after it)
                request.num_spec_tokens = 0
        if self.suspects:
            self._schedule_isolated(out)
            return out
        if self._schedule_alone(out):
            return out
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_isolated(self, out: SchedulerOutput) -> None:
        """The first suspect alone (`recover`): the other running requests skip the step, and the newest of them
        are preempted while it lacks a seat or blocks."""
        request = self._isolating = next(iter(self.suspects.values()))
        while True:
            if request.status == RequestStatus.RUNNING:  # a prompt it recomputes in chunks, or after its first step
                num_new, drafts = self._num_new_tokens_running(request, self.max_num_batched_tokens)
                block_ids = self.kv_cache.allocate_slots(request, num_new,
                                                         num_lookahead_tokens=self.num_lookahead_tokens)
                if block_ids is not None:
                    request.num_spec_tokens = drafts
                    out.scheduled.append(ScheduledRequest(request, num_new, block_ids, drafts))
                    return
            elif len(self.running) < self.max_num_seqs:
                self.waiting.remove(request)
                self.waiting.appendleft(request)  # `_admit` takes the first waiting request
                hit_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
                num_new = min(request.num_tokens - num_hit, self.max_num_batched_tokens)
                if self._admit(request, hit_blocks, num_hit, num_new, out):
                    return
            victim = next(r for r in reversed(self.running) if r is not request)
            self.running.remove(victim)
            self._preempt(victim, out)

    def _schedule_alone(self, out: SchedulerOutput) -> bool:
        """Admit the first waiting request alone when every running request is decoding and its prompt has at
        most `separate_prefill_tokens` to compute. Why: on a GPU a step mixing a prompt with decodes runs
        eagerly (tens of ms at a small batch), while the prompt alone replays a prefill graph and the decodes
        theirs (~1 ms each); a prompt too long for a prefill graph is eager anyway, and joins the decodes."""
        if not (self.separate_prefill_tokens and self.waiting and self.running
                and len(self.running) < self.max_num_seqs):
            return False
        if any(r.num_tokens - r.num_computed_tokens > 1 for r in self.running):
            return False  # a chunked prompt is still running: admissions ride along with it
        request = self.waiting[0]
        hit_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit
        if num_new > min(self.separate_prefill_tokens, self.max_num_batched_tokens):
            return False
        return self._admit(request, hit_blocks, num_hit, num_new, out)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes (and unfinished prefill chunks) first, in admission order; preempt the newest
        running request until an allocation fits. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self.sliding_window is not None:
                self.kv_cache.free_blocks_outside_window(request, self.sliding_window)
            num_new, drafts = self._num_new_tokens_running(request, budget)
            if num_new == 0:  # async: its in-flight token is its last (max_tokens / max_model_len)
                i += 1
                continue
            block_ids = self._allocate_or_preempt(request, num_new, out)
            if block_ids is None:  # the request itself was the newest: it was preempted
                break
            request.num_spec_tokens = drafts
            out.scheduled.append(ScheduledRequest(request, num_new, block_ids, drafts))
            budget -= num_new
            i += 1
        return budget

    def _num_new_tokens_running(self, request: Request, budget: int) -> tuple[int, int]:
        """Tokens to compute for a running request and how many of its drafts are among them (the first ones).

        Drafts are trimmed only where their positions would pass max_model_len (k drafts emit up to k + 1
        tokens). Near max_tokens a request still verifies all of them and the stop check drops what lies
        past it: the step's requests keep one query length, so the step keeps its CUDA graph paths (the
        uniform inputs, drafting behind the verify forward), for at most k tokens of wasted rows."""
        num_tokens, num_computed = request.num_tokens, request.num_computed_tokens
        room = self.max_model_len - num_tokens
        max_tokens = request.sampling_params.max_tokens
        at_limit = room <= 0 or (max_tokens is not None and request.num_output_tokens >= max_tokens)
        if at_limit and request.num_output_placeholders and not request.num_spec_tokens:
            return 0, 0  # async: its in-flight token is its last (in-flight drafts may be rejected: no such rule)
        if not request.num_spec_tokens:  # the common case: no drafts
            num_new = min(num_tokens - num_computed, budget)
            assert num_new > 0, f"running request {request.request_id!r} has nothing to compute"
            return num_new, 0
        drafts = min(request.num_spec_tokens, max(0, room - 1))
        num_new = min(num_tokens + drafts - num_computed, budget)
        assert num_new > 0, f"running request {request.request_id!r} has nothing to compute"
        return num_new, min(drafts, max(0, num_computed + num_new - num_tokens))

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> list[int] | None:
        """Allocate for a running request, preempting the newest running requests while that fails.
        Returns None when `request` itself had to be preempted."""
        while True:
            block_ids = self.kv_cache.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if block_ids is not None:
                return block_ids
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return None

    def _preempt(self, request: Request, out: SchedulerOutput | None) -> None:
        """Back to the front of the queue, to recompute; `out` None: a rollback (`recover`), the runner is reset."""
        request.num_output_placeholders = 0  # outputs in flight will never be its tokens
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_spec_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        if out is not None:
            out.preempted_req_ids.add(request.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests FIFO (preempted ones sit at the front) while seats, budget and
        blocks last; the first that does not fit stops admission."""
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            request = self.waiting[0]
            hit_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self._admit(request, hit_blocks, num_hit, num_new, out):
                break
            budget -= num_new

    def _admit(self, request: Request, hit_blocks: list, num_hit: int, num_new: int, out: SchedulerOutput) -> bool:
        """Move the first waiting request to running with `num_new` tokens to compute this step, if its blocks
        can be allocated."""
        block_ids = self.kv_cache.allocate_slots(
            request, num_new, hit_blocks, num_lookahead_tokens=self.num_lookahead_tokens
        )
        if block_ids is None:
            return False
        self.waiting.popleft()
        self.kv_cache.prefix_cache_stats.record(request.num_tokens, num_hit)
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new, block_ids))
        return True

    def _speculation_disabled(self) -> bool:
        """vLLM's disable_by_batch_size: this step's batch, running plus waiting requests, is larger than it."""
        limit = self.disable_by_batch_size
        return limit is not None and len(self.running) + len(self.waiting) > limit

    # ---- async scheduling --------------------------------------------------------------------
    def can_schedule_ahead(self, verifying: SchedulerOutput | None = None) -> bool:
        """Whether the next step may be scheduled before the running step's tokens are known: the free blocks
        cover every running request's next step, so scheduling cannot preempt. `verifying`: the running step is
        a verify step whose drafting left the next inputs on the device; the next step must then be its requests
        again, each verifying all its drafts: nobody else running, no admission, no step skipping speculation
        (disable_by_batch_size), and room below max_model_len for the drafts and for what the next step emits
        (drafting reads the room before it is known)."""
        if self.suspects:  # one step at a time while isolating: a failure is then the isolated request's
            return False
        if verifying is not None:
            ids = {s.request.request_id for s in verifying.scheduled}
            if self.waiting and len(self.running) < self.max_num_seqs or self._speculation_disabled():
                return False
            if any(r.request_id not in ids or r.num_tokens + 2 * (r.num_spec_tokens + 1) > self.max_model_len
                   for r in self.running):
                return False
        bs, need = self.kv_cache.block_size, 0
        for r in self.running:
            n = min(r.num_tokens - r.num_computed_tokens + r.num_spec_tokens, self.max_num_batched_tokens)
            slots = r.num_computed_tokens + n + self.num_lookahead_tokens
            need += max(0, -(-slots // bs) - self.kv_cache.num_blocks_of(r.request_id))
        return need <= self.kv_cache.num_free_blocks

    def assume_launched(self, scheduler_output: SchedulerOutput, num_proposed: dict[str, int] | None = None) -> None:
        """Advance the requests of a launched step before its tokens are known: the scheduled tokens count
        as computed, and a request whose chunk reaches its last token counts an output in flight for each token it
        may emit (its drafts + 1) and expects drafts for its next step: `num_proposed` (the proposer drafted at
        launch, on the device: request id -> its draft slots), else as many as it verified."""
        scheduler_output.assumed = True
        for sched in scheduler_output.scheduled:
            request = sched.request
            request.num_computed_tokens += sched.num_new_tokens
            if request.num_computed_tokens >= request.num_tokens:
                request.num_output_placeholders += sched.num_spec_tokens + 1
                request.num_spec_tokens = (sched.num_spec_tokens if num_proposed is None
                                           else num_proposed.get(request.request_id, 0))

    # ---- update ------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[Request]:
        """Fold one step's results into the requests; returns the requests that finished. A step the engine did not
        announce with `assume_launched` (a caller driving the scheduler by hand) is assumed here first: one path."""
        if not scheduler_output.assumed:
            self.assume_launched(scheduler_output)
        row = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        finished = []
        for sched in scheduler_output.scheduled:
            request = sched.request
            i = row[request.request_id]
            if request.status != RequestStatus.RUNNING:  # finished or aborted while the step ran
                runner_output.sampled_token_ids[i] = []  # computed for nothing: not an output token
                continue
            logprobs = runner_output.logprobs[i] if runner_output.logprobs is not None else None
            sampled = runner_output.sampled_token_ids[i]
            num_drafts = runner_output.num_draft_tokens[i] if runner_output.num_draft_tokens else sched.num_spec_tokens
            try:
                self._resolve(request, sched, sampled, logprobs, num_drafts)
                if request.finish_reason is None:
                    self.kv_cache.cache_blocks(request, request.num_computed_tokens)
            except Exception as e:  # e.g. detokenizing for its stop strings: its own tokens, so it alone fails
                request.finish_reason, request.error = "error", f"{type(e).__name__}: {e}"
                logger.warning("request %r failed and finishes with error: %s", request.request_id, request.error,
                               exc_info=e)
            if request is self._isolating and (sampled or request.finish_reason is not None):
                self.suspects.pop(request.request_id)  # it ran a whole step alone: cleared
            if request.finish_reason is not None:
                finished.append(request)
                continue
            if not request.num_output_placeholders:  # no later step in flight: its next drafts are this step's
                request.num_spec_tokens = runner_output.num_proposed.get(request.request_id, 0)
        self._isolating = None  # its step completed (only one step runs at a time while isolating)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for request in finished:
                self._finish(request, request.finish_reason)
        return finished

    def recover(self, error: str) -> list[Request]:
        """Roll back after a step failed anywhere from `schedule` to the runner's output (the engine made the
        runner forget every request and every step in flight): every running request is preempted, to recompute
        from its known tokens. If the failed step ran a suspect alone, that request is the culprit: it finishes
        with "error" and the message `error`, and is returned. Otherwise the running requests (the first waiting
        one if none runs: the scheduling of it may have failed) become suspects, each run alone until it emits a
        token (`_schedule_isolated`): the culprit fails again alone, the others go on with the tokens they would
        have had. Every round of isolation emits a token for each suspect, so even failures no request causes
        alone end (at max_tokens at the latest)."""
        culprit, self._isolating = self._isolating, None
        suspects = list(self.running) or list(self.waiting)[:1]
        for request in reversed(self.running):  # newest first: they queue again in admission order
            self._preempt(request, None)
        self.running = []
        if culprit is None:
            self.suspects.update((r.request_id, r) for r in suspects)
            return []
        if culprit.is_finished:  # aborted while its step ran
            return []
        self.waiting.remove(culprit)
        culprit.error = error
        self._finish(culprit, "error")
        return [culprit]

    def _resolve(self, request: Request, sched: ScheduledRequest, sampled: list[int],
                 logprobs: list[dict[int, Logprob]] | None, num_drafts: int) -> None:
        """Append a step's collected tokens in place of the outputs it counted in flight at launch (its drafts + 1),
        drop the count of the rest with the computed count of its rejected drafts, and check stops. num_drafts: the
        real drafts among its draft slots (a drafter on the device may fill fewer than it was given)."""
        if not sampled:  # a prompt chunk that did not reach the end
            return
        assumed = sched.num_spec_tokens + 1
        assert 1 <= len(sampled) <= assumed, f"{len(sampled)} tokens for {assumed - 1} drafts"
        first = len(request.output_token_ids)  # the oldest output in flight: steps are collected in order
        request.output_token_ids += sampled
        request.num_output_placeholders -= assumed
        request.num_computed_tokens -= assumed - len(sampled)
        self._emitted(request, num_drafts, sampled, logprobs, first)

    def _emitted(self, request: Request, num_drafts: int, sampled: list[int],
                 logprobs: list[dict[int, Logprob]] | None, first: int) -> None:
        """A step's emitted tokens, now the request's outputs first .. first + len(sampled) - 1: acceptance counts,
        logprobs, the first token's time, stops. A stop drops every output after it: the step's later tokens and
        (async scheduling) the outputs counted for a step in flight, which computed for nothing."""
        if num_drafts:
            request.num_draft_tokens += num_drafts
            request.num_accepted_tokens += len(sampled) - 1
        for u, token in enumerate(sampled):
            if logprobs:  # [] where this request asked for none while another in the step did
                request.output_logprobs.append(logprobs[u])
            if request.first_token_time is None:
                request.first_token_time = time.perf_counter()
            reason = self._check_stop(request, token, first + u + 1)
            if reason is not None:
                request.finish_reason = reason
                del request.output_token_ids[first + u + 1 :]
                request.num_output_placeholders = 0
                break
        # After a stop inside accepted drafts, computed KV past the last kept token is moot.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)

    def _check_stop(self, request: Request, token: int, num_output: int) -> str | None:
        """Whether `token`, the request's output number `num_output`, stops it."""
        params = request.sampling_params
        if num_output >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return "stop"
            if token in params.stop_token_ids:
                request.stop_reason = token
                return "stop"
        if params.stop and (stop := self.stop_strings.check(request, num_output)) is not None:
            request.stop_reason = stop
            return "stop"
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return "length"
        if request.num_prompt_tokens + num_output >= self.max_model_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> None:
        """Release a request already removed from `waiting` / `running`."""
        request.num_output_placeholders = 0  # outputs in flight will never be its tokens
        if request.status == RequestStatus.RUNNING and reason != "error":  # a failed step's KV is not trusted
            self.kv_cache.cache_blocks(request, request.num_computed_tokens)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.perf_counter()
        request.num_spec_tokens = 0
        self.requests.pop(request.request_id, None)
        self.suspects.pop(request.request_id, None)
        self._finished_since_schedule.add(request.request_id)

