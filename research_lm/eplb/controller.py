"""The EPLB step the engine runs after every runner step: record expert load, rebalance, simulate EP.

    controller = build_eplb_controller(model, eplb_config)   # None for dense models / nothing to do
    ... after each runner step:  controller.step()
    controller.summary()  ->  dict for results.json (and writes the trace file when one was asked for)

Per step (device ops only, no host sync): the MoE layers' slot counters [L, P] are read and zeroed,
mapped to logical experts (tokens per expert, a token routed to k experts counts k times) and pushed
into an `ExpertLoadWindow` of `window_size` steps and, when `record_trace` is set, a `TraceRecorder`
(which copies each step's [L, E] load to the host: a sync per step, only when recording).
The same counters, split into `num_ep_ranks` virtual ranks (slots [r * P/R, (r + 1) * P/R) on rank r),
give the simulated EP metrics of `research_lm.eplb.metrics` with the replicas' actual token counts.

After step t (1-based) with t % step_interval == 0, while fewer than `max_rebalances` rebalances
happened, the policy places experts from the windowed logical load (or its bucketed history, for a policy
with `history_buckets`) and the layers move their weights in place: all at once (the step waits for the whole
move), or, with `rebalance_layers_per_chunk` = c, c layers after each of the following steps (chunk k after
step t + k + 1; a rebalance due earlier first finishes the move). Windowing, the schedule and the dispatch rule
are `research_lm.eplb.replay`'s, so replaying a recorded trace with the same settings reproduces the engine's
placements. The summary carries vLLM's metrics: balancedness per layer and per step (min / p50 / p90 / avg),
rearrangements with their policy and move times, experts and bytes moved and the transfer time they imply at
`nvlink_gbps` / `ib_gbps` over `num_nodes` (research_lm.eplb.metrics.migration), and the slots used.

With real EP (layers built with an `ep_group`) every rank must call `step()` once per engine step, and all
ranks compute the same placement and move weights together. Layer EP (each rank its own tokens): the
rebalance all-reduces the windowed load; counters, metrics and traces are of this rank's tokens. Engine EP
(`ep_replicated_tokens`): every rank routes every token, so the counters already hold the whole load and
the metrics and the trace (written by rank 0) equal a single-process run's; the rebalance takes rank 0's
window, so that the ranks agree even if their floating point ever differed.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from research_lm.eplb.load import ExpertLoadWindow, physical_to_logical
from research_lm.eplb.metrics import CostModel, migration, rank_load, slots_used, spread_stats
from research_lm.eplb.registry import get_policy, policy_traits
from research_lm.eplb.settings import EplbSettings
from research_lm.eplb.trace import TraceRecorder
from research_lm.moe.layer import FusedMoE, MoeGate


def moe_layers(model: nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def build_eplb_controller(model: nn.Module, eplb_config: dict[str, Any] | None) -> EplbController | None:
    """None for a dense model, no config, or a run with nothing to do (identity placement that never
    rebalances, records no trace and has one EP rank, so every metric would be trivially 1)."""
    layers = moe_layers(model)
    if not layers or eplb_config is None:
        return None
    settings = EplbSettings.from_dict(eplb_config)
    idle = settings.policy == "none" and settings.step_interval == 0 and settings.num_ep_ranks == 1
    if idle and not settings.record_trace:
        return None
    gates = [m for m in model.modules() if isinstance(m, MoeGate)]
    config = getattr(model, "config", None)
    meta = {
        "model": (getattr(config, "architectures", None) or ["?"])[0],
        "top_k": gates[0].config.top_k if gates else None,
        "num_groups": layers[0].num_groups,
    }
    return EplbController(layers, settings, meta)


class EplbController:
    def __init__(self, layers: list[FusedMoE], settings: EplbSettings, meta: dict[str, Any] | None = None):
        first = layers[0]
        self.num_experts, self.num_slots, self.num_groups = first.num_experts, first.num_slots, first.num_groups
        for layer in layers:
            if (layer.num_experts, layer.num_slots, layer.num_groups) != (self.num_experts, self.num_slots,
                                                                         self.num_groups):
                raise ValueError("EPLB needs every MoE layer to have the same experts, slots and groups")
        if self.num_slots != self.num_experts + settings.num_redundant_experts:
            raise ValueError(
                f"the model was built with {self.num_slots - self.num_experts} redundant experts per layer, "
                f"the eplb config asks for {settings.num_redundant_experts}: build the model with the same config"
            )
        settings.check_experts(self.num_experts)
        self.layers = layers
        self.settings = settings
        self.meta = {**(meta or {}), "source": "research_lm.engine.llm_engine", "policy": settings.policy,
                     "step_interval": settings.step_interval, "window_size": settings.window_size,
                     "num_physical_experts": self.num_slots}
        self.policy = get_policy(settings.policy)
        self.traits = policy_traits(self.policy)
        num_layers = len(layers)
        device = first.expert_load.device
        # One [L, P] counter; each layer's `expert_load` becomes a view of its row.
        self.counts = torch.zeros(num_layers, self.num_slots, dtype=torch.int64, device=device)
        for i, layer in enumerate(layers):
            layer.expert_load = self.counts[i]
            layer.record_load = True
        self.phy2log = torch.stack([layer.phy2log for layer in layers])  # [L, P]
        self.window = ExpertLoadWindow(num_layers, self.num_experts, settings.window_size, device=device)
        self.recorder = TraceRecorder(num_layers, self.num_experts) if settings.record_trace else None
        self._trace_steps_saved = -1
        self.num_steps = 0
        # Simulated-EP accumulators (device, float64): Σ over steps of each layer's max / mean rank load.
        self._layer_max = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self._layer_mean = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self._rank_total = torch.zeros(settings.num_ep_ranks, dtype=torch.float64, device=device)
        self._step_est: list[torch.Tensor] = []  # 0-d per step: Σ_layers max rank load
        self._step_ideal: list[torch.Tensor] = []  # 0-d per step: Σ_layers mean rank load
        self._step_layer: list[torch.Tensor] = []  # [L] per step: mean / max rank load of each layer
        self.rebalance_steps: list[int] = []
        self.policy_ms: list[float] = []
        self.move_ms: list[float] = []  # per rebalance: wall time of all its moves (its chunks summed)
        self.moved_slots: list[int] = []
        self.moves: list[dict[str, float]] = []  # per rebalance: Migration.summary at the settings' bandwidths
        self.stall_ms: dict[int, float] = {}  # step -> wall ms that step waited for weights
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # placement being moved
        self._next_layer = 0  # layers [0, _next_layer) of the pending placement are in place
        slot_bytes = first.slot_bytes()
        self.cost = CostModel(expert_bytes=slot_bytes, nvlink_gbps=settings.nvlink_gbps, ib_gbps=settings.ib_gbps)

    @property
    def num_rebalances(self) -> int:
        return len(self.rebalance_steps)

    def _rebalance_due(self) -> bool:
        s = self.settings
        if not s.step_interval or self.num_steps % s.step_interval:
            return False
        return s.max_rebalances is None or self.num_rebalances < s.max_rebalances

    @torch.no_grad()
    def step(self) -> None:
        """Record this step's load (call once after every runner step); rebalance when due."""
        physical = self.counts.clone()  # [L, P]
        self.counts.zero_()
        logical = physical_to_logical(physical, self.phy2log, self.num_experts)  # [L, E]
        self.window.record(logical)
        if self.recorder is not None:
            self.recorder.record(logical)
        ranks = rank_load(physical.to(torch.float64), self.settings.num_ep_ranks)  # [L, R]
        peak, mean = ranks.amax(-1), ranks.mean(-1)
        self._layer_max += peak
        self._layer_mean += mean
        self._rank_total += ranks.sum(0)
        self._step_est.append(peak.sum())
        self._step_ideal.append(mean.sum())
        self._step_layer.append(torch.where(peak > 0, mean / peak.clamp_min(1e-300), 1.0))
        self.num_steps += 1
        if self._pending is not None:  # a chunked move: the next chunk, behind this step
            self._move(self.settings.rebalance_layers_per_chunk)
        if self._rebalance_due():
            self.rebalance()

    @torch.no_grad()
    def rebalance(self) -> None:
        """Place experts from the windowed logical load (or history) and move the layers' weights in place:
        every layer now, or, with `rebalance_layers_per_chunk`, chunk by chunk after the next steps."""
        s = self.settings
        if self._pending is not None:  # the previous move finishes first
            self._move(len(self.layers))
        t0 = time.perf_counter()
        buckets = self.traits.history_buckets
        load = self.window.history(buckets) if buckets else self.window.windowed()  # [B, L, E] or [L, E]
        group = self.layers[0].ep_group
        if group is not None and self.layers[0].ep_replicated_tokens:  # engine EP: one load for all ranks
            dist.broadcast(load, group=group, group_src=0)
        elif group is not None:  # layer EP: every rank places experts from the load of all ranks' tokens
            dist.all_reduce(load, group=group)
        load = load.cpu()  # the one host sync, every step_interval steps
        placement = self.policy(load, self.num_slots, self.num_groups, s.num_nodes, s.num_ep_ranks)
        self.policy_ms.append((time.perf_counter() - t0) * 1e3)
        self.rebalance_steps.append(self.num_steps - 1)  # replay's convention: the step after which it ran
        move = migration(self.phy2log.cpu(), placement[0], s.num_ep_ranks, s.num_nodes)
        self.moves.append(move.summary(self.cost))
        self.moved_slots.append(int(move.moved_slots.sum()))
        self.move_ms.append(0.0)
        self._pending, self._next_layer = placement, 0
        if s.rebalance_layers_per_chunk is None:
            self._move(len(self.layers))

    def _move(self, num_layers: int) -> None:
        """Moves the next `num_layers` layers of the pending placement; the wall time is this step's stall."""
        phy2log, log2phy, logcnt = self._pending
        t0 = time.perf_counter()
        stop = min(self._next_layer + num_layers, len(self.layers))
        for i in range(self._next_layer, stop):
            self.layers[i].apply_placement(phy2log[i], log2phy[i], logcnt[i])
            self.phy2log[i].copy_(phy2log[i])
        if self.counts.device.type == "cuda":
            torch.cuda.synchronize(self.counts.device)
        ms = (time.perf_counter() - t0) * 1e3
        self._next_layer = stop
        step = self.num_steps - 1
        self.stall_ms[step] = self.stall_ms.get(step, 0.0) + ms
        self.move_ms[-1] += ms
        if stop == len(self.layers):
            self._pending = None

    def save_trace(self, path: str | None = None) -> str | None:
        """Writes the recorded per-step logical load (research_lm.eplb.trace format); returns the path."""
        path = path or self.settings.record_trace
        if self.recorder is None or path is None:
            return None
        first = self.layers[0]
        if not (first.ep_replicated_tokens and first.ep_rank != 0):  # engine EP: every rank has rank 0's trace
            self.recorder.save(path, meta=self.meta)
        self._trace_steps_saved = self.num_steps
        return str(path)

    def summary(self) -> dict[str, Any]:
        """Metrics of the run so far (names as `ReplayResult.summary`'s where they mean the same); writes
        the trace file first when `record_trace` is set and steps were added since the last write."""
        s = self.settings
        trace_path = None
        if self.recorder is not None:
            trace_path = s.record_trace
            if self._trace_steps_saved != self.num_steps:
                self.save_trace()
        est = torch.stack(self._step_est).cpu() if self._step_est else torch.zeros(0, dtype=torch.float64)
        ideal = torch.stack(self._step_ideal).cpu() if self._step_ideal else torch.zeros(0, dtype=torch.float64)
        per_step = torch.where(est > 0, ideal / est.clamp_min(1e-300), torch.ones_like(est))
        layer_peak = self._layer_max.cpu()
        per_layer = torch.where(layer_peak > 0, self._layer_mean.cpu() / layer_peak.clamp_min(1e-300),
                                torch.ones_like(layer_peak))
        total_est, total_ideal = float(est.sum()), float(ideal.sum())
        slot_bytes = self.layers[0].slot_bytes()
        cells = torch.stack(self._step_layer).cpu() if self._step_layer else torch.ones(0)
        n = max(self.num_rebalances, 1)
        moves = {f"{key}_per_rebalance": sum(m[key] for m in self.moves) / n
                 for key in ("experts_moved", "experts_moved_nvlink", "experts_moved_ib", "bytes_moved",
                             "transfer_ms")}
        return {
            "policy": s.policy,
            "num_moe_layers": len(self.layers),
            "num_logical_experts": self.num_experts,
            "num_physical_experts": self.num_slots,
            "num_ep_ranks": s.num_ep_ranks,
            "num_nodes": s.num_nodes,
            "num_steps": self.num_steps,
            "tokens_routed": int(self._rank_total.sum().item()),  # (token, expert) pairs, all layers
            "balancedness_total": total_ideal / total_est if total_est > 0 else 1.0,  # Σ mean / Σ max
            "balancedness_mean": float(per_step.mean()) if len(per_step) else 1.0,
            "balancedness_min": float(per_step.min()) if len(per_step) else 1.0,
            "balancedness_min_layer": float(per_layer.min()),
            **spread_stats(per_layer, "balancedness_layer"),  # per layer, over the run (Σ mean / Σ max)
            **spread_stats(per_step, "balancedness_step"),  # per step, over layers (Σ mean / Σ max)
            **spread_stats(cells, "balancedness_step_layer"),  # every (step, layer)
            "est_step_time": total_est,  # Σ_steps Σ_layers max rank load (tokens)
            "ideal_step_time": total_ideal,  # Σ_steps Σ_layers mean rank load
            "rank_load": self._rank_total.cpu().tolist(),  # tokens per rank, all layers and steps
            "max_replicas": max(int((layer.log2phy_cpu >= 0).sum(-1).max()) for layer in self.layers),
            "num_rebalances": self.num_rebalances,  # vLLM's rearrangements
            "rebalance_ms_median": _median(self.policy_ms),  # policy compute
            "rebalance_ms": [round(v, 3) for v in self.policy_ms],
            "weight_move_ms_median": _median(self.move_ms),  # measured, all chunks of a rebalance
            "weight_move_ms": [round(v, 3) for v in self.move_ms],
            "stall_ms_max": max(self.stall_ms.values(), default=0.0),  # the longest a step waited for weights
            "rebalance_layers_per_chunk": s.rebalance_layers_per_chunk,
            "dispatch": self.layers[0].dispatch,
            "moved_slots_total": sum(self.moved_slots),
            "moved_bytes_total": sum(self.moved_slots) * slot_bytes,  # every rewritten slot, local copies included
            "expert_bytes": slot_bytes,
            **moves,  # over the interconnect; transfer_ms implied at nvlink_gbps / ib_gbps
            "nvlink_gbps": s.nvlink_gbps,
            "ib_gbps": s.ib_gbps,
            "slots_used": float(slots_used(self.phy2log.cpu(), s.num_ep_ranks).double().mean()),
            "trace_path": trace_path,
        }


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0
