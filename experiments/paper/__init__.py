"""One command per committed table in experiments/results/: `python -m experiments.paper <table>`.

    python -m experiments.paper --list                     # the tables, their device and time
    python -m experiments.paper eplb_policy                # CPU: regenerates experiments/results/eplb_policy.*
    python -m experiments.paper bench_decode --repeats 5   # GPU tables refuse without CUDA ...
    python -m experiments.paper bench_decode --allow-cpu   # ... unless asked for a tiny CPU smoke run
    python -m experiments.paper eplb_policy -- --steps 200 # arguments after `--` go to the benchmark / sweep

Every table measures its whole content `--repeats` times (default 3, at least 3) and reports each cell's
median with the spread as min–max over the repeats; the JSON beside it keeps every repeat's raw values and
the device, package versions, git commit and dirty flag, date and command line.
Two kinds of table (TABLES below):
- a benchmark script, `experiments/<bench>.py`: its `main(argv)` runs with the table's arguments plus
  `--repeats N --out DIR --name TABLE` and aggregates the repeats itself (experiments/bench_common.py);
- a Hydra sweep, `python -m research_lm -m <overrides> +repeat=0,...,N-1` (or `seed=0,...,N-1` for a table
  whose repeats are seeds, `repeat_key="seed"`), then `research_lm.harness.report` with that repeat key: jobs that
  differ only in it are repeats of one cell.
A GPU table refuses to run without CUDA; `--allow-cpu` runs its tiny CPU variant instead (`smoke`
arguments) and writes `<table>_cpu_smoke.*` under outputs/paper/, never over the committed table.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

EXPERIMENTS = Path(__file__).resolve().parent.parent
RESULTS = EXPERIMENTS / "results"
MIN_REPEATS = 3


class PaperError(ValueError):
    """A table that cannot run here (unknown name, no GPU, too few repeats): one line for the user."""


@dataclass(frozen=True)
class Table:
    """How one committed table is regenerated."""

    what: str  # one line: what the table shows
    device: str  # "cpu" or "cuda": what the measurement needs
    measured_on: str  # the device of the committed numbers
    minutes: str  # approximate wall time at the default 3 repeats, on `measured_on` ("~20 s")
    bench: str | None = None  # experiments/<bench>.py, called through its main(argv)
    sweep: tuple[str, ...] = ()  # else: the overrides of `python -m research_lm -m ...`
    parts: tuple[tuple[str, ...], ...] = ()  # sweep: more overrides, one multirun per part (e.g. per batch size)
    prepare: tuple[str, tuple[str, ...]] | None = None  # (path, command) run first when path is missing (not smoke)
    args: tuple[str, ...] = ()  # the benchmark's arguments for this table
    smoke: tuple[str, ...] | None = None  # --allow-cpu on a machine without CUDA: replaces/extends args
    repeat_key: str = "repeat"  # sweep: the key whose values are the repeats (`+repeat=0,1,2`; or `seed`)
    plots: dict[str, str] = field(default_factory=dict)  # sweep: report plot -> file name in results
    ranks: int = 1  # benchmark: > 1 starts it under torchrun, one process per GPU (gloo ranks in a CPU smoke run)
    title: str = ""  # sweep: the heading of the markdown table
    about: str = ""  # sweep: what was run, in prose, above the numbers



# The attention-zoo tables: random weights built once per recipe (outputs/random), the model's seed fixed
# while `seed` (the repeats) varies the workload; experiments/zoo_presets_gpu.sh runs the same sweeps.
_ZOO = ("device=cuda", "logger=jsonl", "model.random.cache_dir=outputs/random", "model.random.seed=0")
_ZOO_LOAD = ("workload.num_requests=64", "workload.prompt_chars=8000", "workload.max_tokens=256",
             "runner.max_num_seqs=64", "runner.num_gpu_blocks=16000", "warmup_requests=64")
_ZOO_SMOKE = ("device=cpu", "attention=torch_ref", "logger=none", "workload.num_requests=2", "workload.max_tokens=4",
              "workload.prompt_chars=300", "runner.max_num_seqs=2", "runner.num_gpu_blocks=256")


_TP_SMOKE = ("--tiny", "--device", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--batch", "1", "2",
             "--steps", "4", "--warmup", "1", "--prompt-len", "16")  # two gloo ranks
_REF = "outputs/reference"  # experiments/train_reference.sh's models (spec_ablation_h200)
_PROFILES = "research_lm/assets/profiles"  # experiments/record_reference_profiles.sh writes the reference's here


def _spec_reference_sweep(ks: str) -> tuple[str, ...]:
    return ("experiment=spec_ablation", "device=cuda", "attention=triton", "logger=jsonl", "model=hf",
            f"model.name={_REF}/target", f"spec.num_speculative_tokens={ks}", "workload.temperature=0.0,1.0",
            "workload.max_tokens=128", "runner.num_gpu_blocks=4096")


def _spec_parts(variants: tuple[tuple[str, ...], ...],
                batches: tuple[int, ...] = (1, 8, 32)) -> tuple[tuple[str, ...], ...]:
    """One part per variant (its overrides) and batch: 8 requests at batch 1, 4 x batch above."""
    return tuple((*variant, f"runner.max_num_seqs={b}", f"workload.num_requests={8 if b == 1 else 4 * b}",
                  f"warmup_requests={b}") for variant in variants for b in batches)


# one part per proposer and batch: the proposer's head
_SPEC_PROPOSERS = tuple(
    (f"spec={method}", *((f"spec.model={_REF}/{head}",) if head else ()))
    for method, head in (("ngram", None), ("eagle3", "eagle3"), ("eagle", "eagle"), ("medusa", "medusa"),
                         ("draft_model", "draft")))
_SPEC_REFERENCE_PARTS = _spec_parts(_SPEC_PROPOSERS)
_SPEC_REFERENCE_ABOUT = (
    "The GPU reference target (experiments/train_reference.sh: Llama, hidden 192, 24 layers, 9.6 M parameters, "
    "trained on the stdlib + pydoc corpus) and its four drafters trained in-framework (EAGLE-3 3500 steps on the "
    "target's own greedy continuations, 3 per corpus window, ttt_steps 5, MLP 4096; the others 800); 128 output "
    "tokens per request; 8 code prompts at batch 1, 4 x batch at 8 and 32 (requests join as others finish, as in "
    "serving; a batch of exactly max_num_seqs requests would time its slowest one); 3 seeds per cell; each job also "
    "runs the same workload without speculation in the same process (speedup: whole-workload output tok/s, prefill "
    "included; tpot_ratio compares decoding alone). CUDA graphs: decode and verify steps, one request's prompt (a "
    "prompt joining running requests gets a step of its own: runner.separate_prefills), and whole drafting steps of "
    "the model-based drafters (entry forward + chain in one replay; what each commit captures: "
    "experiments/results/PERFORMANCE.md).")


# spec_tree_h200: EAGLE-3 chain vs static vs dynamic tree on the reference target, one part per tree and batch
_SPEC_TREE_PARTS = _spec_parts(tuple((f"spec_tree={tree}",) for tree in ("chain", "tree16", "dynamic")))
# spec_suffix_h200: the model-free proposers and EAGLE-3 on the agentic and code workloads, a part per method and batch
# (suffix k = 24: vLLM's default, num_speculative_tokens = the tree depth, so a long match drafts far)
_SPEC_SUFFIX_PARTS = _spec_parts((("spec=ngram",), ("spec=suffix",), ("spec=suffix", "spec.suffix_decoding_tree=true"),
                                  ("spec=suffix", "spec.num_speculative_tokens=24"),
                                  ("spec=eagle3", f"spec.model={_REF}/eagle3")))
# spec_mtp_h200: the DeepSeek reference target (experiments/train_reference_mtp.sh) with its MTP layer vs EAGLE-3
_REF_MTP = "outputs/reference_mtp"
_SPEC_MTP_PARTS = _spec_parts((("spec=mtp", "spec.num_speculative_tokens=1"),
                               ("spec=mtp", "spec.num_speculative_tokens=3"),
                               ("spec=eagle3", f"spec.model={_REF_MTP}/eagle3", "spec.num_speculative_tokens=3")))


def command(name: str) -> str:
    return f"python -m experiments.paper {name}"


TABLES: dict[str, Table] = {
    "bench_decode": Table(
        what="batch-1 decode ms/step of a Llama-3.2-1B shape: research_lm eager / CUDA graphs / compiled vs "
             "gpt-fast (the peer probe, same command), transformers and the weight-streaming floor, with the "
             "per-stage profile",
        device="cuda", measured_on="NVIDIA H200", minutes="~5 min (gpt-fast's compile in each repeat)",
        bench="bench_decode", args=("--profile", "--peer-gptfast", ".peers/peer_gptfast.py"),
        smoke=("--tiny", "--device", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--steps", "8",
               "--warmup", "2", "--hf-dynamic-steps", "4", "--skip-hf-static", "--profile-steps", "4"),
    ),
    "bench_decode_8b": Table(
        what="decode ms/step and tok/s of a Llama-3.1-8B shape at batch 1 and 64: research_lm eager / CUDA graphs / "
             "compiled vs transformers (dynamic cache: 8 tokens) and the floor (weights + KV read per step)",
        device="cuda", measured_on="NVIDIA H200", minutes="~3 min", bench="bench_decode",
        args=("--shape", "llama-3.1-8b", "--batch", "1", "64", "--steps", "32", "--warmup", "8",
              "--hf-dynamic-steps", "8"),
        smoke=("--tiny", "--device", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--batch", "1", "2",
               "--steps", "4", "--warmup", "1", "--hf-dynamic-steps", "3", "--skip-hf-static", "--prompt-len", "16"),
    ),
    "bench_tensor_parallel_8b_h200x2": Table(
        what="decode ms/step of a Llama-3.1-8B shape at batch 1 and 64, tensor parallel over 2 GPUs (NCCL, CUDA "
             "graphs) against TP = 1 on one of them and the floor at each TP (weights / TP + KV over copy bandwidth)",
        device="cuda", measured_on="2 x NVIDIA H200", minutes="~40 s", bench="bench_tensor_parallel", ranks=2,
        args=("--shape", "llama-3.1-8b", "--batch", "1", "64", "--steps", "64", "--warmup", "8"),
        smoke=_TP_SMOKE,
    ),
    "bench_tensor_parallel_70b32l_h200x2": Table(
        what="the same for Llama-3.1-70B's layer shapes with 32 of its 80 layers (59 GB of bf16 weights, so TP = 1 "
             "fits one GPU)",
        device="cuda", measured_on="2 x NVIDIA H200", minutes="~40 s", bench="bench_tensor_parallel", ranks=2,
        args=("--shape", "llama-3.1-70b-32l", "--batch", "1", "64", "--steps", "32", "--warmup", "4"),
        smoke=_TP_SMOKE,
    ),
    "bench_decode_batch_invariant_h200": Table(
        what="the cost of batch_invariant=True (issue 35): decode ms/step of a Llama-3.2-1B shape at batch 1 and 64, "
             "CUDA graphs with and without the switch, against the floor",
        device="cuda", measured_on="NVIDIA H200", minutes="~1 min", bench="bench_decode",
        args=("--batch", "1", "64", "--skip-hf", "--steps", "128", "--variant", "research_lm CUDA graphs",
              "--variant", "research_lm CUDA graphs batch-invariant"),
        smoke=("--tiny", "--device", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--batch", "1", "2",
               "--steps", "4", "--warmup", "1", "--skip-hf", "--prompt-len", "16", "--variant", "research_lm eager"),
    ),
    "bench_throughput_batch_invariant_h200": Table(
        what="the cost of batch_invariant=True (issue 35): offline output tok/s on the nano-vllm workload (256 "
             "requests, greedy) with and without the switch, against the roofline",
        device="cuda", measured_on="NVIDIA H200", minutes="~2 min", bench="bench_throughput",
        args=("--skip-hf", "--temperatures", "0", "--batch-invariant"),
        smoke=("--tiny", "--device", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--num-requests", "4",
               "--skip-hf", "--temperatures", "0", "--batch-invariant", "--no-graphs"),
    ),
    "bench_throughput": Table(
        what="offline output tok/s on the nano-vllm workload (256 requests), research_lm vs transformers "
             "static cache vs the roofline",
        device="cuda", measured_on="NVIDIA H200", minutes="~5 min (transformers is 3 x 65 s of it)",
        bench="bench_throughput",
        smoke=("--tiny", "--device", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--num-requests", "2",
               "--hf-batch", "2", "--temperatures", "0"),
    ),
    "bench_defaults": Table(
        what="what `LLM(model)` with nothing else set gives on a GPU, against the tuned settings in the same "
             "process: nano-vllm workload tok/s and batch-1 decode ms/token (issue 27)",
        device="cuda", measured_on="NVIDIA H100 80GB HBM3", minutes="~2.5 min",
        bench="bench_defaults",
        smoke=("--tiny", "--device", "cpu", "--dtype", "float32", "--num-requests", "2", "--decode-tokens", "4",
               "--workload-runs", "1"),
    ),
    "ab_issue28_stage3_h200": Table(
        what="A/B of issue 28's stage 3 (every backend under graphs, one step path, taps by hooks) against the "
             "session's start (27437bc, `git archive`): batch-1 decode ms/token and nano-vllm tok/s, public API",
        device="cuda", measured_on="NVIDIA H200", minutes="~4 min (2 repeats)",
        bench="ab_commits", args=("--old", "27437bc", "--case", "decode_b1", "--case", "throughput"),
    ),
    "ab_issue28_stage3_spec_h200": Table(
        what="the same A/B on EAGLE-3 / ngram speedups of the shipped tiny pair (k = 5, greedy) at batch 1 and 32",
        device="cuda", measured_on="NVIDIA H200", minutes="~3 min (2 repeats)",
        bench="ab_commits", args=("--old", "27437bc", "--case", "spec_eagle3_b1", "--case", "spec_eagle3_b32",
                                  "--case", "spec_ngram_b1", "--case", "spec_ngram_b32", "--spec-repeats", "2"),
    ),
    "ab_issue28_stage4_h200": Table(
        what="A/B of issue 28's stage 4 (per-request state in device tables, verification and n-gram drafting on "
             "the device) against the session's start (8f3c88e, `git archive`): batch-1 decode ms/token and "
             "nano-vllm tok/s, public API",
        device="cuda", measured_on="NVIDIA H200", minutes="~4 min (3 repeats)",
        bench="ab_commits", args=("--old", "8f3c88e", "--case", "decode_b1", "--case", "throughput"),
    ),
    "ab_issue28_stage4_spec_h200": Table(
        what="the same A/B on EAGLE-3 / ngram speedups of the shipped tiny pair (k = 5, greedy) at batch 1 and 32",
        device="cuda", measured_on="NVIDIA H200", minutes="~6 min (2 repeats)",
        bench="ab_commits", args=("--old", "8f3c88e", "--case", "spec_eagle3_b1", "--case", "spec_eagle3_b32",
                                  "--case", "spec_ngram_b1", "--case", "spec_ngram_b32", "--spec-repeats", "2"),
    ),
    "ab_issue28_stage5_h200": Table(
        what="A/B of issue 28's stage 5 (greedy verification inside the verify graph, the tables' advance and the "
             "draft write replayed from small graphs, draft_model drafting at launch) against 8f3c88e, the redesign's "
             "start (`git archive`): batch-1 decode ms/token and nano-vllm tok/s, public API",
        device="cuda", measured_on="NVIDIA H200", minutes="~4 min (2 repeats)",
        bench="ab_commits", args=("--old", "8f3c88e", "--case", "decode_b1", "--case", "throughput", "--repeats", "2"),
    ),
    "ab_issue28_stage5_spec_h200": Table(
        what="the same A/B on the speedups of the shipped tiny pair's EAGLE-3 head, ngram and draft_model (tiny-llama "
             "drafting for itself) at batch 1 and 32 (k = 5, greedy, 256 tokens)",
        device="cuda", measured_on="NVIDIA H200", minutes="~5 min (1 repeat)",
        bench="ab_commits", args=("--old", "8f3c88e", "--spec-tokens", "256", "--case", "spec_eagle3_b1",
                                  "--case", "spec_eagle3_b32", "--case", "spec_ngram_b1", "--case", "spec_ngram_b32",
                                  "--case", "spec_draft_model_b1", "--case", "spec_draft_model_b32"),
    ),
    "ab_issue28_ablation_h200": Table(
        what="A/B of issue 28's end (f052f8f's research_lm) against 8f3c88e on spec_ablation_h200's k = 5 greedy cells "
             "of eagle3, draft_model and ngram at batch 1, 8 and 32, on the GPU reference target (each tree's own CLI)",
        device="cuda", measured_on="NVIDIA H200", minutes="~5.5 min (1 repeat; + ~8.5 min training when missing)",
        bench="ab_commits", args=("--old", "8f3c88e", "--reference", _REF,
                                  *(a for m in ("eagle3", "draft_model", "ngram") for b in (1, 8, 32)
                                    for a in ("--case", f"ablation_{m}_b{b}"))),
        prepare=(f"{_REF}/target", ("bash", "experiments/train_reference.sh", _REF)),
    ),
    "ab_issue28_ablation_eagle3_b8_h200": Table(
        what="ab_issue28_ablation_h200's eagle3 batch-8 cell (0.870 at one repeat) again with 3 repeats, against "
             "8f3c88e, on the GPU reference target (session 25's research_lm as `new`)",
        device="cuda", measured_on="NVIDIA H200", minutes="~2.5 min (3 repeats; + ~8.5 min training when missing)",
        bench="ab_commits", args=("--old", "8f3c88e", "--reference", _REF, "--spec-repeats", "3",
                                  "--case", "ablation_eagle3_b8"),
        prepare=(f"{_REF}/target", ("bash", "experiments/train_reference.sh", _REF)),
    ),
    "ab_issue28_eagle3_b8_h200": Table(
        what="the same A/B on the shipped tiny pair's EAGLE-3 at batch 8 (k = 5, greedy, 256 tokens), 3 repeats: "
             "whether ab_issue28_ablation_h200's one-repeat eagle3 batch-8 cell is the mechanism's",
        device="cuda", measured_on="NVIDIA H200", minutes="~2.5 min (3 repeats)",
        bench="ab_commits", args=("--old", "8f3c88e", "--spec-tokens", "256", "--spec-repeats", "3",
                                  "--case", "spec_eagle3_b8"),
    ),
    "moe_routing_skew": Table(
        what="routing skew and code-vs-prose drift of small Qwen3-MoE / Qwen2-MoE (shared expert) models trained here "
             "vs random init; rewrites research_lm/assets/moe_traces",
        device="cpu", measured_on="CPU (2 cores)", minutes="~25 min", bench="moe_routing_skew",
    ),
    "bench_attention": Table(
        what="paged attention kernels (decode GB/s, prefill TFLOP/s): triton vs FlashInfer (`.[flashinfer]`) vs "
             "torch_ref vs dense SDPA over batch x context",
        device="cuda", measured_on="NVIDIA H200", minutes="~8 min (estimate)",
        bench="bench_attention",
        smoke=None,  # CUDA graphs and CUDA kernels only: no CPU variant
    ),
    **{f"bench_spec_host_{method}_b{batch}": Table(
        what=f"host µs per step, phase by phase, of plain and {method} (k = 5) decoding of the built-in pair at batch "
             f"{batch}, with ms/token and tau, in one process"
             + (" (and eagle3 waiting for its drafts: the A/B of drafts left on the device)"
                if method == "eagle3" else ""),
        device="cuda", measured_on="NVIDIA H100", minutes="~30 s", bench="bench_spec_host",
        args=("--method", method, "--batch", str(batch)),
        smoke=("--device", "cpu", "--tokens", "8"),
    ) for method in ("eagle3", "ngram") for batch in (1, 8)},
    **{f"bench_spec_host_eagle3_b{batch}_t1": Table(
        what=f"host µs per step, phase by phase, of plain and eagle3 (k = 5) decoding of the built-in pair at batch "
             f"{batch} and temperature 1, with the rejection sampler's kernel and its torch path, in one process",
        device="cuda", measured_on="NVIDIA H100", minutes="~30 s", bench="bench_spec_host",
        args=("--method", "eagle3", "--batch", str(batch), "--temperature", "1.0"),
        smoke=("--device", "cpu", "--tokens", "8"),
    ) for batch in (1, 8)},
    "bench_prefill": Table(
        what="batch-1 time to first token on the GPU reference target, plain and EAGLE-3 (k = 5), with and "
             "without prefill graphs",
        device="cuda", measured_on="NVIDIA H100", minutes="~30 s (+ ~11 min training when missing)",
        bench="bench_prefill", args=("--model", f"{_REF}/target", "--head", f"{_REF}/eagle3"),
        prepare=(f"{_REF}/target", ("bash", "experiments/train_reference.sh", _REF)),
        smoke=("--device", "cpu", "--model", "tiny-llama", "--head", "tiny-llama-eagle3", "--requests", "2"),
    ),
    "eplb_policy": Table(
        what="EPLB policies at DeepSeek-V3 scale: compute ms per rebalance, in-sample and replay balancedness",
        device="cpu", measured_on="CPU (2 cores)", minutes="~25–50 s", bench="bench_eplb_policy",
    ),
    "sim_spec_policy": Table(
        what="the adaptive speculation policy (Thompson sampling) and the moving average it replaced, each over the "
             "best fixed draft cap, in a simulated batch-1 decode: 5 acceptance / draft-cost scenarios x 300 / 1000 "
             "steps, 20 seeds a cell",
        device="cpu", measured_on="CPU (2 cores)", minutes="~15 s", bench="sim_spec_policy",
    ),
    "sim_spec_oracle": Table(
        what="model-free drafting against an oracle target on workload=agentic (the target emits the workload's own "
             "reference answers): ngram k = 3/5/8 vs suffix decoding k = 5/8/24 (path, tree, spec factor 2): tau, "
             "drafts per step, acceptance per position",
        device="cpu", measured_on="CPU (2 cores)", minutes="~1 min", bench="sim_spec_oracle",
        smoke=("--sessions", "2"),
    ),
    "eplb_ablation": Table(
        what="EPLB at DeepSeek-V3 scale (synthetic drift / mix / switch traces) and on the trained MoEs' traces "
             "(research_lm/assets/moe_traces: code, prose, switch): every policy's balancedness (vLLM's per-layer "
             "stats), simulated step, migration, compute ms, slots used; sync vs chunked moves",
        device="cpu", measured_on="CPU (2 cores)", minutes="~5 min", bench="bench_eplb_ablation",
        args=("--trace-dir", "research_lm/assets/moe_traces"),
    ),
    "eplb_ablation_cpu": Table(
        what="eplb_ablation preset: every EPLB policy replayed on a drifting Zipf trace and on a trace recorded "
             "from a random Qwen3-MoE",
        device="cpu", measured_on="CPU (2 cores)", minutes="~3 min",
        sweep=("experiment=eplb_ablation", "logger=none"),
        plots={"report_eplb.png": "eplb_ablation_cpu.png"},
        title="eplb_ablation (CPU)",
        about="Traces: a drifting Zipf synthetic trace, and one recorded from a random-weight Qwen3-MoE "
              "(`model=random-qwen3-moe`, 16 requests): random routers are nearly uniform, so only the Zipf "
              "trace separates the policies. Balancedness = mean / max load per EP rank (vLLM's definition), "
              "time-weighted over the replay; the replays are deterministic, so only the rebalance time "
              "varies between repeats. Per-step series (medians over repeats) in the JSON; plot beside it.",
    ),
    "attention_ablation_h200": Table(
        what="attention_ablation preset at GPU size: one model (Llama-3.2-1B shape, random bf16), every attention "
             "backend x batch 1/16/64/256: end-to-end throughput, latency and KV memory",
        device="cuda", measured_on="NVIDIA H200", minutes="~7 min (torch_ref at batch 1 is a third of it)",
        sweep=(*_ZOO, "experiment=attention_ablation", "model=random-llama-1b", "attention=torch_ref,triton,flashinfer",
               "workload=synthetic", "workload.input_len=[512,512]", "workload.output_len=[128,128]",
               "runner.num_gpu_blocks=12000", "runner.max_num_batched_tokens=8192"),
        # torch_ref (the oracle: pages gathered in Python, eager) at batch 1 only, as the reference point: its
        # batch-16 cell took most of a 10-minute device call and says nothing about the kernels compared here.
        parts=tuple((f"runner.max_num_seqs={b}", f"workload.num_requests={n}", f"warmup_requests={b}",
                     *(() if b == 1 else ("attention=triton,flashinfer",)))
                    for b, n in ((1, 4), (16, 32), (64, 128), (256, 256))),
        repeat_key="seed",
        plots={"report_output_throughput_tok_s_vs_runner.max_num_seqs.png": "attention_ablation_h200_throughput.png",
               "report_tpot_ms_mean_vs_runner.max_num_seqs.png": "attention_ablation_h200_tpot.png"},
        title="attention_ablation on an H200: every backend on one model, end to end",
        about="Llama-3.2-1B shape with random bf16 weights (built once per recipe), synthetic prompts of 512 "
              "tokens and 128 output tokens (ignore_eos), max_num_seqs = the batch, 4 / 2 x batch requests, 3 seeds "
              "per cell, the default runner: async scheduling and CUDA graphs for triton and FlashInfer alike "
              "(FlashInfer's graph-mode wrappers, planned on the host before each replay: the backends' capture "
              "hooks, issue 28), so the rows compare kernels and their planning, not runners. torch_ref (the "
              "oracle: pages gathered in Python, eager) runs at batch 1 only, as the reference point.",
    ),
    "mla_h200": Table(
        what="mla preset at GPU size: KV bytes per token and decode speed of DeepSeek-V2 MLA (latent cache) vs a "
             "same-size dense GQA Llama",
        device="cuda", measured_on="NVIDIA H200", minutes="~2 min",
        sweep=(*_ZOO, "experiment=mla", "attention=triton", *_ZOO_LOAD), repeat_key="seed",
        smoke=_ZOO_SMOKE, title="MLA vs dense GQA (H200)",
        about="Random DeepSeek-V2 (MLA: latent 64 + rope 16 = 80 cached values per token per layer, mla_triton "
              "absorbed decode, reference prefill) against random-llama of the same width and depth (2 KV heads of "
              "32: 128 values) in the same process: 64 code prompts of ~8000 characters, 256 output tokens, batch 64, "
              "3 seeds. Read kv_bytes_per_token_ratio (memory) and tpot_ratio / decode_step_ratio (speed).",
    ),
    "sliding_window_h200": Table(
        what="sliding_window preset at GPU size: KV memory in use and decode speed of a Mistral-style window (64) "
             "vs the same model without it",
        device="cuda", measured_on="NVIDIA H200", minutes="~2 min",
        sweep=(*_ZOO, "experiment=sliding_window", "attention=triton", *_ZOO_LOAD), repeat_key="seed",
        smoke=_ZOO_SMOKE, title="Sliding window vs full attention (H200)",
        about="Random Mistral (window 64 on every layer; blocks wholly outside the window go back to the pool) against "
              "random-llama with the same weights and no window, same process and workload: 64 code prompts of ~8000 "
              "characters, 256 output tokens, batch 64, Triton backend, 3 seeds. Read kv_bytes_used_ratio (memory in "
              "use at the busiest step) and tpot_ratio.",
    ),
    "mamba_h200": Table(
        what="mamba preset at GPU size: state bytes per request and decode speed of Mamba2 (mamba_triton) vs a "
             "same-size dense GQA Llama",
        device="cuda", measured_on="NVIDIA H200", minutes="~2 min",
        sweep=(*_ZOO, "experiment=mamba", "attention=triton", "++attention.mamba_backend=mamba_triton", *_ZOO_LOAD),
        repeat_key="seed", title="Mamba2 vs dense GQA (H200)",
        about="Random Mamba2 (hidden 256, 4 layers, 16 heads of 32, state 64; conv + SSM state slots per request, "
              "mamba_triton kernels) against random-llama (hidden 256, 4 layers) in the same process: 64 code prompts "
              "of ~8000 characters, 256 output tokens, batch 64, prefix caching off for both, 3 seeds. Read "
              "kv_bytes_per_token (0 for Mamba), state_bytes_per_request, kv_bytes_used_ratio and tpot_ratio.",
    ),
    "spec_ablation_h200": Table(
        what="spec_ablation on the GPU reference target: every proposer x k {1,3,5} x batch {1,8,32} x temperature "
             "{0,1}: tau, acceptance per position, draft vs verify time, speedup vs no speculation",
        device="cuda", measured_on="NVIDIA H100",
        minutes="~21 min on one H100, 15 parts of 66-94 s (270 jobs; + ~8.5 min training when missing)",
        sweep=_spec_reference_sweep("1,3,5"), parts=_SPEC_REFERENCE_PARTS,
        prepare=(f"{_REF}/target", ("bash", "experiments/train_reference.sh", _REF)),
        repeat_key="seed",
        plots={"report_speedup_vs_spec.num_speculative_tokens.png": "spec_ablation_h200_speedup.png",
               "report_mean_acceptance_length_vs_spec.num_speculative_tokens.png": "spec_ablation_h200_tau.png"},
        title="spec_ablation on the reference target (GPU)",
        about=_SPEC_REFERENCE_ABOUT + " Both runs schedule asynchronously: greedy EAGLE / EAGLE-3 verify steps launch "
              "before the previous one is verified on the host, other speculative steps are collected before the next "
              "is scheduled.",
    ),
    "spec_ablation_k5_h200": Table(
        what="spec_ablation_h200's k = 5 cells after issue 28 (every proposer launches its next step ahead): every "
             "proposer x batch {1,8,32} x temperature {0,1}",
        device="cuda", measured_on="NVIDIA H200",
        minutes="~7 min on one GPU (90 jobs; + ~8.5 min training when missing)",
        sweep=_spec_reference_sweep("5"), parts=_SPEC_REFERENCE_PARTS,
        prepare=(f"{_REF}/target", ("bash", "experiments/train_reference.sh", _REF)),
        repeat_key="seed",
        title="spec_ablation on the reference target at k = 5, every proposer launching ahead (GPU)",
        about=_SPEC_REFERENCE_ABOUT + " Both runs schedule asynchronously, and every proposer (ngram, EAGLE, EAGLE-3, "
              "Medusa, draft_model) launches its next speculative step before the previous one is collected "
              "where every request is plain greedy (issue 28; a temperature-1 step is collected first); "
              "ab_issue28_ablation_h200 is the same-run A/B of its greedy eagle3 / draft_model / ngram "
              "cells against the commit before the redesign.",
    ),
    "spec_ablation_batch_invariant_h200": Table(
        what="issue 35's losslessness check: every proposer, greedy, k = 5, batch {1, 32} with "
             "runner.batch_invariant=true: outputs_match_baseline must be 1.0 in every cell",
        device="cuda", measured_on="NVIDIA H200",
        minutes="~6 min on one GPU (30 jobs; + ~8.5 min training when missing)",
        sweep=(*_spec_reference_sweep("5")[:6], "spec.num_speculative_tokens=5", "workload.temperature=0.0",
               "workload.max_tokens=64", "runner.num_gpu_blocks=4096", "runner.batch_invariant=true"),
        parts=_spec_parts(_SPEC_PROPOSERS, batches=(1, 32)),
        prepare=(f"{_REF}/target", ("bash", "experiments/train_reference.sh", _REF)),
        repeat_key="seed",
        title="spec_ablation with batch_invariant=True on the reference target (GPU)",
        about=_SPEC_REFERENCE_ABOUT + " Here both runs (speculative and plain) take the batch-invariant kernels "
              "(issue 35: a fixed reduction order per token row whatever the step's batch or query length), so a "
              "verify forward of k + 1 tokens gives each row the bits a one-token decode gives it, and greedy "
              "speculative decoding must equal plain greedy token for token (outputs_match_baseline 1.0) in bf16. "
              "spec_ablation_k5_h200 is the same setting without the switch.",
    ),
    "spec_tree_h200": Table(
        what="EAGLE-3 chain (depth 4) vs static 16-node tree vs EAGLE-2 dynamic tree (15 nodes, topk 4, depth 4) on "
             "the GPU reference target x batch {1,8,32} x temperature {0,1} x speculation policy {always, adaptive}",
        device="cuda", measured_on="NVIDIA H200",
        minutes="~9 min on one GPU (108 jobs; + ~8.5 min training when missing)",
        sweep=("experiment=spec_tree", "device=cuda", "logger=jsonl", "model=hf", f"model.name={_REF}/target",
               f"spec.model={_REF}/eagle3", "workload.temperature=0.0,1.0", "+spec.speculation_policy=always,adaptive",
               "workload.max_tokens=128", "runner.num_gpu_blocks=4096"),
        parts=_SPEC_TREE_PARTS, prepare=(f"{_REF}/target", ("bash", "experiments/train_reference.sh", _REF)),
        repeat_key="seed", title="Token trees vs a chain, EAGLE-3 on the reference target (GPU)",
        about="The GPU reference target and its EAGLE-3 head (spec_ablation_h200's), 8 code prompts at batch 1 and 4 x "
              "batch at 8 and 32, 128 output tokens, 3 seeds per cell; each job also runs the workload without "
              "speculation in the same process (speedup). spec_tree=chain: 4 drafts; tree16: "
              "conf/spec_tree/tree16.yaml (16 nodes, depth 4); dynamic: EAGLE-2 (topk 4, num_draft_tokens 16: 15 "
              "nodes of depth <= 4 chosen per request and step). Trees draft eagerly at collect (no draft graphs); "
              "the chain drafts from graphs and launches ahead. The adaptive policy caps the drafts (tree nodes) each "
              "step verifies at 0, 1, 2, 4, ... or all, whichever it measures fastest per batch size.",
    ),
    "spec_suffix_h200": Table(
        what="suffix decoding (path and tree; k = 5, and k = 24 as vLLM defaults it) vs ngram vs EAGLE-3 (k = 5, "
             "greedy) on the agentic and code workloads, "
             "GPU reference target x batch {1,8,32}",
        device="cuda", measured_on="NVIDIA H200",
        minutes="~8 min on one GPU (90 jobs; + ~8.5 min training when missing)",
        sweep=("experiment=spec_ablation", "device=cuda", "attention=triton", "logger=jsonl", "model=hf",
               f"model.name={_REF}/target", "spec.num_speculative_tokens=5", "workload=agentic,code",
               "workload.max_tokens=128", "runner.num_gpu_blocks=4096"),
        parts=_SPEC_SUFFIX_PARTS, prepare=(f"{_REF}/target", ("bash", "experiments/train_reference.sh", _REF)),
        repeat_key="seed", title="Suffix decoding vs ngram vs EAGLE-3 on agentic and code workloads (GPU)",
        about="The GPU reference target, k = 5 drafts (suffix: at most 5, by spec factor 1 x the match length, and "
              "in one variant at most 24, vLLM's default for suffix (the tree depth): drafts as long as the match; its "
              "tree variant 5 nodes verified as a token tree), greedy, 8 prompts at batch 1 and 4 x batch at 8 and 32, "
              "128 output tokens, 3 seeds per cell; each job also runs the workload without speculation in the same "
              "process. workload=agentic: coding-agent sessions that re-emit and edit earlier outputs (conf/workload/"
              "agentic.yaml); code: stdlib code prompts.",
    ),
    "spec_suffix_cpu": Table(
        what="suffix decoding vs ngram (k = 5, greedy) on the agentic workload, the built-in tiny-llama target at "
             "batch 1 and 8 (CPU): tau over verify steps, tokens per forward over all steps, speedup",
        device="cpu", measured_on="CPU (2 cores)", minutes="~15 min (12 jobs)",
        sweep=("experiment=spec_ablation", "logger=jsonl", "workload=agentic", "spec.num_speculative_tokens=5"),
        parts=_spec_parts((("spec=ngram",), ("spec=suffix",)), batches=(1, 8)), repeat_key="seed",
        title="Suffix decoding vs ngram on the agentic workload (CPU, tiny-llama)",
        about="The built-in tiny-llama target, k = 5 drafts (suffix: vLLM's defaults, at most the match length), "
              "greedy, 8 requests at batch 1 and 32 at batch 8 (4 turns of coding-agent sessions each, conf/workload/"
              "agentic.yaml), 3 seeds per cell; each job also runs the workload without speculation in the same "
              "process. mean_acceptance_length (tau, vLLM's) counts only the steps that verified drafts; "
              "emitted_per_forward counts every step a request emitted in. ngram drafts only where the context "
              "repeats its last 2-5 tokens, suffix decoding on most steps: its tau is lower and its tokens per "
              "forward higher (issue 36).",
    ),
    "spec_mtp_h200": Table(
        what="DeepSeek MTP (k = 1, 3) vs EAGLE-3 (k = 3), greedy, on the agentic and code workloads, GPU reference "
             "DeepSeek-V2 target x batch {1,8,32}",
        device="cuda", measured_on="NVIDIA H200",
        minutes="~5 min on one GPU (estimate: 54 jobs; + ~12 min training when missing)",
        sweep=("experiment=spec_ablation", "device=cuda", "attention=triton", "logger=jsonl", "model=hf",
               f"model.name={_REF_MTP}/mtp", "workload=agentic,code", "workload.temperature=0.0",
               "workload.max_tokens=128", "runner.num_gpu_blocks=4096"),
        parts=_SPEC_MTP_PARTS, prepare=(f"{_REF_MTP}/mtp", ("bash", "experiments/train_reference_mtp.sh", _REF_MTP)),
        repeat_key="seed", title="DeepSeek MTP vs EAGLE-3 on one DeepSeek-V2 target (GPU)",
        about="The GPU reference DeepSeek target (experiments/train_reference_mtp.sh: DeepSeek-V2 with MLA, hidden "
              "192, 24 dense layers, trained like the Llama reference) in its copy with one MTP layer (DeepSeek-V3's "
              "layout), and an EAGLE-3 head of that target; both drafters trained 3500 steps on the target's own "
              "greedy continuations (3 per corpus window). MTP drafts k = 1 (what it was trained for) and k = 3 "
              "(chained, as vLLM's MTP drafter chains one layer); EAGLE-3 k = 3 (ttt_steps 5). Greedy, 8 prompts at "
              "batch 1 and 4 x batch at 8 and 32, 128 output tokens, 3 seeds per cell; each job also runs the "
              "workload without speculation in the same process (speedup). attention=triton: mla_triton for the "
              "target and the MTP layer.",
    ),
    "spec_eagle3_tiny_h200": Table(
        what="EAGLE-3 on the built-in tiny pair: tau, acceptance per position and speedup vs k and batch",
        device="cuda", measured_on="NVIDIA H200", minutes="~6 min (estimate: 12 jobs)",
        sweep=("experiment=eagle3", "gpu=null", "device=cuda", "attention=triton", "logger=jsonl",
               "runner.max_num_seqs=1,8", "spec.num_speculative_tokens=3,5", "workload.num_requests=16",
               "workload.max_tokens=128"),
        smoke=("device=cpu", "attention=torch_ref", "logger=none", "workload.num_requests=2",
               "workload.max_tokens=8"),
        plots={"report_speedup_vs_spec.num_speculative_tokens.png": "spec_eagle3_tiny_h200_speedup.png"},
        title="EAGLE-3 on the built-in tiny pair (GPU)",
        about="The built-in tiny-llama target (0.87M parameters) with its EAGLE-3 head tiny-llama-eagle3, 16 code "
              "prompts x 128 tokens, greedy; each job also runs the same workload without speculation "
              "(the baseline rows) in the same process, so speedup = output tok/s ratio.",
    ),
    "spec_replay_validation_h200": Table(
        what="issue 30's validation: the reference pair's EAGLE-3 (k = 5, batch 1, greedy) for real, then replaying "
             "its own recorded profile (per-request traces) on the same target and workload: tau and speedup side "
             "by side",
        device="cuda", measured_on="NVIDIA H200",
        minutes="~3 min on one GPU (6 jobs; + ~8.5 min training and ~3 min recording when missing)",
        sweep=(*_spec_reference_sweep("5")[:6], "spec.num_speculative_tokens=5", "workload.temperature=0.0",
               "workload.max_tokens=128", "runner.num_gpu_blocks=4096", "spec=eagle3", f"spec.model={_REF}/eagle3",
               "runner.max_num_seqs=1", "workload.num_requests=8", "seed=0"),
        parts=(("acceptance_replay=null",), ("acceptance_replay=reference_eagle3_k5",)),
        prepare=(f"{_PROFILES}/reference_eagle3_k5.json", ("bash", "experiments/record_reference_profiles.sh", _REF)),
        title="Acceptance replay against the run it recorded: the reference pair's EAGLE-3 (GPU)",
        about=_SPEC_REFERENCE_ABOUT + " Here one cell, EAGLE-3 at k = 5, batch 1, greedy, 8 code prompts (seed 0), "
              "three timing repeats: once for real, once replaying research_lm/assets/profiles/"
              "reference_eagle3_k5.json, which experiments/record_reference_profiles.sh recorded from this very "
              "workload (record_acceptance=true: each request's own per-step accepted counts). Replay must give the "
              "real run's tau and speedup within their spread; its outputs are meaningless (outputs_match_baseline "
              "null, acceptance: replayed(...)).",
    ),
    "spec_transfer_8b_h200": Table(
        what="speculative decoding on a Llama-3.1-8B shape (random bf16 weights, triton, CUDA graphs) at vLLM "
             "#20780's published EAGLE-3 acceptance, replayed (issue 30): TPOT, tok/s, speedup, measured vs profile "
             "tau, draft / verify ms of an EAGLE-3 head and a Llama-3.2-1B draft model of real shapes at batch "
             "1/8/32/64, k = 3/5 (EAGLE-3 k = 4 at batch 1), beside vLLM's published 1.75x; and EAGLE-3, the "
             "draft model, Medusa and ngram at the acceptance our trained reference pair recorded "
             "(research_lm/assets/profiles/reference_*_k5.json)",
        device="cuda", measured_on="NVIDIA H200",
        minutes="~12 min (estimate: 10 engines x 3 repeats; + ~1 min writing the drafters' random checkpoints once)",
        bench="bench_spec_transfer",
        args=("--profile", f"{_PROFILES}/reference_eagle3_k5.json", "--draft-profile",
              f"{_PROFILES}/reference_draft_model_k5.json", "--ngram-profile", f"{_PROFILES}/reference_ngram_k5.json",
              "--medusa-profile", f"{_PROFILES}/reference_medusa_k5.json"),
        smoke=("--tiny", "--device", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--batches", "1", "2",
               "--tokens", "8", "--requests", "2", "--prompt-len", "16", "--warmup-tokens", "2",
               "--draft-vocab", "128"),
    ),
    "spec_transfer_8b_h100": Table(
        what="issue 30's goal on vLLM's own GPU kind: EAGLE-3 on a Llama-3.1-8B shape at vLLM #20780's published "
             "acceptance (replayed), batch 1, k = 3/4/5, beside vLLM's 1.75x (H100)",
        device="cuda", measured_on="NVIDIA H100",
        minutes="~2 min (4 engines x 3 repeats; + ~1 min writing the head's random checkpoint once)",
        bench="bench_spec_transfer", args=("--methods", "eagle3", "--batches", "1"),
        smoke=("--tiny", "--device", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--batches", "1",
               "--tokens", "8", "--requests", "2", "--prompt-len", "16", "--warmup-tokens", "2",
               "--draft-vocab", "128", "--methods", "eagle3"),
    ),
}


# issue 29's table wherever the reference pair is trained (its heads train on the GPU that measures them).
TABLES["spec_tree_h100"] = replace(TABLES["spec_tree_h200"], measured_on="NVIDIA H100")

# issue 31's table on vLLM's and gpt-fast's GPU kind too.
TABLES["bench_decode_h100"] = replace(TABLES["bench_decode"], measured_on="NVIDIA H100")

# ngram on the 8B shape at its recorded profile, with echo (README "Acceptance replay"): session 27's H200 table had
# no ngram drafts under replay.
TABLES["spec_transfer_ngram_8b_h100"] = Table(
    what="ngram on a Llama-3.1-8B shape (random bf16 weights, triton, CUDA graphs) at the acceptance our trained "
         "reference pair's ngram recorded (research_lm/assets/profiles/reference_ngram_k5.json), replayed with echo "
         "so it drafts every step: TPOT, tok/s, speedup, tau, draft / verify ms at batch 1/8/32/64, k = 3/5",
    device="cuda", measured_on="NVIDIA H100", minutes="~4 min (estimate: 3 engines x 3 repeats)",
    bench="bench_spec_transfer",
    args=("--methods", "ngram", "--ngram-profile", f"{_PROFILES}/reference_ngram_k5.json"),
    smoke=("--tiny", "--device", "cpu", "--backend", "torch_ref", "--dtype", "float32", "--batches", "1", "2",
           "--tokens", "8", "--requests", "2", "--prompt-len", "16", "--period", "8", "--warmup-tokens", "2",
           "--methods", "ngram",
           "--ngram-profile", f"{_PROFILES}/reference_ngram_k5.json"),
)
TABLES["spec_transfer_ngram_8b_h200"] = replace(TABLES["spec_transfer_ngram_8b_h100"], measured_on="NVIDIA H200")

# The validation and its profile on vLLM's GPU kind too (record the profile on that GPU first:
# `METHODS=eagle3 bash experiments/record_reference_profiles.sh`, so the trace replayed is the run measured).
TABLES["spec_replay_validation_h100"] = replace(TABLES["spec_replay_validation_h200"], measured_on="NVIDIA H100")

# issue 36's tables wherever the device session gets H100s (the references train on the GPU that measures them).
TABLES["spec_suffix_h100"] = replace(TABLES["spec_suffix_h200"], measured_on="NVIDIA H100")
TABLES["spec_mtp_h100"] = replace(TABLES["spec_mtp_h200"], measured_on="NVIDIA H100")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def resolve(name: str, *, allow_cpu: bool = False) -> tuple[Table, bool]:
    """(the table, whether this is a CPU smoke run); PaperError when it cannot run here."""
    if name not in TABLES:
        raise PaperError(f"unknown table {name!r}; choose one of: {', '.join(TABLES)}")
    table = TABLES[name]
    if table.device != "cuda" or cuda_available():
        if table.ranks > cuda_device_count() and table.device == "cuda":
            raise PaperError(f"{name}: needs {table.ranks} CUDA GPUs (measured on {table.measured_on}); "
                             f"{cuda_device_count()} found here.")
        return table, False
    if not allow_cpu:
        raise PaperError(f"{name}: needs a CUDA GPU (measured on {table.measured_on}); none found here. Run it on "
                         "a GPU machine, or add --allow-cpu for a smoke run at tiny sizes on the CPU.")
    if table.smoke is None:
        raise PaperError(f"{name}: needs a CUDA GPU (measured on {table.measured_on}) and has no CPU smoke run.")
    return table, True


def sweep_commands(name: str, *, repeats: int = MIN_REPEATS, extra: tuple[str, ...] = (),
                   sweep_dir: Path | None = None) -> tuple[Path, list[list[str]]]:
    """A sweep table's part commands (argv, `python -m research_lm -m ...`), each into <sweep_dir>/part<i>,
    to run elsewhere (by hand, on several machines); `--from-sweep <sweep_dir>` then writes the table."""
    table = TABLES[name]
    if table.bench is not None:
        raise PaperError(f"{name} is a benchmark script, not a sweep: run `{command(name)}`")
    sweep_dir = sweep_dir or Path("multirun/paper") / name / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    key = "+repeat" if table.repeat_key == "repeat" else table.repeat_key  # `repeat` is not in conf/config.yaml
    overrides = merge_overrides(table.sweep, extra)
    cmds = []
    for i, part in enumerate(table.parts or ((),)):
        part_dir = sweep_dir / f"part{i}" if table.parts else sweep_dir
        cmds.append(["python", "-m", "research_lm", "-m", *merge_overrides(tuple(overrides), part),
                     f"{key}={','.join(map(str, range(repeats)))}", f"hydra.sweep.dir={part_dir}"])
    return sweep_dir, cmds


def table_from_sweep(name: str, sweep_dir: Path, *, repeats: int = MIN_REPEATS, out: Path | None = None,
                     extra: tuple[str, ...] = ()) -> Path:
    """Write table `name` from a sweep already run (`--print-commands`); its commands are recorded as printed."""
    table = TABLES[name]
    _, cmds = sweep_commands(name, repeats=repeats, extra=extra, sweep_dir=Path(sweep_dir))
    out = Path(out) if out is not None else RESULTS
    return write_sweep_table(table, name, Path(sweep_dir), out=out, file_name=name, repeats=repeats,
                             sweep_commands=[" ".join(c) for c in cmds],
                             note="The parts ran from `--print-commands` and the table was written with "
                                  f"`--from-sweep {_rel(Path(sweep_dir))}`.")


def run(name: str, *, repeats: int = MIN_REPEATS, out: Path | None = None, allow_cpu: bool = False,
        extra: tuple[str, ...] = (), sweep_root: Path | None = None, gpus: int = 1) -> Path:
    """Regenerate table `name`: write <out>/<name>.md and .json (and its plots); return the .md path.
    `out` defaults to experiments/results (outputs/paper for a CPU smoke run of a GPU table); `gpus` > 1
    runs a sweep's parts side by side, one per GPU."""
    if repeats < MIN_REPEATS:
        raise PaperError(f"--repeats must be >= {MIN_REPEATS} (each table reports median and spread over repeats)")
    table, smoke = resolve(name, allow_cpu=allow_cpu)
    file_name = f"{name}_cpu_smoke" if smoke else name
    out = Path(out) if out is not None else (Path("outputs/paper") if smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    if table.prepare is not None and not smoke and not Path(table.prepare[0]).exists():
        print("+ " + " ".join(table.prepare[1]), flush=True)  # e.g. train the models the table measures
        env = {**os.environ, "GPUS": str(gpus)}  # train_reference.sh trains its heads side by side
        if subprocess.run(list(table.prepare[1]), env=env).returncode != 0:
            raise PaperError(f"{name}: preparing {table.prepare[0]} failed (see above)")
    if table.bench is not None:
        args = [*table.args, *(table.smoke if smoke else ()), *extra]
        return run_bench(table.bench, args, repeats=repeats, out=out, file_name=file_name, ranks=table.ranks)
    overrides = merge_overrides(table.sweep, table.smoke if smoke else (), extra)
    return run_sweep(table, name, overrides, repeats=repeats, out=out, file_name=file_name,
                     sweep_root=sweep_root or Path("multirun/paper"), gpus=gpus)


def import_bench(module: str) -> Any:
    """experiments/<module>.py, imported as the scripts see each other (they import `bench_common`)."""
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    return importlib.import_module(module)


def run_bench(bench: str, args: list[str], *, repeats: int, out: Path, file_name: str, ranks: int = 1) -> Path:
    """experiments/<bench>.py's main(argv) (it aggregates its repeats and writes the table itself); with ranks > 1,
    the script under torchrun, one process per rank (rank 0 writes the table)."""
    argv = [*args, "--repeats", str(repeats), "--out", str(out), "--name", file_name]
    if ranks == 1:
        import_bench(bench).main(argv)
    elif subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                         str(EXPERIMENTS / f"{bench}.py"), *argv]).returncode != 0:
        raise PaperError(f"{bench}: a rank of {ranks} failed (see above)")
    return out / f"{file_name}.md"


def merge_overrides(*groups: tuple[str, ...]) -> list[str]:
    """Hydra overrides, a later `key=value` replacing an earlier one with the same key (Hydra refuses two)."""
    merged: dict[str, str] = {}
    for group in groups:
        for item in group:
            merged[item.partition("=")[0]] = item
    return list(merged.values())


def run_sweep(table: Table, name: str, overrides: list[str], *, repeats: int, out: Path, file_name: str,
              sweep_root: Path, gpus: int = 1) -> Path:
    """The Hydra multirun with +repeat=0..N-1 (one per part), its report aggregated over the repeats, the table.

    gpus > 1: up to that many parts run at once, part i on GPU i mod gpus (of those CUDA_VISIBLE_DEVICES lists
    when it is set, so two tables can share a host: CUDA_VISIBLE_DEVICES=2,3 ... --gpus 2), each
    with its log in <part dir>.log. Every job compares against its own baseline in its own process, so
    speedups stay like for like; the host is shared, so give each part its own cores' worth of work."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    sweep_dir = Path(sweep_root) / file_name / stamp
    key = "+repeat" if table.repeat_key == "repeat" else table.repeat_key  # `repeat` is not in conf/config.yaml
    commands, running, failed = [], [], []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu_ids = visible.split(",") if visible else [str(j) for j in range(gpus)]
    for i, part in enumerate(table.parts or ((),)):
        part_dir = sweep_dir / f"part{i}" if table.parts else sweep_dir
        cmd = [sys.executable, "-m", "research_lm", "-m", *merge_overrides(tuple(overrides), part),
               f"{key}={','.join(map(str, range(repeats)))}", f"hydra.sweep.dir={part_dir}"]
        commands.append(" ".join(["python", *cmd[1:]]))
        print("+ " + commands[-1], flush=True)
        env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
        if gpus <= 1:
            if subprocess.run(cmd, env=env).returncode != 0:
                raise PaperError(f"{name}: the sweep failed (see its output above; its jobs are in {part_dir})")
            continue
        if len(running) == gpus:  # wait for the oldest part: GPUs are handed out round-robin
            failed += _wait(running.pop(0))
        part_dir.mkdir(parents=True, exist_ok=True)
        log = open(f"{part_dir}.log", "w")  # noqa: SIM115 (closed by _wait)
        env["CUDA_VISIBLE_DEVICES"] = gpu_ids[i % gpus]
        running.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, part_dir))
    for proc in running:
        failed += _wait(proc)
    if failed:
        raise PaperError(f"{name}: sweep part(s) failed: see {', '.join(f'{d}.log' for d in failed)}")
    return write_sweep_table(table, name, sweep_dir, out=out, file_name=file_name, repeats=repeats,
                             sweep_commands=commands)


def _wait(proc: tuple[subprocess.Popen, Any, Path]) -> list[Path]:
    """Wait for one parallel part; [its dir] when it failed."""
    popen, log, part_dir = proc
    code = popen.wait()
    log.close()
    print(f"{'done' if code == 0 else 'FAILED'}: {part_dir} (log {part_dir}.log)", flush=True)
    return [] if code == 0 else [part_dir]


def write_sweep_table(table: Table, name: str, sweep_dir: Path, *, out: Path, file_name: str, repeats: int,
                      sweep_commands: list[str], note: str = "") -> Path:
    """The report of every job under `sweep_dir` (grouped over the repeat key) as <out>/<file_name>.md + .json,
    with the table's plots copied beside it. `note`: a sentence about how this copy was measured."""
    from research_lm.harness.env_info import command_line
    from research_lm.harness.report import build_report

    key = "+repeat" if table.repeat_key == "repeat" else table.repeat_key
    report = build_report(sweep_dir, repeat_key=table.repeat_key)
    data = json.loads((sweep_dir / "report.json").read_text())
    copied = {}
    for plot, target in table.plots.items():
        if (sweep_dir / plot).is_file():
            target = target.replace(name, file_name, 1)
            shutil.copyfile(sweep_dir / plot, out / target)
            copied[plot] = target
    body = report.read_text().splitlines()[2:]  # without the "# Report: <dir>" heading
    smoke = file_name != name
    warning = ["**CPU smoke run (`--allow-cpu`): tiny sizes on a CPU, the numbers mean nothing.**", ""] if smoke else []
    lines = [f"# {table.title or name}", "", *warning, table.about, "",
             f"Regenerate: `{command(name)}` (needs {'a CUDA GPU' if table.device == 'cuda' else 'a CPU'}; "
             f"{table.minutes} at 3 repeats). It runs the sweep(s) below ({repeats} repeats of every cell, `{key}`) "
             f"and `python -m research_lm.harness.report {_rel(sweep_dir)} --repeat-key {table.repeat_key}`.", ""]
    if note:
        lines += [note, ""]
    for line in body:
        if line == "Plots:" and not copied:
            continue
        if line.startswith("!["):  # a plot: keep the ones copied beside the table
            plot = line[line.index("(") + 1 : -1]
            if plot not in copied:
                continue
            line = line.replace(f"({plot})", f"({copied[plot]})")
        lines.append(line)
    md = out / f"{file_name}.md"
    md.write_text("\n".join(lines).rstrip() + "\n")
    payload: dict[str, Any] = {"table": name, "command": command_line(),
                               "sweep_command": sweep_commands[0] if len(sweep_commands) == 1 else sweep_commands,
                               "sweep_dir": _rel(sweep_dir), "device_needed": table.device, "note": note or None,
                               "measured_on": table.measured_on, "spread": "min-max over repeats",
                               "env": data.get("env"), "report": data}
    (out / f"{file_name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(md.read_text())
    return md


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def listing() -> str:
    """The registry as a markdown table (what experiments/paper/README.md shows)."""
    lines = ["| table | command | device needed | approx. time (3 repeats) | what |", "| --- | --- | --- | --- | --- |"]
    for name, t in TABLES.items():
        gpus = f"{t.ranks} CUDA GPUs" if t.ranks > 1 else "CUDA GPU"
        device = f"{gpus} (measured on {t.measured_on})" if t.device == "cuda" else t.measured_on
        lines.append(f"| `{name}` | `{command(name)}` | {device} | {t.minutes} | {t.what} |")
    return "\n".join(lines)
