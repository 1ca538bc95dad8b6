"""Mixture-of-experts layers and their expert-parallel load balancing (EPLB) wiring.

    router.py          select_experts / route: softmax or sigmoid, top-k, renormalise, DeepSeek groups,
                       routed_scaling_factor, e_score_correction_bias (pure functions)
    experts.py         expert compute: torch reference; `moe_backend` selection
    triton_fused_moe.py  the fused grouped-GEMM Triton path (imported only when used)
    layer.py           MoeBlock = MoeGate + FusedMoE (physical slots, replicas, load counter) + shared expert
    weights.py         per-expert and fused checkpoint names -> FusedMoE parameters
    ep.py              expert parallelism over torch.distributed (all-to-all dispatch)

The EPLB controller and settings that drive these layers live in research_lm.eplb (controller.py, settings.py).

A model family builds `MoeBlock(hidden, moe_intermediate, num_experts, RouterConfig(...),
MoeOptions.from_extra(build.extra, build.device), shared_intermediate_size=...)` as a layer's MLP and
loads with `load_moe_params` (see research_lm/models/mixtral.py and qwen_moe.py).
"""

from research_lm.moe.config import MoeOptions
from research_lm.moe.experts import fused_experts, fused_experts_torch, resolve_moe_backend
from research_lm.moe.layer import FusedMoE, MoeBlock, MoeGate
from research_lm.moe.router import RouterConfig, group_limited_scores, route, score, select_experts
from research_lm.moe.weights import HF_EXPERT_PROJS, MIXTRAL_EXPERT_PROJS, load_moe_params

__all__ = [
    "HF_EXPERT_PROJS", "MIXTRAL_EXPERT_PROJS", "FusedMoE", "MoeBlock",
    "MoeGate", "MoeOptions", "RouterConfig", "fused_experts", "fused_experts_torch",
    "group_limited_scores", "load_moe_params", "resolve_moe_backend", "route", "score",
    "select_experts",
]
