"""The batch-invariant GEMM (research_lm/ops/batch_invariant.py `linear`) against cuBLAS (F.linear), per layer shape.

    python experiments/bench_invariant_gemm.py                      # Llama-3.2-1B's projections, M = 1 / 8 / 64 / 512
    python experiments/bench_invariant_gemm.py --shape llama-3.1-8b --m 1 64
    python experiments/bench_invariant_gemm.py --sweep --m 1 64 256  # + the best tile per layer over those Ms
    python experiments/bench_invariant_gemm.py --sweep --m 1 64 256 --tune TUNED  # + writes them where
                                            # linear_config reads them (TUNED: research_lm/assets/tuned/<...>.json)
    python experiments/bench_invariant_gemm.py --tiny --device cpu  # a smoke run (interpreter)

Each row: one projection [M, K] x [N, K]^T in the shape's dtype, µs per call (median), the invariant kernel's tile,
the ratio, and two checks that say what the kernel is for: whether cuBLAS's first row changes with M (it may: its
kernel follows the problem size), and whether the invariant kernel's does (it must not). This is the tuning loop of
issue 35's cost (PERFORMANCE.md, twenty-fourth pass): the end-to-end tables are bench_decode_batch_invariant_h200 and
bench_throughput_batch_invariant_h200.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from bench_common import (
    SHAPES,
    TINY,
    add_repeat_args,
    cell,
    env_line,
    gpu_ms,
    merge_tuned,
    repeats_line,
    run_table,
)

NAME = "bench_invariant_gemm"


def projections(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Layer name -> (N, K) of a Llama-family decoder's GEMMs (qkv and gate_up fused, as research_lm runs them)."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * inter, h), "down_proj": (h, inter),
            "lm_head": (shape["vocab_size"], h)}


def _config_name(c) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k}/{c.split_k} w{c.num_warps}s{c.num_stages}"


def tune(weights: list[torch.Tensor], xs: dict[int, torch.Tensor], cublas: dict[int, float], device: torch.device):
    """--sweep: the tile whose worst ratio to cuBLAS over the Ms is lowest (one tile serves every M: that is what
    keeps a row's bits independent of M). Two stages: BLOCK_N x split-K at linear_config's K step, then the K step,
    warps and stages around the best. Returns (config, {M: µs}); tiles that do not fit the GPU are skipped."""
    from dataclasses import replace

    from research_lm.ops.batch_invariant import linear, linear_config

    def timed(c) -> dict[int, float] | None:
        try:
            return {m: graph_us(lambda w, c=c, x=x: linear(x, w, config=c), weights, device) for m, x in xs.items()}
        except Exception as e:  # triton's OutOfResources (shared memory) and the like: not a candidate here
            print(f"  skip {_config_name(c)}: {type(e).__name__}", flush=True)
            return None

    def best(candidates):
        results = {c: t for c in dict.fromkeys(candidates) if (t := timed(c)) is not None}
        return min(results.items(), key=lambda ct: max(ct[1][m] / cublas[m] for m in xs))

    base = replace(linear_config(*weights[0].shape, weights[0].dtype), num_warps=4, num_stages=3)
    top, _ = best(replace(base, block_n=bn, split_k=sk) for bn in (16, 32, 64, 128) for sk in (1, 2, 4, 8))
    return best(replace(top, block_k=bk, num_warps=w, num_stages=st)
                for bk in (64, 128, 256) for w, st in ((4, 3), (4, 4), (8, 3), (8, 4)))


def graph_us(fn, weights: list[torch.Tensor], device: torch.device) -> float:
    """µs per call of fn(w) over the weights, all calls captured in one CUDA graph as in a model's decode graph: no
    host launch time between them (a Triton launch costs tens of µs of host time, more than a small GEMM's kernel;
    timing calls one by one measured that instead, session 26) and no L2 hit across them (distinct weights, as across
    layers; triton's do_bench flushes the L2 between replays)."""
    if device.type != "cuda":
        return gpu_ms(lambda: [fn(w) for w in weights], device) * 1e3 / len(weights)
    import triton

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles (a tile that does not fit raises here, outside the capture)
        for w in weights:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    return triton.testing.do_bench(graph.replay, warmup=5, rep=30, return_mode="median") * 1e3 / len(weights)


def weight_copies(n: int, k: int, dtype: torch.dtype) -> int:
    """Distinct weights per timing graph: enough to overflow a Hopper L2 (50 MB) by 2x, 2 to 16."""
    return max(2, min(16, -(-100_000_000 // (n * k * dtype.itemsize))))


def write_tuned(path: Path, device_name: str, tuned: dict[tuple[int, int], tuple[Any, dict[int, float], dict]]):
    """Merge this GPU's tiles into TUNED_CONFIGS' JSON (other GPUs' entries stay), with the ratios they measured."""
    from dataclasses import asdict

    merge_tuned(path, device_name,
                "Batch-invariant GEMM tiles per GPU model and 16-bit (N, K), written by "
                "`python experiments/bench_invariant_gemm.py --sweep --tune`: the tile with the lowest worst ratio to "
                "cuBLAS over the measured Ms (µs per call beside it).",
                {f"{n}x{k}": {"config": asdict(config), "us": {str(m): round(t, 2) for m, t in us.items()},
                              "cublas_us": {str(m): round(t, 2) for m, t in cublas.items()}}
                 for (n, k), (config, us, cublas) in tuned.items()})


def measure(args) -> dict[str, Any]:
    from research_lm.ops.batch_invariant import linear, linear_config

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = TINY if args.tiny else SHAPES[args.shape]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows, tuned = [], {}
    for layer, (n, k) in projections(shape).items():
        weight = torch.randn(n, k, generator=gen).to(device, dtype)
        copies = weight_copies(n, k, dtype) if device.type == "cuda" else 1  # (the L2 question is a GPU's)
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        x_max = torch.randn(max(args.m), k, generator=gen).to(device, dtype)
        first = {}
        for m in args.m:
            x = x_max[:m]
            cublas = graph_us(lambda w, x=x: torch.nn.functional.linear(x, w), weights, device)
            invariant = graph_us(lambda w, x=x: linear(x, w), weights, device)
            first[m] = (torch.nn.functional.linear(x, weight)[0], linear(x, weight)[0])
            c = linear_config(n, k, dtype, torch.cuda.get_device_name(device) if device.type == "cuda" else None)
            rows.append({"layer": layer, "n": n, "k": k, "m": m, "cublas_us": cublas, "invariant_us": invariant,
                         "ratio": invariant / cublas, "tile": _config_name(c)})
        layer_rows = rows[-len(args.m):]
        if args.sweep:
            xs = {m: x_max[:m] for m in args.m}
            cublas = {r["m"]: r["cublas_us"] for r in layer_rows}
            config, us = tune(weights, xs, cublas, device)
            tuned[(n, k)] = (config, us, cublas)
            for row in layer_rows:
                row["best_tile"], row["best_us"] = _config_name(config), us[row["m"]]
        m0 = min(args.m)
        for row in layer_rows:
            row["cublas_row_changes"] = not torch.equal(first[row["m"]][0], first[m0][0])
            row["invariant_row_changes"] = not torch.equal(first[row["m"]][1], first[m0][1])
    if args.tune and tuned and device.type == "cuda" and dtype.itemsize == 2:
        write_tuned(Path(args.tune), torch.cuda.get_device_name(device), tuned)
    return {"shape_name": "tiny" if args.tiny else args.shape, "dtype": args.dtype, "rows": rows}


def render(payload: dict[str, Any]) -> str:
    lines = [env_line(payload["env"]), "",
             f"The batch-invariant GEMM against cuBLAS, {payload['shape_name']} shape, {payload['dtype']}: µs per "
             "call (median of triton's do_bench over a CUDA graph of calls on distinct weights: `graph_us`), "
             "and whether the first row's bits change from the smallest M. "
             + repeats_line(payload), "",
             "| layer | N x K | M | cuBLAS µs | invariant µs | ratio | tile (M x N x K / split-K, warps, stages) | "
             "best of --sweep | its µs | cuBLAS row changes | invariant row changes |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | --- |"]
    for r in payload["rows"]:
        lines.append(f"| {r['layer']} | {r['n']} x {r['k']} | {r['m']} | {cell(r, 'cublas_us', '.1f')} | "
                     f"{cell(r, 'invariant_us', '.1f')} | {cell(r, 'ratio', '.2f')} | {r['tile']} | "
                     f"{r.get('best_tile', '—')} | {cell(r, 'best_us', '.1f')} | {r.get('cublas_row_changes')} | "
                     f"{r.get('invariant_row_changes')} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="a tiny shape: a smoke run of the code paths")
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 64, 512], help="token counts (rows)")
    p.add_argument("--sweep", action="store_true",
                   help="also search the tile with the lowest worst ratio to cuBLAS over --m (see tune)")
    p.add_argument("--tune", metavar="JSON", help="with --sweep on a GPU in 16 bits: merge the found tiles into this "
                   "file (research_lm/assets/tuned/batch_invariant_gemm.json is the one linear_config reads)")
    add_repeat_args(p, default_repeats=1)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    name = args.name or (NAME if not args.tiny else NAME + "_tiny")
    return run_table(name, torch.device(args.device), args, measure, render, ("layer", "m"))


if __name__ == "__main__":
    main()
