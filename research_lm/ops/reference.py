"""The torch references of the fused ops: the numbers each kernel must reproduce, and the path models
take on CPU, under torch.compile, and with fused ops off. Plain torch, no Triton import."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden], x's dtype
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * x / rms(x), or with a residual (norm(x + residual), x + residual): the new residual stream.

    transformers' LlamaRMSNorm: statistics in fp32, the normalized x rounded to x's dtype, then times weight."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * x32.to(x.dtype)
    return normed if residual is None else (normed, x)


def rope_cos_sin(
    positions: torch.Tensor,  # [num_tokens] int64
    inv_freq: torch.Tensor,  # [rotary_dim // 2] fp32
    attention_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_tokens, rotary_dim // 2] fp32, scaled
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_size]
    cos: torch.Tensor,  # [num_tokens, rotary_dim // 2] fp32
    sin: torch.Tensor,  # [num_tokens, rotary_dim // 2] fp32
) -> torch.Tensor:  # [num_tokens, num_heads, head_size], x's dtype
    """Rotate pairs (x[i], x[i + rotary_dim/2]) by position * inv_freq[i]; dims past rotary_dim pass through."""
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary_dim].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def rotary_ref(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    k: torch.Tensor | None,  # [num_tokens, num_k_heads, head_size]
    positions: torch.Tensor,  # [num_tokens] int64
    inv_freq: torch.Tensor,  # [rotary_dim // 2] fp32
    attention_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    cos, sin = rope_cos_sin(positions, inv_freq, attention_scaling)
    return apply_rotary(q, cos, sin), None if k is None else apply_rotary(k, cos, sin)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [..., 2 * I] -> [..., I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def graph_step_inputs_ref(
    staging: torch.Tensor,  # int64 [b*q + 2b + 1 (+ b)]: token values (or -1 - index into source), starts, rows,
    # n (then, with a shift, each request's index into it or -1)
    source: torch.Tensor | None,  # int64 [*]: tokens still on the device (placeholders' values)
    block_table: torch.Tensor,  # int32 [>= b, blocks]
    input_ids: torch.Tensor,  # int64 [b*q]
    positions: torch.Tensor,  # int64 [b*q]
    slot_mapping: torch.Tensor,  # int64 [b*q]
    seq_lens: torch.Tensor,  # int32 [b]
    query_start_loc: torch.Tensor,  # int32 [b + 1]
    request_rows: torch.Tensor,  # int32 [b]
    *, b: int, q: int, block_size: int,
    shift: torch.Tensor | None = None,  # int64 [*]: start corrections (a step staged before the last was verified)
) -> None:
    """The step buffers of n requests of q tokens each, padded to b (research_lm.ops.graph_step_inputs)."""
    t = b * q
    n = int(staging[t + 2 * b])
    values, starts, rows = staging[:t], staging[t : t + b], staging[t + b : t + 2 * b]
    real_req = torch.arange(b, device=staging.device) < n
    if shift is not None:
        at = staging[t + 2 * b + 1 : t + 3 * b + 1]
        starts = starts + torch.where(real_req & (at >= 0), shift[at.clamp(min=0)], 0)
    real = real_req.repeat_interleave(q)
    ids = values.clamp(min=0)
    if source is not None:
        ids = torch.where(values >= 0, values, source[(-1 - values).clamp(min=0)])
    pos = (starts[:, None] + torch.arange(q, device=staging.device)).reshape(-1)
    req = torch.arange(b, device=staging.device).repeat_interleave(q)
    blocks = block_table[req, (pos // block_size).clamp(max=block_table.shape[1] - 1)].to(torch.int64)
    input_ids.copy_(torch.where(real, ids, 0))
    positions.copy_(torch.where(real, pos, 0))
    slot_mapping.copy_(torch.where(real, blocks * block_size + pos % block_size, -1))
    seq_lens.copy_(torch.where(real_req, starts + q, 0))
    query_start_loc.copy_(torch.arange(b + 1, device=staging.device).clamp(max=n) * q)
    request_rows.copy_(torch.where(real_req, rows, -1))
