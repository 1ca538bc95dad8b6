"""Turn a composed Hydra config into a run: engine, workload, logger, results on disk."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from research_lm.config import EngineConfig
from research_lm.env_info import environment
from research_lm.llm import LLM
from research_lm.loggers import get_logger
from research_lm.workloads import WorkloadSpec, build_workload

_TASKS: dict[str, Any] = {}
# Tasks registered by other modules, imported when first asked for (their import registers them).
_TASK_MODULES = {name: "research_lm.train.tasks"
                 for name in ("train_target", "train_eagle3", "train_eagle", "train_medusa", "train_draft")}


def register_task(name: str):
    def wrap(fn):
        _TASKS[name] = fn
        return fn

    return wrap


def run(cfg: DictConfig, run_dir: Path, sweep_group: str | None = None) -> dict[str, Any]:
    if cfg.task not in _TASKS and cfg.task in _TASK_MODULES:
        importlib.import_module(_TASK_MODULES[cfg.task])
    if cfg.task not in _TASKS:
        raise ValueError(f"unknown task {cfg.task!r}; choose one of {sorted(set(_TASKS) | set(_TASK_MODULES))}")
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    flat = _flatten(OmegaConf.to_container(cfg, resolve=True))
    logger = get_logger(**OmegaConf.to_container(cfg.logger, resolve=True))
    logger.start(run_dir, flat, name=run_dir.name, group=cfg.sweep_name or sweep_group)
    try:
        results = _TASKS[cfg.task](cfg, run_dir, logger)
        logger.summary(results["summary"])
    finally:
        logger.finish()
    return results


def engine_config(cfg: DictConfig) -> EngineConfig:
    m, r = cfg.model, cfg.runner
    spec = OmegaConf.to_container(cfg.spec, resolve=True) if cfg.spec.get("method") else None
    return EngineConfig(
        model=m.name, tokenizer=m.tokenizer, dtype=m.dtype, device=cfg.device, seed=cfg.seed,
        block_size=r.block_size, max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens,
        max_model_len=m.max_model_len, gpu_memory_utilization=r.gpu_memory_utilization,
        num_gpu_blocks=r.num_gpu_blocks, enable_prefix_caching=r.enable_prefix_caching,
        enable_chunked_prefill=r.enable_chunked_prefill, attention_backend=cfg.attention.backend,
        trust_remote_code=m.trust_remote_code, speculative_config=spec,
        mla_backend=cfg.attention.get("mla_backend", "mla_torch_ref"),
        mamba_backend=cfg.attention.get("mamba_backend", "mamba_torch_ref"),
        eplb_config=OmegaConf.to_container(cfg.eplb, resolve=True) if "eplb" in cfg else None,
    )


@register_task("generate")
def generate(cfg: DictConfig, run_dir: Path, logger) -> dict[str, Any]:
    """Run the workload once through the engine; write results.json, env.json and samples.jsonl."""
    llm = LLM(**vars(engine_config(cfg)))
    w = OmegaConf.to_container(cfg.workload, resolve=True)
    w = {k: tuple(v) if isinstance(v, list) else v for k, v in w.items()}
    workload = build_workload(WorkloadSpec(**w), llm.engine.info.vocab_size)
    if cfg.warmup_requests:
        n = cfg.warmup_requests
        llm.generate(workload.prompts[:n], workload.params[:n], use_tqdm=False)
    llm.engine.metrics.reset()
    outputs = llm.generate(workload.prompts, workload.params)
    metrics = llm.engine.metrics
    for step in metrics.steps:
        logger.log(step, step=step["step"])
    summary = metrics.summary()
    eplb = llm.engine.eplb.summary() if llm.engine.eplb is not None else None  # MoE models only
    if eplb is not None:
        summary.update({f"eplb_{k}": v for k, v in eplb.items() if isinstance(v, int | float | str | bool)})
    info = llm.engine.info
    results = {
        "summary": summary,
        "model": {"path": info.path, "dtype": str(info.dtype), "num_kv_blocks": llm.engine.num_blocks},
        "workload": {"kind": w["kind"], "num_requests": len(workload.prompts), "hash": workload.source_hash},
        "config": OmegaConf.to_container(cfg, resolve=True),
        "eplb": eplb,
        "env": environment(info.device),
    }
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (run_dir / "env.json").write_text(json.dumps(results["env"], indent=2) + "\n")
    with open(run_dir / "samples.jsonl", "w") as f:
        for out in outputs:
            f.write(json.dumps({"request_id": out.request_id, "prompt": out.prompt,
                                "text": out.outputs[0].text, "finish_reason": out.outputs[0].finish_reason,
                                "error": out.error}) + "\n")
    print_table(summary, run_dir)
    return results


def print_table(summary: dict[str, Any], run_dir: Path) -> None:
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
    width = max(len(k) for k, _ in rows)
    print(f"\n| {'metric'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|", file=sys.stdout)
    for k, v in rows:
        print(f"| {k.ljust(width)} | {v} |")
    print(f"\nresults: {run_dir / 'results.json'}")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
