"""`python -m research_lm.harness.report <run or multirun dir>`: every job's results.json -> report.md + PNG plots.

    python -m research_lm -m experiment=quickstart runner.max_num_seqs=1,4 workload.max_tokens=16,32
    python -m research_lm.harness.report multirun/<date>/<time>

Collects the results.json of the directory itself, or of every job below it (a directory holding a
results.json is one job; its subdirectories are not searched). The swept keys are the command-line
overrides whose values differ between jobs (from each job's .hydra/overrides.yaml, else the config
values that differ). Writes, next to the runs:
- report.md: what was run (commit, device, command), a markdown table with a row per job: the swept
  keys and the key metrics of its task (throughput, latency, KV memory, acceptance, speedup, ...);
  for `eplb_replay` jobs a row per trace x policy; when the jobs ran on more than one machine (a SLURM
  sweep: each job's env.json `hostname`), a line naming the hosts and a `host` column;
- report_<metric>_vs_<key>.png: each key metric against each numeric swept key, one line per
  combination of the other swept keys (e.g. throughput vs batch per attention backend; tau and
  speedup vs k per proposer); report_<metric>.png: a bar per job when no swept key is numeric;
- report_eplb_<job>.png: balancedness over time per policy, for `eplb_replay` jobs;
- report.json: the same numbers, machine-readable.
Repeats: jobs that differ only in the repeat key (`--repeat-key`, default `repeat`: sweep it with
`+repeat=0,1,2`; `seed` for a seed sweep) are repeats of one cell, and the cell's row shows each metric's
median over them, with the spread (min–max) in parentheses where the repeats differ; report.json keeps
every repeat's value. Plots show the medians, with min–max error bars.
Plots need matplotlib (Agg backend, no display); without it the report says so and writes the table.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

# Key metrics per task, in column order; a column appears when some job has it.
GENERATE_METRICS = (
    "output_throughput_tok_s", "ttft_ms_p50", "tpot_ms_mean", "decode_step_ms_median", "kv_bytes_per_token",
    "kv_bytes_used_max", "state_bytes_per_request", "num_preemptions", "mean_acceptance_length", "emitted_per_forward",
    "leviathan_tau", "draft_acceptance_rate", "draft_ms_per_step_median", "verify_ms_per_step_median",
    "draft_fraction", "speedup", "tpot_ratio", "decode_step_ratio", "kv_bytes_per_token_ratio", "kv_bytes_used_ratio",
    "outputs_match_baseline", "offered_request_rate",
)
# Plotted against numeric swept keys (when present).
PLOT_METRICS = ("output_throughput_tok_s", "tpot_ms_mean", "mean_acceptance_length", "speedup")
EPLB_COLUMNS = ("balancedness_total", "balancedness_mean", "balancedness_min", "num_rebalances",
                "rebalance_ms_median", "moved_slots_total")
_IGNORED_OVERRIDES = {"hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "logger", "sweep_name"}
REPEAT_KEY = "repeat"  # `+repeat=0,1,2`: jobs that differ only in it are repeats of one measurement


def describe_head(head: dict[str, Any] | None) -> str:
    """One line on the head that drafted (results.json's `spec_head`, research_lm.harness.spec_notes.head_record): which
    one, where it came from and its training steps; "" for a run without one."""
    if not head:
        return ""
    model, steps = head.get("model"), head.get("train_steps")
    trained = f"{steps} training steps" if steps is not None else "training steps unknown"
    if head.get("source") == "trained":
        return f"trained on the fly, {steps} steps ({model})"
    if head.get("source") == "reused":
        return f"{model} (reused, {trained})"
    if head.get("source") == "shipped":
        return f"{model} (shipped, {trained})"
    return f"{model} (given, {trained})"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def aggregate_records(repeats: Sequence[Sequence[dict[str, Any]]], key: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of several repeats of one measurement as one row each: rows are matched across repeats by
    their `key` fields (first-seen order); a numeric field becomes its median over the repeats that have
    it, with `spread[field] = [min, max]` and the raw values in `repeats[field]`; a dict of numbers (e.g.
    per-stage times) is aggregated entry by entry (`spread["field.entry"]`); other fields are the first
    repeat's. A repeat whose row has an `error` counts as failed: `errors` lists those, `num_repeats`
    counts the others (a row that failed in every repeat keeps its first `error`)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for rows in repeats:
        for row in rows:
            k = tuple(json.dumps(row.get(f), sort_keys=True, default=str) for f in key)
            groups.setdefault(k, []).append(row)
    return [_aggregate_rows(rows) for rows in groups.values()]


def _aggregate_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    failed = [r["error"] for r in rows if "error" in r]
    if not ok:
        return {**rows[0], "num_repeats": 0, "errors": failed}
    out: dict[str, Any] = {}
    spread: dict[str, list[float]] = {}
    raw: dict[str, list[Any]] = {}
    for field in dict.fromkeys(f for r in ok for f in r):
        values = [r[field] for r in ok if field in r]
        if all(_is_number(v) for v in values):
            out[field] = statistics.median(values)
            raw[field] = values
            if len(values) > 1:
                spread[field] = [min(values), max(values)]
        elif all(isinstance(v, dict) and v and all(_is_number(x) for x in v.values()) for v in values):
            sub = _aggregate_rows(values)
            out[field] = {k: v for k, v in sub.items() if k not in ("spread", "repeats", "num_repeats")}
            spread |= {f"{field}.{k}": v for k, v in sub["spread"].items()}
        else:
            out[field] = values[0]
    out |= {"num_repeats": len(ok), "spread": spread, "repeats": raw}
    if failed:
        out["errors"] = failed
    return out


def fmt_spread(value: Any, spread: Sequence[float] | None, spec: str | None = None) -> str:
    """`value` as `fmt` (or `format(value, spec)`) and, when the repeats' min and max differ at that
    precision, ` (min–max)` after it."""
    show = (lambda v: format(v, spec)) if spec else fmt
    if value is None:
        return "—"
    text = show(value)
    if spread is not None and _is_number(value):
        lo, hi = show(spread[0]), show(spread[1])
        if lo != hi:
            text += f" ({lo}–{hi})"
    return text


class Job:
    def __init__(self, path: Path):
        self.path = path
        self.results: dict[str, Any] = json.loads((path / "results.json").read_text())
        self.summary: dict[str, Any] = self.results.get("summary") or {}
        self.config: dict[str, Any] = self.results.get("config") or {}
        self.task: str = self.config.get("task", "generate")
        self.overrides = _overrides(path, self.results)
        self.name = path.name
        self.label = ""
        self.spread: dict[str, list[float]] = {}  # metric -> [min, max] over repeats (a Cell's)
        self.baseline_spread: dict[str, list[float]] = {}

    def value(self, key: str) -> Any:
        if key in self.overrides:
            return self.overrides[key]
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


class Cell(Job):
    """The repeats of one combination of swept values (jobs that differ only in the repeat key), read as one
    job: its summary (and its baseline's) holds each metric's median over the repeats, `spread` the
    [min, max]; EPLB rows are aggregated per trace x policy and curves are the per-step medians."""

    def __init__(self, jobs: list[Job], repeat_key: str):
        first = jobs[0]
        self.jobs, self.path, self.task, self.config = jobs, first.path, first.task, first.config
        self.overrides = {k: v for k, v in first.overrides.items() if k != repeat_key}
        self.name = ",".join(j.name for j in jobs)
        self.label = ""
        summary = aggregate_records([[j.summary] for j in jobs], ())[0]
        self.spread = summary.pop("spread")
        self.raw = summary.pop("repeats")
        summary.pop("num_repeats")
        self.summary = summary
        self.results = {**first.results, "summary": summary}
        self.baseline_spread = {}
        bases = [j.results["baseline"] for j in jobs if j.results.get("baseline")]
        if bases:
            base = aggregate_records([[b["summary"]] for b in bases], ())[0]
            self.baseline_spread, raw = base.pop("spread"), base.pop("repeats")
            base.pop("num_repeats")
            self.results["baseline"] = {**bases[0], "summary": base, "repeats": raw}
        if any(j.results.get("rows") for j in jobs):
            self.results["rows"] = aggregate_records([j.results.get("rows") or [] for j in jobs], ("trace", "policy"))
        if any(j.results.get("curves") for j in jobs):
            self.results["curves"] = _median_curves([j.results["curves"] for j in jobs if j.results.get("curves")])

    def record(self) -> dict[str, Any]:
        """What report.json keeps of the cell: medians, spreads and every repeat's value."""
        base = self.results.get("baseline")
        return {"jobs": [str(j.path) for j in self.jobs], "num_repeats": len(self.jobs),
                "overrides": self.overrides, "summary": self.summary, "spread": self.spread, "repeats": self.raw,
                "baseline": None if not base else {"summary": base["summary"], "spread": self.baseline_spread,
                                                   "repeats": base.get("repeats")},
                "rows": self.results.get("rows"), "curves": self.results.get("curves"),
                "spec_head": self.results.get("spec_head"), "notes": _notes(self), "hosts": job_hosts(self)}


def _notes(job: Job) -> list[str]:
    """The notes of a job's run, or of each repeat of a cell that has any (once each)."""
    runs = job.jobs if isinstance(job, Cell) else [job]
    return list(dict.fromkeys(n for j in runs for n in j.results.get("notes") or []))


def _median_curves(runs: list[dict[str, dict[str, list[float]]]]) -> dict[str, dict[str, list[float]]]:
    """Per trace and policy, the per-step median over repeats (of the steps every repeat has)."""
    out: dict[str, dict[str, list[float]]] = {}
    for trace, per_policy in runs[0].items():
        out[trace] = {}
        for policy in per_policy:
            series = [r[trace][policy] for r in runs if policy in r.get(trace, {})]
            out[trace][policy] = [statistics.median(v) for v in zip(*series)]
    return out


def group_repeats(jobs: list[Job], keys: list[str], repeat_key: str = REPEAT_KEY) -> tuple[list[Job], list[str]]:
    """(cells, their keys): with `repeat_key` among the swept keys, one Cell per combination of the other
    keys (in first-seen order); otherwise the jobs and keys as they are."""
    if repeat_key not in keys:
        return jobs, keys
    cell_keys = [k for k in keys if k != repeat_key]
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        groups.setdefault(json.dumps([job.value(k) for k in cell_keys], sort_keys=True, default=str), []).append(job)
    return [Cell(group, repeat_key) for group in groups.values()], cell_keys


def _overrides(path: Path, results: dict[str, Any]) -> dict[str, Any]:
    file = path / ".hydra" / "overrides.yaml"
    items = yaml.safe_load(file.read_text()) if file.is_file() else (
        (results.get("reproducibility") or {}).get("overrides"))
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = str(item).lstrip("+~").partition("=")
        if not sep or key in _IGNORED_OVERRIDES or key.startswith("hydra"):
            continue
        try:
            out[key] = yaml.safe_load(value) if value else value
        except yaml.YAMLError:
            out[key] = value
    return out


def collect(root: Path) -> list[Job]:
    """The jobs at or below root, in natural order of their paths (0, 1, ..., 10)."""
    root = Path(root)
    if (root / "results.json").is_file():
        return [Job(root)]
    jobs: list[Job] = []
    for sub in sorted((p for p in root.iterdir() if p.is_dir()), key=_natural):
        jobs += collect(sub) if not sub.name.startswith(".") else []
    return jobs


def job_hosts(job: Job) -> list[str]:
    """The machines a job (or each repeat of a Cell) ran on, from env `hostname`; [] for runs recorded without it."""
    runs = job.jobs if isinstance(job, Cell) else [job]
    return list(dict.fromkeys(h for j in runs if (h := (j.results.get("env") or {}).get("hostname"))))


def sweep_hosts(jobs: list[Job]) -> list[str]:
    """Every machine the jobs ran on, in first-seen order."""
    return list(dict.fromkeys(h for j in jobs for h in job_hosts(j)))


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def swept_keys(jobs: list[Job]) -> list[str]:
    """Override keys whose values differ between jobs (in first-seen order); with one job, its overrides."""
    keys: list[str] = []
    for job in jobs:
        keys += [k for k in job.overrides if k not in keys]
    if len(jobs) == 1:
        return keys
    return [k for k in keys if len({json.dumps(j.value(k), sort_keys=True, default=str) for j in jobs}) > 1]


def fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return lines


def metric_columns(jobs: list[Job]) -> list[str]:
    tasks = {j.task for j in jobs}
    if tasks <= {"generate"}:  # the key metrics some job has with a value other than 0
        cols = [m for m in GENERATE_METRICS if any(j.summary.get(m) not in (None, 0) for j in jobs)]
        positions = sorted({k for j in jobs for k in j.summary if k.startswith("acceptance_rate_pos")},
                           key=lambda k: int(k.removeprefix("acceptance_rate_pos")))
        return cols + positions
    cols: list[str] = []  # other tasks: their numeric summary keys
    for j in jobs:
        cols += [k for k, v in j.summary.items() if isinstance(v, int | float) and not isinstance(v, bool)
                 and k not in cols]
    return cols[:12]


def build_report(root: Path, plots: bool = True, repeat_key: str = REPEAT_KEY) -> Path:
    """Write report.md, report.json (and the plots) into root; return report.md's path."""
    root = Path(root)
    jobs = collect(root)
    if not jobs:
        raise ValueError(f"no results.json under {root}")
    all_keys = swept_keys(jobs)
    cells, keys = group_repeats(jobs, all_keys, repeat_key)
    repeated = cells is not jobs
    for i, cell in enumerate(cells):
        cell.label = ", ".join(f"{k}={fmt(cell.value(k))}" for k in keys) or cell.name or f"job {i}"
    env = jobs[0].results.get("env") or {}
    git = env.get("git") or {}
    lines = [f"# Report: {root}", ""]
    lines.append(f"{len(jobs)} job(s); task(s): {', '.join(sorted({j.task for j in jobs}))}; "
                 f"{'swept' if len(jobs) > 1 else 'overrides'}: {', '.join(f'`{k}`' for k in all_keys) or 'none'}.")
    if repeated:
        counts = sorted({len(c.jobs) for c in cells})
        lines.append(f"Repeats: {len(cells)} cell(s) x {'/'.join(map(str, counts))} repeat(s) (`{repeat_key}`); each "
                     "value is the median over a cell's repeats, with the spread (min–max) in parentheses where "
                     "the repeats differ at the shown precision; report.json keeps every repeat's value.")
    if env:
        lines.append(f"Device: {env.get('device_name') or env.get('device')} ({env.get('device')}); "
                     f"torch {(env.get('packages') or {}).get('torch')}; commit {git.get('commit')}"
                     f"{' (dirty)' if git.get('dirty') else ''}; {env.get('date')}.")
        lines.append(f"Command: `{env.get('command')}`.")
    hosts = sweep_hosts(jobs)
    if len(hosts) > 1:  # jobs on several machines (a SLURM sweep): which ran where is the table's `host` column
        lines.append(f"Hosts: {len(hosts)} machines: {', '.join(hosts)}.")
    lines.append("")
    plain = [c for c in cells if c.task != "eplb_replay"]
    if plain:
        cols = metric_columns(plain)
        # which head drafted, and how long it was trained: a quick head's acceptance is no trained head's
        heads = ["head"] if any(c.results.get("spec_head") for c in plain) else []
        host = ["host"] if len(hosts) > 1 else []
        rows = []
        for c in plain:
            rows.append([c.name, *[c.value(k) for k in keys], *[describe_head(c.results.get("spec_head")) or "—"
                                                                for _ in heads],
                         *[", ".join(job_hosts(c)) or "—" for _ in host],
                         *[fmt_spread(c.summary.get(c_), c.spread.get(c_)) for c_ in cols]])
            base = c.results.get("baseline")
            if base:  # the same workload on the baseline config, measured in the same process
                what = ", ".join(f"{k}={fmt(v)}" for k, v in (base.get("overrides") or {}).items())
                rows.append([f"{c.name} baseline ({what})", *["" for _ in keys], *["" for _ in heads],
                             *["" for _ in host],
                             *[fmt_spread(base["summary"].get(m), c.baseline_spread.get(m)) for m in cols]])
        lines += _table(["job" if not repeated else "jobs", *[f"`{k}`" for k in keys], *heads, *host, *cols], rows)
        lines.append("")
        notes = [(c, n) for c in plain for n in _notes(c)]
        if notes:  # what the run found questionable in its own numbers (spec_notes.speculation_note, ...)
            lines += ["Notes:", ""] + [f"- {c.name}{f' ({c.label})' if c.label != c.name else ''}: {n}"
                                       for c, n in notes] + [""]
    for cell in (c for c in cells if c.task == "eplb_replay"):
        where = f" (host {', '.join(job_hosts(cell))})" if len(hosts) > 1 else ""
        lines.append(f"## EPLB replay: {cell.label}{where}" if len(cells) > 1 else "## EPLB replay")
        lines.append("")
        eplb_rows = cell.results.get("rows", [])
        cols = [c for c in EPLB_COLUMNS if any(c in r for r in eplb_rows)]
        rows = [[r.get("trace"), r.get("policy"), *[fmt_spread(r.get(c), (r.get("spread") or {}).get(c)) for c in cols]]
                for r in eplb_rows]
        lines += _table(["trace", "policy", *cols], rows)
        lines.append("")
    written: list[Path] = []
    if plots:
        try:
            written = make_plots(root, cells, keys)
        except ImportError:
            lines.append("(matplotlib is not installed: no plots; `pip install matplotlib`)")
    if written:
        lines.append("Plots:")
        lines.append("")
        lines += [f"![{p.stem}]({p.name})" for p in written]
        lines.append("")
    if plain and plain[0].task == "generate":
        lines.append("Columns: throughput in tokens/s; ttft/tpot/decode_step in ms; kv_bytes_per_token = KV cache "
                     "bytes per token of context (all layers); kv_bytes_used_max = KV bytes in use at the busiest "
                     "step; "
                     "mean_acceptance_length = tokens per target forward of a request that verified drafts (tau, "
                     "vLLM's); emitted_per_forward = tokens per target forward of a request over every step it "
                     "emitted in, drafts or not (what a proposer that skips steps buys); leviathan_tau = the tau that "
                     "position-independent acceptance at the measured per-draft rate would give, "
                     "(1 - a^(k+1)) / (1 - a); draft_/verify_ms_per_step_median = "
                     "median ms of the proposer / of the target forward + rejection sampling over steps that verified "
                     "drafts (under CUDA graphs the proposer's host work: the drafts' GPU time overlaps the next "
                     "step's host work, and what remains of it counts in verify), draft_fraction = draft / "
                     "(draft + verify) time over them; speedup and *_ratio = this "
                     "run / its baseline in the same process; outputs_match_baseline = fraction of requests with "
                     "identical tokens; head = the drafting head, where it came from (shipped with research_lm, "
                     "given, trained on the fly by the run, or reused from an earlier one) and its training steps.")
    out = root / "report.md"
    out.write_text("\n".join(lines) + "\n")
    data = {"root": str(root), "env": env, "hosts": hosts, "swept": all_keys,
            "repeat_key": repeat_key if repeated else None,
            "keys": keys, "plots": [p.name for p in written],
            "cells": [c.record() if isinstance(c, Cell) else
                      {"jobs": [str(c.path)], "num_repeats": 1, "overrides": c.overrides, "summary": c.summary,
                       "baseline": c.results.get("baseline"), "rows": c.results.get("rows"),
                       "curves": c.results.get("curves"), "spec_head": c.results.get("spec_head"),
                       "notes": _notes(c), "hosts": job_hosts(c)} for c in cells]}
    (root / "report.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("_")


def make_plots(root: Path, jobs: list[Job], keys: list[str]) -> list[Path]:
    written: list[Path] = []
    for job in jobs:
        if job.task == "eplb_replay" and job.results.get("curves"):
            name = "report_eplb.png" if len(jobs) == 1 else f"report_eplb_{_slug(job.name)}.png"
            plot_balancedness(job.results["curves"], root / name, subtitle=job.label)
            written.append(root / name)
    plain = [j for j in jobs if j.task != "eplb_replay"]
    if not plain:
        return written
    metrics = [m for m in PLOT_METRICS if any(_is_number(j.summary.get(m)) for j in plain)]
    if plain[0].task != "generate":
        metrics = metric_columns(plain)[:2]
    numeric = [k for k in keys if all(_is_number(j.value(k)) for j in plain) and len({j.value(k) for j in plain}) > 1]
    plt = _plt()
    for x in numeric:
        others = [k for k in keys if k != x]
        for metric in metrics:
            series: dict[str, list[tuple[float, float, float, float]]] = {}
            for j in plain:
                if _is_number(j.summary.get(metric)):
                    label = ", ".join(f"{k}={fmt(j.value(k))}" for k in others) or metric
                    y = j.summary[metric]
                    lo, hi = j.spread.get(metric, (y, y))
                    series.setdefault(label, []).append((j.value(x), y, lo, hi))
            if not series:
                continue
            fig, ax = plt.subplots(figsize=(6.4, 4))
            for label, pts in series.items():
                pts.sort()
                ys = [p[1] for p in pts]
                err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
                ax.errorbar([p[0] for p in pts], ys, yerr=err if any(map(any, err)) else None, marker="o",
                            capsize=3, label=label)
            if all(isinstance(j.value(x), int) for j in plain):
                from matplotlib.ticker import MaxNLocator

                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel(x)
            ax.set_ylabel(metric)
            ax.set_title(f"{metric} vs {x}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = root / f"report_{_slug(metric)}_vs_{_slug(x)}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    if not numeric:
        for metric in metrics:
            vals = [(j.label, j.summary.get(metric)) for j in plain if _is_number(j.summary.get(metric))]
            base = [(f"{j.label} (baseline)", (j.results.get("baseline") or {}).get("summary", {}).get(metric))
                    for j in plain]
            vals += [(label, v) for label, v in base if _is_number(v)]
            if not vals:
                continue
            fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(vals) + 2), 4))
            ax.bar(range(len(vals)), [v for _, v in vals])
            ax.set_xticks(range(len(vals)), [label for label, _ in vals], rotation=20, ha="right", fontsize=7)
            ax.set_ylabel(metric)
            ax.set_title(metric, fontsize=10)
            fig.tight_layout()
            path = root / f"report_{_slug(metric)}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def plot_balancedness(curves: dict[str, dict[str, list[float]]], path: Path, subtitle: str = "") -> Path | None:
    """Balancedness (mean / max EP-rank load, Σ over layers) per step, one line per policy, one panel per
    trace. Returns the path, or None without matplotlib."""
    try:
        plt = _plt()
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, axes = plt.subplots(len(curves), 1, figsize=(8, 3.2 * len(curves)), squeeze=False)
    for ax, (trace, per_policy) in zip(axes[:, 0], curves.items()):
        for policy, values in per_policy.items():
            ax.plot(values, label=policy, linewidth=1)
        ax.set_title(f"{trace}" + (f" — {subtitle}" if subtitle else ""), fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("balancedness")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(ncol=3, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research_lm.harness.report", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a run directory or a multirun (sweep) directory")
    ap.add_argument("--no-plots", action="store_true", help="write only report.md (and report.json)")
    ap.add_argument("--repeat-key", default=REPEAT_KEY,
                    help="jobs differing only in this swept key are repeats of one cell: median (min–max) per "
                         "metric (default: repeat, swept with +repeat=0,1,2; seed for a seed sweep)")
    args = ap.parse_args(argv)
    try:
        out = build_report(args.dir, plots=not args.no_plots, repeat_key=args.repeat_key)
    except (ValueError, FileNotFoundError) as e:
        print(f"research_lm.harness.report: error: {e}", file=sys.stderr)
        return 2
    print(out.read_text())
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
