"""`deepseek_swap`: DeepSeek EPLB followed by a pairwise-swap local search between GPUs of one node.

Question it answers: how much balance does DeepSeek's one-pass greedy packing leave on the table,
at the same replicas and the same node locality, and what does finding it cost? Starting from the
`deepseek` placement, each round (all layers at once) takes the most loaded GPU m of each layer
and swaps one of its physical experts with one on GPU b, b among the 4 least loaded other GPUs of
m's node (of all GPUs when deepseek fell back to its global policy), choosing the swap that
minimises max(load m, load b) afterwards; a layer stops when no such swap lowers load m. The
maximum GPU load never rises, so this is never less balanced than `deepseek`. Replicas keep their
replica index when they move.
"""

from __future__ import annotations

import numpy as np
import torch

from research_lm.eplb.deepseek import deepseek_slots
from research_lm.eplb.packing import finish_placement, replica_counts
from research_lm.eplb.registry import PolicyOutput, check_policy_args, register_policy


def swap_refine(
    phy2log: np.ndarray,  # [L, P] int64, modified in place
    phyrank: np.ndarray,  # [L, P] int64, replica index of each slot, modified in place
    slot_load: np.ndarray,  # [L, P] float64, load carried by each slot, modified in place
    num_gpus: int,
    gpus_per_domain: int,  # swaps stay inside blocks of this many consecutive GPUs
    max_rounds: int,
    num_partners: int = 4,
) -> int:
    """Greedy max-GPU swap search; returns the number of rounds run."""
    num_layers, num_phy = slot_load.shape
    per_gpu = num_phy // num_gpus
    num_partners = min(num_partners, gpus_per_domain - 1)
    if num_partners < 1:
        return 0
    row = np.arange(num_layers)[:, None]
    active = np.ones(num_layers, dtype=bool)
    for rnd in range(max_rounds):
        gpu_load = slot_load.reshape(num_layers, num_gpus, per_gpu).sum(-1)  # [L, G]
        m = gpu_load.argmax(1)  # [L]
        load_m = gpu_load[row[:, 0], m]
        items_m = slot_load.reshape(num_layers, num_gpus, per_gpu)[row[:, 0], m]  # [L, k]
        # partners: the `num_partners` lightest other GPUs of m's domain; candidates are their slots
        other = np.arange(num_gpus) // gpus_per_domain != (m // gpus_per_domain)[:, None]
        other[row[:, 0], m] = True
        partners = np.argsort(np.where(other, np.inf, gpu_load), axis=1, kind="stable")[:, :num_partners]
        cand = (partners[:, :, None] * per_gpu + np.arange(per_gpu)).reshape(num_layers, -1)  # [L, c * k]
        cand_gpu = cand // per_gpu
        delta = items_m[:, :, None] - slot_load[row, cand][:, None, :]  # [L, k, c * k]: load moved off m
        after = np.maximum(load_m[:, None, None] - delta, gpu_load[row, cand_gpu][:, None, :] + delta)
        after = np.where(delta > 0, after, np.inf).reshape(num_layers, -1)
        best = after.argmin(1)
        active &= after[row[:, 0], best] < load_m * (1 - 1e-12)
        if not active.any():
            return rnd
        lay = row[active, 0]
        a = m[lay] * per_gpu + best[lay] // cand.shape[1]
        b = cand[lay, best[lay] % cand.shape[1]]
        for arr in (phy2log, phyrank, slot_load):
            arr[lay, a], arr[lay, b] = arr[lay, b], arr[lay, a]
    return max_rounds


@register_policy("deepseek_swap")
def deepseek_swap_placement(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
    max_rounds: int | None = None,
) -> PolicyOutput:
    """`deepseek`, then up to `max_rounds` (default num_gpus) rounds of swap search."""
    load = check_policy_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    phy2log, phyrank = deepseek_slots(load, num_replicas, num_groups, num_nodes, num_gpus)
    logcnt = replica_counts(phy2log, load.shape[1])
    slot_load = np.take_along_axis(load / logcnt, phy2log, 1)
    hierarchical = num_groups % num_nodes == 0
    swap_refine(phy2log, phyrank, slot_load, num_gpus, num_gpus // num_nodes if hierarchical else num_gpus,
                num_gpus if max_rounds is None else max_rounds)
    return finish_placement(phy2log, load.shape[1], phyrank)
