"""Routed-expert compute: y_t = Σ_j w_tj · down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j].

Weights are stacked per physical expert slot (transformers 5's in-memory layout):
    w13: [num_slots, 2 * I, H]  gate rows, then up rows
    w2:  [num_slots, H, I]

Backends (`moe_backend` in `ModelBuildContext.extra`):
    torch   the reference: tokens sorted by expert, one matmul pair per expert that got tokens (host sync)
    triton  fused grouped GEMM (`research_lm.moe.triton_fused_moe`): tokens sorted by expert and padded to
            the tile height, one launch for gate_up with SiLU-and-mul in its epilogue, one launch for down
            with the routing weight in its epilogue; no host sync
    auto    triton on CUDA, torch elsewhere

Both backends write one row per (token, j) pair and sum the k rows of a token in a fixed order, so the
result does not depend on which replica of an expert served the token.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

MOE_BACKENDS = ("torch", "triton", "auto")


def resolve_moe_backend(name: str, device: torch.device) -> str:
    """The concrete backend for `name` on `device`; unsupported combinations fail here, at build time."""
    if name not in MOE_BACKENDS:
        raise ValueError(f"moe_backend {name!r} is not supported; supported: {list(MOE_BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"moe_backend 'triton' needs a CUDA device (got {device.type}); on CPU it runs only under the "
            "Triton interpreter (TRITON_INTERPRET=1, fp32/fp16, tiny shapes): use moe_backend 'torch'"
        )
    return name


def check_expert_args(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    num_tokens, hidden_size = hidden.shape
    num_slots, two_i, k_in = w13.shape
    assert k_in == hidden_size and two_i % 2 == 0, f"w13 {tuple(w13.shape)} does not fit hidden {hidden_size}"
    assert tuple(w2.shape) == (num_slots, hidden_size, two_i // 2), f"w2 {tuple(w2.shape)} does not fit w13"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    assert topk_ids.dtype == torch.int64 and hidden.dtype == w13.dtype == w2.dtype


def fused_experts_torch(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [P, 2I, H]
    w2: torch.Tensor,  # [P, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64 physical slots
) -> torch.Tensor:  # [T, H], hidden's dtype
    """Reference: sort the T*k (token, slot) pairs by slot, run each slot's MLP on its contiguous rows."""
    check_expert_args(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)  # [T*k] pair indices grouped by slot
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    x = hidden[order // top_k]  # [T*k, H]
    w = topk_weights.flatten()[order]  # [T*k]
    out_sorted = torch.empty_like(x)
    start = 0
    for slot, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            gate, up = F.linear(x[rows], w13[slot]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[slot])
            out_sorted[rows] = (y * w[rows, None]).to(x.dtype)  # weight applied in fp32, like the kernel
            start += n
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted
    return out.view(num_tokens, top_k, hidden.shape[1]).sum(dim=1)


def fused_experts(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [P, 2I, H]
    w2: torch.Tensor,  # [P, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64 physical slots
    backend: str = "torch",  # a resolved backend: "torch" or "triton"
) -> torch.Tensor:  # [T, H]
    if backend == "triton":
        from research_lm.moe.triton_fused_moe import fused_experts_triton  # Triton only when asked for

        return fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids)
    return fused_experts_torch(hidden, w13, w2, topk_weights, topk_ids)
