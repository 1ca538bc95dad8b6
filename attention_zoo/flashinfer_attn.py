"""The `flashinfer` backend: FlashInfer's paged prefill/decode wrappers over FlashInfer's own NHD cache layout.

Cache: `[num_blocks, 2, block_size, num_kv_heads, head_size]` (FlashInfer's single-tensor NHD layout;
`[:, 0]` is K, `[:, 1]` is V). The step's K/V go in with our Triton KV-write kernel, handed a view of
this layout in the `[2, num_blocks, ...]` order it expects (it reads strides).

Per step, `build_metadata` computes on the host what every plan needs: `qo_indptr` from
`query_start_loc_cpu`, and which of the batch's pages to read. Per distinct layer spec (heads, head
dim, window, scale) and dtype, the first layer that runs plans one wrapper; every later layer of
that spec reuses the plan. A pure-decode batch (every request has one query token) plans
`BatchDecodeWithPagedKVCacheWrapper`; any other batch plans `BatchPrefillWithPagedKVCacheWrapper`
for all its requests, which serves query length 1 as well, so decodes need not be contiguous.
Decode uses FlashInfer's tensor-core path, which runs the same FA2 kernel module as our prefill
wrapper: one JIT build per (dtype, head dim, windowed or not) serves both.

FlashInfer's defaults bite (STYLE.md lesson 8): prefill `causal=False`, LSE in base 2 (not used
here), `last_page_len >= 1`; every FlashInfer argument is passed by keyword. `window_left` is
inclusive: a token attends to `window_left + 1` positions, so `window_left = sliding_window - 1`.
Pages wholly before the first query's window are left out of the page list (the scheduler may
already have swapped them for the null block): with `pos_encoding_mode="NONE"` FlashInfer's masks
depend only on distances from the end of the list, so dropping whole leading pages is exact.

`flashinfer` is imported only when the first step is planned, so importing this module (the
registry does it to read the capabilities) works on machines without it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from attention_zoo.base import AttentionBackend, AttentionImpl, AttentionSpec, BackendCapabilities
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.registry import register_backend

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial outputs)
# FA2 serves prefill and tensor-core decode from one JIT module; "auto" would build FA3 on Hopper too.
PREFILL_BACKEND = "fa2"


@dataclass(frozen=True)
class FlashInferCapabilities(BackendCapabilities):
    """Capabilities plus the head sizes FlashInfer's FA2 kernels take and the optional package itself."""

    head_sizes: frozenset[int] = frozenset({64, 128, 256})

    def missing(self, spec: AttentionSpec, device: torch.device, dtype: torch.dtype) -> str | None:
        reason = super().missing(spec, device, dtype)
        if reason is None and spec.head_size not in self.head_sizes:
            reason = f"does not support head size {spec.head_size} (FlashInfer: {sorted(self.head_sizes)})"
        if reason is None and importlib.util.find_spec("flashinfer") is None:  # looks, does not import
            reason = "needs the flashinfer package (pip install 'research_lm[flashinfer]')"
        return reason


@dataclass(frozen=True)
class PagedKV:
    """The pages one plan reads, in FlashInfer's CSR form."""

    indptr: torch.Tensor  # [num_reqs + 1] int32, host: request i reads indices[indptr[i]:indptr[i + 1]]
    indices: torch.Tensor  # [indptr[-1]] int32, device: block ids
    last_page_len: torch.Tensor  # [num_reqs] int32, host: tokens in each request's last page, >= 1


def paged_kv(common: CommonAttentionMetadata, sliding_window: int | None) -> PagedKV:
    """Each request's pages holding its context, minus leading pages that no query's window reaches.

    Host arithmetic on `seq_lens_cpu` / `query_start_loc_cpu`; the block ids are gathered from the
    device block table with one host-to-device copy of (row, column) pairs, so nothing syncs.
    """
    bs = common.block_size
    seq_lens = common.seq_lens_cpu.numpy().astype(np.int64)
    query_lens = common.query_lens_cpu.numpy().astype(np.int64)
    end = (seq_lens + bs - 1) // bs
    if sliding_window is None:
        first = np.zeros_like(end)
    else:  # the earliest query (position seq_len - query_len) attends back to position - (window - 1)
        first = np.maximum(seq_lens - query_lens - (sliding_window - 1), 0) // bs
    counts = end - first
    indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    rows = np.repeat(np.arange(len(counts)), counts)
    cols = np.arange(indptr[-1]) - np.repeat(indptr[:-1] - first, counts)
    where = torch.from_numpy(np.stack([rows, cols])).to(common.block_table.device)
    return PagedKV(
        indptr=torch.from_numpy(indptr.astype(np.int32)),
        indices=common.block_table[where[0], where[1]],
        last_page_len=torch.from_numpy(((seq_lens - 1) % bs + 1).astype(np.int32)),
    )


class FlashInferWorkspace:
    """Per device: the float workspace (allocated once) and the wrappers, one per plan key, reused every step.

    Every wrapper shares the workspace: they run one after another on one stream. A wrapper holds
    one plan at a time; `planned_by` records which step's metadata that plan belongs to, so an
    older metadata that finds its wrapper re-planned by a newer step plans again instead of
    running someone else's plan.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # zeroed before first use
        self.wrappers: dict[tuple, Any] = {}
        self.planned_by: dict[tuple, object] = {}

    def wrapper(self, key: tuple, decode: bool) -> Any:
        if key not in self.wrappers:
            import flashinfer

            if decode:
                self.wrappers[key] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    float_workspace_buffer=self.buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=True
                )
            else:
                self.wrappers[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    float_workspace_buffer=self.buffer, kv_layout="NHD", use_cuda_graph=False, backend=PREFILL_BACKEND
                )
        return self.wrappers[key]


@dataclass
class FlashInferMetadata:
    common: CommonAttentionMetadata
    workspace: FlashInferWorkspace
    decode: bool  # every request has exactly one query token: the decode wrapper serves the batch
    num_real_tokens: int
    qo_indptr: torch.Tensor  # [num_reqs + 1] int32, host (a copy: the runner reuses its pinned buffer)
    _pages: dict[int | None, PagedKV] = field(default_factory=dict)  # sliding window -> pages read
    _wrappers: dict[tuple, Any] = field(default_factory=dict)  # plan key -> wrapper planned for this step

    def pages(self, sliding_window: int | None) -> PagedKV:
        if sliding_window not in self._pages:
            self._pages[sliding_window] = paged_kv(self.common, sliding_window)
        return self._pages[sliding_window]

    def wrapper(self, spec: AttentionSpec, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Any:
        """The wrapper planned for this layer's spec: planned by the first layer of that spec this step."""
        key = (self.decode, spec, q_dtype, kv_dtype)
        if key in self._wrappers and self.workspace.planned_by.get(key) is self:
            return self._wrappers[key]
        wrapper = self.workspace.wrapper(key, self.decode)
        pages = self.pages(spec.sliding_window)
        window_left = -1 if spec.sliding_window is None else spec.sliding_window - 1
        if self.decode:
            wrapper.plan(
                indptr=pages.indptr, indices=pages.indices, last_page_len=pages.last_page_len,
                num_qo_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                page_size=self.common.block_size, pos_encoding_mode="NONE", window_left=window_left,
                logits_soft_cap=0.0, sm_scale=spec.scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
            )  # fmt: skip
        else:
            wrapper.plan(
                qo_indptr=self.qo_indptr, paged_kv_indptr=pages.indptr, paged_kv_indices=pages.indices,
                paged_kv_last_page_len=pages.last_page_len, num_qo_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads, head_dim_qk=spec.head_size, page_size=self.common.block_size,
                causal=True, pos_encoding_mode="NONE", window_left=window_left, logits_soft_cap=0.0,
                sm_scale=spec.scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
            )  # fmt: skip
        self._wrappers[key] = wrapper
        self.workspace.planned_by[key] = self
        return wrapper


class FlashInferImpl(AttentionImpl):
    def forward(self, q, k, v, kv_cache, metadata: FlashInferMetadata):
        from attention_zoo.triton_kernels import reshape_and_cache

        reshape_and_cache(k, v, kv_cache.transpose(0, 1), metadata.common.slot_mapping)
        n = metadata.num_real_tokens
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if n < q.shape[0]:
            out[n:].zero_()  # padding rows, as torch_ref leaves them
        wrapper = metadata.wrapper(self.spec, q.dtype, kv_cache.dtype)
        wrapper.run(q=q[:n], paged_kv_cache=kv_cache, out=out[:n])
        return out


@register_backend("flashinfer")
class FlashInferBackend(AttentionBackend):
    capabilities = FlashInferCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kinds=frozenset({"attention"}),
        sliding_window=True,
        cuda_graphs=False,  # plan() runs on the host every step; the graph-safe wrappers are not wired up
    )
    # device -> its workspace and wrappers: allocated on the first step on that device, reused by every
    # later step (FlashInfer wants its workspace and plan buffers long-lived, not per step).
    _workspaces: ClassVar[dict[torch.device, FlashInferWorkspace]] = {}

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, spec: AttentionSpec) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, spec.num_kv_heads, spec.head_size)

    @classmethod
    def workspace(cls, device: torch.device) -> FlashInferWorkspace:
        if device not in cls._workspaces:
            cls._workspaces[device] = FlashInferWorkspace(device)
        return cls._workspaces[device]

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> FlashInferMetadata:
        query_lens = common.query_lens_cpu
        num_real_tokens = int(common.query_start_loc_cpu[-1])
        return FlashInferMetadata(
            common,
            workspace=cls.workspace(common.query_start_loc.device),
            decode=bool(common.num_reqs > 0 and (query_lens == 1).all()),
            num_real_tokens=num_real_tokens,
            qo_indptr=common.query_start_loc_cpu.clone(),
        )

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl:
        return FlashInferImpl(spec)
