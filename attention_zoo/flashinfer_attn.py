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

CUDA graphs: every graph the runner captures (decode, B x 1; spec verify, B x (k + 1); batch-1 prefill, 1 x Q)
gets its own cuda-graph wrappers (`use_cuda_graph=True`: the decode wrapper for q = 1, the prefill wrapper for
q > 1), one per plan key as above, made and planned by the first layer of a spec in the capture's warm-up run,
with fixed index buffers sized for B requests and B * max_blocks_per_req pages. `plan()` cannot run inside a
graph: `prepare_replay` re-plans each of them on the host before every replay, for the step padded to B
requests: padding requests own no query rows and no pages (`page_lists`). Under a graph the wrappers run over
all B * q rows; a decode plan gives each padding request its row (it reads no pages: 0), a prefill plan covers
only the step's T tokens, so its output starts at 0. The plan lengths come from the host: such graphs cannot
serve steps whose lengths only the device knows (`graphs_plan_on_host`).

Workspaces under graphs (`FlashInferWorkspace`): a plan writes its schedule (which CTA does which tiles) into
the wrapper's int workspace, and a graph records that buffer's address. One int workspace per plan key is
shared by every graph: graphs run one at a time on one stream, and each replay re-plans all its wrappers
first, so the schedule in the buffer is always the replaying graph's own. Graphs of one key differ in their
split-KV scratch needs (FlashInfer sizes it for the worst case of the captured shape); they share the float
workspace while it is large enough, and a graph that needs more gets a larger one that later graphs share.

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
INT_WORKSPACE_BYTES = 8 << 20  # what FlashInfer 0.6.13 gives each wrapper for its plan (the schedule arrays)
# FA2 serves prefill and tensor-core decode from one JIT module; "auto" would build FA3 on Hopper too.
PREFILL_BACKEND = "fa2"

PlanKey = tuple[bool, AttentionSpec, torch.dtype, torch.dtype]  # (decode wrapper, spec, q dtype, kv dtype)


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
class PageLists:
    """The pages each request reads, on the host: FlashInfer's CSR page list, each page as its block-table cell."""

    indptr: np.ndarray  # [num_reqs + 1] int64: request i reads pages indptr[i] : indptr[i + 1]
    rows: np.ndarray  # [indptr[-1]] int64: block-table row of each page
    cols: np.ndarray  # [indptr[-1]] int64: block-table column of each page
    last_page_len: np.ndarray  # [num_reqs] int64: tokens in each request's last page, >= 1


def pad_requests(indptr: np.ndarray, num_reqs: int) -> np.ndarray:
    """A CSR indptr [n + 1] extended to num_reqs >= n requests, the added ones owning nothing: [num_reqs + 1]."""
    return np.concatenate([indptr, np.full(num_reqs + 1 - len(indptr), indptr[-1], dtype=indptr.dtype)])


def page_lists(
    query_start_loc: np.ndarray,  # [n + 1]
    seq_lens: np.ndarray,  # [n]
    block_size: int,
    sliding_window: int | None,
    num_reqs: int | None = None,
) -> PageLists:
    """Each request's pages holding its context, minus leading pages that no query's window reaches.

    num_reqs (a graph's B >= n): requests n .. B are padding and own no pages: the indptr repeats its last
    value and their last_page_len is 1 (vLLM's padding). FlashInfer's host plan clamps an empty list's length
    to last_page_len, and its kernels read an empty list as 0 tokens: nothing is read for them."""
    bs = block_size
    seq_lens = seq_lens.astype(np.int64)
    query_lens = np.diff(query_start_loc.astype(np.int64))
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
    last_page_len = (seq_lens - 1) % bs + 1
    if num_reqs is not None:
        indptr = pad_requests(indptr, num_reqs)
        last_page_len = np.concatenate([last_page_len, np.ones(num_reqs - len(seq_lens), dtype=np.int64)])
    return PageLists(indptr, rows, cols, last_page_len)


@dataclass(frozen=True)
class PagedKV:
    """The pages one plan reads, in FlashInfer's CSR form."""

    indptr: torch.Tensor  # [num_reqs + 1] int32, host: request i reads indices[indptr[i]:indptr[i + 1]]
    indices: torch.Tensor  # [indptr[-1]] int32, device: block ids
    last_page_len: torch.Tensor  # [num_reqs] int32, host: tokens in each request's last page, >= 1


def host_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A fresh host copy of array, pinned when `device` is a GPU: a copy from it to the device (ours, or FlashInfer's
    plan's) runs asynchronously, and torch keeps the pinned block until that copy has run."""
    tensor = torch.from_numpy(np.array(array))
    return tensor.pin_memory() if device.type == "cuda" else tensor


def paged_kv(common: CommonAttentionMetadata, sliding_window: int | None, num_reqs: int | None = None) -> PagedKV:
    """`page_lists` of the record, the block ids gathered from the device block table by (row, column) pairs.

    Eager (num_reqs None): from pageable arrays, the pairs by a blocking copy. It waits for the stream, and so for
    the last step's plan to have copied its schedule out of the wrapper's pinned staging buffer, which this step's
    plan rewrites. A graph's plan (num_reqs: its B, the step padded to it): every copy is asynchronous, from fresh
    pinned memory, and `PlanBuffers.staged` guards the staging buffer, so a replay does not wait for the stream."""
    lists = page_lists(common.query_start_loc_cpu.numpy(), common.seq_lens_cpu.numpy(), common.block_size,
                       sliding_window, num_reqs)  # fmt: skip
    device, graph = common.block_table.device, num_reqs is not None
    host = (lambda array: host_tensor(array, device)) if graph else torch.from_numpy
    where = host(np.stack([lists.rows, lists.cols])).to(device, non_blocking=graph)
    return PagedKV(
        indptr=host(lists.indptr.astype(np.int32)),
        indices=common.block_table[where[0], where[1]],
        last_page_len=host(lists.last_page_len.astype(np.int32)),
    )


def plan(wrapper: Any, key: PlanKey, block_size: int, qo_indptr: torch.Tensor, pages: PagedKV) -> None:
    """Plan `wrapper` (the decode or prefill wrapper, as key[0] says) for a layer of spec key[1]; qo_indptr
    [num_reqs + 1] int32 on the host (the decode plan takes one query row per request instead)."""
    decode, spec, q_dtype, kv_dtype = key
    window_left = -1 if spec.sliding_window is None else spec.sliding_window - 1
    if decode:
        wrapper.plan(
            indptr=pages.indptr, indices=pages.indices, last_page_len=pages.last_page_len,
            num_qo_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
            page_size=block_size, pos_encoding_mode="NONE", window_left=window_left,
            logits_soft_cap=0.0, sm_scale=spec.scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
        )  # fmt: skip
    else:
        wrapper.plan(
            qo_indptr=qo_indptr, paged_kv_indptr=pages.indptr, paged_kv_indices=pages.indices,
            paged_kv_last_page_len=pages.last_page_len, num_qo_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads, head_dim_qk=spec.head_size, page_size=block_size,
            causal=True, pos_encoding_mode="NONE", window_left=window_left, logits_soft_cap=0.0,
            sm_scale=spec.scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
        )  # fmt: skip


def graph_float_workspace_bytes(spec: AttentionSpec, num_reqs: int, num_rows: int, num_sms: int,
                                compute_major: int) -> int:  # fmt: skip
    """Bytes of float workspace a cuda-graph plan of num_reqs requests and num_rows query rows reserves: the
    split-KV partial outputs and their LSEs, which FlashInfer 0.6.13 always uses under graphs (PrefillPlan and
    PrefillSplitQOKVIndptr with enable_cuda_graph, the decode wrapper's tensor-core path included). The tile
    height and the CTA count are fixed for the worst case the shape allows, one request holding all rows but
    one per other request, so they depend on the shape alone."""
    group = spec.num_heads // spec.num_kv_heads
    max_packed_qo_len = (num_rows - num_reqs + 1) * group
    if max_packed_qo_len > 64 and spec.head_size < 256:  # FA2DetermineCtaTileQ
        tile_q = 128
    elif compute_major >= 8:
        tile_q = 64 if max_packed_qo_len > 16 else 16
    else:
        tile_q = 64
    tiles = -(-num_rows * group // tile_q) + num_reqs - 1
    ctas = max(2 * num_sms // spec.num_kv_heads, tiles)  # padded_batch_size: 2 CTAs per SM, or every tile
    partial_out = spec.num_heads * ctas * tile_q * spec.head_size * 4
    partial_lse = spec.num_heads * ctas * tile_q * 4
    return -(-partial_out // 16) * 16 + -(-partial_lse // 16) * 16


@dataclass
class PlanBuffers:
    """The int workspace FlashInfer's plan fills (on the device) and stages (in pinned host memory), shared by
    every graph's wrapper of one plan key. A plan copies the staging buffer to the device asynchronously, so the
    next plan into it waits for `staged` (recorded after each plan) before it writes there."""

    device: torch.Tensor  # [INT_WORKSPACE_BYTES] uint8
    host: torch.Tensor  # [INT_WORKSPACE_BYTES] uint8, pinned
    staged: torch.cuda.Event


class FlashInferWorkspace:
    """Per device: the float workspace (allocated once) and the wrappers, one per plan key, reused every step.

    Eager wrappers share the workspace: they run one after another on one stream. A wrapper holds
    one plan at a time; `planned_by` records which step's metadata that plan belongs to, so an
    older metadata that finds its wrapper re-planned by a newer step plans again instead of
    running someone else's plan.

    Graph wrappers belong to their graph's metadata (`FlashInferGraphMetadata`); what they share lives here:
    one `PlanBuffers` per plan key (FlashInfer would give each wrapper 8 MiB of device and 8 MiB of pinned
    memory, for some hundred wrappers), and the float workspace of the graphs captured so far (`graph_buffer`).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # zeroed before first use
        self.wrappers: dict[PlanKey, Any] = {}
        self.planned_by: dict[PlanKey, object] = {}
        self.graph_buffer = self.buffer  # replaced by a larger one when a graph needs more
        self.plan_buffers: dict[PlanKey, PlanBuffers] = {}

    def wrapper(self, key: PlanKey, decode: bool) -> Any:
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

    def graph_wrapper(self, key: PlanKey, num_reqs: int, num_rows: int, max_pages: int) -> tuple[Any, PlanBuffers]:
        """A new cuda-graph wrapper of `key` for a graph of num_reqs requests and num_rows query rows, with fixed
        index buffers for up to max_pages pages, and the plan buffers it shares."""
        with torch.inference_mode(False):  # normal tensors: a replay outside inference mode may re-plan them too
            return self._graph_wrapper(key, num_reqs, num_rows, max_pages)

    def _graph_wrapper(self, key: PlanKey, num_reqs: int, num_rows: int, max_pages: int) -> tuple[Any, PlanBuffers]:
        import flashinfer

        decode, spec = key[0], key[1]
        props = torch.cuda.get_device_properties(self.device)
        need = graph_float_workspace_bytes(spec, num_reqs, num_rows, props.multi_processor_count, props.major)
        if self.graph_buffer.numel() < need:  # earlier graphs keep the buffer they recorded
            self.graph_buffer = torch.zeros(need, dtype=torch.uint8, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        kv_indptr, indices = torch.zeros(num_reqs + 1, **i32), torch.zeros(max_pages, **i32)
        last = torch.ones(num_reqs, **i32)
        if decode:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                float_workspace_buffer=self.graph_buffer, kv_layout="NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=kv_indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last,
            )  # fmt: skip
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer=self.graph_buffer, kv_layout="NHD", use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(num_reqs + 1, **i32), paged_kv_indptr_buf=kv_indptr,
                paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last, backend=PREFILL_BACKEND,
            )  # fmt: skip
        if key not in self.plan_buffers:
            self.plan_buffers[key] = PlanBuffers(
                device=torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device),
                host=torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True),
                staged=torch.cuda.Event(),
            )
        shared = self.plan_buffers[key]
        # FlashInfer 0.6.13's names for the wrapper's own pair (its reset_workspace_buffer would pin a new host copy)
        wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer = shared.device, shared.host
        return wrapper, shared


@dataclass
class FlashInferMetadata:
    common: CommonAttentionMetadata
    workspace: FlashInferWorkspace
    decode: bool  # every request has exactly one query token: the decode wrapper serves the batch
    num_real_tokens: int
    qo_indptr: torch.Tensor  # [num_reqs + 1] int32, host (a copy: the runner reuses its pinned buffer)
    _pages: dict[int | None, PagedKV] = field(default_factory=dict)  # sliding window -> pages read
    _wrappers: dict[PlanKey, Any] = field(default_factory=dict)  # plan key -> wrapper planned for this step

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
        plan(wrapper, key, self.common.block_size, self.qo_indptr, self.pages(spec.sliding_window))
        self._wrappers[key] = wrapper
        self.workspace.planned_by[key] = self
        return wrapper

    def attend(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        n = self.num_real_tokens
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if n < q.shape[0]:
            out[n:].zero_()  # padding rows, as torch_ref leaves them
        self.wrapper(spec, q.dtype, kv_cache.dtype).run(q=q[:n], paged_kv_cache=kv_cache, out=out[:n])
        return out


@dataclass
class FlashInferGraphMetadata:
    """What one CUDA graph of B requests x q tokens records: per plan key a cuda-graph wrapper with fixed buffers
    (the decode wrapper for q = 1, the prefill wrapper for q > 1), planned for `step`: the capture's record in
    its warm-up run, then each replayed step's (`replan`), padded to B requests."""

    common: CommonAttentionMetadata  # the graph's record: B requests, B * q token rows at fixed addresses
    workspace: FlashInferWorkspace
    step: CommonAttentionMetadata  # the record the wrappers are planned for: n <= B requests, T <= B * q tokens
    _pages: dict[int | None, PagedKV] = field(default_factory=dict)  # sliding window -> the step's pages
    _wrappers: dict[PlanKey, tuple[Any, PlanBuffers]] = field(default_factory=dict)

    @property
    def decode(self) -> bool:
        return self.common.max_query_len == 1

    def pages(self, sliding_window: int | None) -> PagedKV:
        if sliding_window not in self._pages:
            self._pages[sliding_window] = paged_kv(self.step, sliding_window, self.common.num_reqs)
        return self._pages[sliding_window]

    def _plan(self, key: PlanKey) -> None:
        wrapper, shared = self._wrappers[key]
        qo_indptr = host_tensor(pad_requests(self.step.query_start_loc_cpu.numpy(), self.common.num_reqs),
                                self.common.block_table.device)  # fmt: skip
        shared.staged.synchronize()  # the last plan's staging copy (another graph's, maybe) has left the buffer
        plan(wrapper, key, self.common.block_size, qo_indptr, self.pages(key[1].sliding_window))
        shared.staged.record()

    def replan(self, step: CommonAttentionMetadata) -> None:
        """Plan every wrapper for this step: on the host, outside the graph, before its replay."""
        assert step.num_reqs <= self.common.num_reqs and step.num_tokens <= self.common.num_tokens
        assert step.max_query_len == 1 or not self.decode
        self.step, self._pages = step, {}
        for key in self._wrappers:
            self._plan(key)

    def wrapper(self, spec: AttentionSpec, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Any:
        """This graph's wrapper for the layer's spec: made and planned by the first layer of the spec in the
        capture's warm-up run (the recording finds it planned)."""
        key = (self.decode, spec, q_dtype, kv_dtype)
        if key not in self._wrappers:
            assert not torch.cuda.is_current_stream_capturing(), "a plan cannot be recorded: warm up first"
            num_rows = self.common.num_tokens
            max_pages = self.common.num_reqs * self.common.block_table.shape[1]
            self._wrappers[key] = self.workspace.graph_wrapper(key, self.common.num_reqs, num_rows, max_pages)
            self._plan(key)
        return self._wrappers[key][0]

    def attend(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,  # [B * q, num_heads, head_size]: every row, the step's T first
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_size]
    ) -> torch.Tensor:  # [B * q, num_heads, head_size]
        # Fixed shapes: the wrapper runs over every row. A decode plan gives each padding request its row (it reads
        # no pages: 0); a prefill plan covers the step's T rows alone and never writes the others: they start at 0.
        out = (torch.empty if self.decode else torch.zeros)(q.shape, dtype=q.dtype, device=q.device)
        self.wrapper(spec, q.dtype, kv_cache.dtype).run(q=q, paged_kv_cache=kv_cache, out=out)
        return out


class FlashInferImpl(AttentionImpl):
    def forward(self, q, k, v, kv_cache, metadata: FlashInferMetadata | FlashInferGraphMetadata):
        from attention_zoo.triton_kernels import reshape_and_cache

        reshape_and_cache(k, v, kv_cache.transpose(0, 1), metadata.common.slot_mapping)
        return metadata.attend(self.spec, q, kv_cache)


@register_backend("flashinfer")
class FlashInferBackend(AttentionBackend):
    capabilities = FlashInferCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kinds=frozenset({"attention"}),
        sliding_window=True,
        cuda_graphs=True,
        cuda_graphs_multi_token=True,  # the prefill wrapper serves any query lengths <= q under a graph
        graphs_plan_on_host=True,  # prepare_replay plans from the step's host lengths
        eager_plans_on_host=True,
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
    def build_graph_metadata(cls, common: CommonAttentionMetadata) -> FlashInferGraphMetadata:
        return FlashInferGraphMetadata(common, workspace=cls.workspace(common.query_start_loc.device), step=common)

    @classmethod
    def prepare_replay(cls, metadata: FlashInferGraphMetadata, common: CommonAttentionMetadata) -> None:
        metadata.replan(common)

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl:
        return FlashInferImpl(spec)
