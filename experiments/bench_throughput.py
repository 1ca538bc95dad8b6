"""Offline throughput on the nano-vllm workload, Llama-3.2-1B shape: research_lm vs transformers, same run.

    python experiments/bench_throughput.py                     # on a CUDA GPU
    python experiments/bench_throughput.py --tiny --device cpu --backend torch_ref --num-requests 8  # smoke
    python -m experiments.paper bench_throughput               # the committed table (experiments/paper/)

The whole table is measured `--repeats` times (default 3) in this process; each cell shows the median
over the repeats and their min–max where they differ.

Workload (research_lm's `synthetic` workload, conf/workload/synthetic.yaml): `--num-requests` requests of
random token ids, input and output lengths uniform in [100, 1024], seed 0, ignore_eos, all arriving
at once. Output tok/s = requested output tokens / wall time of the whole batch (nano-vllm's measure).
- research_lm: `LLM.generate` over all requests (triton backend, CUDA graphs for decode,
  max_num_seqs 256, max_num_batched_tokens 16384, KV budget for every request at once, no prefix
  caching), greedy and at temperature 0.6 (nano-vllm's bench samples at 0.6), after a short warm-up.
- transformers: `generate` with a static cache (which it compiles itself), greedy, the requests in
  order in batches of `--hf-batch`, each left-padded to its longest prompt and run to its longest
  output; counted are the requested output tokens only. A warm-up call at the largest shape compiles.
- roofline: the research_lm schedule's lower bound with every request resident: prefill at the bf16
  GEMM rate, then each decode step the larger of (weights + the KV it reads) / copy bandwidth and
  its GEMM FLOPs / GEMM rate, both ceilings measured in this run.
Prints a table last; writes experiments/results/bench_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from bench_common import (
    LLAMA_3_2_1B,
    TINY,
    add_repeat_args,
    cell,
    copy_bandwidth,
    env_line,
    free_cuda,
    hf_model,
    matmul_flops,
    model_dir,
    repeats_line,
    run_table,
    sync,
)

NAME = "bench_throughput"


def workload(n: int, vocab: int, temperature: float):
    from research_lm.harness.workloads import WorkloadSpec, build_workload

    spec = WorkloadSpec(kind="synthetic", num_requests=n, input_len=(100, 1024), output_len=(100, 1024),
                        temperature=temperature, ignore_eos=True, seed=0)  # fmt: skip
    return build_workload(spec, vocab)


def roofline_s(in_lens: list[int], out_lens: list[int], *, params: int, weight_bytes: int, kv_bytes_per_token: int,
               copy_bw: float, flops: float) -> float:  # fmt: skip
    """Seconds the whole batch needs at the measured ceilings (every request resident from the start)."""
    t = 2.0 * params * sum(in_lens) / flops  # prefill GEMMs; the first output token of each comes with it
    for s in range(1, max(out_lens)):
        active = [i for i, o in zip(in_lens, out_lens) if o > s]
        kv = sum(i + s for i in active) * kv_bytes_per_token
        t += max((weight_bytes + kv) / copy_bw, 2.0 * params * len(active) / flops)
    return t


def roofline_bytes(in_lens: list[int], out_lens: list[int], *, weight_bytes: int, kv_bytes_per_token: int) -> int:
    """Bytes the roofline's schedule reads: the weights once for the prefill and once per decode step, plus the
    KV cache of every active request at each step. Divided by a measured wall time: the effective GB/s."""
    total = weight_bytes
    for s in range(1, max(out_lens)):
        active = [i for i, o in zip(in_lens, out_lens) if o > s]
        total += weight_bytes + sum(i + s for i in active) * kv_bytes_per_token
    return total


def research_lm_rows(path: str, args, device: torch.device, temperatures: list[float],
                     **variant: Any) -> list[dict[str, Any]]:
    """One LLM (the table's settings and `variant`'s keywords) over the workload at each temperature."""
    from research_lm import LLM, SamplingParams

    rows = []
    w0 = workload(args.num_requests, args.vocab, 0.0)
    blocks = sum(-(-(len(p) + sp.max_tokens) // 16) for p, sp in zip(w0.prompts, w0.params)) + 64
    llm = LLM(
        path, load_format="dummy", dtype=args.dtype, device=args.device, attention_backend=args.backend,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048,
        num_gpu_blocks=blocks, enable_prefix_caching=False, cuda_graphs=not args.no_graphs, **variant,
    )  # fmt: skip
    graphs = llm.engine.runner.cuda_graphs
    note = f"CUDA graphs for batch <= {max(graphs.sizes[1])}" if graphs else "eager (no CUDA graphs)"
    warm = [[t % args.vocab for t in range(200 + 50 * i)] for i in range(8)]
    llm.generate(warm, SamplingParams(temperature=0.6, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for temperature in temperatures:
        w = workload(args.num_requests, args.vocab, temperature)
        llm.engine.metrics.reset()
        preempted = llm.engine.scheduler.num_preemptions
        sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(w.prompts, w.params, use_tqdm=False)
        sync(device)
        wall = time.perf_counter() - t0
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert out_tokens == sum(sp.max_tokens for sp in w.params)
        rows.append({
            "system": f"research_lm ({args.backend}, temperature {temperature:g}"
                      + "".join(f", {k.replace('_', '-')}" for k, v in variant.items() if v is True) + ")",
            "wall_s": wall,
            "output_tokens": out_tokens, "input_tokens": sum(len(p) for p in w.prompts),
            "steps": len(llm.engine.metrics.steps),
            "preemptions": llm.engine.scheduler.num_preemptions - preempted, "note": note,
        })  # fmt: skip
        print(f"[{time.strftime('%X')}] {rows[-1]}", flush=True)
    llm = None
    free_cuda()
    return rows


class _StopAfter:
    """A transformers stopping criterion: stop every row once the sequence has n tokens (for the warm-up)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n, dtype=torch.bool,
                          device=input_ids.device)  # fmt: skip


def hf_rows(args, device: torch.device, dtype: torch.dtype, shape: dict[str, Any]) -> list[dict[str, Any]]:
    from transformers import StoppingCriteria, StoppingCriteriaList

    stop_cls = type("StopAfter", (_StopAfter, StoppingCriteria), {})
    n = args.hf_num_requests or args.num_requests
    w = workload(n, args.vocab, 0.0)
    model = hf_model(shape, device, dtype)

    def generate(prompts: list[list[int]], max_new: int, stop_at: int | None = None) -> float:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        kw = {"stopping_criteria": StoppingCriteriaList([stop_cls(width + stop_at)])} if stop_at else {}
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                                 cache_implementation="static", **kw)  # fmt: skip
        sync(device)
        assert stop_at or out.shape[1] == width + max_new, out.shape
        return time.perf_counter() - t0

    b = args.hf_batch
    longest = [[1] * max(len(p) for p in w.prompts)] * b
    max_out = max(sp.max_tokens for sp in w.params)
    compile_s = generate(longest, max_out, stop_at=8)  # the largest static cache; torch.compile runs here
    batch_s = []
    for i in range(0, n, b):
        outs = [sp.max_tokens for sp in w.params[i : i + b]]
        batch_s.append(generate(w.prompts[i : i + b], max(outs)))
        print(f"[{time.strftime('%X')}] transformers batch {i // b}: {batch_s[-1]:.2f} s", flush=True)
    model = None
    free_cuda()
    return [{
        "system": f"transformers static cache (compiled), batch {b}, greedy", "wall_s": sum(batch_s),
        "output_tokens": sum(sp.max_tokens for sp in w.params), "input_tokens": sum(len(p) for p in w.prompts),
        "num_requests": n, "batch_s": batch_s, "warmup_compile_s": compile_s,
        "note": f"warm-up (compile) {compile_s:.0f} s, not counted",
    }]  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--backend", default="triton")
    p.add_argument("--tiny", action="store_true", help="a tiny shape: a smoke run of the code paths")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--hf-num-requests", type=int, default=None, help="default: --num-requests")
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--temperatures", default="0,0.6", help="research_lm runs, comma-separated")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--batch-invariant", action="store_true",
                   help="research_lm's rows again with batch_invariant=True (issue 35's cost)")
    add_repeat_args(p)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    name = args.name or (NAME if not args.tiny else NAME + "_tiny")
    return run_table(name, torch.device(args.device), args, measure, render, ("system",))


def measure(args) -> dict[str, Any]:
    """One repeat of the whole table: the ceilings and roofline, research_lm's rows, transformers' row."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)  # --dtype choices are torch dtype names
    shape = TINY if args.tiny else LLAMA_3_2_1B
    args.vocab = shape["vocab_size"]
    copy_bw, flops = copy_bandwidth(device), matmul_flops(device, dtype)
    free_cuda()
    path = model_dir(shape)

    from research_lm.models.loader import build_model, load_config

    probe = build_model(load_config(path), device="cpu", dtype=dtype, attention_backend="torch_ref")  # torch.empty
    params = sum(p.numel() for p in probe.parameters())
    esize = torch.empty((), dtype=dtype).element_size()
    probe = None
    kv_per_token = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * esize
    w = workload(args.num_requests, args.vocab, 0.0)
    in_lens, out_lens = [len(p) for p in w.prompts], [sp.max_tokens for sp in w.params]
    floor = roofline_s(in_lens, out_lens, params=params, weight_bytes=params * esize, kv_bytes_per_token=kv_per_token,
                       copy_bw=copy_bw, flops=flops)  # fmt: skip
    rows: list[dict[str, Any]] = [{"system": "roofline (lower bound, see above)", "wall_s": floor, "note": "",
                                   "output_tokens": sum(out_lens), "input_tokens": sum(in_lens)}]  # fmt: skip
    temps = [float(t) for t in args.temperatures.split(",") if t]
    try:
        rows += research_lm_rows(path, args, device, temps)
        if args.batch_invariant:
            rows += research_lm_rows(path, args, device, temps, batch_invariant=True)
    except Exception as e:  # reported, not fatal: the transformers row still runs
        rows.append({"system": "research_lm", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
    if not args.skip_hf:
        try:
            rows += hf_rows(args, device, dtype, shape)
        except Exception as e:
            rows.append({"system": "transformers", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
    return {
        "copy_tb_s": copy_bw / 1e12, "gemm_tflop_s": flops / 1e12, "params": params, "dtype": args.dtype,
        "roofline_bytes": roofline_bytes(in_lens, out_lens, weight_bytes=params * esize,
                                         kv_bytes_per_token=kv_per_token),
        "num_requests": args.num_requests, "hf_num_requests": args.hf_num_requests or args.num_requests,
        "workload_fingerprint": w.fingerprint(), "rows": rows, "tiny": args.tiny,
    }  # fmt: skip


def render(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    hf = next((r for r in rows if r["system"].startswith("transformers") and "wall_s" in r), None)
    hf_tps = hf["output_tokens"] / hf["wall_s"] if hf else None
    roof_tps = rows[0]["output_tokens"] / rows[0]["wall_s"]
    n, n_hf = payload["num_requests"], payload["hf_num_requests"]
    scaled = ""
    if n != 256 or n_hf != 256:
        scaled = f" SCALED DOWN from nano-vllm's 256 requests: {n} (transformers {n_hf})."
    shape = "a tiny shape (smoke run)" if payload["tiny"] else "Llama-3.2-1B shape (random weights)"
    head = (
        f"{env_line(payload['env'])}\n\nnano-vllm workload: {n} requests, input/output lengths uniform in "
        f"[100, 1024], seed 0, ignore_eos, all at t = 0 (fingerprint {payload['workload_fingerprint']}).{scaled} "
        f"{shape}, {payload['dtype']}. Ceilings measured in this run: copy {payload['copy_tb_s']:.2f} TB/s, GEMM "
        f"{payload['gemm_tflop_s']:.0f} TFLOP/s. Output tok/s = requested output tokens / wall time. "
        f"GB/s = the bytes the roofline's schedule reads (weights once per decode step, the active requests' KV; "
        f"{payload.get('roofline_bytes', 0) / 1e9:,.0f} GB) / wall time: an effective bandwidth, against the "
        f"measured copy bandwidth. "
        f"{repeats_line(payload)}\n"
    )
    lines = [head, "| system | output tok/s | total tok/s | GB/s | wall s | vs transformers | % of roofline | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    nbytes = payload.get("roofline_bytes")
    for r in rows:
        if "wall_s" not in r:
            lines.append(f"| {r['system']} | — | — | — | — | — | — | {r.get('error', '')} |")
            continue
        out_n, all_n = r["output_tokens"], r["output_tokens"] + r["input_tokens"]
        tps = out_n / r["wall_s"]
        vs = f"{tps / hf_tps:.2f}" if hf_tps else "—"
        note = r.get("note", "")
        if "steps" in r:
            note = f"{cell(r, 'steps', '.0f')} steps, {cell(r, 'preemptions', '.0f')} preemptions; {note}"
        if r.get("errors"):
            note += f"; {len(r['errors'])} repeat(s) failed: {r['errors'][0]}"
        lines.append(f"| {r['system']} | {cell(r, 'wall_s', ',.0f', lambda s, n=out_n: n / s)} | "
                     f"{cell(r, 'wall_s', ',.0f', lambda s, n=all_n: n / s)} | "
                     f"{cell(r, 'wall_s', ',.0f', lambda s: nbytes / s / 1e9) if nbytes else '—'} | "
                     f"{cell(r, 'wall_s', '.2f')} | {vs} | "
                     f"{tps / roof_tps:.0%} | {note} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
