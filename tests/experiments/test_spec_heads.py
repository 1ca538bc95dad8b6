"""Which head drafts (shipped, trained on the fly, reused), how a run records it, and the note that says why a
speculative run did not pay off. No engine runs here: training is monkeypatched, the notes are numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from research_lm.assets import ASSETS, SHIPPED_HEADS, shipped_head
from research_lm.harness import experiment
from research_lm.harness.experiment import TASKS, quick_head_note, speculation_note, with_spec_head
from research_lm.harness.report import build_report, describe_head

from .conftest import CONF_DIR


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _no_training(cfg, run_dir, logger):
    raise AssertionError("a head was trained although one ships with the target")


def test_the_shipped_heads_are_built_in_checkpoints(tmp_path, monkeypatch):
    for target, heads in SHIPPED_HEADS.items():
        assert (ASSETS / target / "config.json").is_file()
        assert all((ASSETS / head / "config.json").is_file() for head in heads.values())
    assert shipped_head("tiny-llama", "eagle3") == "tiny-llama-eagle3"
    assert shipped_head(ASSETS / "tiny-llama", "eagle3") == "tiny-llama-eagle3"  # the built-in's own directory
    assert shipped_head("tiny-llama", "medusa") is None and shipped_head("other", "eagle3") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-llama").mkdir()  # a directory of that name is loaded as that directory, not the built-in
    assert shipped_head("tiny-llama", "eagle3") is None


@pytest.mark.parametrize("overrides", [("experiment=spec_ablation", "spec=eagle3"), ("experiment=eagle3",),
                                       ("experiment=quickstart",)])
def test_builtin_target_drafts_with_its_shipped_head_without_training(overrides, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(TASKS.entries, "train_eagle3", _no_training)
    cfg = _compose(*overrides)
    assert cfg.spec.method == "eagle3" and cfg.spec.model is None
    resolved, head = with_spec_head(cfg, tmp_path / "run")
    assert resolved.spec.model == "tiny-llama-eagle3"
    assert head == {"method": "eagle3", "model": "tiny-llama-eagle3", "source": "shipped", "train_steps": 600,
                    "recipe_steps": None}
    assert not (tmp_path / "run" / "prepare").exists() and not (tmp_path / "outputs").exists()
    assert describe_head(head) == "tiny-llama-eagle3 (shipped, 600 training steps)"
    assert quick_head_note(head) is None


def test_a_given_head_is_used_as_given(tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS.entries, "train_eagle3", _no_training)
    cfg = _compose("experiment=eagle3", f"spec.model={ASSETS / 'tiny-llama-eagle3'}")
    _, head = with_spec_head(cfg, tmp_path)
    assert head["source"] == "shipped" and head["train_steps"] == 600  # a path into the built-ins is still shipped
    (tmp_path / "head").mkdir()
    _, head = with_spec_head(_compose("experiment=eagle3", f"spec.model={tmp_path / 'head'}"), tmp_path)
    assert head == {"method": "eagle3", "model": str(tmp_path / "head"), "source": "given", "train_steps": None,
                    "recipe_steps": None}
    assert describe_head(head) == f"{tmp_path / 'head'} (given, training steps unknown)"
    cfg = _compose("experiment=spec_ablation")  # ngram: no head
    assert with_spec_head(cfg, tmp_path) == (cfg, None)


def _fake_training(calls: list):
    """A train_<method> task that writes only what the run reads back: config.json and recipe.json."""

    def train(cfg, run_dir, logger):
        calls.append(cfg)
        out = Path(cfg.train.output_dir)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "recipe.json").write_text(json.dumps({"steps": cfg.train.steps}))

    return train


def test_a_method_without_a_shipped_head_trains_one_then_reuses_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls: list = []
    monkeypatch.setitem(TASKS.entries, "train_medusa", _fake_training(calls))
    cfg = _compose("experiment=spec_ablation", "spec=medusa", "spec_head.train_steps=3")
    resolved, head = with_spec_head(cfg, tmp_path / "run")
    assert len(calls) == 1 and calls[0].train.steps == 3 and calls[0].train.target == "tiny-llama"
    assert resolved.spec.model == "outputs/train/medusa"
    assert head == {"method": "medusa", "model": "outputs/train/medusa", "source": "trained", "train_steps": 3,
                    "recipe_steps": 150}
    assert describe_head(head) == "trained on the fly, 3 steps (outputs/train/medusa)"
    assert "3 training steps against the 150 of experiment=train_medusa" in quick_head_note(head)

    _, again = with_spec_head(cfg, tmp_path / "run2")  # the next run reuses it, with its recipe's step count
    assert len(calls) == 1
    assert again == {**head, "source": "reused"}
    assert describe_head(again) == "outputs/train/medusa (reused, 3 training steps)"


def test_a_random_target_gets_no_shipped_head(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls: list = []
    monkeypatch.setitem(TASKS.entries, "train_eagle3", _fake_training(calls))
    monkeypatch.setattr(experiment, "prepare_model", lambda cfg, run_dir: tmp_path / "model")
    _, head = with_spec_head(_compose("experiment=eagle3", "model=random-llama"), tmp_path / "run")
    assert head["source"] == "trained" and calls[0].train.target == str(tmp_path / "model")


def test_the_report_names_each_jobs_head_and_notes(tmp_path):
    trained = {"method": "medusa", "model": "outputs/train/medusa", "source": "trained", "train_steps": 2,
               "recipe_steps": 150}
    jobs = {"0": ("ngram", None, []),
            "1": ("medusa", trained, [quick_head_note(trained), "speedup 0.60 (< 1.1) ..."])}
    for name, (spec, head, notes) in jobs.items():
        job = tmp_path / name
        job.mkdir()
        (job / "results.json").write_text(json.dumps({
            "summary": {"output_throughput_tok_s": 10.0, "speedup": 0.6}, "spec_head": head, "notes": notes,
            "config": {"task": "generate", "spec": {"method": spec}},
            "reproducibility": {"overrides": [f"spec={spec}"]},
        }))
    text = build_report(tmp_path, plots=False).read_text()
    assert "| job | `spec` | head | output_throughput_tok_s |" in text
    assert "| 0 | ngram | — | 10 |" in text
    assert "| 1 | medusa | trained on the fly, 2 steps (outputs/train/medusa) | 10 |" in text
    assert "- 1 (spec=medusa): the medusa head (outputs/train/medusa) is a quick one, 2 training steps" in text
    assert "- 1 (spec=medusa): speedup 0.60 (< 1.1) ..." in text
    cells = json.loads((tmp_path / "report.json").read_text())["cells"]
    assert cells[1]["spec_head"] == trained and len(cells[1]["notes"]) == 2


# The quantities speculation_note reads: a run's summary after compare_to_baseline.
BATCH1_GPU = {  # experiment=eagle3 on one H100 (gpu: block, k = 3): asynchronous steps, phases timed on few
    "speedup": 0.80, "mean_acceptance_length": 2.07, "decode_step_ms_median": 0.449,
    "baseline_decode_step_ms_median": 0.169, "decode_batch_mean": 1.0, "tpot_ratio": 1.25, "ttft_ratio": 1.35,
    "draft_ms_per_step_median": 0.02, "verify_ms_per_step_median": 1.5, "num_verify_steps": 32,
    "num_decode_steps": 3990,
}


def test_no_note_when_speculation_pays_or_did_not_run():
    assert speculation_note({**BATCH1_GPU, "speedup": 1.5}, 3, "eagle3") is None
    assert speculation_note({"speedup": 0.5}, 3, "eagle3") is None  # no drafts verified: nothing to explain
    assert speculation_note({"mean_acceptance_length": 2.0}, 3, "eagle3") is None  # no baseline
    note = speculation_note({"speedup": 0.5, "mean_acceptance_length": 2.0}, 3, "eagle3")
    assert note.startswith("speedup 0.50 (< 1.1) at tau 2.00 of at most 4") and "no pure decode steps" in note


def test_note_at_batch_1_blames_drafting_on_a_launch_bound_target():
    note = speculation_note(BATCH1_GPU, 3, "eagle3")
    assert note.startswith("speedup 0.80 (< 1.1) at tau 2.07 of at most 4: at batch 1 a speculative decode step "
                           "takes 0.449 ms = 2.66 plain steps of 0.169 ms, so it pays only where tau > 2.66.")
    # (0.449 - 0.169) / 3 / 0.169 = 0.55 plain steps per draft token
    assert "the extra 0.28 ms is drafting: 0.55 plain steps per draft token; at this size a head step" in note
    assert "timed apart on 32 of 3990 decode steps only" in note
    ngram = speculation_note(BATCH1_GPU, 3, "ngram")  # no model drafts: the extra is the step's own work
    assert "Its drafts need no model, so the extra 0.28 ms = 1.66 plain steps" in ngram and "head" not in ngram


def test_note_uses_the_phase_times_where_most_steps_were_timed():
    synced = {**BATCH1_GPU, "num_verify_steps": 3990}
    drafting = speculation_note({**synced, "draft_ms_per_step_median": 0.2, "verify_ms_per_step_median": 0.25}, 3,
                                "eagle3")
    assert "Drafting is the cost: 3 drafts take 0.2 ms = 1.18 plain steps, 0.39 per draft; at this size a head" \
        in drafting
    big = {**synced, "decode_batch_mean": 32.0, "draft_ms_per_step_median": 0.05, "verify_ms_per_step_median": 0.4}
    assert "Verifying is the cost: 0.4 ms = 2.37 plain steps (drafting 0.05 ms); the target computes k + 1 tokens" \
        in speculation_note(big, 3, "eagle3")
    unsynced = {**big, "num_verify_steps": 10}
    assert "The extra 0.28 ms pays for 3 drafts and a verify forward over 4 tokens per request" in speculation_note(
        unsynced, 3, "eagle3")


def test_note_names_prefills_the_median_or_acceptance_when_those_explain_it():
    prefill = speculation_note({**BATCH1_GPU, "tpot_ratio": 0.8, "ttft_ratio": 1.6}, 3, "eagle3")
    assert "Decoding pays (1.25x faster per output token) and the prefills take the gain: time to first token is " \
           "1.60x the baseline's (the drafter reads every prompt too)." in prefill
    outside = speculation_note({**BATCH1_GPU, "tpot_ratio": 0.74, "ttft_ratio": 0.97}, 3, "eagle3")
    assert "Decoding pays (1.35x faster per output token, time to first token 0.97x the baseline's), so what takes " \
           "the gain lies outside both" in outside
    median = speculation_note({**BATCH1_GPU, "mean_acceptance_length": 3.0}, 3, "eagle3")  # 3.0 > 2.66
    assert "Its decode steps pay at their median (1.13x) but not over the run (0.80x per output token)" in median
    rejected = speculation_note({**BATCH1_GPU, "mean_acceptance_length": 1.5}, 3, "eagle3")  # 0.5 of 3 drafts
    assert rejected.endswith("Acceptance is the limit: 0.50 of 3 drafts accepted per step.")
