"""Fused Triton kernels for the elementwise glue between GEMMs, where profiling showed they pay.

Batch-1 decode of a Llama-3.2-1B shape on an H200 (CUDA graphs) spent ~1.0 ms of a ~1.9 ms forward in
hundreds of tiny kernels: RMSNorm (~7 each), rotary (~10 per tensor), SiLU * mul, residual adds, casts.
One file per kernel (`rms_norm`, `rotary`, `silu_and_mul`) holds the kernel and its launcher, which asserts
shapes, strides and dtypes; `reference.py` holds the torch code that defines their numbers. tests/ops
compares the two under the Triton interpreter. Triton is imported only when a kernel first runs.

Compile keys: Triton specializes int arguments on "== 1" and "divisible by 16" and pointers on 16-byte alignment.
Arguments that change from step to step (token and request counts, offsets into step buffers) are marked
`do_not_specialize` / `do_not_specialize_on_alignment`, and tile sizes do not follow them, so a new prompt length
never compiles a kernel mid-run (0.1 s each on a cold cache: PERFORMANCE.md, thirteenth pass).

The switch: modules that can fuse (`RMSNorm`, `RotaryEmbedding`, `GatedMLP` in models/layers.py) carry
`fused_ops = True` and take the fused path only for CUDA tensors and outside torch.compile (`use_fused`).
`set_fused_ops(model, False)` puts a model back on the torch path; the engine applies
`EngineConfig.fused_ops` (Hydra `runner.fused_ops`) to the target model and the drafter.

Batch invariance, a second switch of the same shape: modules whose CUDA kernels could reduce a row in an order
that depends on the rest of the step (`Linear` and its parallel variants, the LM head, `RMSNorm`, paged
`Attention`) carry `batch_invariant = False`; `set_batch_invariant(model, True)` sends them to the kernels of
`batch_invariant.py` (and the attention backend's invariant plan) for CUDA tensors (`use_batch_invariant`). On
CPU nothing changes: CPU torch kernels run as before. The engine applies `EngineConfig.batch_invariant` (Hydra
`runner.batch_invariant`, env `VLLM_BATCH_INVARIANT=1`) and refuses models that cannot meet it.

`exponential_race` is the sampler's: argmax(probs / q) with q the `rng.exponential_rows` noise hashed in
registers instead of ~20 int64 kernels over [N, V] (~2 ms per step at 256 x 128k on an H200). Its reference is
`sampler.random_sample`'s torch path, whose tokens it reproduces bit for bit; `random_sample` (hence the
drafters) takes it for tensors on `FUSED_DEVICE_TYPES`, outside torch.compile. The rejection sampler has a
kernel of its own that reuses this noise (research_lm/ops/rejection_kernel.py), under the same switch.
"""

from __future__ import annotations

import torch
from torch import nn

from research_lm.ops.reference import (
    apply_rotary,
    rms_norm_ref,
    rope_cos_sin,
    rotary_ref,
    silu_and_mul_ref,
    skinny_linear_ref,
)

# The most rows (tokens in a step) the skinny kernels take (`ops.skinny_linear`); `EngineConfig.skinny_rows` picks
# how many a run gives them (`PreNormDecoderLayer.skinny`).
SKINNY_MAX_ROWS = 4

# Device types the kernels serve; CPU keeps the readable torch path (tests add "cpu" to run the kernels
# there under TRITON_INTERPRET=1).
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def on_kernel_device(x: torch.Tensor) -> bool:
    """Whether x lives on a device the kernels serve."""
    return x.device.type in FUSED_DEVICE_TYPES


def use_fused(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `module` runs its kernel on `x`: its `fused_ops` switch is on, x lives on a device the kernels
    serve, and torch.compile is not tracing (inductor fuses the torch path itself, across more ops)."""
    return module.fused_ops and on_kernel_device(x) and not torch.compiler.is_compiling()


def set_fused_ops(module: nn.Module, enabled: bool) -> None:
    """Turn the kernels on or off in every submodule that has them."""
    for m in module.modules():
        if hasattr(m, "fused_ops"):
            m.fused_ops = enabled


def set_skinny_rows(module: nn.Module, rows: int) -> None:
    """Steps of up to `rows` tokens take the skinny kernels in every layer that has them (0: none)."""
    for m in module.modules():
        if hasattr(m, "skinny_rows"):
            m.skinny_rows = rows


def use_batch_invariant(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether `module` runs its batch-invariant kernel on `x`: its `batch_invariant` switch is on and x lives on a
    device the kernels serve (on CPU the switch changes nothing)."""
    return module.batch_invariant and x.device.type in FUSED_DEVICE_TYPES


def set_batch_invariant(module: nn.Module, enabled: bool) -> None:
    """Turn batch-invariant kernels on or off in every submodule that has them (whether the model can meet the
    guarantee is `batch_invariant.check_batch_invariant`'s question, which the engine asks on CUDA)."""
    for m in module.modules():
        if hasattr(m, "batch_invariant"):
            m.batch_invariant = enabled


__all__ = [
    "FUSED_DEVICE_TYPES", "SKINNY_MAX_ROWS", "apply_rotary", "on_kernel_device", "rms_norm_ref", "rope_cos_sin",
    "rotary_ref", "set_batch_invariant", "set_fused_ops", "set_skinny_rows", "silu_and_mul_ref", "skinny_linear_ref",
    "use_batch_invariant", "use_fused",
]
