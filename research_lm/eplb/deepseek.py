"""`deepseek`: the DeepSeek EPLB algorithm (deepseek-ai/EPLB), rewritten and vectorised over layers.

Question it answers: the production baseline. How balanced do EP ranks get with DeepSeek's
redundant-expert replication and greedy packing, while keeping each expert group on one node?
"""

from __future__ import annotations

import numpy as np
import torch

from research_lm.eplb.packing import (
    balanced_packing,
    finish_placement,
    inverse_permutation,
    replicate_by_load,
)
from research_lm.eplb.registry import PolicyOutput, check_policy_args, register_policy


def _hierarchical(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray]:
    """weight: [L, E] float64. Returns phy2log [L, P] and the replica index of each slot [L, P]."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = num_logical // num_nodes
    phy_per_node = num_replicas // num_nodes
    phy_per_gpu = num_replicas // num_gpus

    # 1. Groups to nodes, balancing node load. Renumber experts node-major ("mlog"): node n holds
    #    mlog ids [n * log_per_node, (n + 1) * log_per_node), its groups in arrival order.
    group_load = weight.reshape(num_layers, num_groups, group_size).sum(-1)  # [L, G]
    node_of_group, rank_in_node = balanced_packing(group_load, num_nodes)
    group_start = (node_of_group * groups_per_node + rank_in_node) * group_size  # [L, G]
    log2mlog = (group_start[:, :, None] + np.arange(group_size)).reshape(num_layers, num_logical)
    mlog2log = inverse_permutation(log2mlog)

    # 2. Replicate within each node: rows are (layer, node) pairs.
    node_load = np.take_along_axis(weight, mlog2log, 1).reshape(num_layers * num_nodes, log_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_by_load(node_load, phy_per_node)

    # 3. Pack each node's physical experts onto its GPUs; a replica carries load / replicas.
    phy_load = np.take_along_axis(node_load / mlogcnt, phy2mlog, 1)  # [L * N, phy_per_node]
    gpu, rank_in_gpu = balanced_packing(phy_load, num_gpus // num_nodes)
    slot2phy = inverse_permutation(gpu * phy_per_gpu + rank_in_gpu)

    node_offset = np.tile(np.arange(num_nodes) * log_per_node, num_layers)[:, None]
    slot2mlog = (np.take_along_axis(phy2mlog, slot2phy, 1) + node_offset).reshape(num_layers, -1)
    phy2log = np.take_along_axis(mlog2log, slot2mlog, 1)
    phyrank = np.take_along_axis(phyrank, slot2phy, 1).reshape(num_layers, num_replicas)
    return phy2log, phyrank


def deepseek_slots(
    load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray]:
    """The policy on validated float64 load [L, E]: phy2log [L, P] and each slot's replica index."""
    num_logical = load.shape[1]
    if num_groups % num_nodes != 0:  # global policy
        return _hierarchical(load, num_replicas, 1, 1, num_gpus)
    if num_logical % num_groups != 0:
        raise ValueError(
            f"the number of logical experts ({num_logical}) must be divisible by num_groups "
            f"({num_groups}) for hierarchical balancing (used when num_groups % num_nodes == 0)"
        )
    return _hierarchical(load, num_replicas, num_groups, num_nodes, num_gpus)


@register_policy("deepseek")
def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> PolicyOutput:
    """DeepSeek's expert-parallel load balancer, with the interface and outputs of deepseek-ai/EPLB.

    Args:
      weight: [num_layers, num_logical_experts] load of each logical expert (e.g. tokens routed over
        a window of steps), >= 0.
      num_replicas: physical expert slots per layer, >= num_logical_experts, divisible by num_gpus.
      num_groups: expert groups (consecutive blocks of experts, DeepSeek-V3's n_group).
      num_nodes: server nodes; num_gpus must be divisible by it.
      num_gpus: EP ranks; GPU g holds slots [g * k, (g + 1) * k), k = num_replicas // num_gpus.

    Returns (phy2log [L, num_replicas], log2phy [L, num_logical, max_replicas] padded with -1,
    logcnt [L, num_logical]), int64 on the CPU.

    Policy. Hierarchical when num_groups % num_nodes == 0 (num_logical_experts must then be divisible
    by num_groups): (1) pack expert groups onto nodes, num_groups / num_nodes per node, balancing
    node load; (2) within each node, grant the node's share of redundant slots one at a time to the
    expert with the highest load per replica; (3) pack each node's physical experts onto its GPUs,
    equal count per GPU, balancing the per-replica load. Otherwise global: the same with one group
    and one node (replication and packing ignore node boundaries).

    Packing is greedy: heaviest item first, into the lightest GPU (or node) with room left.

    Ties are broken deterministically: items of equal load are taken in a stable sort, the lower
    index first; among equally light packs the lower pack index wins; among experts of equal load
    per replica the lower expert index gets the next replica. log2phy lists an expert's slots in the
    order its replicas were created (the original first).

    Differences from deepseek-ai/EPLB, which gives the same outputs on its README example: its sort
    is not stable, so where loads tie (replicas of one expert always do) it may put equal-load items
    in other slots, with the same balance; and it compares loads in float32, we in float64, which
    can order near-equal sums differently (about 1 in 600 random small-integer cases).
    """
    load = check_policy_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    phy2log, phyrank = deepseek_slots(load, num_replicas, num_groups, num_nodes, num_gpus)
    return finish_placement(phy2log, load.shape[1], phyrank)
