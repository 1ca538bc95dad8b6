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

CUDA graphs (decode graphs of B requests x 1 row; with `cuda_graphs_multi_token`, verify graphs of q rows per
request and batch-1 prefill graphs of Q rows): every row of a graph is a decode row, so a request of several rows
(drafts to verify, a prompt or its chunk) is attended causally by FlashInfer where an eager step takes the naive
path. Each graph has its own wrappers, made with `use_cuda_graph=True` by the warm-up forward before capture (one
per plan key, each with FlashInfer's int workspace: 8 MB on the device, 8 MB pinned), and `prepare_replay`
re-plans them on the host from the step's lengths before every replay (`graphs_plan_on_host`: a step whose
lengths only the device knows cannot replay them): the graph recorded the int workspace that plan() rewrites.
Pages come straight from the block table (request i's at i * its row stride, flattened), so nothing is gathered;
padding rows belong to padding requests (`graph_pages` says why).

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
        self.plan(wrapper, key)
        self._wrappers[key] = wrapper
        self.workspace.planned_by[key] = self
        return wrapper

    def plan(self, wrapper: Any, key: tuple) -> None:
        """Plan `wrapper` for the plan key's (spec, dtypes) over this metadata's CSR description."""
        _, spec, q_dtype, kv_dtype = key
        wrapper.plan(
            qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr, kv_indices=self.kv_indices, kv_len_arr=self.kv_lens,
            num_heads=spec.num_heads, head_dim_ckv=spec.kv_lora_rank, head_dim_kpe=spec.qk_rope_head_dim,
            page_size=self.common.block_size, causal=True, sm_scale=spec.scale, q_data_type=q_dtype,
            kv_data_type=kv_dtype, use_profiler=False,
        )  # fmt: skip


@dataclass
class FlashInferMLAGraphMetadata(FlashInferMLAMetadata):
    """What a CUDA graph of B requests x q rows records: all B * q rows are decode rows, planned as S requests (S = B,
    or B + 1 for q > 1: `graph_pages`). qo_indptr [S + 1], kv_indptr [S + 1] and kv_lens [S] are host tensors
    refilled in place for each replay; kv_indices is the graph's block table, flattened (a view).

    Its wrappers are its own, one per plan key, made and planned by the warm-up forward before capture."""

    planned: torch.cuda.Event | None = None  # CUDA: fires once the last plan's host -> device copies are done

    def wrapper(self, spec: MLASpec, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Any:
        key = (self.wrapper_backend, spec, q_dtype, kv_dtype)
        if key not in self._wrappers:
            # a plan copies from the host: never inside the capture (cuda_graph_capture warms up first)
            capturing = self.kv_indices.is_cuda and torch.cuda.is_current_stream_capturing()
            assert not capturing, "the graph's first forward must run before capture"
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            slots, device = len(self.kv_lens), self.kv_indices.device
            self._wrappers[key] = BatchMLAPagedAttentionWrapper(
                float_workspace_buffer=self.workspace.buffer, use_cuda_graph=True,
                # plan() copies its inputs into these; the kernels read the plan (the wrapper's int workspace)
                qo_indptr=torch.empty(slots + 1, dtype=torch.int32, device=device),
                kv_indptr=torch.empty(slots + 1, dtype=torch.int32, device=device),
                kv_indices=self.kv_indices,  # plan()'s copy of it onto itself is a no-op
                kv_len_arr=torch.empty(slots, dtype=torch.int32, device=device), backend=self.wrapper_backend,
            )  # fmt: skip
            self.plan(self._wrappers[key], key)
        return self._wrappers[key]

    def plan(self, wrapper: Any, key: tuple) -> None:
        super().plan(wrapper, key)
        if self.planned is not None:
            self.planned.record()

    def set_step(self, common: CommonAttentionMetadata) -> None:
        """Lay the step (n <= B requests, host mirrors) out over the graph's rows and slots, in the host tensors."""
        if self.planned is not None:
            # the last plan's copies must have left these tensors and the wrappers' pinned plan buffers, which
            # this step's plan rewrites (the runner already waited for the inputs copied just before them)
            self.planned.synchronize()
        pages = graph_pages(
            common.query_start_loc_cpu.numpy(), common.seq_lens_cpu.numpy(), num_rows=self.common.num_tokens,
            num_slots=len(self.kv_lens), row_stride=self.common.block_table.stride(0),
        )  # fmt: skip
        for dst, src in zip((self.qo_indptr, self.kv_indptr, self.kv_lens), pages, strict=True):
            dst.numpy()[:] = src


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


def graph_pages(
    query_start_loc: np.ndarray,  # [n + 1]: the step's requests' rows
    seq_lens: np.ndarray,  # [n]: each request's keys after this step
    *,
    num_rows: int,  # B * q: the graph's rows, the step's T first, then padding
    num_slots: int,  # S >= n: the requests FlashInfer plans
    row_stride: int,  # the block table's row stride
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # qo_indptr [S + 1], kv_indptr [S + 1], kv_lens [S], int32
    """FlashInfer's CSR description of a graph step: the step's n requests, then S - n padding requests sharing the
    padding rows T .. num_rows evenly, each attending causally to as many keys as it has rows.

    Pages: FlashInfer's MLA kernels read request i's page j at kv_indices[kv_indptr[i] + j] (kv_indptr[i + 1] is
    never read: include/flashinfer/attention/mla.cuh), so over the flattened block table request i starts at
    i * row_stride, and a padding request at 0 (valid block ids; what it reads is discarded with its rows).

    Why every row has a request: the plan picks the kernel's cluster size from the mean rows per request (`MLAPlan`,
    include/flashinfer/attention/scheduler.cuh), and the graph keeps the launch grid of the capture's plan; num_rows
    rows over S requests give every replay the capture's mean. So a q = 1 graph (S = B) gives each padding request
    one row and one key; a q > 1 graph has one slot more (S = B + 1), for the rows a step of n = B requests leaves."""
    n = len(seq_lens)
    num_pad, left = num_slots - n, num_rows - int(query_start_loc[-1])
    assert num_pad > 0 or left == 0, (n, num_slots, left)
    pad_rows = left // max(num_pad, 1) + (np.arange(num_pad) < left % max(num_pad, 1))
    qo_indptr = np.concatenate([query_start_loc, query_start_loc[-1] + np.cumsum(pad_rows)])
    kv_indptr = np.zeros(num_slots + 1, dtype=np.int64)
    kv_indptr[:n] = np.arange(n) * row_stride
    kv_lens = np.concatenate([seq_lens, pad_rows])
    return qo_indptr.astype(np.int32), kv_indptr.astype(np.int32), kv_lens.astype(np.int32)


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
        cuda_graphs=True,
        cuda_graphs_multi_token=True,  # every graph row is a causal decode row; the plan keeps the captured grid
        graphs_plan_on_host=True,  # FlashInfer plans from the step's lengths on the host
        eager_plans_on_host=True,
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
    def build_graph_metadata(cls, common: CommonAttentionMetadata) -> FlashInferMLAGraphMetadata:
        """Every row a decode row (decode_query_len = q), over pinned host plan inputs and the block table's view."""
        base = build_mla_metadata(common, decode_query_len=common.max_query_len)
        slots = common.num_reqs + (common.max_query_len > 1)
        kv_indices = common.block_table.view(-1)  # [B * row stride] int32: the step buffer itself, no copy
        assert common.num_tokens <= kv_indices.numel() * common.block_size, "padding requests' pages must fit"
        cuda = kv_indices.device.type == "cuda"
        host = lambda size: torch.zeros(size, dtype=torch.int32, pin_memory=cuda)
        metadata = FlashInferMLAGraphMetadata(
            **vars(base), workspace=cls.workspace(kv_indices.device), qo_indptr=host(slots + 1),
            kv_indptr=host(slots + 1), kv_indices=kv_indices, kv_lens=host(slots),
            planned=torch.cuda.Event() if cuda else None,
        )  # fmt: skip
        metadata.set_step(common)
        return metadata

    @classmethod
    def prepare_replay(cls, metadata: FlashInferMLAGraphMetadata, common: CommonAttentionMetadata) -> None:
        """Re-plan each of the graph's wrappers (host work, a copy into its int workspace) for this step."""
        metadata.set_step(common)
        for key, wrapper in metadata._wrappers.items():
            metadata.plan(wrapper, key)

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl:
        return FlashInferMLAImpl(spec)
