"""Prompt-lookup (n-gram) drafting: continue the sequence the way it continued before.

For a sequence a[0:L] (prompt + output), find the longest suffix n-gram a[L-n:L] with
n in [prompt_lookup_min, prompt_lookup_max] that also occurs earlier, at some start s < L - n
(overlaps allowed), and propose the tokens that followed its earliest occurrence,
a[s+n : s+n+k], which may be fewer than k near the end of the sequence. No match: no drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from research_lm.spec import Proposal, StepOutcome


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {prompt_lookup_min} and {prompt_lookup_max}"
            )
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids_per_request: Sequence[np.ndarray | Sequence[int]]) -> list[list[int]]:
        """Drafts per request (each of length 0..num_speculative_tokens) from prompt + output ids."""
        return [
            find_ngram_proposal(
                np.asarray(ids, dtype=np.int64),
                self.prompt_lookup_min,
                self.prompt_lookup_max,
                self.num_speculative_tokens,
            )
            for ids in token_ids_per_request
        ]


def find_ngram_proposal(
    tokens: np.ndarray,  # [L] int64, prompt + output
    min_n: int,
    max_n: int,
    k: int,
) -> list[int]:  # up to k tokens
    """All candidate occurrences are scored at once: no loop over positions or n-gram sizes."""
    length = tokens.shape[0]
    max_n = min(max_n, length - 1)  # an earlier occurrence needs at least one token before the suffix
    if k == 0 or max_n < min_n:
        return []
    # Window e (0 <= e < L) holds the max_n tokens ending just before a[e] (zero-padded on the
    # left); a[e] is what followed it. e < L excludes the suffix itself.
    padded = np.concatenate([np.zeros(max_n, dtype=tokens.dtype), tokens[:-1]])  # [max_n + L - 1]
    windows = sliding_window_view(padded, max_n)  # [L, max_n]
    suffix = tokens[length - max_n :]  # [max_n]
    # match_len[e] = how many trailing tokens of window e equal the trailing tokens of the suffix,
    # capped at e so that padding never counts.
    eq = windows[:, ::-1] == suffix[::-1]  # [L, max_n], column d compares a[e-1-d] with a[L-1-d]
    match_len = np.minimum(np.cumprod(eq, axis=1).sum(axis=1), np.arange(length))  # [L]
    best = int(match_len.max())
    if best < min_n:
        return []
    # The longest n-gram is best long; its earliest occurrence is the first window matching it.
    e = int(np.argmax(match_len == best))
    return tokens[e : e + k].tolist()


class NgramStepProposer:
    """`research_lm.spec.Proposer` over `NgramProposer`: stateless, needs no hidden states or q."""

    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram
        self.num_speculative_tokens = ngram.num_speculative_tokens

    def propose(self, outcome: StepOutcome) -> Proposal:
        # `emitted` is not yet appended to the requests; a request that emitted nothing (a prompt
        # chunk short of the end) gets no drafts.
        live = [(r, e) for r, e in zip(outcome.requests, outcome.emitted, strict=True) if e]
        drafts = self.ngram.propose([r.all_token_ids + list(e) for r, e in live])
        token_ids = {r.request_id: [] for r in outcome.requests}
        token_ids.update({r.request_id: d for (r, _), d in zip(live, drafts)})
        return Proposal(token_ids)

    def on_requests_removed(self, req_ids: set[str]) -> None:
        pass  # no per-request state


def build_proposer(speculative_config: dict[str, Any], target: Any) -> NgramStepProposer:
    """vLLM's keys and defaults: one of the lookup bounds defaults to the other, both to 5."""
    lo, hi = speculative_config.get("prompt_lookup_min"), speculative_config.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    k = speculative_config.get("num_speculative_tokens")
    if k is None:
        raise ValueError("speculative_config for 'ngram' needs num_speculative_tokens")
    return NgramStepProposer(NgramProposer(int(lo), int(hi), int(k)))
