"""Dispatch-time balancing among an expert's replicas (DeepSeek LPLB's idea; SGLang's LP dispatch).

A placement fixes which ranks hold replicas of each expert; dispatch decides, per batch, how the expert's tokens
split among them. `round_robin` (token t uses replica t % count; simulated as an even split, its expectation)
ignores the batch. `least_loaded` sends each token of a replicated expert to the least-loaded rank among the
expert's replicas, given the whole batch. We compute it in token amounts (a fluid limit): start from round
robin's even split; then each replicated expert in turn, heaviest first, takes its tokens back and pours them
onto its replicas' ranks by water-filling (the lowest ranks rise to a common level) with everything else fixed;
two sweeps. Each pour minimises the max over that expert's ranks with the rest fixed, so no rank ends above
round robin's max. LPLB solves a linear program over the same edges; this coordinate descent needs no solver.

    rank_load, alloc = least_loaded(counts, log2phy, num_ranks, slots_per_rank)  # counts [T, L, E]; log2phy [L, E, m]

Used by the simulator (`research_lm.eplb.replay`) and by the MoE layer (`FusedMoE.to_physical`), which turns the
per-replica token amounts into per-token replica choices.
"""

from __future__ import annotations

import torch


def replica_ranks(log2phy: torch.Tensor, slots_per_rank: int) -> torch.Tensor:
    """[..., E, m] slots (-1 padded) -> [..., E, m] rank of each replica, -1 for padding and for a replica on
    the same rank as an earlier one (a second copy on one rank balances nothing: it gets no share)."""
    ranks = torch.where(log2phy >= 0, log2phy.div(slots_per_rank, rounding_mode="floor"), -1)
    m = ranks.shape[-1]
    earlier = torch.ones(m, m, dtype=torch.bool, device=ranks.device).tril(-1)  # [j, i]: i < j
    same = (ranks[..., :, None] == ranks[..., None, :]) & earlier  # [..., E, m, m]
    return torch.where(same.any(-1), -1, ranks)


def waterfill(
    amount: torch.Tensor,  # [...] >= 0, what to pour
    levels: torch.Tensor,  # [..., m] current bin loads, inf where no bin
) -> torch.Tensor:  # [..., m] >= 0, sums to amount over the finite bins
    """The fills that minimise the highest bin: the k lowest bins rise to a common level h, with
    k the largest index such that s_k < h_k = (amount + s_1 + ... + s_k) / k (s sorted ascending)."""
    s, order = levels.sort(-1)
    finite = torch.isfinite(s)
    k = torch.arange(1, s.shape[-1] + 1, device=s.device, dtype=s.dtype)
    h = (amount[..., None] + torch.where(finite, s, 0.0).cumsum(-1)) / k
    count = (finite & (s < h)).sum(-1, keepdim=True).clamp_min(1)  # the condition holds on a prefix
    level = h.gather(-1, count - 1)
    fill_sorted = torch.where(finite, (level - s).clamp_min(0.0), 0.0)
    return torch.empty_like(fill_sorted).scatter_(-1, order, fill_sorted)


def least_loaded(
    counts: torch.Tensor,  # [T, L, E] tokens per logical expert per batch
    log2phy: torch.Tensor,  # [L, E, m] slots of each expert's replicas, -1 padded
    num_ranks: int,
    slots_per_rank: int,
    *,
    sweeps: int = 2,
    return_alloc: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank loads [T, L, R] float64 under least-loaded dispatch, and (when asked) the tokens each replica gets,
    alloc [T, L, E, m] (0 for padding and same-rank copies). Slots [r * P / R, (r + 1) * P / R) are rank r's."""
    counts = counts.to(torch.float64)
    num_steps, num_layers, num_experts = counts.shape
    width = log2phy.shape[-1]
    m = max(int((log2phy >= 0).sum(-1).max()), 1) if log2phy.numel() else 1
    slots = log2phy[..., :m].to(counts.device)
    ranks = replica_ranks(slots, slots_per_rank)  # [L, E, m]
    valid = ranks >= 0
    spread = valid.sum(-1)  # [L, E] distinct ranks holding the expert
    # round robin's split to start from: an even share per replica, a rank's copies summed on its first one
    raw = torch.where(slots >= 0, slots.div(slots_per_rank, rounding_mode="floor"), -1)
    copies = ((raw[..., :, None] == raw[..., None, :]) & (slots[..., None, :] >= 0)).sum(-1)  # [L, E, m]
    fraction = torch.where(valid, copies.double() / (slots >= 0).sum(-1, keepdim=True).clamp_min(1), 0.0)
    share = counts[..., None] * fraction  # [T, L, E, m]
    index = ranks.clamp_min(0).expand(num_steps, -1, -1, -1)
    rank_load = counts.new_zeros(num_steps, num_layers, num_ranks)
    rank_load.scatter_add_(-1, index.flatten(-2), share.flatten(-2))
    multi = spread > 1  # [L, E]
    num_multi = int(multi.sum(-1).max()) if num_experts else 0
    if num_multi:
        # replicated experts of each batch, heaviest first (the others sort last with key -1 and are skipped)
        key = torch.where(multi, counts, -1.0)
        order = torch.argsort(key, dim=-1, descending=True, stable=True)[..., :num_multi]  # [T, L, X]
        live = multi.expand(num_steps, -1, -1).gather(-1, order)  # [T, L, X]
        gather_m = order[..., None].expand(-1, -1, -1, m)
        alloc = share.gather(2, gather_m)  # [T, L, X, m] each replicated expert's current split
        bins = index.gather(2, gather_m)  # [T, L, X, m]
        open_bin = valid.expand(num_steps, -1, -1, -1).gather(2, gather_m)
        amount = counts.gather(-1, order)  # [T, L, X]
        for _ in range(sweeps):
            for i in range(num_multi):
                b = bins[..., i, :]
                rank_load.scatter_add_(-1, b, -alloc[..., i, :])  # take its tokens back
                levels = torch.where(open_bin[..., i, :], rank_load.gather(-1, b), torch.inf)
                fill = torch.where(live[..., i, None], waterfill(amount[..., i], levels), alloc[..., i, :])
                rank_load.scatter_add_(-1, b, fill)
                alloc[..., i, :] = fill
        share.scatter_(2, gather_m, torch.where(live[..., None], alloc, share.gather(2, gather_m)))
    if not return_alloc:
        return rank_load, None
    return rank_load, torch.nn.functional.pad(share, (0, width - m))
