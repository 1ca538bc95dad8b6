"""The `mla_triton` backend: a Triton latent write and a Triton absorbed-decode kernel over the latent cache.

Decode rows: q_nope is absorbed through W_UK (one batched GEMM over heads), `mla_decode` attends
over the paged latents (split-KV when few rows meet long contexts), and W_UV maps the latent output
back to per-head values (one batched GEMM). Prefill requests take the naive path of the reference
(`mla.naive_prefill`: gather, up-project, attend per request): correct, not yet fast.
The split count is chosen once per step from host integers (`MLATritonMetadata.num_splits`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton

from attention_zoo.base import AttentionImpl, AttentionSpec, BackendCapabilities
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.mla import DECODE_QUERY_LEN, MLABackendBase, MLAImpl, MLAMetadata, build_mla_metadata, naive_prefill
from attention_zoo.mla import split_kv_b as _split_kv_b
from attention_zoo.registry import register_backend
from attention_zoo.triton_attn import _sm_count, choose_num_splits
from attention_zoo.triton_kernels.mla_decode import mla_decode, write_latent

# Under TRITON_INTERPRET=1 the kernels run (slowly) on CPU tensors; that is how CPU tests use them.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_H = 16  # query heads per program (tl.dot needs >= 16 rows)


@dataclass
class MLATritonMetadata(MLAMetadata):
    sm_count: int = 1
    force_num_splits: int | None = None  # tests force the split-KV path on (or off) with this
    # num_heads -> split count: decided by the first layer of that shape, reused by the others.
    _splits: dict[int, int] = field(default_factory=dict)

    def num_splits(self, num_heads: int) -> int:
        if self.force_num_splits is not None:
            return self.force_num_splits
        if num_heads not in self._splits:
            head_blocks = triton.cdiv(num_heads, BLOCK_H)
            self._splits[num_heads] = choose_num_splits(
                self.num_decode_tokens, head_blocks, self.max_decode_kv_len, True, self.sm_count
            )
        return self._splits[num_heads]


class MLATritonImpl(MLAImpl):
    def forward(self, q, kv_c, k_pe, kv_b_weight, kv_cache, metadata: MLATritonMetadata):
        spec, common = self.spec, metadata.common
        write_latent(kv_cache, kv_c, k_pe, common.slot_mapping)
        out = q.new_zeros(q.shape[0], spec.num_heads, spec.v_head_dim)
        naive_prefill(out, q, kv_cache, kv_b_weight, metadata, spec)
        if metadata.num_decode_tokens == 0:
            return out
        q_dec = q[: metadata.num_decode_tokens] if metadata.all_decode else q[metadata.decode_token_idx]
        q_nope, q_pe = q_dec.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = _split_kv_b(kv_b_weight, spec)  # [H, nope, L], [H, v, L]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, L], strided
        o_lat = mla_decode(
            q_lat, q_pe, kv_cache, common.block_table, metadata.decode_req_idx, metadata.decode_kv_lens,
            scale=spec.scale, num_splits=metadata.num_splits(spec.num_heads), block_h=BLOCK_H,
            block_n=16 if _INTERPRET else 32, upcast=_INTERPRET,
        )  # fmt: skip
        o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [N, H, v]
        if metadata.all_decode:
            out[: metadata.num_decode_tokens] = o
        else:
            out[metadata.decode_token_idx] = o
        return out


@register_backend("mla_triton")
class MLATritonBackend(MLABackendBase):
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda", "cpu"} if _INTERPRET else {"cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kinds=frozenset({"mla"}),
    )

    @classmethod
    def build_metadata(
        cls,
        common: CommonAttentionMetadata,
        *,
        decode_query_len: int = DECODE_QUERY_LEN,
        force_num_splits: int | None = None,
    ) -> MLATritonMetadata:
        base = build_mla_metadata(common, decode_query_len)
        return MLATritonMetadata(
            **vars(base), sm_count=_sm_count(common.query_start_loc.device), force_num_splits=force_num_splits
        )

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl:
        return MLATritonImpl(spec)
