"""Every preset composes and says what it asks; the quick ones run to the end (one multirun over them)."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from research_lm.harness.experiment import TASKS

from .conftest import CONF_DIR, PRESETS, run_cli

REQUIRED = {"quickstart", "eagle3", "eagle", "medusa", "ngram", "draft_model", "spec_ablation", "attention_ablation",
            "mla", "sliding_window", "mamba", "eplb_ablation", "train_target", "train_eagle3", "train_medusa",
            "train_draft", "bench_decode", "bench_throughput", "spec_tree"}
# Run to the end below (tiny workloads); the train_* presets have their own tests in tests/train/. medusa trains its
# head on the fly (2 steps): no medusa head ships.
QUICK = ["ngram", "sliding_window", "mla", "mamba", "bench_decode", "bench_throughput", "attention_ablation",
         "eplb_ablation", "eagle3", "medusa", "spec_tree"]


def test_every_required_preset_exists():
    assert REQUIRED <= set(PRESETS), sorted(REQUIRED - set(PRESETS))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_and_states_its_question(name):
    text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n"), "a preset overrides the global config"
    assert "Question:" in text.split("\n", 3)[1], "the header's first line states the question the preset answers"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={name}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert resolved["task"] in TASKS


def test_cfg_job_prints_the_composed_preset(tmp_path):
    proc = run_cli("experiment=mla", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.model.random.architecture == "DeepseekV2Config"
    assert cfg.baseline.model == "random-llama"


@pytest.fixture(scope="module")
def preset_runs(tmp_path_factory):
    """One multirun over the quick presets, every workload shrunk to 2 requests of a few tokens."""
    cwd = tmp_path_factory.mktemp("presets")
    sweep = cwd / "multirun"
    proc = run_cli("-m", f"experiment={','.join(QUICK)}", "logger=none", "workload.num_requests=2",
                   "++workload.max_tokens=4", "++workload.input_len=[8,16]", "++workload.output_len=[4,6]",
                   "warmup_requests=0", "++spec_head.train_steps=2", "++eplb_replay.synthetic.num_steps=60",
                   f"hydra.sweep.dir={sweep}", cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: json.loads((sweep / str(i) / "results.json").read_text()) | {"_dir": sweep / str(i)}
            for i, name in enumerate(QUICK)} | {"_sweep": sweep}


def test_quick_presets_run_to_the_end(preset_runs):
    for name in QUICK:
        results = preset_runs[name]
        assert results["config"]["task"] in ("generate", "eplb_replay"), name
        assert results["summary"], name
        assert results["reproducibility"]["seeds"]["seed"] == 0


def test_model_comparison_presets_report_memory_against_the_dense_baseline(preset_runs):
    mla, mamba, window = preset_runs["mla"]["summary"], preset_runs["mamba"]["summary"], preset_runs["sliding_window"]
    assert mla["kv_bytes_per_token_ratio"] == pytest.approx(80 / 128)  # latent 64 + rope 16 vs 2 x 2 x 32
    assert mamba["kv_bytes_per_token"] == 0 and mamba["state_bytes_per_request"] > 0
    assert window["model"]["random"]["config"]["sliding_window"] == 64
    assert window["baseline"]["model"]["random"]["architecture"] == "LlamaConfig"
    assert window["summary"]["kv_bytes_used_ratio"] < 1  # blocks out of the window went back to the pool


def test_spec_presets_report_acceptance_and_identical_outputs(preset_runs):
    for name in ("ngram", "eagle3"):
        s = preset_runs[name]["summary"]
        assert s["outputs_match_baseline"] == 1.0, name  # greedy speculation never changes the output
        assert "speedup" in s and "baseline_output_throughput_tok_s" in s
        assert s["draft_ms_per_step_median"] > 0 and s["verify_ms_per_step_median"] > 0, name
        assert 0 < s["draft_fraction"] < 1, name
        assert "draft_fraction" not in preset_runs[name]["baseline"]["summary"], name  # no drafts, no phases
    s = preset_runs["eagle3"]["summary"]  # a head drafts at every decode step (ngram only on a match)
    # the built-in trained pair: the head guesses the target's next token often (held-out top-1 0.48)
    assert s["mean_acceptance_length"] > 1.3 and 0.3 < s["acceptance_rate_pos0"] <= 1.0
    # Leviathan's check: position-independent acceptance at the measured rate predicts tau in [1, k + 1]
    assert 0 < s["draft_alpha"] < 1 and 1.0 < s["leviathan_tau"] < 1 + preset_runs["eagle3"]["config"]["spec"][
        "num_speculative_tokens"]
    assert not (preset_runs["eagle3"]["_dir"] / "prepare").exists()  # the built-in head needs no training


def test_spec_tree_verifies_a_tree_and_keeps_the_outputs(preset_runs):
    run = preset_runs["spec_tree"]
    assert run["config"]["spec"]["method"] == "eagle3" and len(run["config"]["spec"]["speculative_token_tree"]) == 16
    assert run["summary"]["outputs_match_baseline"] == 1.0 and run["summary"]["mean_acceptance_length"] > 1.0
    assert not any("of at most 1:" in note for note in run["notes"])  # the note bounds tau by the tree's depth + 1


def test_spec_presets_name_the_head_that_drafted(preset_runs):
    assert preset_runs["eagle3"]["spec_head"] == {"method": "eagle3", "model": "tiny-llama-eagle3", "source": "shipped",
                                                  "train_steps": 600, "recipe_steps": None}
    assert preset_runs["eagle3"]["config"]["spec"]["model"] == "tiny-llama-eagle3"  # the recorded config re-runs it
    medusa = preset_runs["medusa"]
    assert medusa["spec_head"] == {"method": "medusa", "model": "outputs/train/medusa", "source": "trained",
                                   "train_steps": 2, "recipe_steps": 150}
    assert (medusa["_dir"] / "prepare" / "results.json").is_file()  # the training run's own record
    assert any("quick one, 2 training steps against the 150" in note for note in medusa["notes"])
    assert preset_runs["ngram"]["spec_head"] is None


def test_eplb_ablation_replays_every_policy_with_a_plot(preset_runs):
    res = preset_runs["eplb_ablation"]
    policies = {r["policy"] for r in res["rows"]}
    assert {"none", "deepseek", "lpt", "static"} <= policies
    assert set(res["curves"]) == {"zipf", "model:random-qwen3-moe"}
    assert len(res["curves"]["zipf"]["deepseek"]) == 60
    deepseek = next(r for r in res["rows"] if r["trace"] == "zipf" and r["policy"] == "deepseek")
    none = next(r for r in res["rows"] if r["trace"] == "zipf" and r["policy"] == "none")
    assert deepseek["balancedness_total"] > none["balancedness_total"]
    assert (res["_dir"] / "eplb_balancedness.png").read_bytes()[:4] == b"\x89PNG"


def test_report_over_the_presets(preset_runs):
    from research_lm.harness.report import build_report

    text = build_report(preset_runs["_sweep"]).read_text()
    assert "| job | `experiment` |" in text and "## EPLB replay" in text
    assert "draft_ms_per_step_median | verify_ms_per_step_median | draft_fraction" in text
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| ") and " | " in line}
    assert "| tiny-llama-eagle3 (shipped, 600 training steps) |" in rows["eagle3"]
    assert "| trained on the fly, 2 steps (outputs/train/medusa) |" in rows["medusa"]
    assert "quick one, 2 training steps" in text.split("Notes:")[1]
    assert (preset_runs["_sweep"] / f"report_eplb_{QUICK.index('eplb_ablation')}.png").is_file()
