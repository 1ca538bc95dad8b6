"""Routing traces: per-step, per-layer logical-expert loads, saved to a file for offline replay.

File format (`.npz`, read with numpy's `allow_pickle=False`: data, never code):
    format  0-d str   "research_lm.eplb.trace/v1"
    load    [num_steps, num_layers, num_logical] integer or float: tokens routed to each logical
            expert of each MoE layer at each step (a token routed to k experts counts k times)
    meta    0-d str   JSON object, free-form; known keys: model, top_k, num_groups, source, seed
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch

TRACE_FORMAT = "research_lm.eplb.trace/v1"


@dataclass
class ExpertTrace:
    load: torch.Tensor  # [num_steps, num_layers, num_logical]
    meta: dict = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return self.load.shape[0]


def save_trace(path: str | os.PathLike, load: torch.Tensor | np.ndarray, meta: dict | None = None) -> None:
    load = np.asarray(load.cpu() if isinstance(load, torch.Tensor) else load)
    if load.ndim != 3:
        raise ValueError(f"trace load must be [num_steps, num_layers, num_logical], got shape {load.shape}")
    with open(path, "wb") as f:  # an open file keeps numpy from appending ".npz" to the name
        np.savez_compressed(f, format=np.array(TRACE_FORMAT), load=load,
                            meta=np.array(json.dumps(meta or {}, sort_keys=True)))


def load_trace(path: str | os.PathLike) -> ExpertTrace:
    with np.load(path, allow_pickle=False) as data:
        fmt = str(data["format"]) if "format" in data else None
        if fmt != TRACE_FORMAT:
            raise ValueError(f"{os.fspath(path)!r} is not an expert-load trace (format {fmt!r}, "
                             f"expected {TRACE_FORMAT!r})")
        load = torch.from_numpy(data["load"])
        meta = json.loads(str(data["meta"])) if "meta" in data else {}
    if load.dim() != 3:
        raise ValueError(f"trace load must be 3-D [num_steps, num_layers, num_logical], got {tuple(load.shape)}")
    return ExpertTrace(load=load, meta=meta)


class TraceRecorder:
    """Collects per-step logical-expert loads (copied to the CPU) and writes a trace file."""

    def __init__(self, num_layers: int, num_logical: int) -> None:
        self.shape = (num_layers, num_logical)
        self.steps: list[torch.Tensor] = []

    def record(self, step_load: torch.Tensor) -> None:
        """step_load: [num_layers, num_logical] tokens routed to each logical expert this step."""
        if tuple(step_load.shape) != self.shape:
            raise ValueError(f"step_load must have shape {self.shape}, got {tuple(step_load.shape)}")
        self.steps.append(step_load.detach().to("cpu", copy=True))

    def trace(self, meta: dict | None = None) -> ExpertTrace:
        load = torch.stack(self.steps) if self.steps else torch.zeros(0, *self.shape, dtype=torch.int64)
        return ExpertTrace(load=load, meta=dict(meta or {}))

    def save(self, path: str | os.PathLike, meta: dict | None = None) -> None:
        save_trace(path, self.trace().load, meta)
