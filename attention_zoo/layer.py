"""The attention layer models call: binds a backend's impl to this layer's slice of the KV cache."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attention_zoo.base import AttentionSpec
from attention_zoo.registry import select_backend


class CacheLayer(nn.Module):
    """A layer that owns a slice of the cache (paged KV, MLA latents, or Mamba state slots).

    The runner finds every `CacheLayer` in the model (and in a proposer's drafter), sizes the cache
    from their specs, and binds `kv_cache` once at start-up from `backend.allocate_cache`.

    NOTE: subclasses' `forward` is `torch.compiler.disable`d: under `runner.compile` the model compiles
    around them. Their metadata are host-side objects and their launch plans come from host integers;
    tracing them would guard on per-step values and recompile every step.
    """

    def __init__(self, spec: AttentionSpec, backend: str, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        self.backend = select_backend(backend, spec, device, dtype)
        self.impl = self.backend.make_impl(spec)
        self.kv_cache: Any = torch.empty(0)  # replaced by the runner's allocation


class Attention(CacheLayer):
    """Paged attention over this layer's KV cache."""

    @property
    def batch_invariant(self) -> bool:
        """The impl's switch (`research_lm.ops.set_batch_invariant` sets it like any module's): a backend whose
        capabilities claim `batch_invariant` then plans launches that no row's result depends on."""
        return self.impl.batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, enabled: bool) -> None:
        self.impl.batch_invariant = enabled

    @torch.compiler.disable  # see CacheLayer
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        attn_metadata: dict[str, Any],  # backend name -> that backend's metadata for this step
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        return self.impl.forward(q, k, v, self.kv_cache, attn_metadata[self.backend.name])
