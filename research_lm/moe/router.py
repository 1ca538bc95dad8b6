"""MoE routers as pure functions: router logits -> (top-k weights, top-k logical expert ids).

One function covers the routers of the families we load (T tokens, E experts, k = top_k):

    s = softmax(logits)  or  sigmoid(logits)                              scoring_func, in fp32
    c = s + b                                                             b = e_score_correction_bias (V3), else 0
    if n_group:  keep the topk_group best groups of E / n_group experts,  group score = max_g c (V2)
                 mask the other experts out of c                          or the sum of the top 2 of c (V3, with b)
    ids = topk(c, k)                                                      choice uses c ...
    w   = s[ids]                                                          ... the weights use s (bias excluded)
    w   = w / (Σ_k w + 1e-20)   if renormalize                            norm_topk_prob
    w   = w * routed_scaling_factor

    Mixtral:        softmax, renormalize
    Qwen2/3-MoE:    softmax, renormalize = norm_topk_prob
    DeepSeek-V2:    softmax, groups (topk_method "group_limited_greedy"; "greedy" = no groups), scaling
    DeepSeek-V3:    sigmoid, bias, groups scored by top-2 sums, renormalize = norm_topk_prob, scaling

The 1e-20 only guards an all-zero row (it is below fp32 resolution of any real sum of k scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RouterConfig:
    """What a model's config says about routing; `route(logits, config, bias)` applies it."""

    top_k: int
    scoring_func: str = "softmax"
    renormalize: bool = False  # norm_topk_prob
    num_expert_group: int | None = None  # n_group; None or 1 = no group limit
    topk_group: int | None = None  # groups kept per token
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias parameter exists
    logits_fp32: bool = False  # DeepSeek computes the gate GEMM in fp32; others in the model dtype

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; supported: {list(SCORING_FUNCS)}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.grouped and not self.topk_group:
            raise ValueError(f"num_expert_group={self.num_expert_group} needs topk_group >= 1")

    @property
    def grouped(self) -> bool:
        return bool(self.num_expert_group) and self.num_expert_group > 1

    def validate(self, num_experts: int) -> None:
        """Fails at build time with a sentence when the config cannot route `num_experts` experts."""
        if self.top_k > num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds the number of experts ({num_experts})")
        if self.grouped:
            g, kg = self.num_expert_group, self.topk_group
            if num_experts % g:
                raise ValueError(f"{num_experts} experts do not split into n_group={g} equal groups")
            if not 1 <= kg <= g or kg * (num_experts // g) < self.top_k:
                raise ValueError(
                    f"topk_group={kg} of n_group={g} groups ({num_experts // g} experts each) cannot hold "
                    f"top_k={self.top_k} experts"
                )


def score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:  # [T, E] -> [T, E] fp32
    """softmax over experts, or an independent sigmoid per expert, in fp32."""
    if scoring_func == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits.float())
    raise ValueError(f"scoring_func {scoring_func!r} is not supported; supported: {list(SCORING_FUNCS)}")


def group_limited_scores(
    choice: torch.Tensor,  # [T, E] fp32: the scores the choice is made on
    num_expert_group: int,
    topk_group: int,
    group_score: str = "max",  # "max" (DeepSeek-V2) or "top2_sum" (DeepSeek-V3)
) -> torch.Tensor:  # [T, E] fp32: choice with experts outside the kept groups set to -inf
    """DeepSeek's group-limited routing: score each of the n_group groups (max, or sum of the top 2
    members), keep the topk_group best groups per token, and exclude every expert of the others."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
    if group_score == "max":
        group_scores = grouped.amax(dim=-1)
    elif group_score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        raise ValueError(f"group_score must be 'max' or 'top2_sum', got {group_score!r}")
    group_idx = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)  # [T, G]
    keep = keep[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
    return choice.masked_fill(~keep, float("-inf"))


def select_experts(
    logits: torch.Tensor,  # [T, E] router logits (any float dtype)
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,  # [E]
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, logical expert ids [T, k] int64
    """The routing formula in the module docstring. Groups are scored by their max member without a
    correction bias and by the sum of their top-2 members with one (vLLM's and the references' rule)."""
    scores = score(logits, scoring_func)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group and num_expert_group > 1:
        group_score = "max" if e_score_correction_bias is None else "top2_sum"
        choice = group_limited_scores(choice, num_expert_group, topk_group, group_score)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


def route(
    logits: torch.Tensor,  # [T, E]
    config: RouterConfig,
    e_score_correction_bias: torch.Tensor | None = None,  # [E]
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, ids [T, k] int64
    return select_experts(
        logits, config.top_k, scoring_func=config.scoring_func, renormalize=config.renormalize,
        num_expert_group=config.num_expert_group, topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor, e_score_correction_bias=e_score_correction_bias,
    )
