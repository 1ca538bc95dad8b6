"""What a result was measured on: versions, device, git commit, command line."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

import torch

_PACKAGES = ("torch", "triton", "transformers", "safetensors", "numpy", "hydra-core", "wandb", "flashinfer-python")


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state(repo: Path | None = None) -> dict[str, object]:
    repo = repo or Path(__file__).resolve().parent.parent
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


def environment(device: torch.device) -> dict[str, object]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        "cpu_count": torch.get_num_threads(),
        "packages": {p: _version(p) for p in _PACKAGES},
        "git": git_state(),
    }
