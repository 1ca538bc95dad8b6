"""What a trainer leaves behind: weight files in the published layouts, config.json, recipe.json."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from research_lm.harness.train.config import TrainConfig
from research_lm.harness.train.data import Corpus
from research_lm.harness.train.loop import FitResult


@dataclass
class TrainResult:
    output_dir: Path
    summary: dict[str, Any]  # flat scalars: what results.json and the logger's summary hold
    fit: FitResult


def save_safetensors(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    """Floating tensors cast to `dtype`; integer and bool tensors (d2t, t2d) kept as they are."""
    from safetensors.torch import save_file

    out = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous().clone()
           for k, v in state.items()}
    save_file(out, str(path), metadata={"format": "pt"})


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def summarize(task: str, cfg: TrainConfig, fit: FitResult, corpus: Corpus, output_dir: Path,
              num_params: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "task": task, "steps": fit.step, "final_train_loss": fit.train_loss,
        **{f"final_val_{k}": v for k, v in fit.val.items()},
        "tokens_seen": fit.tokens_seen, "wall_s": round(fit.wall_s, 2), "trainable_params": num_params,
        "resumed_from": fit.resumed_from, "seed": cfg.seed, **corpus.describe(), "output_dir": str(output_dir),
    }
    summary.update(extra or {})
    return summary


def write_recipe(output_dir: Path, summary: dict[str, Any], cfg: TrainConfig, details: dict[str, Any]) -> None:
    """recipe.json: how the files beside it were made (corpus hash, steps, losses, knobs, versions)."""
    write_json(output_dir / "recipe.json", {
        **summary, **details, "train": dataclasses.asdict(cfg),
        "versions": {p: _version(p) for p in ("torch", "transformers", "tokenizers", "research_lm")},
    })
