"""workload=agentic: coding-agent sessions built from the stdlib corpus.

Invariants: deterministic from the seed; turn t + 1's prompt extends turn t's (a session's shared prefix); each
prompt ends with an instruction and the first line of an answer that is a function of the excerpt, as the session
last emitted it, with one more small edit; every answer in a prompt is valid Python; a later turn re-edits an
earlier turn's function; a bad num_turns is refused naming the field.
"""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

from research_lm.harness.workloads import WorkloadSpec, build_workload

TURN = re.compile(r"# User: in `(\w+)`, (.+)\.\n# Agent:\n")


def _workload(**kw):
    return build_workload(WorkloadSpec(**({"kind": "agentic", "num_requests": 12, "num_turns": 4,
                                           "prompt_chars": 1000, "max_tokens": 32} | kw)), 1024)


def _turns(prompt: str) -> list[tuple[str, str, str]]:
    """(function name, instruction, answer) of every completed turn in a prompt."""
    parts = TURN.split(prompt)  # [head, name, instruction, answer, name, instruction, answer, ...]
    return [(parts[i], parts[i + 1], parts[i + 2].rstrip("\n")) for i in range(1, len(parts) - 3, 3)]


def test_deterministic_from_the_seed():
    a, b, c = _workload(), _workload(), _workload(seed=1)
    assert a.prompts == b.prompts and a.fingerprint() == b.fingerprint() and a.source_hash == b.source_hash
    assert a.prompts != c.prompts
    assert len(a.prompts) == 12 and all(p.max_tokens == 32 for p in a.params)


def test_sessions_extend_their_prompts_and_re_emit_edited_functions():
    w = _workload(num_requests=40, num_turns=4)
    reedited = 0
    for s in range(0, 40, 4):
        session = w.prompts[s : s + 4]
        assert all(later.startswith(earlier) for earlier, later in zip(session, session[1:]))
        excerpt = session[0][: TURN.search(session[0]).start()].split("\n")
        latest: dict[str, list[str]] = {}
        turns = _turns(session[-1])
        assert len(turns) == 3
        for name, instruction, answer in turns:
            ast.parse(textwrap.dedent(answer))  # valid Python
            lines = answer.split("\n")
            comment = re.fullmatch(r"add the comment `(# [^`]+)` to its body", instruction)
            if name in latest:
                base, reedited = latest[name], reedited + 1
            else:  # the first edit of a function of the excerpt: its lines there
                start = next(i for i, line in enumerate(excerpt) if re.match(rf"\s*(async )?def {name}\(", line))
                base = excerpt[start : start + len(lines) - bool(comment)]
            if rename := re.fullmatch(r"rename `(\w+)` to `(\w+)`", instruction):
                assert lines == re.sub(rf"\b{rename[1]}\b", rename[2], "\n".join(base)).split("\n")
            elif comment:
                i = next(i for i, (a, b) in enumerate(zip([*base, None], lines)) if a != b)
                assert lines[:i] + lines[i + 1 :] == base and lines[i].strip() == comment[1]
            else:
                number = re.fullmatch(r"change the constant (\d+) to (\d+)", instruction)
                diffs = [(a, b) for a, b in zip(base, lines, strict=True) if a != b]
                assert number and len(diffs) == 1 and number[1] in diffs[0][0] and number[2] in diffs[0][1]
            latest[name] = lines
        last = session[-1].rstrip("\n").rsplit("\n", 1)[1]  # the open turn ends with its answer's first line
        assert re.match(r"\s*(async )?def \w+\(", last)
    assert reedited > 0, "some turns should edit what an earlier turn emitted"


def test_bad_num_turns_is_refused():
    with pytest.raises(ValueError, match="workload.num_turns must be >= 1"):
        _workload(num_turns=0)
