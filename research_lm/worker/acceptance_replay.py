"""Acceptance replay: every verify step runs for real, and each request's accepted-draft count comes from a profile.

A real-shaped target with random weights (`load_format=dummy`) accepts almost nothing, so its speculative speed says
nothing. Replay keeps acceptance and time apart: the draft forwards, the verify forward of k + 1 tokens, sampling, KV
writes, graphs and async launch all run; only how many drafts each request keeps is decided by an acceptance profile
(a trained pair's, or a paper's). The outputs are then meaningless; the time per token is real.

A profile is a JSON file (or the same dict):

    {"source": "vLLM #20780 EAGLE-3 Llama-3.1-8B MT-bench K=4",   # free text: where the numbers come from
     "num_speculative_tokens": k,
     "per_position": [a_1, ..., a_k],   # a_j = P(draft j accepted | drafts 1 .. j-1 accepted)
     "traces": [[[num_drafts, num_accepted], ...], ...] | null}   # per request, its verify steps in order (optional)

("trace": [[num_drafts, num_accepted], ...], one trace that every request replays, is read as "traces": [trace].)

Replayed count n of a request in a verify step (then capped by its real drafts this step):
- without a trace: n = the leading run of j with u_j < a_j, the u_j counter-based uniforms of the REPLAY stream at
  (the request's seed, its token count on the device), so a request's counts depend on nothing else in the batch;
- with traces: the i-th request admitted to the runner (0, 1, ...: prompt order, as the scheduler admits them)
  replays trace i mod len(traces): entry c of its num_accepted, c = the request's own verify steps so far (each step
  that verifies draft slots of it), from the start again after the last entry; a preempted request that comes back
  counts as a new one.
A profile of k positions serves a run of k' <= k drafts (its first k' rates: conditional rates truncate exactly);
k' > k is refused. A run with `record_acceptance=true` (research_lm/harness/experiment.py) writes its own profile:
the rates measured over all its requests, and every request's trace in prompt order, so that replaying the same
workload gives each request its own counts.

The request then emits its first n drafts and the target's token at row n (`StepReplay.apply`), all on the device
without a host sync. The counts come from device tables alone (each row's seed, trace and place in it), so a verify
graph computes them, and the emitted tokens, inside itself where it accepts greedily (`replay_greedy`, the same
numbers as an eager step): a replayed plain-greedy step costs what a real one does. Where a "verified" draft graph
re-derives acceptance from the verify's argmax rows, those rows are rewritten to agree (`forge_argmax`), so drafting
behind the verify graph and async launch stay on. Chains only.

Echo (`echo` = P > 0, the engine's `acceptance_replay_echo`): the target's token at row n is instead the token P
positions before it in the request's own text (the argmax where the text is shorter). Replay makes the text meaningless,
and a model-free drafter (ngram, suffix) drafts from the text: on a random target's tokens it finds no match and drafts
nothing, so its verify steps never run. With a prompt that repeats a block of P tokens and echo P, the text keeps
repeating it, the drafter finds the continuation every step as it finds real text's repeats in a real run, and the
profile decides how much of it is kept. The argmax is still computed, so a step costs what it costs without echo.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import research_lm.ops
from research_lm.assets import ASSETS
from research_lm.worker import rng
from research_lm.worker.rng import to_device

ProfileSpec = str | os.PathLike | dict[str, Any]


@dataclass(frozen=True)
class AcceptanceProfile:
    source: str
    num_speculative_tokens: int
    per_position: tuple[float, ...]  # [k] conditional acceptance rates
    traces: tuple[tuple[tuple[int, int], ...], ...] | None = None  # per request: (num_drafts, num_accepted) per
    # verify step, in order

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_position"] = list(self.per_position)
        d["traces"] = None if self.traces is None else [[list(s) for s in t] for t in self.traces]
        return d


SHIPPED_PROFILES = ASSETS / "profiles"  # <name>.json: published anchors


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in SHIPPED_PROFILES.glob("*.json"))


def load_profile(spec: ProfileSpec) -> AcceptanceProfile:
    """A profile from a JSON file's path, a shipped profile's name (research_lm/assets/profiles/<name>.json) or its
    dict; ValueError naming what is wrong."""
    if isinstance(spec, str | os.PathLike):
        path = Path(spec)
        if not path.is_file() and (SHIPPED_PROFILES / f"{spec}.json").is_file():
            path = SHIPPED_PROFILES / f"{spec}.json"
        if not path.is_file():
            raise ValueError(f"acceptance_replay: no profile file at {str(path)!r}, and no shipped profile of that "
                             f"name (shipped: {shipped_profiles()})")
        try:
            spec = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"acceptance_replay: {str(path)!r} is not JSON ({e})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"acceptance_replay must be a profile's path or dict, got {type(spec).__name__}")
    unknown = set(spec) - {"source", "num_speculative_tokens", "per_position", "trace", "traces"}
    if unknown:
        raise ValueError(f"acceptance profile: unknown key(s) {sorted(unknown)}")
    if spec.get("trace") is not None and spec.get("traces") is not None:
        raise ValueError("acceptance profile: give 'trace' (one for every request) or 'traces' (per request), not both")
    source, k, rates = spec.get("source"), spec.get("num_speculative_tokens"), spec.get("per_position")
    if not isinstance(source, str) or not source.strip():
        raise ValueError("acceptance profile: 'source' must say where the numbers come from (a non-empty string)")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"acceptance profile: 'num_speculative_tokens' must be a positive integer, got {k!r}")
    if (not isinstance(rates, list | tuple) or len(rates) != k
            or not all(isinstance(a, int | float) and not isinstance(a, bool) and 0.0 <= a <= 1.0 for a in rates)):
        raise ValueError(f"acceptance profile: 'per_position' must be {k} rates in [0, 1], got {rates!r}")
    traces = spec.get("traces")
    if spec.get("trace") is not None:
        traces = [spec["trace"]]
    elif traces is not None and (not isinstance(traces, list | tuple) or not traces):
        raise ValueError("acceptance profile: 'traces' must be null or a non-empty list of traces")
    return AcceptanceProfile(source, k, tuple(float(a) for a in rates),
                             None if traces is None else tuple(_trace(t) for t in traces))


def _trace(trace: Any) -> tuple[tuple[int, int], ...]:
    ok = isinstance(trace, list | tuple) and len(trace) > 0 and all(
        isinstance(s, list | tuple) and len(s) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
        and 0 <= s[1] <= s[0] and s[0] >= 1 for s in trace)
    if not ok:
        raise ValueError("acceptance profile: 'trace' must be null or a non-empty list of [num_drafts, num_accepted] "
                         "pairs with 0 <= num_accepted <= num_drafts and num_drafts >= 1")
    return tuple((int(d), int(a)) for d, a in trace)


def write_profile(profile: AcceptanceProfile, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    return path


def expected_tau(profile: AcceptanceProfile, k: int | None = None) -> float:
    """Mean tokens per verify step of a request verifying k drafts (default: the profile's k) under the rates:
    1 + sum_j prod_{i <= j} a_i."""
    tau, survive = 1.0, 1.0
    for a in profile.per_position[: k or profile.num_speculative_tokens]:
        survive *= a
        tau += survive
    return tau


def profile_from_rates(per_position: Sequence[float], source: str,
                       traces: Iterable[Iterable[Sequence[int]]] | None = None) -> AcceptanceProfile:
    """A profile from conditional per-position rates (and per-request traces), checked as a loaded one."""
    steps = None if traces is None else [[list(s) for s in t] for t in traces]
    return load_profile({"source": source, "num_speculative_tokens": len(per_position),
                         "per_position": list(per_position), "traces": steps})


def profile_from_tau(tau: float, k: int, source: str) -> AcceptanceProfile:
    """A published mean acceptance length tau at k drafts, read as Leviathan et al.'s i.i.d. model: every draft
    accepted with the same alpha, 1 + alpha + ... + alpha^k = tau. A paper's per-position rates, where it gives
    them, are better: real acceptance falls with the position."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"tau must be in [1, k + 1] = [1, {k + 1}], got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: tau(alpha) increases with alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**j for j in range(k + 1)) < tau else (lo, mid)
    return profile_from_rates([(lo + hi) / 2] * k, source)


def profile_from_steps(steps: Iterable[Sequence[int]], k: int, source: str,
                       traces: Iterable[Iterable[Sequence[int]]] | None = None) -> AcceptanceProfile:
    """The conditional rates measured from verify steps (num_drafts, num_accepted): a_j = steps that accepted draft j
    / steps that judged it (had it, and accepted drafts 1 .. j-1): their maximum-likelihood estimate; 0 for a
    position no step judged."""
    judged, accepted = [0] * k, [0] * k
    for d, a in steps:
        for j in range(min(a + 1, d, k)):
            judged[j] += 1
            accepted[j] += j < a
    return profile_from_rates([a / n if n else 0.0 for a, n in zip(accepted, judged)], source, traces)


class AcceptanceReplay:
    """The engine's replay of one profile (module docstring): per verify step, each request's replayed count, from
    device tables alone (its seed, its trace and its place in it, by table row), so that a verify graph computes the
    counts inside itself exactly as an eager step does."""

    def __init__(self, profile: AcceptanceProfile, num_speculative_tokens: int, device: torch.device,
                 max_num_reqs: int, echo: int = 0):
        if num_speculative_tokens > profile.num_speculative_tokens:
            raise ValueError(f"acceptance_replay: the profile ({profile.source}) has rates for "
                             f"{profile.num_speculative_tokens} draft positions; the run drafts "
                             f"{num_speculative_tokens} (num_speculative_tokens)")
        if echo and echo <= num_speculative_tokens:  # (the echoed token is then already in the token table)
            raise ValueError(f"acceptance_replay_echo must exceed num_speculative_tokens ({num_speculative_tokens}), "
                             f"got {echo}")
        self.profile = profile
        self.echo = echo
        self.source = profile.source
        self.device = device
        self.rates = torch.tensor(profile.per_position[:num_speculative_tokens], dtype=torch.float32, device=device)
        self.seeds = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)  # [R] each row's request seed
        self.traces = self.trace_lens = None
        if profile.traces:
            width = max(len(t) for t in profile.traces)
            self.traces = torch.tensor([[a for _, a in t] + [0] * (width - len(t)) for t in profile.traces],
                                       dtype=torch.int64, device=device)  # [T, L] num_accepted, padded
            self.trace_lens = torch.tensor([len(t) for t in profile.traces], dtype=torch.int64, device=device)
        self.trace_of = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)  # [R] the row's trace
        self.cursor = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)  # [R] its verify steps so far
        self._ones = torch.ones(max_num_reqs, dtype=torch.int64, device=device)
        self._admitted: set[str] = set()
        self._num_admitted = 0  # the next request admitted replays trace _num_admitted mod T

    def admit(self, gone: Iterable[str], requests: Sequence[Any], row_of: dict[str, int]) -> None:
        """Forget the requests gone (a request preempted and back is admitted anew); then the step's requests new to
        the replay (engine Requests, in the step's order): their row's seed, trace (the i-th admitted replays trace
        i mod T) and cursor, in one copy. Call before the step's forward."""
        self._admitted.difference_update(gone)
        new = [r for r in requests if r.request_id not in self._admitted]
        if not new:
            return
        self._admitted.update(r.request_id for r in new)
        n, traces = len(new), len(self.profile.traces or ()) or 1
        which = [(self._num_admitted + i) % traces for i in range(n)]
        self._num_admitted += n
        up = to_device([row_of[r.request_id] for r in new] + [r.seed for r in new] + which, torch.int64, self.device)
        rows, seeds, which_t = up.split(n)
        self.seeds.index_copy_(0, rows, seeds)
        self.trace_of.index_copy_(0, rows, which_t)
        self.cursor.index_fill_(0, rows, 0)

    def rewind(self) -> None:
        """The next request admitted replays trace 0 again: a measured run after warm-up requests gives its i-th
        request the i-th recorded trace, as in the run that recorded them."""
        self._num_admitted = 0

    def counts(
        self,
        rows: torch.Tensor,  # [n] int64 on the device: each request's table row, -1 for a graph's padding
        num_tokens: torch.Tensor,  # [n] int on the device: each request's tokens before this step (prompt + outputs)
        k: int,  # draft slots at most
    ) -> torch.Tensor:  # [n] int64 on the device: replayed accepted drafts (uncapped by the real ones)
        """The replayed counts, device ops only and no side effect (a verify graph computes them whether or not the
        host then takes its acceptance; `advance` moves the traces on, once per verify step)."""
        safe = rows.clamp(min=0)
        if self.traces is not None:
            which = self.trace_of[safe]
            return self.traces[which, self.cursor[safe] % self.trace_lens[which]]
        u = rng.uniform_rows(self.seeds[safe], num_tokens.to(torch.int64), rng.REPLAY, k, self.device)  # [n, k]
        return (u < self.rates[:k]).long().cumprod(dim=1).sum(dim=1)

    def echoed(
        self,
        token_ids: torch.Tensor,  # [R, W] the requests' token table
        rows: torch.Tensor,  # [n] int64: table rows (>= 0)
        num_tokens: torch.Tensor,  # [n] int: their tokens before the step
        count: torch.Tensor,  # [n] int64: their emitted drafts (row n's token goes to position num_tokens + n)
    ) -> torch.Tensor | None:  # [n] int64: the token `echo` positions before it, -1 where none; None without echo
        if not self.echo:
            return None
        at = num_tokens.long() + count - self.echo
        return torch.where(at >= 0, token_ids[rows, at.clamp(min=0)].long(), -1)

    def accept_greedily(
        self,
        num_tokens: torch.Tensor,  # [R] int: every table row's tokens before the step
        token_ids: torch.Tensor,  # [R, W] int: the token table (read with `echo`)
        rows: torch.Tensor,  # [>= b] int32: each request's table row, -1 on padding
        num_drafts: torch.Tensor,  # [R] int32: every table row's real drafts
        input_ids: torch.Tensor,  # [>= b*q] int64: the step's ids (each request's newest token, then its drafts)
        greedy: torch.Tensor,  # [>= b*q] int64: their argmax (rows 0 .. n of each request are overwritten)
        logits: torch.Tensor,  # [>= b*q, V] float32
        packed: torch.Tensor,  # [>= b*q + 2b] int64, written: emitted, n + 1, real (`GraphStep.accepted`)
        b: int,
        q: int,
    ) -> None:
        """A verify graph's greedy acceptance of b plain-greedy requests of q rows under replay: `counts` capped by
        the real drafts, then `replay_greedy`; on CUDA one kernel (research_lm/ops/replay_accept.py), the same
        numbers."""
        if self.device.type in research_lm.ops.FUSED_DEVICE_TYPES:
            from research_lm.ops.replay_accept import replay_accept  # Triton, imported when a kernel runs

            return replay_accept(self, rows, num_tokens, token_ids, num_drafts, input_ids, greedy, logits, packed,
                                 b, q)
        t, row = b * q, rows[:b].long()
        safe = row.clamp(min=0)
        real = num_drafts[safe].long()
        n_acc = torch.minimum(self.counts(row, num_tokens[safe], q - 1), real)
        emitted = replay_greedy(logits[:t].view(b, q, -1), greedy[:t].view(b, q), input_ids[:t].view(b, q)[:, 1:],
                                n_acc, real, self.echoed(token_ids, safe, num_tokens[safe], n_acc))
        packed[:t].view(b, q).copy_(emitted)
        packed[t : t + b].copy_(n_acc + 1)
        packed[t + b : t + 2 * b].copy_(real)

    def advance(self, rows: torch.Tensor, verifies: torch.Tensor | None = None) -> None:
        """After a verify step: the traces of its requests (rows [n] int32 or int64 on the device) that had draft slots
        (verifies [n] bool; None: all) move on one entry."""
        if self.traces is not None:  # (one kernel where all verify: a replay step's bookkeeping shows in its time)
            step = self._ones[: len(rows)] if verifies is None else verifies.long()
            self.cursor.index_add_(0, rows, step)


def replay_greedy(logits: torch.Tensor, greedy: torch.Tensor, drafts: torch.Tensor, count: torch.Tensor,
                  real: torch.Tensor, echoed: torch.Tensor | None = None) -> torch.Tensor:
    """A uniform verify step of plain-greedy requests under replay, device ops only (verify graphs run it): logits
    [b, q, V], greedy [b, q] their argmax, drafts [b, q - 1], count [b] replayed counts (<= real [b]). Emitted [b, q]:
    the first count drafts, then row count's argmax with draft count + 1 excluded where it is real (greedy
    rejection's correction; the echoed token instead where `echoed` [b] has one), -1 after; greedy's rows 0 .. count
    are rewritten to them (`forge_argmax`)."""
    row = logits[torch.arange(len(count), device=logits.device), count]  # [b, V]: row n of each request
    last = _corrected(row, drafts, count, real)
    emitted = _lay_out(drafts, count, last if echoed is None else torch.where(echoed >= 0, echoed, last))
    forge_argmax(greedy.view(-1), emitted, count)
    return emitted


def _corrected(row: torch.Tensor, drafts: torch.Tensor, count: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Row n's argmax (row [n, V]) with draft n + 1 excluded where it is real: greedy rejection's correction. [n]"""
    rejected = drafts.gather(1, count.clamp(max=drafts.shape[1] - 1)[:, None]).clamp(0, row.shape[-1] - 1)  # [n, 1]
    hide = torch.where(count[:, None] < real[:, None], float("-inf"), row.gather(1, rejected))
    return row.scatter(1, rejected, hide).argmax(dim=-1)


def _lay_out(drafts: torch.Tensor, count: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The first count drafts, then last, then -1: [n, k + 1]."""
    j = torch.arange(drafts.shape[1] + 1, device=drafts.device)
    padded = torch.cat([drafts, drafts.new_zeros(len(count), 1)], dim=1)
    return torch.where(j < count[:, None], padded, torch.where(j == count[:, None], last[:, None], -1))


@dataclass(frozen=True)
class StepReplay:
    """One verify step's replay: the engine's `AcceptanceReplay` and each sampling request's token count."""

    replay: AcceptanceReplay
    rows: torch.Tensor  # [n] int64 on the device: the sampling requests' table rows
    num_tokens: torch.Tensor  # [n] int on the device: prompt + outputs before the step
    token_ids: torch.Tensor  # [R, W] the token table (read with echo)

    def apply(
        self,
        num_drafts: Sequence[int],  # [n] draft slots of each sampling request, in batch order (host)
        drafts: torch.Tensor,  # [n, k] int64: its draft slots (past num_real: anything)
        num_real: torch.Tensor,  # [n] int: real drafts
        emitted: torch.Tensor,  # [n, k + 1] int64: the real verification's tokens, -1 after
        num_emitted: torch.Tensor,  # [n] int32: how many
        logits: torch.Tensor,  # [rows, vocab] the step's sampled rows
        target_row: torch.Tensor | None,  # [n, k + 1] int64: request i's row j among them; None: i * (k + 1) + j
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # emitted [n, k + 1] int64, num_emitted [n] int32, n [n]
        """Emit the first n replayed drafts, then the target's token at row n: the real verification's where it kept
        n drafts too, else the argmax of row n with draft n + 1 (where real) excluded, greedy rejection's correction
        (the echoed token instead, with echo).
        For a plain-greedy request both are that argmax, so the emitted tokens are the argmax rows 0 .. n of a
        verify whose drafts 1 .. n were the argmax: what a "verified" draft graph reads (`forge_argmax`)."""
        n, k = drafts.shape
        count = torch.minimum(self.replay.counts(self.rows, self.num_tokens, k), num_real.to(torch.int64))
        self.replay.advance(self.rows, to_device([d > 0 for d in num_drafts], torch.bool, drafts.device))
        if target_row is None:
            at = torch.arange(n, device=drafts.device) * (k + 1) + count
        else:
            at = target_row.gather(1, count[:, None])[:, 0]
        corrected = _corrected(logits[at].float(), drafts, count, num_real)  # row n of each request's
        real_last = emitted.gather(1, (num_emitted.long() - 1).clamp(min=0)[:, None])[:, 0]
        last = torch.where(num_emitted.long() - 1 == count, real_last, corrected)
        echoed = self.replay.echoed(self.token_ids, self.rows, self.num_tokens, count)
        if echoed is not None:
            last = torch.where(echoed >= 0, echoed, last)
        return _lay_out(drafts, count, last), (count + 1).to(torch.int32), count


def forge_argmax(greedy_ids: torch.Tensor, emitted: torch.Tensor, count: torch.Tensor) -> None:
    """Write the replayed tokens into a uniform verify step's argmax rows 0 .. n of each request (greedy_ids [n * (k +
    1)] int64, in place), so a "verified" draft graph that re-derives acceptance from (argmax, drafts) finds n and
    enters the emitted tokens (spec_decode/draft_graphs.py). The later rows keep the real argmax."""
    n, m = emitted.shape
    view = greedy_ids.view(n, m)
    view.copy_(torch.where(torch.arange(m, device=emitted.device) <= count[:, None], emitted, view))
