"""What a user gets with the defaults, against the tuned settings, in one process (Llama-3.2-1B shape, bf16).

    python experiments/bench_defaults.py                      # on a CUDA GPU
    python experiments/bench_defaults.py --tiny --device cpu --num-requests 8 --decode-tokens 16   # smoke

Two configurations through the public API (`LLM`, `generate`), built one after the other and freed in between:
- defaults: `LLM(path, load_format="dummy", dtype="bfloat16")` and nothing else: the attention backends, batch
  limits and KV budget are the library's choices for the device;
- tuned: the settings of bench_throughput (triton, max_num_seqs 256, max_num_batched_tokens 16384, a KV budget for
  every request at once, no prefix caching) and of bench_decode (batch-1 graphs only).
Each measures (1) the nano-vllm offline workload (bench_throughput's: `--num-requests` random prompts, input and
output lengths uniform in [100, 1024], greedy, ignore_eos), output tok/s over the whole batch, and (2) batch-1 decode:
one greedy request of `--prompt-len` random tokens and `--decode-tokens` output tokens, ms per output token after the
first (`RequestOutput.metrics`: (finish - first token) / (n - 1)). The workload runs `--workload-runs` times per build
(its median counts); the pair is built and measured `--repeats` times, alternating (defaults, tuned, defaults, ...),
each cell the median and min–max over the repeats. Goal (issue 27): defaults >= 95 % of tuned
throughput, batch-1 decode equal within noise. Writes experiments/results/bench_defaults.{md,json}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch
from bench_common import (
    LLAMA_3_2_1B,
    TINY,
    add_repeat_args,
    cell,
    env_line,
    free_cuda,
    model_dir,
    repeats_line,
    run_table,
)
from bench_throughput import workload

NAME = "bench_defaults"


def tuned(args, w) -> dict[str, Any]:
    blocks = sum(-(-(len(p) + sp.max_tokens) // 16) for p, sp in zip(w.prompts, w.params)) + 64
    return dict(attention_backend="triton" if args.device == "cuda" else "torch_ref", max_num_seqs=256,
                max_num_batched_tokens=16384, num_gpu_blocks=blocks, enable_prefix_caching=False, max_model_len=2048)


def measure_one(path: str, args, settings: dict[str, Any], w) -> dict[str, Any]:
    from research_lm import LLM, SamplingParams

    llm = LLM(path, load_format="dummy", dtype=args.dtype, device=args.device, **settings)
    engine = llm.engine
    chosen = {"backends": engine.backends, "max_num_seqs": engine.config.max_num_seqs,
              "max_num_batched_tokens": engine.config.max_num_batched_tokens, "num_kv_blocks": engine.num_blocks,
              "cuda_graph_sizes": sorted(engine.runner.cuda_graphs.sizes[1]) if engine.runner.cuda_graphs else []}
    warm = [[t % args.vocab for t in range(200 + 50 * i)] for i in range(8)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    walls = []
    for _ in range(args.workload_runs):  # one run is ~4.5 s on an H100 and varies by ~5 % from run to run
        engine.metrics.reset()
        t0 = time.perf_counter()
        outs = llm.generate(w.prompts, w.params, use_tqdm=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(sp.max_tokens for sp in w.params)
    steps = len(engine.metrics.steps)  # of the last run: equal counts say the two configs scheduled alike
    prompt = [random.Random(1).randrange(args.vocab) for _ in range(args.prompt_len)]
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    tpot = []
    for _ in range(3):  # the first one warms the batch-1 path
        m = llm.generate([prompt], decode, use_tqdm=False)[0].metrics
        tpot.append((m.finish_time - m.first_token_time) / (m.num_output_tokens - 1) * 1e3)
    del llm, engine
    free_cuda()
    return {"output_tok_s": tokens / wall, "wall_s": wall, "steps": steps, "decode_ms": min(tpot[1:]), **chosen}


def measure(args, device: torch.device) -> dict[str, Any]:
    path = model_dir(TINY if args.tiny else LLAMA_3_2_1B)
    w = workload(args.num_requests, args.vocab, 0.0)
    rows = [{"config": "defaults", **measure_one(path, args, {}, w)},
            {"config": "tuned", **measure_one(path, args, tuned(args, w), w)}]
    for r in rows:
        print(f"[{time.strftime('%X')}] {r}", flush=True)
    d, t = rows
    return {"rows": rows, "throughput_ratio": d["output_tok_s"] / t["output_tok_s"],
            "decode_ratio": d["decode_ms"] / t["decode_ms"], "num_requests": args.num_requests}


def render(p: dict[str, Any]) -> str:
    lines = [f"# Defaults against tuned settings ({p['shape']}, bf16)", "", env_line(p["env"]), "",
             repeats_line(p), "",
             "| config | output tok/s (nano-vllm workload) | steps | batch-1 decode ms/token | chosen |",
             "| --- | --- | --- | --- | --- |"]
    for r in p["rows"]:
        chosen = (f"backends {r['backends']}, max_num_seqs {r['max_num_seqs']}, "
                  f"max_num_batched_tokens {r['max_num_batched_tokens']}, KV blocks {r['num_kv_blocks']}")
        lines.append(f"| {r['config']} | {cell(r, 'output_tok_s', '.0f')} | {cell(r, 'steps', '.0f')} | "
                     f"{cell(r, 'decode_ms', '.3f')} | {chosen} |")
    lines += ["", f"Defaults / tuned: throughput {p['throughput_ratio']:.3f} (goal >= 0.95), batch-1 decode time "
              f"{p['decode_ratio']:.3f} (goal: 1 within noise). {p['num_requests']} requests."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama (smoke runs on CPU)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--workload-runs", type=int, default=3, help="runs of the workload per build (median)")
    add_repeat_args(ap)
    args = ap.parse_args()
    args.vocab = (TINY if args.tiny else LLAMA_3_2_1B)["vocab_size"]
    device = torch.device(args.device)
    run_table(NAME, device, args, lambda a: measure(a, device), render, key=("config",),
              shape="tiny" if args.tiny else "Llama-3.2-1B")


if __name__ == "__main__":
    main()
