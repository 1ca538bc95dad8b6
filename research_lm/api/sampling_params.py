"""`SamplingParams`, with vLLM's field names and validation at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from research_lm.api.checks import InvalidType, checked

_GREEDY_EPS = 1e-5

# field -> its kind (research_lm.api.checks; "?": None allowed). logit_bias, a dict, is checked on its own.
_KINDS = {
    "n": "posint", "temperature": "number", "top_p": "number", "top_k": "int", "min_p": "number",
    "presence_penalty": "number", "frequency_penalty": "number", "repetition_penalty": "number",
    "seed": "int?", "max_tokens": "posint?", "min_tokens": "count", "logprobs": "count?",
    "stop": "strs?", "stop_token_ids": "ints?", "include_stop_str_in_output": "bool", "ignore_eos": "bool",
    "skip_special_tokens": "bool", "allowed_token_ids": "ints?",
}


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt (`LLM.generate` runs them as n requests)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None  # stop strings: the output text ends before the first one it contains
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per output token (plus the sampled one)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before anything else but the mask
    allowed_token_ids: list[int] | None = None  # sample only among these ids

    def __post_init__(self) -> None:
        # Types first (numpy scalars become ints and floats), so a bad field is refused here, naming itself,
        # not deep in the sampler; the range checks below then compare numbers.
        for name, kind in _KINDS.items():
            setattr(self, name, checked(f"SamplingParams.{name}", getattr(self, name), kind))
        self.stop = self.stop or []
        self.stop_token_ids = self.stop_token_ids or []
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias) or None
        checks = [
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1, 0 (disabled) or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be > 0"),
            ("stop", all(self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be non-negative integers"),
            ("logit_bias", all(t >= 0 for t in self.logit_bias or {}), "must map non-negative token ids to numbers"),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                self.allowed_token_ids and all(t >= 0 for t in self.allowed_token_ids)),
             "must be a non-empty list of non-negative integers"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )

    def children(self) -> list[SamplingParams]:
        """The n single-completion params of parallel sampling, as vLLM makes them: a seeded request's child
        i samples with seed + i (so each completion is reproducible on its own); an unseeded one's children
        each get a seed from the engine, like any request."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i) for i in range(self.n)]

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def token_ids_used(self) -> list[int]:
        """The ids logit_bias and allowed_token_ids name (the engine checks them against the vocabulary)."""
        return [*(self.logit_bias or {}), *(self.allowed_token_ids or [])]

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies (it reads the output tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _checked_logit_bias(bias: Any) -> dict[int, float]:
    """{token id: bias} with int keys and float values. JSON object keys arrive as strings ("42"), which vLLM
    accepts too; a key that is no integer, or a value that is no finite number, is refused naming logit_bias."""
    try:
        if not isinstance(bias, Mapping):
            raise ValueError
        return {checked("logit_bias key", int(t) if isinstance(t, str) else t, "int"):
                checked("logit_bias value", b, "number") for t, b in bias.items()}
    except ValueError:  # int("abc") or a checked(...): one message that shows the whole mapping
        raise InvalidType(
            f"SamplingParams.logit_bias must map token ids (integers) to finite numbers, got {bias!r}"
        ) from None
