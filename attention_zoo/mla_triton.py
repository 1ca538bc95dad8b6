"""The `mla_triton` backend: a Triton latent write and a Triton absorbed-decode kernel over the latent cache.

Decode rows: q_nope is absorbed through W_UK (one batched GEMM over heads), `mla_decode` attends
over the paged latents (split-KV when few rows meet long contexts), and W_UV maps the latent output
back to per-head values (one batched GEMM). Eager steps send prefill requests down the naive path of
the reference (`mla.naive_prefill`: gather, up-project, attend per request, a host loop): correct, not
yet fast. The split count is chosen once per step from host integers (`SplitPlan`), each split taking at
least MIN_TOKENS_PER_SPLIT keys.

CUDA graphs (decode, verify and batch-1 prefill graphs) record the absorbed path for every token row:
it is exact for any query length (the same sums, associated differently), so a graph needs no
host-side split of its batch. `mla_decode_tokens` finds each row's request and causal key count on the
device from query_start_loc and seq_lens, so the recording serves every step of its shape with nothing
to refresh (no `prepare_replay`, no host plan: draft chains may use it too); padding rows see 0 keys and
return 0. The split count is fixed at capture from B * q rows and max_model_len; shorter contexts leave
the splits they do not need empty.
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
from attention_zoo.triton_attn import MIN_TOKENS_PER_SPLIT, _sm_count, choose_num_splits
from attention_zoo.triton_kernels.mla_decode import mla_decode, mla_decode_tokens, write_latent

# Under TRITON_INTERPRET=1 the kernels run (slowly) on CPU tensors; that is how CPU tests use them.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_H = 16  # query heads per program (tl.dot needs >= 16 rows)
BLOCK_N = 16 if _INTERPRET else 32  # keys per inner iteration


@dataclass
class SplitPlan:
    """The split-KV count of `rows` decode rows over contexts of up to `max_kv_len` keys, per head count."""

    rows: int
    max_kv_len: int
    sm_count: int
    force_num_splits: int | None = None  # tests force the split-KV path on (or off) with this
    # num_heads -> split count: decided by the first layer of that shape, reused by the others.
    _splits: dict[int, int] = field(default_factory=dict)

    def num_splits(self, num_heads: int) -> int:
        if self.force_num_splits is not None:
            return self.force_num_splits
        if num_heads not in self._splits:
            head_blocks = triton.cdiv(num_heads, BLOCK_H)
            self._splits[num_heads] = choose_num_splits(self.rows, head_blocks, self.max_kv_len, True, self.sm_count)
        return self._splits[num_heads]

    @property
    def min_split_tokens(self) -> int:
        return 0 if self.force_num_splits is not None else MIN_TOKENS_PER_SPLIT


@dataclass
class MLATritonMetadata(MLAMetadata):
    plan: SplitPlan  # of the decode rows


@dataclass
class MLATritonGraphMetadata:
    """A CUDA graph's: every token row of its B * q is an absorbed decode row, found by the kernel."""

    common: CommonAttentionMetadata  # the graph's padded record, over the persistent step buffers
    plan: SplitPlan  # fixed at capture for B * q rows and max_model_len


class MLATritonImpl(MLAImpl):
    def forward(self, q, kv_c, k_pe, kv_b_weight, kv_cache, metadata: MLATritonMetadata | MLATritonGraphMetadata):
        spec, common, plan = self.spec, metadata.common, metadata.plan
        write_latent(kv_cache, kv_c, k_pe, common.slot_mapping)
        launch = dict(
            scale=spec.scale,
            num_splits=plan.num_splits(spec.num_heads),
            min_split_tokens=plan.min_split_tokens,
            block_h=BLOCK_H,
            block_n=BLOCK_N,
            upcast=_INTERPRET,
        )
        if isinstance(metadata, MLATritonGraphMetadata):
            q_lat, q_pe, w_uv = self._absorb(q, kv_b_weight)
            o_lat = mla_decode_tokens(
                q_lat,
                q_pe,
                kv_cache,
                common.block_table,
                common.query_start_loc,
                common.seq_lens,
                num_reqs=common.num_reqs,
                **launch,
            )
            return self._expand(o_lat, w_uv)
        out = q.new_zeros(q.shape[0], spec.num_heads, spec.v_head_dim)
        naive_prefill(out, q, kv_cache, kv_b_weight, metadata, spec)
        if metadata.num_decode_tokens == 0:
            return out
        q_dec = q[: metadata.num_decode_tokens] if metadata.all_decode else q[metadata.decode_token_idx]
        q_lat, q_pe, w_uv = self._absorb(q_dec, kv_b_weight)
        o_lat = mla_decode(
            q_lat, q_pe, kv_cache, common.block_table, metadata.decode_req_idx, metadata.decode_kv_lens, **launch
        )
        o = self._expand(o_lat, w_uv)
        if metadata.all_decode:
            out[: metadata.num_decode_tokens] = o
        else:
            out[metadata.decode_token_idx] = o
        return out

    def _absorb(
        self,
        q: torch.Tensor,  # [N, H, nope + R]
        kv_b_weight: torch.Tensor,  # [H * (nope + v), L]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q_lat [N, H, L] (strided), q_pe [N, H, R], W_UV
        spec = self.spec
        q_nope, q_pe = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = _split_kv_b(kv_b_weight, spec)  # [H, nope, L], [H, v, L]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe, w_uv

    @staticmethod
    def _expand(
        o_lat: torch.Tensor,  # [N, H, L]
        w_uv: torch.Tensor,  # [H, v, L]
    ) -> torch.Tensor:  # [N, H, v]
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


@register_backend("mla_triton")
class MLATritonBackend(MLABackendBase):
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda", "cpu"} if _INTERPRET else {"cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kinds=frozenset({"mla"}),
        cuda_graphs=True,
        cuda_graphs_multi_token=True,  # every token a causal absorbed row: any query length up to the graph's
        eager_plans_on_host=True,
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
        plan = SplitPlan(
            base.num_decode_tokens, base.max_decode_kv_len, _sm_count(common.query_start_loc.device), force_num_splits
        )
        return MLATritonMetadata(**vars(base), plan=plan)

    @classmethod
    def build_graph_metadata(
        cls, common: CommonAttentionMetadata, *, force_num_splits: int | None = None
    ) -> MLATritonGraphMetadata:
        plan = SplitPlan(
            common.num_tokens, common.max_seq_len, _sm_count(common.query_start_loc.device), force_num_splits
        )
        return MLATritonGraphMetadata(common, plan)

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl:
        return MLATritonImpl(spec)
