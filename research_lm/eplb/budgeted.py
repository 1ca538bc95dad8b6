"""`budgeted`: replicas where they pay, under a total slot budget across layers (CRAFT's idea, arXiv 2603.28768).

Question it answers: DeepSeek gives every layer the same number of redundant experts, but a layer whose load is
already even gains nothing from them while a skewed one could use more. How few redundant slots reach DeepSeek's
balance if they go where they lower the step time the most, and what does the memory they free buy?

Per layer l and r redundant replicas (0 <= r <= P - E), DeepSeek's global rule gives a placement from the summed
load: r grants by load per replica, then heaviest-first packing onto GPUs with room. Its cost f_l(r) is the
layer's share of the step time over the window's history: Σ_b max GPU load in bucket b (B buckets,
`history_buckets`; a 2-D weight is one bucket). Judged on the sum alone, replicas stop paying as soon as the
packing reaches the mean, and the next window's drift finds the layer bare; the buckets keep the replicas that
absorb the load's swings. A knapsack over layers (exact dynamic program) picks r_l minimising Σ_l f_l(r_l)
subject to Σ_l r_l <= slot_budget x L x (P - E), and, among the best, the fewest replicas: a layer that stays
balanced keeps fewer. Every GPU gets at least one real expert (the first G items go to distinct GPUs), so
r_l >= G - E.

The contract's fixed P slots per layer stay: a slot the layer does not use holds a second copy of an expert its
GPU already holds, preferring one with no other replica (so an even round-robin split stays even). Such a copy
balances nothing and would not be allocated in a deployment: `research_lm.eplb.metrics.slots_used` counts
distinct (GPU, expert) pairs, and moving to it costs a local copy at most. Groups and nodes are ignored (like `lpt`).
"""

from __future__ import annotations

import numpy as np
import torch

from research_lm.eplb.packing import finish_placement, replicate_by_load
from research_lm.eplb.registry import PolicyOutput, check_history_args, register_policy

_FULL = 1e300


def pack_with_room(
    weight: np.ndarray,  # [rows, n] float64 item loads
    present: np.ndarray,  # [rows, n] bool: items to place (the others are skipped)
    num_packs: int,
    capacity: int,
) -> np.ndarray:
    """Greedy packing with at most `capacity` items a pack: present items, heaviest first (stable), the first
    `num_packs` to packs 0, 1, ... (so none stays empty; every row has that many), the rest each to the lightest
    pack with room. Returns the pack of each item [rows, n], -1 for absent items."""
    rows, n = weight.shape
    order = np.argsort(-np.where(present, weight, -np.inf), axis=1, kind="stable")
    sorted_t = np.ascontiguousarray(np.take_along_axis(weight, order, 1).T)  # [n, rows]
    live_t = np.ascontiguousarray(np.take_along_axis(present, order, 1).T)  # present items first in each row
    key = np.zeros(num_packs * rows)  # pack load, + _FULL once full; [num_packs, rows] flattened
    count = np.zeros(num_packs * rows, dtype=np.int64)
    key_2d = key.reshape(num_packs, rows)
    pack_sorted = np.full((n, rows), -1, dtype=np.int64)
    row = np.arange(rows)
    for j in range(int(live_t.sum(1).nonzero()[0].max()) + 1 if live_t.any() else 0):
        live = live_t[j]
        pack = np.full(rows, j) if j < num_packs else key_2d.argmin(0)
        pack_sorted[j] = np.where(live, pack, -1)
        f = pack * rows + row
        c = count[f] + live
        count[f] = c
        key[f] += np.where(live, sorted_t[j] + _FULL * (c == capacity), 0.0)
    pack = np.full((rows, n), -1, dtype=np.int64)
    np.put_along_axis(pack, order, pack_sorted.T, axis=1)
    return pack


def allocate(cost: np.ndarray, budget: int) -> np.ndarray:
    """cost [L, K]: f_l(r_min + k). Returns k_l [L] minimising Σ cost[l, k_l] with Σ k_l <= budget, the fewest
    replicas among equal costs (min-plus dynamic program over layers, exact)."""
    num_layers, width = cost.shape
    budget = min(budget, num_layers * (width - 1))
    best = np.full(budget + 1, np.inf)
    best[0] = 0.0  # best[b]: least cost of the layers so far using exactly b replicas
    choice = np.zeros((num_layers, budget + 1), dtype=np.int64)
    used = np.arange(budget + 1)
    for layer in range(num_layers):
        prev = np.where(used[:, None] >= np.arange(width), best[np.clip(used[:, None] - np.arange(width), 0, None)],
                        np.inf)  # [b, k]: cost so far if this layer takes k
        total = prev + cost[layer]
        choice[layer] = total.argmin(1)  # the fewest k among ties
        best = total[used, choice[layer]]
    b = int(np.flatnonzero(best <= best.min())[0])  # the fewest replicas reaching the least cost
    out = np.empty(num_layers, dtype=np.int64)
    for layer in range(num_layers - 1, -1, -1):
        out[layer] = choice[layer, b]
        b -= out[layer]
    return out


@register_policy("budgeted", history_buckets=16)
def budgeted_placement(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
    slot_budget: float = 1.0,
) -> PolicyOutput:
    """weight [L, E] or its history [B, L, E]. At most slot_budget (0..1) of the L x (P - E) redundant slots used,
    where they lower Σ_l Σ_b max GPU load the most; by default all may be, and those that do not pay stay unused."""
    history = check_history_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    load = history.sum(0)
    if not 0.0 <= slot_budget <= 1.0:
        raise ValueError(f"slot_budget must lie in [0, 1] (a fraction of the redundant slots), got {slot_budget!r}")
    num_layers, num_logical = load.shape
    per_gpu = num_replicas // num_gpus
    r_min, r_max = max(0, num_gpus - num_logical), num_replicas - num_logical
    width = r_max - r_min + 1
    grants, _, _ = replicate_by_load(load, num_replicas)  # every prefix of the grants is DeepSeek's for r
    onehot = np.zeros((num_layers, r_max + 1, num_logical))
    onehot[np.arange(num_layers)[:, None], np.arange(1, r_max + 1), grants[:, num_logical:]] = 1
    counts = 1 + onehot.cumsum(1)[:, r_min:]  # [L, K, E] replicas per expert after r_min + k grants
    per_replica = np.take_along_axis(load[:, None] / counts, np.broadcast_to(grants[:, None], (num_layers, width,
                                                                                            num_replicas)), -1)
    present = np.arange(num_replicas) < num_logical + r_min + np.arange(width)[:, None]  # [K, P]
    pack = pack_with_room(per_replica.reshape(-1, num_replicas),
                          np.broadcast_to(present, (num_layers, width, num_replicas)).reshape(-1, num_replicas),
                          num_gpus, per_gpu)
    pack = pack.reshape(num_layers, width, num_replicas)
    step = np.zeros((num_layers, width))
    gpu_slot = np.where(pack >= 0, pack, num_gpus) + (np.arange(num_layers * width) * (num_gpus + 1)).reshape(
        num_layers, width, 1)  # a flat (layer, r, GPU) bin per item; absent items in a spare bin
    for bucket in history:  # [L, E]: each bucket's max GPU load under each candidate placement
        item = np.take_along_axis(bucket[:, None] / counts, np.broadcast_to(grants[:, None], pack.shape), -1)
        gpu = np.bincount(gpu_slot.ravel(), item.ravel(), minlength=num_layers * width * (num_gpus + 1))
        step += gpu.reshape(num_layers, width, num_gpus + 1)[..., :num_gpus].max(-1)
    step = np.round(step / max(float(load.sum(1).max()), 1.0) * 1e9)  # ignore gains below 1e-9 of a layer's load
    budget = int(np.floor(slot_budget * num_layers * r_max + 1e-9)) - num_layers * r_min
    k = allocate(step, max(budget, 0))
    pack = pack[np.arange(num_layers), k]  # [L, P], -1: unused slot
    return finish_placement(_fill_unused(grants, pack, counts[np.arange(num_layers), k], per_gpu), num_logical)


def _fill_unused(
    grants: np.ndarray,  # [L, P] expert of each physical item (DeepSeek's grant order)
    pack: np.ndarray,  # [L, P] GPU of each used item, -1 for the unused ones
    counts: np.ndarray,  # [L, E] replicas of each expert among the used items
    per_gpu: int,
) -> np.ndarray:
    """phy2log [L, P]: each GPU's items, then copies of one of them filling its unused slots."""
    num_layers, num_slots = grants.shape
    phy2log = np.empty_like(grants)
    for layer in range(num_layers):
        for gpu in range(num_slots // per_gpu):
            experts = grants[layer, pack[layer] == gpu]  # a GPU always holds at least one item
            single = experts[counts[layer, experts] == 1]
            copy = (single if len(single) else experts)[0]
            phy2log[layer, gpu * per_gpu:(gpu + 1) * per_gpu] = np.concatenate(
                [experts, np.full(per_gpu - len(experts), copy)])
    return phy2log
