"""Synthetic expert loads: Zipf-skewed popularity, optionally drifting over steps.

Each layer ranks its experts by a random permutation; expert of rank r (1-based) gets popularity
proportional to r ** -alpha (alpha = 0: uniform; 1: classic Zipf; a sequence: one alpha per layer, since
trained MoEs skew some layers more than others). A router picks top_k distinct
experts per token, so no expert can see more than every token: the expected share of tokens an
expert receives is its inclusion probability min(1, c * popularity), with c set so that the shares
sum to top_k. Token counts are Poisson draws around num_tokens * share. In a trace, log-popularity
takes a Gaussian random walk of standard deviation `drift` per step, so yesterday's placement slowly
goes stale. `mixture_trace` serves two workloads with independent popularities (think code and prose) in a
proportion that swings over the steps. Group-limited routing (DeepSeek-V3's topk_group) is not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _zipf_logits(num_layers: int, num_experts: int, alpha: float | Sequence[float],
                 gen: torch.Generator) -> torch.Tensor:
    ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_layers)]) + 1
    alpha = torch.as_tensor(alpha, dtype=torch.float64)
    if alpha.dim() == 1 and alpha.numel() != num_layers:
        raise ValueError(f"alpha has {alpha.numel()} values, one per layer needs {num_layers}")
    return -alpha.reshape(-1, 1) * ranks.to(torch.float64).log()  # [L, E]


def inclusion_probs(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """[..., E] popularity (sums to 1) -> [..., E] per-token selection probability min(1, c * p),
    summing to top_k (top_k <= E)."""
    capped = torch.zeros_like(probs, dtype=torch.bool)
    for _ in range(top_k + 1):  # each pass caps at least one more expert, or stops changing
        free = probs.masked_fill(capped, 0.0)
        scale = (top_k - capped.sum(-1, keepdim=True)) / free.sum(-1, keepdim=True).clamp_min(1e-300)
        new_capped = capped | (probs * scale >= 1.0)
        if torch.equal(new_capped, capped):
            break
        capped = new_capped
    return torch.where(capped, torch.ones_like(probs), (probs * scale).clamp(max=1.0))


def zipf_load(num_layers: int, num_experts: int, *, alpha: float | Sequence[float] = 1.0, num_tokens: int = 8192,
              top_k: int = 8, seed: int = 0) -> torch.Tensor:
    """[num_layers, num_experts] int64 token counts of one window."""
    gen = torch.Generator().manual_seed(seed)
    share = inclusion_probs(_zipf_logits(num_layers, num_experts, alpha, gen).softmax(-1), top_k)
    return torch.poisson(share * num_tokens, generator=gen).to(torch.int64)


def zipf_trace(num_steps: int, num_layers: int, num_experts: int, *, alpha: float | Sequence[float] = 1.0,
               drift: float = 0.05, num_tokens: int = 256, top_k: int = 8, seed: int = 0) -> torch.Tensor:
    """[num_steps, num_layers, num_experts] int64 per-step token counts with drifting popularity."""
    gen = torch.Generator().manual_seed(seed)
    logits = _zipf_logits(num_layers, num_experts, alpha, gen)
    walk = torch.randn(num_steps, num_layers, num_experts, generator=gen, dtype=torch.float64) * drift
    walk[0] = 0
    share = inclusion_probs((logits + walk.cumsum(0)).softmax(-1), top_k)
    return torch.poisson(share * num_tokens, generator=gen).to(torch.int64)


def mixture_trace(num_steps: int, num_layers: int, num_experts: int, *, alpha: float | Sequence[float] = 1.0,
                  period: int = 50, num_tokens: int = 256, top_k: int = 8, seed: int = 0) -> torch.Tensor:
    """[num_steps, num_layers, num_experts] int64: workloads A and B (independent Zipf popularities), step t's
    tokens a fraction w_t = (1 + sin(2 pi t / period)) / 2 from A and the rest from B."""
    gen = torch.Generator().manual_seed(seed)
    shares = [inclusion_probs(_zipf_logits(num_layers, num_experts, alpha, gen).softmax(-1), top_k) for _ in "AB"]
    w = (1 + torch.sin(2 * math.pi * torch.arange(num_steps, dtype=torch.float64) / period)) / 2
    share = w[:, None, None] * shares[0] + (1 - w[:, None, None]) * shares[1]
    return torch.poisson(share * num_tokens, generator=gen).to(torch.int64)
