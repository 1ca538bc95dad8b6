"""Eager launches per speculative step outside graph replays, by the function that issued them (CPU, ~1 min).

    python experiments/count_eager_ops.py --method eagle3_tree16     # the built-in pair, a 16-node static tree
    python experiments/count_eager_ops.py --method eagle3             # the chain, for comparison

On the GPU every op a step runs eagerly (outside a CUDA graph's replay) is a launch the host pays (~5-10 µs each on
the device machine's host), so their count is what a step's host time follows once its GPU work is in graphs. This
counts them on CPU as the GPU would launch them:
- the built-in pair (tiny-llama + tiny-llama-eagle3), greedy, batch 1, triton attention under the interpreter;
- research_lm's fused Triton ops too (`FUSED_DEVICE_TYPES` gets "cpu"); each Triton kernel is one launch whatever
  the interpreter does inside it, and so is the torch reference of a CUDA-only kernel (research_lm/ops/reference.py);
- the target's and the drafter's graphs captured with `eager_capture` (a replay re-runs the captured function;
  nothing in it is counted).
Each launch is charged to the innermost research_lm / spec_decode function on the stack. Session 27: the 16-node
tree 470 -> 247 launches a step after vectorizing its verification and compaction; the chain 72.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import research_lm.ops  # noqa: E402
from research_lm import LLM, SamplingParams  # noqa: E402
from research_lm.worker.cuda_graphs import GraphPool, eager_capture  # noqa: E402

TREE16 = [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
          (1, 0, 0), (0, 0, 0, 0), (0, 0, 1, 0)]
METHODS = {"eagle3": {"num_speculative_tokens": 4}, "eagle3_tree16": {"speculative_token_tree": TREE16},
           "eagle3_dynamic": {"num_speculative_tokens": 4, "topk": 4, "num_draft_tokens": 16}}
ROOTS = ("research_lm", "spec_decode")


class _Counter(TorchDispatchMode):
    """Counts launches by issuing function: aten ops, and Triton kernels as one each; nothing while a graph
    replays or inside a kernel."""

    def __init__(self):
        super().__init__()
        self.by_function: collections.Counter[str] = collections.Counter()
        self.quiet = 0  # > 0 inside a replay or a Triton kernel

    def count(self) -> None:
        if not self.quiet:
            self.by_function[_issuer()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count()
        return func(*args, **(kwargs or {}))

    def quietly(self, run):
        def wrapped(*a, **kw):
            self.quiet += 1
            try:
                return run(*a, **kw)
            finally:
                self.quiet -= 1

        return wrapped


def _issuer() -> str:
    for frame in reversed(traceback.extract_stack()):
        parts = frame.filename.replace(os.sep, "/").split("/")
        for root in ROOTS:
            if root in parts[:-1]:
                return f"{'/'.join(parts[parts.index(root):])}:{frame.name}"
    return "?"


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=sorted(METHODS), default="eagle3_tree16")
    p.add_argument("--tokens", type=int, default=40, help="output tokens of the measured request")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    counter = _Counter()
    capture, launch = GraphPool.__call__, InterpretedFunction.run
    research_lm.ops.FUSED_DEVICE_TYPES = ("cuda", "cpu")  # the Triton kernels the GPU runs, interpreted
    GraphPool.__call__ = lambda pool, fn: counter.quietly(capture(pool, fn))  # a replay's re-run is not counted

    def kernel(fn, *a, **kw):
        counter.count()
        return counter.quietly(launch)(fn, *a, **kw)

    InterpretedFunction.run = kernel
    # The torch references of kernels that run on CUDA only (research_lm/ops/reference.py: the step-input gather,
    # the table advance, ...) count as the one launch their kernel is, wherever a module bound them by name.
    bound = [(module, name, fn) for module in list(sys.modules.values())
             if getattr(module, "__name__", "").startswith(ROOTS)
             for name, fn in list(vars(module).items())
             if callable(fn) and getattr(fn, "__module__", None) == "research_lm.ops.reference"]
    for module, name, fn in bound:
        setattr(module, name, lambda *a, _fn=fn, **kw: (counter.count(), counter.quietly(_fn)(*a, **kw))[1])
    try:
        llm = LLM("tiny-llama", device="cpu", attention_backend="triton", max_num_seqs=1, cuda_graphs=False,
                  speculative_config={"method": "eagle3", "model": "tiny-llama-eagle3", **METHODS[args.method]})
        reason = llm.engine.runner.capture_cuda_graphs(sizes=[1], prefill_sizes=[], capture=eager_capture)
        assert reason is None, reason
        prompt = ["def fibonacci(n):\n    "]
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        with counter:
            out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True),
                               use_tqdm=False)
    finally:
        for module, name, fn in bound:
            setattr(module, name, fn)
        GraphPool.__call__, InterpretedFunction.run = capture, launch
        research_lm.ops.FUSED_DEVICE_TYPES = ("cuda",)
    metrics = out[0].metrics
    steps = metrics.num_output_tokens - metrics.num_accepted_tokens
    per_step = {name: n / steps for name, n in counter.by_function.most_common()}
    total = sum(per_step.values())
    print(f"{args.method}: {steps} steps, {total:.1f} launches per step outside graph replays; by function:")
    for name, n in list(per_step.items())[: args.top]:
        print(f"{n:8.1f}  {name}")
    return {"steps": steps, "launches_per_step": total, **per_step}


if __name__ == "__main__":
    sys.exit(main() and 0)
