"""Speculative runs time their two phases per step (draft = the proposer's `propose`, verify = the target
forward + rejection sampling of a step that verified drafts) and summarize them: median ms per step of
each, and the fraction of their total spent drafting. Runs without drafts report none of them."""

from __future__ import annotations

import json

import pytest

from research_lm import LLM, SamplingParams
from research_lm.engine.metrics import spec_phase_stats
from research_lm.harness.report import Job, metric_columns

PHASE_KEYS = ("draft_ms_per_step_median", "verify_ms_per_step_median", "draft_fraction")
KNOBS = dict(device="cpu", dtype="float32", max_model_len=96, max_num_seqs=2)
PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n", "import os\nimport sys\nimport os\n"]


def _run(spec: dict | None) -> LLM:
    llm = LLM("tiny-llama", **KNOBS, speculative_config=spec)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return llm


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": 3},
], ids=["ngram", "eagle3"])
def test_spec_run_reports_draft_and_verify_time(spec):
    metrics = _run(spec).engine.metrics
    verifying = [s for s in metrics.steps if s["num_draft_tokens"] > 0]
    assert verifying, "the workload must verify drafts"
    assert all(s["verify_ms"] > 0 and s["draft_ms"] > 0 for s in verifying)
    assert not any("verify_ms" in s for s in metrics.steps if s["num_draft_tokens"] == 0)
    summary = metrics.summary()
    assert summary["draft_ms_per_step_median"] > 0 and summary["verify_ms_per_step_median"] > 0
    assert 0 < summary["draft_fraction"] < 1
    assert summary["num_verify_steps"] == len(verifying)


def test_plain_run_reports_no_phase_times():
    metrics = _run(None).engine.metrics
    assert not any("draft_ms" in s or "verify_ms" in s for s in metrics.steps)
    assert not set(PHASE_KEYS) & set(metrics.summary())


def test_phase_stats_are_medians_and_a_time_weighted_fraction():
    steps = [{"draft_ms": 1.0}, {"draft_ms": 1.0, "verify_ms": 3.0}, {"draft_ms": 3.0, "verify_ms": 5.0},
             {"draft_ms": 2.0, "verify_ms": 4.0}]  # the first (a prefill's propose) verified nothing: left out
    stats = spec_phase_stats(steps)
    assert stats["draft_ms_per_step_median"] == 2.0 and stats["verify_ms_per_step_median"] == 4.0
    assert stats["draft_fraction"] == pytest.approx(6.0 / 18.0) and stats["num_verify_steps"] == 3
    assert spec_phase_stats([{"draft_ms": 1.0}]) == {}


def test_report_shows_phase_columns_for_spec_runs_only(tmp_path):
    def job(name: str, summary: dict) -> Job:
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"summary": summary, "config": {"task": "generate"}}))
        return Job(tmp_path / name)

    plain = job("plain", {"output_throughput_tok_s": 10.0})
    spec = job("spec", {"output_throughput_tok_s": 12.0, "draft_ms_per_step_median": 0.5,
                        "verify_ms_per_step_median": 2.0, "draft_fraction": 0.2})
    assert not set(PHASE_KEYS) & set(metric_columns([plain]))
    cols = metric_columns([plain, spec])
    assert [c for c in cols if c in PHASE_KEYS] == list(PHASE_KEYS)
