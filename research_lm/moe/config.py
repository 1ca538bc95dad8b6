"""MoE knobs read from `ModelBuildContext.extra`: the expert backend and the EPLB config (conf/eplb/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from research_lm.moe.experts import resolve_moe_backend


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
    # Real EP over the torchrun processes (research_lm.distributed): num_ep_ranks must equal WORLD_SIZE.
    expert_parallel: bool = False

    @classmethod
    def from_dict(cls, config: dict[str, Any] | None) -> EplbSettings:
        config = dict(config or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown eplb config key(s) {unknown}; known: {sorted(known)}")
        settings = cls(**config)
        settings.validate()
        return settings

    def validate(self) -> None:
        from research_lm.eplb import available_policies

        if self.policy not in available_policies():
            raise ValueError(f"unknown EPLB policy {self.policy!r}; choose one of {available_policies()}")
        for name in ("step_interval", "num_redundant_experts"):
            if getattr(self, name) < 0:
                raise ValueError(f"eplb.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("window_size", "num_ep_ranks", "num_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"eplb.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_rebalances is not None and self.max_rebalances < 0:
            raise ValueError(f"eplb.max_rebalances must be >= 0 or null, got {self.max_rebalances}")
        if self.num_ep_ranks % self.num_nodes:
            raise ValueError(f"eplb.num_ep_ranks ({self.num_ep_ranks}) must divide by num_nodes ({self.num_nodes})")

    def check_experts(self, num_experts: int) -> None:
        """The placement constraints that depend on the model: raised while the model is built."""
        slots = num_experts + self.num_redundant_experts
        if slots % self.num_ep_ranks:
            raise ValueError(
                f"{num_experts} experts + eplb.num_redundant_experts ({self.num_redundant_experts}) = {slots} "
                f"physical slots per layer, which does not divide over eplb.num_ep_ranks ({self.num_ep_ranks})"
            )


@dataclass(frozen=True)
class MoeOptions:
    backend: str  # resolved: "torch" or "triton"
    num_redundant_experts: int
    eplb: EplbSettings
    ep_group: Any = None  # a torch.distributed ProcessGroup: real expert parallelism (research_lm.moe.ep)
    # True (engine EP, eplb.expert_parallel): every rank brings the same tokens; False: each its own
    ep_replicated_tokens: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any], device: torch.device) -> MoeOptions:
        """extra: `moe_backend` (torch | triton | auto), `eplb` (a conf/eplb dict), `ep_group` (optional)."""
        eplb = EplbSettings.from_dict(extra.get("eplb"))
        if eplb.expert_parallel and extra.get("ep_group") is None:
            raise ValueError("eplb.expert_parallel needs a process group in extra['ep_group']: build the model "
                             "through LLM / LLMEngine, which creates it under torchrun")
        backend = resolve_moe_backend(extra.get("moe_backend", "torch"), device)
        return cls(backend=backend, num_redundant_experts=eplb.num_redundant_experts, eplb=eplb,
                   ep_group=extra.get("ep_group"), ep_replicated_tokens=eplb.expert_parallel)
