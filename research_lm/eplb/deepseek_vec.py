"""`deepseek_vec`: DeepSeek's replicate-then-pack, balancing the load history instead of its sum (SGLang's idea).

Question it answers: a window's summed load hides when each expert was hot. Two experts hot at different times
can share a rank; two hot at the same time should not. Does balancing every step of the history, rather than
the total, give placements that hold up step by step, e.g. when the workload moves between code and prose?

The policy gets the window's history, B contiguous buckets [B, L, E] (`history_buckets`; a 2-D weight is one
bucket) and minimises the sum over buckets of the bucket's max, in both of DeepSeek's steps:
  1. replication: each redundant slot goes to the expert whose extra replica lowers Σ_b max_e load_b(e) / count(e)
     the most (SGLang's deepseek_vec rule); ties (and no gain at all) fall back to DeepSeek's rule on the sum;
  2. packing: physical experts, heaviest total first, each go to the GPU with room whose load vector it raises
     the sum over buckets of the per-bucket max GPU load the least; ties go to the lightest GPU in total.
Groups and nodes are ignored (DeepSeek's global policy), like `lpt`.
"""

from __future__ import annotations

import numpy as np
import torch

from research_lm.eplb.packing import finish_placement, inverse_permutation
from research_lm.eplb.registry import PolicyOutput, check_history_args, register_policy

_FULL = 1e300  # added to a full GPU's cost so that argmin never picks it


def replicate_by_history(history: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """history [B, L, E] float64 -> phy2log [L, P] (experts in order, then the granted replicas), phyrank [L, P],
    logcnt [L, E]: each grant lowers Σ_b max_e history[b, l, e] / logcnt[l, e] the most (first index on ties)."""
    num_buckets, num_layers, num_log = history.shape
    total = history.sum(0)  # [L, E]
    phy2log = np.empty((num_layers, num_phy), dtype=np.int64)
    phy2log[:, :num_log] = np.arange(num_log)
    phyrank = np.zeros((num_layers, num_phy), dtype=np.int64)
    cnt = np.ones((num_layers, num_log), dtype=np.int64)
    row = np.arange(num_layers)
    bucket = np.arange(num_buckets)[:, None]
    per_replica = history.copy()  # [B, L, E] history / cnt, kept up to date column by column
    for slot in range(num_log, num_phy):
        arg = per_replica.argmax(-1)  # [B, L] the max expert of each bucket
        peak = np.take_along_axis(per_replica, arg[..., None], -1)[..., 0]
        np.put_along_axis(per_replica, arg[..., None], -np.inf, -1)
        second = per_replica.max(-1) if num_log > 1 else np.zeros_like(peak)
        np.put_along_axis(per_replica, arg[..., None], peak[..., None], -1)
        after = np.maximum(second, history[bucket, row, arg] / (cnt[row, arg] + 1))  # its bucket max after a grant
        gain = np.zeros((num_layers, num_log))
        np.add.at(gain, (np.broadcast_to(row, arg.shape), arg), peak - after)
        best = gain.max(-1, keepdims=True)
        tied = (gain >= best * (1 - 1e-12)) & (best > 0)
        dhondt = total / cnt  # DeepSeek's key, among the tied (or among all when no grant gains)
        expert = np.where(tied.any(-1, keepdims=True) & ~tied, -np.inf, dhondt).argmax(-1)
        phy2log[:, slot] = expert
        phyrank[:, slot] = cnt[row, expert]
        cnt[row, expert] += 1
        per_replica[:, row, expert] = history[:, row, expert] / cnt[row, expert]
    return phy2log, phyrank, cnt


def pack_by_history(items: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """items [B, L, n] per-bucket loads, n divisible by num_packs -> pack [L, n], rank in pack [L, n]. Items,
    heaviest total first (stable), each go to the pack with room minimising Σ_b max(M_b, pack_b + item_b) (M_b:
    the bucket's current max over packs); ties: the lighter pack in total, then the lower index."""
    num_buckets, num_layers, n = items.shape
    capacity = n // num_packs
    order = np.argsort(-items.sum(0), axis=-1, kind="stable")  # [L, n]
    loads = np.zeros((num_buckets, num_layers, num_packs))
    count = np.zeros((num_layers, num_packs), dtype=np.int64)
    pack_sorted = np.empty((num_layers, n), dtype=np.int64)
    rank_sorted = np.empty((num_layers, n), dtype=np.int64)
    row = np.arange(num_layers)
    scale = max(float(items.sum(0).max()), 1.0) * num_buckets
    for j in range(n):
        item = items[:, row, order[:, j]]  # [B, L]
        bucket_max = loads.max(-1, keepdims=True)  # [B, L, 1]
        cost = np.maximum(bucket_max, loads + item[..., None]).sum(0)  # [L, G]
        # tie-break on total load, scaled far below any real difference of the cost
        cost = cost + loads.sum(0) / scale * 1e-6 + _FULL * (count == capacity)
        pack = cost.argmin(-1)
        pack_sorted[:, j] = pack
        rank_sorted[:, j] = count[row, pack]
        count[row, pack] += 1
        loads[:, row, pack] += item
    pack_index = np.empty_like(pack_sorted)
    rank_in_pack = np.empty_like(rank_sorted)
    np.put_along_axis(pack_index, order, pack_sorted, axis=1)
    np.put_along_axis(rank_in_pack, order, rank_sorted, axis=1)
    return pack_index, rank_in_pack


@register_policy("deepseek_vec", history_buckets=16)
def deepseek_vec_placement(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> PolicyOutput:
    """weight: [L, E] (one bucket) or the history [B, L, E]; the placement minimises Σ_b max over GPUs."""
    history = check_history_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    num_logical = history.shape[-1]
    phy2log, phyrank, logcnt = replicate_by_history(history, num_replicas)
    items = np.take_along_axis(history / logcnt, np.broadcast_to(phy2log, (history.shape[0], *phy2log.shape)), -1)
    gpu, rank_in_gpu = pack_by_history(items, num_gpus)
    slot2phy = inverse_permutation(gpu * (num_replicas // num_gpus) + rank_in_gpu)
    return finish_placement(np.take_along_axis(phy2log, slot2phy, 1), num_logical,
                            np.take_along_axis(phyrank, slot2phy, 1))
