"""How many drafts the next step verifies: speculative_config's batch-aware policy.

Speculation pays where a verify step's extra tokens outweigh its extra cost, and both move with the batch: at batch
32 the target's step is no longer latency-bound, so a verify step of k + 1 tokens per request costs more, while the
acceptance of the drafts stays what it was. vLLM's `disable_by_batch_size` is a fixed cut; `"speculation_policy":
"adaptive"` measures instead. Its arms are caps on the drafts a request's next step verifies: 0 (no drafts: the step
runs as plain decoding, launched ahead as a plain step is, and nothing is drafted for it), 1, 2, 4, ... and k (all:
a chain's length, a token tree's node count; a cap keeps a chain's first drafts and a tree's first nodes, a
breadth-first subtree). Per batch-size bucket (powers of two) it keeps an exponential moving average of the output
tokens per second of the steps verified under each arm (the acceptance estimate is in it: tokens per step), and picks
the fastest. A bucket tries each arm until it has `warmup` steps of it, then re-tries the other arms in turn, one step
in `explore_every`, so that a change of acceptance (another part of the workload) is seen. A cap bounds what is
verified, not what is drafted: a drafter still drafts its k (its graphs are captured for k), except under arm 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Rates:
    """Output tokens per second of one bucket's steps under each arm (EMA), and their counts."""

    rate: dict[int, float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    since_explore: int = 0
    explored: int = 0  # the arms re-tried so far, to take them in turn


class SpeculationPolicy:
    """Every step drafts all k (`"speculation_policy": "always"`, the default), except where running plus waiting
    requests outnumber `disable_by_batch_size` (then the scheduler skips verification, as vLLM does)."""

    measures = False  # whether `record` reads anything (the engine skips its per-step bookkeeping otherwise)

    def choose(self, batch_size: int) -> int | None:
        """The most drafts per request the next step verifies: 0 none (nothing is drafted), None all."""
        return None

    def record(self, batch_size: int, arm: int, num_tokens: int, seconds: float) -> None:
        """A collected decode step: its batch, the cap its verification ran under (0: it verified no drafts; k: all),
        the tokens it emitted and its wall time."""
        return None


class AdaptivePolicy(SpeculationPolicy):
    measures = True

    def __init__(self, num_speculative_tokens: int = 1, warmup: int = 4, explore_every: int = 32,
                 smoothing: float = 0.2):
        k = num_speculative_tokens
        self.arms = sorted({0, k} | {1 << i for i in range(k.bit_length()) if 1 << i < k})  # 0, 1, 2, 4, ..., k
        self.warmup, self.explore_every, self.smoothing = warmup, explore_every, smoothing
        self.buckets: dict[int, _Rates] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(batch_size - 1, 0).bit_length()  # 1, 2, 4, 8, ...

    def choose(self, batch_size: int) -> int | None:
        b = self.buckets.setdefault(self.bucket(batch_size), _Rates())
        untried = [a for a in self.arms if b.steps.get(a, 0) < self.warmup]
        if untried:  # the least measured first: every arm gets its warm-up steps in turn
            return min(untried, key=lambda a: b.steps.get(a, 0))
        best = max(self.arms, key=lambda a: b.rate[a])
        b.since_explore += 1
        if b.since_explore >= self.explore_every:
            b.since_explore = 0
            others = [a for a in self.arms if a != best]
            b.explored += 1
            return others[(b.explored - 1) % len(others)]
        return best

    def record(self, batch_size: int, arm: int, num_tokens: int, seconds: float) -> None:
        if seconds <= 0 or num_tokens <= 0:
            return
        b = self.buckets.setdefault(self.bucket(batch_size), _Rates())
        arm = min((a for a in self.arms if a >= arm), default=self.arms[-1])  # a shorter step counts as its arm
        rate = num_tokens / seconds
        b.rate[arm] = rate if arm not in b.rate else b.rate[arm] + self.smoothing * (rate - b.rate[arm])
        b.steps[arm] = b.steps.get(arm, 0) + 1


POLICIES = {"always": lambda k: SpeculationPolicy(), "adaptive": AdaptivePolicy}  # name -> (k) -> policy


def build_policy(name: str | None, num_speculative_tokens: int, distributed: bool = False) -> SpeculationPolicy:
    """num_speculative_tokens: the drafts (a tree's nodes) per request and step, k. distributed: several ranks run the
    same schedule, which the adaptive policy's per-rank timings could split."""
    if (name or "always") not in POLICIES:
        raise ValueError(f"unknown speculation_policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == "adaptive" and distributed:
        raise ValueError("speculation_policy='adaptive' decides from each rank's own step times, so ranks could "
                         "decide apart; with several ranks (tensor or expert parallelism) use 'always'")
    return POLICIES[name or "always"](num_speculative_tokens)
