"""EPLB ablation: every policy replayed at DeepSeek-V3 scale (synthetic traces) and on recorded traces, with vLLM's
metrics, the cost of each rebalance, and synchronous against chunked (async) weight moves.

    python experiments/bench_eplb_ablation.py                  # writes experiments/results/eplb_ablation.{md,json}
    python -m experiments.paper eplb_ablation                  # the same, as the paper table
    python -m experiments.paper eplb_ablation -- --trace-dir research_lm/assets/moe_traces   # + trained-MoE traces

Scale (synthetic): 58 MoE layers, 256 routed experts, top-8, 288 slots (32 redundant: 9 a rank, DeepSeek-V3's
prefill deployment), 32 EP ranks on 4 nodes of 8, 4096 tokens a step, 600 steps; a rebalance every 100 steps
from the last 100. The synthetic router is not group-limited, so every policy runs with one expert group (DeepSeek's
global policy: `deepseek` equals `lpt` here; eplb_policy.md has the hierarchical branch). Skew differs by layer:
Zipf alpha evenly spaced over [0.6, 1.4] (shuffled). Traces: `drift` (popularity random walk, 0.02 a step),
`mix` (two workloads, e.g. code and prose, in a proportion swinging with period 50 steps), `switch` (one workload
for 300 steps, then another). Recorded traces (`--trace NAME=PATH`, or every .npz under `--trace-dir`, e.g. the
trained MoEs' code / prose / switch traces in research_lm/assets/moe_traces; research_lm.eplb.trace files): EP
ranks max(2, E / 4) with as many redundant slots (5 slots a rank), one node per 8 ranks, a rebalance every
num_steps / 6 steps from as many.

Metrics (research_lm.eplb.metrics / replay): balancedness = mean / max tokens per EP rank, time-weighted over
the steps after the first rebalance (the warm-up on the identity placement is left out), over all layers
(`bal.`) and per layer (min / p50 / p90 / avg over layers); the simulated MoE step time (Σ_layers max rank
load x time per (token, expert) pair, plus the steps' stalls for weights); per rebalance: experts moved over
the interconnect, GB and the transfer time they imply; policy compute ms (median over --timing-runs runs on the
first window, per repeat); slots used per layer (distinct rank-expert pairs). Costs: DeepSeek-V3's expert
(3 x 7168 x 2048 weights) in fp8 (1 byte a weight: 44 MB), 600 TFLOP/s effective per rank (an assumption),
NVLink 450 GB/s and InfiniBand 50 GB/s per GPU (flags). The replays are deterministic and run once; the repeats
re-time the policies.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from bench_common import add_repeat_args, cell, environment, repeat, repeats_line, write_results
from bench_eplb_policy import cpu_model

from research_lm.eplb import available_policies, get_policy, load_trace, replay, zipf_trace
from research_lm.eplb.load import bucket_history
from research_lm.eplb.metrics import CostModel
from research_lm.eplb.registry import configured_policy, policy_traits
from research_lm.eplb.synthetic import mixture_trace

NAME = "eplb_ablation"
LAYERS, EXPERTS, SLOTS, RANKS, NODES, TOP_K, TOKENS = 58, 256, 288, 32, 4, 8, 4096
OURS = ("deepseek_vec", "lplb", "deepseek_vec+ll", "budgeted 100%")  # the new policies at equal slots
BUDGETS = (0.25, 0.5, 0.75, 0.9, 1.0)
CHUNKS = (None, 1, 2, 4, 8)  # None: sync
MATCH_TOLERANCE = 0.002  # "matches": balancedness within this of deepseek's


def variants() -> list[tuple[str, object, dict]]:
    """(row name, policy name or callable, replay keywords): every registered policy, static, and variants."""
    rows = [(name, name, {}) for name in available_policies() if name != "budgeted"]
    rows.append(("static", "deepseek", {"max_rebalances": 1}))
    rows.append(("deepseek_vec+ll", "deepseek_vec", {"dispatch": "least_loaded"}))
    rows += [(f"budgeted {b:.0%}", configured_policy("budgeted", slot_budget=b), {}) for b in BUDGETS]
    return rows


def synthetic_traces(steps: int, seed: int) -> dict[str, tuple[torch.Tensor, dict]]:
    gen = torch.Generator().manual_seed(seed)
    alpha = torch.linspace(0.6, 1.4, LAYERS, dtype=torch.float64)[torch.randperm(LAYERS, generator=gen)].tolist()
    common = dict(num_tokens=TOKENS, top_k=TOP_K, alpha=alpha)
    half = steps // 2
    setup = dict(num_replicas=SLOTS, num_groups=1, num_nodes=NODES, num_gpus=RANKS, step_interval=100,
                 window_size=100)
    return {
        "drift": (zipf_trace(steps, LAYERS, EXPERTS, drift=0.02, seed=seed, **common), setup),
        "mix": (mixture_trace(steps, LAYERS, EXPERTS, period=50, seed=seed, **common), setup),
        "switch": (torch.cat([zipf_trace(half, LAYERS, EXPERTS, drift=0.0, seed=seed + 1, **common),
                              zipf_trace(steps - half, LAYERS, EXPERTS, drift=0.0, seed=seed + 2, **common)]), setup),
    }


def recorded_traces(
    specs: list[str], trace_dir: Path | None, ranks: int | None
) -> dict[str, tuple[torch.Tensor, dict]]:
    """--trace NAME=PATH files and every .npz under --trace-dir (named by its path there, e.g. qwen3_moe/code),
    with the scaled-down setup of the module docstring."""
    paths = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--trace must be NAME=PATH, got {spec!r}")
        paths[name] = Path(path)
    if trace_dir is not None:
        if not trace_dir.is_dir():
            raise SystemExit(f"--trace-dir {trace_dir} is not a directory")
        paths |= {str(p.relative_to(trace_dir).with_suffix("")): p for p in sorted(trace_dir.rglob("*.npz"))}
    out = {}
    for name, path in paths.items():
        trace = load_trace(path)
        num_steps, _, num_experts = trace.load.shape
        num_gpus = ranks or max(2, num_experts // 4)
        interval = max(1, num_steps // 6)
        out[name] = (trace.load, dict(num_replicas=num_experts + num_gpus, num_groups=int(trace.meta.get(
            "num_groups") or 1), num_nodes=max(1, num_gpus // 8), num_gpus=num_gpus, step_interval=interval,
            window_size=interval))
    return out


def replay_rows(traces: dict, cost: CostModel) -> tuple[list[dict], list[dict]]:
    """Every variant on every trace, then the async table (sync vs chunked moves) on the first trace."""
    rows = []
    for trace_name, (load, setup) in traces.items():
        warmup = setup["step_interval"]
        for row_name, policy, kw in variants():
            t0 = time.perf_counter()
            result = replay(load, policy, **setup, cost=cost, **kw)
            rows.append({"trace": trace_name, "row": row_name, "step_interval": warmup,
                         **result.summary(from_step=warmup),
                         "replay_s": time.perf_counter() - t0, "rebalance_ms_all": result.rebalance_ms})
            print(f"{trace_name} / {row_name}: {rows[-1]['balancedness_total']:.4f}", flush=True)
    first, (load, setup) = next(iter(traces.items()))
    async_rows = []
    for row_name in ("deepseek", "lplb"):
        for chunk in CHUNKS:
            result = replay(load, row_name, **setup, cost=cost, layers_per_chunk=chunk)
            async_rows.append({"trace": first, "row": row_name, "layers_per_chunk": chunk or "sync",
                               **result.summary(from_step=setup["step_interval"])})
    return rows, async_rows


def timing_rows(traces: dict, runs: int) -> list[dict]:
    """Policy compute ms on each trace's first window, `runs` runs after one warm-up."""
    rows = []
    for trace_name, (load, setup) in traces.items():
        window = load[: setup["window_size"]].to(torch.float64)
        args = (setup["num_replicas"], setup["num_groups"], setup["num_nodes"], setup["num_gpus"])
        for row_name, policy, _ in variants():
            fn = get_policy(policy) if isinstance(policy, str) else policy
            buckets = policy_traits(fn).history_buckets
            weight = bucket_history(window, buckets) if buckets else window.sum(0)
            fn(weight, *args)
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                fn(weight, *args)
                times.append((time.perf_counter() - t0) * 1e3)
            rows.append({"trace": trace_name, "row": row_name, "policy_ms": statistics.median(times)})
    return rows


def goals(rows: list[dict]) -> list[str]:
    """The issue's goals, checked on the numbers of this run (one line each, per trace)."""
    lines = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        by = {r["row"]: r for r in rows if r["trace"] == trace}
        ds = by["deepseek"]
        best = max(OURS, key=lambda n: by[n]["balancedness_total"])
        gain = by[best]["balancedness_total"] - ds["balancedness_total"]
        verdict = "beats" if gain > 0 else "does not beat"
        lines.append(f"- **{trace}, equal slots:** the best of ours, `{best}` "
                     f"({by[best]['balancedness_total']:.4f}), {verdict} `deepseek` ({ds['balancedness_total']:.4f}) "
                     f"by {gain:+.4f}; simulated step {by[best]['step_ms']:.2f} vs {ds['step_ms']:.2f} ms.")
        matching = [b for b in BUDGETS if by[f"budgeted {b:.0%}"]["balancedness_total"]
                    >= ds["balancedness_total"] - MATCH_TOLERANCE]
        if matching:
            b = by[f"budgeted {matching[0]:.0%}"]
            lines.append(f"- **{trace}, fewer slots:** `budgeted` at {matching[0]:.0%} of the redundant slots "
                         f"matches `deepseek` within {MATCH_TOLERANCE} ({b['balancedness_total']:.4f}) with "
                         f"{b['slots_used']:.1f} slots used a layer against {ds['slots_used']:.1f} "
                         f"({b['slots_used'] - ds['slots_used']:+.1f}).")
        else:
            lines.append(f"- **{trace}, fewer slots:** no budget below 100% matches `deepseek` within "
                         f"{MATCH_TOLERANCE}.")
        worse = []
        for name in (*OURS, *(f"budgeted {b:.0%}" for b in BUDGETS[:-1])):
            r, notes = by[name], []
            if r["balancedness_total"] < ds["balancedness_total"]:
                notes.append(f"balancedness {r['balancedness_total'] - ds['balancedness_total']:+.4f}")
            if r["balancedness_layer_min"] < ds["balancedness_layer_min"]:
                notes.append(f"worst layer {r['balancedness_layer_min'] - ds['balancedness_layer_min']:+.4f}")
            if r["bytes_moved_per_rebalance"] > ds["bytes_moved_per_rebalance"] * 1.01:
                notes.append(f"moves {r['bytes_moved_per_rebalance'] / ds['bytes_moved_per_rebalance']:.2f}x the bytes")
            if r.get("policy_ms", 0) > 1.5 * ds.get("policy_ms", 0):
                notes.append(f"compute {r['policy_ms'] / ds['policy_ms']:.0f}x")
            if notes:
                worse.append(f"`{name}` ({', '.join(notes)})")
        lines.append(f"- **{trace}, where ours are worse than `deepseek`:** " + ("; ".join(worse) or "nowhere") + ".")
    return lines


def async_goals(rows: list[dict], async_rows: list[dict]) -> list[str]:
    """Goal 5 (no step stalls for the whole move), and what sync moves cost at this interval."""
    lines = []
    for policy in dict.fromkeys(r["row"] for r in async_rows):
        mine = [r for r in async_rows if r["row"] == policy]
        sync = next(r for r in mine if r["layers_per_chunk"] == "sync")
        best = min(mine, key=lambda r: r["step_ms"])
        one = next(r for r in mine if r["layers_per_chunk"] == 1)
        lines.append(f"- **async, `{policy}` on `{sync['trace']}`:** sync moves stall the step after each rebalance "
                     f"{sync['stall_ms_max']:.0f} ms; one layer a step, the worst step stalls "
                     f"{one['stall_ms_max']:.1f} ms (balancedness {one['balancedness_total']:.4f} against "
                     f"{sync['balancedness_total']:.4f}: layers wait on the old placement); the fastest schedule is "
                     f"{best['layers_per_chunk']} ({best['step_ms']:.2f} ms a step against {sync['step_ms']:.2f}).")
    trace = async_rows[0]["trace"]
    by = {r["row"]: r for r in rows if r["trace"] == trace}
    lines.append(f"- **sync moves at this interval, `{trace}`:** `static` (one rebalance) steps "
                 f"{by['static']['step_ms']:.2f} ms, `deepseek` (every {by['deepseek']['step_interval']} steps) "
                 f"{by['deepseek']['step_ms']:.2f} ms "
                 f"({by['deepseek']['forward_ms']:.2f} computing + {by['deepseek']['stall_ms_per_step']:.2f} "
                 "waiting for weights): each full reshuffle moves nearly every expert.")
    return lines


def render(payload: dict) -> str:
    env, setup = payload["env"], payload["setup"]
    head = [
        "# EPLB ablation: DeepSeek-V3 scale (synthetic) and recorded traces",
        "",
        f"CPU: {env['cpu_model']} (1 torch thread; load average {env['load_average_1m']:.1f} at the end: other jobs "
        f"share the cores, so `ms` is noisy); torch {env['torch']}; commit "
        f"{env['commit']}{' (dirty)' if env['dirty'] else ''}; {env['date']}. Command: `{env['command']}`.",
        "",
        f"Synthetic: {setup['layers']} MoE layers, {setup['experts']} experts, top-{setup['top_k']}, "
        f"{setup['slots']} slots ({setup['slots'] - setup['experts']} redundant), {setup['ranks']} EP ranks on "
        f"{setup['nodes']} nodes, {setup['tokens']} tokens a step, {setup['steps']} steps, a rebalance every 100 steps "
        "from the last 100; one expert group (the synthetic router is not group-limited: `deepseek` runs its global "
        "policy). Recorded traces: see the JSON's `traces`. Costs: DeepSeek-V3 expert in fp8 "
        f"({setup['cost']['expert_bytes'] / 1e6:.1f} MB), {setup['cost']['expert_tflops']:.0f} TFLOP/s effective "
        f"per rank (assumed), NVLink {setup['cost']['nvlink_gbps']:.0f} GB/s, InfiniBand "
        f"{setup['cost']['ib_gbps']:.0f} GB/s per GPU.",
        "",
        repeats_line(payload) + " Only `ms` varies: the replays are deterministic and ran once.",
        "",
        "Columns: `bal.` balancedness (mean / max tokens per rank, time-weighted over all layers, steps after the "
        "first rebalance); `layer min / p50 / p90 / avg` the same per layer; `fwd ms` simulated MoE expert compute "
        "a step (each layer waits for its busiest rank), `stall` ms a step waiting for weights (sync moves, averaged "
        "over the steps), `step ms` their sum; `moved` experts sent over the interconnect per "
        "rebalance, `GB` and `xfer ms` the bytes and the transfer time they imply (busiest rank, per link); "
        "`ms` policy compute on the first window; `slots` per layer in use (distinct rank-expert pairs). `ll`: "
        "least-loaded dispatch among replicas; `budgeted N%`: at most N% of the redundant slots.",
        "",
    ]
    lines = []
    for trace in dict.fromkeys(r["trace"] for r in payload["rows"]):
        lines += [f"## {trace}", "", "| policy | bal. | layer min | p50 | p90 | avg | fwd ms | stall | step ms | "
                  "moved | GB | xfer ms | ms | slots |", "| --- | " + " | ".join(["---:"] * 13) + " |"]
        for r in (r for r in payload["rows"] if r["trace"] == trace):
            lines.append(
                f"| {r['row']} | {r['balancedness_total']:.4f} | {r['balancedness_layer_min']:.3f} | "
                f"{r['balancedness_layer_p50']:.3f} | {r['balancedness_layer_p90']:.3f} | "
                f"{r['balancedness_layer_avg']:.3f} | {r['forward_ms']:.2f} | {r['stall_ms_per_step']:.2f} | "
                f"{r['step_ms']:.2f} | {r['experts_moved_per_rebalance']:.0f} | "
                f"{r['bytes_moved_per_rebalance'] / 1e9:.1f} | {r['transfer_ms_per_rebalance']:.0f} | "
                f"{cell(r, 'policy_ms', '.1f')} | {r['slots_used']:.1f} |")
        lines.append("")
    a = payload["async_rows"]
    lines += [f"## Rebalancing: sync vs async (chunked) moves, `{a[0]['trace']}` trace", "",
              "Sync: the step after a rebalance waits for every layer's experts. Chunked: c layers move behind the "
              "forward of each following step (into staging; they switch after it), so a step stalls only for what "
              "does not fit behind its forward; until then a layer serves the old placement (the balancedness cost).",
              "", "| policy | layers a step | bal. | fwd ms | stall | step ms | worst step's stall ms |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in a:
        lines.append(f"| {r['row']} | {r['layers_per_chunk']} | {r['balancedness_total']:.4f} | "
                     f"{r['forward_ms']:.2f} | {r['stall_ms_per_step']:.2f} | {r['step_ms']:.2f} | "
                     f"{r['stall_ms_max']:.1f} |")
    lines += ["", "## Goals (issue 32), checked on these numbers", "", *payload["goals"]]
    return "\n".join(head + lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", default=[], metavar="NAME=PATH",
                    help="a recorded trace (research_lm.eplb.trace); repeat for more")
    ap.add_argument("--trace-dir", type=Path, default=None,
                    help="every .npz under it is a recorded trace (e.g. research_lm/assets/moe_traces)")
    ap.add_argument("--trace-ranks", type=int, default=None,
                    help="EP ranks for recorded traces (default max(2, experts / 4), as many redundant slots)")
    ap.add_argument("--no-synthetic", action="store_true", help="recorded traces only")
    ap.add_argument("--steps", type=int, default=600, help="synthetic trace length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing-runs", type=int, default=3, help="timed policy runs per repeat (median)")
    ap.add_argument("--expert-tflops", type=float, default=CostModel.expert_tflops)
    ap.add_argument("--nvlink-gbps", type=float, default=CostModel.nvlink_gbps)
    ap.add_argument("--ib-gbps", type=float, default=CostModel.ib_gbps)
    ap.add_argument("--expert-bytes", type=float, default=CostModel.expert_bytes,
                    help="bytes of one expert (default DeepSeek-V3's in fp8; bf16: twice that)")
    add_repeat_args(ap)
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.timing_runs < 1:
        ap.error("--repeats and --timing-runs must be >= 1")
    torch.set_num_threads(1)  # small tensors: intra-op threads only contend on 2 shared cores
    cost = CostModel(expert_bytes=args.expert_bytes, expert_tflops=args.expert_tflops,
                     nvlink_gbps=args.nvlink_gbps, ib_gbps=args.ib_gbps)
    traces = {} if args.no_synthetic else synthetic_traces(args.steps, args.seed)
    traces |= recorded_traces(args.trace, args.trace_dir, args.trace_ranks)
    if not traces:
        ap.error("no trace: drop --no-synthetic or give --trace NAME=PATH")
    rows, async_rows = replay_rows(traces, cost)
    timed = repeat(lambda: {"rows": timing_rows(traces, args.timing_runs)}, args.repeats, ("trace", "row"))
    ms = {(r["trace"], r["row"]): r for r in timed["rows"]}
    for r in rows:
        t = ms[(r["trace"], r["row"])]
        r["policy_ms"], r["spread"], r["repeats"] = t["policy_ms"], t.get("spread", {}), t.get("repeats", {})
    env = environment(torch.device("cpu")) | {"cpu_model": cpu_model(), "load_average_1m": os.getloadavg()[0]}
    payload = {
        "rows": rows, "async_rows": async_rows, "num_repeats": timed["num_repeats"], "env": env,
        "setup": {"layers": LAYERS, "experts": EXPERTS, "slots": SLOTS, "ranks": RANKS, "nodes": NODES,
                  "top_k": TOP_K, "tokens": TOKENS, "steps": args.steps, "seed": args.seed,
                  "cost": {k: getattr(cost, k) for k in ("expert_bytes", "pair_flops", "expert_tflops", "nvlink_gbps",
                                                         "ib_gbps")}},
        "traces": {name: {"shape": list(load.shape), **setup} for name, (load, setup) in traces.items()},
    }
    payload["goals"] = goals(rows) + async_goals(rows, async_rows)
    table = render(payload)
    write_results(args.name or NAME, table, payload, args.out)
    print(table)
    return payload


if __name__ == "__main__":
    main()
