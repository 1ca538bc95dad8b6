"""MLA (multi-head latent attention, DeepSeek-V2/V3): a latent KV cache, naive prefill, absorbed decode.

Per token the cache keeps one "head" of kv_lora_rank + qk_rope_head_dim values (L + R): the
normalised latent c (kv_a_layernorm's output) and the roped key k_pe that all heads share.
kv_b_proj's weight [H * (nope + v), L] holds, per head h, W_UK[h] [nope, L] and W_UV[h] [v, L]:

    k[h] = (W_UK[h] c, k_pe)        v[h] = W_UV[h] c
    score_h(q, t) = scale * (q_nope[h] . W_UK[h] c_t + q_pe[h] . k_pe_t)
                  = scale * ((W_UK[h]^T q_nope[h]) . c_t + q_pe[h] . k_pe_t)          (absorbed)
    out[h]        = sum_t p_t W_UV[h] c_t = W_UV[h] (sum_t p_t c_t)                   (absorbed)

Prefill (many queries per request: compute bound) up-projects the context once and runs ordinary
attention over H heads of (nope + R) / v dims. Decode (one query: bandwidth bound) absorbs W_UK into
the query and W_UV into the output, so it reads L + R values per cached token instead of
H * (nope + R + v), and attends with one latent "KV head" shared by all H query heads (MQA).

`build_mla_metadata` splits the step's requests into the two paths once per step, from the host
mirrors; each MLA backend then serves both in one `forward`. This file also holds the torch
reference backend "mla_torch_ref": a Python loop over requests, fp32 softmax, the oracle.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from attention_zoo.base import AttentionBackend, AttentionImpl, AttentionSpec, BackendCapabilities
from attention_zoo.layer import CacheLayer
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.registry import register_backend
from attention_zoo.torch_ref import causal_mask, gather_context, reference_attention

# Requests with at most this many query tokens take the absorbed (decode) path by default.
DECODE_QUERY_LEN = 1


@dataclass(frozen=True)
class MLASpec(AttentionSpec):
    """An MLA layer: H query heads over one cached latent "head" of head_size = kv_lora_rank + rope dims."""

    kv_lora_rank: int = 0  # L
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0  # R
    v_head_dim: int = 0
    kind: str = "mla"

    @classmethod
    def from_dims(
        cls, *, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
        scale: float,
    ) -> MLASpec:
        return cls(
            num_heads=num_heads, num_kv_heads=1, head_size=kv_lora_rank + qk_rope_head_dim, scale=scale,
            kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
        )

    def __post_init__(self) -> None:
        if self.num_kv_heads != 1 or self.head_size != self.kv_lora_rank + self.qk_rope_head_dim:
            raise ValueError(
                f"an MLA cache holds one latent head of kv_lora_rank + qk_rope_head_dim values; got "
                f"num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}"
            )

    def page_size_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """One latent per token, no separate K and V: block_size * (L + R) * itemsize."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return block_size * (self.kv_lora_rank + self.qk_rope_head_dim) * itemsize


# ---------------------------------------------------------------------------------------------------
# Metadata: which requests take which path, decided once per step


@dataclass
class MLAMetadata:
    common: CommonAttentionMetadata
    prefill_reqs: list[int]  # requests with query_len > decode_query_len: naive path
    decode_reqs: list[int]  # requests with 1 <= query_len <= decode_query_len: absorbed path
    # One row per query token of the decode requests, in batch order (a request with q_len > 1 gives
    # q_len rows, each seeing the keys up to its own position: causal).
    num_decode_tokens: int
    decode_token_idx: torch.Tensor  # [num_decode_tokens] int64, device: row in the flat batch
    decode_req_idx: torch.Tensor  # [num_decode_tokens] int32, device: request (block table row)
    decode_kv_lens: torch.Tensor  # [num_decode_tokens] int32, device: keys this token attends to
    max_decode_kv_len: int
    all_decode: bool  # every token of the batch is a decode row, in order: no gather/scatter needed


def build_mla_metadata(common: CommonAttentionMetadata, decode_query_len: int = DECODE_QUERY_LEN) -> MLAMetadata:
    """Split the batch from the host mirrors (no device sync) and lay out the decode rows."""
    qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
    query_lens = qsl[1:] - qsl[:-1]
    seq_lens = common.seq_lens_cpu.numpy().astype(np.int64)
    is_decode = (query_lens >= 1) & (query_lens <= decode_query_len)
    decode_reqs = np.flatnonzero(is_decode)
    n = query_lens[decode_reqs]
    req_idx = np.repeat(decode_reqs, n)
    first = np.repeat(np.cumsum(n) - n, n)  # index of each row's request's first decode row
    j = np.arange(int(n.sum())) - first  # offset of the token inside its request's query
    token_idx = qsl[req_idx] + j
    kv_lens = seq_lens[req_idx] - query_lens[req_idx] + j + 1
    device = common.query_start_loc.device
    num_tokens = int(qsl[-1])
    return MLAMetadata(
        common=common,
        prefill_reqs=np.flatnonzero(query_lens > decode_query_len).tolist(),
        decode_reqs=decode_reqs.tolist(),
        num_decode_tokens=len(token_idx),
        decode_token_idx=torch.from_numpy(token_idx).to(device, non_blocking=True),
        decode_req_idx=torch.from_numpy(req_idx.astype(np.int32)).to(device, non_blocking=True),
        decode_kv_lens=torch.from_numpy(kv_lens.astype(np.int32)).to(device, non_blocking=True),
        max_decode_kv_len=int(kv_lens.max()) if len(kv_lens) else 0,
        all_decode=len(token_idx) == num_tokens,
    )


# ---------------------------------------------------------------------------------------------------
# The math, shared by the backends (and by the tests as the oracle)


def write_latent(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    kv_c: torch.Tensor,  # [num_tokens, L], normalised latent
    k_pe: torch.Tensor,  # [num_tokens, R], roped shared key
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, not written
) -> None:
    num_tokens = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    latent = torch.cat((kv_c[:num_tokens], k_pe[:num_tokens]), dim=-1)
    flat[slot_mapping[valid]] = latent[valid].to(kv_cache.dtype)


def split_kv_b(
    kv_b_weight: torch.Tensor, spec: MLASpec
) -> tuple[torch.Tensor, torch.Tensor]:  # W_UK [H, nope, L], W_UV [H, v, L]: views, no copy
    w = kv_b_weight.view(spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
    return w[:, : spec.qk_nope_head_dim], w[:, spec.qk_nope_head_dim :]


def up_project(
    latent: torch.Tensor,  # [S, L + R] cache rows
    kv_b_weight: torch.Tensor,  # [H * (nope + v), L]
    spec: MLASpec,
) -> tuple[torch.Tensor, torch.Tensor]:  # k [S, H, nope + R], v [S, H, v]
    kv_c, k_pe = latent.split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
    kv = F.linear(kv_c.to(kv_b_weight.dtype), kv_b_weight).view(latent.shape[0], spec.num_heads, -1)
    k_nope, v = kv.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None, :].to(k_nope.dtype).expand(-1, spec.num_heads, -1)), dim=-1)
    return k, v


def naive_mla(
    q: torch.Tensor,  # [q_len, H, nope + R], rope applied
    latent: torch.Tensor,  # [S, L + R]: the request's context, this step's tokens last
    kv_b_weight: torch.Tensor,  # [H * (nope + v), L]
    spec: MLASpec,
) -> torch.Tensor:  # [q_len, H, v] fp32
    """Up-project every cached latent to per-head K and V, then causal attention."""
    k, v = up_project(latent, kv_b_weight, spec)
    seq_len = latent.shape[0]
    q_positions = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)
    return reference_attention(q, k, v, causal_mask(q_positions, seq_len, None), spec.scale)


def absorbed_mla(
    q: torch.Tensor,  # [q_len, H, nope + R], rope applied
    latent: torch.Tensor,  # [S, L + R]: the request's context, this step's tokens last
    kv_b_weight: torch.Tensor,  # [H * (nope + v), L]
    spec: MLASpec,
) -> torch.Tensor:  # [q_len, H, v] fp32
    """W_UK folded into the query, W_UV into the output: attention runs over the latents themselves."""
    w_uk, w_uv = split_kv_b(kv_b_weight.float(), spec)
    q_nope, q_pe = q.float().split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
    kv_c, k_pe = latent.float().split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
    q_lat = torch.einsum("qhn,hnl->qhl", q_nope, w_uk)  # [q_len, H, L]
    scores = (torch.einsum("qhl,sl->hqs", q_lat, kv_c) + torch.einsum("qhr,sr->hqs", q_pe, k_pe)) * spec.scale
    seq_len = latent.shape[0]
    q_positions = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)
    scores = scores.masked_fill(~causal_mask(q_positions, seq_len, None)[None], float("-inf"))
    o_lat = torch.einsum("hqs,sl->qhl", scores.softmax(dim=-1), kv_c)  # [q_len, H, L]
    return torch.einsum("qhl,hvl->qhv", o_lat, w_uv)


def naive_prefill(
    out: torch.Tensor,  # [num_tokens, H, v], rows of the prefill requests written
    q: torch.Tensor,  # [num_tokens, H, nope + R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R], this step's latents already written
    kv_b_weight: torch.Tensor,
    metadata: MLAMetadata,
    spec: MLASpec,
) -> None:
    """The naive path for every prefill request: its context latents gathered from the cache."""
    common = metadata.common
    qsl, seq_lens = common.query_start_loc_cpu.tolist(), common.seq_lens_cpu.tolist()
    for i in metadata.prefill_reqs:
        latent = gather_context(kv_cache, common.block_table[i], seq_lens[i])
        out[qsl[i] : qsl[i + 1]] = naive_mla(q[qsl[i] : qsl[i + 1]], latent, kv_b_weight, spec).to(out.dtype)


# ---------------------------------------------------------------------------------------------------
# The interface MLA backends implement, the layer models call, and the reference backend


class MLAImpl(AttentionImpl):
    """Per-layer MLA compute. `forward` writes this step's latents into the cache, then attends.

    Unlike `AttentionImpl.forward` it takes the latent (not per-head K/V) and kv_b_proj's weight,
    which the naive path up-projects with and the absorbed path folds into q and the output.
    """

    spec: MLASpec

    @abstractmethod
    def forward(  # type: ignore[override]
        self,
        q: torch.Tensor,  # [num_tokens, H, nope + R], rope applied
        kv_c: torch.Tensor,  # [num_tokens, L], after kv_a_layernorm
        k_pe: torch.Tensor,  # [num_tokens, R], rope applied
        kv_b_weight: torch.Tensor,  # [H * (nope + v), L]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
        metadata: MLAMetadata,
    ) -> torch.Tensor:  # [num_tokens, H, v]
        ...


class MLAAttention(CacheLayer):
    """MLA over this layer's latent cache; the model keeps kv_b_proj and passes its weight in."""

    spec: MLASpec

    @torch.compiler.disable  # see CacheLayer
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, H, nope + R], rope applied
        kv_c: torch.Tensor,  # [num_tokens, L], after kv_a_layernorm
        k_pe: torch.Tensor,  # [num_tokens, R], rope applied
        kv_b_weight: torch.Tensor,  # [H * (nope + v), L]
        attn_metadata: dict[str, Any],  # backend name -> that backend's metadata for this step
    ) -> torch.Tensor:  # [num_tokens, H, v]
        return self.impl.forward(q, kv_c, k_pe, kv_b_weight, self.kv_cache, attn_metadata[self.backend.name])


class MLATorchRefImpl(MLAImpl):
    def forward(self, q, kv_c, k_pe, kv_b_weight, kv_cache, metadata: MLAMetadata):
        common = metadata.common
        write_latent(kv_cache, kv_c, k_pe, common.slot_mapping)
        out = q.new_zeros(q.shape[0], self.spec.num_heads, self.spec.v_head_dim)
        naive_prefill(out, q, kv_cache, kv_b_weight, metadata, self.spec)
        qsl, seq_lens = common.query_start_loc_cpu.tolist(), common.seq_lens_cpu.tolist()
        for i in metadata.decode_reqs:
            latent = gather_context(kv_cache, common.block_table[i], seq_lens[i])
            out[qsl[i] : qsl[i + 1]] = absorbed_mla(q[qsl[i] : qsl[i + 1]], latent, kv_b_weight, self.spec).to(q.dtype)
        return out


class MLABackendBase(AttentionBackend):
    """What every MLA backend shares: the latent cache layout and the per-step split."""

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, spec: AttentionSpec) -> tuple[int, ...]:
        return (num_blocks, block_size, spec.head_size)

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata, *, decode_query_len: int = DECODE_QUERY_LEN):
        """`decode_query_len`: requests with up to this many query tokens take the absorbed path
        (0: everything naive; tests use it to compare the two paths)."""
        return build_mla_metadata(common, decode_query_len)


@register_backend("mla_torch_ref")
class MLATorchRefBackend(MLABackendBase):
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kinds=frozenset({"mla"}),
        eager_plans_on_host=True,
    )

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl:
        return MLATorchRefImpl(spec)
