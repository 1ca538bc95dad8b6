"""`python -m research_lm experiment=train_target ...` composes the preset and trains end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_train_target_preset_runs_from_the_cli(tmp_path):
    args = [
        "experiment=train_target", "logger=jsonl", "train.steps=2", "train.batch_size=2", "train.seq_len=32",
        "train.corpus_bytes=20000", "train.pydoc=false", "train.progress=false",
        "train.model.hidden_size=32", "train.model.intermediate_size=64", "train.model.num_attention_heads=2",
        "train.model.num_key_value_heads=1", f"train.output_dir={tmp_path / 'model'}",
        f"train.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "research_lm", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["summary"]["steps"] == 2 and results["summary"]["corpus_hash"]
    assert results["config"]["task"] == "train_target"
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "train/loss" in x] == [2]  # every log_every (10) steps and the last
    assert "final_val_loss" in lines[-1]["summary"]
    recipe = json.loads((tmp_path / "model" / "recipe.json").read_text())
    assert recipe["steps"] == 2 and recipe["model"]["hidden_size"] == 32
    assert "final_val_loss" in proc.stdout  # the summary table is printed last


def test_train_moe_preset_runs_from_the_cli(tmp_path):
    """experiment=train_moe trains the Qwen2-MoE variant (a shared expert) and writes both checkpoints."""
    args = [
        "experiment=train_moe", "logger=none", "train.steps=2", "train.batch_size=2", "train.seq_len=32",
        "train.corpus_bytes=20000", "train.pydoc=false", "train.progress=false", "train.save_every=0",
        "train.architecture=Qwen2MoeForCausalLM", "train.model.hidden_size=32", "train.model.num_attention_heads=2",
        "train.model.num_key_value_heads=1", "train.model.head_dim=16", "train.model.num_experts=4",
        "train.model.moe_intermediate_size=16", f"train.output_dir={tmp_path / 'model'}",
        f"train.init_dir={tmp_path / 'init'}", f"train.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "research_lm", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["summary"]["architecture"] == "Qwen2MoeForCausalLM" and results["summary"]["steps"] == 2
    recipe = json.loads((tmp_path / "model" / "recipe.json").read_text())
    assert recipe["model"]["num_experts"] == 4 and recipe["model"]["shared_expert_intermediate_size"] == 64
    assert recipe["router_aux_loss_coef"] == 0.001
    assert (tmp_path / "init" / "model.safetensors").is_file()
