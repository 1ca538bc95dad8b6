"""Sweeps through the submitit launchers (issue 33, item 4): a 2-job `submitit_local` sweep end to end on CPU (W&B
group, env.json, report), `submitit_slurm` composed down to the sbatch script without submitting, and the report of a
sweep whose jobs ran on different machines."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from research_lm.harness.env_info import SLURM_VARIABLES, where_ran
from research_lm.harness.report import build_report
from tests.experiments.conftest import CONF_DIR, run_cli, run_module

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the `test` (or `slurm`) extra")

# The documented GPU sweep options (conf/README.md, Sweeps) and the sbatch lines each must become.
SLURM_OPTIONS = {
    "hydra.launcher.partition=gpu": "#SBATCH --partition=gpu",
    "hydra.launcher.gpus_per_node=1": "#SBATCH --gpus-per-node=1",
    "hydra.launcher.timeout_min=120": "#SBATCH --time=120",
    "hydra.launcher.cpus_per_task=8": "#SBATCH --cpus-per-task=8",
    "hydra.launcher.mem_gb=64": "#SBATCH --mem=64GB",
    "hydra.launcher.nodes=1": "#SBATCH --nodes=1",
}
# Options that are not a plain value: a shell line each job runs first, any other sbatch option.
SLURM_EXTRAS = {
    "hydra.launcher.setup=[nvidia-smi]": "nvidia-smi",
    "+hydra.launcher.additional_parameters.mail-type=END": "#SBATCH --mail-type=END",
}


def test_submitit_local_sweep_end_to_end_with_wandb_group_and_report(tmp_path):
    """Two bench_decode jobs (1 and 2 requests of 8 + 4 tokens), each its own submitit process."""
    sweep = tmp_path / "multirun" / "cluster-sweep"
    proc = run_cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=2",
                   "hydra.launcher.cpus_per_task=1", "experiment=bench_decode", "device=cpu", "logger=wandb",
                   "warmup_requests=0", "workload.input_len=[8,8]", "workload.output_len=[4,4]",
                   "workload.num_requests=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [sweep / "0", sweep / "1"]
    assert sorted(p.parent for p in sweep.glob("*/results.json")) == jobs
    assert list((sweep / ".submitit").glob("*/*_log.out")), "the jobs ran as submitit processes"
    for num_requests, job in enumerate(jobs, start=1):
        results = json.loads((job / "results.json").read_text())
        assert results["config"]["workload"]["num_requests"] == num_requests
        assert results["reproducibility"]["sweep_group"] == "cluster-sweep"
        runs = list((job / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, "each job is its own W&B run"
        assert b"cluster-sweep" in next(runs[0].glob("run-*.wandb")).read_bytes(), "grouped under the sweep's name"
        env = json.loads((job / "env.json").read_text())
        assert env["hostname"] == socket.gethostname()
        assert env["slurm"] == {name: os.environ.get(name) for name in SLURM_VARIABLES}
        # the sweep as typed, not the submitit job's own `python -u -m submitit.core._submit <folder>`
        assert env["command"].startswith("python -m research_lm -m hydra/launcher=submitit_local ")
        assert "workload.num_requests=1,2" in env["command"]

    report = run_module("research_lm.harness.report", str(sweep), "--no-plots", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    text = (sweep / "report.md").read_text()
    assert "| job | `workload.num_requests` | output_throughput_tok_s" in text, "one host: no host column"
    assert [line.split(" | ")[:2] for line in text.splitlines() if line.startswith(("| 0 ", "| 1 "))] == \
        [["| 0", "1"], ["| 1", "2"]]
    assert "Hosts:" not in text


def test_submitit_slurm_composes_with_gpu_partition_and_time_options(tmp_path, monkeypatch):
    """The launcher's options reach the sbatch script submitit would submit; nothing is submitted (map_array is
    replaced) and no SLURM is needed (submitit only looks for an `srun` on PATH)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    import submitit

    submitted: list[tuple[str, int]] = []

    def record_sbatch_script(executor, _function, *job_args):
        submitted.append((executor._executor._make_submission_file_text("<command>", "uid"), len(job_args[0])))
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", record_sbatch_script)
    overrides = ["hydra/launcher=submitit_slurm", *SLURM_OPTIONS, *SLURM_EXTRAS,
                 f"hydra.sweep.dir={tmp_path / 'sweep'}", "experiment=spec_ablation", "device=cuda"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    launcher_cfg = cfg.hydra.launcher
    assert (launcher_cfg.partition, launcher_cfg.gpus_per_node, launcher_cfg.timeout_min) == ("gpu", 1, 120)
    launcher = instantiate(launcher_cfg)
    launcher.config = cfg
    assert launcher.launch([["spec=ngram"], ["spec=eagle3"]], initial_job_idx=0) == []
    [(script, num_jobs)] = submitted
    assert num_jobs == 2
    for option, line in (SLURM_OPTIONS | SLURM_EXTRAS).items():
        assert line in script.splitlines(), option
    assert f"--output={tmp_path / 'sweep'}/.submitit/" in script


def test_the_cli_accepts_the_documented_slurm_options(tmp_path):
    """The README's command, through research_lm's own command-line checks (`--cfg hydra`: nothing runs)."""
    proc = run_cli("hydra/launcher=submitit_slurm", *SLURM_OPTIONS, *SLURM_EXTRAS, "experiment=spec_ablation",
                   "--cfg", "hydra", "-p", "hydra.launcher", cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launcher = yaml.safe_load(proc.stdout)
    assert {f"hydra.launcher.{k}={v}" for k, v in launcher.items()} >= set(SLURM_OPTIONS)
    assert launcher["setup"] == ["nvidia-smi"] and launcher["additional_parameters"] == {"mail-type": "END"}
    typo = run_cli("-m", "hydra/launcher=submitit_slurm", "hydra.launcher.gpu_per_node=1", cwd=tmp_path, timeout=60)
    assert typo.returncode == 2 and "did you mean hydra.launcher.gpus_per_node" in typo.stderr


def test_where_ran_names_the_host_and_the_slurm_job():
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NODELIST": "gpu-[01-02]", "SLURM_ARRAY_TASK_ID": "3"}
    assert where_ran(slurm) == {"hostname": socket.gethostname(), "slurm": slurm}
    assert where_ran({}) == {"hostname": socket.gethostname(),
                             "slurm": {"SLURM_JOB_ID": None, "SLURM_NODELIST": None, "SLURM_ARRAY_TASK_ID": None}}


def _job(root: Path, name: str, host: str, overrides: list[str], throughput: float) -> None:
    """A job folder as a sweep job writes it: results.json with its overrides, summary and env (hostname)."""
    job = root / name
    job.mkdir(parents=True)
    job_id = str(4242 + int(name))
    env = {"device": "cuda", "device_name": "NVIDIA H100", "hostname": host,
           "slurm": {"SLURM_JOB_ID": job_id, "SLURM_NODELIST": host, "SLURM_ARRAY_TASK_ID": name}}
    (job / "results.json").write_text(json.dumps({
        "summary": {"output_throughput_tok_s": throughput}, "config": {"task": "generate"},
        "reproducibility": {"overrides": overrides}, "env": env}))
    (job / "env.json").write_text(json.dumps(env))


def test_report_of_a_sweep_over_two_hosts_names_each_jobs_host(tmp_path):
    sweep = tmp_path / "two-hosts"
    for name, host, batch in (("0", "gpu-01", 1), ("1", "gpu-01", 2), ("2", "gpu-02", 4)):
        _job(sweep, name, host, [f"runner.max_num_seqs={batch}"], 10.0 * batch)
    text = build_report(sweep, plots=False).read_text()
    assert "Hosts: 2 machines: gpu-01, gpu-02." in text
    assert "| job | `runner.max_num_seqs` | host | output_throughput_tok_s |" in text
    assert "| 2 | 4 | gpu-02 | 40 |" in text and "| 0 | 1 | gpu-01 | 10 |" in text
    data = json.loads((sweep / "report.json").read_text())
    assert data["hosts"] == ["gpu-01", "gpu-02"]
    assert [cell["hosts"] for cell in data["cells"]] == [["gpu-01"], ["gpu-01"], ["gpu-02"]]


def test_repeats_on_two_hosts_list_both_in_their_cell(tmp_path):
    sweep = tmp_path / "repeats"
    _job(sweep, "0", "gpu-01", ["runner.max_num_seqs=1", "+repeat=0"], 10.0)
    _job(sweep, "1", "gpu-02", ["runner.max_num_seqs=1", "+repeat=1"], 12.0)
    text = build_report(sweep, plots=False).read_text()
    assert "| jobs | host | output_throughput_tok_s |" in text
    assert "| 0,1 | gpu-01, gpu-02 | 11 (10–12) |" in text
