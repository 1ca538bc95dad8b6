"""Routing skew and drift of a MoE trained here: per-expert load on code and on prose, trained vs random init.

    python experiments/moe_routing_skew.py    # CPU, ~25 min: experiments/results/moe_routing_skew.{md,json,png}
                                              # and research_lm/assets/moe_traces/<variant>/{code,prose,switch}.npz

Each repeat is one training seed (--seed + repeat index). For each variant:
- train it with `harness.train.moe.train_moe` (next-token loss + the architecture's load-balancing loss at its
  default coefficient, 0.001), keeping the same model before its first step as the random-init baseline;
- serve the code and the prose workload (research_lm.harness.workloads: conf/workload's defaults, --requests requests of
  --max-tokens tokens, at most --max-num-seqs running) on each checkpoint, each on a fresh engine loaded by the
  normal loader, `LLM(path, eplb_config={"record_trace": ...})` (policy none), and write the traces; the switch
  trace is the code trace followed by the prose trace (meta["segments"] gives each one's steps);
- measure the per-expert load (harness.train.routing_stats): skew per layer, and drift between code and prose
  against the drift between the two halves of one workload (what sampling alone moves).
The first repeat's traces of the trained models are copied to --traces-out (the committed ones).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
from bench_common import add_repeat_args, cell, env_line, environment, repeat, repeats_line, write_results

from research_lm.eplb.trace import save_trace
from research_lm.harness.train import routing_stats as rs
from research_lm.harness.train.config import TrainConfig
from research_lm.harness.train.moe import DEFAULT_SHAPE, SHARED_EXPERT_RATIO, train_moe
from research_lm.harness.train.moe_traces import SHIPPED_TRACES, TRACE_KINDS, record_trace
from research_lm.harness.workloads import WorkloadSpec

NAME = "moe_routing_skew"
ROOT = Path(__file__).resolve().parent.parent
# variant -> (architecture, train.model overrides): the same shape but for the shared expert (Qwen2-MoE's gated
# shared expert of 4 x 96, plus its q/k/v biases and no q/k norm); both renormalise the top-2 weights.
VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", {}),
}
WORKLOADS = ("code", "prose")
SKEW = ("max_over_mean", "gini", "normalized_entropy", "top1_share", "step_max_over_mean")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=600, help="training steps of batch 8 x 128 tokens")
    ap.add_argument("--corpus-bytes", type=int, default=1_000_000, help="stdlib characters (plus all pydoc topics)")
    ap.add_argument("--seed", type=int, default=0, help="repeat i trains with seed + i")
    ap.add_argument("--requests", type=int, default=64, help="requests per workload")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadiest on a shared 2-core box)")
    ap.add_argument("--work-dir", type=Path, default=ROOT / "outputs" / NAME, help="checkpoints and every trace")
    ap.add_argument("--cache-dir", default=None, help="tokenized-corpus cache (default ~/.cache/research_lm/tokens)")
    ap.add_argument("--traces-out", type=Path, default=SHIPPED_TRACES, help="the first repeat's trained traces go here")
    ap.add_argument("--no-plot", action="store_true")
    add_repeat_args(ap)
    return ap


def train_config(args: argparse.Namespace, out: Path, seed: int) -> TrainConfig:
    return TrainConfig(output_dir=str(out), steps=args.steps, batch_size=8, seq_len=128, lr=3e-3, warmup_steps=20,
                       log_every=50, eval_every=0, save_every=0, corpus_bytes=args.corpus_bytes, seed=seed,
                       device="cpu", progress=False, cache_dir=args.cache_dir)


def record(args: argparse.Namespace, model: Path, out: Path, meta: dict) -> dict[str, torch.Tensor]:
    """The code, prose and switch traces of `model` in `out`; returns their loads [steps, L, E]."""
    out.mkdir(parents=True, exist_ok=True)
    loads, metas = {}, {}
    for kind in WORKLOADS:
        spec = WorkloadSpec(kind=kind, num_requests=args.requests, max_tokens=args.max_tokens, seed=0)
        trace = record_trace(model, [spec], out / f"{kind}.npz", meta=meta, device="cpu", dtype="float32",
                             max_num_seqs=args.max_num_seqs)
        loads[kind], metas[kind] = trace.load, trace.meta
    code_steps = loads["code"].shape[0]
    segments = [metas["code"]["segments"][0],
                {**metas["prose"]["segments"][0], "start": code_steps, "stop": code_steps + loads["prose"].shape[0]}]
    loads["switch"] = torch.cat([loads["code"], loads["prose"]])
    save_trace(out / "switch.npz", loads["switch"], {**metas["code"], "segments": segments,
                                                     "switch": "code.npz then prose.npz (two engines)"})
    return loads


def stats_row(variant: str, weights: str, loads: dict[str, torch.Tensor]) -> dict:
    row: dict = {"variant": variant, "weights": weights}
    for kind in WORKLOADS:
        s = rs.skew(loads[kind])
        row |= {f"{kind}_{k}": s[k] for k in SKEW}
        row[f"{kind}_steps"] = loads[kind].shape[0]
        row[f"{kind}_max_over_mean_per_layer"] = dict(enumerate(s["max_over_mean_per_layer"]))
        row[f"{kind}_shares"] = rs.shares(loads[kind].sum(0)).tolist()  # [L][E]: the per-expert distribution
    d = rs.drift(loads["code"], loads["prose"])
    row |= {"drift_l1": d["l1"], "drift_spearman": d["spearman"],
            "drift_l1_per_layer": dict(enumerate(d["l1_per_layer"])),
            "drift_spearman_per_layer": dict(enumerate(d["spearman_per_layer"]))}
    for kind in WORKLOADS:
        row[f"{kind}_halves_l1"] = rs.drift(*rs.halves(loads[kind]))["l1"]
    row["drift_over_halves"] = row["drift_l1"] / max(1e-12, (row["code_halves_l1"] + row["prose_halves_l1"]) / 2)
    return row


def measure(args: argparse.Namespace, index: int) -> dict:
    """One repeat: every variant trained with seed args.seed + index, its traces recorded and measured."""
    seed = args.seed + index
    rows, training = [], {}
    for variant in args.variants:
        architecture, shape = VARIANTS[variant]
        base = args.work_dir / f"seed{seed}" / variant
        result = train_moe(train_config(args, base / "trained", seed), architecture=architecture, model=shape,
                           init_dir=str(base / "init"))
        s = result.summary
        training[variant] = {k: s[k] for k in ("architecture", "router_aux_loss_coef", "trainable_params", "wall_s",
                                               "final_val_lm_loss", "final_val_ppl", "corpus_hash", "pydoc_hash")}
        for weights in ("init", "trained"):
            meta = {"checkpoint": {"variant": variant, "weights": weights, "seed": seed, "steps": s["steps"],
                                   "corpus_hash": s["corpus_hash"], "pydoc_hash": s["pydoc_hash"],
                                   "router_aux_loss_coef": s["router_aux_loss_coef"],
                                   "recipe": f"python experiments/{NAME}.py --steps {args.steps}"}}
            loads = record(args, base / weights, base / "traces" / weights, meta)
            row = stats_row(variant, weights, loads)
            if weights == "trained":
                row |= {"val_lm_loss": s["final_val_lm_loss"], "train_wall_s": s["wall_s"]}
            rows.append(row)
        if index == 0:
            dest = args.traces_out / variant
            dest.mkdir(parents=True, exist_ok=True)
            for kind in TRACE_KINDS:
                shutil.copy(base / "traces" / "trained" / f"{kind}.npz", dest / f"{kind}.npz")
        print(f"seed {seed} {variant}: done", flush=True)
    return {"rows": rows, "training": training, "seed": seed}


def render(payload: dict) -> str:
    env, setup, rows = payload["env"], payload["setup"], payload["rows"]
    training = payload["training"]
    first = next(iter(training.values()))
    models = ", ".join(f"`{v}` ({t['architecture']}, {t['trainable_params'] / 1e6:.2f} M params)"
                       for v, t in training.items())
    m = DEFAULT_SHAPE
    layers, experts, top_k = m["num_hidden_layers"], m["num_experts"], m["num_experts_per_tok"]
    head = [
        "# Routing skew and drift of a trained MoE (CPU)",
        "",
        f"Models: {models}: hidden {m['hidden_size']}, {layers} layers, {m['num_attention_heads']} heads "
        f"({m['num_key_value_heads']} KV), every MLP a MoE of {experts} experts of {m['moe_intermediate_size']}, "
        f"top-{top_k} (renormalised), tiny-llama's 1024-token vocabulary; qwen2_moe adds a gated shared expert of "
        f"{SHARED_EXPERT_RATIO * m['moe_intermediate_size']}. "
        f"Trained in-framework (`harness.train.moe.train_moe`) for {setup['steps']} steps of 8 x 128 tokens "
        f"on the first {setup['corpus_bytes']:,} characters of the stdlib plus the pydoc topics (corpus hash "
        f"{first['corpus_hash']}, pydoc {first['pydoc_hash']}), AdamW 3e-3, loss = cross-entropy + "
        f"{first['router_aux_loss_coef']} x load-balancing loss (transformers' Switch-style loss at the "
        "architecture's default coefficient; it balances the experts' load summed over layers, so a layer may stay "
        "skewed). `init`: the same model before its first step.",
        f"Workloads: `workload=code` / `prose` (conf/workload, seed 0), {setup['requests']} requests of "
        f"{WorkloadSpec.prompt_chars} characters, greedy, up to {setup['max_tokens']} new tokens, at most "
        f"{setup['max_num_seqs']} running; one trace step = one engine step (prefill chunks and decodes). Traces "
        "recorded by "
        "`LLM(path, eplb_config={\"record_trace\": ...})`.",
        f"{env_line(env)}; {setup['cpu_count']} CPU cores, {setup['threads']} torch thread(s).",
        "",
        repeats_line(payload) + " Repeats are training seeds "
        f"{', '.join(str(r['seed']) for r in payload['repeats_raw'])}.",
        "",
        *reading(rows),
        f"Skew of each layer's load summed over the trace, averaged over the {layers} layers: max / mean tokens per "
        f"expert (1 = balanced, {experts} = one expert), Gini (0 = balanced), entropy / ln {experts} (1 = balanced), "
        f"the top expert's share (1/{experts} = {1 / experts:.4f} balanced); step max/mean: the same ratio per engine "
        "step and layer, averaged (what one step's slowest expert sees; a decode step routes only "
        f"{top_k} x {setup['max_num_seqs']} tokens, so sampling noise alone lifts it).",
        "",
        "| variant | weights | val CE | workload | steps | max/mean | Gini | entropy | top-1 share | step max/mean |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines = []
    for r in rows:
        for kind in WORKLOADS:
            lines.append(
                f"| {r['variant']} | {r['weights']} | {cell(r, 'val_lm_loss', '.2f')} | {kind} | "
                f"{cell(r, f'{kind}_steps', '.0f')} | "
                + " | ".join(cell(r, f"{kind}_{k}", ".3f" if k != "max_over_mean" else ".2f") for k in SKEW) + " |")
    drift = [
        "",
        "Drift from code to prose: L1 distance between the two workloads' normalized per-expert loads (0 = same, "
        "2 = disjoint) and their Spearman rank correlation, averaged over layers; against the L1 distance between "
        "the first and second half of one workload's trace (the drift sampling alone makes). Ratio: code-vs-prose "
        "L1 / the mean same-workload L1.",
        "",
        "| variant | weights | L1 code vs prose | Spearman | L1 code halves | L1 prose halves | ratio |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        drift.append(f"| {r['variant']} | {r['weights']} | {cell(r, 'drift_l1', '.3f')} | "
                     f"{cell(r, 'drift_spearman', '.3f')} | {cell(r, 'code_halves_l1', '.3f')} | "
                     f"{cell(r, 'prose_halves_l1', '.3f')} | {cell(r, 'drift_over_halves', '.1f')} |")
    layers = ["", "Per layer, trained weights: max / mean on code and prose, and the code-vs-prose drift.", "",
              "| variant | layer | max/mean code | max/mean prose | L1 code vs prose | Spearman |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in (r for r in rows if r["weights"] == "trained"):
        for layer in r["code_max_over_mean_per_layer"]:
            layers.append(f"| {r['variant']} | {layer} | "
                          + " | ".join(_layer_cell(r, f, layer) for f in ("code_max_over_mean_per_layer",
                                                                          "prose_max_over_mean_per_layer",
                                                                          "drift_l1_per_layer",
                                                                          "drift_spearman_per_layer")) + " |")
    return "\n".join(head + lines + drift + layers)


def reading(rows: list[dict]) -> list[str]:
    """What the numbers say, per variant, from the medians (written from the rows, so it follows a rerun)."""
    out = ["Reading it:"]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        i, t = (next(r for r in rows if r["variant"] == variant and r["weights"] == w) for w in ("init", "trained"))
        halves = (t["code_halves_l1"] + t["prose_halves_l1"]) / 2
        i_halves = (i["code_halves_l1"] + i["prose_halves_l1"]) / 2
        noise = i["drift_over_halves"] < 2  # the init's code-vs-prose move is no bigger than its sampling noise
        init_drift = ("of the order of its halves'" if noise else "above its halves'")
        why = ": a random router's load follows the requests' tokens more than the workload" if noise else ""
        out.append(
            f"- `{variant}`: training lifts max/mean from {i['code_max_over_mean']:.2f} / "
            f"{i['prose_max_over_mean']:.2f} (init; code / prose) to {t['code_max_over_mean']:.2f} / "
            f"{t['prose_max_over_mean']:.2f}, Gini from {i['code_gini']:.2f} / {i['prose_gini']:.2f} to "
            f"{t['code_gini']:.2f} / {t['prose_gini']:.2f}. The trained load is steady within a workload (L1 "
            f"{halves:.3f} between halves) and moves {t['drift_over_halves']:.1f}x that (median ratio over seeds) "
            "from code to prose (L1 "
            f"{t['drift_l1']:.3f}), while the hot experts mostly stay hot (Spearman {t['drift_spearman']:.2f}). "
            f"At init the code-vs-prose L1 ({i['drift_l1']:.3f}) is {init_drift} ({i_halves:.3f}, ratio "
            f"{i['drift_over_halves']:.1f}){why}.")
    ce = min(r["val_lm_loss"] for r in rows if "val_lm_loss" in r)
    out += ["- Caveats: tiny models (held-out cross-entropy >= "
            f"{ce:.2f} nats) and greedy decoding, whose repetition concentrates decode steps on few tokens; "
            "transformers' aux loss balances each expert's load summed over the layers, not per layer.", ""]
    return out


def _layer_cell(row: dict, field: str, layer) -> str:
    spread = row.get("spread", {}).get(f"{field}.{layer}")
    return cell({"v": row[field][layer], "spread": {"v": spread} if spread else {}}, "v", ".2f")


def plot(payload: dict, path: Path) -> None:
    """Per-expert load shares of each layer, code vs prose, trained weights of the first repeat."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    rows = [r for r in payload["repeats_raw"][0]["rows"] if r["weights"] == "trained"]
    num_layers = len(rows[0]["code_shares"])
    fig, axes = plt.subplots(len(rows), num_layers, figsize=(3.2 * num_layers, 2.6 * len(rows)), squeeze=False)
    for i, r in enumerate(rows):
        for layer in range(num_layers):
            ax = axes[i][layer]
            experts = range(len(r["code_shares"][layer]))
            ax.bar([e - 0.2 for e in experts], r["code_shares"][layer], width=0.4, label="code")
            ax.bar([e + 0.2 for e in experts], r["prose_shares"][layer], width=0.4, label="prose")
            ax.axhline(1 / len(experts), color="grey", linewidth=0.8, linestyle="--")
            ax.set_title(f"{r['variant']} layer {layer}", fontsize=9)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.supxlabel("expert")
    fig.supylabel("share of routed tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    name = args.name or NAME
    env = environment(torch.device("cpu"))
    print(env_line(env), flush=True)
    setup = {k: getattr(args, k) for k in ("variants", "steps", "corpus_bytes", "requests", "max_tokens",
                                           "max_num_seqs", "threads")} | {"cpu_count": os.cpu_count()}
    counter = iter(range(args.repeats))

    def save(payload: dict) -> str:
        table = render(payload)
        write_results(name, table, payload, args.out)
        return table

    payload = repeat(lambda: measure(args, next(counter)) | {"env": env, "setup": setup}, args.repeats,
                     ("variant", "weights"), on_repeat=save)
    table = save(payload)
    if not args.no_plot:
        plot(payload, Path(args.out) / f"{name}.png")
    print(table)
    return payload


if __name__ == "__main__":
    main()
