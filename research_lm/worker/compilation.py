"""`runner.compile`: the model forward through torch.compile (inductor), with the attention layers left eager.

How it meets the rest of the runner:
- Attention, MLA and Mamba layers (`attention_zoo` CacheLayers) are `torch.compiler.disable`d: their metadata
  are host-side objects and their Triton launch plans come from host integers, so tracing them would guard on
  per-step values and recompile. Dynamo compiles the pieces between them (norms, rotary, projections,
  SiLU * mul, residual adds), which is where inductor's fusion pays. Layers that sync with the host (MoE
  routing's bincount().tolist()) break the graph there; correct, just less fused.
- dynamic=True: one graph for every token count. Dynamo still specializes sizes 0 and 1, so batch-1 decode
  compiles once more.
- mode "default", not "reduce-overhead": the runner's decode CUDA graphs (cuda_graphs.py) capture the compiled
  forward; their warm-up call compiles it first, so nothing compiles under capture. Inductor's own CUDA
  graphs would nest inside ours.
- The fused Triton ops (`research_lm.ops`) step aside while dynamo traces: inductor generates its own kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# The CPU test uses "inductor" too (C++ codegen; needs a C compiler). "aot_eager" traces without codegen:
# the choice for a machine without a compiler, or to tell a dynamo problem from an inductor one.
COMPILE_BACKEND = "inductor"


def compile_forward(model: nn.Module, backend: str | None = None) -> Callable:
    """`model`'s forward compiled (same signature and outputs); the module itself is left as it was."""
    return torch.compile(model, dynamic=True, backend=backend or COMPILE_BACKEND)
