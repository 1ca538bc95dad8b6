"""Engine metrics: per-step series and a run summary (throughput, TTFT/TPOT percentiles, KV usage)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from research_lm.api.outputs import RequestOutput, RunnerOutput, SchedulerOutput


def percentiles(values: list[float], prefix: str, qs=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    out = {f"{prefix}_mean": float(arr.mean())}
    out.update({f"{prefix}_p{q}": float(np.percentile(arr, q)) for q in qs})
    return out


@dataclass
class EngineMetrics:
    steps: list[dict[str, Any]] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)
    start_time: float = field(default_factory=time.perf_counter)
    num_prompt_tokens_computed: int = 0
    num_output_tokens: int = 0
    num_failed_steps: int = 0  # steps that raised: their requests were rolled back (`LLMEngine._recover`)

    def reset(self) -> None:
        self.steps.clear()
        self.finished.clear()
        self.start_time = time.perf_counter()
        self.num_prompt_tokens_computed = self.num_output_tokens = self.num_failed_steps = 0

    def record_step(self, sched: SchedulerOutput, out: RunnerOutput, stats: Any, seconds: float) -> None:
        emitted = sum(len(t) for t in out.sampled_token_ids)
        self.num_output_tokens += emitted
        self.num_prompt_tokens_computed += sched.num_scheduled_tokens - emitted
        drafts = sum(out.num_draft_tokens or [])
        phases = {"verify_ms": out.verify_ms, "draft_ms": out.draft_ms}  # speculative runs only
        self.steps.append({
            "step": len(self.steps),
            "step_time_s": seconds,
            "num_scheduled_tokens": sched.num_scheduled_tokens,
            "num_reqs": len(sched.scheduled),
            "num_output_tokens": emitted,
            "num_draft_tokens": drafts,
            **{k: v for k, v in phases.items() if v is not None},
            **vars(stats),
        })

    def record_finished(self, outputs: list[RequestOutput]) -> None:
        self.finished.extend(outputs)

    def summary(self) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.start_time, 1e-9)
        ok = [o for o in self.finished if o.error is None]
        prompt_tokens = sum(o.metrics.num_prompt_tokens for o in ok)
        output_tokens = sum(o.metrics.num_output_tokens for o in ok)
        ttft = [o.metrics.time_to_first_token for o in ok if o.metrics.time_to_first_token is not None]
        tpot = [o.metrics.time_per_output_token for o in ok if o.metrics.time_per_output_token is not None]
        kv = [s.get("kv_cache_usage", 0.0) for s in self.steps]
        out: dict[str, Any] = {
            "num_requests": len(self.finished),
            "num_failed_requests": len(self.finished) - len(ok),
            "num_failed_steps": self.num_failed_steps,
            "num_steps": len(self.steps),
            "elapsed_s": elapsed,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "prompt_throughput_tok_s": prompt_tokens / elapsed,
            "output_throughput_tok_s": output_tokens / elapsed,
            "kv_cache_usage_mean": float(np.mean(kv)) if kv else 0.0,
            "kv_cache_usage_max": float(np.max(kv)) if kv else 0.0,
            "num_preemptions": sum(o.metrics.num_preemptions for o in self.finished),
            "num_cached_prompt_tokens": sum(o.metrics.num_cached_tokens for o in ok),
        }
        out.update(percentiles([t * 1e3 for t in ttft], "ttft_ms"))
        out.update(percentiles([t * 1e3 for t in tpot], "tpot_ms"))
        drafts = sum(o.metrics.num_draft_tokens for o in ok)
        if drafts:
            accepted = sum(o.metrics.num_accepted_tokens for o in ok)
            out["draft_acceptance_rate"] = accepted / drafts
        disabled = sum(1 for s in self.steps if s.get("spec_disabled"))
        if drafts or disabled:  # steps whose batch was over disable_by_batch_size: no drafts verified
            out["num_spec_disabled_steps"] = disabled
        out.update(spec_phase_stats(self.steps))
        return out


def spec_phase_stats(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Draft vs verify time over the steps that verified drafts (each also drafted for the next step):
    median ms per step of each phase, and draft_fraction = total draft / (total draft + total verify).
    Drafts left on the device (graph drafting) make draft the proposer's host time; the wait for them is in the
    next step's verify. Empty for a run without drafts."""
    spec = [(s["draft_ms"], s["verify_ms"]) for s in steps if "verify_ms" in s and "draft_ms" in s]
    if not spec:
        return {}
    draft, verify = np.asarray(spec, dtype=np.float64).T
    return {"draft_ms_per_step_median": float(np.median(draft)), "verify_ms_per_step_median": float(np.median(verify)),
            "draft_fraction": float(draft.sum() / max(draft.sum() + verify.sum(), 1e-12)),
            "num_verify_steps": len(spec)}
