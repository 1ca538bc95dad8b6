"""The attention backends' registry (names -> lazily imported modules, which register their class on import), and
"auto": the backend each layer gets when none is named."""

from __future__ import annotations

import torch

from attention_zoo.base import AttentionBackend, AttentionSpec
from attention_zoo.registries import Registry

# name -> module that defines it. Importing the module runs its @register_backend decorator, so a
# heavy optional dependency (FlashInfer) is imported only when its backend is chosen.
BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend", {
    "torch_ref": "attention_zoo.torch_ref",
    "triton": "attention_zoo.triton_attn",
    "flashinfer": "attention_zoo.flashinfer_attn",
    "mamba_torch_ref": "attention_zoo.mamba",
    "mamba_triton": "attention_zoo.mamba_triton",
    "mla_torch_ref": "attention_zoo.mla",
    "mla_triton": "attention_zoo.mla_triton",
    "mla_flashinfer": "attention_zoo.flashinfer_mla",
})

AUTO = "auto"
# What "auto" tries per layer kind on CUDA, fastest first (experiments/results: attention_ablation_h200). Off CUDA
# it tries them in reverse: the torch references (the Triton ones run on CPU only under the interpreter, for tests).
_AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "attention": ("triton", "flashinfer", "torch_ref"),
    "mla": ("mla_triton", "mla_flashinfer", "mla_torch_ref"),
    "mamba": ("mamba_triton", "mamba_torch_ref"),
}


def register_backend(name: str):
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        return BACKENDS.register(name)(cls)

    return wrap


def available_backends() -> list[str]:
    return BACKENDS.names()


def auto_backend(spec: AttentionSpec, device: torch.device, dtype: torch.dtype) -> str:
    """The backend "auto" picks for this layer: the first in `_AUTO_ORDER` that serves it, preferring one that
    replays from CUDA graphs on CUDA (an eager step costs more than any kernel difference at small batch)."""
    order = _AUTO_ORDER.get(spec.kind, ())
    serving = [n for n in (order if device.type == "cuda" else order[::-1]) if _serves(n, spec, device, dtype) is None]
    if not serving:
        raise ValueError(f"no attention backend serves layer kind {spec.kind!r} on {device.type} in {dtype}")
    graphs = [n for n in serving if device.type == "cuda" and get_backend(n).capabilities.cuda_graphs]
    return (graphs or serving)[0]


def get_backend(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:  # "auto" is valid where a layer is built (select_backend)
        raise ValueError(f"unknown attention backend {name!r}; choose one of {[AUTO, *available_backends()]}")
    return BACKENDS.get(name)


def _serves(name: str, spec: AttentionSpec, device: torch.device, dtype: torch.dtype) -> str | None:
    try:
        backend = get_backend(name)
    except ValueError as e:
        return str(e)
    return backend.capabilities.missing(spec, device, dtype)


def select_backend(
    name: str, spec: AttentionSpec, device: torch.device, dtype: torch.dtype
) -> type[AttentionBackend]:
    """The backend `name` ("auto": `auto_backend`'s pick) if it serves this layer; otherwise a ValueError that
    says why and what would."""
    backend = get_backend(auto_backend(spec, device, dtype) if name == AUTO else name)
    reason = backend.capabilities.missing(spec, device, dtype)
    if reason is not None:
        working = [n for n in available_backends() if _serves(n, spec, device, dtype) is None]
        raise ValueError(
            f"attention backend {name!r} {reason} (layer kind {spec.kind!r}, device {device.type}, "
            f"dtype {dtype}); backends that would work: {working or 'none'}"
        )
    return backend
