"""What the benchmarks share: model shapes, the measured ceilings, the environment, repeats, results files.

Imported by the `experiments/bench_*.py` scripts (run as scripts, so this folder is on sys.path; the paper
runner, `python -m experiments.paper`, puts it there too). No hydra: the GPU machine has none.

Repeats: each script measures its whole table `--repeats` times (default 3) and reports, per cell, the
median over the repeats with the spread (min–max) beside it (`repeat`, `cell`); the JSON keeps every
repeat's raw values.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from research_lm.harness.report import aggregate_records, fmt_spread

RESULTS = Path(__file__).parent / "results"

# Llama-3.2-1B (the config.json of meta-llama/Llama-3.2-1B), weights drawn at random.
LLAMA_3_2_1B: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
    bos_token_id=128000, eos_token_id=128001,
)  # fmt: skip
# Llama-3.1-8B (the config.json of meta-llama/Llama-3.1-8B), weights drawn at random.
LLAMA_3_1_8B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
    bos_token_id=128000, eos_token_id=128001,
)  # fmt: skip
# Llama-3.1-70B's layer shapes with 32 of its 80 layers: 59 GB of bf16 weights, so TP = 1 fits one 80 GB GPU
# (a step costs ~0.4 of the full model's; the ratio to the floor is what transfers).
LLAMA_3_1_70B_32L: dict[str, Any] = dict(
    LLAMA_3_1_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=32, num_attention_heads=64,
)  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {"llama-3.2-1b": LLAMA_3_2_1B, "llama-3.1-8b": LLAMA_3_1_8B,
                                     "llama-3.1-70b-32l": LLAMA_3_1_70B_32L}
# For smoke runs of the scripts on a CPU.
TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=4096,
)  # fmt: skip


def model_dir(shape: dict[str, Any]) -> str:
    """A temp directory holding only a config.json: research_lm loads it with load_format="dummy"."""
    from transformers import LlamaConfig

    path = tempfile.mkdtemp(prefix="bench_llama_")
    LlamaConfig(**shape, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def hf_model(shape: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Llama with random weights, built on the device; generates exactly max_new_tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype)
    model.generation_config.eos_token_id = None  # ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters (a tied embedding counted once): what one decode step must read."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median ms of fn: CUDA events through triton's do_bench on a GPU, the host clock elsewhere."""
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second (2 GiB buffers on a GPU)."""
    n = (2 << 30) if device.type == "cuda" else (64 << 20)
    buffers = torch.empty(2, n, dtype=torch.uint8, device=device)
    ms = gpu_ms(lambda: buffers[1].copy_(buffers[0]), device)
    return 2 * n / (ms * 1e-3)


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """bf16 (dtype) GEMM FLOP/s at 8192^3 (512^3 on a CPU)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = gpu_ms(lambda: a @ b, device)
    return 2 * n**3 / (ms * 1e-3)


def environment(device: torch.device) -> dict[str, Any]:
    from research_lm.harness.env_info import environment as env

    info = env(device)
    git = info["git"]
    if os.environ.get("BENCH_COMMIT") or not re.fullmatch(r"[0-9a-f]{40}", str(git["commit"])):
        # a copy of the tree without usable (or with stale) git metadata: the caller says what it is
        git = {"commit": os.environ.get("BENCH_COMMIT"), "dirty": os.environ.get("BENCH_DIRTY") == "1"}
    return {
        "device": info["device_name"], "date": info["date"], "commit": git["commit"],
        "dirty": git["dirty"], "torch": info["packages"]["torch"], "triton": info["packages"]["triton"],
        "transformers": info["packages"]["transformers"], "python": info["python"], "command": info["command"],
    }  # fmt: skip


def env_line(env: dict[str, Any]) -> str:
    dirty = " (uncommitted changes)" if env.get("dirty") else ""
    command = f"; command `{env['command']}`" if env.get("command") else ""
    return (f"{env['device']}; torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; "
            f"commit {str(env['commit'])[:12]}{dirty}; {env['date']}{command}")  # fmt: skip


def write_results(name: str, table: str, payload: dict[str, Any], out: Path = RESULTS) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(table + "\n")


def merge_tuned(path: Path, device_name: str, about: str, entries: dict[str, dict[str, Any]]) -> None:
    """Merge one GPU model's tuned entries (shape key -> entry) into a tuned-tiles JSON that a kernel reads at run
    time (research_lm/assets/tuned/); other GPUs' entries stay."""
    data = json.loads(path.read_text()) if path.exists() else {"devices": {}}
    data["about"] = about
    data["devices"].setdefault(device_name, {}).update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def add_repeat_args(parser: argparse.ArgumentParser, default_repeats: int = 3) -> None:
    """--repeats, --out, --name: what every benchmark (and the paper runner) passes the same way."""
    parser.add_argument("--repeats", type=int, default=default_repeats,
                        help="measure the whole table this many times; each cell: median, min–max")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for <name>.md/.json")
    parser.add_argument("--name", default=None, help="file name of the table (default: the benchmark's)")


def repeat(measure: Callable[[], dict[str, Any]], repeats: int, key: Sequence[str],
           on_repeat: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run `measure` (one whole table: a payload with `rows`) `repeats` times and aggregate (`aggregate`);
    `on_repeat` gets the aggregate so far after each repeat (to save partial results)."""
    payloads: list[dict[str, Any]] = []
    for i in range(repeats):
        print(f"[{time.strftime('%X')}] repeat {i + 1}/{repeats}", flush=True)
        payloads.append(measure())
        if on_repeat is not None:
            on_repeat(aggregate(payloads, key))
    return aggregate(payloads, key)


def run_table(name: str, device: torch.device, args: argparse.Namespace, measure: Callable[..., dict[str, Any]],
              render: Callable[[dict[str, Any]], str], key: Sequence[str], **fields: Any) -> dict[str, Any]:
    """A benchmark's main: print the environment, measure the whole table `args.repeats` times (saving the
    aggregate after each repeat, so a cut-off run keeps what it measured), print and return the table.
    `fields` are added to every repeat's payload (e.g. the shape)."""
    env = environment(device)
    print(env_line(env), flush=True)

    def save(payload: dict[str, Any]) -> str:
        table = render(payload)
        write_results(name, table, payload, args.out)
        return table

    payload = repeat(lambda: measure(args) | {"env": env, **fields}, args.repeats, key, on_repeat=save)
    print(save(payload))
    return payload


def aggregate(payloads: list[dict[str, Any]], key: Sequence[str]) -> dict[str, Any]:
    """Repeats of one table as one payload: the first repeat's fields, its numeric top-level fields (e.g. the
    measured ceilings) and every row's numeric fields replaced by the median over repeats (rows matched by
    `key`), `spread` = [min, max] beside them (research_lm.harness.report.aggregate_records), `repeats_raw` =
    every repeat's payload (without env)."""
    out = dict(payloads[0])
    top = aggregate_records([[{k: v for k, v in p.items() if _is_number(v)}] for p in payloads], ())[0]
    out |= {k: v for k, v in top.items() if k != "repeats"}
    out["rows"] = aggregate_records([p["rows"] for p in payloads], key)
    out["num_repeats"] = len(payloads)
    out["repeats_raw"] = [{k: v for k, v in p.items() if k != "env"} for p in payloads]
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def cell(row: dict[str, Any], key: str, spec: str, fn: Callable[[float], float] | None = None) -> str:
    """row[key] (or fn(row[key]), fn monotone: a scale, an inverse) as `spec`, then ` (min–max)` over the
    repeats where they differ at that precision; `—` when the row has no such field."""
    if key not in row:
        return "—"
    fn = fn or (lambda v: v)
    lo_hi = (row.get("spread") or {}).get(key)
    return fmt_spread(fn(row[key]), None if lo_hi is None else sorted(fn(v) for v in lo_hi), spec)


def repeats_line(payload: dict[str, Any]) -> str:
    n = payload.get("num_repeats", 1)
    if n == 1:
        return "One repeat (no spread)."
    return (f"Each value: the median over {n} repeats of the whole table (in this process), with the spread "
            "(min–max) in parentheses where the repeats differ at the shown precision; the JSON keeps every "
            "repeat's values.")


def free_cuda() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
