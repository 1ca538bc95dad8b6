"""Decode of a Llama-shaped model (random weights, bf16): ms per step, against the floor.

Default: batch 1 of the Llama-3.2-1B shape. `--shape llama-3.1-8b` picks the Llama-3.1-8B shape, and
`--batch N [M ...]` decodes N equal-length requests together (each batch size in turn, in one table).

    python experiments/bench_decode.py --profile                    # on a CUDA GPU: the 1B batch-1 table
    python experiments/bench_decode.py --shape llama-3.1-8b --batch 1 64 --steps 32 --warmup 8
    python experiments/bench_decode.py --tiny --device cpu --backend torch_ref --steps 8   # smoke run
    python -m experiments.paper bench_decode                        # the committed tables (experiments/paper/)
    python -m experiments.paper bench_decode_8b                     # the 8B shape at batch 1 and 64

Rows, all measured in this process, the whole table `--repeats` times (default 3): each cell shows the
median over the repeats and their min–max where they differ. At each `--batch` N:
- floor: (the parameter bytes (tied embedding once) + the KV bytes a step reads at the mean context of the
  measured steps: N x context x layers x 2 x kv heads x head dim x dtype bytes) over the device copy bandwidth
  (read + write) measured here: no decode step can read its weights and KV cache faster.
- research_lm eager / CUDA graphs / compiled + CUDA graphs (`compile=True`: torch.compile'd forward,
  captured in the decode graphs; skipped, with the reason in the table, where EngineConfig has no
  `compile`) (`--backend`, triton by default): N requests of `--prompt-len` random tokens (seeded), prefilled
  in one step, then each `engine.step()` (one token of every request) timed on the host; max_num_seqs,
  max_num_batched_tokens, num_gpu_blocks and cuda_graph_sizes=[N] follow N. The sampler's `.tolist()` waits
  for the GPU, so a step's wall time is the whole step: schedule, input prep, forward, logits, sampling,
  bookkeeping. Median over `--steps` steps after `--warmup`.
- "forward alone": the model forward of one decode step (every request) without the rest of the step (CUDA
  events; eager launches are host-bound, so that row is the host's launch time).
- transformers generate of the same N prompts as one batch (equal lengths: no padding), dynamic cache
  (`--hf-dynamic-steps`, slow: few steps; `--skip-hf-dynamic` leaves it out) and
  `cache_implementation="static"` (which transformers compiles itself): (t(S new tokens) - t(1 new token)) /
  (S - 1), after a warm-up call (the compilation).
- gpt-fast (`--peer-gptfast PATH`, batch 1 of the 1B shape only): the peer probe of ../shared/peers (gpt-fast's own
  model.py and its recipe, torch.compile mode="reduce-overhead"), run as a subprocess of this command in each
  repeat, its median ms per step read from its JSON line. The peer's code is measured, never committed: copy
  ../shared/peers to an ignored folder (the paper entry reads .peers/peer_gptfast.py; missing, the row says so).
ms/step is per engine step (all N rows); tok/s = N / step time; GB/s = (weight + KV bytes) / step time;
"× floor" = ms / the floor at that batch.
Each model is freed before the next is built (an 8B model is 16 GB in bf16).
`--profile` adds the host time of each stage of a research_lm step, with a device sync after each
stage (so each stage carries its GPU work), and the top CUDA kernels of an eager step (torch.profiler); it
is meant for the batch-1 table (it runs at every batch given, but is not part of the 8B paper table).
Prints a table last; writes experiments/results/<name>.{md,json}: bench_decode for the 1B shape at batch 1,
else e.g. bench_decode_8b_b1-64 (`--name` sets it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from bench_common import (
    SHAPES,
    TINY,
    add_repeat_args,
    cell,
    copy_bandwidth,
    env_line,
    free_cuda,
    gpu_ms,
    hf_model,
    model_dir,
    repeats_line,
    run_table,
    sync,
    weight_bytes,
)

import research_lm.worker.runner as runner_module

NAME = "bench_decode"
DEFAULT_SHAPE = "llama-3.2-1b"
SHAPE_NAMES = {"llama-3.2-1b": "Llama-3.2-1B", "llama-3.1-8b": "Llama-3.1-8B", "tiny": "tiny"}
# research_lm rows: label -> LLM keywords
VARIANTS: dict[str, dict[str, Any]] = {
    "research_lm eager": {"cuda_graphs": False},
    "research_lm CUDA graphs, synchronous steps": {"cuda_graphs": True, "async_scheduling": False},
    "research_lm CUDA graphs": {"cuda_graphs": True},  # (batch 1: the skinny GEMVs, skinny_rows=1 by default)
    "research_lm CUDA graphs, per-op (skinny_rows=0)": {"cuda_graphs": True, "skinny_rows": 0},  # cuBLAS: the A/B
    "research_lm CUDA graphs, skinny_rows=4": {"cuda_graphs": True, "skinny_rows": 4},  # the all-rows kernel
    "research_lm compiled + CUDA graphs": {"cuda_graphs": True, "compile": True},
    "research_lm CUDA graphs batch-invariant": {"cuda_graphs": True, "batch_invariant": True},  # issue 35's cost
}


def build_llm(path: str, args, n: int, **variant: Any):
    """research_lm on the dummy-loaded shape, sized for `n` requests decoding together."""
    from research_lm import LLM

    max_len = args.prompt_len + args.warmup + max(args.steps, args.profile_steps) + 16
    return LLM(
        path, load_format="dummy", dtype=args.dtype, device=args.device, attention_backend=args.backend,
        max_num_seqs=n, max_num_batched_tokens=max(args.prompt_len * n, 256), max_model_len=max_len,
        num_gpu_blocks=n * -(-max_len // 16) + 2, enable_prefix_caching=False, cuda_graph_sizes=[n], **variant,
    )  # fmt: skip


def unsupported(variant: dict[str, Any]) -> str | None:
    """Why this research_lm cannot build the variant (a keyword EngineConfig lacks), or None."""
    from research_lm.api.config import EngineConfig

    missing = [k for k in variant if k not in EngineConfig.__dataclass_fields__]
    return f"skipped: EngineConfig has no {', '.join(missing)}" if missing else None


def add_requests(engine, prompts: list[list[int]], max_tokens: int) -> None:
    from research_lm import SamplingParams

    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def decode_steps(engine, prompts: list[list[int]], warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps of the greedy requests (after prefill and `warmup` steps)."""
    add_requests(engine, prompts, 1 + warmup + steps)
    engine.step()  # prefill (and the first token): max_num_batched_tokens holds every prompt
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    assert not engine.has_unfinished_requests()
    return times


def forward_alone_ms(engine, device: torch.device) -> float:
    """One decode token's forward over the step buffers (graph replay when captured), as the step runs it."""
    from research_lm.worker.cuda_graphs import graph_metadata

    runner = engine.runner
    buf = runner.buffers
    n = runner.max_num_seqs  # every request of the batch
    seq_len = int(buf.seq_lens.np[:n].max())  # left by the last step
    common = graph_metadata(buf, n, runner.block_size, max_seq_len=seq_len)
    if runner.cuda_graphs is not None:
        return gpu_ms(lambda: runner.cuda_graphs.run(common), device)
    ids, pos = buf.input_ids.gpu[:n], buf.positions.gpu[:n]

    @torch.inference_mode()
    def forward():
        return runner.model(ids, pos, {b.name: b.build_metadata(common) for b in runner.backends})

    return gpu_ms(forward, device)


def stage_profile(engine, prompts: list[list[int]], steps: int, device: torch.device) -> dict[str, float]:
    """Mean ms per decode step in each stage, a device sync closing each stage."""
    runner, sched = engine.runner, engine.scheduler
    stages = [("schedule", sched, "schedule"), ("prepare_inputs", runner_module, "prepare_step_inputs"),
              ("forward (eager)", runner.model, "forward"), ("forward (graph replay)", runner.cuda_graphs, "replay"),
              ("logits", runner.model, "compute_logits"), ("sample", runner_module, "sample_or_verify"),
              ("advance the tables", runner.state, "advance"),
              ("collect (wait for the ids)", runner, "collect"),
              ("update_from_output", sched, "update_from_output"),
              ("metrics", engine.metrics, "record_step")]  # fmt: skip
    totals: dict[str, float] = defaultdict(float)
    recording = [False]

    def timed(name, fn):
        def wrapper(*a, **k):
            if not recording[0]:
                return fn(*a, **k)
            sync(device)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync(device)
            totals[name] += time.perf_counter() - t0
            return out

        return wrapper

    patched = [(obj, attr, getattr(obj, attr)) for _, obj, attr in stages if obj is not None]
    for name, obj, attr in stages:
        if obj is not None:
            setattr(obj, attr, timed(name, getattr(obj, attr)))
    try:
        original_step = engine.step

        def step():
            recording[0] = True
            sync(device)
            t0 = time.perf_counter()
            out = original_step()
            sync(device)
            totals["step (total)"] += time.perf_counter() - t0
            recording[0] = False
            return out

        engine.step = step
        add_requests(engine, prompts, 2 + steps)
        original_step()  # prefill
        original_step()
        for _ in range(steps):
            engine.step()
    finally:
        engine.__dict__.pop("step", None)
        for obj, attr, fn in patched:  # a module's function is put back; an instance's wrapper goes
            if isinstance(obj, types.ModuleType):
                setattr(obj, attr, fn)
            else:
                obj.__dict__.pop(attr, None)
    out = {k: v / steps * 1e3 for k, v in totals.items()}
    out["other (metadata, outputs, engine)"] = out["step (total)"] - sum(
        v for k, v in out.items() if k != "step (total)"
    )
    return out


def kernel_profile(engine, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """The CUDA kernels of `steps` decode steps: time per step, and the top kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    add_requests(engine, prompts, 2 + steps)
    engine.step()
    engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
    torch.cuda.synchronize()
    kernels = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if t > 0 and evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((evt.key, t / 1e3 / steps, evt.count // steps))
    kernels.sort(key=lambda k: -k[1])
    return {
        "kernel_ms_per_step": sum(k[1] for k in kernels),
        "top": [{"kernel": k[:90], "ms_per_step": ms, "launches_per_step": n} for k, ms, n in kernels[:10]],
    }


def research_lm_rows(path: str, args, prompts: list[list[int]], device: torch.device) -> list[dict[str, Any]]:
    rows = []
    batch = len(prompts)
    for label, variant in VARIANTS.items():
        if args.variant and label not in args.variant:
            continue
        graphs = variant.get("cuda_graphs", False)
        row: dict[str, Any] = {"batch": batch, "variant": label, "backend": args.backend}
        llm = engine = None
        if (reason := unsupported(variant)) is not None:
            print(f"{label}: {reason}", flush=True)
            rows.append(row | {"error": reason})
            continue
        try:
            llm = build_llm(path, args, batch, **variant)
            engine = llm.engine
            if graphs and engine.runner.cuda_graphs is None:
                raise RuntimeError("graphs were not captured (see the warning above)")
            times = decode_steps(engine, prompts, args.warmup, args.steps)
            row |= {"ms": statistics.median(times) * 1e3, "mean_ms": statistics.fmean(times) * 1e3,
                    "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3}  # fmt: skip
            forward = {"batch": batch, "variant": f"{label}: forward alone", "ms": forward_alone_ms(engine, device)}
            if args.profile and not variant.get("compile"):  # the stage wrappers would be traced by dynamo
                row["stages_ms"] = stage_profile(engine, prompts, args.profile_steps, device)
                if device.type == "cuda" and not graphs:
                    row["kernels"] = kernel_profile(engine, prompts, 8)
            rows += [row, forward]
        except Exception as e:  # reported in the table, not fatal: the other rows still run
            rows.append(row | {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
        finally:
            llm = engine = None
            free_cuda()
    return rows


def hf_rows(args, prompts: list[list[int]], device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """transformers generate of the prompts as one batch: dynamic cache, then the (compiled) static cache."""
    batch = len(prompts)
    variants = [("transformers dynamic cache", {}, args.hf_dynamic_steps, args.skip_hf_dynamic, "--skip-hf-dynamic"),
                ("transformers static cache (compiled)", {"cache_implementation": "static"}, args.steps,
                 args.skip_hf_static, "--skip-hf-static")]  # fmt: skip
    rows = [{"batch": batch, "variant": label} | ({"error": f"skipped ({flag})"} if skip else {"transformers_steps": n})
            for label, _, n, skip, flag in variants]  # fmt: skip
    todo = [(row, kw, n) for row, (_, kw, n, skip, _) in zip(rows, variants, strict=True) if not skip]
    if not todo:
        return rows
    try:
        model = hf_model(bench_shape(args), device, dtype)
    except Exception as e:  # e.g. out of memory: the rows say so, the table is still written
        free_cuda()
        error = f"building the model: {type(e).__name__}: {str(e).splitlines()[0][:140]}"
        return [row | {"error": error} if "error" not in row else row for row in rows]
    ids = torch.tensor(prompts, device=device)  # [batch, prompt_len]: equal lengths, no padding

    def generate(n: int, **kw) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kw)
        sync(device)
        assert out.shape[1] == ids.shape[1] + n, out.shape
        return time.perf_counter() - t0

    for row, kw, n in todo:
        try:
            row["first_call_s"] = generate(n, **kw)  # static: includes torch.compile
            t1 = min(generate(1, **kw) for _ in range(3))
            tn = min(generate(n, **kw) for _ in range(2))
            if tn <= t1:  # a loaded machine and too few steps: the difference is timer noise, not a step
                raise RuntimeError(f"{n} steps took no longer than 1: raise --hf-dynamic-steps / --steps")
            row["ms"] = (tn - t1) / (n - 1) * 1e3
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    model = ids = None
    free_cuda()
    return rows


PEER = "gpt-fast (peer: its model.py and recipe)"


def peer_row(args, batch: int) -> dict[str, Any]:
    """gpt-fast's batch-1 ms per step from its probe, run here as a subprocess (its compile and graphs stay there)."""
    row = {"batch": batch, "variant": PEER}
    if batch != 1 or args.tiny or args.shape != DEFAULT_SHAPE:
        return row | {"error": f"skipped: the probe runs batch 1 of the {DEFAULT_SHAPE} shape"}
    if not Path(args.peer_gptfast).is_file():
        return row | {"error": f"no probe at {args.peer_gptfast}: copy ../shared/peers there"}
    free_cuda()
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, args.peer_gptfast], capture_output=True, text=True,
                              env={**os.environ, "OUT": out}, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return row | {"error": f"probe failed (rc {proc.returncode}): {(proc.stderr or proc.stdout)[-160:]!r}"}
    return row | {"ms": float(json.loads(lines[-1])["gptfast_bs1_ms_per_step"])}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--backend", default="triton")
    p.add_argument("--tiny", action="store_true", help="a tiny shape: a smoke run of the code paths")
    p.add_argument("--shape", default=DEFAULT_SHAPE, choices=sorted(SHAPES), help="the model shape (random weights)")
    p.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[1],
        help="requests decoding together (several: each in turn, one table)",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--hf-dynamic-steps", type=int, default=32, help="the dynamic cache is slow: fewer steps")
    p.add_argument("--skip-hf", action="store_true", help="no transformers rows")
    p.add_argument("--skip-hf-dynamic", action="store_true", help="no transformers dynamic-cache row")
    p.add_argument("--skip-hf-static", action="store_true")
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS),
                   help="only these research_lm rows (repeat the flag); default: all")
    p.add_argument("--peer-gptfast", help="gpt-fast's probe script (../shared/peers/peer_gptfast.py, copied): a row")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=32)
    add_repeat_args(p)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser()
    args = p.parse_args(argv)
    if min(args.batch) < 1 or len(set(args.batch)) != len(args.batch):
        p.error(f"--batch: distinct sizes >= 1, got {args.batch}")
    if min(args.steps, args.hf_dynamic_steps) < 2:
        p.error("--steps and --hf-dynamic-steps must be >= 2 (transformers' rows difference two calls)")
    return run_table(default_name(args), torch.device(args.device), args, measure, render, ("batch", "variant"))


def default_name(args) -> str:
    """--name, else bench_decode for the default (Llama-3.2-1B, batch 1), a suffix per departure from it:
    `_8b` for --shape llama-3.1-8b, `_b1-64` for --batch 1 64, `_tiny`."""
    if args.name:
        return args.name
    name = NAME
    if not args.tiny and args.shape != DEFAULT_SHAPE:
        name += "_" + args.shape.rsplit("-", 1)[-1]
    if args.batch != [1]:
        name += "_b" + "-".join(map(str, args.batch))
    return name + ("_tiny" if args.tiny else "")


FLOOR = "floor: (weight + KV bytes) / copy bandwidth"


def bench_shape(args) -> dict[str, Any]:
    return TINY if args.tiny else SHAPES[args.shape]


def kv_bytes_per_step(shape: dict[str, Any], batch: int, context: float, dtype: torch.dtype) -> float:
    """K and V of every layer for `batch` requests at `context` tokens: what a decode step's attention reads."""
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim * dtype.itemsize
    return batch * context * per_token


def measure(args) -> dict[str, Any]:
    """One repeat of the whole table: at each batch size, the floor, the research_lm rows and transformers'."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)  # --dtype choices are torch dtype names
    shape = bench_shape(args)
    copy_bw = copy_bandwidth(device)
    path = model_dir(shape)

    from research_lm.models.loader import build_model, load_config

    probe = build_model(load_config(path), device="cpu", dtype=dtype, attention_backend="torch_ref")  # torch.empty
    wbytes = weight_bytes(probe)
    probe = None
    # the mean context of the measured steps: after the prefill step (prompt + its first token), decode step i
    # (from 0) writes the KV of position prompt + i and attends over prompt + 1 + i tokens; the measured steps
    # are i = warmup ... warmup + steps - 1
    context = args.prompt_len + 1 + args.warmup + (args.steps - 1) / 2
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        rng = random.Random(0)  # the same first prompt at every batch size
        prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(batch)]
        kv_bytes = kv_bytes_per_step(shape, batch, context, dtype)
        rows.append({"batch": batch, "variant": FLOOR, "ms": (wbytes + kv_bytes) / copy_bw * 1e3, "kv_bytes": kv_bytes})
        rows += research_lm_rows(path, args, prompts, device)
        if not args.skip_hf:
            rows += hf_rows(args, prompts, device, dtype)
        if args.peer_gptfast:
            rows.append(peer_row(args, batch))
        if device.type == "cuda":  # every model was freed: a leak here would add up over batches and repeats
            print(f"batch {batch} done; CUDA memory still allocated {torch.cuda.memory_allocated(device) / 1e9:.2f} GB",
                  flush=True)  # fmt: skip
    return {
        "copy_tb_s": copy_bw / 1e12, "weight_bytes": wbytes, "shape": shape,
        "shape_name": "tiny" if args.tiny else args.shape, "batches": args.batch, "dtype": args.dtype,
        "prompt_len": args.prompt_len, "steps": args.steps, "warmup": args.warmup, "mean_context": context,
        "rows": rows,
    }  # fmt: skip


def render(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    batches = payload["batches"]
    multi = len(batches) > 1

    def at(r: dict[str, Any]) -> int:
        return int(r.get("batch", 1))

    def label(r: dict[str, Any]) -> str:
        return f"batch {at(r)}: {r['variant']}" if multi else r["variant"]

    floor = {at(r): r for r in rows if r["variant"] == FLOOR}
    static = {at(r): r["ms"] for r in rows if r["variant"].startswith("transformers static") and "ms" in r}
    s = payload["shape"]
    name = SHAPE_NAMES.get(payload.get("shape_name"), payload.get("shape_name"))
    kv = ", ".join(f"{floor[b]['kv_bytes'] / 1e9:.3f} GB" + (f" at batch {b}" if multi else "")
                   for b in batches if b in floor)  # fmt: skip
    which = f"Batch-{batches[0]} decode" if not multi else f"Decode at batch {', '.join(map(str, batches))}"
    same = " (at the same batch)" if multi else ""
    prompts = f"{batches[0]} prompt(s)" if not multi else "at each batch size that many prompts (decoding together)"
    head = (
        f"{env_line(payload['env'])}\n\n{which}, {name} shape (hidden {s['hidden_size']}, "
        f"{s['num_hidden_layers']} layers, {s['num_attention_heads']}/{s['num_key_value_heads']} heads, vocab "
        f"{s['vocab_size']}, {'tied' if s.get('tie_word_embeddings', True) else 'untied'}), random weights, "
        f"{payload['dtype']}; {prompts} of {payload['prompt_len']} random tokens, "
        f"median of {payload['steps']} decode steps after {payload['warmup']}. Weights "
        f"{payload['weight_bytes'] / 1e9:.3f} GB; copy bandwidth {payload['copy_tb_s']:.2f} TB/s (read+write, "
        f"measured in this run). Floor: (weight bytes + the KV cache a step reads at the mean context of the "
        f"measured steps, {payload['mean_context']:.0f} tokens: {kv}) / copy bandwidth. ms/step: one engine step "
        f"(a token of every request); tok/s: output tokens per second of the whole batch (batch / step time); "
        f"GB/s: the floor's bytes (weights + KV) / step time, the floor row's being the copy bandwidth. "
        f'"× floor": ms / floor ms{same}; "vs HF static": transformers static ms / ms{same}. {repeats_line(payload)}\n'
    )
    lines = []
    stages = [r for r in rows if "stages_ms" in r]
    if stages:
        names = list(dict.fromkeys(n for r in stages for n in r["stages_ms"]))  # every variant's, in order
        lines += ["Stages of a research_lm decode step, ms (a device sync closes each stage, so each carries its "
                  "GPU work; the step total is therefore a little above the unsynchronized median; with async "
                  "scheduling the syncs also undo the overlap, so its total is no measure of its step):", "",
                  "| stage | " + " | ".join(label(r) for r in stages) + " |",
                  "| --- |" + " ---: |" * len(stages)]  # fmt: skip
        for n in names:
            lines.append(f"| {n} | " + " | ".join(_stage(r, n) for r in stages) + " |")
        lines.append("")
    for r in rows:
        if "kernels" in r:
            k = r["kernels"]
            lines += [f"CUDA kernels of a {label(r)} step: {k['kernel_ms_per_step']:.3f} ms of kernel time per "
                      "step; the top ones:", "", "| kernel | ms/step | launches/step |",
                      "| --- | ---: | ---: |"]  # fmt: skip
            lines += [f"| `{t['kernel']}` | {t['ms_per_step']:.3f} | {t['launches_per_step']} |" for t in k["top"]]
            lines.append("")
    first = "| batch " if multi else ""
    lines += [head, first + "| variant | ms/step | tok/s | GB/s | × floor | vs HF static | note |",
              ("| ---: " if multi else "") + "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for r in rows:
        b = at(r)
        lead = f"| {b} " if multi else ""
        if "ms" not in r or r.get("num_repeats") == 0:  # (every repeat failed: its ms are not a measurement)
            error = r.get("error") or f"every repeat failed: {(r.get('errors') or [''])[0]}"
            lines.append(f"{lead}| {r['variant']} | — | — | — | — | — | {error} |")
            continue
        ms = r["ms"]
        note = ""
        if "p90_ms" in r:
            note = f"mean {cell(r, 'mean_ms', '.3f')}, p90 {cell(r, 'p90_ms', '.3f')}"
        if "first_call_s" in r:
            note = f"first call (compile, warm-up) {r['first_call_s']:.1f} s; {r['transformers_steps']} tokens"
        if r.get("errors"):
            note += f"; {len(r['errors'])} repeat(s) failed: {r['errors'][0]}"
        vs = f"{static[b] / ms:.2f}" if b in static else "—"
        fl = f"{ms / floor[b]['ms']:.2f}" if b in floor else "—"
        read = payload["weight_bytes"] + (floor[b]["kv_bytes"] if b in floor else 0)  # bytes a step must read
        tok_s = cell(r, "ms", ".0f", lambda v, b=b: b * 1e3 / v)
        gb_s = cell(r, "ms", ".0f", lambda v, n=read: n / v / 1e6)
        lines.append(f"{lead}| {r['variant']} | {cell(r, 'ms', '.3f')} | {tok_s} | {gb_s} | {fl} | {vs} | {note} |")
    return "\n".join(lines)


def _stage(row: dict[str, Any], stage: str) -> str:
    if stage not in row["stages_ms"]:
        return "—"
    value = row["stages_ms"][stage]
    return cell({"v": value, "spread": {"v": (row.get("spread") or {}).get(f"stages_ms.{stage}")}}, "v", ".3f")


if __name__ == "__main__":
    main()
