"""EPLB policy registry and the contract every placement policy keeps.

A policy maps a load estimate to an expert placement, with the conventions of deepseek-ai/EPLB:

    policy(weight,        # [num_layers, num_logical] load per logical expert (tokens), >= 0
           num_replicas,  # physical expert slots per layer (logical + redundant)
           num_groups,    # expert groups of group-limited routing (DeepSeek's n_group); 1 if none
           num_nodes,     # server nodes (fast intra-node links)
           num_gpus)      # EP ranks; slots [g * k, (g + 1) * k) live on rank g, k = num_replicas // num_gpus
    -> (phy2log,  # [num_layers, num_replicas] int64: logical expert held by each physical slot
        log2phy,  # [num_layers, num_logical, max_replicas] int64: slots of each logical expert, -1 padded
        logcnt)   # [num_layers, num_logical] int64: replicas of each logical expert (>= 1)

Outputs are CPU tensors; the caller moves them to its device. Policies live one per module and
register here with `@register_policy("name")`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from attention_zoo.registries import Registry

PolicyOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Policy = Callable[[torch.Tensor, int, int, int, int], PolicyOutput]

# name -> module that defines it; importing the module runs its @register_policy decorator.
POLICIES: Registry[Policy] = Registry("EPLB policy", {
    "none": "research_lm.eplb.identity",
    "deepseek": "research_lm.eplb.deepseek",
    "deepseek_swap": "research_lm.eplb.swap",
    "lpt": "research_lm.eplb.lpt",
    "snake": "research_lm.eplb.snake",
})
register_policy = POLICIES.register


def available_policies() -> list[str]:
    return POLICIES.names()


def get_policy(name: str) -> Policy:
    return POLICIES.get(name)


def check_policy_args(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """Validates the common arguments; returns the load as a float64 numpy array [layers, logical]."""
    weight = torch.as_tensor(weight)
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] < 1:
        raise ValueError(
            f"weight must be a non-empty 2-D tensor [num_layers, num_logical_experts], got shape "
            f"{tuple(weight.shape)}"
        )
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups),
                        ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    num_logical = weight.shape[1]
    if num_replicas < num_logical:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be >= the number of logical experts ({num_logical}): "
            "every logical expert needs at least one physical slot"
        )
    if num_replicas % num_gpus != 0:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be divisible by num_gpus ({num_gpus}) so that every "
            "GPU holds the same number of experts"
        )
    if num_gpus % num_nodes != 0:
        raise ValueError(f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes})")
    weight = weight.detach().to("cpu", torch.float64).numpy()
    if not np.isfinite(weight).all() or (weight < 0).any():
        raise ValueError("weight (expert load) must be finite and >= 0")
    return weight
