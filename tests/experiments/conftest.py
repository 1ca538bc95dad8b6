"""Helpers for the experiment-layer tests: run `python -m research_lm` (and its report / reproduce
modules) in a subprocess with one thread, W&B offline under the test's directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"
PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def run_module(module: str, *args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(cwd), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_cli(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_module("research_lm", *args, cwd=cwd, timeout=timeout)
