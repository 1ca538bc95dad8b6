"""Host time of a speculative step, phase by phase (issue 4): where a batch-1 step's time goes.

    python experiments/bench_spec_host.py                                     # CUDA, eagle3 k = 5, batch 1
    python experiments/bench_spec_host.py --method ngram --batch 8
    python experiments/bench_spec_host.py --method eagle3_tree16   # token trees: where a tree step's time goes
    python experiments/bench_spec_host.py --device cpu --tokens 8 --repeats 1   # a smoke run

The built-in tiny pair (tiny-llama, and tiny-llama-eagle3 for eagle3; ngram needs no head), greedy, `--batch`
requests at a time, `--tokens` output tokens each, CUDA graphs wherever the device has them. Plain decoding and
speculative decoding run in the same process, one engine each, both built before the first repeat. Each repeat
serves both. Reported, per engine:
- ms per output token;
- τ (tokens per step);
- the median host time per step of each phase, measured with perf_counter around the engine's, scheduler's
  and runner's functions (no profiler):
  - step: the whole engine step;
  - schedule;
  - prepare: input preparation, copies included;
  - verify: verification, including its wait for the target's tokens;
  - propose: the proposer, including its wait for the drafts;
  - update: the scheduler's update;
  - metrics.

A step whose phases add up to much more than its GPU work is host-bound. On the H100 device machine a batch-1
eagle3 step took ~1.4 ms for ~0.65 ms of GPU work (PERFORMANCE.md, eighth pass).

To A/B a change, give it a runtime switch and alternate the switch inside one process. Two processes running
the same code differed by up to 1.4x in ms/token on that machine, while their phase times agreed within ~10 %.

Same-process A/B rows: "... inputs launched" launch the step-input gather kernel (research_lm/ops/step_inputs.py)
every step instead of replaying it from a small graph; and for eagle3:
- greedy: "eagle3 verify first" never drafts at launch (`EagleProposer.propose_on_device` declines), so the
  proposer drafts at collect, once the host has the step's tokens, as every step did before the "verified" draft
  graph (and no step is launched ahead of it);
- `--temperature` above 0: "eagle3 torch rejection" runs with `research_lm.ops.FUSED_DEVICE_TYPES` emptied, so
  the rejection sampler takes its torch path instead of its kernel (research_lm/ops/rejection_kernel.py). The
  graphs keep the kernels they captured; what else runs eagerly at T = 1 is the plain sampler's race at prompt
  steps, which then takes its torch path too.

Prints a table last; writes experiments/results/bench_spec_host.{md,json}.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from typing import Any

import torch
import triton
from bench_common import add_repeat_args, cell, env_line, repeats_line, run_table

import research_lm.ops
import research_lm.worker.runner as runner_module
import research_lm.worker.step_tokens as step_tokens_module
from research_lm import LLM, SamplingParams

NAME = "bench_spec_host"
PHASES = ("step", "schedule", "prepare", "verify", "propose", "update", "metrics")
PROMPTS = ("import os\nimport sys\n\n\ndef main(argv):\n    parser = ", "class Foo(object):\n    def __init__(self",
           "def test_", "    for i in range(")
TREE16 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
          [1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]]  # conf/spec_tree/tree16.yaml
SPECS = {"eagle3": {"method": "eagle3", "model": "tiny-llama-eagle3"}, "ngram": {"method": "ngram"},
         # token trees (issue 29): a static 16-node tree and EAGLE-2's dynamic one (conf/spec_tree/dynamic.yaml)
         "eagle3_tree16": {"method": "eagle3", "model": "tiny-llama-eagle3", "speculative_token_tree": str(TREE16),
                           "num_speculative_tokens": None},
         "eagle3_dynamic": {"method": "eagle3", "model": "tiny-llama-eagle3", "num_speculative_tokens": 4, "topk": 4,
                            "num_draft_tokens": 16}}


class Compiles:
    """Triton kernels compiled while a run is measured (a kernel compiled inside a measured run costs ~0.1 s: a step
    whose shapes or specializations change each time recompiles; PERFORMANCE.md, thirteenth pass)."""

    def __init__(self):
        self.count = 0
        jit = triton.runtime.jit.JITFunction
        if hasattr(jit, "_do_compile"):
            compile_one = jit._do_compile

            def counted(fn, *args, **kwargs):
                self.count += 1
                return compile_one(fn, *args, **kwargs)

            jit._do_compile = counted


class PhaseTimer:
    """Host microseconds per call of the wrapped functions, per phase."""

    def __init__(self):
        self.times: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[phase].append((time.perf_counter() - start) * 1e6)

        return timed


def instrument(llm: LLM) -> PhaseTimer:
    timer, engine = PhaseTimer(), llm.engine
    runner = engine.runner
    engine.step = timer.wrap("step", engine.step)
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = timer.wrap("update", engine.scheduler.update_from_output)
    engine.metrics.record_step = timer.wrap("metrics", engine.metrics.record_step)
    if runner.proposer is not None:  # drafting at launch or at collect
        for name in ("propose_on_device", "propose"):
            setattr(runner.proposer, name, timer.wrap("propose", getattr(runner.proposer, name)))
    return timer


def verify_first(llm: LLM) -> LLM:
    """The A/B switch: the proposer never drafts at launch, before the host has the step's tokens."""
    llm.engine.runner.proposer.propose_on_device = lambda outcome: None
    return llm


def inputs_launched(llm: LLM) -> LLM:
    """The A/B switch: the step-input gather and the tables' advance launch their kernels every step instead of
    replaying them from small graphs (`research_lm.ops.step_inputs.RecurringLaunches`)."""
    runner = llm.engine.runner
    runner._write_inputs.launches.max_graphs = runner.state.launches.max_graphs = 0
    return llm


def build(args: argparse.Namespace, spec: dict[str, Any] | None) -> LLM:
    device = torch.device(args.device)
    return LLM("tiny-llama", device=args.device, cuda_graphs=device.type == "cuda", max_num_seqs=args.batch,
               attention_backend="triton" if device.type == "cuda" else "torch_ref",
               speculative_config=None if spec is None else {"num_speculative_tokens": args.k, **spec})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--method", choices=sorted(SPECS), default="eagle3")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    add_repeat_args(parser, default_repeats=4)
    args = parser.parse_args(argv)
    name = args.name or NAME
    engines = {"plain": build(args, None), args.method: build(args, SPECS[args.method])}
    engines["plain inputs launched"] = inputs_launched(build(args, None))
    engines[f"{args.method} inputs launched"] = inputs_launched(build(args, SPECS[args.method]))
    torch_rejection = f"{args.method} torch rejection"
    if args.method == "eagle3" and args.temperature == 0.0:
        engines[f"{args.method} verify first"] = verify_first(build(args, SPECS[args.method]))
    elif args.method == "eagle3":
        engines[torch_rejection] = build(args, SPECS[args.method])
    timers = {run: instrument(llm) for run, llm in engines.items()}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(args.batch, len(PROMPTS)))]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True, seed=0)
    fused = research_lm.ops.FUSED_DEVICE_TYPES
    verify, prepare = step_tokens_module.verify_drafts, runner_module.prepare_step_inputs
    for llm in engines.values():  # warm-up: kernels of every shape the measured runs take
        llm.generate(prompts, params, use_tqdm=False)

    compiles = Compiles()

    def measure(_: argparse.Namespace) -> dict[str, Any]:
        rows = []
        for run, llm in engines.items():
            timer = timers[run]
            timer.times.clear()
            step_tokens_module.verify_drafts = timer.wrap("verify", verify)  # module functions: patched per engine
            runner_module.prepare_step_inputs = timer.wrap("prepare", prepare)
            if args.device == "cuda":
                torch.cuda.synchronize()
            research_lm.ops.FUSED_DEVICE_TYPES = () if run == torch_rejection else fused
            start, compiled = time.perf_counter(), compiles.count
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            step_tokens_module.verify_drafts, runner_module.prepare_step_inputs = verify, prepare
            research_lm.ops.FUSED_DEVICE_TYPES = fused
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            row = {"run": run, "batch": args.batch, "ms_per_token": seconds * 1e3 / tokens, "tau": _tau(outputs),
                   "compiles": compiles.count - compiled}
            row |= {f"{p}_us": statistics.median(timer.times[p]) for p in PHASES if timer.times.get(p)}
            rows.append(row)
        return {"rows": rows}

    return run_table(name, torch.device(args.device), args, measure, render, ("run", "batch"),
                     method=args.method, k=args.k, tokens=args.tokens, temperature=args.temperature)


def _tau(outputs) -> float:
    """Tokens per step of a request, averaged over requests (1 for plain decoding)."""
    taus = []
    for o in outputs:
        drafts, accepted = o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens
        steps = o.metrics.num_output_tokens - accepted  # each step emits its accepted drafts plus one token
        taus.append(o.metrics.num_output_tokens / steps if drafts and steps else 1.0)
    return statistics.mean(taus)


def render(payload: dict[str, Any]) -> str:
    head = ["engine", "batch", "ms/token", "τ", "Triton compiles"] + [f"{p} µs" for p in PHASES]
    title = (f"# Host time per step, phase by phase ({payload['method']}, k = {int(payload['k'])}, "
             f"{int(payload['tokens'])} tokens per request, temperature {payload.get('temperature', 0.0):g})")
    lines = [title, "", env_line(payload["env"]), "", repeats_line(payload), "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * 2 + " ---: |" * (len(head) - 2)]
    for row in payload["rows"]:
        values = [row["run"], str(int(row["batch"])), cell(row, "ms_per_token", ".3f"), cell(row, "tau", ".2f"),
                  cell(row, "compiles", ".0f")]
        values += [cell(row, f"{p}_us", ".0f") for p in PHASES]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
