"""Runs record what reproducing them needs; `research_lm.harness.reproduce` re-runs one and compares outputs."""

from __future__ import annotations

import json
import shutil

from research_lm.harness.reproduce import compare

from .conftest import run_cli, run_module


def test_reproduce_gives_identical_cpu_outputs(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("logger=jsonl", "deterministic=true", "device=cpu", "workload.num_requests=3",
                   "workload.max_tokens=6", "workload.temperature=0.8", f"hydra.run.dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    rep, env = results["reproducibility"], results["env"]
    assert rep["seeds"] == {"seed": 0, "workload_seed": 0} and rep["deterministic"] is True
    assert "workload.temperature=0.8" in rep["overrides"]
    assert {"commit", "dirty"} <= set(env["git"]) and env["packages"]["torch"] and env["device"] == "cpu"
    assert env["command"].startswith("python -m research_lm logger=jsonl ")  # as typed, not __main__.py's path
    assert "workload.max_tokens=6" in env["command"]
    assert results["config"]["workload"]["temperature"] == 0.8  # the resolved config
    assert len(results["workload"]["fingerprint"]) == 16 and results["workload"]["hash"]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert all(s["token_ids"] for s in samples)

    again = tmp_path / "again"
    proc = run_module("research_lm.harness.reproduce", str(run), "--out", str(again), "--logger", "none", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "IDENTICAL" in proc.stdout and "3/3 requests identical" in proc.stdout
    report = json.loads((again / "reproduce.json").read_text())
    assert report["identical"] and report["samples"]["compared"] == "token_ids"
    assert json.loads((again / "results.json").read_text())["reproducibility"]["reproduced_from"] == str(run)

    # a changed token is caught
    changed = tmp_path / "changed"
    shutil.copytree(again, changed)
    lines = (changed / "samples.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["token_ids"][-1] += 1
    (changed / "samples.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    report = compare(run, changed)
    assert not report["identical"] and report["samples"]["different_request_ids"] == [first["request_id"]]


def test_reproduce_refuses_a_directory_that_is_not_a_run(tmp_path):
    proc = run_module("research_lm.harness.reproduce", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "no results.json" in proc.stderr and "Traceback" not in proc.stderr
