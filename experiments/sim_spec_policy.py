"""The adaptive speculation policy against the best fixed draft cap, in simulation (CPU, ~10 s a repeat).

    python experiments/sim_spec_policy.py              # 3 repeats (each: its own 20 seeds per cell)

A simulated request at batch 1 verifies arm a drafts (a cap of 0, 1, 2 or 4 of k = 4) per step: each draft accepted
with probability alpha while the ones before it were (tokens per step: 1 + the accepted run), and the step costs
base + per-draft x a ms with 5 % noise. Per scenario (alpha, costs) and run length, each cell gives the policy's output
tokens per second over the best fixed arm's on the same seed, the mean and the worst over the seeds: for
research_lm.engine.spec_policy.AdaptivePolicy (Thompson sampling) and for `MovingAverage`, the policy it replaced
(an EMA of each step's tokens per second, the fastest arm taken, the others re-tried one step in 32). Issue 29's goal
for the adaptive policy is >= 0.95x of always-drafting in every cell of spec_tree_h200; at batch 1 the GPU measured
0.91x with `MovingAverage` (PERFORMANCE.md, twenty-fifth pass).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
from typing import Any

import torch
from bench_common import add_repeat_args, cell, env_line, repeats_line, run_table

from research_lm.engine.spec_policy import AdaptivePolicy, SpeculationPolicy

NAME = "sim_spec_policy"
K = 4
# (alpha, base ms, ms per draft): cheap drafts with high / middling acceptance, costly drafts, a case where
# speculation does not pay (arm 0 wins), and one where a step of all k drafts costs ~9 plain steps (a 16-node tree's
# on the H200, spec_tree_h200), however well they are accepted.
SCENARIOS = [(0.8, 0.6, 0.05), (0.6, 0.6, 0.05), (0.7, 0.7, 0.25), (0.5, 0.6, 0.15), (0.3, 0.6, 0.3), (0.8, 0.5, 1.0)]
_repeat = itertools.count()


class MovingAverage(SpeculationPolicy):
    """The policy before Thompson sampling: an EMA (0.2) of each step's tokens per second per arm after 4 warm-up
    steps each, the fastest taken, the others re-tried in turn one step in 32."""

    def __init__(self, k: int):
        self.arms = AdaptivePolicy(k).arms
        self.ema: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self.explored = self.since = 0

    def choose(self, batch_size: int) -> int | None:
        untried = [a for a in self.arms if self.count.get(a, 0) < 4]
        if untried:
            return min(untried, key=lambda a: self.count.get(a, 0))
        best = max(self.arms, key=self.ema.__getitem__)
        self.since += 1
        if self.since >= 32:
            self.since, self.explored = 0, self.explored + 1
            others = [a for a in self.arms if a != best]
            return others[(self.explored - 1) % len(others)]
        return best

    def record(self, batch_size: int, arm: int, num_tokens: int, seconds: float) -> None:
        rate = num_tokens / seconds
        self.ema[arm] = rate if arm not in self.ema else self.ema[arm] + 0.2 * (rate - self.ema[arm])
        self.count[arm] = self.count.get(arm, 0) + 1


class Fixed(SpeculationPolicy):
    def __init__(self, arm: int):
        self.arm = arm

    def choose(self, batch_size: int) -> int | None:
        return self.arm


def simulate(policy: SpeculationPolicy, alpha: float, base: float, per_draft: float, steps: int, seed: int) -> float:
    """Output tokens per second of `steps` decode steps at batch 1 under the policy."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(steps):
        arm = policy.choose(1)
        arm = K if arm is None else arm
        n = 1
        while n <= arm and rng.random() < alpha:
            n += 1
        s = (base + per_draft * arm) * (1 + 0.05 * rng.gauss(0.0, 1.0)) / 1e3
        policy.record(1, arm, n, s)
        tokens, seconds = tokens + n, seconds + s
    return tokens / seconds


def measure(args) -> dict[str, Any]:
    first = next(_repeat) * args.seeds
    rows = []
    for (alpha, base, per_draft), steps in itertools.product(SCENARIOS, args.steps):
        ratios: dict[str, list[float]] = {"adaptive": [], "moving_average": []}
        for seed in range(first, first + args.seeds):
            run = (alpha, base, per_draft, steps, seed)
            best = max(simulate(Fixed(a), *run) for a in AdaptivePolicy(K).arms)
            ratios["adaptive"].append(simulate(AdaptivePolicy(K, seed=seed), *run) / best)
            ratios["moving_average"].append(simulate(MovingAverage(K), *run) / best)
        rows.append({"scenario": f"alpha {alpha}, {base} + {per_draft} ms/draft", "steps": steps,
                     **{f"{p}_mean": statistics.mean(r) for p, r in ratios.items()},
                     **{f"{p}_min": min(r) for p, r in ratios.items()}})
    return {"rows": rows, "seeds": args.seeds}


def render(payload: dict[str, Any]) -> str:
    lines = [env_line(payload["env"]), "",
             f"Policy / best fixed draft cap, output tokens per second at batch 1, k = {K} (arms 0 / 1 / 2 / 4), "
             f"{payload['seeds']} seeds a cell: their mean and worst. " + repeats_line(payload), "",
             "| scenario | steps | adaptive (Thompson) mean | worst | moving average (before) mean | worst |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in payload["rows"]:
        lines.append(f"| {r['scenario']} | {r['steps']} | {cell(r, 'adaptive_mean', '.3f')} | "
                     f"{cell(r, 'adaptive_min', '.3f')} | {cell(r, 'moving_average_mean', '.3f')} | "
                     f"{cell(r, 'moving_average_min', '.3f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--steps", type=int, nargs="+", default=[300, 1000], help="decode steps per run")
    add_repeat_args(p, default_repeats=3)
    args = p.parse_args(argv)
    return run_table(args.name or NAME, torch.device("cpu"), args, measure, render, ("scenario", "steps"))


if __name__ == "__main__":
    main()
