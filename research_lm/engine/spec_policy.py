"""Whether the next step drafts: speculative_config's batch-aware policy.

Speculation pays where a verify step's extra tokens outweigh its extra cost, and both move with the batch: at batch
32 the target's step is no longer latency-bound, so a verify step of k + 1 tokens per request costs more, while the
acceptance of the drafts stays what it was. vLLM's `disable_by_batch_size` is a fixed cut; `"speculation_policy":
"adaptive"` measures instead. Per batch-size bucket (powers of two) it keeps an exponential moving average of the
output tokens per second of steps that verified drafts and of steps that did not (the acceptance estimate is in the
former: tokens per verify step), and drafts for the next step where speculation's rate is the higher. A bucket tries
each way until it has `warmup` steps of it, then re-tries the losing way one step in `explore_every`, so that a change
of acceptance (another part of the workload) is seen. A step that does not draft runs as plain decoding: no drafts,
no draft slots, launched ahead of its predecessor as a plain step is.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Rates:
    """Output tokens per second of one bucket's steps, with and without drafts (EMA), and their counts."""

    rate: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [plain, speculative]
    steps: list[int] = field(default_factory=lambda: [0, 0])
    since_explore: int = 0


class SpeculationPolicy:
    """Every step drafts (`"speculation_policy": "always"`, the default), except where running plus waiting requests
    outnumber `disable_by_batch_size` (then the scheduler skips verification, as vLLM does)."""

    measures = False  # whether `record` reads anything (the engine skips its per-step bookkeeping otherwise)

    def drafts(self, batch_size: int) -> bool:
        return True

    def record(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        return None


class AdaptivePolicy(SpeculationPolicy):
    measures = True

    def __init__(self, warmup: int = 4, explore_every: int = 32, smoothing: float = 0.2):
        self.warmup, self.explore_every, self.smoothing = warmup, explore_every, smoothing
        self.buckets: dict[int, _Rates] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(batch_size - 1, 0).bit_length()  # 1, 2, 4, 8, ...

    def drafts(self, batch_size: int) -> bool:
        b = self.buckets.setdefault(self.bucket(batch_size), _Rates())
        if min(b.steps) < self.warmup:
            return b.steps[1] <= b.steps[0]  # alternate until both ways are measured
        best = b.rate[1] >= b.rate[0]
        b.since_explore += 1
        if b.since_explore >= self.explore_every:
            b.since_explore = 0
            return not best
        return best

    def record(self, batch_size: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A collected decode step: its batch, whether it verified drafts, the tokens it emitted and its wall time."""
        if seconds <= 0 or num_tokens <= 0:
            return
        b = self.buckets.setdefault(self.bucket(batch_size), _Rates())
        way, rate = int(speculated), num_tokens / seconds
        b.rate[way] = rate if b.steps[way] == 0 else b.rate[way] + self.smoothing * (rate - b.rate[way])
        b.steps[way] += 1


POLICIES = {"always": SpeculationPolicy, "adaptive": AdaptivePolicy}


def build_policy(name: str | None, distributed: bool = False) -> SpeculationPolicy:
    """distributed: several ranks run the same schedule, which the adaptive policy's per-rank timings could split."""
    if (name or "always") not in POLICIES:
        raise ValueError(f"unknown speculation_policy {name!r}; choose one of {sorted(POLICIES)}")
    if name == "adaptive" and distributed:
        raise ValueError("speculation_policy='adaptive' decides from each rank's own step times, so ranks could "
                         "decide apart; with several ranks (tensor or expert parallelism) use 'always'")
    return POLICIES[name or "always"]()
