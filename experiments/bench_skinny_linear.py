"""A decoder layer's projections at a few rows: the skinny kernels (research_lm/ops/skinny_linear.py, norm and SwiGLU
and residual fused in) against the per-op path they replace (the fused RMSNorm kernel, cuBLAS, the SwiGLU kernel).

    python experiments/bench_skinny_linear.py                        # Llama-3.2-1B's projections, M = 1 / 2 / 4
    python experiments/bench_skinny_linear.py --sweep --tune TUNED   # + the best tile per projection and M,
                                  # written where skinny_tiles reads them (research_lm/assets/tuned/skinny_linear.json)
    python experiments/bench_skinny_linear.py --rows-per-program 4  # the all-rows kernel (skinny_rows > 1)
    python experiments/bench_skinny_linear.py --tiny --device cpu    # a smoke run (interpreter)

Each row: one projection with what the skinny path fuses into it, µs per call (a CUDA graph of calls on distinct
weights, as across layers: `bench_invariant_gemm.graph_us`), both paths, and the weight-streaming floor (its bytes
over the measured copy bandwidth). The `layer` rows add up a decoder layer's four. This is the kernel loop of
issue 31; the end-to-end table is bench_decode.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import (
    SHAPES,
    TINY,
    add_repeat_args,
    cell,
    copy_bandwidth,
    env_line,
    merge_tuned,
    repeats_line,
    run_table,
)
from bench_invariant_gemm import graph_us, weight_copies
from bench_invariant_gemm import projections as gemm_shapes

NAME = "bench_skinny_linear"


FUSIONS = {"qkv_proj": "norm", "o_proj": "residual", "gate_up_proj": "norm_silu_mul", "down_proj": "residual"}


def projections(shape: dict[str, Any]) -> dict[str, tuple[int, int, str]]:
    """Layer name -> (rows of W, K, fusion) of a Llama decoder's projections as the skinny path runs them."""
    gemms = gemm_shapes(shape)
    return {layer: (*gemms[layer], fusion) for layer, fusion in FUSIONS.items()}


def calls(fusion: str, x: torch.Tensor, norm: torch.Tensor, residual: torch.Tensor, rows_per_program: int = 1):
    """(skinny(w, tile), per_op(w)): the two paths of one projection, as functions of its weight. residual: [M, K]
    entering a normed projection (the per-op norm kernel adds it; the skinny path's x is the summed stream), [M, N]
    after an output projection (the skinny kernel adds it; the per-op path adds it in the next norm)."""
    from research_lm.ops.rms_norm import rms_norm
    from research_lm.ops.silu_and_mul import silu_and_mul
    from research_lm.ops.skinny_linear import skinny_linear

    normed, silu = "norm" in fusion, "silu" in fusion
    kw = {"norm_weight": norm if normed else None, "eps": 1e-5, "silu_mul": silu,
          "residual": None if normed else residual}

    def per_op(w):
        y = F.linear(rms_norm(x, norm, 1e-5, residual)[0] if normed else x, w)
        return silu_and_mul(y) if silu else y

    return (lambda w, tile=None: skinny_linear(x, w, tile=tile, rows_per_program=rows_per_program, **kw)), per_op


def candidates(n: int, k: int, rows_per_program: int = 1):
    """Tiles to sweep: K steps from 256 (or the whole K) to 2048, 1-32 columns, up to 16K products per program (the
    all-rows kernel: K steps of 64-512, 16K products over its rows)."""
    from research_lm.ops.common import next_power_of_2
    from research_lm.ops.skinny_linear import SkinnyTile

    steps = (256, 512, 1024, 2048) if rows_per_program == 1 else (64, 128, 256, 512)
    for block_k in sorted({min(bk, next_power_of_2(k)) for bk in steps}):
        for block_n in (1, 2, 4, 8, 16, 32):
            if block_n <= next_power_of_2(n) and block_n * block_k * rows_per_program <= 16384:
                for warps in (4, 8):
                    yield SkinnyTile(block_n, block_k, warps)


def measure(args) -> dict[str, Any]:
    from research_lm.ops.skinny_linear import skinny_tiles

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = TINY if args.tiny else SHAPES[args.shape]
    gen = torch.Generator(device="cpu").manual_seed(0)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    rows, tuned = [], {}
    for layer, (rows_w, k, fusion) in projections(shape).items():
        n = rows_w // 2 if "silu" in fusion else rows_w
        weight = (torch.randn(rows_w, k, generator=gen) / k**0.5).to(device, dtype)
        copies = weight_copies(rows_w, k, dtype) if device.type == "cuda" else 1
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        norm = (1 + torch.randn(k, generator=gen) / 4).to(device, dtype)
        paths = {}  # m -> (skinny, per_op)
        for m in args.m:
            x = torch.randn(m, k, generator=gen).to(device, dtype)
            residual = torch.randn(m, k if "norm" in fusion else n, generator=gen).to(device, dtype)
            paths[m] = skinny, per_op = calls(fusion, x, norm, residual, args.rows_per_program)
            row = {"layer": layer, "fusion": fusion, "n": n, "k": k, "m": m,
                   "per_op_us": graph_us(per_op, weights, device), "skinny_us": graph_us(skinny, weights, device),
                   "tile": "x".join(map(str, skinny_tiles(n, k, name, args.rows_per_program)))}
            if bandwidth:
                row["floor_us"] = weight.numel() * weight.element_size() / bandwidth * 1e6
            row["ratio"] = row["skinny_us"] / row["per_op_us"]
            rows.append(row)
        if args.sweep:  # one tile for all Ms: the lowest worst ratio to the per-op path
            layer_rows = {r["m"]: r for r in rows[-len(args.m):]}
            timed = {}
            for tile in candidates(n, k, args.rows_per_program):
                try:  # a tile must give the default tile's numbers (up to summation order) to be timed
                    for skinny, _ in paths.values():
                        torch.testing.assert_close(skinny(weight, tile), skinny(weight), atol=2e-2, rtol=2e-2)
                    timed[tile] = {m: graph_us(lambda w, t=tile, f=paths[m][0]: f(w, t), weights, device)
                                   for m in args.m}
                except Exception as e:  # a tile that does not fit (registers, shared memory): not a candidate
                    print(f"  skip {tile}: {type(e).__name__}", flush=True)
            best = min(timed, key=lambda t: max(timed[t][m] / layer_rows[m]["per_op_us"] for m in args.m))
            for m, row in layer_rows.items():
                row["best_tile"], row["best_us"] = "x".join(map(str, best)), timed[best][m]
            tuned[(n, k)] = (best, timed[best], {m: r["per_op_us"] for m, r in layer_rows.items()})
    for m in args.m:  # a decoder layer: its four projections
        parts = [r for r in rows if r["m"] == m and r["layer"] != "layer"]
        total = {key: sum(r[key] for r in parts) for key in ("per_op_us", "skinny_us", "floor_us") if key in parts[0]}
        rows.append({"layer": "layer", "fusion": "all four", "m": m, **total,
                     "ratio": total["skinny_us"] / total["per_op_us"]})
    if args.tune and tuned and name is not None and dtype.itemsize == 2:
        suffix = f"x{args.rows_per_program}" if args.rows_per_program > 1 else ""  # the all-rows kernel's key
        merge_tuned(Path(args.tune), name,
                    "Skinny linear tiles (block_n, block_k, num_warps) per GPU model and (N, K) (NxKxR: the all-rows "
                    "kernel of R rows), written by `python experiments/bench_skinny_linear.py --sweep --tune "
                    "[--rows-per-program R]`: the tile with the lowest worst ratio to the per-op path over the "
                    "measured Ms (one tile for every M: a row's numbers must not depend on M), with its µs per call "
                    "and the per-op path's per M.",
                    {f"{n}x{k}{suffix}": {"tile": list(tile), "us": {str(m): round(t, 2) for m, t in us.items()},
                                          "per_op_us": {str(m): round(t, 2) for m, t in per_op.items()}}
                     for (n, k), (tile, us, per_op) in tuned.items()})
    return {"shape_name": "tiny" if args.tiny else args.shape, "dtype": args.dtype, "rows": rows,
            "rows_per_program": args.rows_per_program,
            "copy_gb_s": (bandwidth or 0) / 1e9}


def render(payload: dict[str, Any]) -> str:
    lines = [env_line(payload["env"]), "",
             f"A decoder layer's projections at M rows, {payload['shape_name']} shape, {payload['dtype']}: the skinny "
             f"kernel ({'a program per row' if payload.get('rows_per_program', 1) == 1 else 'all rows in one program'}"
             "; norm / SwiGLU / residual fused) against the per-op path (RMSNorm kernel + cuBLAS + SwiGLU "
             "kernel), µs per call (median of triton's do_bench over a CUDA graph of calls on distinct weights), and "
             f"the weight-streaming floor at the measured copy bandwidth ({payload['copy_gb_s']:.0f} GB/s). "
             + repeats_line(payload), "",
             "| projection | fused | N x K | M | per-op µs | skinny µs | skinny / per-op | floor µs | tile (N, K, "
             "warps) | best of --sweep | its µs |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |"]
    for r in payload["rows"]:
        nk = f"{r['n']} x {r['k']}" if "n" in r else "—"
        lines.append(f"| {r['layer']} | {r['fusion']} | {nk} | {r['m']} | {cell(r, 'per_op_us', '.1f')} | "
                     f"{cell(r, 'skinny_us', '.1f')} | {cell(r, 'ratio', '.2f')} | {cell(r, 'floor_us', '.1f')} | "
                     f"{r.get('tile', '—')} | {r.get('best_tile', '—')} | {cell(r, 'best_us', '.1f')} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="a tiny shape: a smoke run of the code paths")
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4], help="token counts (rows), at most SKINNY_MAX_ROWS")
    p.add_argument("--rows-per-program", type=int, default=1, choices=(1, 4),
                   help="1: the one-row kernel (skinny_rows=1); 4: all rows in one program (skinny_rows > 1)")
    p.add_argument("--sweep", action="store_true", help="also time every candidate tile (see candidates)")
    p.add_argument("--tune", metavar="JSON", help="with --sweep on a GPU in 16 bits: merge the best tiles into this "
                   "file (research_lm/assets/tuned/skinny_linear.json is the one skinny_tiles reads)")
    add_repeat_args(p, default_repeats=1)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    name = args.name or (NAME if not args.tiny else NAME + "_tiny")
    return run_table(name, torch.device(args.device), args, measure, render, ("layer", "m"))


if __name__ == "__main__":
    main()
