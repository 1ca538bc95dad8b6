"""Host time of the suffix proposer per step (issue 36), on the built-in tiny-llama target (CPU), greedy, on the
agentic workload (conf/workload/agentic.yaml's builder) at each --batch (max_num_seqs), k = 5.

    python experiments/bench_suffix_host.py                                  # batch 1, 8, 32
    python experiments/bench_suffix_host.py --baseline /tmp/suffix_old.py    # A/B against another suffix.py

Two measurements:
- live: the time inside `SuffixProposer.propose` and `on_requests_removed` (perf_counter around them) during the
  engine run, per step the proposer drafted in. Noisy where other processes share the CPU.
- replay (with --baseline): the run's proposer calls, recorded, are replayed into fresh proposers of this checkout's
  suffix.py and of the baseline, alternately, --repeats times each, best repeat kept; as paths (the run's config)
  and as speculation trees (`suffix_decoding_tree`, the same inputs). Every replayed call's drafts (rows, tokens,
  tree parents) must be the same from both, or it stops.
--dump writes each batch's output token ids and per-request accepted counts (JSON), to diff two checkouts' runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from types import SimpleNamespace

import torch

import spec_decode.suffix as suffix
from research_lm import LLM
from research_lm.harness.workloads import WorkloadSpec, build_workload
from research_lm.worker.spec import PROPOSERS


def load_module(path: str):
    """The suffix.py at `path`, as module suffix_baseline; "suffix" stays this checkout's method."""
    spec = importlib.util.spec_from_file_location("suffix_baseline", path)
    module = sys.modules["suffix_baseline"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    ours = PROPOSERS.entries.pop("suffix")  # its factory registers itself under the same name
    spec.loader.exec_module(module)
    PROPOSERS.entries["suffix"] = ours
    return module


def record(trace: list, clock: list[float]):
    """Wrap the proposer's two methods: each call's time goes to clock[0], its inputs to `trace`. Returns the undo."""
    propose, removed = suffix.SuffixProposer.propose, suffix.SuffixProposer.on_requests_removed

    def undo():
        suffix.SuffixProposer.propose, suffix.SuffixProposer.on_requests_removed = propose, removed

    def timed_propose(self, outcome):
        trace.append(("propose", [(r.request_id, r.all_token_ids) for r in outcome.requests],
                      [list(e) for e in outcome.emitted]))
        start = time.perf_counter()
        out = propose(self, outcome)
        clock[0] += time.perf_counter() - start
        return out

    def timed_removed(self, req_ids):
        reqs = [self._live[r].request for r in req_ids if r in self._live]
        trace.append(("removed", [(r.request_id, r.is_finished, r.finish_reason, list(r.output_token_ids))
                                  for r in reqs], set(req_ids)))
        start = time.perf_counter()
        removed(self, req_ids)
        clock[0] += time.perf_counter() - start

    suffix.SuffixProposer.propose, suffix.SuffixProposer.on_requests_removed = timed_propose, timed_removed
    return undo


def replay(module, config: dict, trace: list) -> tuple[float, list]:
    """Seconds inside the proposer over the trace, and its drafts per propose call."""
    proposer = module.build_proposer(config, None)
    reqs: dict[str, SimpleNamespace] = {}
    empty = torch.zeros(0, dtype=torch.int64)
    seconds, drafts = 0.0, []
    for kind, rows, arg in trace:
        if kind == "propose":
            for req_id, tokens in rows:
                req = reqs.setdefault(req_id, SimpleNamespace(request_id=req_id))
                req.all_token_ids, req.num_known_tokens = tokens, len(tokens)
            outcome = SimpleNamespace(requests=[reqs[r] for r, _ in rows], emitted=arg, input_ids=empty)
            start = time.perf_counter()
            out = proposer.propose(outcome)
            seconds += time.perf_counter() - start
            parents = None if out.tree_parents is None else out.tree_parents.tolist()
            drafts.append((out.index, out.token_ids.tolist(), out.num, parents))
        else:
            for req_id, finished, reason, outputs in rows:
                reqs[req_id].is_finished, reqs[req_id].finish_reason = finished, reason
                reqs[req_id].output_token_ids = outputs
            start = time.perf_counter()
            proposer.on_requests_removed(arg)
            seconds += time.perf_counter() - start
    return seconds, drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=32, help="agentic requests (turns) per batch size")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--baseline", default=None, help="another suffix.py to replay the runs' calls into")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dump", default=None, help="write outputs and accepted counts here (JSON)")
    args = parser.parse_args()

    config = {"method": "suffix", "num_speculative_tokens": args.k}
    rows, traces, dump, clock = [], {}, {}, [0.0]
    for batch in args.batch:
        trace = traces[batch] = []
        undo, clock[0] = record(trace, clock), 0.0
        llm = LLM("tiny-llama", device="cpu", dtype="float32", max_num_seqs=batch, max_model_len=2048,
                  speculative_config=config)
        spec = WorkloadSpec(kind="agentic", num_requests=args.requests, num_turns=4, prompt_chars=1000,
                            max_tokens=args.max_tokens, temperature=0.0, seed=0)
        workload = build_workload(spec, llm.engine.info.vocab_size)
        outs = llm.generate(workload.prompts, workload.params, use_tqdm=False)
        undo()
        steps = sum(kind == "propose" for kind, _, _ in trace)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        accepted = [o.metrics.num_accepted_tokens for o in outs]
        rows.append((batch, steps, tokens / steps, sum(accepted), 1e3 * clock[0] / steps))
        dump[batch] = {"outputs": [o.outputs[0].token_ids for o in outs], "accepted": accepted}

    print("live (engine run):\n")
    print("| batch | steps | tokens/step | accepted drafts | proposer ms/step |")
    print("|---|---|---|---|---|")
    for batch, steps, tau, accepted, ms in rows:
        print(f"| {batch} | {steps} | {tau:.2f} | {accepted} | {ms:.3f} |")
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(dump, f)
    if args.baseline is None:
        return
    baseline = load_module(args.baseline)
    print(f"\nreplay (best of {args.repeats}; drafts identical in every call):\n")
    print("| batch | drafts | baseline ms/step | this ms/step | speed-up |")
    print("|---|---|---|---|---|")
    for batch, trace in traces.items():
        steps = sum(kind == "propose" for kind, _, _ in trace)
        for name, cfg in (("path", config), ("tree", config | {"suffix_decoding_tree": True})):
            best = {}
            for _ in range(args.repeats):
                for module in (baseline, suffix):
                    seconds, drafts = replay(module, cfg, trace)
                    best[module] = min(best.get(module, seconds), seconds)
                    if module is baseline:
                        want = drafts
                    elif drafts != want:
                        raise SystemExit(f"batch {batch} {name}: drafts differ from the baseline's")
            old, new = (1e3 * best[m] / steps for m in (baseline, suffix))
            print(f"| {batch} | {name} | {old:.3f} | {new:.3f} | {old / new:.2f}x |")


if __name__ == "__main__":
    main()
