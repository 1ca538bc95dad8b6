"""train_moe: a few CPU steps write a checkpoint the engine serves like transformers and records traces from;
the loss is cross-entropy + the architecture's default load-balancing coefficient; bad shapes fail by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.eplb.trace import TRACE_FORMAT, load_trace
from research_lm.harness.corpus import corpus_hash, stdlib_files
from research_lm.harness.train.config import TrainConfig
from research_lm.harness.train.moe import (
    ARCHITECTURES,
    MoeLMObjective,
    build_moe,
    expert_load_ratio,
    moe_config,
    train_moe,
)
from research_lm.harness.train.moe_traces import record_trace
from research_lm.harness.workloads import WorkloadSpec

TINY_MOE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)  # fmt: skip


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny_moe(request, tmp_path_factory, train_kwargs) -> tuple[str, Path, Path]:
    """(architecture, trained dir, init dir) after 3 steps."""
    base = tmp_path_factory.mktemp(request.param)
    cfg = TrainConfig(output_dir=str(base / "trained"), steps=3, **{**train_kwargs, "save_every": 0})
    train_moe(cfg, architecture=request.param, model=TINY_MOE, init_dir=str(base / "init"))
    return request.param, base / "trained", base / "init"


def _tokenizer():
    from transformers import AutoTokenizer

    from research_lm.models.loader import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny-llama"))


def test_checkpoint_records_its_recipe_and_is_served_like_transformers(tiny_moe):
    """recipe.json names the corpus, seed, architecture and aux coefficient; LLM(path)'s greedy tokens are
    transformers' argmax loop on the same weights (the router included); the init dir holds other weights."""
    from transformers import AutoModelForCausalLM

    architecture, trained, init = tiny_moe
    recipe = json.loads((trained / "recipe.json").read_text())
    assert recipe["corpus_hash"] == corpus_hash(stdlib_files(limit_bytes=30_000)) and recipe["seed"] == 0
    assert recipe["architecture"] == architecture and recipe["router_aux_loss_coef"] == 0.001
    assert recipe["model"]["num_experts"] == 4 and recipe["steps"] == 3
    assert math.isfinite(recipe["final_val_lm_loss"]) and recipe["final_val_lm_loss"] < recipe["final_val_loss"]
    assert json.loads((trained / "config.json").read_text())["architectures"] == [architecture]
    assert json.loads((init / "recipe.json").read_text())["seed"] == 0

    llm = LLM(str(trained), device="cpu", dtype="float32")
    prompt = llm.get_tokenizer()("def main(")["input_ids"]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert list(out[0].outputs[0].token_ids) == ids[0, len(prompt):].tolist()

    before = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(before.state_dict()[gate], hf.state_dict()[gate])  # the router trained


def test_record_trace_serves_workloads_in_turn(tiny_moe, tmp_path):
    """One engine, code then prose: a research_lm.eplb.trace file [steps, layers, experts] whose segments tile
    the steps; every layer routes each step's tokens top_k times."""
    _, trained, _ = tiny_moe
    specs = [WorkloadSpec(kind=kind, num_requests=2, max_tokens=3, prompt_chars=60) for kind in ("code", "prose")]
    trace = record_trace(trained, specs, tmp_path / "t.npz", meta={"note": "x"}, device="cpu", dtype="float32")
    assert trace.load.shape[1:] == (2, 4) and trace.meta["note"] == "x" and trace.meta["policy"] == "none"
    segments = trace.meta["segments"]
    assert [s["kind"] for s in segments] == ["code", "prose"]
    assert segments[0]["start"] == 0 and segments[0]["stop"] == segments[1]["start"] > 0
    assert segments[1]["stop"] == trace.num_steps
    per_layer = trace.load.sum(-1)  # [steps, layers]
    assert (per_layer == per_layer[:, :1]).all() and (per_layer % 2 == 0).all() and (per_layer > 0).all()
    assert torch.equal(load_trace(tmp_path / "t.npz").load, trace.load)


def test_record_trace_refuses_a_dense_model(tmp_path):
    with pytest.raises(ValueError, match="no MoE layer"):
        record_trace("tiny-llama", [WorkloadSpec(num_requests=1, max_tokens=1)], tmp_path / "t.npz", device="cpu")


def test_objective_is_cross_entropy_plus_the_default_aux_coefficient():
    tok = _tokenizer()
    for architecture in ARCHITECTURES:
        model = build_moe(moe_config(tok, architecture, TINY_MOE), seed=0)
        objective = MoeLMObjective(model)
        assert objective.coef == 0.001  # both Qwen MoE families' default router_aux_loss_coef
        ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
        loss, metrics = objective.loss(ids)
        ce = model(input_ids=ids, labels=ids).loss  # without output_router_logits: cross-entropy alone
        torch.testing.assert_close(metrics["lm_loss"], ce.detach())
        torch.testing.assert_close(loss.detach(), ce.detach() + 0.001 * metrics["aux_loss"])
        assert 1.0 <= float(metrics["expert_load_max_over_mean"]) <= 4.0
    stronger = moe_config(tok, "Qwen3MoeForCausalLM", {**TINY_MOE, "router_aux_loss_coef": 0.01})
    assert MoeLMObjective(build_moe(stronger, seed=0)).coef == 0.01


def test_objective_takes_an_output_without_router_fields():
    """transformers 5.17's dense DeepSeek-V2 returns a CausalLMOutputWithPast with neither aux_loss nor
    router_logits (the GPU machine's version: the MTP reference failed to train there, session 30)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    model = build_moe(moe_config(_tokenizer(), "Qwen3MoeForCausalLM", TINY_MOE), seed=0)
    objective = MoeLMObjective(model)
    ce = torch.tensor(2.5, requires_grad=True)
    objective.module = lambda **_: CausalLMOutputWithPast(loss=ce)
    loss, metrics = objective.loss(torch.zeros(1, 4, dtype=torch.long))
    assert float(loss.detach()) == 2.5 and float(metrics["aux_loss"]) == 0.0
    assert "expert_load_max_over_mean" not in metrics


def test_moe_config_shapes_and_errors():
    tok = _tokenizer()
    shared = moe_config(tok, "Qwen2MoeForCausalLM", TINY_MOE)
    assert shared.shared_expert_intermediate_size == 4 * 16 and shared.vocab_size == 1024
    assert shared.norm_topk_prob and shared.architectures == ["Qwen2MoeForCausalLM"]
    with pytest.raises(ValueError, match="unknown train.model key.*num_expert"):
        moe_config(tok, "Qwen3MoeForCausalLM", {"num_expert": 8})
    with pytest.raises(ValueError, match="Qwen3-MoE has no shared expert"):
        moe_config(tok, "Qwen3MoeForCausalLM", {"shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match="MixtralForCausalLM.*Qwen2MoeForCausalLM"):
        moe_config(tok, "MixtralForCausalLM")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        moe_config(tok, "Qwen3MoeForCausalLM", {"num_experts": 2, "num_experts_per_tok": 3})


def test_expert_load_ratio_counts_top_k_choices():
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0], [3.0, 0.0, 2.0, 0.0]])  # choices {0, 1}, {0, 2}: counts 2, 1, 1, 0
    assert float(expert_load_ratio((logits,), top_k=2)) == pytest.approx(2 / 1.0)
    balanced = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    assert float(expert_load_ratio((logits, balanced), top_k=2)) == pytest.approx((2.0 + 1.0) / 2)


def test_the_trace_format_is_the_eplb_one(tiny_moe, tmp_path):
    import numpy as np

    _, trained, _ = tiny_moe
    record_trace(trained, [WorkloadSpec(num_requests=1, max_tokens=2, prompt_chars=40)], tmp_path / "t.npz",
                 device="cpu", dtype="float32")
    with np.load(tmp_path / "t.npz", allow_pickle=False) as data:
        assert str(data["format"]) == TRACE_FORMAT and data["load"].dtype.kind == "i"
