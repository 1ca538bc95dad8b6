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
import torch

from research_lm.worker.spec import Drafts, DraftTarget, Proposer, StepOutcome, register_proposer
from spec_decode.ngram_device import ngram_drafts


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


class NgramStepProposer(Proposer):
    """`research_lm.worker.spec.Proposer` over the n-gram rule, looked up on the device in the runner's token table
    (spec_decode/ngram_device.py, equal to `find_ngram_proposals`): it needs no host values, so every step drafts at
    launch and async scheduling may launch the next step right behind it."""

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram
        self.num_speculative_tokens = ngram.num_speculative_tokens

    def propose_on_device(self, outcome: StepOutcome) -> Drafts:
        # A bound of every row's length: its tokens before the step (scheduled drafts included) and what it emits.
        k = self.num_speculative_tokens
        max_len = max(r.num_tokens_with_spec for r in outcome.requests) + k + 1
        drafts, num = ngram_drafts(outcome.tokens.token_ids, outcome.tokens.num_tokens, outcome.tokens.rows.long(),
                                   min_n=self.ngram.prompt_lookup_min, max_n=self.ngram.prompt_lookup_max, k=k,
                                   max_len=min(max_len, outcome.tokens.token_ids.shape[1]))
        # a request that emitted nothing (a prompt chunk short of its end) drafts nothing
        num = torch.where(outcome.num_emitted > 0, num, 0)
        return Drafts(list(range(len(outcome.requests))), drafts, num)

    propose = propose_on_device


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
