"""Trace replay: run a policy over a recorded (or synthetic) load trace, offline, as the engine would.

The model starts with the identity placement (`none`). At every step the step's load is served by the
current placement (balancedness measured); after step t, when (t + 1) % step_interval == 0 and fewer
than `max_rebalances` rebalances happened, the policy recomputes the placement from the load summed
over the last `window_size` steps (or, for a policy with `history_buckets`, from that window's history in
buckets: `research_lm.eplb.registry`). step_interval = 0 never rebalances; max_rebalances = 1 gives a
static placement computed once from a warm-up window.

Dispatch: the policy's rule (`dispatch=None`) or the one given: `round_robin` splits a replicated expert's
tokens evenly, `least_loaded` balances them per step (`research_lm.eplb.dispatch`).

Moving weights (`layers_per_chunk`), the engine controller's schedule:
  None (sync): every layer switches at the step after the rebalance, which first waits for the whole move.
  c (async, chunked): chunk k (layers [k c, (k + 1) c)) is copied into staging behind the forward of the
    (k + 1)-th step after the rebalance and switches after it; that step stalls only for what does not fit
    behind its forward: max(0, chunk transfer - forward time). Layers not yet moved keep the old placement.
    A rebalance due while layers are still pending first moves them all (a sync stall for them).
With a `CostModel`, tokens become seconds (forward = Σ_layers max rank load x pair time) and each layer's move
takes its busiest rank's link time (`research_lm.eplb.metrics.migration`); without one, stalls are not modelled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from research_lm.eplb.dispatch import least_loaded
from research_lm.eplb.load import bucket_history
from research_lm.eplb.metrics import CostModel, migration, rank_load, slot_load, slots_used, spread_stats
from research_lm.eplb.registry import DISPATCH_RULES, Policy, get_policy, policy_traits


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
    layer_max: torch.Tensor | None = None  # [num_steps, L] max rank load
    layer_mean: torch.Tensor | None = None  # [num_steps, L] mean rank load
    moves: list[dict] = field(default_factory=list)  # per rebalance: Migration.summary
    slots_used: torch.Tensor | None = None  # [num_steps] mean over layers of the serving placement's slots used
    stall_s: torch.Tensor | None = None  # [num_steps] seconds the step waited for weights (with a cost model)
    cost: CostModel | None = None
    dispatch: str = "round_robin"

    def summary(self, from_step: int = 0) -> dict:
        """Metrics over steps [from_step, num_steps) (e.g. from the first rebalance on, leaving out the warm-up the
        identity placement serves); rebalances and moves: all of them."""
        steps = slice(from_step, None)
        balance = self.balancedness[steps]
        est, ideal = float(self.est_step_time[steps].sum()), float(self.ideal_step_time[steps].sum())
        out = {
            "policy": self.policy,
            "dispatch": self.dispatch,
            "balancedness_mean": float(balance.mean()),
            "balancedness_min": float(balance.min()),
            "balancedness_total": ideal / est if est > 0 else 1.0,  # time-weighted: ideal / simulated time
            "num_rebalances": len(self.rebalance_steps),
            "rebalance_ms_median": (sorted(self.rebalance_ms)[len(self.rebalance_ms) // 2]
                                    if self.rebalance_ms else 0.0),
            "moved_slots_total": sum(self.moved_slots),
            **spread_stats(balance, "balancedness_step"),
        }
        if self.layer_max is not None:  # per layer, time-weighted
            peak, mean = self.layer_max[steps].sum(0), self.layer_mean[steps].sum(0)
            out |= spread_stats(torch.where(peak > 0, mean / peak.clamp_min(1e-300), 1.0), "balancedness_layer")
        n = max(len(self.moves), 1)
        keys = ("experts_moved", "experts_moved_nvlink", "experts_moved_ib")
        for key in keys + (("bytes_moved", "transfer_ms") if self.cost is not None else ()):
            out[f"{key}_per_rebalance"] = sum(m[key] for m in self.moves) / n
        if self.slots_used is not None:
            out["slots_used"] = float(self.slots_used[steps].mean())  # per layer, time-weighted
        if self.cost is not None and self.stall_s is not None:
            pair_ms = self.cost.pair_seconds * 1e3
            num = len(self.est_step_time[steps])
            stall = self.stall_s[steps]
            out |= {
                "step_ms": (est * pair_ms + float(stall.sum()) * 1e3) / num,  # mean, stalls included
                "forward_ms": est * pair_ms / num,  # mean MoE expert compute: the slowest rank of each layer
                "ideal_step_ms": ideal * pair_ms / num,
                "stall_ms_per_step": float(stall.sum()) * 1e3 / num,
                "stall_ms_total": float(stall.sum()) * 1e3,
                "stall_ms_max": float(stall.max()) * 1e3,
            }
        return out


def _serve(
    load: torch.Tensor,  # [T, L, E]
    placement: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # (phy2log, log2phy, logcnt)
    num_gpus: int,
    dispatch: str,
) -> torch.Tensor:  # [T, L, R] rank loads
    phy2log, log2phy, logcnt = placement
    if dispatch == "least_loaded":
        return least_loaded(load, log2phy, num_gpus, phy2log.shape[-1] // num_gpus)[0]
    return rank_load(slot_load(load, phy2log, logcnt), num_gpus)


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
    dispatch: str | None = None,  # None: the policy's (registry traits)
    layers_per_chunk: int | None = None,  # None: sync moves; c: c layers per step behind the forward
    cost: CostModel | None = None,
) -> ReplayResult:
    if load.dim() != 3:
        raise ValueError(f"load must be [num_steps, num_layers, num_logical], got shape {tuple(load.shape)}")
    if step_interval < 0 or window_size < 1:
        raise ValueError(f"need step_interval >= 0 and window_size >= 1, got {step_interval}, {window_size}")
    if layers_per_chunk is not None and layers_per_chunk < 1:
        raise ValueError(f"layers_per_chunk must be >= 1 or None (sync), got {layers_per_chunk}")
    name = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    fn = get_policy(policy) if isinstance(policy, str) else policy
    traits = policy_traits(fn)
    dispatch = dispatch or traits.dispatch
    if dispatch not in DISPATCH_RULES:
        raise ValueError(f"unknown dispatch rule {dispatch!r}; choose one of {list(DISPATCH_RULES)}")
    num_steps, num_layers, _ = load.shape
    load = load.to(torch.float64)
    current = get_policy("none")(load[0], num_replicas, num_groups, num_nodes, num_gpus)
    ranks = torch.empty(num_steps, num_layers, num_gpus, dtype=torch.float64)
    stall = torch.zeros(num_steps, dtype=torch.float64)
    used = torch.empty(num_steps, dtype=torch.float64)
    result = ReplayResult(name, torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0), cost=cost,
                          dispatch=dispatch)
    pair_s = cost.pair_seconds if cost is not None else 0.0
    # the move in flight: old placement, each layer's first step on the new one, its transfer seconds
    old, switch, seconds = None, np.zeros(num_layers, dtype=np.int64), np.zeros(num_layers)
    start = 0
    while start < num_steps:
        # steps [start, end) are served by `current`, but layers not yet moved still serve `old`
        end = num_steps
        if step_interval and (max_rebalances is None or len(result.rebalance_steps) < max_rebalances):
            end = min(num_steps, (start // step_interval + 1) * step_interval)
        ranks[start:end] = _serve(load[start:end], current, num_gpus, dispatch)
        used[start:end] = slots_used(current[0], num_gpus).double().mean()
        if old is not None:  # layer l serves the old placement before step switch[l]
            last = min(int(switch.max()), end)
            if last > start:
                steps = torch.arange(start, last)[:, None]
                stale = steps < torch.from_numpy(switch)[None, :]  # [T', L]
                before = _serve(load[start:last], old, num_gpus, dispatch)
                ranks[start:last] = torch.where(stale[..., None], before, ranks[start:last])
                used[start:last] = torch.where(stale, slots_used(old[0], num_gpus).double(),
                                               slots_used(current[0], num_gpus).double()).mean(-1)
            for step in range(start, last):  # the chunk switching after this step moved behind its forward
                forward_s = float(ranks[step].amax(-1).sum()) * pair_s
                stall[step] += max(0.0, float(seconds[switch == step + 1].sum()) - forward_s)
        due = end < num_steps and bool(step_interval) and (
            max_rebalances is None or len(result.rebalance_steps) < max_rebalances)
        if due:
            stall[end] += float(seconds[switch > end].sum())  # an unfinished move completes first
            window = load[max(0, end - window_size):end]
            weight = bucket_history(window, traits.history_buckets) if traits.history_buckets else window.sum(0)
            t0 = time.perf_counter()
            new = fn(weight, num_replicas, num_groups, num_nodes, num_gpus)
            result.rebalance_ms.append((time.perf_counter() - t0) * 1e3)
            result.rebalance_steps.append(end - 1)
            move = migration(current[0], new[0], num_gpus, num_nodes)
            result.moved_slots.append(int(move.moved_slots.sum()))
            result.moves.append(move.summary(cost))
            seconds = move.layer_seconds(cost) if cost is not None else np.zeros(num_layers)
            if layers_per_chunk is None:  # sync: the next step first waits for every layer
                stall[end] += float(seconds.sum())
                old = None
            else:  # chunk k moves behind the forward of step end + k and serves from end + k + 1
                old, switch = current, end + np.arange(num_layers) // layers_per_chunk + 1
            current = new
        start = end
    peak, mean = ranks.amax(-1), ranks.mean(-1)  # [T, L]
    per_layer = torch.where(peak > 0, mean / peak.clamp_min(1e-300), 1.0)
    est, ideal = peak.sum(-1), mean.sum(-1)
    result.balancedness_per_layer = per_layer
    result.balancedness = torch.where(est > 0, ideal / est.clamp_min(1e-300), 1.0)
    result.est_step_time, result.ideal_step_time = est, ideal
    result.layer_max, result.layer_mean, result.slots_used = peak, mean, used
    if cost is not None:
        result.stall_s = stall
    return result
