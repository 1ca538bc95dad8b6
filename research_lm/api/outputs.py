"""What flows between scheduler, runner and engine each step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from research_lm.engine.request import Logprob, Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, drafts included
    block_ids: list[int]  # the request's whole block table after this step's allocation
    num_spec_tokens: int = 0  # draft slots verified this step (its last tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # running requests first, then newly admitted ones
    finished_req_ids: set[str] = field(default_factory=set)  # left since last step: drop their rows
    preempted_req_ids: set[str] = field(default_factory=set)  # preempted: drop rows, reset state
    assumed: bool = False  # async scheduling: requests advanced at launch (`Scheduler.assume_launched`)
    draft: bool = True  # whether the proposer drafts for the next step (the engine's speculation policy)
    max_drafts: int | None = None  # the policy's cap on each request's drafts for the next step; None: all k
    verify_cap: int = 0  # the cap the drafts this step verifies were written under (the policy's bookkeeping)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class RunnerOutput:
    req_ids: list[str]  # the scheduled requests, in batch order
    # Tokens each request emits this step: [] for a prefill chunk that does not reach the end of
    # the known tokens, [t] for plain decoding, up to k+1 for verified drafts.
    sampled_token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob]]] | None = None  # per request, per emitted token
    num_draft_tokens: list[int] | None = None  # real drafts verified per request this step
    num_proposed: dict[str, int] = field(default_factory=dict)  # request id -> draft slots for its next step
    # Host wall time of the step's two speculative phases (None when the phase did not run): verify =
    # input prep + target forward + rejection sampling of a step whose batch verified drafts, up to the
    # `.tolist()` of the emitted tokens (a deferred verify step under async scheduling: from its launch to its
    # verification in `collect`, the next step's launch included); draft = the proposer's `propose` call.
    verify_ms: float | None = None
    draft_ms: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # sum of the emitted tokens' logprobs, when logprobs were asked


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # why this request failed alone (e.g. prompt longer than max_model_len)
    # The profile's source where the engine replays acceptance (EngineConfig.acceptance_replay): then the tokens are
    # not the model's output, only their count and timing mean anything
    acceptance_replayed: str | None = None


def merge_completions(children: list[RequestOutput]) -> RequestOutput:
    """One prompt's n parallel-sampling children as vLLM returns them: one RequestOutput whose outputs are the
    children's completions (index 0 .. n-1); metrics over all of them (first token first, finish last, token
    and draft counts summed); the first child's error, if any."""
    first = children[0]
    outputs = [replace(c.outputs[0], index=i) for i, c in enumerate(children)]
    ms = [c.metrics for c in children]
    firsts = [m.first_token_time for m in ms if m.first_token_time is not None]
    finishes = [m.finish_time for m in ms if m.finish_time is not None]
    metrics = RequestMetrics(
        arrival_time=min(m.arrival_time for m in ms), first_token_time=min(firsts, default=None),
        finish_time=max(finishes, default=None), num_prompt_tokens=first.metrics.num_prompt_tokens,
        num_output_tokens=sum(m.num_output_tokens for m in ms), num_cached_tokens=sum(m.num_cached_tokens for m in ms),
        num_preemptions=sum(m.num_preemptions for m in ms), num_draft_tokens=sum(m.num_draft_tokens for m in ms),
        num_accepted_tokens=sum(m.num_accepted_tokens for m in ms),
    )
    return replace(first, outputs=outputs, metrics=metrics,
                   error=next((c.error for c in children if c.error is not None), None))
