"""How many drafts the next step verifies: speculative_config's batch-aware policy.

Speculation pays where a verify step's extra tokens outweigh its extra cost, and both move with the batch: at batch
32 the target's step is no longer latency-bound, so a verify step of k + 1 tokens per request costs more, while the
acceptance of the drafts stays what it was. vLLM's `disable_by_batch_size` is a fixed cut; `"speculation_policy":
"adaptive"` measures instead. Its arms are caps on the drafts a request's next step verifies: 0 (no drafts: the step
runs as plain decoding, launched ahead as a plain step is, and nothing is drafted for it), 1, 2, 4, ... and k (all:
a chain's length, a token tree's node count; a cap keeps a chain's first drafts and a tree's first nodes, a
breadth-first subtree). Per batch-size bucket (powers of two) and arm it keeps discounted sums of the tokens its steps
emitted (and their squares) and of their seconds. After `warmup` steps of every arm it picks by Thompson sampling: a
draw of each arm's mean tokens per step from a normal around the measured mean (its variance at least that of a
uniform count over 1 .. reach + 1 per request, reach the most drafts the arm's step can accept (its cap, at most
a tree's depth), so that a few unlucky early steps never look certain), over its mean
seconds per step; the highest wins. Every step discounts the sums of the arm it measured (`decay`) and, ten times
more slowly, the bucket's other arms', so an arm not chosen for a while grows uncertain and is drawn again: a change of
acceptance (another part of the workload) is seen. Aged at the full rate, a dear arm (a 16-node tree's step costs ~9
plain ones) was drawn again in ~4 % of steps, 20 % of the run's time (spec_tree_h200, session 30). A cap
bounds what is verified, not what is drafted: a drafter still drafts its k (its graphs are captured for k), except
under arm 0. A step's time splits by arm: its drafting (for the next step, under the cap chosen now) is charged to
that cap's arm, the rest to the arm it verified under. Charged whole to the verified arm, a step of arm 0 followed by
drafting carried a drafting it did not use; where drafting is dear (a 16-node tree's eager levels) arm 0 then looked
slower than plain decoding is, and the policy never settled on it (a tree16 run stayed at 0.36x plain). Why
sampling rather than a moving average of each step's rate: after a run of unlucky steps of the best
arm the average locked onto a worse one (experiments/sim_spec_policy.py measures both against the best fixed arm).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# How fast an arm not chosen ages, relative to the one measured. In simulation (a tree-like dear arm, and
# experiments/sim_spec_policy.py's scenarios) 0.1 with 2 warm-up steps an arm took the tree case from 0.82x to 0.91x
# plain over 1000 steps and every sim scenario to >= 0.966x the best fixed cap (from >= 0.93x); a change of
# acceptance is still seen within ~30 steps (tests/engine/test_spec_policy.py).
UNCHOSEN_AGING = 0.1


@dataclass
class _Bucket:
    """One batch bucket's measurements per arm: discounted sums of steps, tokens, squared tokens and seconds."""

    sums: dict[int, list[float]] = field(default_factory=dict)  # arm -> [steps, tokens, tokens^2, seconds]
    steps: dict[int, int] = field(default_factory=dict)  # arm -> steps measured (undiscounted)


class SpeculationPolicy:
    """Every step drafts all k (`"speculation_policy": "always"`, the default), except where running plus waiting
    requests outnumber `disable_by_batch_size` (then the scheduler skips verification, as vLLM does)."""

    measures = False  # whether `record` reads anything (the engine skips its per-step bookkeeping otherwise)

    def choose(self, batch_size: int) -> int | None:
        """The most drafts per request the next step verifies: 0 none (nothing is drafted), None all."""
        return None

    def record(self, batch_size: int, arm: int, num_tokens: int, seconds: float) -> None:
        """A collected decode step: its batch, the cap its verification ran under (0: it verified no drafts; k: all),
        the tokens it emitted and its wall time, less the time it spent drafting (`charge`)."""
        return None

    def charge(self, batch_size: int, arm: int | None, seconds: float) -> None:
        """Time a step spent drafting under the cap `arm` (None: all k) for the next step: that arm's cost."""
        return None


class AdaptivePolicy(SpeculationPolicy):
    measures = True

    def __init__(self, num_speculative_tokens: int = 1, warmup: int = 2, decay: float = 0.005, seed: int = 0,
                 depth: int | None = None):
        k = num_speculative_tokens
        self.arms = sorted({0, k} | {1 << i for i in range(k.bit_length()) if 1 << i < k})  # 0, 1, 2, 4, ..., k
        self.depth = k if depth is None else depth  # the most drafts one step can accept: a tree's longest path
        self.warmup, self.decay = warmup, decay
        self.buckets: dict[int, _Bucket] = {}
        self.rng = random.Random(seed)  # the draws: the same decisions for the same measurements

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(batch_size - 1, 0).bit_length()  # 1, 2, 4, 8, ...

    def choose(self, batch_size: int) -> int | None:
        b = self.buckets.setdefault(self.bucket(batch_size), _Bucket())
        untried = [a for a in self.arms if b.steps.get(a, 0) < self.warmup]
        if untried:  # the least measured first: every arm gets its warm-up steps in turn
            return min(untried, key=lambda a: b.steps.get(a, 0))
        return max(self.arms, key=lambda a: self._draw(a, b.sums[a], batch_size))

    def _draw(self, arm: int, sums: list[float], batch_size: int) -> float:
        """Tokens per second with the mean tokens per step drawn from its posterior."""
        n, tokens, squares, seconds = sums
        mean = tokens / n
        # (a tree arm of 16 nodes emits at most depth + 1 tokens a request: a floor from its node count kept a
        # 16-node tree's step, ~9 plain ones, drawn in ~1 % of steps long after it had lost; spec_tree_h200, session 31)
        variance = max(squares / n - mean * mean, batch_size * (min(arm, self.depth) + 1) ** 2 / 12)
        return (mean + math.sqrt(variance / n) * self.rng.gauss(0.0, 1.0)) / (seconds / n)

    def record(self, batch_size: int, arm: int, num_tokens: int, seconds: float) -> None:
        if seconds <= 0 or num_tokens <= 0:
            return
        b = self.buckets.setdefault(self.bucket(batch_size), _Bucket())
        arm = self._arm_of(arm)
        for other, sums in b.sums.items():  # measurements age, so an arm left alone grows uncertain again
            decay = self.decay if other == arm else self.decay * UNCHOSEN_AGING
            sums[:] = [x * (1.0 - decay) for x in sums]
        sums = b.sums.setdefault(arm, [0.0, 0.0, 0.0, 0.0])
        sums[:] = [sums[0] + 1, sums[1] + num_tokens, sums[2] + num_tokens**2, sums[3] + seconds]
        b.steps[arm] = b.steps.get(arm, 0) + 1

    def charge(self, batch_size: int, arm: int | None, seconds: float) -> None:
        b = self.buckets.get(self.bucket(batch_size))
        arm = self._arm_of(arm)
        if b is not None and arm in b.sums and seconds > 0:  # (an arm not yet measured starts with its first step)
            b.sums[arm][3] += seconds

    def _arm_of(self, cap: int | None) -> int:
        """The arm a cap counts as: the smallest arm at least as large (a shorter step counts as its arm); None: k."""
        return self.arms[-1] if cap is None else min((a for a in self.arms if a >= cap), default=self.arms[-1])

    def rate(self, batch_size: int, arm: int) -> float:
        """The measured tokens per second of an arm in this batch's bucket (discounted means)."""
        _, tokens, _, seconds = self.buckets[self.bucket(batch_size)].sums[arm]
        return tokens / seconds


POLICIES = {"always": lambda k, depth: SpeculationPolicy(),
            "adaptive": lambda k, depth: AdaptivePolicy(k, depth=depth)}  # name -> (k, depth) -> policy


def build_policy(name: str | None, num_speculative_tokens: int, distributed: bool = False,
                 depth: int | None = None) -> SpeculationPolicy:
    """num_speculative_tokens: the drafts (a tree's nodes) per request and step, k; depth: the most of them one step
    can accept (a tree's longest path; None: k, a chain). distributed: several ranks run the same schedule, which the
    adaptive policy's per-rank timings could split."""
    if (name or "always") not in POLICIES:
        raise ValueError(f"unknown speculation_policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == "adaptive" and distributed:
        raise ValueError("speculation_policy='adaptive' decides from each rank's own step times, so ranks could "
                         "decide apart; with several ranks (tensor or expert parallelism) use 'always'")
    return POLICIES[name or "always"](num_speculative_tokens, depth)
