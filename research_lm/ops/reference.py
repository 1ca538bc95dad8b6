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


def skinny_linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K], or [2N, K] (gate rows, then up rows) with silu_mul
    bias: torch.Tensor | None = None,  # [N] or [2N]
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: rms-normalize x with it first
    eps: float = 0.0,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,  # [M, N]: added to the output
) -> torch.Tensor:  # [M, N]
    """The per-op path that `ops.skinny_linear` fuses: norm, linear, SwiGLU, residual add."""
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    y = F.linear(x, weight, bias)
    if silu_mul:
        y = silu_and_mul_ref(y)
    return y if residual is None else y + residual


def gather_step_inputs_ref(
    token_ids: torch.Tensor,  # int32 [R, W]: per request row, prompt + outputs + drafts
    num_computed: torch.Tensor,  # int32 [R]
    block_table: torch.Tensor,  # int32 [>= b, blocks], in batch order
    staging: torch.Tensor,  # int64 [>= 2b + 1]: request rows [b] (-1: padding), query_start_loc [b + 1]
    input_ids: torch.Tensor,  # int64 [>= t_pad]
    positions: torch.Tensor,  # int64 [>= t_pad]
    slot_mapping: torch.Tensor,  # int64 [>= t_pad]
    seq_lens: torch.Tensor,  # int32 [>= b]
    query_start_loc: torch.Tensor,  # int32 [>= b + 1]
    request_rows: torch.Tensor,  # int32 [>= b]
    *, b: int, t_pad: int, max_query_len: int, block_size: int,
) -> None:
    """One step's inputs from the tables (research_lm.ops.step_inputs); no host sync. Token t of request i
    (qsl[i] <= t < qsl[i+1]) sits at pos = num_computed[row_i] + t - qsl[i]; tokens from T = qsl[b] on are padding.
    max_query_len only sizes the kernel's grid."""
    dev = staging.device
    rows, qsl = staging[:b], staging[b : 2 * b + 1]
    real = rows >= 0
    computed = torch.where(real, num_computed[rows.clamp(min=0)].to(torch.int64), 0)
    t = torch.arange(t_pad, device=dev)
    token_real = t < qsl[b]
    req = torch.searchsorted(qsl[1:], t, right=True).clamp(max=b - 1)  # qsl[req] <= t < qsl[req + 1]
    pos = torch.where(token_real, computed[req] + t - qsl[req], 0)
    ids = token_ids[rows[req].clamp(min=0), pos].to(torch.int64)
    blocks = block_table[req, (pos // block_size).clamp(max=block_table.shape[1] - 1)].to(torch.int64)
    input_ids[:t_pad] = torch.where(token_real, ids, 0)
    positions[:t_pad] = pos
    slot_mapping[:t_pad] = torch.where(token_real, blocks * block_size + pos % block_size, -1)
    seq_lens[:b] = torch.where(real, computed + qsl[1:] - qsl[:-1], 0)
    query_start_loc[: b + 1] = qsl
    request_rows[:b] = torch.where(real, rows, -1)


def _row_columns(
    token_ids: torch.Tensor,  # int32 [R, W]
    num_tokens: torch.Tensor,  # int32 [R]
    rows: torch.Tensor,  # int [n]
    counts: torch.Tensor,  # int [n]: tokens to write per request
    m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # row, column, mask: [n, m] each
    """Where request i's j-th new token goes: (row, num_tokens[row] + j), kept where j < counts[i], the row is real
    and the column is inside W."""
    r = rows.to(torch.int64).clamp(min=0)
    j = torch.arange(m, device=rows.device)
    cols = num_tokens[r].to(torch.int64)[:, None] + j
    keep = (rows >= 0)[:, None] & (j < counts[:, None]) & (cols < token_ids.shape[1])
    return r[:, None].expand(-1, m), cols, keep


def advance_rows_ref(
    token_ids: torch.Tensor,  # int32 [R, W]
    num_tokens: torch.Tensor,  # int32 [R]
    num_computed: torch.Tensor,  # int32 [R]
    rows: torch.Tensor,  # int [n]: < 0 skipped; no row twice
    delta: torch.Tensor,  # int [n]: num_new_tokens - scheduled drafts
    emitted: torch.Tensor,  # int64 [n, m]
    num_emitted: torch.Tensor,  # int [n], 0..m
) -> None:
    """Append each request's e = num_emitted[i] tokens to its row (never past W); num_tokens += e;
    num_computed += delta + max(e - 1, 0): every emitted token but the last (the freshly sampled one) has its KV."""
    r, cols, keep = _row_columns(token_ids, num_tokens, rows, num_emitted, emitted.shape[1])
    token_ids[r[keep], cols[keep]] = emitted[keep].to(torch.int32)
    real = rows >= 0
    rr, e = rows[real].to(torch.int64), num_emitted[real].to(torch.int64)
    num_tokens[rr] = (num_tokens[rr] + e).to(torch.int32)
    num_computed[rr] = (num_computed[rr] + delta[real] + (e - 1).clamp(min=0)).to(torch.int32)


def write_drafts_ref(
    token_ids: torch.Tensor,  # int32 [R, W]
    num_tokens: torch.Tensor,  # int32 [R]
    rows: torch.Tensor,  # int [n]: < 0 skipped
    drafts: torch.Tensor,  # int64 [n, k]
) -> None:
    """token_ids[row, num_tokens[row] + j] = drafts[i, j] for j < k, never past W; counts unchanged."""
    n, k = drafts.shape
    r, cols, keep = _row_columns(token_ids, num_tokens, rows, torch.full((n,), k, device=rows.device), k)
    token_ids[r[keep], cols[keep]] = drafts[keep].to(torch.int32)
