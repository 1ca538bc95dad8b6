"""`lpt`: flat longest-processing-time packing with replication by load; no groups, no nodes.

Question it answers: what does node locality cost? It is DeepSeek's global policy applied always:
redundant slots go to the experts with the highest load per replica (D'Hondt), then physical
experts, heaviest first, go to the lightest GPU with room left, across all GPUs at once. Compared
with `deepseek` at num_groups % num_nodes == 0, the gap in balancedness is the price of keeping
each expert group on one node (which saves inter-node traffic that this simulator does not count).
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


@register_policy("lpt")
def lpt_placement(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> PolicyOutput:
    """Greedy LPT over all GPUs; ties as in `balanced_packing` (stable sort, lower index first)."""
    weight = check_policy_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    num_logical = weight.shape[1]
    phy2log, phyrank, logcnt = replicate_by_load(weight, num_replicas)
    phy_load = np.take_along_axis(weight / logcnt, phy2log, 1)
    gpu, rank_in_gpu = balanced_packing(phy_load, num_gpus)
    slot2phy = inverse_permutation(gpu * (num_replicas // num_gpus) + rank_in_gpu)
    return finish_placement(np.take_along_axis(phy2log, slot2phy, 1), num_logical,
                            np.take_along_axis(phyrank, slot2phy, 1))
