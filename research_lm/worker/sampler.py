"""Token sampling: vLLM V1 logit processing, counter-based random draws, raw-distribution logprobs.

A *row* is "sample the token at output position p of this request". A request usually has one
row per step; when drafts are verified it has k+1 consecutive rows (positions p .. p+k), the later
rows seeing the drafts as extra output history (penalties, min_tokens). Verification (`research_lm.worker.verification`,
`research_lm.worker.rejection_sampler`) builds its `SamplingBatch` from those rows and reuses `process_logits` /
`compute_probs` / `random_sample` / `gather_logprobs`, so verified and plain decoding process the
logits identically.

Order of processing (vLLM V1's `Sampler.forward`):

    raw logprobs = log_softmax(logits)            (returned logprobs: the model's distribution)
    min_tokens -> penalties                       (change greedy results too)
    temperature -> min_p -> top-k / top-p         (random rows only; greedy rows are untouched)
    greedy rows: argmax;  random rows: argmax(probs / q), q ~ Exp(1) from rng (exponential race)

Every random draw comes from `rng.exponential_rows(seed, position, stream)`, so a row's token
depends only on its own logits, params, seed and position: never on the batch around it.
On CUDA the race runs as one Triton kernel that hashes the same noise in registers
(`research_lm.ops.exponential_race`), giving the same tokens.

Penalties read each row's token history: from the runner's device token table (`TokenHistory`), whose rows hold
outputs still in flight that the host has only counted; or, without one (drafters), from the host's lists.

Host cost: `SamplingBatch.build` is one pass of Python over the rows plus at most two pinned,
non-blocking copies (floats, ints); nothing in this module synchronises with the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np
import torch

from research_lm import ops
from research_lm.api.sampling_params import _GREEDY_EPS
from research_lm.engine.request import Logprob, Request
from research_lm.worker import rng

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingRow",
    "TokenHistory",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k_top_p",
    "compute_probs",
    "gather_logprobs",
    "logprobs_to_dicts",
    "probs_from_processed",
    "process_logits",
    "race",
    "random_sample",
    "sample_tokens",
]


# ----------------------------------------------------------------------------------------------
# Rows and the per-step batch
# ----------------------------------------------------------------------------------------------


@dataclass
class SamplingRow:
    """Sample the token at output position `position` of `request`, where the outputs before it are
    `output_token_ids` (None: the request's own) followed by `then` (drafts being verified or drafted).
    The concatenation is built only if a penalty reads it from the host: a verify row must not copy a long output."""

    request: Request
    output_token_ids: list[int] | None = None
    then: Sequence[int] = ()

    @property
    def _base(self) -> list[int]:
        return self.request.output_token_ids if self.output_token_ids is None else self.output_token_ids

    @property
    def outputs(self) -> list[int]:
        return self._base + list(self.then) if self.then else self._base

    @property
    def position(self) -> int:
        # The request's own count includes outputs still in flight, whose values the host does not hold.
        base = self.request.num_output_tokens if self.output_token_ids is None else len(self.output_token_ids)
        return base + len(self.then)

    @classmethod
    def verify(cls, request: Request, draft_token_ids: Sequence[int]) -> list[SamplingRow]:
        """The k+1 rows that verify k drafts: positions p .. p+k, row j seeing drafts[:j] as output."""
        drafts = [int(t) for t in draft_token_ids]
        return [cls(request, then=drafts[:j]) for j in range(len(drafts) + 1)]


@dataclass
class TokenHistory:
    """Where penalties read each batch row's tokens: a device table whose rows hold a request's prompt, then its
    outputs (those still in flight included), then the drafts its step verifies. The host gives only counts."""

    table: torch.Tensor  # [R_max, W] int32 on the device: per table row the prompt, then the outputs
    rows: list[int]  # per batch row, its table row
    prompt_lens: list[int]  # per batch row
    ends: list[int]  # per batch row: its prompt + the outputs before the token it samples (drafts it follows included)

    def segments(self, batch_rows: list[int], outputs_only: bool) -> list[int]:  # [4 * n], see `_history_index`
        """The columns these batch rows read: the outputs (`outputs_only`) or the prompt and the outputs."""
        firsts = [self.prompt_lens[i] if outputs_only else 0 for i in batch_rows]
        return [*batch_rows, *(self.rows[i] for i in batch_rows), *firsts, *(self.ends[i] for i in batch_rows)]


RowLike = Request | SamplingRow | tuple[Request, list[int] | None]


def plain_greedy(request: Request) -> bool:
    """The request's rows from its next output on take argmax(raw logits) (`SamplingBatch.plain_argmax`): greedy,
    no penalty, logit_bias or allowed_token_ids, and min_tokens reached, so no stop id is banned. Decided per
    request, where building the batch is Python per row (verify and draft steps have k + 1 rows per request)."""
    sp = request.sampling_params
    return (sp.greedy and not sp.penalized and not sp.logit_bias and sp.allowed_token_ids is None
            and request.num_output_tokens >= sp.min_tokens)


def _as_row(row: RowLike) -> SamplingRow:
    if isinstance(row, SamplingRow):
        return row
    if isinstance(row, Request):
        return SamplingRow(row)
    request, outputs = row
    return SamplingRow(request, None if outputs is None else list(outputs))


def _token_index(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:  # [sum(len)] int64: row * V + token, flat indices into a [rows, V] tensor
    lengths = [len(t) for t in token_lists]
    # np.fromiter is ~10x faster than torch.tensor on a long Python list.
    flat = torch.from_numpy(np.fromiter(chain.from_iterable(token_lists), np.int64, sum(lengths)))
    row = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor(lengths, dtype=torch.int64))
    return rng.to_device(row * vocab_size + flat, torch.int64, device)


def _history_index(
    table: torch.Tensor,  # [R_max, W] int32 on the device, `TokenHistory.table`
    segments: torch.Tensor,  # [4, n] int64 on the device: per row its batch row, table row, first and end column
    lo: int,  # min over the rows of the first column
    hi: int,  # max over the rows of the end column
    vocab_size: int,
    dump: int,  # flat index that the cells outside a row's columns point to
) -> torch.Tensor:  # [n * (hi - lo)] int64: batch row * V + token per cell in a row's columns, dump elsewhere
    """`_token_index` of table[table row, first:end] per row, by batched device ops over [n, hi - lo] columns."""
    batch_row, table_row, first, end = segments
    cols = torch.arange(lo, hi, device=table.device)  # [L]
    inside = (cols >= first[:, None]) & (cols < end[:, None])  # [n, L]
    # Cells outside a row's columns may hold anything (another row's drafts, stale tokens): never index by them.
    flat = batch_row[:, None] * vocab_size + table[table_row, lo:hi]  # [n, L] int64
    return torch.where(inside, flat, dump).view(-1)


def _penalty_index(
    rows: list[SamplingRow],
    used: list[int],  # the batch rows this penalty reads (at least one)
    outputs_only: bool,  # read the outputs (presence, frequency); else the prompt and the outputs (repetition)
    history: TokenHistory | None,
    segments: torch.Tensor | None,  # [4 * len(used)] int64 on the device: `history.segments(used, outputs_only)`
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:  # [N] int64 flat indices into [len(rows) * V + 1]: row * V + token, or the last slot
    """The tokens a penalty reads, from the history's device table, else from the host's lists."""
    if history is not None and segments is not None:
        firsts = [history.prompt_lens[i] for i in used] if outputs_only else [0]
        return _history_index(history.table, segments.view(4, -1), min(firsts), max(history.ends[i] for i in used),
                              vocab_size, len(rows) * vocab_size)
    lists: list[list[int]] = [[] for _ in rows]
    for i in used:
        lists[i] = rows[i].outputs if outputs_only else rows[i].request.prompt_token_ids + rows[i].outputs
    return _token_index(lists, vocab_size, device)


def _upload(
    named: dict[str, list[float] | list[int] | None], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor | None]:  # name -> [len] view of one device tensor (None stays None)
    """Several host lists -> device in one non-blocking copy."""
    present = {k: v for k, v in named.items() if v is not None}
    out: dict[str, torch.Tensor | None] = dict.fromkeys(named)
    if present:
        flat = rng.to_device(list(chain.from_iterable(present.values())), dtype, device)
        out.update(zip(present, flat.split([len(v) for v in present.values()])))
    return out


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, built once per step by `SamplingBatch.build`.

    Only what some row uses becomes a tensor (None otherwise), and every tensor reaches the device
    through one pinned, non-blocking copy, so building a batch never waits for the GPU. An
    all-greedy batch without penalties, min_tokens or logprobs builds no tensor at all.
    Greedy rows carry neutral values for temperature / top-k / top-p / min-p (1, V, 1, 0), so the
    processing functions can run over the whole batch without branching per row.
    """

    vocab_size: int
    device: torch.device
    greedy: list[bool]  # [R]
    seeds: list[int]  # [R] request.seed
    positions: list[int]  # [R] output index being sampled
    random_rows: list[int]  # indices of non-greedy rows
    num_logprobs: list[int | None]  # [R] the request's `logprobs` (None: none asked)
    max_num_logprobs: int | None  # max over rows; None when no row asks
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    temperature: torch.Tensor | None  # [R] float32; 1.0 on greedy rows; None when all are 1.0
    top_k: torch.Tensor | None  # [R] int64; V where disabled; None when no_top_k
    top_p: torch.Tensor | None  # [R] float32; 1.0 where disabled; None when no_top_p
    min_p: torch.Tensor | None  # [R] float32; 0.0 where disabled; None when no_min_p
    # Penalty state; None when no row needs it (fast path).
    presence_penalty: torch.Tensor | None  # [R] float32; None when output_counts is None
    frequency_penalty: torch.Tensor | None  # [R] float32; None when output_counts is None
    repetition_penalty: torch.Tensor | None  # [R] float32; None when seen_mask is None
    output_counts: torch.Tensor | None  # [R, V] float32: occurrences among the row's outputs
    seen_mask: torch.Tensor | None  # [R, V] bool: token in the row's prompt or outputs
    # min_tokens: (row, token) pairs to ban; None when no row is below its min_tokens.
    banned_rows: torch.Tensor | None  # [N] int64
    banned_token_ids: torch.Tensor | None  # [N] int64
    # logit_bias: (row, token, bias) triples; allowed_token_ids: (row, token) pairs; None when no row has them.
    bias_rows: torch.Tensor | None  # [B] int64
    bias_token_ids: torch.Tensor | None  # [B] int64
    bias_values: torch.Tensor | None  # [B] float32
    allowed_rows: torch.Tensor | None  # [A] int64
    allowed_token_ids: torch.Tensor | None  # [A] int64

    @property
    def num_rows(self) -> int:
        return len(self.seeds)

    @property
    def no_penalties(self) -> bool:
        return self.output_counts is None and self.seen_mask is None

    @property
    def biased(self) -> bool:
        """Some row has logit_bias or allowed_token_ids."""
        return self.bias_rows is not None or self.allowed_rows is not None

    @property
    def plain_argmax(self) -> bool:
        """Every row takes argmax(raw logits): all greedy, and no penalty, min_tokens ban this step (a row below
        min_tokens with nothing to ban counts as plain), logit_bias or allowed_token_ids moves it."""
        return self.all_greedy and self.no_penalties and self.banned_rows is None and not self.biased

    @property
    def argmax_only(self) -> bool:
        """The sampler returns argmax(raw logits) and no logprobs (`plain_argmax`, no logprobs asked). A
        precomputed argmax (the decode CUDA graph's) may then stand in for it."""
        return self.plain_argmax and self.max_num_logprobs is None

    @cached_property
    def greedy_mask(self) -> torch.Tensor:  # [R] bool, built on first use (mixed batches)
        return rng.to_device(self.greedy, torch.bool, self.device)

    @classmethod
    def build(
        cls,
        rows: Sequence[RowLike],
        vocab_size: int,
        device: torch.device | str = "cpu",
        history: TokenHistory | None = None,
    ) -> SamplingBatch:
        """rows: `Request` (its next token), `SamplingRow`, or `(request, outputs_before)`.

        history: where penalties read each row's tokens on the device (the runner's table, which holds outputs still
        in flight); None: from the host's lists (`SamplingRow.outputs`)."""
        device = torch.device(device)
        V = vocab_size
        rs = [_as_row(r) for r in rows]
        if history is not None:
            for name in ("rows", "prompt_lens", "ends"):
                if len(getattr(history, name)) != len(rs):
                    raise ValueError(f"history.{name} has {len(getattr(history, name))} entries for {len(rs)} rows")
        params = [r.request.sampling_params for r in rs]
        positions = [r.position for r in rs]
        greedy = [sp.greedy for sp in params]
        all_greedy = all(greedy)
        use_count = [sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 for sp in params]
        use_seen = [sp.repetition_penalty != 1.0 for sp in params]
        asked = [sp.logprobs for sp in params if sp.logprobs is not None]

        # Truncation parameters (random rows only; neutral on greedy rows); None where unused.
        top_k = top_p = min_p = temperature = None
        if not all_greedy:
            temperature = [1.0 if g else sp.temperature for g, sp in zip(greedy, params)]
            top_k = [V if g or sp.top_k <= 0 or sp.top_k >= V else sp.top_k for g, sp in zip(greedy, params)]
            top_p = [1.0 if g else sp.top_p for g, sp in zip(greedy, params)]
            min_p = [0.0 if g else sp.min_p for g, sp in zip(greedy, params)]
            top_k = None if all(k >= V for k in top_k) else top_k
            top_p = None if all(p >= 1.0 for p in top_p) else top_p
            min_p = None if all(p <= 0.0 for p in min_p) else min_p
            temperature = None if all(t == 1.0 for t in temperature) else temperature

        # min_tokens: ban the stop ids (and EOS unless ignore_eos) while outputs < min_tokens.
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, (r, sp, pos) in enumerate(zip(rs, params, positions)):
            if pos >= sp.min_tokens:
                continue
            ids = set(sp.stop_token_ids)
            if not sp.ignore_eos and r.request.eos_token_id is not None:
                ids.add(r.request.eos_token_id)
            ids = sorted(t for t in ids if 0 <= t < V)
            banned_rows += [i] * len(ids)
            banned_ids += ids

        # logit_bias and allowed_token_ids, over the vocabulary (the engine refused ids outside it).
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        allowed_rows: list[int] = []
        allowed_ids: list[int] = []
        for i, sp in enumerate(params):
            for t, b in (sp.logit_bias or {}).items():
                if t < V:
                    bias_rows.append(i)
                    bias_ids.append(t)
                    bias_values.append(b)
            if sp.allowed_token_ids is not None:
                ids = [t for t in sp.allowed_token_ids if t < V]
                allowed_rows += [i] * len(ids)
                allowed_ids += ids

        # Every per-row tensor some row uses, in one float and one int host -> device copy.
        any_count, any_seen = any(use_count), any(use_seen)
        count_rows = [i for i, u in enumerate(use_count) if u]
        seen_rows = [i for i, u in enumerate(use_seen) if u]
        floats = {
            "temperature": temperature,
            "top_p": top_p,
            "min_p": min_p,
            "presence_penalty": [sp.presence_penalty for sp in params] if any_count else None,
            "frequency_penalty": [sp.frequency_penalty for sp in params] if any_count else None,
            "repetition_penalty": [sp.repetition_penalty for sp in params] if any_seen else None,
            "bias_values": bias_values or None,
        }
        ints = {
            "top_k": top_k,
            "banned_rows": banned_rows or None,
            "banned_token_ids": banned_ids or None,
            "bias_rows": bias_rows or None,
            "bias_token_ids": bias_ids or None,
            "allowed_rows": allowed_rows or None,
            "allowed_token_ids": allowed_ids or None,
            "count_history": history.segments(count_rows, True) if history is not None and any_count else None,
            "seen_history": history.segments(seen_rows, False) if history is not None and any_seen else None,
        }
        tensors = {**_upload(floats, torch.float32, device), **_upload(ints, torch.int64, device)}
        count_history, seen_history = tensors.pop("count_history"), tensors.pop("seen_history")

        # Penalties: build only the state some row uses, and only from the rows that use it. The flat indices point
        # into [R * V + 1], whose last slot takes the table cells outside a row's columns and is dropped.
        output_counts = seen_mask = None
        RV = len(rs) * V
        if any_count:
            idx = _penalty_index(rs, count_rows, True, history, count_history, V, device)
            # Small integer sums are exact in float32, so the atomic add order does not matter.
            output_counts = torch.zeros(RV + 1, dtype=torch.float32, device=device)
            output_counts = output_counts.index_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))
            output_counts = output_counts[:RV].view(len(rs), V)
        if any_seen:
            idx = _penalty_index(rs, seen_rows, False, history, seen_history, V, device)
            seen_mask = torch.zeros(RV + 1, dtype=torch.bool, device=device)
            seen_mask.index_fill_(0, idx, True)  # (an indexed assignment of a scalar copies it from the host)
            seen_mask = seen_mask[:RV].view(len(rs), V)

        return cls(
            vocab_size=V,
            device=device,
            greedy=greedy,
            seeds=[r.request.seed for r in rs],
            positions=positions,
            random_rows=[] if all_greedy else [i for i, g in enumerate(greedy) if not g],
            num_logprobs=[sp.logprobs for sp in params],
            max_num_logprobs=max(asked) if asked else None,
            all_greedy=all_greedy,
            all_random=not any(greedy),
            no_top_k=top_k is None,
            no_top_p=top_p is None,
            no_min_p=min_p is None,
            output_counts=output_counts,
            seen_mask=seen_mask,
            **tensors,
        )


# ----------------------------------------------------------------------------------------------
# Logit processing: small pure functions (inputs are never modified)
# ----------------------------------------------------------------------------------------------


def apply_min_tokens(
    logits: torch.Tensor,  # [R, V] float32
    banned_rows: torch.Tensor | None,  # [N] int64
    banned_token_ids: torch.Tensor | None,  # [N] int64
) -> torch.Tensor:  # [R, V]
    """logits[banned_rows[n], banned_token_ids[n]] = -inf."""
    if banned_rows is None or banned_token_ids is None:
        return logits
    logits = logits.clone()
    logits[banned_rows, banned_token_ids] = float("-inf")
    return logits


def apply_allowed_token_ids(
    logits: torch.Tensor,  # [R, V] float32
    rows: torch.Tensor | None,  # [A] int64
    token_ids: torch.Tensor | None,  # [A] int64
) -> torch.Tensor:  # [R, V]
    """A row named in `rows` keeps only its (row, token) pairs' logits; the rest of that row is -inf."""
    if rows is None or token_ids is None:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[rows, token_ids] = True
    restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    restricted[rows] = True
    return logits.masked_fill(restricted[:, None] & ~keep, float("-inf"))


def apply_logit_bias(
    logits: torch.Tensor,  # [R, V] float32
    rows: torch.Tensor | None,  # [B] int64
    token_ids: torch.Tensor | None,  # [B] int64
    values: torch.Tensor | None,  # [B] float32
) -> torch.Tensor:  # [R, V]
    """logits[rows[n], token_ids[n]] += values[n]."""
    if rows is None or token_ids is None or values is None:
        return logits
    return logits.index_put((rows, token_ids), values, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float32
    output_counts: torch.Tensor | None,  # [R, V] float32 counts over outputs; None: no presence/freq
    seen_mask: torch.Tensor | None,  # [R, V] bool, seen in prompt or outputs; None: no repetition
    presence_penalty: torch.Tensor | None,  # [R] float32; needed with output_counts
    frequency_penalty: torch.Tensor | None,  # [R] float32; needed with output_counts
    repetition_penalty: torch.Tensor | None,  # [R] float32; needed with seen_mask
) -> torch.Tensor:  # [R, V]
    """vLLM's penalties, in this order:

        repetition (tokens seen in prompt or outputs):  l = l / r if l > 0 else l * r
        frequency:  l -= f * count(outputs)
        presence:   l -= p * [count(outputs) > 0]
    """
    if seen_mask is not None:
        r = torch.where(seen_mask, repetition_penalty[:, None], 1.0)  # [R, V]
        logits = torch.where(logits > 0, logits / r, logits * r)
    if output_counts is not None:
        logits = logits - frequency_penalty[:, None] * output_counts
        logits = logits - presence_penalty[:, None] * (output_counts > 0).float()
    return logits


def apply_temperature(
    logits: torch.Tensor,  # [R, V] float32
    temperature: torch.Tensor,  # [R] float32
) -> torch.Tensor:  # [R, V]
    """l / T; rows with T < 1e-5 (greedy) are left untouched."""
    t = torch.where(temperature < _GREEDY_EPS, 1.0, temperature)
    return logits / t[:, None]


def apply_min_p(
    logits: torch.Tensor,  # [R, V] float32
    min_p: torch.Tensor,  # [R] float32 in [0, 1]; 0 disables
) -> torch.Tensor:  # [R, V]
    """Drop tokens with prob < min_p * max prob.

    In logit space (no softmax): p_i / p_max = exp(l_i - l_max), so drop l_i < l_max + log(min_p).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]  # [R, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


_TOP_P_UNITS = float(1 << 40)  # top-p's fixed point: exact sums of up to 2^23 tokens' masses in int64


def apply_top_k_top_p(
    logits: torch.Tensor,  # [R, V] float32
    top_k: torch.Tensor | None,  # [R] int64; <= 0 or >= V disables; None: no row uses top-k
    top_p: torch.Tensor | None,  # [R] float32 in (0, 1]; 1 disables; None: no row uses top-p
) -> torch.Tensor:  # [R, V]
    """Top-k, then top-p on the top-k-renormalised distribution (vLLM's order).

    top-k keeps the k largest logits; top-p keeps the smallest descending prefix whose cumulative
    probability is >= p (so always at least one token). Both reduce to a per-row logit threshold,
    and every token at or above it is kept: a tie at the boundary keeps all the tied tokens, so the
    result never depends on how the sort orders equal values.
    """
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [R, V]
    threshold = torch.full_like(logits[:, :1], float("-inf"))  # [R, 1]
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > V), V, top_k)  # [R]
        threshold = sorted_logits.gather(1, (k - 1)[:, None])  # [R, 1]: the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        # The prefix sums in fixed point (units of 2^-40): integer sums are exact, so the cut never depends on the
        # order a scan adds in, which CUDA picks from the tensor's shape (the batch): a request's top-p set is the
        # same alone and in any batch.
        mass = (sorted_logits.softmax(dim=-1).double() * _TOP_P_UNITS).round().long()  # [R, V]
        cum_before = mass.cumsum(dim=-1) - mass  # mass ahead of i
        # Keep i while the tokens before it hold < p; p = 1 keeps everything despite rounding.
        p_units = (top_p.double() * _TOP_P_UNITS).round().long()[:, None]
        keep = (cum_before < p_units) | (top_p[:, None] >= 1.0)  # [R, V], a prefix
        last = keep.sum(dim=-1, keepdim=True).clamp(min=1) - 1  # [R, 1]
        threshold = torch.maximum(threshold, sorted_logits.gather(1, last))
    return logits.masked_fill(logits < threshold, float("-inf"))


def process_logits(
    logits: torch.Tensor,  # [R, V] raw model logits (any float dtype)
    batch: SamplingBatch,
) -> torch.Tensor:  # [R, V] float32, processed
    """allowed_token_ids -> min_tokens -> logit_bias -> penalties -> temperature -> min_p -> top-k/top-p
    (vLLM V1's order)."""
    logits = logits.float()
    logits = apply_allowed_token_ids(logits, batch.allowed_rows, batch.allowed_token_ids)
    logits = apply_min_tokens(logits, batch.banned_rows, batch.banned_token_ids)
    logits = apply_logit_bias(logits, batch.bias_rows, batch.bias_token_ids, batch.bias_values)
    if not batch.no_penalties:
        logits = apply_penalties(logits, batch.output_counts, batch.seen_mask, batch.presence_penalty,
                                 batch.frequency_penalty, batch.repetition_penalty)
    if batch.all_greedy:
        return logits  # the rest is argmax-invariant
    if batch.temperature is not None:
        logits = apply_temperature(logits, batch.temperature)
    if not batch.no_min_p:
        logits = apply_min_p(logits, batch.min_p)
    return apply_top_k_top_p(logits, None if batch.no_top_k else batch.top_k,
                             None if batch.no_top_p else batch.top_p)


def probs_from_processed(
    processed: torch.Tensor,  # [R, V] float32, from process_logits
    batch: SamplingBatch,
) -> torch.Tensor:  # [R, V] float32
    """softmax(processed); greedy rows are one-hot on argmax (first index on ties)."""
    if batch.all_random:
        return processed.softmax(dim=-1)
    one_hot = torch.zeros_like(processed).scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
    if batch.all_greedy:
        return one_hot
    return torch.where(batch.greedy_mask[:, None], one_hot, processed.softmax(dim=-1))


def compute_probs(
    logits: torch.Tensor,  # [R, V] raw model logits
    batch: SamplingBatch,
) -> torch.Tensor:  # [R, V] float32
    """The distribution each row samples from (the target p of rejection sampling)."""
    return probs_from_processed(process_logits(logits, batch), batch)


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


def random_sample(
    probs: torch.Tensor,  # [N, V] float32, any non-negative weights (need not sum to 1)
    seeds: Sequence[int] | torch.Tensor,  # [N]
    positions: Sequence[int] | torch.Tensor,  # [N]
    stream: int | torch.Tensor = rng.SAMPLE,  # or [N] int64, one stream per row
) -> torch.Tensor:  # [N] int64
    """Exponential race: argmax_i p_i / q_i with q_i ~ Exp(1) is distributed as p / sum(p).

    q comes from (seed, position, stream) alone, so each row's draw is batch-independent.
    q >= 1e-16 (`rng.exponential_rows`), so p / q is finite and masked tokens (p = 0) stay at 0.
    """
    return race(probs, rng.row_keys(seeds, positions, stream))


def race(
    probs: torch.Tensor,  # [N, V] float32, non-negative weights
    keys: torch.Tensor,  # [N] int64, each row's `rng.row_keys` (host or probs' device)
) -> torch.Tensor:  # [N] int64
    """`random_sample` of rows whose noise keys are already hashed.

    On CUDA one Triton kernel (`research_lm.ops.exponential_race`) hashes the noise in registers and races
    in place, with the same tokens; elsewhere (and under torch.compile) this torch code is the reference.
    """
    keys = rng.to_device(keys, torch.int64, probs.device)
    if (probs.device.type in ops.FUSED_DEVICE_TYPES and probs.dtype == torch.float32 and probs.dim() == 2
            and probs.shape[-1] > 0 and not torch.compiler.is_compiling()):
        from research_lm.ops.exponential_race import exponential_race

        return exponential_race(probs if probs.stride(-1) == 1 else probs.contiguous(), keys)
    q = rng.exponential_from_keys(keys, probs.shape[-1])  # [N, V]
    return torch.div(probs, q, out=q).argmax(dim=-1)


def sample_tokens(
    processed: torch.Tensor,  # [R, V] float32, from process_logits
    batch: SamplingBatch,
) -> torch.Tensor:  # [R] int64
    """Greedy rows: argmax; random rows: `random_sample` of softmax(processed).

    Noise is drawn for the random rows only: on a mixed batch they are gathered first.
    """
    if batch.all_greedy:
        return processed.argmax(dim=-1)
    if batch.all_random:
        return random_sample(processed.softmax(dim=-1), batch.seeds, batch.positions)
    tokens = processed.argmax(dim=-1)  # [R]
    idx = batch.random_rows
    idx_t = rng.to_device(idx, torch.int64, processed.device)  # [N]
    probs = processed[idx_t].softmax(dim=-1)  # [N, V]
    drawn = random_sample(probs, [batch.seeds[i] for i in idx], [batch.positions[i] for i in idx])
    return tokens.index_copy(0, idx_t, drawn)


# ----------------------------------------------------------------------------------------------
# Logprobs (of the raw model distribution, vLLM's default `raw_logprobs`)
# ----------------------------------------------------------------------------------------------


@dataclass
class LogprobsTensors:
    """Rank = 1 + number of tokens with a strictly larger logprob (ties share a rank)."""

    sampled_logprobs: torch.Tensor  # [R] float32
    sampled_ranks: torch.Tensor  # [R] int64
    topk_ids: torch.Tensor  # [R, n] int64, most likely first
    topk_logprobs: torch.Tensor  # [R, n] float32
    topk_ranks: torch.Tensor  # [R, n] int64


def gather_logprobs(
    logprobs: torch.Tensor,  # [R, V] float32, log_softmax of raw logits
    token_ids: torch.Tensor,  # [R] int64, the emitted tokens
    num_logprobs: int,  # n: top entries per row (>= 0)
) -> LogprobsTensors:
    token_lp = logprobs.gather(1, token_ids[:, None])  # [R, 1]
    ranks = (logprobs > token_lp).sum(dim=-1) + 1  # [R]
    n = min(num_logprobs, logprobs.shape[-1])
    top_lp, top_ids = logprobs.topk(n, dim=-1)  # [R, n], sorted descending
    # Every token above a top-n entry is itself in the top n, so ranks need only the top n.
    top_ranks = (top_lp[:, None, :] > top_lp[:, :, None]).sum(dim=-1) + 1  # [R, n]
    return LogprobsTensors(token_lp[:, 0], ranks, top_ids, top_lp, top_ranks)


def logprobs_to_dicts(
    logprobs: LogprobsTensors,
    token_ids: torch.Tensor,  # [R] int64
    num_logprobs: Sequence[int | None],  # [R] per-row n; None: the row asked for none
) -> list[dict[int, Logprob] | None]:
    """Per row: {sampled token, then its top-n tokens: Logprob}; None for rows that asked for none."""
    tok = token_ids.tolist()
    s_lp, s_rank = logprobs.sampled_logprobs.tolist(), logprobs.sampled_ranks.tolist()
    t_ids, t_lp = logprobs.topk_ids.tolist(), logprobs.topk_logprobs.tolist()
    t_rank = logprobs.topk_ranks.tolist()
    out: list[dict[int, Logprob] | None] = []
    for i, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        d = {tok[i]: Logprob(s_lp[i], s_rank[i])}
        for t, lp, rk in zip(t_ids[i][:n], t_lp[i][:n], t_rank[i][:n]):
            d.setdefault(t, Logprob(lp, rk))
        out.append(d)
    return out


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: LogprobsTensors | None = None  # when some row asked for logprobs

    def logprob_dicts(self, batch: SamplingBatch) -> list[dict[int, Logprob] | None]:
        """Per row: top-n plus the sampled token; None where the row asked for none (or none did)."""
        if self.logprobs is None:
            return [None] * len(batch.num_logprobs)
        return logprobs_to_dicts(self.logprobs, self.token_ids, batch.num_logprobs)


class Sampler:
    """logits [R, V] -> one token per row (+ raw logprobs when asked). Stateless.

    Nothing here waits for the device: the caller's `.tolist()` of the tokens is the step's one
    host-device sync. An all-greedy batch without penalties, min_tokens or logprobs
    (`SamplingBatch.argmax_only`) is one argmax.
    """

    def __call__(
        self,
        logits: torch.Tensor,  # [R, V] float32 (other float dtypes are upcast)
        batch: SamplingBatch,
    ) -> SamplerOutput:
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = logits.float().log_softmax(dim=-1)  # [R, V]
        token_ids = sample_tokens(process_logits(logits, batch), batch)
        lp = None
        if raw_logprobs is not None:
            lp = gather_logprobs(raw_logprobs, token_ids, batch.max_num_logprobs)
        return SamplerOutput(token_ids, lp)
