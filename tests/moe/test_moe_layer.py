"""The MoE block's placement machinery: replicas, round-robin replica choice, in-place rebalancing that
leaves outputs unchanged, load counting, and the shared expert's sigmoid gate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from research_lm.eplb import get_policy
from research_lm.moe import MoeBlock, MoeOptions, RouterConfig

E, H, INTER = 6, 16, 12


def _block(num_redundant: int = 0, shared: int = 0, seed: int = 0) -> MoeBlock:
    options = MoeOptions.from_extra({"eplb": {"num_redundant_experts": num_redundant}}, torch.device("cpu"))
    block = MoeBlock(H, INTER, E, RouterConfig(top_k=2, renormalize=True), options,
                     shared_intermediate_size=shared, shared_expert_gate=bool(shared))
    gen = torch.Generator().manual_seed(seed)
    experts = block.experts
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H, generator=gen))
        logical_w13 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.2
        logical_w2 = torch.randn(E, H, INTER, generator=gen) * 0.2
        experts.gate_up_proj.weight_loader(experts.gate_up_proj, logical_w13, None)
        experts.down_proj.weight_loader(experts.down_proj, logical_w2, None)
        for name, p in block.named_parameters():
            if "shared" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    block.logical_w13, block.logical_w2 = logical_w13, logical_w2
    return block


def _slots_hold_their_experts(block: MoeBlock) -> bool:
    ex = block.experts
    return all(torch.equal(ex.gate_up_proj[s], block.logical_w13[e]) and torch.equal(ex.down_proj[s],
               block.logical_w2[e]) for s, e in enumerate(ex.phy2log.tolist()))


def test_replicas_are_loaded_into_every_slot():
    block = _block(num_redundant=3)
    ex = block.experts
    assert ex.num_slots == 9 and ex.phy2log.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert ex.logcnt.tolist() == [2, 2, 2, 1, 1, 1]
    assert _slots_hold_their_experts(block)


def test_per_expert_shards_fill_all_replicas():
    block = _block(num_redundant=2)
    ex = block.experts
    new = torch.full((INTER, H), 7.0)
    ex.gate_up_proj.weight_loader(ex.gate_up_proj, new, (1, "up"))
    for slot in (1, 7):  # expert 1 lives in slots 1 and 7
        assert torch.equal(ex.gate_up_proj[slot, INTER:], new)
        assert not torch.equal(ex.gate_up_proj[slot, :INTER], new)
    with pytest.raises(ValueError, match="does not exist"):
        ex.down_proj.weight_loader(ex.down_proj, torch.zeros(H, INTER), (E, "down"))


def test_round_robin_replica_choice():
    block = _block(num_redundant=2)  # experts 0 and 1 have replicas at slots 6 and 7
    ids = torch.tensor([[0, 3], [0, 1], [0, 1], [2, 1]])
    slots = block.experts.to_physical(ids)
    assert slots.tolist() == [[0, 3], [6, 7], [0, 1], [2, 7]]  # replica = token index % replica count


def test_rebalance_moves_weights_and_keeps_outputs():
    block = _block(num_redundant=2, shared=8)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = block(x)
    load = torch.rand(1, E, generator=torch.Generator().manual_seed(4)) * 100
    load[0, 4] = 1000  # expert 4 is hot: it gets the replicas
    phy2log, log2phy, logcnt = get_policy("deepseek")(load, 8, 1, 1, 2)
    moved = block.experts.apply_placement(phy2log[0], log2phy[0], logcnt[0])
    assert moved > 0 and block.experts.logcnt[4] >= 2
    assert block.experts.phy2log.tolist() == phy2log[0].tolist()
    assert _slots_hold_their_experts(block)
    with torch.no_grad():
        after = block(x)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    assert block.experts.apply_placement(phy2log[0], log2phy[0], logcnt[0]) == 0  # idempotent


def test_load_counter_counts_routed_pairs_without_sync():
    block = _block(num_redundant=2)
    block.experts.record_load = True
    x = torch.randn(11, H)
    with torch.no_grad():
        block(x)
        block(x[:5])
    assert int(block.experts.expert_load.sum()) == (11 + 5) * 2
    block.experts.expert_load.zero_()
    with torch.no_grad():
        block(x)
        slots = block.experts.to_physical(block.gate(x)[1])
    assert torch.equal(block.experts.expert_load, torch.bincount(slots.flatten(), minlength=8))


def test_shared_expert_is_sigmoid_gated():
    block = _block(shared=8)
    x = torch.randn(5, H)
    with torch.no_grad():
        weights, ids = block.gate(x)
        routed = block.experts(x, weights, ids)
        gate, up = F.linear(x, block.shared_expert.gate_up_proj.weight).chunk(2, -1)
        shared = F.linear(F.silu(gate) * up, block.shared_expert.down_proj.weight)
        expected = routed + torch.sigmoid(x @ block.shared_expert_gate.weight.T) * shared
        torch.testing.assert_close(block(x), expected, atol=1e-6, rtol=1e-6)


def test_bad_placement_is_rejected():
    block = _block(num_redundant=1)
    with pytest.raises(ValueError, match="phy2log"):
        block.experts.apply_placement(torch.tensor([0, 1, 2, 3, 4, 5, 9]), torch.zeros(E, 2, dtype=torch.int64),
                                      torch.ones(E, dtype=torch.int64))


# ---- DeepSeek's MoE block (the MLA model lives elsewhere; its MoE is this block) -------------------

DEEPSEEK_BLOCKS = [
    ("DeepseekV2Config", "deepseek_v2", "DeepseekV2Moe",
     dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5, mlp_bias=True),
     RouterConfig(top_k=3, num_expert_group=4, topk_group=2, routed_scaling_factor=1.5, logits_fp32=True)),
    ("DeepseekV3Config", "deepseek_v3", "DeepseekV3MoE",
     dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
     RouterConfig(top_k=3, scoring_func="sigmoid", renormalize=True, num_expert_group=4, topk_group=2,
                  routed_scaling_factor=2.5, has_correction_bias=True, logits_fp32=True)),
]


@pytest.mark.parametrize("config_class, module, cls, overrides, router", DEEPSEEK_BLOCKS, ids=["v2", "v3"])
def test_deepseek_moe_block_matches_transformers(config_class, module, cls, overrides, router):
    """Grouped routing, scaling, correction bias and (biased) shared experts, with 2 redundant slots;
    weights read from transformers' in-memory (fused) names, shared_experts renamed to shared_expert."""
    import importlib

    import transformers

    from research_lm.models.llama import STACKED_PARAMS
    from research_lm.moe import load_moe_params

    config = getattr(transformers, config_class)(
        hidden_size=H, num_attention_heads=2, n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=INTER,
        n_shared_experts=2,
        **overrides,
    )
    hf = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)(config).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in list(hf.parameters()) + list(hf.buffers()):
            p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if p.dim() == 1 else 0.3))
    options = MoeOptions.from_extra({"eplb": {"num_redundant_experts": 2}}, torch.device("cpu"))
    ours = torch.nn.ModuleDict({"mlp": MoeBlock(
        H, INTER, 16, router, options, shared_intermediate_size=2 * INTER,
        shared_expert_bias=overrides.get("mlp_bias", False))})
    state = {f"mlp.{k}": v for k, v in hf.state_dict().items()}
    loaded = load_moe_params(ours, state.items(), STACKED_PARAMS, renames=((".shared_experts.", ".shared_expert."),))
    assert loaded == {name for name, _ in ours.named_parameters()}
    x = torch.randn(1, 23, H, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(ours["mlp"](x[0]), hf(x)[0], atol=1e-5, rtol=1e-5)
