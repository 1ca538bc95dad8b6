"""Expert-load traces of a MoE checkpoint serving built-in workloads, one after another in one engine, and the
traces shipped in research_lm/assets/moe_traces (experiments/moe_routing_skew.py records them).

    trace = record_trace("outputs/moe/qwen3_moe", [WorkloadSpec(kind="code"), WorkloadSpec(kind="prose")],
                         "switch.npz")
    trace.meta["segments"]   # [{"kind": "code", "start": 0, "stop": 212}, {"kind": "prose", "start": 212, ...}]
    load_trace(shipped_trace("qwen3_moe", "switch")).load   # [steps, 4 layers, 16 experts]

The checkpoint is loaded by the normal loader (`LLM(path, eplb_config={"record_trace": path})`, policy none:
identity placement, no rebalancing), so the trace is what `eplb.record_trace` writes for any run
(research_lm.eplb.trace format); its meta gains the workloads and the step range each one filled.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from research_lm.assets import ASSETS
from research_lm.eplb.trace import ExpertTrace, load_trace
from research_lm.harness.workloads import WorkloadSpec, build_workload

SHIPPED_TRACES = ASSETS / "moe_traces"
TRACE_KINDS = ("code", "prose", "switch")  # switch: the code trace, then the prose one (meta["segments"])


def shipped_trace(variant: str = "qwen3_moe", kind: str = "switch") -> Path:
    """The committed trace of a trained MoE variant (a directory under assets/moe_traces) on a workload kind."""
    variants = sorted(p.name for p in SHIPPED_TRACES.iterdir() if p.is_dir()) if SHIPPED_TRACES.is_dir() else []
    if variant not in variants:
        raise ValueError(f"no shipped MoE trace variant {variant!r}; choose one of {variants}")
    if kind not in TRACE_KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; choose one of {list(TRACE_KINDS)}")
    return SHIPPED_TRACES / variant / f"{kind}.npz"


def record_trace(model: str | os.PathLike, workloads: Sequence[WorkloadSpec], path: str | os.PathLike, *,
                 meta: dict[str, Any] | None = None, **engine: Any) -> ExpertTrace:
    """Serve each workload in turn on one engine (`engine`: more LLM knobs, e.g. device, max_num_seqs) and
    write the per-step expert load to `path`; returns the trace as written."""
    from research_lm import LLM

    if not workloads:
        raise ValueError("record_trace needs at least one workload")
    llm = LLM(os.fspath(model), eplb_config={"record_trace": os.fspath(path)}, **engine)
    controller = llm.engine.eplb
    if controller is None:
        raise ValueError(f"{os.fspath(model)!r} has no MoE layer: there is no expert load to record")
    segments = []
    for spec in workloads:
        work = build_workload(spec, llm.engine.info.vocab_size)
        start = controller.num_steps
        llm.generate(work.prompts, work.params, use_tqdm=False)
        segments.append({"kind": spec.kind, "start": start, "stop": controller.num_steps,
                         "workload": {**asdict(spec), "fingerprint": work.fingerprint()}})
    controller.meta.update({**(meta or {}), "segments": segments})
    controller.save_trace()
    return load_trace(path)
