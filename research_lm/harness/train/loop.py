"""One training loop for every trainer: AdamW, warmup + cosine, logging, held-out eval, resume.

An `Objective` owns the trainable module and turns a batch of token ids into a scalar loss (plus
metrics); the loop owns everything else. Resume checkpoints hold the module, the optimizer, the step
and the RNG states; since batches are a pure function of (seed, step), a resumed run is bit-identical
to an uninterrupted one on CPU.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from research_lm.harness.train.config import TrainConfig
from research_lm.harness.train.data import PackedData

# Knobs a resumed run must share with the run that wrote the checkpoint (the data order depends on them).
_RESUME_INVARIANTS = ("batch_size", "seq_len", "seed")


class Objective(Protocol):
    module: nn.Module  # the trained parameters (and persistent buffers), checkpointed whole
    reports_ppl: bool  # the loss is a per-token cross-entropy: log exp(loss) as perplexity

    def loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """input_ids: [batch, seq_len] int64 -> (scalar loss, {metric: 0-d tensor})."""
        ...


@dataclass
class FitResult:
    step: int  # steps completed
    train_loss: float | None  # mean over the last logging window of this process (None if it ran no step)
    val: dict[str, float]  # held-out metrics at the end ("loss", ...)
    resumed_from: int | None
    wall_s: float
    tokens_seen: int
    history: list[dict[str, Any]] = field(default_factory=list)  # everything logged, in order


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine from `lr` down to `lr * min_lr_ratio` at `steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(module: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


def autocast_for(device: torch.device, enabled: bool) -> AbstractContextManager:
    if device.type == "cuda" and enabled:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# ---- resume checkpoints ---------------------------------------------------------------------------

def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints(ckpt_dir: Path) -> list[Path]:
    """Resume checkpoints in `ckpt_dir`, oldest first."""
    return sorted(ckpt_dir.glob("step_*.pt"))


def save_checkpoint(ckpt_dir: Path, step: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                    cfg: TrainConfig) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step_{step:08d}.pt"
    state = {"step": step, "module": module.state_dict(), "optimizer": optimizer.state_dict(),
             "rng": _rng_state(), "meta": {k: getattr(cfg, k) for k in _RESUME_INVARIANTS}}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # a crash mid-write never leaves a truncated newest checkpoint
    for old in checkpoints(ckpt_dir)[: -cfg.keep_checkpoints]:
        old.unlink()
    return path


def load_checkpoint(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> int:
    """Restore module, optimizer and RNG from `path` (weights-only unpickling); returns the step."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in _RESUME_INVARIANTS:
        if state["meta"][key] != getattr(cfg, key):
            raise ValueError(f"cannot resume from {path}: it was trained with train.{key}={state['meta'][key]}, "
                             f"this run has {getattr(cfg, key)}")
    module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    return int(state["step"])


# ---- the loop -------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(objective: Objective, batches: list[torch.Tensor], device: torch.device, cfg: TrainConfig
             ) -> dict[str, float]:
    objective.module.eval()
    sums: dict[str, float] = {}
    for batch in batches:
        with autocast_for(device, cfg.autocast):
            loss, metrics = objective.loss(batch.to(device))
        for k, v in {"loss": loss, **metrics}.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    out = {k: v / max(1, len(batches)) for k, v in sums.items()}
    if objective.reports_ppl and "loss" in out:
        out["ppl"] = math.exp(min(out["loss"], 50.0))
    return out


class _Window:
    """Train-loss and metric sums since the last log, kept on the device (one sync per log)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.steps, self.t0 = 0, time.perf_counter()

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        for k, v in {"loss": loss, **metrics}.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        self.steps += 1

    def report(self, lr: float, cfg: TrainConfig, reports_ppl: bool) -> tuple[float, dict[str, float]]:
        """(mean train loss, the metrics to log): window means, lr, throughput, perplexity if meaningful."""
        means = {k: float(v) / self.steps for k, v in self.sums.items()}
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        out = {f"train/{k}": v for k, v in means.items()}
        out.update({"lr": lr, "tokens_per_s": self.steps * cfg.batch_size * cfg.seq_len / elapsed})
        if reports_ppl:
            out["train/ppl"] = math.exp(min(means["loss"], 50.0))
        return means["loss"], out


def _train_step(objective: Objective, optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                batch: torch.Tensor, lr: float, cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for group in optimizer.param_groups:
        group["lr"] = lr
    objective.module.train()
    with autocast_for(batch.device, cfg.autocast):
        loss, metrics = objective.loss(batch)
    loss.backward()
    if cfg.grad_clip > 0:
        metrics = {**metrics, "grad_norm": torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, metrics


def fit(objective: Objective, data: PackedData, cfg: TrainConfig, logger: Any = None) -> FitResult:
    """Train `objective.module` for `cfg.steps` steps (resuming if asked), logging to `logger.log`."""
    device = cfg.resolve_device()
    module = objective.module
    optimizer = build_optimizer(module, cfg, device)
    ckpt_dir = cfg.resolve_checkpoint_dir()
    start, resumed_from = 0, None
    if cfg.resume and checkpoints(ckpt_dir):
        start = resumed_from = load_checkpoint(checkpoints(ckpt_dir)[-1], module, optimizer, cfg)
    val_batches = data.val_batches(cfg.batch_size, cfg.eval_batches)
    history: list[dict[str, Any]] = []

    def log(metrics: dict[str, Any], step: int) -> None:
        history.append({"step": step, **metrics})
        if logger is not None:
            logger.log(metrics, step=step)

    t_start, window, last_train = time.perf_counter(), _Window(), None
    params = [p for p in module.parameters() if p.requires_grad]
    bar = tqdm(total=cfg.steps, initial=start, desc="train", disable=not cfg.progress, dynamic_ncols=True)
    for step in range(start, cfg.steps):
        lr = lr_at(step, cfg)
        batch = data.train_batch(step, cfg.batch_size, cfg.seed).to(device, non_blocking=True)
        window.add(*_train_step(objective, optimizer, params, batch, lr, cfg))
        done = step + 1
        logged = done % cfg.log_every == 0 or done == cfg.steps
        if logged:
            last_train, out = window.report(lr, cfg, objective.reports_ppl)
            log(out, done)
            bar.set_postfix(loss=f"{last_train:.3f}")
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps and val_batches:
            log({f"val/{k}": v for k, v in evaluate(objective, val_batches, device, cfg).items()}, done)
        if cfg.save_every and done % cfg.save_every == 0:
            save_checkpoint(ckpt_dir, done, module, optimizer, cfg)
        if logged:
            window = _Window()  # after eval and save, so tokens_per_s measures training alone
        bar.update(1)
    bar.close()
    final_step = max(start, cfg.steps)
    if not checkpoints(ckpt_dir) or checkpoints(ckpt_dir)[-1].name != f"step_{final_step:08d}.pt":
        save_checkpoint(ckpt_dir, final_step, module, optimizer, cfg)  # a later run can extend this one
    val = evaluate(objective, val_batches, device, cfg) if val_batches else {}
    if val:
        log({f"val/{k}": v for k, v in val.items()}, final_step)
    return FitResult(step=final_step, train_loss=last_train, val=val, resumed_from=resumed_from,
                     wall_s=time.perf_counter() - t_start,
                     tokens_seen=(final_step - start) * cfg.batch_size * cfg.seq_len, history=history)
