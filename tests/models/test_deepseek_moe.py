"""DeepSeek-V2/V3 with routed-expert layers match transformers: logits, greedy generation, and greedy
generation under EPLB (redundant experts, rebalancing every 2 steps), token for token.

Checkpoints (tests/conftest.py): deepseek-v2-moe (softmax, group_limited_greedy over 4 groups, scaled,
biased shared experts, every layer routed) and deepseek-v3-moe (sigmoid, noaux_tc, renormalised and scaled,
layer 0 dense). transformers saves V3's e_score_correction_bias (a buffer) as zeros: `_v3_biased` rewrites
it with random values so that the bias decides routes.
"""

from __future__ import annotations

import dataclasses
import random
import shutil

import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.models import build_model, load_config, load_model
from research_lm.models.layers import GatedMLP
from research_lm.moe import FusedMoE, MoeBlock
from tests.models.test_deepseek import _hf_greedy, _hf_logits, _tokens
from tests.utils import PagedBatch

ATOL = 1e-4
MODELS = ["deepseek-v2-moe", "deepseek-v3-moe"]
EPLB = dict(policy="deepseek", step_interval=2, window_size=3, num_redundant_experts=2, num_ep_ranks=2)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    """name -> checkpoint directory; deepseek-v3-moe with a random e_score_correction_bias."""
    from safetensors.torch import load_file, save_file

    cache = {}

    def make(name: str):
        if name in cache:
            return cache[name]
        path = tiny_checkpoint(name)
        if name == "deepseek-v3-moe":
            biased = tmp_path_factory.mktemp("deepseek-v3-moe-biased")
            shutil.copytree(path, biased, dirs_exist_ok=True)
            tensors = load_file(biased / "model.safetensors")
            gen = torch.Generator().manual_seed(7)
            for key in [k for k in tensors if k.endswith("e_score_correction_bias")]:
                tensors[key] = torch.randn(tensors[key].shape, generator=gen) * 0.2
            save_file(tensors, biased / "model.safetensors", metadata={"format": "pt"})
            path = biased
        cache[name] = path
        return path

    return make


@pytest.fixture(scope="module")
def oracle(checkpoint):
    from transformers import AutoModelForCausalLM

    cache = {}

    def load(name: str):
        if name not in cache:
            hf = AutoModelForCausalLM.from_pretrained(checkpoint(name), dtype=torch.float32,
                                                      attn_implementation="eager")  # fmt: skip
            cache[name] = hf.eval()
        return cache[name]

    return load


def _load(path, **extra):
    model, _ = load_model(path, device="cpu", dtype=torch.float32, attention_backend="torch_ref",
                          extra={"mla_backend": "mla_torch_ref", **extra})  # fmt: skip
    return model


def _max_diff(model, hf, seqs) -> float:
    got = PagedBatch(model, [len(s) for s in seqs], block_size=4).step(seqs)
    return max(float((logits - _hf_logits(hf, tokens)).abs().max()) for tokens, logits in zip(seqs, got))


@pytest.mark.parametrize("name", MODELS)
def test_batched_prefill_matches_transformers(name, checkpoint, oracle):
    """Logits of 3 sequences in one forward; then the routing features are shown to matter: without
    V2's group limit, or with V3's correction bias zeroed, the same model is off by far more than ATOL."""
    model, hf = _load(checkpoint(name)), oracle(name)
    seqs = [_tokens(n, seed) for seed, n in enumerate([19, 5, 1])]
    assert _max_diff(model, hf, seqs) <= ATOL
    blocks = [m for m in model.modules() if isinstance(m, MoeBlock)]
    with torch.no_grad():
        for block in blocks:
            if name == "deepseek-v2-moe":
                block.gate.config = dataclasses.replace(block.gate.config, num_expert_group=None, topk_group=None)
            else:
                block.gate.e_score_correction_bias.zero_()
    assert _max_diff(model, hf, seqs) > 1e-2


def test_layers_routers_and_weights(checkpoint):
    """Dense/MoE layer rule, router settings from the config, every parameter loaded, n_group as the EPLB
    policy's num_groups, and V3's correction bias kept in fp32 in a bf16 model."""
    v2 = _load(checkpoint("deepseek-v2-moe"), eplb=EPLB)
    v3 = _load(checkpoint("deepseek-v3-moe"))
    assert all(isinstance(layer.mlp, MoeBlock) for layer in v2.model.layers)
    assert isinstance(v3.model.layers[0].mlp, GatedMLP)
    assert all(isinstance(layer.mlp, MoeBlock) for layer in v3.model.layers[1:])
    r2, r3 = v2.model.layers[0].mlp.gate.config, v3.model.layers[1].mlp.gate.config
    assert (r2.scoring_func, r2.renormalize, r2.num_expert_group, r2.topk_group, r2.routed_scaling_factor,
            r2.has_correction_bias) == ("softmax", False, 4, 2, 1.5, False)  # fmt: skip
    assert (r3.scoring_func, r3.renormalize, r3.num_expert_group, r3.topk_group, r3.routed_scaling_factor,
            r3.has_correction_bias) == ("sigmoid", True, 4, 2, 2.5, True)  # fmt: skip
    experts = [m for m in v2.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and all((e.num_slots, e.num_groups) == (10, 4) for e in experts)
    assert v2.model.layers[1].mlp.shared_expert.gate_up_proj.bias is not None  # V2 mlp_bias
    assert float(v3.model.layers[2].mlp.gate.e_score_correction_bias.abs().max()) > 0.1  # read from the file

    from research_lm.models.loader import checkpoint_files, iter_checkpoint

    for model, name in ((v2, "deepseek-v2-moe"), (v3, "deepseek-v3-moe")):
        loaded = model.load_weights(iter_checkpoint(checkpoint_files(checkpoint(name))))
        assert loaded == {n for n, _ in model.named_parameters()}

    config = load_config(checkpoint("deepseek-v3-moe"))
    bf16 = build_model(config, device="cpu", dtype=torch.bfloat16, attention_backend="torch_ref")
    gate = bf16.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32 and gate.weight.dtype == torch.bfloat16
    config.topk_method = "greedy"
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM routes with scoring_func 'sigmoid'.*'greedy'"):
        build_model(config, device="cpu", dtype=torch.float32, attention_backend="torch_ref")


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(n)] for n in (4, 9, 15, 22, 31)]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_matches_transformers_with_and_without_eplb(name, checkpoint, oracle):
    """Chunked prefill (16-token steps) and batched decode through the engine; then the same run with 2
    redundant experts on 2 simulated EP ranks, rebalanced every 2 steps: weights move, tokens do not."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = _hf_greedy(oracle(name), _prompts(), 8)
    for eplb in (None, EPLB):
        llm = LLM(str(checkpoint(name)), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
                  max_num_seqs=4, max_model_len=64, eplb_config=eplb)  # fmt: skip
        layers = [m for m in llm.engine.model.modules() if isinstance(m, FusedMoE)]
        initial = [layer.phy2log.clone() for layer in layers]
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"eplb={eplb}"
    ctrl = llm.engine.eplb
    assert ctrl.num_groups == 4 and ctrl.num_slots == 10
    assert ctrl.num_rebalances >= 3 and sum(ctrl.moved_slots) > 0
    assert any(not torch.equal(layer.phy2log, p) for layer, p in zip(layers, initial))
