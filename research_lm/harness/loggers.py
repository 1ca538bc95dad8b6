"""Pluggable run loggers: `wandb` (offline unless the user chose a mode), `jsonl`, `none`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from attention_zoo.registries import Registry

LOGGERS: Registry[type[RunLogger]] = Registry("logger")
register_logger = LOGGERS.register


def get_logger(name: str, **kwargs: Any) -> RunLogger:
    return LOGGERS.get(name)(**kwargs)


class RunLogger:
    """start → log(step metrics)* → summary → finish. Subclasses override what they record."""

    def start(self, run_dir: Path, config: dict[str, Any], name: str | None, group: str | None) -> None:
        pass

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def summary(self, metrics: dict[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass


@register_logger("none")
class NoLogger(RunLogger):
    pass


@register_logger("jsonl")
class JsonlLogger(RunLogger):
    """One JSON object per line in `<run_dir>/metrics.jsonl`; the summary as `{"summary": {...}}`."""

    def __init__(self, **_: Any):
        self.file = None

    def start(self, run_dir, config, name, group):
        # line-buffered, so a long run can be followed with tail -f
        self.file = open(Path(run_dir) / "metrics.jsonl", "w", buffering=1)  # noqa: SIM115 (closed in finish)

    def log(self, metrics, step):
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")

    def summary(self, metrics):
        self.file.write(json.dumps({"summary": metrics}) + "\n")

    def finish(self):
        if self.file is not None:
            self.file.close()


@register_logger("wandb")
class WandbLogger(RunLogger):
    """W&B run per job; offline by default (`WANDB_MODE` unset), with the sync command printed."""

    def __init__(self, project: str = "research_lm", entity: str | None = None, mode: str | None = None, **_: Any):
        self.project, self.entity, self.mode = project, entity, mode
        self.run = None

    def start(self, run_dir, config, name, group):
        mode = self.mode or os.environ.get("WANDB_MODE") or "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb  # lazily: the GPU machine runs without it under logger=jsonl

        self.run = wandb.init(
            project=self.project, entity=self.entity, mode=mode, dir=str(run_dir), name=name,
            group=group, config=config, reinit="finish_previous",
        )

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def summary(self, metrics):
        for key, value in metrics.items():
            self.run.summary[key] = value

    def finish(self):
        if self.run is None:
            return
        run_dir = getattr(self.run, "dir", None)
        offline = self.run.settings.mode == "offline"
        self.run.finish()
        if offline and run_dir:
            print(f"wandb: offline run saved; upload with: wandb sync {Path(run_dir).parent}")
