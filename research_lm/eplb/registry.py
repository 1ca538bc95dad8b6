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

Traits: what a policy asks of its caller beyond the contract, declared where it registers and read through
`policy_traits` by the replay (`research_lm.eplb.replay`) and the engine's controller (`research_lm.eplb.controller`).
A plain callable (a custom policy handed to `replay`) has the defaults, so the contract above is all it needs.

    @register_policy("deepseek_vec", history_buckets=16)   # weight may be [B, L, E]: the window's load history,
                                                           # B <= 16 contiguous bucket sums, oldest first
    @register_policy("lplb", dispatch="least_loaded")      # tokens pick the least-loaded replica per batch
                                                           # (research_lm.eplb.dispatch), not round robin

A policy with history_buckets > 0 still accepts a 2-D weight (one bucket).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from attention_zoo.registries import Registry

PolicyOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Policy = Callable[[torch.Tensor, int, int, int, int], PolicyOutput]

# How tokens of an expert with several replicas pick one: `round_robin` (token index modulo the replica count;
# simulated as an even split) or `least_loaded` (per batch, to the least-loaded replica's rank).
DISPATCH_RULES = ("round_robin", "least_loaded")

# name -> module that defines it; importing the module runs its @register_policy decorator.
POLICIES: Registry[Policy] = Registry("EPLB policy", {
    "none": "research_lm.eplb.identity",
    "deepseek": "research_lm.eplb.deepseek",
    "deepseek_swap": "research_lm.eplb.swap",
    "lpt": "research_lm.eplb.lpt",
    "snake": "research_lm.eplb.snake",
    "deepseek_vec": "research_lm.eplb.deepseek_vec",
    "budgeted": "research_lm.eplb.budgeted",
    "lplb": "research_lm.eplb.lplb",
})


@dataclass(frozen=True)
class PolicyTraits:
    history_buckets: int = 0  # > 0: give the policy the window's history [B <= history_buckets, L, E]
    dispatch: str = "round_robin"  # one of DISPATCH_RULES

    def __post_init__(self) -> None:
        if int(self.history_buckets) != self.history_buckets or self.history_buckets < 0:
            raise ValueError(f"history_buckets must be a non-negative integer, got {self.history_buckets!r}")
        if self.dispatch not in DISPATCH_RULES:
            raise ValueError(f"unknown dispatch rule {self.dispatch!r}; choose one of {list(DISPATCH_RULES)}")


def register_policy(
    name: str, *, history_buckets: int = 0, dispatch: str = "round_robin"
) -> Callable[[Policy], Policy]:
    """A decorator: registers the policy under `name` with its traits (stored as its `traits` attribute)."""
    traits = PolicyTraits(history_buckets, dispatch)

    def wrap(fn: Policy) -> Policy:
        fn.traits = traits
        return POLICIES.register(name)(fn)

    return wrap


def configured_policy(name: str, **options) -> Policy:
    """The registered policy `name` with keyword options bound (e.g. `budgeted`'s slot_budget), keeping its name
    and traits, for `replay` or a benchmark."""
    fn = get_policy(name)
    bound = functools.partial(fn, **options)
    bound.__name__ = name
    bound.traits = policy_traits(fn)
    return bound


def policy_traits(policy: Policy) -> PolicyTraits:
    """The traits a policy registered with; the defaults for any other callable."""
    traits = getattr(policy, "traits", None)
    return traits if isinstance(traits, PolicyTraits) else PolicyTraits()


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


def check_history_args(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """`check_policy_args` for a policy that takes history: weight [L, E] or [B, L, E]; returns float64 [B, L, E]."""
    weight = torch.as_tensor(weight)
    if weight.dim() == 3:
        if weight.shape[0] < 1:
            raise ValueError(f"a load history [B, L, E] needs B >= 1, got shape {tuple(weight.shape)}")
        history = weight.detach().to("cpu", torch.float64).numpy()
        if not np.isfinite(history).all() or (history < 0).any():
            raise ValueError("weight (expert load) must be finite and >= 0")
        check_policy_args(weight.sum(0), num_replicas, num_groups, num_nodes, num_gpus)
        return history
    return check_policy_args(weight, num_replicas, num_groups, num_nodes, num_gpus)[None]
