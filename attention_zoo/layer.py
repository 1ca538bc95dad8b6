"""The attention layer models call: binds a backend's impl to this layer's slice of the KV cache."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attention_zoo.base import AttentionSpec
from attention_zoo.registry import select_backend


class Attention(nn.Module):
    """Paged attention over this layer's KV cache. The runner binds `kv_cache` once at start-up."""

    def __init__(self, spec: AttentionSpec, backend: str, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        self.backend = select_backend(backend, spec, device, dtype)
        self.impl = self.backend.make_impl(spec)
        self.kv_cache = torch.empty(0)  # replaced by the runner's allocation

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        attn_metadata: dict[str, Any],  # backend name -> that backend's metadata for this step
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        return self.impl.forward(q, k, v, self.kv_cache, attn_metadata[self.backend.name])
