"""`snake`: replication by load, then a sort-and-deal (boustrophedon) placement; no sequential packing.

Question it answers: how much of the greedy packing's balance does a placement step get that is one
sort and index arithmetic, with no item-by-item loop (replication is the same greedy as deepseek's)? Physical experts,
sorted by per-replica load (heaviest first, stable), are dealt to GPUs 0, 1, ..., G-1, then
G-1, ..., 0, and so on; every GPU gets one item per round. Groups and nodes are ignored.
"""

from __future__ import annotations

import numpy as np
import torch

from research_lm.eplb.packing import finish_placement, replicate_by_load
from research_lm.eplb.registry import PolicyOutput, check_policy_args, register_policy


@register_policy("snake")
def snake_placement(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> PolicyOutput:
    """Item j of the load-sorted list goes to round r = j // G at GPU j % G (r even) or G-1-j % G (odd)."""
    weight = check_policy_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    num_layers, num_logical = weight.shape
    phy2log, phyrank, logcnt = replicate_by_load(weight, num_replicas)
    phy_load = np.take_along_axis(weight / logcnt, phy2log, 1)
    order = np.argsort(-phy_load, axis=1, kind="stable")  # [L, P]: physical expert at sorted position j
    j = np.arange(num_replicas)
    rnd, col = j // num_gpus, j % num_gpus
    gpu = np.where(rnd % 2 == 0, col, num_gpus - 1 - col)
    slot_of_position = gpu * (num_replicas // num_gpus) + rnd  # [P]
    slot2phy = np.empty_like(order)
    slot2phy[:, slot_of_position] = order
    return finish_placement(np.take_along_axis(phy2log, slot2phy, 1), num_logical,
                            np.take_along_axis(phyrank, slot2phy, 1))
