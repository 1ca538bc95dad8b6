"""Tensor-parallel decode of a Llama-shaped model (random weights, bf16): ms per step at TP = 1 and TP = N, each
against its floor. Run by torchrun, one process per GPU:

    torchrun --nproc-per-node 2 experiments/bench_tensor_parallel.py --shape llama-3.1-8b --batch 1 64
    torchrun --nproc-per-node 2 experiments/bench_tensor_parallel.py --tiny --device cpu --backend torch_ref \
        --dtype float32 --batch 1 2 --steps 4 --warmup 1 --prompt-len 16 --repeats 1   # a CPU smoke run (gloo)

Rows, all measured in this run, the whole table `--repeats` times (median, min–max), at each `--batch` B:
- floor at TP = t: what one GPU must read per step, (weight bytes / t + the KV bytes of its KV heads at the mean
  context of the measured steps) over the device copy bandwidth (read + write) measured here; the ranks stream their
  shares at once, and the all-reduces (2 per layer) are not counted: what TP cannot beat.
- research_lm at TP = 1 (rank 0 alone, the other ranks waiting) and at TP = N (every rank), CUDA graphs and async
  scheduling as configured by default (`--eager` for neither): B requests of `--prompt-len` random tokens, prefilled
  in one step, then each `engine.step()` timed on rank 0's host (research_lm.bench_decode's `decode_steps`).
ms/step is per engine step (all B rows); tok/s = B / step time; "× floor" = ms / the floor at that TP and batch;
"vs TP = 1" = TP-1 ms / ms. Prints a table last; rank 0 writes experiments/results/<name>.{md,json}
(bench_tensor_parallel_<shape>_tp<N>_b<batches>, or `--name`).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from bench_common import (
    SHAPES,
    TINY,
    add_repeat_args,
    cell,
    copy_bandwidth,
    env_line,
    free_cuda,
    model_dir,
    run_table,
    weight_bytes,
)
from bench_decode import build_llm, decode_steps

SHAPE_NAMES = {"llama-3.2-1b": "Llama-3.2-1B", "llama-3.1-8b": "Llama-3.1-8B",
               "llama-3.1-70b-32l": "Llama-3.1-70B (32 of 80 layers)", "tiny": "tiny"}


def floor_bytes(shape: dict[str, Any], weight_bytes: int, tp: int, batch: int, context: float,
                dtype: torch.dtype) -> tuple[float, float]:
    """(weight bytes, KV bytes) one rank reads per decode step at TP = tp: its 1/tp of the weights (the replicated
    norms are negligible), its KV heads (one each when there are fewer KV heads than ranks)."""
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    kv_heads = max(shape["num_key_value_heads"] // tp, 1)
    kv = batch * context * shape["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype.itemsize
    return weight_bytes / tp, kv


def weight_bytes_of(path: str, dtype: torch.dtype) -> int:
    from research_lm.models.loader import build_model, load_config

    probe = build_model(load_config(path), device="cpu", dtype=dtype, attention_backend="torch_ref")  # torch.empty
    return weight_bytes(probe)


def research_lm_row(path: str, args, prompts: list[list[int]], tp: int) -> dict[str, Any]:
    variant = {"cuda_graphs": False, "async_scheduling": False} if args.eager else {}
    row: dict[str, Any] = {"batch": len(prompts), "tp": tp, "variant": f"research_lm TP = {tp}"}
    llm = None
    try:
        llm = build_llm(path, args, len(prompts), tensor_parallel_size=tp, **variant)
        times = decode_steps(llm.engine, prompts, args.warmup, args.steps)
        row |= {"ms": statistics.median(times) * 1e3, "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3,
                "graphs": llm.engine.runner.cuda_graphs is not None}
    except Exception as e:  # reported in the table; the other rows still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        llm = None
        free_cuda()
    return row


def measure(args) -> dict[str, Any]:
    """One repeat: at each batch, the floors, TP = 1 on rank 0 (the others wait) and TP = N on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    host = args.host_group
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = TINY if args.tiny else SHAPES[args.shape]
    path = args.path
    wbytes = weight_bytes_of(path, dtype)
    copy_bw = copy_bandwidth(device)
    context = args.prompt_len + 1 + args.warmup + (args.steps - 1) / 2
    rows: list[dict[str, Any]] = []
    for batch in args.batch:
        rng = random.Random(0)
        prompts = [[rng.randrange(shape["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(batch)]
        for tp in (1, world):
            w, kv = floor_bytes(shape, wbytes, tp, batch, context, dtype)
            rows.append({"batch": batch, "tp": tp, "variant": f"floor at TP = {tp}", "ms": (w + kv) / copy_bw * 1e3})
        if rank == 0:
            rows.append(research_lm_row(path, args, prompts, 1))
        dist.barrier(group=host)  # the other ranks wait (on the host) while rank 0 measures TP = 1
        rows.append(research_lm_row(path, args, prompts, world))
    return {"copy_tb_s": copy_bw / 1e12, "weight_bytes": wbytes, "shape": shape, "world": world,
            "shape_name": "tiny" if args.tiny else args.shape, "batches": args.batch, "dtype": args.dtype,
            "prompt_len": args.prompt_len, "steps": args.steps, "warmup": args.warmup, "mean_context": context,
            "rows": rows}


def render(payload: dict[str, Any]) -> str:
    rows, s, n = payload["rows"], payload["shape"], payload["world"]
    floor = {(r["batch"], r["tp"]): r["ms"] for r in rows if r["variant"].startswith("floor")}
    tp1 = {r["batch"]: r["ms"] for r in rows if r["variant"] == "research_lm TP = 1" and "ms" in r}
    name = SHAPE_NAMES.get(payload["shape_name"], payload["shape_name"])
    head = (
        f"{env_line(payload['env'])}; {n} ranks (torchrun)\n\nDecode at batch {', '.join(map(str, payload['batches']))}"
        f", {name} shape (hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, {s['num_attention_heads']}/"
        f"{s['num_key_value_heads']} heads, vocab {s['vocab_size']}), random weights, {payload['dtype']}; at each "
        f"batch that many prompts of {payload['prompt_len']} random tokens, median of {payload['steps']} decode steps "
        f"after {payload['warmup']}. Weights {payload['weight_bytes'] / 1e9:.3f} GB; copy bandwidth "
        f"{payload['copy_tb_s']:.2f} TB/s (one GPU, read+write, measured in this run). Floor at TP = t: (weights / t "
        f"+ one rank's KV heads at the mean context, {payload['mean_context']:.0f} tokens) / copy bandwidth, "
        f"communication not counted. \"× floor\": ms / the floor at the same TP and batch; \"vs TP = 1\": TP-1 "
        f"ms / ms at the same batch.\n"
    )
    lines = [head, "| batch | variant | ms/step | tok/s | × floor | vs TP = 1 | note |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        b = r["batch"]
        if "ms" not in r:
            lines.append(f"| {b} | {r['variant']} | — | — | — | — | {r.get('error', '')} |")
            continue
        ms = r["ms"]
        measured = "graphs" in r
        note = ("CUDA graphs" if r["graphs"] else "eager") if measured else ""
        vs_tp1 = f"{tp1[b] / ms:.2f}" if measured and b in tp1 else "—"
        lines.append(f"| {b} | {r['variant']} | {cell(r, 'ms', '.3f')} | {b / ms * 1e3:,.0f} | "
                     f"{ms / floor[b, r['tp']]:.2f} | {vs_tp1} | {note} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--backend", default="triton")
    p.add_argument("--tiny", action="store_true", help="a tiny shape: a smoke run of the code paths")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES), help="the model shape (random weights)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="requests decoding together, each in turn")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs, no async scheduling")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="the process groups' timeout")
    add_repeat_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.profile_steps = 0  # bench_decode.build_llm sizes max_model_len with it
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("run me with torchrun --nproc-per-node N (N >= 2 ranks, one GPU each)")
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # our own group (the engine's TP runs reuse it), with a timeout that covers rank 0's TP = 1 rows
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=timeout)
    args.host_group = dist.new_group(backend="gloo", timeout=timeout)
    shape = TINY if args.tiny else SHAPES[args.shape]
    box = [model_dir(shape) if rank == 0 else None]  # one config dir, rank 0's (same machine)
    dist.broadcast_object_list(box, group=args.host_group, group_src=0)
    args.path = box[0]
    world = dist.get_world_size()
    name = args.name or (f"bench_tensor_parallel_{'tiny' if args.tiny else args.shape.rsplit('-', 1)[-1]}_tp{world}"
                         f"_b{'-'.join(map(str, args.batch))}")
    if rank == 0:
        run_table(name, torch.device(args.device), args, measure, render, ("batch", "variant"))
    else:
        for _ in range(args.repeats):
            measure(args)
    dist.barrier(group=args.host_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
