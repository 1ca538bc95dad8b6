"""`lplb`: DeepSeek's placement, and each batch's tokens balanced among the replicas it made (DeepSeek LPLB's idea).

Question it answers: a placement is fixed for thousands of steps, but every batch routes differently. How much of
the remaining imbalance goes if, per batch, each token of a replicated expert goes to the least-loaded of the
ranks holding a replica, instead of round robin? Placement: `deepseek` (hierarchical or global, as its rules
pick). Dispatch: `least_loaded` (research_lm.eplb.dispatch), which the simulator and the MoE layer apply when
this policy is chosen (or any policy with `eplb.dispatch: least_loaded`). LPLB proper solves a linear program
over the replicas' rank graph on the GPU; the greedy water-filling here needs no solver.
"""

from __future__ import annotations

import torch

from research_lm.eplb.deepseek import rebalance_experts
from research_lm.eplb.registry import PolicyOutput, register_policy


@register_policy("lplb", dispatch="least_loaded")
def lplb_placement(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> PolicyOutput:
    """DeepSeek's placement; the policy's trait makes dispatch least-loaded."""
    return rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
