"""The DeepSeek reference for MTP vs EAGLE-3 (experiments/train_reference_mtp.sh, issue 36): train_moe's DeepSeek-V2
shape, and the script's TINY=1 run of the same presets, whose target, MTP copy and EAGLE-3 head the engine serves.

Invariants:
- train.model sizes DeepSeek-V2's MLA from head_dim in DeepSeek-V2's ratios unless a key sets it; MLA has no KV heads;
  the router never renormalises (transformers' V2 does not), and keys of the other family are refused by name.
- The script writes a dense DeepSeek-V2 target served like transformers, a copy with one MTP layer and an EAGLE-3 head,
  all three on one corpus; greedy drafting with either drafter gives the target's own tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.harness.train.moe import DEEPSEEK, MoeLMObjective, build_moe, moe_config
from research_lm.models.loader import resolve_model_path

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["def main(", "import os\nclass Reader:", "The tuple is"]


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny-llama"))


def test_deepseek_shape_derives_mla_from_head_dim_and_refuses_other_keys():
    tok = _tokenizer()
    config = moe_config(tok, DEEPSEEK, {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
                                         "head_dim": 32, "kv_lora_rank": 48, "q_lora_rank": None})
    assert (config.qk_nope_head_dim, config.v_head_dim, config.qk_rope_head_dim) == (32, 32, 16)
    assert config.kv_lora_rank == 48 and config.q_lora_rank is None and config.num_key_value_heads == 4
    assert config.norm_topk_prob is False and config.topk_method == "greedy"
    assert config.n_shared_experts == 2 and config.router_aux_loss_coef == 0.001
    assert moe_config(tok, DEEPSEEK, {"head_dim": 16}).kv_lora_rank == 64  # 4 x head_dim
    with pytest.raises(ValueError, match="norm_topk_prob.*never renormalises"):
        moe_config(tok, DEEPSEEK, {"norm_topk_prob": True})
    with pytest.raises(ValueError, match=r"\['mlp_only_layers'\]: Qwen MoE key"):
        moe_config(tok, DEEPSEEK, {"mlp_only_layers": [0]})
    with pytest.raises(ValueError, match=r"\['kv_lora_rank'\]: DeepSeek-V2 key"):
        moe_config(tok, "Qwen3MoeForCausalLM", {"kv_lora_rank": 64})


def test_a_dense_deepseek_objective_is_the_cross_entropy():
    """first_k_dense_replace above the depth: no router, so the aux term is 0 and no load metric is reported."""
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "head_dim": 16, "first_k_dense_replace": 3}
    model = build_moe(moe_config(_tokenizer(), DEEPSEEK, shape), seed=0)
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, metrics = MoeLMObjective(model).loss(ids)
    torch.testing.assert_close(loss.detach(), model(input_ids=ids, labels=ids).loss.detach())
    assert float(metrics["aux_loss"]) == 0.0 and "expert_load_max_over_mean" not in metrics


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """experiments/train_reference_mtp.sh at TINY=1 (a few seconds per preset)."""
    out = tmp_path_factory.mktemp("reference_mtp")
    env = {**os.environ, "TINY": "1", "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "experiments/train_reference_mtp.sh", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + "".join(p.read_text()[-2000:] for p in out.glob("*.log"))
    return out


def _greedy(path: Path, spec: dict | None = None) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", speculative_config=spec)
    tok = llm.get_tokenizer()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_reference_script_writes_a_dense_deepseek_target_served_like_transformers(reference):
    from transformers import AutoModelForCausalLM

    config = json.loads((reference / "target" / "config.json").read_text())
    assert config["architectures"] == [DEEPSEEK] and config["first_k_dense_replace"] > config["num_hidden_layers"]
    recipes = [json.loads((reference / d / "recipe.json").read_text()) for d in ("target", "mtp", "eagle3")]
    assert len({r["corpus_hash"] for r in recipes}) == 1
    assert json.loads((reference / "mtp" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert all((reference / "runs" / d / "results.json").is_file() for d in ("target", "mtp", "eagle3"))

    hf = AutoModelForCausalLM.from_pretrained(reference / "target", dtype=torch.float32).eval()
    tok = _tokenizer()
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tok(prompt)["input_ids"]])
            for _ in range(10):
                ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            want.append(ids[0, -10:].tolist())
    assert _greedy(reference / "target") == want


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_both_drafters_of_the_reference_draft_losslessly(reference, method):
    """The table's setting: the MTP copy as the target, drafting from its own layer or from the EAGLE-3 head."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["model"] = str(reference / "eagle3")
    assert _greedy(reference / "mtp", spec) == _greedy(reference / "target")
