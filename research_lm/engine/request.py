"""A request's lifetime state, owned by the scheduler and read by the runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from research_lm.api.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass(eq=False)  # identity semantics: a request is one live object, hashable
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # effective sampling seed: the params' seed, or one derived from the engine seed
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)  # the outputs the host knows
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV (or state) is in the cache
    num_cached_tokens: int = -1  # prefix-cache hits at first schedule; -1 = not yet scheduled
    num_spec_tokens: int = 0  # drafts its next step verifies (their values wait in the runner's device table)
    # Outputs of launched steps not yet collected (async scheduling): counted, their values still on the device.
    num_output_placeholders: int = 0
    block_hashes: list[int] = field(default_factory=list)  # hash chain over full blocks
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    output_text: str | None = None  # set when a stop string ended it: the text cut at that string
    error: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Spec-decode accounting, per request.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        """The tokens the host knows: the prompt, then the known outputs."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs, the ones still in flight included."""
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows: all but the outputs in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + self.num_spec_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` (known tokens) without concatenating the whole history (hot path)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - n)]
