"""Time to first token at batch 1, with and without prefill graphs (issue 4: a prompt's host cost).

    python experiments/bench_prefill.py                                      # CUDA, the built-in tiny pair
    python experiments/bench_prefill.py --model outputs/reference/target --head outputs/reference/eagle3
    python experiments/bench_prefill.py --device cpu --requests 2 --repeats 1  # a smoke run

One request at a time (max_num_seqs 1), `--requests` prompts of random token ids with lengths uniform in
[--min-len, --max-len] (seeded), max_tokens 1: each request is one prompt step and its first token; with a
drafter also the prompt's entry into the drafter and its first drafts. Reported per engine: ms per request
(the wall time of `generate` over the requests, divided by their number) and the host's ms per prompt step
(perf_counter around the engine's step). Engines, all built before the first repeat and run in turn in one
process:
- plain / eagle3: the defaults (CUDA graphs, and one request's prompt of <= 512 tokens replays a batch-1
  prefill graph: research_lm/worker/cuda_graphs.py, spec_decode/draft_graphs.py);
- "... eager prompts": `prefill_graph_sizes=[]`, so prompts run eagerly (decode and draft graphs stay).
On a CPU there are no graphs: both variants run eagerly, and the run only checks the plumbing.

Committed: `python -m experiments.paper bench_prefill` (experiments/results/bench_prefill.md: the 24-layer
reference target on an H100, 1.50 ms per request with prefill graphs against 20.3 ms without).

Prints a table last; writes experiments/results/bench_prefill.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from bench_common import add_repeat_args, cell, env_line, repeats_line, run_table

from research_lm import LLM, SamplingParams

NAME = "bench_prefill"


def build(args: argparse.Namespace, head: bool, prompt_graphs: bool) -> LLM:
    cuda = args.device == "cuda"
    spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.k} if head else None
    return LLM(args.model, device=args.device, dtype="bfloat16" if cuda else "float32", max_num_seqs=1,
               attention_backend="triton" if cuda else "torch_ref", speculative_config=spec,
               max_num_batched_tokens=max(2048, args.max_len), max_model_len=args.max_len + 64,
               num_gpu_blocks=-(-(args.max_len + 64) // 16) + 8,
               enable_prefix_caching=False, **({} if prompt_graphs else {"prefill_graph_sizes": []}))


def prompts(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.requests,), generator=g)
    return [torch.randint(vocab, (int(n),), generator=g).tolist() for n in lengths]


def step_timer(llm: LLM) -> list[float]:
    """The host ms of every engine step from now on (the list fills as the engine steps)."""
    times, step = [], llm.engine.step

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            times.append((time.perf_counter() - start) * 1e3)

    llm.engine.step = timed
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--head", default="tiny-llama-eagle3", help="an EAGLE-3 head for --model")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=120)
    parser.add_argument("--max-len", type=int, default=200)
    add_repeat_args(parser)
    args = parser.parse_args(argv)
    engines = {"plain": build(args, False, True), "plain eager prompts": build(args, False, False),
               "eagle3": build(args, True, True), "eagle3 eager prompts": build(args, True, False)}
    timers = {run: step_timer(llm) for run, llm in engines.items()}
    vocab = engines["plain"].engine.info.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for llm in engines.values():  # warm-up: every kernel and plan the measured prompts need
        llm.generate(prompts(args, vocab, seed=1), params, use_tqdm=False)
    repeat = iter(range(2, 1 << 30))

    def measure(_: argparse.Namespace) -> dict[str, Any]:
        batch, rows = prompts(args, vocab, seed=next(repeat)), []
        for run, llm in engines.items():
            timers[run].clear()
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            if args.device == "cuda":
                torch.cuda.synchronize()
            rows.append({"run": run, "ms_per_request": (time.perf_counter() - start) * 1e3 / len(batch),
                         "step_ms": statistics.median(timers[run])})
        return {"rows": rows}

    return run_table(NAME if args.name is None else args.name, torch.device(args.device), args, measure, render,
                     ("run",), model=args.model, head=args.head, k=args.k, requests=args.requests,
                     prompt_lengths=[args.min_len, args.max_len])


def render(payload: dict[str, Any]) -> str:
    lo, hi = payload["prompt_lengths"]
    title = (f"# Batch-1 time to first token, prefill graphs on and off ({payload['model']}; EAGLE-3 head "
             f"{payload['head']}, k = {int(payload['k'])}; {int(payload['requests'])} prompts of {lo}-{hi} tokens)")
    lines = [title, "", env_line(payload["env"]), "", repeats_line(payload), "",
             "| engine | ms per request | host ms per step |", "| --- | ---: | ---: |"]
    for row in payload["rows"]:
        lines.append(f"| {row['run']} | {cell(row, 'ms_per_request', '.2f')} | {cell(row, 'step_ms', '.2f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
