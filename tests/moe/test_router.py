"""Routers: `select_experts` equals a per-token reference written from the formulas, and transformers'
own router modules (Mixtral, Qwen2/3-MoE, DeepSeek-V2 greedy and group-limited, DeepSeek-V3)."""

from __future__ import annotations

import pytest
import torch

from research_lm.moe.router import RouterConfig, group_limited_scores, route, select_experts


def _logits(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    return torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)) * 2


def _reference(logits, top_k, scoring, renormalize, n_group, topk_group, scale, bias):
    """One token at a time, in float64, straight from the router docstring."""
    weights, ids = [], []
    for row in logits.double():
        s = row.softmax(-1) if scoring == "softmax" else row.sigmoid()
        c = s + (bias.double() if bias is not None else 0)
        allowed = list(range(len(row)))
        if n_group and n_group > 1:
            size = len(row) // n_group
            groups = [c[g * size:(g + 1) * size] for g in range(n_group)]
            gscore = [(g.max() if bias is None else g.sort(descending=True).values[:2].sum()).item() for g in groups]
            kept = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
            allowed = [e for e in allowed if e // size in kept]
        chosen = sorted(allowed, key=lambda e: -c[e].item())[:top_k]
        w = torch.stack([s[e] for e in chosen])
        if renormalize:
            w = w / w.sum()
        weights.append(w * scale)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids)


def _sorted_by_id(weights, ids):
    order = ids.argsort(-1)
    return weights.gather(-1, order), ids.gather(-1, order)


CASES = [
    # scoring, renormalize, n_group, topk_group, scale, bias
    ("softmax", False, None, None, 1.0, False),  # Qwen2-MoE default
    ("softmax", True, None, None, 1.0, False),  # Mixtral, Qwen3-MoE with norm_topk_prob
    ("softmax", False, 4, 2, 16.0, False),  # DeepSeek-V2 group_limited_greedy
    ("sigmoid", True, 4, 2, 2.5, True),  # DeepSeek-V3
    ("sigmoid", False, 1, 1, 1.0, True),  # sigmoid with bias, no groups
    ("softmax", True, 8, 3, 1.0, True),  # groups of 2 with a bias: top-2 sums are whole groups
]


@pytest.mark.parametrize("scoring, renormalize, n_group, topk_group, scale, use_bias", CASES)
@pytest.mark.parametrize("top_k", [1, 4])
def test_select_experts_matches_reference(scoring, renormalize, n_group, topk_group, scale, use_bias, top_k):
    num_experts = 16
    logits = _logits(37, num_experts, seed=top_k)
    bias = torch.randn(num_experts, generator=torch.Generator().manual_seed(9)) * 0.3 if use_bias else None
    weights, ids = select_experts(
        logits, top_k, scoring_func=scoring, renormalize=renormalize, num_expert_group=n_group,
        topk_group=topk_group, routed_scaling_factor=scale, e_score_correction_bias=bias,
    )
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (37, top_k)
    ref_w, ref_ids = _reference(logits, top_k, scoring, renormalize, n_group, topk_group, scale, bias)
    w, i = _sorted_by_id(weights, ids)
    rw, ri = _sorted_by_id(ref_w.float(), ref_ids)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)


def test_group_limit_excludes_other_groups():
    """With topk_group=1 every chosen expert lies in one group, the one holding the best score (max rule)."""
    logits = _logits(50, 16, seed=3)
    _, ids = select_experts(logits, 3, num_expert_group=4, topk_group=1)
    groups = ids // 4
    assert (groups == groups[:, :1]).all()
    assert torch.equal(groups[:, 0], logits.argmax(-1) // 4)
    masked = group_limited_scores(logits.softmax(-1), 4, 1)
    assert (masked.isinf().sum(-1) == 12).all()


def test_bias_steers_choice_but_not_weights():
    """DeepSeek-V3: the correction bias changes which experts win, the weights stay the raw sigmoid scores."""
    logits = torch.zeros(1, 8)
    logits[0, 0] = 1.0
    bias = torch.zeros(8)
    bias[5] = 10.0
    weights, ids = select_experts(logits, 2, scoring_func="sigmoid", e_score_correction_bias=bias)
    assert sorted(ids[0].tolist()) == [0, 5]
    torch.testing.assert_close(weights[0].sort().values, torch.tensor([0.5, torch.sigmoid(torch.tensor(1.0))]))


def test_router_config_validation():
    with pytest.raises(ValueError, match="scoring_func"):
        RouterConfig(top_k=2, scoring_func="relu")
    with pytest.raises(ValueError, match="topk_group"):
        RouterConfig(top_k=2, num_expert_group=4)
    with pytest.raises(ValueError, match="cannot hold"):
        RouterConfig(top_k=5, num_expert_group=4, topk_group=1).validate(16)
    with pytest.raises(ValueError, match="equal groups"):
        RouterConfig(top_k=2, num_expert_group=3, topk_group=1).validate(16)
    with pytest.raises(ValueError, match="exceeds"):
        RouterConfig(top_k=9).validate(8)


# ---- transformers' routers -----------------------------------------------------------------------

def _hf_router(config_class: str, router_module: str, router_class: str, **overrides):
    import importlib

    import transformers

    config = getattr(transformers, config_class)(hidden_size=32, **overrides)
    router = getattr(importlib.import_module(router_module), router_class)(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(1)))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(router.weight.shape[0]) * 0.1)
    return config, router


HF_ROUTERS = [
    ("MixtralConfig", "transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter",
     dict(num_local_experts=8, num_experts_per_tok=2), RouterConfig(top_k=2, renormalize=True)),
    ("Qwen2MoeConfig", "transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter",
     dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False), RouterConfig(top_k=3)),
    ("Qwen3MoeConfig", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter",
     dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True), RouterConfig(top_k=2, renormalize=True)),
    ("DeepseekV2Config", "transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2TopkRouter",
     dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="greedy", routed_scaling_factor=2.0),
     RouterConfig(top_k=3, routed_scaling_factor=2.0, logits_fp32=True)),
    ("DeepseekV2Config", "transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2TopkRouter",
     dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4,
          topk_group=2, routed_scaling_factor=2.0),
     RouterConfig(top_k=3, num_expert_group=4, topk_group=2, routed_scaling_factor=2.0, logits_fp32=True)),
    ("DeepseekV3Config", "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter",
     dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
          routed_scaling_factor=2.5),
     RouterConfig(top_k=4, scoring_func="sigmoid", renormalize=True, num_expert_group=4, topk_group=2,
                  routed_scaling_factor=2.5, has_correction_bias=True, logits_fp32=True)),
]


@pytest.mark.parametrize("config_class, module, cls, overrides, ours", HF_ROUTERS,
                         ids=[f"{r[2]}-{i}" for i, r in enumerate(HF_ROUTERS)])
def test_matches_transformers_router(config_class, module, cls, overrides, ours):
    _, router = _hf_router(config_class, module, cls, **overrides)
    hidden = torch.randn(29, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, hf_weights, hf_ids = router(hidden)
    logits = torch.nn.functional.linear(hidden, router.weight)
    weights, ids = route(logits, ours, getattr(router, "e_score_correction_bias", None))
    w, i = _sorted_by_id(weights, ids)
    hw, hi = _sorted_by_id(hf_weights.float(), hf_ids)
    assert torch.equal(i, hi)
    torch.testing.assert_close(w, hw, atol=1e-6, rtol=1e-5)
