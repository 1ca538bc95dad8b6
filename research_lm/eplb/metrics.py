"""Balance metrics, the simulated expert-parallel (EP) step model, and what a rebalance moves.

Definitions (vLLM's): a rank's load is the tokens its physical experts process; a replicated logical
expert's load is split evenly across its replicas (round-robin dispatch; `research_lm.eplb.dispatch` for
least-loaded). Per layer, balancedness = mean / max rank load (1 = perfect; 1 / num_ranks = everything on
one rank; 1 for a layer with no load), reported as min / p50 / p90 / avg over layers (`spread_stats`).
Overall, balancedness = sum over layers of the mean / sum over layers of the max. The simulated step time
is the sum over layers of the max rank load (each MoE layer waits for its slowest rank), in token
units; the ideal is the sum of the means, so overall balancedness = ideal / estimated step time.
`CostModel` turns tokens into seconds and moved experts into bytes and seconds.

What a rebalance moves (`migration`): for each rank, every logical expert it holds under the new placement
and did not hold before is one expert moved (sent over the interconnect, from a rank of the same node when
one had it: NVLink, else across nodes: InfiniBand); a slot whose new expert the rank already held is a local
copy and costs no link. Slots used (`slots_used`): distinct (rank, expert) pairs; a second copy of an expert
on one rank holds memory but balances nothing, so a deployment would not allocate it (`budgeted` marks its
unused slots this way).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# DeepSeek-V3's routed expert: hidden 7168, moe_intermediate 2048, gate + up + down projections.
DEEPSEEK_V3_EXPERT_PARAMS = 3 * 7168 * 2048


@dataclass(frozen=True)
class CostModel:
    """Seconds and bytes for the simulated EP step and for moving experts. Defaults: DeepSeek-V3's routed expert
    in fp8 (1 byte a weight; block scales, 0.02 %, ignored) on H100-class ranks; every figure is a parameter."""

    expert_bytes: float = DEEPSEEK_V3_EXPERT_PARAMS * 1.0  # bytes of one expert's weights (bf16: 2 bytes a weight)
    pair_flops: float = 2.0 * DEEPSEEK_V3_EXPERT_PARAMS  # FLOPs of one (token, expert) pair
    # Effective expert GEMM rate per rank: an assumption, about a third of H100 SXM's 1979 dense fp8 TFLOP/s
    # (grouped GEMMs at ~100 tokens per expert fall well short of peak).
    expert_tflops: float = 600.0
    nvlink_gbps: float = 450.0  # GB/s per GPU per direction inside a node (H100 NVLink 4: 900 GB/s both ways)
    ib_gbps: float = 50.0  # GB/s per GPU across nodes (one 400 Gb/s NDR InfiniBand NIC per GPU)

    def __post_init__(self) -> None:
        for name in ("expert_bytes", "pair_flops", "expert_tflops", "nvlink_gbps", "ib_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and np.isfinite(value) and value > 0):
                raise ValueError(f"CostModel.{name} must be a positive number, got {value!r}")

    @property
    def pair_seconds(self) -> float:
        """Seconds one rank spends on one (token, expert) pair."""
        return self.pair_flops / (self.expert_tflops * 1e12)


def percentile(values: torch.Tensor, q: float) -> float:
    """The q-quantile (0..1) of a 1-D tensor, linear interpolation (numpy's default)."""
    return float(torch.quantile(values.to(torch.float64).flatten(), q))


def spread_stats(values: torch.Tensor, prefix: str) -> dict[str, float]:
    """{prefix_min, prefix_p50, prefix_p90, prefix_avg} of a tensor of balancedness values (vLLM's summary)."""
    v = values.to(torch.float64).flatten()
    if v.numel() == 0:
        return {f"{prefix}_{k}": 1.0 for k in ("min", "p50", "p90", "avg")}
    return {f"{prefix}_min": float(v.min()), f"{prefix}_p50": percentile(v, 0.5),
            f"{prefix}_p90": percentile(v, 0.9), f"{prefix}_avg": float(v.mean())}


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


def slots_used(phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[L, P] -> [L] int64: distinct (rank, expert) pairs of each layer (see the module docstring)."""
    num_layers, num_slots = phy2log.shape
    rank = torch.arange(num_slots, device=phy2log.device) // (num_slots // num_ranks)
    key = rank * (int(phy2log.max()) + 1 if phy2log.numel() else 1) + phy2log  # [L, P]
    return (key.sort(-1).values.diff(dim=-1) != 0).sum(-1) + 1


@dataclass
class Migration:
    """What one rebalance moves, per layer (see the module docstring for the counting rules)."""

    moved_slots: np.ndarray  # [L] slots whose expert changed (local copies included)
    via_nvlink: np.ndarray  # [L] experts sent from a rank of the same node
    via_ib: np.ndarray  # [L] experts sent across nodes
    nvlink_peak: np.ndarray  # [L] max over ranks of max(experts received, sent) over NVLink
    ib_peak: np.ndarray  # [L] the same over InfiniBand

    @property
    def experts_moved(self) -> np.ndarray:  # [L]
        return self.via_nvlink + self.via_ib

    def layer_seconds(self, cost: CostModel) -> np.ndarray:
        """[L] seconds to move each layer's experts: its busiest rank's link time (NVLink and InfiniBand in turn)."""
        return cost.expert_bytes * (self.nvlink_peak / (cost.nvlink_gbps * 1e9) + self.ib_peak / (cost.ib_gbps * 1e9))

    def summary(self, cost: CostModel | None) -> dict[str, float]:
        out = {"moved_slots": int(self.moved_slots.sum()), "experts_moved": int(self.experts_moved.sum()),
               "experts_moved_nvlink": int(self.via_nvlink.sum()), "experts_moved_ib": int(self.via_ib.sum())}
        if cost is not None:
            out |= {"bytes_moved": float(self.experts_moved.sum() * cost.expert_bytes),
                    "transfer_ms": float(self.layer_seconds(cost).sum() * 1e3)}
        return out


def migration(
    old_phy2log: torch.Tensor | np.ndarray,  # [L, P]
    new_phy2log: torch.Tensor | np.ndarray,  # [L, P]
    num_ranks: int,
    num_nodes: int = 1,
) -> Migration:
    """Experts a rebalance from `old_phy2log` to `new_phy2log` sends over each link class (module docstring)."""
    old, new = np.asarray(old_phy2log, dtype=np.int64), np.asarray(new_phy2log, dtype=np.int64)
    num_layers, num_slots = new.shape
    num_experts = int(max(old.max(), new.max())) + 1
    per_rank, ranks_per_node = num_slots // num_ranks, num_ranks // num_nodes
    rank_of_slot = np.arange(num_slots) // per_rank
    layer = np.arange(num_layers)[:, None]

    def holds(phy2log: np.ndarray) -> np.ndarray:  # [L, R, E] rank r holds expert e
        out = np.zeros((num_layers, num_ranks, num_experts), dtype=bool)
        out[layer, rank_of_slot[None, :], phy2log] = True
        return out

    had, has = holds(old), holds(new)
    need = has & ~had  # [L, R, E]: one transfer each
    node_had = had.reshape(num_layers, num_nodes, ranks_per_node, num_experts)
    from_node = node_had.any(2)  # [L, N, E]
    l_idx, dst, expert = np.nonzero(need)
    dst_node = dst // ranks_per_node
    local = from_node[l_idx, dst_node, expert]  # a same-node source exists
    # source: the first rank of the destination's node holding it, else the first rank anywhere
    src = np.where(local, dst_node * ranks_per_node + node_had[l_idx, dst_node, :, expert].argmax(-1),
                   had[l_idx, :, expert].argmax(-1))

    def peak(mask: np.ndarray) -> np.ndarray:  # [L] busiest rank's max(received, sent) on this link class
        size = num_layers * num_ranks
        recv = np.bincount(l_idx[mask] * num_ranks + dst[mask], minlength=size).reshape(num_layers, num_ranks)
        sent = np.bincount(l_idx[mask] * num_ranks + src[mask], minlength=size).reshape(num_layers, num_ranks)
        return np.maximum(recv, sent).max(-1)

    return Migration(
        moved_slots=(old != new).sum(-1),
        via_nvlink=np.bincount(l_idx[local], minlength=num_layers),
        via_ib=np.bincount(l_idx[~local], minlength=num_layers),
        nvlink_peak=peak(local),
        ib_peak=peak(~local),
    )
