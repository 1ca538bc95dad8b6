"""Model-free drafting against an oracle target (CPU, ~1 min): ngram vs suffix decoding on the agentic workload when
the target emits the workload's own reference answers (issue 36: where each method wins, apart from any model).

    python experiments/sim_spec_oracle.py                  # 16 sessions (64 requests), one pass (deterministic)
    python experiments/sim_spec_oracle.py --sessions 2     # a smoke run

workload=agentic (research_lm/harness/workloads.py `_agentic`) builds coding-agent sessions whose turn t prompt holds
the answers of turns 1 .. t - 1, so each answer but a session's last is known: the next prompt's text between this
prompt and the next "# User:" line. Here the "target" emits exactly that answer (tiny-llama's tokenizer, the GPU
reference target's, at most `--max-tokens` tokens), greedy, one request at a time in session order, so
acceptance depends on the proposer alone. A step: the proposer drafts from prompt + output so far, the longest
prefix of the drafts (of a speculation tree: its deepest node whose path) that the answer continues is accepted,
and the step emits it plus the answer's next token. Suffix decoding runs research_lm's own SuffixProposer (its
global tree gets each finished answer); ngram research_lm's host `find_ngram_proposals`
(prompt_lookup_min 2, max 5, as conf/spec/ngram.yaml). Reported per proposer: tau (output tokens per verify step),
drafts per step, the fraction of drafts accepted, and the conditional acceptance at draft positions 1 .. 5.

A real target does not re-emit its inputs this faithfully (a trained one copies less, and a random one nothing):
these are the proposers' ceilings on this workload, and a sanity check of their logic; the GPU tables measure the
rest (experiments/results/spec_suffix_h200.md).
"""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from bench_common import add_repeat_args, cell, env_line, repeats_line, run_table
from transformers import AutoTokenizer

from research_lm.assets import ASSETS
from research_lm.harness import workloads
from spec_decode.ngram import find_ngram_proposals
from spec_decode.suffix import SuffixProposer

NAME = "sim_spec_oracle"
POSITIONS = 5
# (label, method, num_speculative_tokens, extra keys)
PROPOSERS = [("ngram k=3", "ngram", 3, {}), ("ngram k=5", "ngram", 5, {}), ("ngram k=8", "ngram", 8, {}),
             ("suffix k=5", "suffix", 5, {}), ("suffix k=5, tree", "suffix", 5, {"tree": True}),
             ("suffix k=8", "suffix", 8, {}), ("suffix k=24 (vLLM's default)", "suffix", 24, {}),
             ("suffix k=24, spec factor 2", "suffix", 24, {"factor": 2.0})]


def sessions(num_sessions: int, turns: int, prompt_chars: int, max_tokens: int, seed: int) -> list[tuple[list, list]]:
    """(prompt ids, answer ids) of every turn with a known answer, in session order."""
    tokenizer = AutoTokenizer.from_pretrained(str(ASSETS / "tiny-llama"))
    rng, files = random.Random(seed), workloads.stdlib_files(limit_bytes=4_000_000)
    pairs = []
    for _ in range(num_sessions):
        prompts = workloads._session(files, rng, prompt_chars, turns)
        for prompt, following in zip(prompts, prompts[1:]):
            rest = following[len(prompt):]
            answer = rest[: rest.index("\n# User:") + 1] if "\n# User:" in rest else rest
            ids, full = (tokenizer(text)["input_ids"] for text in (prompt, prompt + answer))
            common = next((i for i, (a, b) in enumerate(zip(ids, full)) if a != b), len(ids))  # a merge at the seam
            pairs.append((full[:common], full[common:][:max_tokens]))
    return pairs


class _Suffix:
    """SuffixProposer driven one request at a time, as the runner drives it (emitted tokens not yet appended)."""

    def __init__(self, k: int, tree: bool = False, factor: float = 1.0):
        self.proposer = SuffixProposer(k, 24, 10000, factor, 0.1, speculation_trees=tree)

    def draft(self, rid: int, context: list[int], known: int) -> tuple[list[int], list[int] | None]:
        request = SimpleNamespace(request_id=str(rid), num_known_tokens=known, all_token_ids=context[:known])
        drafts = self.proposer.propose(SimpleNamespace(requests=[request], emitted=[context[known:]],
                                                       input_ids=torch.zeros(1)))
        if not drafts.index:
            return [], None
        n = drafts.num[0] if drafts.num is not None else drafts.token_ids.shape[1]
        tokens = drafts.token_ids[0, :n].tolist()
        return tokens, None if drafts.tree_parents is None else drafts.tree_parents[0, 1 : n + 1].tolist()

    def finish(self, rid: int, answer: list[int]) -> None:
        self.proposer._live.pop(str(rid), None)
        self.proposer.finished.add(str(rid), list(answer))


class _Ngram:
    def __init__(self, k: int):
        self.k = k

    def draft(self, rid: int, context: list[int], known: int) -> tuple[list[int], None]:
        return find_ngram_proposals([np.asarray(context, dtype=np.int64)], 2, 5, self.k)[0], None

    def finish(self, rid: int, answer: list[int]) -> None:
        pass


def accepted(tokens: list[int], parents: list[int] | None, truth: list[int]) -> int:
    """Drafts the target keeps: the longest prefix of a path (node j's parent parents[j - 1], 0 the root) that
    `truth` continues."""
    if parents is None:
        n = 0
        while n < len(tokens) and n < len(truth) and tokens[n] == truth[n]:
            n += 1
        return n
    node, depth = 0, 0
    while depth < len(truth):
        node = next((j for j in range(1, len(tokens) + 1) if parents[j - 1] == node and tokens[j - 1] == truth[depth]),
                    None)
        if node is None:
            break
        depth += 1
    return depth


def simulate(proposer, pairs: list[tuple[list, list]]) -> dict[str, Any]:
    steps = drafted = kept = 0
    reached, passed = [0] * POSITIONS, [0] * POSITIONS  # per position: drafts judged, drafts accepted
    for rid, (prompt, answer) in enumerate(pairs):
        context, known, pos = list(prompt), len(prompt) - 1, 0  # the prompt's last token: the first "emitted"
        while pos < len(answer):
            tokens, parents = proposer.draft(rid, context, known)
            known = len(context)
            n = accepted(tokens, parents, answer[pos:])
            depth = len(tokens) if parents is None else max((_depth(parents, j) for j in range(1, len(tokens) + 1)),
                                                             default=0)
            for j in range(min(depth, POSITIONS)):
                if j <= n:
                    reached[j] += j < depth
                    passed[j] += j < n
            emit = answer[pos : pos + n + 1]
            context += emit
            pos += len(emit)
            steps, drafted, kept = steps + 1, drafted + len(tokens), kept + n
        proposer.finish(rid, answer)
    tokens = sum(len(a) for _, a in pairs)
    return {"tau": tokens / steps, "drafts_per_step": drafted / steps, "accepted_fraction": kept / max(drafted, 1),
            **{f"accept_{j + 1}": passed[j] / reached[j] if reached[j] else None for j in range(POSITIONS)}}


def _depth(parents: list[int], node: int) -> int:
    depth = 0
    while node:
        node, depth = parents[node - 1], depth + 1
    return depth


def measure(args) -> dict[str, Any]:
    pairs = sessions(args.sessions, args.turns, args.prompt_chars, args.max_tokens, args.seed)
    rows = []
    for label, method, k, extra in PROPOSERS:
        proposer = _Ngram(k) if method == "ngram" else _Suffix(k, extra.get("tree", False), extra.get("factor", 1.0))
        rows.append({"proposer": label, **simulate(proposer, pairs)})
    return {"rows": rows, "requests": len(pairs), "answer_tokens": sum(len(a) for _, a in pairs),
            "sessions": args.sessions, "turns": args.turns}


def render(payload: dict[str, Any]) -> str:
    head = " | ".join(f"pos {j + 1}" for j in range(POSITIONS))
    lines = [env_line(payload["env"]), "",
             f"Oracle target on workload=agentic: {payload['sessions']} sessions of {payload['turns']} turns, "
             f"{payload['requests']} requests with a known answer ({payload['answer_tokens']} answer tokens); the "
             f"target emits each answer, greedy, one request at a time. tau: output tokens per verify step; accepted: "
             f"the fraction of drafts kept; pos j: P(draft j accepted | drafts 1 .. j - 1 were). "
             + repeats_line(payload), "",
             f"| proposer | tau | drafts/step | accepted | {head} |",
             "| --- | ---: | ---: | ---: |" + " ---: |" * POSITIONS]
    for r in payload["rows"]:
        cells = " | ".join(cell(r, f"accept_{j + 1}", ".3f") for j in range(POSITIONS))
        lines.append(f"| {r['proposer']} | {cell(r, 'tau', '.3f')} | {cell(r, 'drafts_per_step', '.2f')} | "
                     f"{cell(r, 'accepted_fraction', '.3f')} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=5, help="turns per session (all but the last have an answer)")
    p.add_argument("--prompt-chars", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    add_repeat_args(p, default_repeats=1)
    args = p.parse_args(argv)
    return run_table(args.name or NAME, torch.device("cpu"), args, measure, render, ("proposer",))


if __name__ == "__main__":
    main()
