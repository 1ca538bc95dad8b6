"""Llama building blocks for the trainable heads, with the parameter names the published layouts use
(`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, `*_layernorm`), so a head's `state_dict()`
is its checkpoint. Training-only: plain PyTorch, full sequences, no KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int -> cos, sin: [T, head_dim] fp32 (Llama's default rotary embedding)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos, sin: [T, head_dim]."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Llama attention whose q/k/v read `in_features` (2 x hidden for EAGLE-3's midlayer)."""

    def __init__(self, in_features: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, in_features] -> q, k, v: [B, num_heads, T, head_dim] (k, v repeated over the GQA groups)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        return q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """attn: [B, num_heads, T, head_dim] -> [B, T, hidden]."""
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """EAGLE-3 training-time test attention. q, keys[i], values[i]: [B, heads, T, head_dim].

    keys[0]/values[0] come from the step fed with the target's features: the query at position t sees
    them causally (positions <= t). keys[j>0] come from unrolled step j, whose row t holds the draft's
    own j-th guess after t: the query at t sees only that row (the diagonal), as the drafter will at
    inference after j accepted draft tokens.
    """
    t = q.shape[2]
    scale = q.shape[-1] ** -0.5
    scores = (q @ keys[0].transpose(-1, -2)) * scale  # [B, heads, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    diag = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]  # each [B, heads, T, 1]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :t] @ values[0]
    for j, v in enumerate(values[1:]):
        out = out + probs[..., t + j: t + j + 1] * v
    return out


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@torch.no_grad()
def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Hugging Face's Llama init: N(0, std) matrices, zero biases (norm scales stay 1)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.normal_(0.0, std)
            if m.bias is not None:
                m.bias.zero_()
