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

from research_lm.request import Request
from research_lm.spec import DraftTarget, Proposal, Proposer, StepOutcome, register_proposer


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
        seqs = [np.asarray(ids, dtype=np.int64) for ids in token_ids_per_request]
        return find_ngram_proposals(seqs, self.prompt_lookup_min, self.prompt_lookup_max, self.num_speculative_tokens)


def find_ngram_proposals(
    seqs: Sequence[np.ndarray],  # per request [L_r] int64, prompt + output
    min_n: int,
    max_n: int,
    k: int,
) -> list[list[int]]:  # per request, up to k tokens
    """Every request at once, over the sequences laid end to end (no loop over requests or positions).

    An earlier n-gram equal to a suffix ends at a position p < L - 1 holding the request's last token, so only
    those positions are candidates. Each candidate's match length (how many tokens before p equal the ones
    before L - 1, up to max_n, never crossing the sequence's start) comes from one [candidates, max_n]
    comparison. Per request the longest match wins (at least min_n), the earliest on ties, and the drafts are
    the tokens after it.
    """
    out: list[list[int]] = [[] for _ in seqs]
    lens = np.fromiter((s.shape[0] for s in seqs), dtype=np.int64, count=len(seqs))
    if k == 0 or not seqs or int(lens.max()) < min_n + 1:
        return out
    flat = np.concatenate(seqs)  # [T]
    ends = np.cumsum(lens)  # exclusive
    starts = ends - lens
    row_of = np.repeat(np.arange(len(seqs)), lens)  # [T]
    last = ends - 1  # each request's last position (garbage for empty rows, which `usable` drops)
    usable = lens >= min_n + 1  # a suffix of min_n tokens and at least one token before it
    cand = np.flatnonzero(usable[row_of] & (flat == flat[last[row_of]]) & (np.arange(flat.shape[0]) != last[row_of]))
    if cand.size == 0:
        return out
    rows = row_of[cand]
    back = np.arange(max_n)
    mine, suffix = cand[:, None] - back, last[rows][:, None] - back  # [C, max_n]: positions d tokens back
    same = (mine >= starts[rows][:, None]) & (flat[np.maximum(mine, 0)] == flat[suffix])
    match = np.cumprod(same, axis=1).sum(axis=1)  # [C]
    keep = match >= min_n
    cand, rows, match = cand[keep], rows[keep], match[keep]
    order = np.lexsort((cand, -match, rows))  # by request, longest first, earliest first
    first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]] if order.size else order
    for c in first:
        r, e = int(rows[c]), int(cand[c]) + 1  # the drafts start after the earlier occurrence
        out[r] = flat[e : min(e + k, int(ends[r]))].tolist()
    return out


class _TokenArrays:
    """Each live request's prompt + outputs as a growing int64 array, so a step copies in only the tokens
    added since the last one instead of converting the whole list again."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens filled)

    def get(self, req: Request, emitted: Sequence[int]) -> np.ndarray:  # [num_tokens + len(emitted)]
        n = req.num_tokens
        m = n + len(emitted)
        buf, filled = self._arrays.get(req.request_id, (None, 0))
        filled = filled if filled <= n else 0  # (never fewer tokens than before while live; rebuild if so)
        if buf is None or buf.shape[0] < m:
            grown = np.empty(max(2 * m, 256), dtype=np.int64)
            if buf is not None:
                grown[:filled] = buf[:filled]
            buf = grown
        if filled < n:
            buf[filled:n] = req.token_ids_slice(filled, n)
        buf[n:m] = emitted  # not kept as filled: the scheduler may still cut them at a stop
        self._arrays[req.request_id] = (buf, n)
        return buf[:m]

    def drop(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._arrays.pop(req_id, None)


class NgramStepProposer(Proposer):
    """`research_lm.spec.Proposer` over `NgramProposer`: needs no hidden states or q."""

    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram
        self.num_speculative_tokens = ngram.num_speculative_tokens
        self._tokens = _TokenArrays()

    def propose(self, outcome: StepOutcome) -> Proposal:
        # `emitted` is not yet appended to the requests; a request that emitted nothing (a prompt
        # chunk short of the end) gets no drafts.
        live = [(r, e) for r, e in zip(outcome.requests, outcome.emitted, strict=True) if e]
        drafts = self.ngram.propose([self._tokens.get(r, e) for r, e in live])
        token_ids = {r.request_id: [] for r in outcome.requests}
        token_ids.update({r.request_id: d for (r, _), d in zip(live, drafts)})
        return Proposal(token_ids)

    def on_requests_removed(self, req_ids: set[str]) -> None:
        self._tokens.drop(req_ids)


@register_proposer("ngram", prompt_lookup_min="posint?", prompt_lookup_max="posint?")
def build_proposer(speculative_config: dict[str, Any], target: DraftTarget) -> NgramStepProposer:
    """vLLM's keys and defaults: one of the lookup bounds defaults to the other, both to 5."""
    lo, hi = speculative_config.get("prompt_lookup_min"), speculative_config.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    k = speculative_config.get("num_speculative_tokens")
    if k is None:
        raise ValueError("speculative_config for 'ngram' needs num_speculative_tokens")
    if int(k) < 1:  # as the other proposers: zero drafts is no speculation, i.e. no speculative_config
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    return NgramStepProposer(NgramProposer(int(lo), int(hi), int(k)))
