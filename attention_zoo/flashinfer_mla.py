"""The `mla_flashinfer` backend: FlashInfer's MLA wrapper for the absorbed decode, over the shared latent cache.

Cache: the layout of every MLA backend (`MLABackendBase`), `[num_blocks, block_size, L + R]`.
FlashInfer's `BatchMLAPagedAttentionWrapper.run` takes the latent and the rope key as two paged
tensors `[num_pages, page_size, L]` / `[num_pages, page_size, R]`, but reads their page and row
strides (`ckv_stride_page`, `ckv_stride_n` in csrc/batch_mla_run.cu), so it gets two views of the one
cache, `kv_cache[..., :L]` and `kv_cache[..., L:]`: no second layout, no copy. Rows must start on
16 bytes (128-bit loads): L = 512 values does.

Decode rows (the absorbed path of `mla.py`): q_nope is absorbed through W_UK (one batched GEMM
over heads), FlashInfer attends over the paged latents with one latent "KV head" shared by all
heads and returns the latent output `[rows, H, L]`, and W_UV maps it back to per-head values (one
batched GEMM). Prefill requests take the naive path of the reference (`mla.naive_prefill`: gather,
up-project, attend per request), as in `mla_triton`: correct, not fast. The step's latents go in
with the Triton latent-write kernel of `mla_triton`.

Per step, `build_metadata` lays out the decode requests in FlashInfer's CSR form on the host
(`qo_indptr` over their query rows, `kv_indptr` / `kv_lens`, and the block ids, gathered from the
device block table without a sync). Per distinct MLA spec and dtype, the first layer that runs
plans one wrapper; every later layer of that spec reuses the plan (the `flashinfer` backend's
scheme). Plans are `causal=True`: FlashInfer aligns a request's queries with the end of its keys
(query i of q_len sees kv_len - q_len + i + 1 keys), which is what a multi-token decode request
(draft verification, `decode_query_len > 1`) needs; with one query per request it masks nothing.

FlashInfer's MLA kernels are built for DeepSeek-V2/V3's latent, kv_lora_rank 512 + rope 64 (its own
tests and docstrings use only these; the CUDA templates hard-code tilings for them): other shapes
are refused at build time. fp16 / bf16 only. `flashinfer` is imported when the first step is
planned, so importing this module (the registry does, to read the capabilities) works without it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from attention_zoo.base import AttentionImpl, AttentionSpec, BackendCapabilities
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.mla import (
    DECODE_QUERY_LEN,
    MLABackendBase,
    MLAImpl,
    MLAMetadata,
    MLASpec,
    build_mla_metadata,
    naive_prefill,
    split_kv_b,
)
from attention_zoo.registry import register_backend

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial outputs)
# FlashInfer's kernel family: "auto" takes FA3 on Hopper (sm90a), FA2 elsewhere; "fa2" / "fa3" force one.
WRAPPER_BACKEND = "auto"


@dataclass(frozen=True)
class FlashInferMLACapabilities(BackendCapabilities):
    """Capabilities plus the latent shapes FlashInfer's MLA kernels take and the optional package itself."""

    latent_dims: frozenset[tuple[int, int]] = frozenset({(512, 64)})  # (kv_lora_rank, qk_rope_head_dim)

    def missing(self, spec: AttentionSpec, device: torch.device, dtype: torch.dtype) -> str | None:
        reason = super().missing(spec, device, dtype)
        if reason is None:  # an MLA layer (super checked the kind)
            dims = (spec.kv_lora_rank, spec.qk_rope_head_dim)
            if dims not in self.latent_dims:
                supported = " or ".join(f"{lat} + {r}" for lat, r in sorted(self.latent_dims))
                reason = (f"does not support kv_lora_rank + qk_rope_head_dim = {dims[0]} + {dims[1]} "
                          f"(FlashInfer's MLA kernels take DeepSeek-V2/V3's {supported})")  # fmt: skip
        if reason is None and importlib.util.find_spec("flashinfer") is None:  # looks, does not import
            reason = "needs the flashinfer package (pip install 'research_lm[flashinfer]')"
        return reason


class FlashInferMLAWorkspace:
    """Per device: the float workspace (allocated once) and the MLA wrappers, one per plan key, reused every step.

    A wrapper holds one plan at a time; `planned_by` records which step's metadata that plan belongs
    to, so an older metadata that finds its wrapper re-planned by a newer step plans again.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrappers: dict[tuple, Any] = {}
        self.planned_by: dict[tuple, object] = {}

    def wrapper(self, key: tuple, backend: str) -> Any:
        if key not in self.wrappers:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            self.wrappers[key] = BatchMLAPagedAttentionWrapper(
                float_workspace_buffer=self.buffer, use_cuda_graph=False, backend=backend
            )
        return self.wrappers[key]


@dataclass
class FlashInferMLAMetadata(MLAMetadata):
    workspace: FlashInferMLAWorkspace | None = None
    wrapper_backend: str = WRAPPER_BACKEND
    # The decode requests (`decode_reqs`) in FlashInfer's CSR form; host tensors are copies (plan inputs).
    qo_indptr: torch.Tensor | None = None  # [num_decode_reqs + 1] int32, host: request j's rows of the decode rows
    kv_indptr: torch.Tensor | None = None  # [num_decode_reqs + 1] int32, host: request j's pages in kv_indices
    kv_indices: torch.Tensor | None = None  # [kv_indptr[-1]] int32, device: block ids
    kv_lens: torch.Tensor | None = None  # [num_decode_reqs] int32, host: keys of each request after this step
    _wrappers: dict[tuple, Any] = field(default_factory=dict)  # plan key -> wrapper planned for this step

    def wrapper(self, spec: MLASpec, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Any:
        """The wrapper planned for this layer's spec: planned by the first layer of that spec this step."""
        key = (self.wrapper_backend, spec, q_dtype, kv_dtype)
        if key in self._wrappers and self.workspace.planned_by.get(key) is self:
            return self._wrappers[key]
        wrapper = self.workspace.wrapper(key, self.wrapper_backend)
        wrapper.plan(
            qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr, kv_indices=self.kv_indices, kv_len_arr=self.kv_lens,
            num_heads=spec.num_heads, head_dim_ckv=spec.kv_lora_rank, head_dim_kpe=spec.qk_rope_head_dim,
            page_size=self.common.block_size, causal=True, sm_scale=spec.scale, q_data_type=q_dtype,
            kv_data_type=kv_dtype, use_profiler=False,
        )  # fmt: skip
        self._wrappers[key] = wrapper
        self.workspace.planned_by[key] = self
        return wrapper


def decode_pages(common: CommonAttentionMetadata, decode_reqs: list[int]) -> dict[str, torch.Tensor]:
    """FlashInfer's CSR description of the decode requests: host arithmetic, one host-to-device copy, no sync."""
    bs = common.block_size
    reqs = np.asarray(decode_reqs, dtype=np.int64)
    qsl = common.query_start_loc_cpu.numpy().astype(np.int64)
    kv_lens = common.seq_lens_cpu.numpy().astype(np.int64)[reqs]
    qo_indptr, kv_indptr = np.zeros(len(reqs) + 1, dtype=np.int64), np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(qsl[reqs + 1] - qsl[reqs], out=qo_indptr[1:])
    pages = (kv_lens + bs - 1) // bs
    np.cumsum(pages, out=kv_indptr[1:])
    rows = np.repeat(reqs, pages)
    cols = np.arange(kv_indptr[-1]) - np.repeat(kv_indptr[:-1], pages)
    where = torch.from_numpy(np.stack([rows, cols])).to(common.block_table.device)
    return dict(
        qo_indptr=torch.from_numpy(qo_indptr.astype(np.int32)),
        kv_indptr=torch.from_numpy(kv_indptr.astype(np.int32)),
        kv_indices=common.block_table[where[0], where[1]],
        kv_lens=torch.from_numpy(kv_lens.astype(np.int32)),
    )


class FlashInferMLAImpl(MLAImpl):
    def forward(self, q, kv_c, k_pe, kv_b_weight, kv_cache, metadata: FlashInferMLAMetadata):
        from attention_zoo.triton_kernels.mla_decode import write_latent

        spec, common = self.spec, metadata.common
        write_latent(kv_cache, kv_c, k_pe, common.slot_mapping)
        out = q.new_zeros(q.shape[0], spec.num_heads, spec.v_head_dim)
        naive_prefill(out, q, kv_cache, kv_b_weight, metadata, spec)
        n = metadata.num_decode_tokens
        if n == 0:
            return out
        q_dec = q[:n] if metadata.all_decode else q[metadata.decode_token_idx]
        q_nope, q_pe = q_dec.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)  # strided views
        w_uk, w_uv = split_kv_b(kv_b_weight, spec)  # [H, nope, L], [H, v, L]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, H, L], strided (FlashInfer reads strides)
        ckv, kpe = kv_cache.split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)  # views of the one cache
        o_lat = torch.empty(n, spec.num_heads, spec.kv_lora_rank, dtype=q.dtype, device=q.device)
        wrapper = metadata.wrapper(spec, q.dtype, kv_cache.dtype)
        wrapper.run(q_nope=q_lat, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, out=o_lat, return_lse=False)
        o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [n, H, v]
        if metadata.all_decode:
            out[:n] = o
        else:
            out[metadata.decode_token_idx] = o
        return out


@register_backend("mla_flashinfer")
class FlashInferMLABackend(MLABackendBase):
    capabilities = FlashInferMLACapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kinds=frozenset({"mla"}),
        cuda_graphs=False,  # plan() runs on the host every step; the graph-safe wrapper buffers are not wired up
    )
    # device -> its workspace and wrappers: allocated on the first step on that device, reused by every
    # later step (FlashInfer wants its workspace and plan buffers long-lived, not per step).
    _workspaces: ClassVar[dict[torch.device, FlashInferMLAWorkspace]] = {}

    @classmethod
    def workspace(cls, device: torch.device) -> FlashInferMLAWorkspace:
        if device not in cls._workspaces:
            cls._workspaces[device] = FlashInferMLAWorkspace(device)
        return cls._workspaces[device]

    @classmethod
    def build_metadata(
        cls,
        common: CommonAttentionMetadata,
        *,
        decode_query_len: int = DECODE_QUERY_LEN,
        wrapper_backend: str = WRAPPER_BACKEND,
    ) -> FlashInferMLAMetadata:
        """`wrapper_backend`: FlashInfer's kernel family ("auto", "fa2", "fa3"); tests compare them."""
        base = build_mla_metadata(common, decode_query_len)
        pages = decode_pages(common, base.decode_reqs) if base.num_decode_tokens else {}
        return FlashInferMLAMetadata(
            **vars(base), workspace=cls.workspace(common.query_start_loc.device), wrapper_backend=wrapper_backend,
            **pages,
        )  # fmt: skip

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl:
        return FlashInferMLAImpl(spec)
