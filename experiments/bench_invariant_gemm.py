"""The batch-invariant GEMM (research_lm/ops/batch_invariant.py `linear`) against cuBLAS (F.linear), per layer shape.

    python experiments/bench_invariant_gemm.py                      # Llama-3.2-1B's projections, M = 1 / 8 / 64 / 512
    python experiments/bench_invariant_gemm.py --shape llama-3.1-8b --m 1 64
    python experiments/bench_invariant_gemm.py --sweep              # + the fastest (BLOCK_N, split-K) per cell
    python experiments/bench_invariant_gemm.py --tiny --device cpu  # a smoke run (interpreter)

Each row: one projection [M, K] x [N, K]^T in the shape's dtype, µs per call (median), the invariant kernel's tile,
the ratio, and two checks that say what the kernel is for: whether cuBLAS's first row changes with M (it may: its
kernel follows the problem size), and whether the invariant kernel's does (it must not). This is the tuning loop of
issue 35's cost (PERFORMANCE.md, twenty-fourth pass): the end-to-end tables are bench_decode_batch_invariant_h200 and
bench_throughput_batch_invariant_h200.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from bench_common import SHAPES, TINY, add_repeat_args, cell, env_line, gpu_ms, repeats_line, run_table

NAME = "bench_invariant_gemm"


def projections(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Layer name -> (N, K) of a Llama-family decoder's GEMMs (qkv and gate_up fused, as research_lm runs them)."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * inter, h), "down_proj": (h, inter),
            "lm_head": (shape["vocab_size"], h)}


SWEEP = [(block_n, split_k) for block_n in (16, 32, 64, 128) for split_k in (1, 2, 4, 8)]


def best_config(x: torch.Tensor, weight: torch.Tensor, device: torch.device) -> tuple[str, float]:
    """--sweep: the fastest (BLOCK_N, SPLIT_K) of SWEEP at this M, keeping linear_config's BLOCK_M and BLOCK_K (a rule
    for linear_config must then pick one config per (N, K) for every M)."""
    from dataclasses import replace

    from research_lm.ops.batch_invariant import linear, linear_config

    base = linear_config(*weight.shape, weight.dtype)
    times = {}
    for block_n, split_k in SWEEP:
        c = replace(base, block_n=block_n, split_k=split_k)
        times[f"{c.block_m}x{block_n}x{c.block_k}/{split_k}"] = gpu_ms(lambda c=c: linear(x, weight, config=c),
                                                                     device) * 1e3
    tile = min(times, key=times.get)
    return tile, times[tile]


def measure(args) -> dict[str, Any]:
    from research_lm.ops.batch_invariant import linear, linear_config

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = TINY if args.tiny else SHAPES[args.shape]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for layer, (n, k) in projections(shape).items():
        weight = torch.randn(n, k, generator=gen).to(device, dtype)
        x_max = torch.randn(max(args.m), k, generator=gen).to(device, dtype)
        first = {}
        for m in args.m:
            x = x_max[:m]
            cublas = gpu_ms(lambda x=x, w=weight: torch.nn.functional.linear(x, w), device) * 1e3
            invariant = gpu_ms(lambda x=x, w=weight: linear(x, w), device) * 1e3
            first[m] = (torch.nn.functional.linear(x, weight)[0], linear(x, weight)[0])
            c = linear_config(n, k, dtype)
            rows.append({"layer": layer, "n": n, "k": k, "m": m, "cublas_us": cublas, "invariant_us": invariant,
                         "ratio": invariant / cublas, "tile": f"{c.block_m}x{c.block_n}x{c.block_k}/{c.split_k}"})
            if args.sweep:
                rows[-1]["best_tile"], rows[-1]["best_us"] = best_config(x, weight, device)
        m0 = min(args.m)
        for row in rows[-len(args.m):]:
            row["cublas_row_changes"] = not torch.equal(first[row["m"]][0], first[m0][0])
            row["invariant_row_changes"] = not torch.equal(first[row["m"]][1], first[m0][1])
    return {"shape_name": "tiny" if args.tiny else args.shape, "dtype": args.dtype, "rows": rows}


def render(payload: dict[str, Any]) -> str:
    lines = [env_line(payload["env"]), "",
             f"The batch-invariant GEMM against cuBLAS, {payload['shape_name']} shape, {payload['dtype']}: µs per "
             "call (median of triton's do_bench), and whether the first row's bits change from the smallest M. "
             + repeats_line(payload), "",
             "| layer | N x K | M | cuBLAS µs | invariant µs | ratio | tile (M x N x K / split-K) | best of --sweep | "
             "its µs | cuBLAS row changes | invariant row changes |",
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
    p.add_argument("--sweep", action="store_true", help="also time every (BLOCK_N, SPLIT_K) of SWEEP: the best")
    add_repeat_args(p, default_repeats=1)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    name = args.name or (NAME if not args.tiny else NAME + "_tiny")
    return run_table(name, torch.device(args.device), args, measure, render, ("layer", "m"))


if __name__ == "__main__":
    main()
