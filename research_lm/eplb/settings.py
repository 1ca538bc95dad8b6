"""The EPLB settings: one `conf/eplb/*.yaml` group (or `eplb_config` dict), validated when made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from research_lm.api.checks import checked

# eplb_config key -> its kind (research_lm.api.checks; "?": None allowed); the keys are EplbSettings' fields.
_KINDS = {
    "policy": "str", "step_interval": "count", "window_size": "posint", "max_rebalances": "count?",
    "num_ep_ranks": "posint", "num_nodes": "posint", "num_redundant_experts": "count", "record_trace": "path?",
    "expert_parallel": "bool", "dispatch": "str", "rebalance_layers_per_chunk": "posint?", "nvlink_gbps": "number",
    "ib_gbps": "number",
}
DISPATCH_CHOICES = ("policy", "round_robin", "least_loaded")


@dataclass(frozen=True)
class EplbSettings:
    """One `conf/eplb/*.yaml` group, validated. Field meanings are in conf/eplb/none.yaml."""

    policy: str = "none"
    step_interval: int = 0  # rebalance after every N engine steps; 0 = never
    window_size: int = 1000  # steps of load the policy sees
    max_rebalances: int | None = None  # None = unlimited
    num_ep_ranks: int = 1  # EP ranks (simulated unless expert_parallel); slots [r * P / R, (r + 1) * P / R) on rank r
    num_nodes: int = 1
    num_redundant_experts: int = 0  # physical slots per layer = num_experts + this
    record_trace: str | None = None  # write the per-step logical load to this .npz (research_lm.eplb.trace)
    # Real EP over the torchrun processes (research_lm.engine.distributed): num_ep_ranks must equal WORLD_SIZE.
    expert_parallel: bool = False
    dispatch: str = "policy"  # how tokens pick among replicas: the policy's rule, round_robin or least_loaded
    rebalance_layers_per_chunk: int | None = None  # None: move every layer at once; c: c layers a step after
    nvlink_gbps: float = 450.0  # GB/s per GPU inside a node, for the implied transfer time of a rebalance
    ib_gbps: float = 50.0  # GB/s per GPU across nodes

    def __post_init__(self) -> None:
        """Every value checked (numpy ints become ints) when the settings are made, before any model is built:
        the engine parses its eplb_config first thing."""
        from research_lm.eplb.registry import available_policies

        for name, kind in _KINDS.items():  # frozen: set through object's own __setattr__
            object.__setattr__(self, name, checked(f"eplb.{name}", getattr(self, name), kind))
        if self.policy not in available_policies():
            raise ValueError(f"unknown EPLB policy {self.policy!r}; choose one of {available_policies()}")
        if self.num_ep_ranks % self.num_nodes:
            raise ValueError(f"eplb.num_ep_ranks ({self.num_ep_ranks}) must divide by num_nodes ({self.num_nodes})")
        if self.dispatch not in DISPATCH_CHOICES:
            raise ValueError(f"unknown eplb.dispatch {self.dispatch!r}; choose one of {list(DISPATCH_CHOICES)}")
        for name in ("nvlink_gbps", "ib_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"eplb.{name} must be > 0, got {getattr(self, name)!r}")

    def dispatch_rule(self) -> str:
        """The dispatch the MoE layers use: `dispatch`, or the policy's own (its registry traits) for "policy"."""
        if self.dispatch != "policy":
            return self.dispatch
        from research_lm.eplb.registry import get_policy, policy_traits

        return policy_traits(get_policy(self.policy)).dispatch

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | None) -> EplbSettings:
        if config is not None and not isinstance(config, Mapping):
            raise ValueError(f"eplb_config must be a dict of {sorted(_KINDS)} (or None), got {config!r}")
        config = dict(config or {})
        unknown = sorted(set(config) - set(_KINDS))
        if unknown:
            raise ValueError(f"unknown eplb config key(s) {unknown}; known: {sorted(_KINDS)}")
        return cls(**config)

    def check_experts(self, num_experts: int) -> None:
        """The placement constraints that depend on the model: raised while the model is built."""
        slots = num_experts + self.num_redundant_experts
        if slots % self.num_ep_ranks:
            raise ValueError(
                f"{num_experts} experts + eplb.num_redundant_experts ({self.num_redundant_experts}) = {slots} "
                f"physical slots per layer, which does not divide over eplb.num_ep_ranks ({self.num_ep_ranks})"
            )
