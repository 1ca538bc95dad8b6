"""EPLB policies at DeepSeek-V3 scale on the CPU: placement compute time and EP balance.

    python experiments/bench_eplb_policy.py            # writes experiments/results/eplb_policy.{md,json,png}
    python -m experiments.paper eplb_policy            # the same, as the paper table (experiments/paper/)

Scale: 58 MoE layers, 256 logical experts, 288 physical slots (32 redundant), 32 EP ranks on 4 nodes,
8 expert groups (DeepSeek-V3's n_group), so `deepseek` takes its hierarchical branch.
The whole table is measured `--repeats` times (default 3); each cell shows the median over the repeats
and their min–max where they differ (deterministic columns, e.g. balancedness, do not).
- time: policy compute per rebalance (all 58 layers), median of --timing-runs runs after one warm-up;
  the goal is < 50 ms on a CPU.
- in-sample balancedness (Σ_layers mean / Σ_layers max rank load): placement computed from one
  Zipf-skewed window load (alpha 0.6 / 1.0 / 1.4; 1M tokens, top-8) and evaluated on that load.
- replay: a drifting Zipf(1.0) trace (--steps steps of 4096 tokens, top-8); rebalance every 100
  steps from the last 100 steps; balancedness time-weighted over the trace (ideal / simulated time),
  and the slots whose expert changed per rebalance (weight copies). `static` = deepseek computed
  once after the first 100 steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from bench_common import add_repeat_args, cell, repeat, repeats_line, write_results

from research_lm.eplb import available_policies, get_policy, replay, simulate_ep, zipf_load, zipf_trace
from research_lm.harness.env_info import environment

NAME = "eplb_policy"
LAYERS, EXPERTS, SLOTS, GROUPS, NODES, GPUS = 58, 256, 288, 8, 4, 32
GOAL_MS = 50.0
ALPHAS = (0.6, 1.0, 1.4)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def time_policy(name: str, weight: torch.Tensor, repeats: int) -> list[float]:
    fn = get_policy(name)
    fn(weight, SLOTS, GROUPS, NODES, GPUS)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(weight, SLOTS, GROUPS, NODES, GPUS)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def in_sample_balance(name: str, alpha: float, seed: int) -> float:
    load = zipf_load(LAYERS, EXPERTS, alpha=alpha, num_tokens=1_000_000, top_k=8, seed=seed)
    phy2log, _, logcnt = get_policy(name)(load, SLOTS, GROUPS, NODES, GPUS)
    return simulate_ep(load, phy2log, logcnt, GPUS, NODES).balancedness


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timing-runs", type=int, default=15, help="timed runs per policy per repeat (median)")
    ap.add_argument("--steps", type=int, default=600, help="replay trace length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    add_repeat_args(ap)
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = parser()
    args = ap.parse_args(argv)
    if args.timing_runs < 5:
        ap.error("--timing-runs must be >= 5")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    name = args.name or NAME
    setup = {"layers": LAYERS, "logical_experts": EXPERTS, "physical_slots": SLOTS, "groups": GROUPS,
             "nodes": NODES, "ep_ranks": GPUS, "timing_runs": args.timing_runs, "replay_steps": args.steps,
             "seed": args.seed}

    def save(payload: dict) -> str:
        for raw in payload["repeats_raw"]:  # the replay is deterministic: its curves are kept once, at the top
            raw.pop("replay_curves", None)
        payload["env"] = environment(torch.device("cpu")) | {
            "cpu_model": cpu_model(), "torch_threads": torch.get_num_threads(), "load_average_1m": os.getloadavg()[0]}
        table = render(payload)
        write_results(name, table, payload, args.out)
        return table

    payload = repeat(lambda: measure(args) | {"setup": setup}, args.repeats, ("policy",), on_repeat=save)
    table = save(payload)
    if not args.no_plot:
        plot(payload["replay_curves"], Path(args.out) / f"{name}.png")
    print(table)
    return payload


def measure(args) -> dict:
    """One repeat of the whole table: {rows, replay_curves}."""
    policies = available_policies()
    timing_load = zipf_load(LAYERS, EXPERTS, alpha=1.0, num_tokens=1_000_000, top_k=8, seed=args.seed)
    trace = zipf_trace(args.steps, LAYERS, EXPERTS, alpha=1.0, drift=0.02, num_tokens=4096, top_k=8,
                       seed=args.seed)
    rows, curves = [], {}
    for name in policies + ["static"]:
        policy = "deepseek" if name == "static" else name
        row: dict = {"policy": name}
        if name != "static":
            times = time_policy(policy, timing_load, args.timing_runs)
            row |= {"ms_median": statistics.median(times), "ms_min": min(times), "ms_all": times}
            for alpha in ALPHAS:
                row[f"balance_alpha_{alpha}"] = in_sample_balance(policy, alpha, args.seed)
        result = replay(trace, policy, SLOTS, GROUPS, NODES, GPUS, step_interval=100, window_size=100,
                        max_rebalances=1 if name == "static" else None)
        summary = result.summary()
        row |= {"replay_balance": summary["balancedness_total"],
                "replay_balance_after_first": float(result.ideal_step_time[100:].sum()
                                                    / result.est_step_time[100:].sum()),
                "num_rebalances": summary["num_rebalances"],
                "moved_slots_per_rebalance": (summary["moved_slots_total"] / summary["num_rebalances"]
                                              if summary["num_rebalances"] else 0.0)}
        curves[name] = [round(v, 4) for v in result.balancedness.tolist()]
        rows.append(row)
        print(f"{name}: done", flush=True)
    return {"rows": rows, "replay_curves": curves}


def render(payload: dict) -> str:
    rows, env, setup = payload["rows"], payload["env"], payload["setup"]
    git = env["git"]
    base = next(r["ms_min"] for r in rows if r["policy"] == "deepseek")
    head = [
        "# EPLB policies at DeepSeek-V3 scale (CPU)",
        "",
        f"{setup['layers']} MoE layers, {setup['logical_experts']} experts, {setup['physical_slots']} slots, "
        f"{setup['ep_ranks']} EP ranks on {setup['nodes']} nodes, {setup['groups']} groups. "
        f"CPU: {env['cpu_model']} ({env['torch_threads']} torch threads, load average "
        f"{env['load_average_1m']:.1f} at the end: other jobs share the CPU, so min is the uncontended "
        f"estimate); Python {env['python']}, "
        f"torch {env['packages']['torch']}, numpy {env['packages']['numpy']}; "
        f"commit {git['commit']}{' (dirty)' if git['dirty'] else ''}; {env['date']}.",
        f"Command: `{env['command']}`.",
        "",
        repeats_line(payload),
        "",
        "ms: policy compute per rebalance, median (and min) of "
        f"{setup['timing_runs']} runs in each repeat (goal < {GOAL_MS:.0f} ms). Balance: Σ mean / Σ max rank "
        "load, placement computed from and evaluated on one Zipf window (in-sample). Replay: drifting "
        "Zipf(1.0) trace of "
        f"{setup['replay_steps']} steps x 4096 tokens, rebalance every 100 steps from the last 100; "
        "time-weighted balance over the trace and over the steps after the first rebalance; slots "
        "moved per rebalance (weight copies, of 58 x 288 = 16704). `static`: deepseek once, then frozen.",
        "",
        "Reading it: the synthetic router ignores expert groups (no group-limited routing), so group loads "
        "are uneven, and `deepseek`'s hierarchical branch, which keeps groups whole on a node and "
        "replicates only inside it, trails the flat `lpt`: that gap is the price of node locality on such "
        "a router (the inter-node traffic locality saves is not modelled). Every policy recomputes the "
        "placement from scratch, so nearly all slots move at each rebalance.",
        "",
        "| policy | ms (median) | ms (min) | min vs deepseek | balance α=0.6 | α=1.0 | α=1.4 "
        "| replay balance | after 1st rebalance | slots moved / rebalance |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines = []
    for r in rows:
        ratio = f"{r['ms_min'] / base:.2f}x" if "ms_min" in r else "—"
        lines.append(
            f"| {r['policy']} | {cell(r, 'ms_median', '.1f')} | {cell(r, 'ms_min', '.1f')} | {ratio} | "
            + " | ".join(cell(r, f"balance_alpha_{a}", ".3f") for a in ALPHAS)
            + f" | {cell(r, 'replay_balance', '.3f')} | {cell(r, 'replay_balance_after_first', '.3f')} | "
            f"{cell(r, 'moved_slots_per_rebalance', '.0f')} |"
        )
    return "\n".join(head + lines)


def plot(curves: dict[str, list[float]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, values in curves.items():
        ax.plot(values, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("balancedness (mean / max rank load)")
    ax.set_title("EPLB replay, drifting Zipf(1.0), DeepSeek-V3 shape, rebalance every 100 steps")
    ax.set_ylim(0, 1)
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
