"""The `flashinfer` backend matches `torch_ref` on the same logical cache, eagerly and replayed from CUDA graphs,
and the engine on it matches `triton`, and with graphs its own eager run.

The GPU tests (`@pytest.mark.gpu`) skip without CUDA or without `flashinfer`. They run bf16 only, and
put sliding windows at head size 64 only, so FlashInfer JIT-builds three kernel modules (dtype x head
size x windowed): head 128, head 64, head 64 windowed (a cuda-graph wrapper runs the same modules). The CPU
tests check what needs no GPU: the capability refusal (which must not import flashinfer), the page lists
handed to FlashInfer's plans, a graph's padded plan and its float workspace size.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch

from attention_zoo import registry
from attention_zoo.base import AttentionSpec
from attention_zoo.flashinfer_attn import (
    FlashInferBackend,
    FlashInferGraphMetadata,
    PlanBuffers,
    graph_float_workspace_bytes,
    pad_requests,
    page_lists,
    paged_kv,
)
from attention_zoo.metadata import CommonAttentionMetadata
from tests.attention_zoo.paged_cases import PagedCase, make_case, run_backend
from tests.utils import assert_greedy_agrees_up_to_near_ties

gpu = pytest.mark.gpu
BS = 16
TOL = 2e-2  # bf16
D128 = dict(num_heads=8, num_kv_heads=2, head_size=128, block_size=BS, dtype=torch.bfloat16, device="cuda")
D64 = D128 | dict(head_size=64)
REAL = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16, device="cuda")


@pytest.fixture
def flashinfer():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return pytest.importorskip("flashinfer")


def to_flashinfer_layout(cache: torch.Tensor) -> torch.Tensor:
    """torch_ref's [2, blocks, page, kv_heads, d] -> FlashInfer's NHD [blocks, 2, page, kv_heads, d]."""
    return cache.transpose(0, 1).contiguous()


def run_flashinfer(case: PagedCase, kv_cache: torch.Tensor | None = None):
    """(output, cache after the step in torch_ref's layout, metadata) on a copy of the case's cache."""
    cache = to_flashinfer_layout(case.kv_cache if kv_cache is None else kv_cache)
    metadata = FlashInferBackend.build_metadata(case.common)
    out = FlashInferBackend.make_impl(case.spec).forward(case.q, case.k, case.v, cache, metadata)
    return out, cache.transpose(0, 1), metadata


def assert_matches_ref(case: PagedCase):
    ref_out, ref_cache = run_backend("torch_ref", case)
    out, cache, metadata = run_flashinfer(case)
    n = case.num_real_tokens
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out[:n].float(), ref_out[:n].float(), atol=TOL, rtol=TOL)
    assert (out[n:] == 0).all()  # padding rows, as torch_ref leaves them
    return metadata


# ---------------------------------------------------------------- CPU: no flashinfer needed


def test_select_on_cpu_fails_naming_working_backends_without_importing_flashinfer():
    had_flashinfer = "flashinfer" in sys.modules
    spec = AttentionSpec(8, 2, 128, 128**-0.5)
    with pytest.raises(ValueError, match=r"'flashinfer' does not run on cpu.*would work: \[.*'torch_ref'"):
        registry.select_backend("flashinfer", spec, torch.device("cpu"), torch.bfloat16)
    assert had_flashinfer or "flashinfer" not in sys.modules


def test_capabilities_refuse_unsupported_head_size_and_dtype():
    caps = FlashInferBackend.capabilities
    cuda = torch.device("cuda")  # a device name; needs no GPU
    assert "head size 16" in caps.missing(AttentionSpec(4, 2, 16, 0.25), cuda, torch.bfloat16)
    assert "dtype" in caps.missing(AttentionSpec(4, 2, 64, 0.125), cuda, torch.float32)
    assert caps.cuda_graphs and caps.cuda_graphs_multi_token and caps.graphs_plan_on_host and caps.sliding_window
    assert FlashInferBackend.kv_cache_shape(10, BS, AttentionSpec(8, 2, 128, 1.0)) == (10, 2, BS, 2, 128)


def test_page_lists_cover_each_context_and_drop_pages_before_the_window():
    case = make_case([1, 7, 3], [BS + 1, 3 * BS, 2 * BS + 2], num_heads=4, num_kv_heads=2, head_size=64,
                     block_size=BS, dtype=torch.float32)  # fmt: skip
    bt = case.common.block_table
    full = paged_kv(case.common, None)
    assert full.indptr.tolist() == [0, 2, 5, 8]
    assert full.last_page_len.tolist() == [1, BS, 2]
    assert full.indices.tolist() == bt[0, :2].tolist() + bt[1, :3].tolist() + bt[2, :3].tolist()
    # window 5: request 0's query (position 16) reaches back to 12: page 0 stays; request 1's first
    # query (41) reaches 37: pages 0-1 go; request 2's first query (31) reaches 27: page 0 goes
    win = paged_kv(case.common, 5)
    assert win.indptr.tolist() == [0, 2, 3, 5]
    assert win.indices.tolist() == bt[0, :2].tolist() + bt[1, 2:3].tolist() + bt[2, 1:3].tolist()
    assert win.last_page_len.tolist() == [1, BS, 2]
    assert full.indptr.dtype == full.indices.dtype == full.last_page_len.dtype == torch.int32


def test_a_graphs_page_lists_pad_requests_with_no_pages_and_last_page_len_one():
    """3 requests padded to a graph of 4: the padding request owns no query rows and no pages."""
    qsl, seq_lens = np.array([0, 4, 6, 7], dtype=np.int32), np.array([10, 5, 13], dtype=np.int32)
    full = page_lists(qsl, seq_lens, 4, None, num_reqs=4)
    assert full.indptr.tolist() == [0, 3, 5, 9, 9]  # 3, 2, 4 pages of 4 tokens, then none
    assert full.rows.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert full.cols.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert full.last_page_len.tolist() == [2, 1, 1, 1]
    # window 3: request 0's first query (position 6) reaches back to 4: page 1 on; request 1's (3) to 1: page 0
    # on; request 2's (12) to 10: page 2 on
    win = page_lists(qsl, seq_lens, 4, 3, num_reqs=4)
    assert win.indptr.tolist() == [0, 2, 4, 6, 6]
    assert win.cols.tolist() == [1, 2, 0, 1, 2, 3]
    assert pad_requests(qsl, 4).tolist() == [0, 4, 6, 7, 7] and pad_requests(qsl, 3).tolist() == qsl.tolist()
    assert page_lists(qsl, seq_lens, 4, None).indptr.tolist() == [0, 3, 5, 9]  # eager: no padding


class _FakeWrapper:
    def __init__(self):
        self.plans: list[dict] = []

    def plan(self, **kwargs):  # a positional argument would raise TypeError here
        self.plans.append(kwargs)


class _NoEvent:  # stands in for the CUDA event that guards the shared pinned staging buffer
    def synchronize(self):
        pass

    def record(self):
        pass


def _record(query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor, block_size: int):
    """A record on the host (a graph's: B requests of q tokens, as at capture)."""
    n, qsl = len(query_lens), torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
        num_computed_tokens_cpu=seq - torch.tensor(query_lens, dtype=torch.int32), block_table=block_table[:n],
        slot_mapping=torch.full((int(qsl[-1]),), -1), request_rows=torch.arange(n), num_reqs=n,
        num_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size,
    )  # fmt: skip


@pytest.mark.parametrize("decode", [True, False])
def test_replan_hands_each_wrapper_the_step_padded_to_the_graphs_batch(decode):
    """What `prepare_replay` plans, on the host: the step's 3 requests padded to the graph's 4 (decode: 4 x 1,
    verify: 4 x 4), page ids gathered from the step's block table rows, every argument by keyword."""
    bs = 4
    block_table = torch.arange(1, 4 * 8 + 1, dtype=torch.int32).reshape(4, 8)  # request i: blocks 8i+1 ..
    query_lens, seq_lens = ([1, 1, 1], [1, 4, 9]) if decode else ([4, 2, 1], [10, 5, 13])
    q = 1 if decode else 4
    graph = _record([q] * 4, [q] * 4, block_table, bs)
    metadata = FlashInferGraphMetadata(graph, workspace=None, step=graph)
    spec = AttentionSpec(8, 2, 64, 0.125)
    key = (decode, spec, torch.bfloat16, torch.bfloat16)
    wrapper = _FakeWrapper()
    metadata._wrappers[key] = (wrapper, PlanBuffers(device=None, host=None, staged=_NoEvent()))
    step = _record(query_lens, seq_lens, block_table, bs)
    FlashInferBackend.prepare_replay(metadata, step)
    (kw,) = wrapper.plans
    if decode:
        assert kw["indptr"].tolist() == [0, 1, 2, 5, 5]
        assert kw["indices"].tolist() == [1, 9, 17, 18, 19]
        assert kw["last_page_len"].tolist() == [1, 4, 1, 1]
    else:
        assert kw["qo_indptr"].tolist() == [0, 4, 6, 7, 7] and kw["causal"] is True
        assert kw["paged_kv_indptr"].tolist() == [0, 3, 5, 9, 9]
        assert kw["paged_kv_indices"].tolist() == [1, 2, 3, 9, 10, 17, 18, 19, 20]
        assert kw["paged_kv_last_page_len"].tolist() == [2, 1, 1, 1]
        # a fresh host array: FlashInfer copies it asynchronously, and the runner rewrites its pinned buffer
        assert not np.shares_memory(kw["qo_indptr"].numpy(), step.query_start_loc_cpu.numpy())
    assert kw["window_left"] == -1 and kw["sm_scale"] == spec.scale and kw["page_size"] == bs
    assert metadata.step is step


def test_graph_float_workspace_covers_flashinfers_worst_case_schedule():
    """FlashInfer 0.6.13 under graphs: split-KV always, the tile height and CTA count fixed by the shape."""
    llama8b = AttentionSpec(32, 8, 128, 128**-0.5)
    # verify graph B = 256, q = 4 on 132 SMs: one request may hold 769 rows x 4 heads (> 64): tiles of 128 rows;
    # ceil(4096 / 128) + 255 = 287 CTAs (> 2 * 132 / 8); 32 heads x 287 x 128 rows x (128 fp32 + an LSE)
    assert graph_float_workspace_bytes(llama8b, 256, 1024, 132, 9) == 32 * 287 * 128 * (128 * 4 + 4)
    # decode graph B = 4: 4 packed rows: tiles of 16; 2 * 132 / 2 = 132 CTAs (> 4)
    small = AttentionSpec(8, 2, 64, 0.125)
    assert graph_float_workspace_bytes(small, 4, 4, 132, 9) == 8 * 132 * 16 * (64 * 4 + 4)
    # prefill graph 1 x 16: 16 x 4 = 64 packed rows: tiles of 64 on Ampere and later
    assert graph_float_workspace_bytes(small, 1, 16, 132, 9) == 8 * 132 * 64 * (64 * 4 + 4)


# ---------------------------------------------------------------- GPU: kernels vs torch_ref


@gpu
def test_decode_only_batch_takes_the_decode_wrapper(flashinfer):
    case = make_case([1] * 6, [1, BS - 1, BS, BS + 1, 100, 300], **D128)
    assert assert_matches_ref(case).decode


@gpu
def test_prefill_only_batch(flashinfer):
    case = make_case([1, 15, 16, 17, 200], [1, 15, 16, 17, 200], **D128)
    assert not assert_matches_ref(case).decode


@gpu
def test_mixed_batch_with_scattered_decodes_chunked_prefill_and_padding(flashinfer):
    """Decodes between prefills (not contiguous), a chunk after cached context, a fresh prefill."""
    case = make_case([1, 7, 1, 19, 1], [30, 27, 5, 19, 300], pad_tokens=3, **D128)
    assert not assert_matches_ref(case).decode


@gpu
def test_chunked_prefill_after_context(flashinfer):
    case = make_case([5, 64, 100], [40, 264, 1000], **D128)
    assert_matches_ref(case)


@gpu
@pytest.mark.parametrize("phase", ["decode", "mixed"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_ratios(flashinfer, group, phase):
    query_lens = [1, 1, 1] if phase == "decode" else [1, 9, 2]
    case = make_case(query_lens, [12, 21, 34], **(D128 | dict(num_heads=2 * group, num_kv_heads=2)), seed=group)
    assert_matches_ref(case)


@gpu
@pytest.mark.parametrize("phase", ["decode", "mixed"])
def test_head_size_64(flashinfer, phase):
    query_lens = [1, 1, 1, 1] if phase == "decode" else [1, 23, 1, 6]
    case = make_case(query_lens, [40, 23, 17, 70], **D64)
    assert_matches_ref(case)


@gpu
@pytest.mark.parametrize("window", [1, BS - 1, BS, BS + 1, 100])
@pytest.mark.parametrize("phase", ["decode", "mixed"])
def test_sliding_window(flashinfer, window, phase):
    seq_lens = [BS + 1, 3 * BS + 2, 20, 2 * BS + 5, 300]
    query_lens = [1] * 5 if phase == "decode" else [1, 1, 20, 6, 40]
    case = make_case(query_lens, seq_lens, sliding_window=window, **D64)
    assert_matches_ref(case)


@gpu
def test_sliding_window_never_reads_pages_outside_the_window(flashinfer):
    """Pages wholly outside every query's window may be freed (null block, stale data): poison them."""
    window, seq_len = 5, 4 * BS + 3
    case = make_case([1, 2], [seq_len, seq_len], sliding_window=window, **D64)
    ref_out, _ = run_backend("torch_ref", case)
    first_needed_page = (seq_len - 2 - window + 1) // BS
    poisoned = case.kv_cache.clone()
    for r in range(2):
        poisoned[:, case.common.block_table[r, :first_needed_page].long()] = float("nan")
    case.common.block_table[1, :first_needed_page] = 0  # freed: points at the null block
    poisoned[:, 0] = float("nan")
    out, _, _ = run_flashinfer(case, kv_cache=poisoned)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=TOL, rtol=TOL)


@gpu
def test_real_shapes_decode(flashinfer):
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 4096, (48,), generator=gen).tolist() + [1, 15, 16, 17, 8191]
    case = make_case([1] * len(seq_lens), seq_lens, **REAL)
    assert assert_matches_ref(case).decode


@gpu
@pytest.mark.parametrize("shape", ["d128", "d64-window"])
def test_real_shapes_mixed(flashinfer, shape):
    query_lens = [1] * 20 + [512, 1000, 37]
    seq_lens = [300 + 97 * i for i in range(20)] + [512, 3000, 2085]
    kwargs = REAL if shape == "d128" else REAL | dict(head_size=64, sliding_window=1024)
    case = make_case(query_lens, seq_lens, pad_tokens=5, **kwargs)
    assert_matches_ref(case)


# ---------------------------------------------------------------- GPU: planning


@gpu
def test_one_plan_per_step_and_spec_every_argument_by_keyword(flashinfer, monkeypatch):
    """Two layers of one spec share a plan; a layer of another spec (here: scale) gets its own."""
    plans = []
    original = flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan

    def keyword_only_plan(self, **kwargs):  # a positional argument would raise TypeError here
        plans.append(kwargs)
        return original(self, **kwargs)

    monkeypatch.setattr(flashinfer.BatchPrefillWithPagedKVCacheWrapper, "plan", keyword_only_plan)
    case = make_case([1, 9, 2], [12, 21, 34], **D128)
    other = AttentionSpec(8, 2, 128, 0.5 * 128**-0.5)
    metadata = FlashInferBackend.build_metadata(case.common)
    cache = to_flashinfer_layout(case.kv_cache)
    outs = [FlashInferBackend.make_impl(spec).forward(case.q, case.k, case.v, cache, metadata)
            for spec in (case.spec, case.spec, other)]  # fmt: skip
    assert len(plans) == 2
    assert all(p["causal"] is True and p["window_left"] == -1 and p["pos_encoding_mode"] == "NONE" for p in plans)
    assert [p["sm_scale"] for p in plans] == [case.spec.scale, other.scale]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    assert not torch.equal(outs[0], outs[2])


@gpu
def test_workspace_and_wrappers_live_across_steps_and_a_stale_plan_is_redone(flashinfer):
    case_a = make_case([1, 9, 2], [12, 21, 34], **D128)
    case_b = make_case([3, 50], [70, 50], **D128, seed=1)
    ref_a, _ = run_backend("torch_ref", case_a)
    impl = FlashInferBackend.make_impl(case_a.spec)
    cache_a, cache_b = to_flashinfer_layout(case_a.kv_cache), to_flashinfer_layout(case_b.kv_cache)
    meta_a = FlashInferBackend.build_metadata(case_a.common)
    impl.forward(case_a.q, case_a.k, case_a.v, cache_a, meta_a)
    meta_b = FlashInferBackend.build_metadata(case_b.common)  # the next step: same spec, same wrapper
    impl.forward(case_b.q, case_b.k, case_b.v, cache_b, meta_b)
    assert meta_a.workspace is meta_b.workspace
    key = (False, case_a.spec, torch.bfloat16, torch.bfloat16)
    assert meta_a._wrappers[key] is meta_b._wrappers[key]
    out_a = impl.forward(case_a.q, case_a.k, case_a.v, cache_a, meta_a)  # wrapper holds b's plan: re-plan
    torch.testing.assert_close(out_a.float(), ref_a.float(), atol=TOL, rtol=TOL)


# ---------------------------------------------------------------- GPU: CUDA graphs of the backend


class _GraphedLayers:
    """Two attention layers (spec, and spec with window 5, each with its own cache) over fixed q/k/v, captured by
    `DecodeGraphs` as the runner captures the model: decode graphs of 1, 2, 4 requests, verify graphs of 4
    tokens per request, a prefill graph of 16 tokens. `run` replays a case's step through the graph that
    serves it, as the runner does, and returns every row of each layer's output (padding rows included)."""

    def __init__(self, spec: AttentionSpec, dtype: torch.dtype, num_blocks: int = 64, max_blocks: int = 8):
        from research_lm.worker.buffers import StepBuffers
        from research_lm.worker.cuda_graphs import DecodeGraphs

        cuda, rows = torch.device("cuda"), 16
        self.specs = [spec, dataclasses.replace(spec, sliding_window=5)]
        self.buf = StepBuffers(max_num_tokens=rows, max_num_reqs=4, max_blocks_per_req=max_blocks, device=cuda)
        shape = (rows, spec.num_heads, spec.head_size)
        self.q = torch.zeros(shape, dtype=dtype, device=cuda)
        self.k = torch.zeros(shape[0], spec.num_kv_heads, spec.head_size, dtype=dtype, device=cuda)
        self.v = torch.zeros_like(self.k)
        self.caches = [torch.zeros(num_blocks, 2, BS, spec.num_kv_heads, spec.head_size, dtype=dtype, device=cuda)
                       for _ in self.specs]  # fmt: skip
        impls = [FlashInferBackend.make_impl(s) for s in self.specs]
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (B, q) -> the recording's outputs

        def forward(input_ids, positions, metadata):
            t, md = len(input_ids), metadata["flashinfer"]
            outs = tuple(impl.forward(self.q[:t], self.k[:t], self.v[:t], cache, md)
                         for impl, cache in zip(impls, self.caches))  # fmt: skip
            self.outputs[md.common.num_reqs, md.common.max_query_len] = outs  # the recording comes last
            return outs

        self.graphs = DecodeGraphs(forward, self.buf, [FlashInferBackend], sizes=[1, 2, 4], query_lens=[1, 4],
                                   prefill_sizes=[16], block_size=BS, max_seq_len=max_blocks * BS)  # fmt: skip

    def run(self, case: PagedCase) -> tuple[tuple[int, int], list[torch.Tensor]]:
        """The graph's key and each layer's output rows [B * q] after replaying `case` (its cache copied in)."""
        c, buf = case.common, self.buf
        n, t, cols = c.num_reqs, case.num_real_tokens, c.block_table.shape[1]
        buf.query_start_loc.np[: n + 1] = c.query_start_loc_cpu.numpy()
        buf.seq_lens.np[:n] = c.seq_lens_cpu.numpy()
        buf.num_computed.np[:n] = c.num_computed_tokens_cpu.numpy()
        buf.request_rows.np[:n] = np.arange(n)
        buf.slot_mapping.np[:t] = c.slot_mapping[:t].cpu().numpy()
        buf.block_table.np[:n, :cols] = c.block_table.cpu().numpy()
        buf.copy_block_table(n, cols)
        nan = float("nan")  # padding token rows and unreferenced blocks: nothing may read them into a real row
        for static, x in ((self.q, case.q), (self.k, case.k), (self.v, case.v)):
            static.fill_(nan)
            static[:t] = x[:t]
        for cache in self.caches:
            cache.fill_(nan)
            cache[: case.kv_cache.shape[1]] = to_flashinfer_layout(case.kv_cache)
            cache[0] = nan  # the null block: padding requests own no pages, so not even this one
        step = CommonAttentionMetadata(
            query_start_loc=buf.query_start_loc.gpu[: n + 1], query_start_loc_cpu=buf.query_start_loc.cpu[: n + 1],
            seq_lens=buf.seq_lens.gpu[:n], seq_lens_cpu=buf.seq_lens.cpu[:n],
            num_computed_tokens_cpu=buf.num_computed.cpu[:n], block_table=buf.block_table.gpu[:n],
            slot_mapping=buf.slot_mapping.gpu[:t], request_rows=buf.request_rows.gpu[:n], num_reqs=n, num_tokens=t,
            max_query_len=c.max_query_len, max_seq_len=c.max_seq_len, block_size=BS,
        )  # fmt: skip
        key = self.graphs.padded_size(step)
        with torch.inference_mode():
            self.graphs.run(step)
        return key, [out.clone() for out in self.outputs[key]]

    def caches_in_ref_layout(self, case: PagedCase) -> list[torch.Tensor]:
        return [cache[: case.kv_cache.shape[1]].transpose(0, 1) for cache in self.caches]


@gpu
def test_graph_replays_match_torch_ref_across_decode_verify_and_prefill_graphs(flashinfer):
    """Steps replayed one after another through different graphs (their wrappers share plan buffers per key):
    each layer's real rows match torch_ref, padding rows (NaN inputs) come out 0, the cache gets exactly the
    step's K/V; replaying a step again gives the same bits."""
    layers = _GraphedLayers(AttentionSpec(8, 2, 64, 64**-0.5), torch.bfloat16)
    assert layers.graphs.sizes == {1: [1, 2, 4], 4: [1, 2, 4]} and layers.graphs.prefill == [16]
    steps = [  # (query lens, seq lens, the graph that replays them)
        ([1, 1, 1], [1, BS, 3 * BS + 5], (4, 1)),  # decode, padded 3 -> 4
        ([4, 2, 1], [37, 2, BS + 1], (4, 4)),  # verify: 7 of 16 rows, a fresh 2-token prompt, a decode
        ([1], [100], (1, 1)),
        ([13], [40], (1, 16)),  # one prompt chunk after 27 cached tokens
        ([3, 4], [20, 4], (2, 4)),
        ([1, 1], [50, 7], (2, 1)),
    ]
    first = None
    for i, (query_lens, seq_lens, want_key) in enumerate(steps):
        case = make_case(query_lens, seq_lens, **D64, seed=i)
        key, outs = layers.run(case)
        assert key == want_key
        t = case.num_real_tokens
        for spec, out, cache in zip(layers.specs, outs, layers.caches_in_ref_layout(case)):
            ref_out, ref_cache = run_backend("torch_ref", dataclasses.replace(case, spec=spec))
            torch.testing.assert_close(out[:t].float(), ref_out[:t].float(), atol=TOL, rtol=TOL)
            assert (out[t:] == 0).all()
            torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], atol=0, rtol=0)
        first = first or (case, outs)
    again = layers.run(first[0])[1]
    assert all(torch.equal(a, b) for a, b in zip(first[1], again))
    # one plan buffer per key (decode or prefill wrapper x spec), shared by every graph
    metadata = [md for entries in layers.graphs._metadata.values() for _, md in entries]
    wrappers = [w for md in metadata for w, _ in md._wrappers.values()]
    assert len(wrappers) == 2 * 7  # 7 graphs x 2 specs
    assert len({w._int_workspace_buffer.data_ptr() for w in wrappers}) == 4


# ---------------------------------------------------------------- GPU: the engine

# A tiny model needs head size >= 64 here (FlashInfer's FA2 kernels); the shared tiny models use 16.
ENGINE_MODELS = {"llama": dict(), "mistral": dict(sliding_window=8)}


@pytest.fixture(scope="module")
def head64_checkpoint(tmp_path_factory):
    import transformers

    from tests.conftest import TINY_SHAPE, _randomize

    def make(arch: str):
        config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[arch]
        config = config_class(**(TINY_SHAPE | dict(head_dim=64) | ENGINE_MODELS[arch]))
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model, seed=0)
        path = tmp_path_factory.mktemp(f"{arch}-head64")
        model.save_pretrained(path)
        return str(path)

    return make


@gpu
@pytest.mark.parametrize("arch", list(ENGINE_MODELS))
def test_engine_greedy_matches_triton(flashinfer, head64_checkpoint, arch):
    """bf16 greedy, chunked prefill, mixed and decode-only steps (mistral: windowed, blocks freed).

    Two bf16 kernels may round differently, so a sequence may part at a near-tie of its top two
    tokens; until then the chosen tokens' logprobs agree.
    """
    from research_lm import LLM, SamplingParams
    from tests.engine.test_generate_parity import _prompts

    path = head64_checkpoint(arch)
    knobs = dict(dtype="bfloat16", device="cuda", block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                 num_gpu_blocks=64, max_model_len=64)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    runs = {}
    for backend in ("triton", "flashinfer"):
        llm = LLM(path, attention_backend=backend, **knobs)
        assert [b.name for b in llm.engine.runner.backends] == [backend]
        runs[backend] = [o.outputs[0] for o in llm.generate(_prompts(llm.engine.info.vocab_size), params,
                                                            use_tqdm=False)]  # fmt: skip
    assert_greedy_agrees_up_to_near_ties(runs["triton"], runs["flashinfer"], num_tokens=8)


# ---------------------------------------------------------------- GPU: the engine with CUDA graphs

GRAPH_KNOBS = dict(attention_backend="flashinfer", dtype="bfloat16", device="cuda", block_size=4,
                   max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=64, max_model_len=64,
                   cuda_graph_sizes=[1, 2, 4], enable_prefix_caching=False)  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def _generate(llm, prompts, max_tokens: list[int], logprobs: int | None = None):
    """Greedy completions, and the (B, q) of every graph replay."""
    from research_lm import SamplingParams
    from research_lm.worker.cuda_graphs import DecodeGraphs

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs) for n in max_tokens]
    graphs, keys = llm.engine.runner.cuda_graphs, []
    if graphs is not None:
        graphs.replay = lambda key, common: keys.append(key) or DecodeGraphs.replay(graphs, key, common)
    try:
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)], keys
    finally:
        if graphs is not None:
            del graphs.replay


def _assert_agree_up_to_near_ties(want: list, got: list, tol: float = 0.05) -> None:
    """bf16 graphs vs eager (different FlashInfer schedules: split-KV under graphs, padded GEMMs): each sequence
    matches the reference (with logprobs) token for token until it may part at a near-tie of the reference's
    top two tokens; where `got` has logprobs, the chosen tokens' agree within tol; all but at most one sequence
    match to the end."""
    same = 0
    for w_out, g_out in zip(want, got, strict=True):
        assert len(g_out.token_ids) == len(w_out.token_ids)
        for j, (w, g) in enumerate(zip(w_out.token_ids, g_out.token_ids)):
            if w != g:
                top = w_out.logprobs[j]
                assert g in top and abs(top[w].logprob - top[g].logprob) < tol, (j, w, g, top)
                break
            if g_out.logprobs is not None:
                assert abs(w_out.logprobs[j][w].logprob - g_out.logprobs[j][g].logprob) < tol
        else:
            same += 1
    assert same >= len(want) - 1


def _graph_llm(path: str, **knobs):
    from research_lm import LLM

    llm = LLM(path, cuda_graphs=True, **GRAPH_KNOBS, **knobs)
    assert [b.name for b in llm.engine.runner.backends] == ["flashinfer"]
    assert llm.engine.runner.cuda_graphs is not None
    return llm


@gpu
def test_engine_decode_graphs_with_padding_match_eager(flashinfer, head64_checkpoint):
    """3 requests of 12, 8, 4 tokens: decode steps replay the graphs of 4 (3 padded), 2 and 1 requests. The graph
    run's logprobs agree with the eager run's, its tokens up to near-ties; without logprobs (each decode step
    takes the graph's argmax) it emits what it emits with them."""
    from research_lm import LLM
    from tests.engine.test_generate_parity import _prompts

    path, max_tokens = head64_checkpoint("llama"), [12, 8, 4]
    eager = LLM(path, cuda_graphs=False, **GRAPH_KNOBS)
    prompts = _prompts(eager.engine.info.vocab_size)[:3]
    want, _ = _generate(eager, prompts, max_tokens, logprobs=5)
    llm = _graph_llm(path)
    got_lp, keys_lp = _generate(llm, prompts, max_tokens, logprobs=5)
    got, keys = _generate(llm, prompts, max_tokens)
    assert keys == keys_lp == [(4, 1)] * 3 + [(2, 1)] * 4 + [(1, 1)] * 4  # the first tokens come from the prefill
    _assert_agree_up_to_near_ties(want, got_lp)
    assert [o.token_ids for o in got] == [o.token_ids for o in got_lp]


@gpu
def test_engine_spec_verify_graphs_match_plain_greedy(flashinfer, head64_checkpoint):
    """ngram drafts (k = 3) on prompts that repeat: verify steps (2 .. 4 query tokens per request) replay the
    prefill wrapper's graphs of 4 tokens per request, 3 requests padded to 4; tokens are plain eager greedy's
    up to near-ties."""
    from research_lm import LLM

    path, max_tokens = head64_checkpoint("llama"), [12, 9, 6]
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5], [7, 8, 9, 7, 8]]
    want, _ = _generate(LLM(path, cuda_graphs=False, **GRAPH_KNOBS), prompts, max_tokens, logprobs=5)
    llm = _graph_llm(path, speculative_config=NGRAM)
    assert llm.engine.runner.cuda_graphs.sizes == {1: [1, 2, 4], 4: [1, 2, 4]}
    got, keys = _generate(llm, prompts, max_tokens)
    assert (4, 4) in keys
    _assert_agree_up_to_near_ties(want, got)


@gpu
@pytest.mark.parametrize("prompt_len, graph", [(13, (1, 16)), (40, (1, 64))])
def test_engine_batch1_prefill_graph_matches_eager(flashinfer, head64_checkpoint, prompt_len, graph):
    """One prompt alone replays the prefill graph that holds it (13 of 16 rows, 40 of 64), then decode graphs."""
    from research_lm import LLM

    path = head64_checkpoint("llama")
    eager = LLM(path, cuda_graphs=False, **GRAPH_KNOBS)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(eager.engine.info.vocab_size, (prompt_len,), generator=gen).tolist()]
    want, _ = _generate(eager, prompts, [8], logprobs=5)
    llm = _graph_llm(path)
    assert llm.engine.runner.cuda_graphs.prefill == [16, 32, 64]
    got, keys = _generate(llm, prompts, [8], logprobs=5)
    assert keys == [graph] + [(1, 1)] * 7
    _assert_agree_up_to_near_ties(want, got)
