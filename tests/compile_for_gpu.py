"""Compile, for a Hopper GPU and on a machine without one, every Triton kernel that CPU tests launch.

    python -m tests.compile_for_gpu [PYTEST_ARGS...]   # default: tests/ops tests/attention_zoo tests/spec_decode

Why: the interpreter (TRITON_INTERPRET=1, how CI runs our kernels) executes a kernel's Python without Triton's
front end, so a kernel can pass every CPU test and still fail to compile on the GPU (session 28: `rope_and_cache`
redefined a variable with another shape inside an `if`; every GPU test through the triton backend failed). Triton
compiles for a `GPUTarget` without a device (its ptxas is bundled), so this runs the given tests under the
interpreter, records each kernel launch's argument types and constexprs, then compiles each distinct launch
(at most `PER_KERNEL` per kernel) for sm_90 in a subprocess without the interpreter. Run it before a device session;
it takes a few minutes, so CI leaves it out.
"""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any

PER_KERNEL = 6  # distinct launches compiled per kernel (the first seen)
TARGET = ("cuda", 90, 32)  # H100 / H200
_TENSOR_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
                 "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def describe(fn: Any, args: tuple, kwargs: dict) -> tuple | None:
    """(module, name, signature, constexprs, options) of one launch, or None for what it cannot type."""
    import torch

    params = inspect.signature(fn).parameters
    values = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constexprs = {}, {}
    for i, (name, param) in enumerate(params.items()):
        value = values.get(name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TENSOR_TYPES[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            return None
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return fn.__module__, fn.__qualname__, signature, constexprs, options


class Recorder:
    """A pytest plugin: records every interpreted kernel launch."""

    def __init__(self):
        self.launches: dict[tuple, tuple] = {}

    def pytest_configure(self, config):
        from triton.runtime.interpreter import InterpretedFunction

        real_run, launches = InterpretedFunction.run, self.launches

        def run(kernel, *args, grid, warmup, **kwargs):
            launch = describe(kernel.fn, args, kwargs)
            if launch is not None:
                key = repr(launch)
                if key not in launches and sum(k[:2] == launch[:2] for k in launches.values()) < PER_KERNEL:
                    launches[key] = launch
            return real_run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run


def compile_all(path: str) -> int:
    """(In the subprocess, without the interpreter.) Compile each recorded launch; the number that failed."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with open(path, "rb") as f:
        launches = pickle.load(f)
    failed = 0
    for module, name, signature, constexprs, options in launches:
        kernel = getattr(importlib.import_module(module), name, None)
        if kernel is None:  # a kernel made inside a function: not reachable by name
            print(f"skip    {module}.{name}", flush=True)
            continue
        while not isinstance(kernel, triton.runtime.JITFunction):  # autotune / heuristics wrappers
            kernel = kernel.fn
        try:
            triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget(*TARGET), options=options)
            print(f"ok      {module}.{name} {options}", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported, then counted
            failed += 1
            print(f"FAILED  {module}.{name} {options} {signature}\n{type(e).__name__}: {e}", flush=True)
    return failed


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compile"]:
        return min(compile_all(argv[1]), 1)
    import pytest

    os.environ["TRITON_INTERPRET"] = "1"
    recorder = Recorder()
    pytest.main([*(argv or ["tests/ops", "tests/attention_zoo", "tests/spec_decode"]), "-q", "-p", "no:cacheprovider",
                 "-m", "not gpu", "-x"], plugins=[recorder])
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        pickle.dump(list(recorder.launches.values()), f)
    print(f"compiling {len(recorder.launches)} launches for sm_{TARGET[1]}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "tests.compile_for_gpu", "--compile", f.name], env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
