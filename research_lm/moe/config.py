"""MoE knobs read from `ModelBuildContext.extra`: the expert backend and the EPLB settings (eplb.settings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from research_lm.eplb.settings import EplbSettings
from research_lm.moe.experts import resolve_moe_backend


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
