"""Built-in workloads: code from the stdlib, prose from pydoc topics, agent sessions editing stdlib files, synthetic
lengths, JSONL files; and when each request arrives (all at once, or a Poisson / gamma process at `request_rate`)."""

from __future__ import annotations

import ast
import hashlib
import json
import math
import random
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from research_lm.api.sampling_params import SamplingParams
from research_lm.harness.corpus import corpus_hash, pydoc_topics, stdlib_files

WORKLOAD_KINDS = ("code", "prose", "agentic", "synthetic", "jsonl")


@dataclass
class WorkloadSpec:
    kind: str = "code"
    num_requests: int = 16
    prompt_chars: int = 400  # code/prose: prompt length in characters; agentic: the file excerpt's
    num_turns: int = 4  # agentic: requests per session (turn t's prompt holds turns 1 .. t - 1)
    input_len: tuple[int, int] = (100, 1024)  # synthetic: uniform token lengths, inclusive
    output_len: tuple[int, int] = (100, 1024)  # synthetic
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False
    path: str | None = None  # jsonl
    seed: int = 0
    request_rate: float | None = None  # requests/s of a Poisson process; None or inf: all arrive at t = 0
    burstiness: float = 1.0  # gamma shape of the inter-arrival times (1: Poisson; < 1 burstier; > 1 steadier)


@dataclass
class Workload:
    prompts: list[str | list[int]]
    params: list[SamplingParams]
    source_hash: str  # identifies the prompts' source (corpus hash or file hash)
    arrival_times: list[float] | None = None  # seconds after the start; None: all at t = 0

    def fingerprint(self) -> str:
        """sha256 (16 hex) over the exact prompts, their sampling parameters and arrival times: two runs
        with the same fingerprint were given the same requests."""
        h = hashlib.sha256()
        for prompt, params in zip(self.prompts, self.params, strict=True):
            h.update(json.dumps([prompt, repr(params)]).encode())
        h.update(json.dumps(self.arrival_times).encode())
        return h.hexdigest()[:16]


def build_workload(spec: WorkloadSpec, vocab_size: int) -> Workload:
    if spec.kind not in WORKLOAD_KINDS:
        raise ValueError(f"unknown workload kind {spec.kind!r}; choose one of {list(WORKLOAD_KINDS)}")
    rng = random.Random(spec.seed)
    build = {"code": _code, "prose": _prose, "agentic": _agentic, "synthetic": _synthetic, "jsonl": _jsonl}[spec.kind]
    workload = build(spec, rng, vocab_size)
    if spec.request_rate is not None and not math.isinf(spec.request_rate):
        # its own stream: turning arrivals on does not change the prompts
        workload.arrival_times = arrival_times(len(workload.prompts), spec.request_rate,
                                               burstiness=spec.burstiness, seed=spec.seed)
    return workload


def arrival_times(num_requests: int, request_rate: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times (seconds after the start, non-decreasing) of `num_requests` requests: the first at
    t = 0, then gaps drawn i.i.d. from a gamma distribution of mean 1 / request_rate and shape
    `burstiness` (1: exponential gaps, a Poisson process; vLLM's benchmark_serving convention)."""
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"workload.request_rate must be > 0 (or null/inf for all at once), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"workload.burstiness must be > 0, got {burstiness}")
    rng = random.Random(f"arrivals:{seed}")
    times, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
        times.append(t)
    return times


def _params(spec: WorkloadSpec, max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, max_tokens=max_tokens,
        ignore_eos=spec.ignore_eos, seed=seed,
    )


def _snippet(text: str, rng: random.Random, chars: int) -> str:
    lines = text.splitlines(keepends=True)
    start = rng.randrange(max(1, len(lines) - 1))
    return "".join(lines[start:])[:chars]


def _code(spec: WorkloadSpec, rng: random.Random, vocab_size: int) -> Workload:
    files = stdlib_files(limit_bytes=4_000_000)
    picks = [files[rng.randrange(len(files))] for _ in range(spec.num_requests)]
    prompts = [_snippet(p.read_text(encoding="utf-8"), rng, spec.prompt_chars) or "def f():\n" for p in picks]
    params = [_params(spec, spec.max_tokens, spec.seed * 100_003 + i) for i in range(len(prompts))]
    return Workload(prompts, params, corpus_hash(files))


def _prose(spec: WorkloadSpec, rng: random.Random, vocab_size: int) -> Workload:
    topics = pydoc_topics()
    names = sorted(topics)
    prompts = [_snippet(topics[names[rng.randrange(len(names))]], rng, spec.prompt_chars) or "The"
               for _ in range(spec.num_requests)]
    params = [_params(spec, spec.max_tokens, spec.seed * 100_003 + i) for i in range(len(prompts))]
    return Workload(prompts, params, f"pydoc_topics:{len(names)}")


def _agentic(spec: WorkloadSpec, rng: random.Random, vocab_size: int) -> Workload:
    """Coding-agent sessions, the workload suffix decoding was built for (SuffixDecoding's agentic benchmarks): an
    agent edits one stdlib file a function at a time and re-emits each function whole, so its outputs repeat the
    file and its own earlier outputs with small edits.

    A session is a file excerpt of `prompt_chars` characters and `num_turns` turns; each turn asks for one
    function of the excerpt with one edit (rename a parameter or local, add a comment line, change a number),
    half the time a function an earlier turn already edited, and its answer is that function's latest version with
    the edit applied. Turn t is one request: a fixed system text, the excerpt, turns 1 .. t - 1 with their answers,
    then turn t's instruction and the first line of its answer, which the model continues. So the prompts of a
    session share their prefix (prefix caching), the answer copies text of the prompt (n-gram and suffix trees
    draft from it), and a later turn re-emits what earlier requests emitted (the global tree of finished outputs).
    Sessions follow each other; `num_requests` turns in all. Deterministic from `seed`."""
    if spec.num_turns < 1:
        raise ValueError(f"workload.num_turns must be >= 1, got {spec.num_turns}")
    files = stdlib_files(limit_bytes=4_000_000)
    prompts: list[str] = []
    while len(prompts) < spec.num_requests:
        prompts += _session(files, rng, spec.prompt_chars, spec.num_turns)
    prompts = prompts[: spec.num_requests]
    params = [_params(spec, spec.max_tokens, spec.seed * 100_003 + i) for i in range(len(prompts))]
    return Workload(prompts, params, corpus_hash(files))


_AGENT_SYSTEM = ("# A session with a coding agent. The agent edits the file below one function at a time: each turn\n"
                 "# it re-emits the whole function, with the change the user asks for applied to its latest version.\n")
_COMMENTS = ("validated by the caller", "keep in sync with the tests", "reviewed by the agent", "see the module docs",
             "hot path: avoid allocations")
_SUFFIXES = ("new", "value", "item", "arg", "tmp")
_MAX_FUNCTION_CHARS = 600  # keeps 4-turn sessions under 1.8k tokens of tiny-llama (max_model_len 2048)


def _session(files: list[Path], rng: random.Random, excerpt_chars: int, num_turns: int) -> list[str]:
    """One agent session's prompts, one per turn."""
    path, excerpt, functions = _excerpt(files, rng, excerpt_chars)
    latest: dict[str, str] = {}  # function name -> its latest version (the file's until a turn edits it)
    history = f"{_AGENT_SYSTEM}# File: {path.name}\n{excerpt}\n"
    prompts = []
    for _ in range(num_turns):
        edited = sorted(latest)
        name = rng.choice(edited) if edited and rng.random() < 0.5 else rng.choice(sorted(functions))
        answer, instruction = _edit(latest.get(name, functions[name]), rng)
        latest[name] = answer
        ask = f"# User: in `{name}`, {instruction}.\n# Agent:\n"
        prompts.append(history + ask + answer.split("\n", 1)[0] + "\n")
        history += ask + answer + "\n"
    return prompts


def _excerpt(files: list[Path], rng: random.Random, chars: int) -> tuple[Path, str, dict[str, str]]:
    """A file and an excerpt of it of at most `chars` characters, starting at a function, holding at least two whole
    undecorated functions of 3 to 25 lines and at most `_MAX_FUNCTION_CHARS` (their sources, by name)."""
    for _ in range(1000):
        path = files[rng.randrange(len(files))]
        text = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        defs = sorted((node.lineno, node.end_lineno, node.name) for node in ast.walk(tree)
                      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.decorator_list
                      and 3 <= node.end_lineno - node.lineno + 1 <= 25
                      and len("".join(lines[node.lineno - 1 : node.end_lineno])) <= _MAX_FUNCTION_CHARS)
        if len(defs) < 2:
            continue
        first = rng.randrange(len(defs) - 1)
        start, end, size = defs[first][0] - 1, defs[first][0] - 1, 0
        while end < len(lines) and size + len(lines[end]) <= chars:
            size += len(lines[end])
            end += 1
        functions = {name: "".join(lines[a - 1 : b]).rstrip("\n") for a, b, name in defs[first:] if b <= end}
        if len(functions) >= 2:
            return path, "".join(lines[start:end]), functions
    raise ValueError(f"workload.prompt_chars={chars}: no stdlib file excerpt holds two whole functions; raise it")


def _edit(source: str, rng: random.Random) -> tuple[str, str]:
    """One small edit of a function's source, and the instruction that asks for it: rename a parameter or local
    variable, add a comment line at the top of the body, or change a number (when the function has one)."""
    node = ast.parse(textwrap.dedent(source)).body[0]
    names = sorted({a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg) and a.arg not in ("self", "cls")}
                   | {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)})
    numbers = [m for m in re.finditer(r"(?<![\w.])\d+(?![\w.])", source) if m.start() > source.find(":")]
    kind = rng.choice(["rename", "comment", "number"])
    if kind == "rename" and names:
        old = rng.choice(names)
        new = f"{old}_{rng.choice(_SUFFIXES)}"
        return re.sub(rf"\b{re.escape(old)}\b", new, source), f"rename `{old}` to `{new}`"
    if kind == "number" and numbers:
        m = rng.choice(numbers)
        new = str(int(m.group()) + rng.randint(1, 9))
        return source[: m.start()] + new + source[m.end() :], f"change the constant {m.group()} to {new}"
    lines = source.split("\n")
    body = max(1, node.body[0].lineno - 1)  # the body's first line (line 0 is the def)
    indent = lines[body][: len(lines[body]) - len(lines[body].lstrip())]
    note = rng.choice(_COMMENTS)
    return "\n".join([*lines[:body], f"{indent}# {note}", *lines[body:]]), f"add the comment `# {note}` to its body"


def _synthetic(spec: WorkloadSpec, rng: random.Random, vocab_size: int) -> Workload:
    """The nano-vllm workload: random token ids, lengths uniform in the given ranges."""
    prompts, params = [], []
    for i in range(spec.num_requests):
        n_in = rng.randint(*spec.input_len)
        n_out = rng.randint(*spec.output_len)
        prompts.append([rng.randrange(vocab_size) for _ in range(n_in)])
        params.append(_params(spec, n_out, spec.seed * 100_003 + i))
    return Workload(prompts, params, f"synthetic:seed={spec.seed}")


def _jsonl(spec: WorkloadSpec, rng: random.Random, vocab_size: int) -> Workload:
    """One JSON object per line: {"prompt": str | [ids], "max_tokens"?: int}, or ShareGPT's
    {"conversations": [{"from": "human", "value": ...}, ...]} (the first human turn is the prompt)."""
    if not spec.path:
        raise ValueError("workload.kind=jsonl needs workload.path")
    path = Path(spec.path)
    if not path.is_file():
        raise ValueError(f"workload file not found: {path}")
    prompts, params = [], []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
        prompt = record.get("prompt")
        if prompt is None and "conversations" in record:
            prompt = next((t["value"] for t in record["conversations"] if t.get("from") == "human"), None)
        if prompt is None:
            raise ValueError(f"{path}:{line_no}: needs a 'prompt' or ShareGPT 'conversations' field")
        prompts.append(prompt)
        max_tokens = int(record.get("max_tokens", spec.max_tokens))
        params.append(_params(spec, max_tokens, spec.seed * 100_003 + line_no))
        if len(prompts) == spec.num_requests:
            break
    return Workload(prompts, params, hashlib.sha256(path.read_bytes()).hexdigest()[:16])
