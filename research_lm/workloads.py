"""Built-in workloads: code from the stdlib, prose from pydoc topics, synthetic lengths, JSONL files;
and when each request arrives (all at once, or a Poisson / gamma process at `request_rate`)."""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from research_lm.corpus import corpus_hash, pydoc_topics, stdlib_files
from research_lm.sampling_params import SamplingParams

WORKLOAD_KINDS = ("code", "prose", "synthetic", "jsonl")


@dataclass
class WorkloadSpec:
    kind: str = "code"
    num_requests: int = 16
    prompt_chars: int = 400  # code/prose: prompt length in characters
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
    build = {"code": _code, "prose": _prose, "synthetic": _synthetic, "jsonl": _jsonl}[spec.kind]
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
