"""Balance metrics and the simulated expert-parallel (EP) step model.

Definitions (vLLM's): a rank's load is the tokens its physical experts process; a replicated logical
expert's load is split evenly across its replicas. Per layer, balancedness = mean / max rank load
(1 = perfect; 1 / num_ranks = everything on one rank; 1 for a layer with no load). Overall,
balancedness = sum over layers of the mean / sum over layers of the max. The simulated step time
is the sum over layers of the max rank load (each MoE layer waits for its slowest rank), in token
units; the ideal is the sum of the means, so overall balancedness = ideal / estimated step time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def slot_load(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """Load each physical slot carries: weight[..., l, phy2log] / logcnt[l, phy2log].

    weight: [..., L, num_logical] (leading dims, e.g. steps, broadcast); phy2log: [L, P];
    logcnt: [L, num_logical]. Returns [..., L, P] float64."""
    per_replica = weight.to(torch.float64) / logcnt.to(weight.device, torch.float64)
    index = phy2log.to(weight.device).expand(*weight.shape[:-1], phy2log.shape[-1])
    return per_replica.gather(-1, index)


def rank_load(physical_load: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Sums slots into EP ranks: [..., P] -> [..., num_ranks]; rank r holds slots [r * k, (r + 1) * k)."""
    num_phy = physical_load.shape[-1]
    if num_phy % num_ranks != 0:
        raise ValueError(f"number of physical experts ({num_phy}) must be divisible by num_ranks ({num_ranks})")
    return physical_load.reshape(*physical_load.shape[:-1], num_ranks, num_phy // num_ranks).sum(-1)


def balancedness(ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ranks: [..., L, R] rank loads. Returns (per-layer mean / max [..., L], overall Σ mean / Σ max [...])."""
    ranks = ranks.to(torch.float64)
    mean, peak = ranks.mean(-1), ranks.amax(-1)
    per_layer = torch.where(peak > 0, mean / peak.clamp_min(1e-300), torch.ones_like(mean))
    total_peak = peak.sum(-1)
    overall = torch.where(total_peak > 0, mean.sum(-1) / total_peak.clamp_min(1e-300),
                          torch.ones_like(total_peak))
    return per_layer, overall


@dataclass
class EPSummary:
    """Simulated EP on one device for one load [L, num_logical] and one placement."""

    rank_load: torch.Tensor  # [L, num_ranks] tokens per rank
    node_load: torch.Tensor  # [L, num_nodes] tokens per node
    balancedness_per_layer: torch.Tensor  # [L] mean / max rank load
    balancedness: float  # Σ_layers mean / Σ_layers max
    est_step_time: float  # Σ_layers max rank load (token units)
    ideal_step_time: float  # Σ_layers mean rank load
    replicas_per_layer: torch.Tensor  # [L] largest replica count of any expert

    def to_dict(self) -> dict:
        return {
            "balancedness": self.balancedness,
            "balancedness_min_layer": float(self.balancedness_per_layer.min()),
            "est_step_time": self.est_step_time,
            "ideal_step_time": self.ideal_step_time,
            "max_replicas": int(self.replicas_per_layer.max()),
        }


def simulate_ep(
    weight: torch.Tensor,  # [L, num_logical] tokens per logical expert
    phy2log: torch.Tensor,  # [L, P]
    logcnt: torch.Tensor,  # [L, num_logical]
    num_ranks: int,
    num_nodes: int = 1,
) -> EPSummary:
    """Partitions the physical experts into `num_ranks` virtual ranks (in `num_nodes` nodes) and
    reports per-rank load, balancedness and the max-rank-load step time model."""
    if num_ranks % num_nodes != 0:
        raise ValueError(f"num_ranks ({num_ranks}) must be divisible by num_nodes ({num_nodes})")
    ranks = rank_load(slot_load(weight, phy2log, logcnt), num_ranks)
    per_layer, overall = balancedness(ranks)
    peak = ranks.amax(-1)
    return EPSummary(
        rank_load=ranks,
        node_load=ranks.reshape(ranks.shape[0], num_nodes, -1).sum(-1),
        balancedness_per_layer=per_layer,
        balancedness=float(overall),
        est_step_time=float(peak.sum()),
        ideal_step_time=float(ranks.mean(-1).sum()),
        replicas_per_layer=logcnt.amax(-1),
    )
