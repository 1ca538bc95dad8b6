"""A 2x2 multirun: four jobs, each a W&B (offline) run in one group named after the sweep; then the report."""

from __future__ import annotations

import json

import yaml
from hydra import compose, initialize_config_dir

from research_lm.harness.report import build_report, collect, swept_keys

from .conftest import CONF_DIR, run_cli, run_module


def _joblib() -> list[str]:
    """Parallel jobs through the joblib launcher when installed (the `test` and `sweep` extras), else Hydra's
    basic launcher: the same sweep either way."""
    try:
        import hydra_plugins.hydra_joblib_launcher  # noqa: F401
    except ImportError:
        return []
    return ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]


def test_2x2_multirun_with_wandb_groups_and_a_report(tmp_path):
    sweep = tmp_path / "multirun" / "my-sweep"
    proc = run_cli("-m", *_joblib(), "logger=wandb", "workload.num_requests=2", "workload.max_tokens=2,4",
                   "runner.max_num_seqs=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted(sweep.glob("*/results.json"))
    assert len(results) == 4
    combos = {(json.loads(p.read_text())["config"]["workload"]["max_tokens"],
               json.loads(p.read_text())["config"]["runner"]["max_num_seqs"]) for p in results}
    assert combos == {(2, 1), (2, 2), (4, 1), (4, 2)}
    for job in sorted(sweep.glob("[0-3]")):
        runs = list((job / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, "each job is its own W&B run"
        assert b"my-sweep" in next(runs[0].glob("run-*.wandb")).read_bytes(), "grouped under the sweep's name"
        assert json.loads((job / "results.json").read_text())["reproducibility"]["sweep_group"] == "my-sweep"
    assert "wandb sync" in proc.stdout

    report = run_module("research_lm.harness.report", str(sweep), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    text = (sweep / "report.md").read_text()
    # quickstart drafts with the EAGLE-3 head shipped for tiny-llama: the head column says so on every job's row
    assert "| job | `workload.max_tokens` | `runner.max_num_seqs` | head | output_throughput_tok_s" in text
    assert text.count("| tiny-llama-eagle3 (shipped, 600 training steps) |") == 4
    job_rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len([row for row in job_rows if "baseline" not in row]) == 4  # quickstart adds a baseline row each
    pngs = sorted(sweep.glob("report_*.png"))
    assert sweep / "report_output_throughput_tok_s_vs_runner.max_num_seqs.png" in pngs
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_report_of_a_single_run_and_of_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({
        "summary": {"output_throughput_tok_s": 10.0, "tpot_ms_mean": 2.0},
        "config": {"task": "generate", "spec": {"num_speculative_tokens": 3}},
        "reproducibility": {"overrides": ["spec=ngram", "spec.num_speculative_tokens=3", "logger=none"]},
        "baseline": {"summary": {"output_throughput_tok_s": 5.0}, "overrides": {"spec": "none"}},
    }))
    jobs = collect(run)
    assert swept_keys(jobs) == ["spec", "spec.num_speculative_tokens"]  # one job: its overrides
    text = build_report(run).read_text()
    assert "run baseline (spec=none)" in text
    assert (run / "report_output_throughput_tok_s.png").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_module("research_lm.harness.report", str(empty), cwd=tmp_path)
    assert proc.returncode == 2 and "no results.json" in proc.stderr


def test_wandb_sweep_yaml_drives_the_cli_with_hydra_overrides():
    """conf/wandb_sweep.yaml: every grid point, as W&B's ${args_no_hyphens} passes it, composes."""
    sweep = yaml.safe_load((CONF_DIR / "wandb_sweep.yaml").read_text())
    command = sweep["command"]
    assert command[command.index("-m") + 1] == "research_lm" and command[-1] == "${args_no_hyphens}"
    grid = [{}]
    for key, spec in sweep["parameters"].items():
        values = spec["values"] if "values" in spec else [spec["value"]]
        grid = [{**point, key: v} for point in grid for v in values]
    assert len(grid) >= 2
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for point in grid:
            args = [a for a in command[command.index("research_lm") + 1:-1]] + [f"{k}={v}" for k, v in point.items()]
            cfg = compose("config", overrides=args)
            assert cfg.logger.name == "wandb"
            assert cfg.spec.num_speculative_tokens == point["spec.num_speculative_tokens"]
