"""env.command records the command as typed (`python -m research_lm ...`), not the path of __main__.py."""

from __future__ import annotations

from research_lm.harness.env_info import command_line

from .conftest import REPO

MAIN = str(REPO / "research_lm" / "__main__.py")


def test_module_runs_are_recorded_as_python_dash_m():
    typed = ["/work/venv/bin/python3", "-m", "research_lm", "experiment=eagle3", "workload.input_len=[128,128]"]
    argv = [MAIN, "experiment=eagle3", "workload.input_len=[128,128]"]
    assert command_line(argv, typed) == "python3 -m research_lm experiment=eagle3 'workload.input_len=[128,128]'"
    argv = [str(REPO / "research_lm" / "harness" / "report.py"), "multirun/x"]
    assert command_line(argv, ["python", "-m", "research_lm.harness.report", "multirun/x"]) == \
        "python -m research_lm.harness.report multirun/x"
    paper = str(REPO / "experiments" / "paper" / "__main__.py")  # `experiments` has no __init__.py
    assert command_line([paper, "eplb_policy"], ["python", "-m", "experiments.paper", "eplb_policy"]) == \
        "python -m experiments.paper eplb_policy"


def test_scripts_keep_their_path_and_interpreter_options():
    argv = ["experiments/bench_decode.py", "--tiny"]
    assert command_line(argv, ["python", "-u", *argv]) == "python -u experiments/bench_decode.py --tiny"
    assert command_line(["-c"], ["python", "-c", "print(1)"]) == "python -c 'print(1)'"


def test_without_a_matching_orig_argv_the_main_path_becomes_dash_m():
    """A joblib sweep job: sys.argv is the parent's, orig_argv the worker's own launch."""
    worker = ["/usr/bin/python", "-m", "joblib.externals.loky.backend.popen_loky_posix", "--pipe", "14"]
    argv = [MAIN, "-m", "hydra/launcher=joblib", "spec=ngram,eagle3"]
    assert command_line(argv, worker) == "python -m research_lm -m hydra/launcher=joblib spec=ngram,eagle3"
    assert command_line([MAIN], worker) == "python -m research_lm"
    assert command_line(["bench.py", "--x"], []) == "python bench.py --x"


def test_env_records_which_packages_differ_from_the_tested_versions(tmp_path):
    from research_lm.harness.env_info import CONSTRAINTS, environment, lock_differences, locked_versions

    lock = tmp_path / "constraints.txt"
    lock.write_text("# a comment\ntorch==2.15.0\ntriton==3.9.0  # pinned\nnumpy==2.4.6\n")
    locked = locked_versions(lock)
    assert locked == {"torch": "2.15.0", "triton": "3.9.0", "numpy": "2.4.6"}
    installed = {"torch": "2.15.0+cu132", "triton": "3.6.0", "numpy": "2.4.6", "wandb": "0.19"}
    assert lock_differences(installed, locked) == {"triton": {"installed": "3.6.0", "tested": "3.9.0"}}
    assert set(locked_versions(CONSTRAINTS)) >= {"torch", "triton", "transformers", "hydra-core", "pytest"}
    import torch

    assert "differs_from_constraints" in environment(torch.device("cpu"))
