"""What a result was measured on: versions, device, the machine (and SLURM job), git commit, command line."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import torch

_PACKAGES = ("torch", "triton", "transformers", "safetensors", "numpy", "hydra-core", "wandb", "flashinfer-python")
CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints.txt"  # the tested versions (README's install)
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_ARRAY_TASK_ID")
_SUBMITIT_JOB = "submitit.core._submit"  # the module a submitit job process is started as


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def locked_versions(path: Path = CONSTRAINTS) -> dict[str, str]:
    """Package -> version pinned in the constraints file (empty when it is not beside the package)."""
    if not path.is_file():
        return {}
    pins = (line.split("#")[0].strip().partition("==") for line in path.read_text().splitlines())
    return {name.lower(): version for name, sep, version in pins if sep}


def lock_differences(installed: dict[str, str | None], locked: dict[str, str]) -> dict[str, dict[str, str | None]]:
    """The packages whose installed version is not the tested one (a local build tag such as +cu132 aside)."""
    return {p: {"installed": v, "tested": locked[p]} for p, v in installed.items()
            if p in locked and (v or "").split("+")[0] != locked[p]}


def git_state(repo: Path | None = None) -> dict[str, object]:
    """HEAD and the dirty flag of the checkout; RESEARCH_LM_COMMIT (+ RESEARCH_LM_DIRTY=1) override them for
    copies of the tree that carry no (or stale) git metadata, such as a benchmark machine's."""
    if os.environ.get("RESEARCH_LM_COMMIT"):
        return {"commit": os.environ["RESEARCH_LM_COMMIT"], "dirty": os.environ.get("RESEARCH_LM_DIRTY") == "1"}
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit or None, "dirty": dirty if commit else None}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def where_ran(environ: dict[str, str] | None = None) -> dict[str, object]:
    """The machine a job ran on (`hostname`) and, under SLURM, its job: `slurm` maps each of SLURM_VARIABLES to
    its value, None where unset (outside SLURM all are), so a report can tell a sweep's machines apart."""
    environ = os.environ if environ is None else environ
    return {"hostname": socket.gethostname(), "slurm": {name: environ.get(name) for name in SLURM_VARIABLES}}


def command_line(argv: list[str] | None = None, orig_argv: list[str] | None = None) -> str:
    """The command as the user typed it: `python -m research_lm experiment=eagle3 ...`, `python
    experiments/bench_decode.py --profile`, shell-quoted (`'workload.input_len=[128,128]'`).

    From `sys.orig_argv` (the interpreter's own argv, options and `-m <module>` included) when it agrees
    with `sys.argv`; with the interpreter written by its name (`python`), not its path. Otherwise (a
    worker process, e.g. a joblib sweep job, whose orig_argv is the worker's own launch while sys.argv is
    its parent's) from `sys.argv`, a path inside a package turned back into `-m <package.module>`. A submitit
    job (hydra/launcher=submitit_*) runs as `python -m submitit.core._submit <folder>`: its sweep's command."""
    argv = list(sys.argv if argv is None else argv)
    orig = list(getattr(sys, "orig_argv", None) or [] if orig_argv is None else orig_argv)
    if _SUBMITIT_JOB in orig and (sweep := submitit_sweep_command()):
        return sweep
    args = argv[1:]
    n = len(orig) - len(args)  # orig[n:] should be the arguments; orig[n - 1] the script, `-c`, or the module
    if orig and n >= 2 and orig[n:] == args:
        launched = orig[n - 1]
        module = orig[n - 1] if orig[n - 2] == "-m" else None
        typed = launched == argv[0] or argv[0] == orig[n - 2] == "-c"  # a script, or python -c
        found = _module_of(argv[0])  # of a namespace package (no __init__.py), only the tail: `paper`
        if typed or (module and (found is None or f".{module}".endswith(f".{found}"))):
            return shlex.join([Path(orig[0]).name or "python", *orig[1:]])
    module = _module_of(argv[0]) if argv else None
    head = ["-m", module] if module else argv[:1]
    return shlex.join(["python", *head, *args])


def submitit_sweep_command() -> str | None:
    """`python -m research_lm -m <the sweep's overrides>` of the Hydra sweep this process is a job of, as typed
    (`runner.max_num_seqs=1,2`), from the multirun.yaml Hydra writes into the sweep folder before it submits the
    jobs (a submitit job's own argv is submitit's); None outside a Hydra job or without that file. research_lm
    is the only Hydra app here, so the module is named, not found."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return None
    recorded = Path(HydraConfig.get().sweep.dir) / "multirun.yaml"
    if not recorded.is_file():
        return None
    overrides = OmegaConf.load(recorded).hydra.overrides
    args = [o for o in (*overrides.hydra, *overrides.task) if o != "hydra.mode=MULTIRUN"]
    return shlex.join(["python", "-m", "research_lm", "-m", *args])


def _module_of(path: str) -> str | None:
    """`research_lm/__main__.py` -> `research_lm`, `research_lm/harness/report.py` -> `research_lm.harness.report`: the
    dotted module of a .py file inside a package (folders with __init__.py, so a namespace package's name
    is left out); None for a plain script."""
    file = Path(path)
    if file.suffix != ".py" or not (file.parent / "__init__.py").is_file():
        return None
    parts = [] if file.stem == "__main__" else [file.stem]
    folder = file.resolve().parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def environment(device: torch.device) -> dict[str, object]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command_line(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        **where_ran(),
        "cpu_count": torch.get_num_threads(),
        "packages": (packages := {p: _version(p) for p in _PACKAGES}),
        "differs_from_constraints": lock_differences(packages, locked_versions()),
        "git": git_state(),
    }
