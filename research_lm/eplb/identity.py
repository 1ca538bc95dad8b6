"""`none`: identity placement, the baseline every other policy must beat.

Question it answers: how unbalanced are EP ranks if experts are never moved? Slot s holds logical
expert s % num_logical: the first num_logical slots hold experts in order, and redundant slots (when
num_replicas > num_logical) replicate experts 0, 1, 2, ... round-robin, whatever their load. This is
vLLM's initial placement. The load, groups and nodes are ignored (the arguments are still validated).
"""

from __future__ import annotations

import numpy as np
import torch

from research_lm.eplb.packing import finish_placement
from research_lm.eplb.registry import PolicyOutput, check_policy_args, register_policy


@register_policy("none")
def identity_placement(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> PolicyOutput:
    """phy2log[l, s] = s % num_logical; replicas of an expert are numbered in slot order."""
    weight = check_policy_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    num_layers, num_logical = weight.shape
    slots = np.broadcast_to(np.arange(num_replicas), (num_layers, num_replicas))
    return finish_placement(slots % num_logical, num_logical, phyrank=slots // num_logical)
