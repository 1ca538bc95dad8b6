"""Decode of a Llama-shaped model (random weights, bf16): ms per step, against the floor.

Default: batch 1 of the Llama-3.2-1B shape; `--shape llama-3.1-8b` and `--batch N` show the trend.

    python experiments/bench_decode.py --profile                    # on a CUDA GPU
    python experiments/bench_decode.py --shape llama-3.1-8b --batch 64 --name bench_decode_8b_b64
    python experiments/bench_decode.py --tiny --device cpu --backend torch_ref --steps 8   # smoke run
    python -m experiments.paper bench_decode                        # the committed table (experiments/paper/)

Rows, all measured in this process, the whole table `--repeats` times (default 3): each cell shows the
median over the repeats and their min–max where they differ:
- floor: the parameter bytes (tied embedding once) over the device copy bandwidth (read + write)
  measured here: no decode step can read its weights faster. At `--batch N` the floor adds the KV cache a
  step reads at the mean context of the measured steps (N x context x layers x 2 x kv heads x head dim x
  dtype bytes); tok/s is N tokens per step.
- research_lm eager / CUDA graphs / compiled + CUDA graphs (`compile=True`: torch.compile'd forward,
  captured in the decode graphs; skipped, with the reason in the table, where EngineConfig has no
  `compile`) (`--backend`, triton by default): one request, a `--prompt-len` prompt, then each
  `engine.step()` timed on the host (`--batch N`: N equal-length requests decoding together). The
  sampler's `.tolist()` waits for the GPU,
  so a step's wall time is the whole step: schedule, input prep, forward, logits, sampling,
  bookkeeping. Median over `--steps` steps after `--warmup`.
- "forward alone": the model forward of one decode step (every request) without the rest of the step (CUDA events;
  eager launches are host-bound, so that row is the host's launch time).
- transformers generate, dynamic cache and `cache_implementation="static"` (which transformers compiles
  itself): (t(N new tokens) - t(1 new token)) / (N - 1), after a warm-up call (the compilation).
`--profile` adds the host time of each stage of a research_lm step, with a device sync after each
stage (so each stage carries its GPU work), and the top CUDA kernels of an eager step (torch.profiler).
Prints a table last; writes experiments/results/bench_decode.{md,json}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
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

NAME = "bench_decode"
# research_lm rows: label -> LLM keywords
VARIANTS: dict[str, dict[str, Any]] = {
    "research_lm eager": {"cuda_graphs": False},
    "research_lm CUDA graphs": {"cuda_graphs": True},
    "research_lm compiled + CUDA graphs": {"cuda_graphs": True, "compile": True},
}


def build_llm(path: str, args, **variant: Any):
    from research_lm import LLM

    max_len = args.prompt_len + args.warmup + max(args.steps, args.profile_steps) + 16
    n = args.batch
    return LLM(
        path, load_format="dummy", dtype=args.dtype, device=args.device, attention_backend=args.backend,
        max_num_seqs=n, max_num_batched_tokens=max(args.prompt_len * n, 256), max_model_len=max_len,
        num_gpu_blocks=n * -(-max_len // 16) + 2, enable_prefix_caching=False, cuda_graph_sizes=[n], **variant,
    )  # fmt: skip


def unsupported(variant: dict[str, Any]) -> str | None:
    """Why this research_lm cannot build the variant (a keyword EngineConfig lacks), or None."""
    from research_lm.config import EngineConfig

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
    from research_lm.cuda_graphs import graph_metadata

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
    stages = [("schedule", sched, "schedule"), ("prepare_inputs", runner, "_prepare_inputs"),
              ("forward (eager)", runner.model, "forward"), ("forward (graph replay)", runner.cuda_graphs, "run"),
              ("logits", runner.model, "compute_logits"), ("sample", runner, "_sample_or_verify"),
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

    patched = [(obj, attr) for _, obj, attr in stages if obj is not None]
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
        for obj, attr in patched:
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
    for label, variant in VARIANTS.items():
        graphs = variant.get("cuda_graphs", False)
        row: dict[str, Any] = {"variant": label, "backend": args.backend}
        llm = engine = None
        if (reason := unsupported(variant)) is not None:
            print(f"{label}: {reason}", flush=True)
            rows.append(row | {"error": reason})
            continue
        try:
            llm = build_llm(path, args, **variant)
            engine = llm.engine
            if graphs and engine.runner.cuda_graphs is None:
                raise RuntimeError("graphs were not captured (see the warning above)")
            times = decode_steps(engine, prompts, args.warmup, args.steps)
            row |= {"ms": statistics.median(times) * 1e3, "mean_ms": statistics.fmean(times) * 1e3,
                    "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3}  # fmt: skip
            forward = {"variant": f"{label}: forward alone", "ms": forward_alone_ms(engine, device)}
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
    rows = []
    model = hf_model(bench_shape(args), device, dtype)
    ids = torch.tensor(prompts, device=device)  # [batch, prompt_len]: equal lengths, no padding

    def generate(n: int, **kw) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kw)
        sync(device)
        assert out.shape[1] == ids.shape[1] + n, out.shape
        return time.perf_counter() - t0

    variants = [("transformers dynamic cache", {}, args.hf_dynamic_steps),
                ("transformers static cache (compiled)", {"cache_implementation": "static"}, args.steps)]  # fmt: skip
    if args.skip_hf_static:
        variants = variants[:1]
    for label, kw, n in variants:
        row: dict[str, Any] = {"variant": label, "transformers_steps": n}
        try:
            row["first_call_s"] = generate(n, **kw)  # static: includes torch.compile
            t1 = min(generate(1, **kw) for _ in range(3))
            tn = min(generate(n, **kw) for _ in range(2))
            row["ms"] = (tn - t1) / (n - 1) * 1e3
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
    model = None
    free_cuda()
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--backend", default="triton")
    p.add_argument("--tiny", action="store_true", help="a tiny shape: a smoke run of the code paths")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES), help="the model shape (random weights)")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--hf-dynamic-steps", type=int, default=32, help="the dynamic cache is slow: fewer steps")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-hf-static", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=32)
    add_repeat_args(p)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    name = args.name or (NAME if not args.tiny else NAME + "_tiny")
    return run_table(name, torch.device(args.device), args, measure, render, ("variant",))


def bench_shape(args) -> dict[str, Any]:
    return TINY if args.tiny else SHAPES[args.shape]


def kv_bytes_per_step(shape: dict[str, Any], batch: int, context: float, dtype: torch.dtype) -> float:
    """K and V of every layer for `batch` requests at `context` tokens: what a decode step's attention reads."""
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * head_dim * dtype.itemsize
    return batch * context * per_token


def measure(args) -> dict[str, Any]:
    """One repeat of the whole table: the ceiling, the research_lm rows and transformers' rows."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)  # --dtype choices are torch dtype names
    shape = bench_shape(args)
    copy_bw = copy_bandwidth(device)
    path = model_dir(shape)
    rng = random.Random(0)
    prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.batch)]

    from research_lm.models.loader import build_model, load_config

    probe = build_model(load_config(path), device="cpu", dtype=dtype, attention_backend="torch_ref")  # torch.empty
    wbytes = weight_bytes(probe)
    context = args.prompt_len + args.warmup + args.steps / 2  # the mean context of the measured steps
    kv_bytes = kv_bytes_per_step(shape, args.batch, context, dtype) if args.batch > 1 else 0.0
    floor_ms = (wbytes + kv_bytes) / copy_bw * 1e3
    label = "floor: weight bytes / copy bandwidth" if not kv_bytes else "floor: (weight + KV bytes) / copy bandwidth"
    rows: list[dict[str, Any]] = [{"variant": label, "ms": floor_ms}]
    rows += research_lm_rows(path, args, prompts, device)
    if not args.skip_hf:
        rows += hf_rows(args, prompts, device, dtype)
    return {
        "copy_tb_s": copy_bw / 1e12, "weight_bytes": wbytes, "kv_bytes_per_step": kv_bytes, "shape": shape,
        "shape_name": "tiny" if args.tiny else args.shape, "batch": args.batch, "dtype": args.dtype,
        "prompt_len": args.prompt_len, "steps": args.steps, "warmup": args.warmup, "rows": rows,
    }  # fmt: skip


def render(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    floor = rows[0]["ms"]
    static = next((r.get("ms") for r in rows if r["variant"].startswith("transformers static")), None)
    s = payload["shape"]
    batch = payload.get("batch", 1)
    name = {"llama-3.1-8b": "Llama-3.1-8B", "tiny": "tiny"}.get(payload.get("shape_name"), "Llama-3.2-1B")
    kv = payload.get("kv_bytes_per_step") or 0
    kv_note = (f" The floor adds the KV cache a step reads at the mean context of the measured steps "
               f"({kv / 1e9:.3f} GB for {batch} requests)." if kv else "")
    head = (
        f"{env_line(payload['env'])}\n\nBatch-{batch} decode, {name} shape (hidden {s['hidden_size']}, "
        f"{s['num_hidden_layers']} layers, {s['num_attention_heads']}/{s['num_key_value_heads']} heads, vocab "
        f"{s['vocab_size']}, {'tied' if s.get('tie_word_embeddings', True) else 'untied'}), random weights, "
        f"{payload['dtype']}; {batch} prompt(s) of {payload['prompt_len']} tokens, "
        f"median of {payload['steps']} decode steps after {payload['warmup']}. Weights "
        f"{payload['weight_bytes'] / 1e9:.3f} GB; copy bandwidth {payload['copy_tb_s']:.2f} TB/s (read+write, "
        f"measured in this run).{kv_note} tok/s: output tokens per second of the whole batch. \"× floor\": ms / "
        f"floor ms; \"vs HF static\": transformers static ms / ms. {repeats_line(payload)}\n"
    )
    lines = []
    stages = [r for r in rows if "stages_ms" in r]
    if stages:
        names = list(stages[0]["stages_ms"])
        lines += ["Stages of a research_lm decode step, ms (a device sync closes each stage, so each carries its "
                  "GPU work; the step total is therefore a little above the unsynchronized median):", "",
                  "| stage | " + " | ".join(r["variant"] for r in stages) + " |",
                  "| --- |" + " ---: |" * len(stages)]  # fmt: skip
        for n in names:
            lines.append(f"| {n} | " + " | ".join(_stage(r, n) for r in stages) + " |")
        lines.append("")
    for r in rows:
        if "kernels" in r:
            k = r["kernels"]
            lines += [f"CUDA kernels of a {r['variant']} step: {k['kernel_ms_per_step']:.3f} ms of kernel time per "
                      "step; the top ones:", "", "| kernel | ms/step | launches/step |",
                      "| --- | ---: | ---: |"]  # fmt: skip
            lines += [f"| `{t['kernel']}` | {t['ms_per_step']:.3f} | {t['launches_per_step']} |" for t in k["top"]]
            lines.append("")
    lines += [head, "| variant | ms/step | tok/s | × floor | vs HF static | note |",
              "| --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['variant']} | — | — | — | — | {r.get('error', '')} |")
            continue
        ms = r["ms"]
        note = ""
        if "p90_ms" in r:
            note = f"mean {cell(r, 'mean_ms', '.3f')}, p90 {cell(r, 'p90_ms', '.3f')}"
        if "first_call_s" in r:
            note = f"first call (compile, warm-up) {r['first_call_s']:.1f} s; {r['transformers_steps']} tokens"
        if r.get("errors"):
            note += f"; {len(r['errors'])} repeat(s) failed: {r['errors'][0]}"
        vs = f"{static / ms:.2f}" if static else "—"
        lines.append(f"| {r['variant']} | {cell(r, 'ms', '.3f')} | {cell(r, 'ms', '.0f', lambda v: batch * 1e3 / v)} | "
                     f"{ms / floor:.2f} | {vs} | {note} |")
    return "\n".join(lines)


def _stage(row: dict[str, Any], stage: str) -> str:
    value = row["stages_ms"].get(stage, 0.0)
    return cell({"v": value, "spread": {"v": (row.get("spread") or {}).get(f"stages_ms.{stage}")}}, "v", ".3f")


if __name__ == "__main__":
    main()
