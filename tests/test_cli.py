"""The Hydra CLI end to end: the quickstart writes its results; bad input exits 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    # what attention=auto and the device-sized batch limits resolved to (CPU: the torch reference, 64 / 2048)
    assert results["engine"] == {"attention_backends": {"attention": "torch_ref"}, "max_num_seqs": 64,
                                 "max_num_batched_tokens": 2048}
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


# Bad command lines: (arguments, what the one line must contain). TMP stands for an empty directory.
BAD_COMMAND_LINES = [
    # wrong types
    (["runner.max_num_seqs=abc"], ["runner.max_num_seqs", "integer", "'abc'"]),
    (["workload.max_tokens=1.5"], ["workload.max_tokens", "integer"]),
    (["runner.cuda_graphs=maybe"], ["runner.cuda_graphs", "true or false"]),
    (["seed=xyz"], ["seed", "integer"]),
    (["workload.temperature=hot"], ["workload.temperature", "number"]),
    (["workload=synthetic", "workload.input_len=[1]"], ["workload.input_len", "2 integers"]),
    # out of range
    (["runner.max_num_seqs=0"], ["runner.max_num_seqs", ">= 1"]),
    (["runner.gpu_memory_utilization=1.5"], ["runner.gpu_memory_utilization", "(0, 1]"]),
    (["workload.temperature=-1"], ["workload.temperature", ">= 0"]),
    (["workload.num_requests=-3"], ["workload.num_requests", ">= 1"]),
    # unknown keys
    (["runner.max_num_seq=4"], ["runner.max_num_seq'", "did you mean runner.max_num_seqs?"]),
    (["nonexistent.key=3"], ["nonexistent.key", "--cfg job"]),
    (["~nope"], ["nope"]),
    (["runner.max_num_seqs=${oops}"], ["runner.max_num_seqs", "oops"]),
    # unknown options
    (["attention=nope"], ["attention", "torch_ref"]),
    (["experiment=nope"], ["experiment", "quickstart"]),
    (["spec=nope"], ["spec", "ngram"]),
    (["hydra/launcher=nope"], ["hydra/launcher", "joblib"]),
    # paths that cannot be read
    (["model=hf", "model.name=/nonexistent/dir"], ["model.name", "/nonexistent/dir", "tiny-llama"]),
    (["model=hf", "model.name=TMP"], ["model.name", "config.json"]),
    (["model=hf"], ["model.name", "required"]),
    (["workload=jsonl", "workload.path=/nope.jsonl"], ["workload.path", "/nope.jsonl"]),
    (["workload=jsonl", "workload.path=TMP"], ["workload.path", "directory"]),
    # malformed command lines
    (["runner.max_num_seqs"], ["runner.max_num_seqs", "'='"]),
    (["key=="], ["key=="]),
    (["runner.max_num_seqs=[1"], ["runner.max_num_seqs=[1"]),
    (["runner.max_num_seqs=1,2"], ["runner.max_num_seqs", "-m"]),
    (["--no-such-flag"], ["--no-such-flag"]),
    # a sweep: each value is checked before the first job runs
    (["-m", "runner.max_num_seqs=1,abc"], ["runner.max_num_seqs", "'abc'"]),
    (["-m", "attention=torch_ref,nope"], ["attention", "nope"]),
]


@pytest.mark.parametrize("args,expected", BAD_COMMAND_LINES, ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_bad_command_line_is_one_line_exit_2(args, expected, tmp_path, monkeypatch, capsys):
    """Each fails before Hydra runs a job (so in-process, ~0.1 s): exit 2, one line naming the key, no traceback."""
    from research_lm.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["research_lm", *(a.replace("TMP", str(tmp_path)) for a in args)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("research_lm: error: "), err
    for text in expected:
        assert text in lines[0], err
    assert not list(tmp_path.iterdir()), "nothing is written before the command line is valid"


@pytest.mark.parametrize("args", [
    [],
    ["--cfg", "job", "model=hf", "runner.max_num_seqs=0"],  # printing the config checks keys, not values
    ["-m", "hydra/launcher=joblib", "runner.max_num_seqs=1,2", "attention=torch_ref,triton"],
    ["+foo=1", "runner.max_num_seqs=null", "workload=synthetic", "workload.input_len=[4,8]"],
    ["--help", "nonsense"],
])
def test_valid_command_lines_pass_the_checks(args):
    from research_lm.__main__ import CONF_DIR
    from research_lm.harness.cli_checks import check_command_line

    check_command_line(args, CONF_DIR)


@pytest.mark.parametrize("args,key", [
    (["runner.max_num_seqs=abc"], "runner.max_num_seqs"),  # once a TypeError deep in the engine
    (["task=nope", "logger=none"], "task"),  # raised inside the job, by experiment.run
])
def test_bad_values_exit_2_with_one_line_in_a_real_process(args, key, tmp_path):
    proc = _run(*args, f"hydra.run.dir={tmp_path}/r", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and key in proc.stderr
