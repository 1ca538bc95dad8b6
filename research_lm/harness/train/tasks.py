"""The Hydra tasks: `task: train_target | train_moe | train_eagle3 | train_eagle | train_medusa | train_draft`.

Each reads the `train:` block of its preset (conf/experiment/train_*.yaml): the `TrainConfig` knobs,
plus `tokenizer` / `model` (train_target, train_moe with `architecture` and `init_dir`, train_draft's `model`),
`target` and `head` (the heads).
Writes results.json and env.json to the run directory and prints the summary table.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from research_lm.harness.env_info import environment
from research_lm.harness.experiment import print_table, register_task
from research_lm.harness.train.artifacts import TrainResult
from research_lm.harness.train.config import TrainConfig
from research_lm.harness.train.heads import TASKS, train_head
from research_lm.harness.train.moe import train_moe
from research_lm.harness.train.target import train_target

HEAD_TASKS = {task: method for method, task in TASKS.items()}
_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)} - {"seed", "device"}
_TASK_KEYS = {"train_target": {"tokenizer", "model"}, "train_moe": {"tokenizer", "model", "architecture", "init_dir"},
              **{t: {"target", "head", "regenerate"} for t in HEAD_TASKS}}


def _train_block(cfg: DictConfig) -> dict[str, Any]:
    if "train" not in cfg:
        raise ValueError(f"task {cfg.task!r} needs a train: block (use experiment={cfg.task})")
    block = OmegaConf.to_container(cfg.train, resolve=True)
    allowed = _TRAIN_FIELDS | _TASK_KEYS[cfg.task]
    unknown = sorted(set(block) - allowed)
    if unknown:
        raise ValueError(f"unknown train key(s) {unknown} for {cfg.task}; valid ones: {sorted(allowed)}")
    return block


def train_config(cfg: DictConfig) -> TrainConfig:
    """The `TrainConfig` of a composed config: `train.*` knobs plus the top-level seed and device."""
    block = _train_block(cfg)
    return TrainConfig(seed=cfg.seed, device=cfg.device, **{k: v for k, v in block.items() if k in _TRAIN_FIELDS})


def _finish(cfg: DictConfig, run_dir: Path, result: TrainResult, device: str) -> dict[str, Any]:
    import torch

    env = environment(torch.device(device))
    results = {"summary": result.summary, "output_dir": str(result.output_dir),
               "config": OmegaConf.to_container(cfg, resolve=True), "env": env}
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (run_dir / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    print_table({k: v for k, v in result.summary.items() if v is not None}, run_dir)
    return results


@register_task("train_target")
def run_train_target(cfg: DictConfig, run_dir: Path, logger) -> dict[str, Any]:
    """Train the reference target LM; the output directory is a Hugging Face checkpoint."""
    block, tc = _train_block(cfg), train_config(cfg)
    result = train_target(tc, tokenizer=block.get("tokenizer") or "tiny-llama", model=block.get("model"),
                          logger=logger)
    return _finish(cfg, run_dir, result, str(tc.resolve_device()))


@register_task("train_moe")
def run_train_moe(cfg: DictConfig, run_dir: Path, logger) -> dict[str, Any]:
    """Train a small Qwen3-MoE / Qwen2-MoE with its load-balancing loss; the output is a Hugging Face checkpoint."""
    block, tc = _train_block(cfg), train_config(cfg)
    result = train_moe(tc, architecture=block.get("architecture") or "Qwen3MoeForCausalLM",
                       tokenizer=block.get("tokenizer") or "tiny-llama", model=block.get("model"),
                       init_dir=block.get("init_dir"), logger=logger)
    return _finish(cfg, run_dir, result, str(tc.resolve_device()))


def _head_task(method: str):
    def run_head_task(cfg: DictConfig, run_dir: Path, logger) -> dict[str, Any]:
        block, tc = _train_block(cfg), train_config(cfg)
        result = train_head(method, tc, target=block.get("target") or "tiny-llama", head=block.get("head"),
                            regenerate=block.get("regenerate"), logger=logger)
        return _finish(cfg, run_dir, result, str(tc.resolve_device()))

    run_head_task.__doc__ = f"Self-distil a {method} drafter from the frozen target; written in its published layout."
    return run_head_task


for _task, _method in HEAD_TASKS.items():
    register_task(_task)(_head_task(_method))
