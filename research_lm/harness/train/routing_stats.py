"""How skewed a MoE's expert loads are, and how far they drift between two workloads.

Inputs are expert loads (tokens routed to each expert, a token routed to k experts counted k times) with the
experts on the last axis: a trace's `load` [steps, layers, experts], its total over steps [layers, experts],
or one layer [experts]. Every statistic reduces the last axis:

    max_over_mean       max_e x_e / mean_e x_e                       1 = balanced, E = one expert takes all
    gini                Σ_i (2i - n - 1) x_(i) / (n Σ x), x sorted   0 = balanced, (n - 1) / n = one expert
    normalized_entropy  H(x / Σ x) / ln n                            1 = balanced, 0 = one expert
    top_share           Σ of the k largest x_e / Σ x                 k / n = balanced, 1 = k experts take all
    l1_distance         Σ_e |x_e / Σ x - y_e / Σ y|                  0 = same distribution, 2 = disjoint
    spearman            Pearson correlation of the (average) ranks   1 = same order of popularity

An all-zero load counts as balanced (max_over_mean 1, gini 0, entropy 1): a layer that saw no token is not skewed.
"""

from __future__ import annotations

import math

import torch


def shares(load: torch.Tensor) -> torch.Tensor:  # [..., E] -> [..., E] float64 summing to 1 (uniform if all 0)
    x = load.to(torch.float64)
    total = x.sum(-1, keepdim=True)
    return torch.where(total > 0, x / total.clamp_min(1e-300), torch.full_like(x, 1.0 / x.shape[-1]))


def max_over_mean(load: torch.Tensor) -> torch.Tensor:  # [..., E] -> [...]
    p = shares(load)
    return p.amax(-1) * p.shape[-1]


def gini(load: torch.Tensor) -> torch.Tensor:  # [..., E] -> [...]
    p = shares(load).sort(-1).values
    n = p.shape[-1]
    rank = torch.arange(1, n + 1, dtype=torch.float64, device=p.device)
    return ((2 * rank - n - 1) * p).sum(-1) / n


def normalized_entropy(load: torch.Tensor) -> torch.Tensor:  # [..., E] -> [...]
    p = shares(load)
    h = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return h / math.log(p.shape[-1])


def top_share(load: torch.Tensor, k: int = 1) -> torch.Tensor:  # [..., E] -> [...]
    return shares(load).topk(k, dim=-1).values.sum(-1)


def l1_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [..., E], [..., E] -> [...]
    return (shares(a) - shares(b)).abs().sum(-1)


def _ranks(x: torch.Tensor) -> torch.Tensor:  # [..., E] -> [..., E] float64, ties share their average rank
    x = x.to(torch.float64)
    less = (x.unsqueeze(-1) > x.unsqueeze(-2)).sum(-1).to(torch.float64)  # elements below each one
    equal = (x.unsqueeze(-1) == x.unsqueeze(-2)).sum(-1).to(torch.float64)  # itself included
    return less + (equal + 1) / 2


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [..., E], [..., E] -> [...]; 0 if constant
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    denom = (ra.square().sum(-1) * rb.square().sum(-1)).sqrt()
    return torch.where(denom > 0, (ra * rb).sum(-1) / denom.clamp_min(1e-300), torch.zeros_like(denom))


def skew(load: torch.Tensor) -> dict[str, list[float] | float]:
    """Skew of a trace `load` [steps, layers, experts]: per layer (lists) over the whole trace's total load,
    their means over layers, and the per-step max / mean averaged over steps and layers (one step's
    imbalance, the thing a static placement pays for; noisy when a step routes few tokens)."""
    total = load.sum(0)  # [L, E]
    per_layer = {"max_over_mean": max_over_mean(total), "gini": gini(total),
                 "normalized_entropy": normalized_entropy(total), "top1_share": top_share(total, 1)}
    active = load.sum(-1) > 0  # [S, L]: steps that routed tokens in the layer
    step_ratio = max_over_mean(load)[active]
    out: dict[str, list[float] | float] = {f"{k}_per_layer": v.tolist() for k, v in per_layer.items()}
    out |= {k: float(v.mean()) for k, v in per_layer.items()}
    out["step_max_over_mean"] = float(step_ratio.mean()) if step_ratio.numel() else 1.0
    out["tokens_routed"] = int(load.sum())
    return out


def drift(a: torch.Tensor, b: torch.Tensor) -> dict[str, list[float] | float]:
    """How far the load of trace `a` [steps_a, L, E] moves in trace `b` [steps_b, L, E]: per layer, the L1
    distance between the normalized totals and their rank correlation, and the means over layers."""
    ta, tb = a.sum(0), b.sum(0)
    l1, rho = l1_distance(ta, tb), spearman(ta, tb)
    return {"l1_per_layer": l1.tolist(), "spearman_per_layer": rho.tolist(), "l1": float(l1.mean()),
            "spearman": float(rho.mean())}


def halves(load: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second half of a trace's steps: drift between them is the same-workload baseline."""
    mid = load.shape[0] // 2
    return load[:mid], load[mid:]
