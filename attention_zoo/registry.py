"""Backend registry: names map to lazily imported modules, which register their class on import."""

from __future__ import annotations

import importlib

import torch

from attention_zoo.base import AttentionBackend, AttentionSpec

# name -> module that defines it. Importing the module runs its @register_backend decorator, so a
# heavy optional dependency (FlashInfer) is imported only when its backend is chosen.
_BACKEND_MODULES: dict[str, str] = {
    "torch_ref": "attention_zoo.torch_ref",
    "triton": "attention_zoo.triton_attn",
    "flashinfer": "attention_zoo.flashinfer_attn",
    "mamba_torch_ref": "attention_zoo.mamba",
    "mamba_triton": "attention_zoo.mamba_triton",
    "mla_torch_ref": "attention_zoo.mla",
    "mla_triton": "attention_zoo.mla_triton",
    "mla_flashinfer": "attention_zoo.flashinfer_mla",
}
_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str):
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def available_backends() -> list[str]:
    return sorted(set(_BACKEND_MODULES) | set(_BACKENDS))


def get_backend(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        if name not in _BACKEND_MODULES:
            raise ValueError(f"unknown attention backend {name!r}; choose one of {available_backends()}")
        try:
            importlib.import_module(_BACKEND_MODULES[name])
        except ImportError as e:
            raise ValueError(f"attention backend {name!r} is not installed: {e}") from e
    return _BACKENDS[name]


def _serves(name: str, spec: AttentionSpec, device: torch.device, dtype: torch.dtype) -> str | None:
    try:
        backend = get_backend(name)
    except ValueError as e:
        return str(e)
    return backend.capabilities.missing(spec, device, dtype)


def select_backend(
    name: str, spec: AttentionSpec, device: torch.device, dtype: torch.dtype
) -> type[AttentionBackend]:
    """The backend `name` if it serves this layer; otherwise a ValueError that says why and what would."""
    backend = get_backend(name)
    reason = backend.capabilities.missing(spec, device, dtype)
    if reason is not None:
        working = [n for n in available_backends() if _serves(n, spec, device, dtype) is None]
        raise ValueError(
            f"attention backend {name!r} {reason} (layer kind {spec.kind!r}, device {device.type}, "
            f"dtype {dtype}); backends that would work: {working or 'none'}"
        )
    return backend
