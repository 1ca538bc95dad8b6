"""Trace replay: run a policy over a recorded (or synthetic) load trace, offline, as the engine would.

The model starts with the identity placement (`none`). At every step the step's load is served by the
current placement (balancedness measured); after step t, when (t + 1) % step_interval == 0 and fewer
than `max_rebalances` rebalances happened, the policy recomputes the placement from the load summed
over the last `window_size` steps. step_interval = 0 never rebalances; max_rebalances = 1 gives a
static placement computed once from a warm-up window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from research_lm.eplb.metrics import balancedness, rank_load, slot_load
from research_lm.eplb.registry import Policy, get_policy


@dataclass
class ReplayResult:
    policy: str
    balancedness_per_layer: torch.Tensor  # [num_steps, L] mean / max rank load of each step
    balancedness: torch.Tensor  # [num_steps] Σ_layers mean / Σ_layers max of each step
    est_step_time: torch.Tensor  # [num_steps] Σ_layers max rank load (token units)
    ideal_step_time: torch.Tensor  # [num_steps] Σ_layers mean rank load
    rebalance_steps: list[int] = field(default_factory=list)  # step after which each rebalance ran
    rebalance_ms: list[float] = field(default_factory=list)  # policy compute time of each rebalance
    moved_slots: list[int] = field(default_factory=list)  # slots (all layers) whose expert changed

    def summary(self) -> dict:
        est = float(self.est_step_time.sum())
        return {
            "policy": self.policy,
            "balancedness_mean": float(self.balancedness.mean()),
            "balancedness_min": float(self.balancedness.min()),
            # time-weighted: ideal / simulated time over the whole trace
            "balancedness_total": float(self.ideal_step_time.sum()) / est if est > 0 else 1.0,
            "num_rebalances": len(self.rebalance_steps),
            "rebalance_ms_median": (sorted(self.rebalance_ms)[len(self.rebalance_ms) // 2]
                                    if self.rebalance_ms else 0.0),
            "moved_slots_total": sum(self.moved_slots),
        }


def replay(
    load: torch.Tensor,  # [num_steps, L, num_logical] tokens per logical expert per step
    policy: str | Policy,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    step_interval: int,
    window_size: int,
    max_rebalances: int | None = None,
) -> ReplayResult:
    if load.dim() != 3:
        raise ValueError(f"load must be [num_steps, num_layers, num_logical], got shape {tuple(load.shape)}")
    if step_interval < 0 or window_size < 1:
        raise ValueError(f"need step_interval >= 0 and window_size >= 1, got {step_interval}, {window_size}")
    name = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    fn = get_policy(policy) if isinstance(policy, str) else policy
    num_steps = load.shape[0]
    load = load.to(torch.float64)
    phy2log, _, logcnt = get_policy("none")(load[0], num_replicas, num_groups, num_nodes, num_gpus)
    per_layer, overall, est, ideal = [], [], [], []
    steps, times, moved = [], [], []
    start = 0
    while start < num_steps:
        # steps [start, end) are served by the current placement
        end = num_steps
        if step_interval and (max_rebalances is None or len(steps) < max_rebalances):
            end = min(num_steps, (start // step_interval + 1) * step_interval)
        ranks = rank_load(slot_load(load[start:end], phy2log, logcnt), num_gpus)  # [T, L, R]
        b_layer, b_all = balancedness(ranks)
        per_layer.append(b_layer)
        overall.append(b_all)
        est.append(ranks.amax(-1).sum(-1))
        ideal.append(ranks.mean(-1).sum(-1))
        if end < num_steps:
            window = load[max(0, end - window_size):end].sum(0)
            t0 = time.perf_counter()
            new_phy2log, _, logcnt = fn(window, num_replicas, num_groups, num_nodes, num_gpus)
            times.append((time.perf_counter() - t0) * 1e3)
            steps.append(end - 1)
            moved.append(int((new_phy2log != phy2log).sum()))
            phy2log = new_phy2log
        start = end
    return ReplayResult(name, torch.cat(per_layer), torch.cat(overall), torch.cat(est), torch.cat(ideal),
                        steps, times, moved)
