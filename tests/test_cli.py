"""The Hydra CLI end to end: the quickstart writes its results; bad input exits 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(cwd), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "research_lm", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_quickstart_runs_end_to_end(tmp_path):
    """The default experiment (small here) with the default logger (wandb, offline)."""
    run_dir = tmp_path / "run"
    proc = _run("workload.num_requests=3", "workload.max_tokens=4", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((run_dir / "results.json").read_text())
    assert results["summary"]["num_requests"] == 3
    assert results["summary"]["output_tokens"] > 0
    assert results["env"]["packages"]["torch"]
    assert "commit" in results["env"]["git"]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "output_throughput_tok_s" in proc.stdout  # the table is printed last
    assert list((run_dir / "wandb").glob("offline-run-*")), "an offline W&B run should be written"


def test_jsonl_logger_writes_steps(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run("logger=jsonl", "workload=prose", "workload.num_requests=2", "workload.max_tokens=3",
                f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["summary"]["num_requests"] == 2
    assert "kv_cache_usage" in lines[0]


def test_unknown_choice_lists_valid_ones(tmp_path):
    proc = _run("attention=nope", cwd=tmp_path)
    assert proc.returncode == 2
    assert "torch_ref" in proc.stderr and "nope" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_our_errors_are_one_line_exit_2(tmp_path):
    proc = _run("model=hf", f"model.name={tmp_path / 'missing'}", "logger=none", f"hydra.run.dir={tmp_path}/r",
                cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "missing" in proc.stderr
