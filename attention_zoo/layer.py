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

    def takes_rope(self, rope: Any) -> bool:
        """Whether `forward` may be given the rotary inputs instead of rotated q and k: the backend rotates them as
        it writes the cache (`BackendCapabilities.rope_in_kv_write`), and rope is the kernels' kind (no cos/sin
        table: `research_lm.models.layers.Rope` from the fused path; the torch path stays with the model, where
        torch.compile fuses it)."""
        return self.backend.capabilities.rope_in_kv_write and getattr(rope, "cos", True) is None

    @torch.compiler.disable  # see CacheLayer
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        attn_metadata: dict[str, Any],  # backend name -> that backend's metadata for this step
        rope: Any = None,  # where `takes_rope`: positions, inv_freq, attention_scaling; q and k then unrotated
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        metadata = attn_metadata[self.backend.name]
        if rope is None:
            return self.impl.forward(q, k, v, self.kv_cache, metadata)
        return self.impl.forward(q, k, v, self.kv_cache, metadata, rope=rope)
