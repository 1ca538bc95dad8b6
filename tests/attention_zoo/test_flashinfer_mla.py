"""The `mla_flashinfer` backend matches `mla_torch_ref`; the engine on it generates mla_torch_ref's greedy tokens.

CPU tests check what needs no GPU: the registry entry, the build-time refusals (which must not
import flashinfer), the page lists handed to FlashInfer's plan, a CUDA graph's padded plan inputs
(refilled in place before each replay), and the graphs' plumbing with FlashInfer's graph-mode wrapper
stood in by torch. The `@pytest.mark.gpu` tests skip
without CUDA or without `flashinfer`; they run DeepSeek-V2-Lite/V3 MLA shapes (kv_lora_rank 512,
rope 64, nope 128, v 128, 16 heads) in bf16 against the reference computed in fp32 on the same
(bf16-valued) inputs, with cache rows outside every context and FlashInfer's output buffer
poisoned with NaN. Every plan is JIT-built once per (kernel family, dtype): bf16 FA3 (the "auto"
choice on Hopper) and bf16 FA2 (one parametrised test). The CUDA-graph tests capture one layer over
the runner's step buffers (decode, verify and prefill graphs, replayed for steps that need padding), and
the engine with graphs against the engine without.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from attention_zoo import flashinfer_mla, registry
from attention_zoo.base import AttentionSpec
from attention_zoo.flashinfer_mla import FlashInferMLABackend, decode_pages, graph_pages
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.mla import MLASpec
from research_lm.worker.buffers import StepBuffers
from research_lm.worker.cuda_graphs import DecodeGraphs, cuda_graph_capture, graph_metadata, pad_step_inputs
from tests.attention_zoo.test_mla import MLACase, make_mla_case, run_mla_backend
from tests.utils import assert_greedy_agrees_up_to_near_ties

gpu = pytest.mark.gpu
BS = 16
DEEPSEEK = dict(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
REL_TOL = 1e-2  # per-token relative L2 error of bf16 outputs vs the fp32 reference


def deepseek_spec(**overrides) -> MLASpec:
    dims = DEEPSEEK | overrides
    return MLASpec.from_dims(**dims, scale=(dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5)


@pytest.fixture
def flashinfer():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return pytest.importorskip("flashinfer")


# ---------------------------------------------------------------- CPU: no flashinfer needed


def test_registry_lists_the_backend_and_importing_it_does_not_import_flashinfer():
    code = (
        "import sys, attention_zoo\n"
        "from attention_zoo import available_backends, get_backend\n"
        "assert 'mla_flashinfer' in available_backends()\n"
        "assert get_backend('mla_flashinfer').name == 'mla_flashinfer'\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported at registry time'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_select_on_cpu_fails_naming_working_backends_without_importing_flashinfer():
    had_flashinfer = "flashinfer" in sys.modules
    with pytest.raises(ValueError, match=r"'mla_flashinfer' does not run on cpu.*would work: \[.*'mla_torch_ref'"):
        registry.select_backend("mla_flashinfer", deepseek_spec(), torch.device("cpu"), torch.bfloat16)
    assert had_flashinfer or "flashinfer" not in sys.modules


def test_non_deepseek_latent_shapes_and_fp32_are_refused_with_a_sentence():
    cuda = torch.device("cuda")  # a device name; needs no GPU
    small = MLASpec.from_dims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                              scale=1.0)  # fmt: skip
    pattern = r"kv_lora_rank \+ qk_rope_head_dim = 32 \+ 8 .*512 \+ 64\).*would work: \[.*'mla_torch_ref'"
    with pytest.raises(ValueError, match=pattern):
        registry.select_backend("mla_flashinfer", small, cuda, torch.bfloat16)
    caps = FlashInferMLABackend.capabilities
    rope32 = caps.missing(deepseek_spec(qk_rope_head_dim=32), cuda, torch.bfloat16)
    assert "kv_lora_rank + qk_rope_head_dim = 512 + 32" in rope32
    assert "dtype" in caps.missing(deepseek_spec(), cuda, torch.float32)
    assert "does not implement attention layers" in caps.missing(AttentionSpec(8, 2, 128, 1.0), cuda, torch.bfloat16)
    assert caps.cuda_graphs and caps.cuda_graphs_multi_token and caps.graphs_plan_on_host


def test_deepseek_shape_needs_only_the_package(monkeypatch):
    import importlib.util

    caps, cuda = FlashInferMLABackend.capabilities, torch.device("cuda")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "needs the flashinfer package" in caps.missing(deepseek_spec(), cuda, torch.bfloat16)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert caps.missing(deepseek_spec(), cuda, torch.bfloat16) is None
    assert caps.missing(deepseek_spec(num_heads=128), cuda, torch.float16) is None


def test_cache_is_the_shared_latent_layout():
    spec = deepseek_spec()
    assert FlashInferMLABackend.kv_cache_shape(10, BS, spec) == (10, BS, 576)
    assert registry.get_backend("mla_torch_ref").kv_cache_shape(10, BS, spec) == (10, BS, 576)


def test_decode_pages_cover_each_decode_context_in_csr_form():
    """Requests 1, 3 and 4 decode (4 with two query rows, decode_query_len=2); 0 prefills, 2 is idle."""
    case = make_mla_case([5, 1, 0, 2, 1], [20, BS, 7, BS + 1, 3 * BS + 2], block_size=BS)
    bt = case.common.block_table
    pages = decode_pages(case.common, [1, 3, 4])
    assert pages["qo_indptr"].tolist() == [0, 1, 3, 4]
    assert pages["kv_indptr"].tolist() == [0, 1, 3, 7]
    assert pages["kv_lens"].tolist() == [BS, BS + 1, 3 * BS + 2]
    assert pages["kv_indices"].tolist() == bt[1, :1].tolist() + bt[3, :2].tolist() + bt[4, :4].tolist()
    assert all(t.dtype == torch.int32 for t in pages.values())
    assert pages["qo_indptr"].device.type == pages["kv_indptr"].device.type == pages["kv_lens"].device.type == "cpu"


def test_graph_pages_give_every_padding_row_a_request_and_keep_the_graphs_row_count():
    """A graph step's plan covers all B * q rows: FlashInfer's plan picks the kernel's cluster size from the mean rows
    per request, which must stay the capture's (the graph keeps its launch grid)."""
    ints = lambda *xs: np.asarray(xs, dtype=np.int32)
    # q = 1, B = 6: 3 decodes; padding requests 3 .. 5 get one row and one key each, their page at the table's start
    qo, kv_indptr, kv_lens = graph_pages(ints(0, 1, 2, 3), ints(5, 17, 1), num_rows=6, num_slots=6, row_stride=9)
    assert qo.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert kv_indptr.tolist() == [0, 9, 18, 0, 0, 0, 0]
    assert kv_lens.tolist() == [5, 17, 1, 1, 1, 1]
    assert qo.dtype == kv_indptr.dtype == kv_lens.dtype == np.int32
    # q = 4, B = 4 (5 slots): queries of 1, 3 and 2 leave 10 rows to the two padding requests, causal over as many keys
    qo, kv_indptr, kv_lens = graph_pages(ints(0, 1, 4, 6), ints(20, 33, 2), num_rows=16, num_slots=5, row_stride=9)
    assert qo.tolist() == [0, 1, 4, 6, 11, 16]
    assert kv_indptr.tolist() == [0, 9, 18, 0, 0, 0]
    assert kv_lens.tolist() == [20, 33, 2, 5, 5]
    # a full batch (n = B = 2, q = 3): the extra slot takes the rows left; the capture's own shape leaves none
    qo, _, kv_lens = graph_pages(ints(0, 2, 3), ints(7, 40), num_rows=6, num_slots=3, row_stride=9)
    assert (qo.tolist(), kv_lens.tolist()) == ([0, 2, 3, 6], [7, 40, 3])
    qo, _, kv_lens = graph_pages(ints(0, 3, 6), ints(3, 3), num_rows=6, num_slots=3, row_stride=9)
    assert (qo.tolist(), kv_lens.tolist()) == ([0, 3, 6, 6], [3, 3, 0])


def test_graph_pages_of_random_steps_stay_within_the_graph():
    gen = np.random.default_rng(0)
    for _ in range(200):
        b, q = int(gen.integers(1, 9)), int(gen.choice([1, 2, 4, 16]))
        n = int(gen.integers(1, b + 1))
        query_lens = np.ones(n, dtype=np.int32) if q == 1 else gen.integers(1, q + 1, n).astype(np.int32)
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        seq_lens = query_lens + gen.integers(0, 100, n).astype(np.int32)
        slots = b + (q > 1)
        qo, kv_indptr, kv_lens = graph_pages(qsl, seq_lens, num_rows=b * q, num_slots=slots, row_stride=7)
        assert len(qo) == len(kv_indptr) == slots + 1 and len(kv_lens) == slots
        assert qo[-1] == b * q and (np.diff(qo) >= 0).all()
        assert (qo[: n + 1] == qsl).all() and (kv_lens[:n] == seq_lens).all()
        assert (kv_lens[n:] == np.diff(qo)[n:]).all()  # causal padding: a key per row, none masked out entirely
        assert (kv_indptr[:n] == 7 * np.arange(n)).all() and (kv_indptr[n:] == 0).all()
        pad_rows = np.diff(qo)[n:]
        assert len(pad_rows) == 0 or np.ptp(pad_rows) <= 1  # shared evenly


def step_record(buf: StepBuffers, query_lens: list[int], seq_lens: list[int]) -> CommonAttentionMetadata:
    """A step's record over the step buffers, host mirrors of its n requests filled (what prepare_replay reads)."""
    n, t = len(query_lens), sum(query_lens)
    buf.query_start_loc.np[: n + 1] = np.concatenate([[0], np.cumsum(query_lens)])
    buf.seq_lens.np[:n] = seq_lens
    buf.num_computed.np[:n] = np.asarray(seq_lens) - np.asarray(query_lens)
    return dataclasses.replace(graph_metadata(buf, n, BS, max_seq_len=80), slot_mapping=buf.slot_mapping.gpu[:t],
                               num_tokens=t, max_query_len=max(query_lens), max_seq_len=max(seq_lens))  # fmt: skip


def test_graph_metadata_replans_its_wrappers_for_each_replay_in_place(monkeypatch):
    """A verify graph (B = 4, q = 4) over CPU step buffers, one stand-in wrapper: each prepare_replay plans it once
    with the step's padded layout, in the very host tensors the metadata holds; pages are the block table's view."""
    monkeypatch.setattr(flashinfer_mla, "WORKSPACE_BYTES", 16)
    monkeypatch.setattr(FlashInferMLABackend, "_workspaces", {})
    buf = StepBuffers(max_num_tokens=32, max_num_reqs=8, max_blocks_per_req=5, device=torch.device("cpu"))
    b, q = 4, 4
    pad_step_inputs(buf, 0, 0, b, b * q)  # the capture's inputs, as DecodeGraphs writes them
    buf.query_start_loc.np[: b + 1] = range(0, b * q + 1, q)
    buf.seq_lens.np[:b] = q
    meta = FlashInferMLABackend.build_graph_metadata(graph_metadata(buf, b, BS, max_seq_len=80, query_len=q))
    assert (meta.num_decode_tokens, meta.all_decode, meta.prefill_reqs) == (b * q, True, [])
    assert meta.kv_indices.data_ptr() == buf.block_table.gpu.data_ptr() and meta.kv_indices.shape == (b * 5,)
    assert meta.qo_indptr.tolist() == [0, 4, 8, 12, 16, 16] and meta.kv_lens.tolist() == [4, 4, 4, 4, 0]

    plans = []

    class StandIn:
        def plan(self, **kwargs):
            plans.append({k: v.tolist() if k in ("qo_indptr", "kv_indptr", "kv_len_arr") else v
                          for k, v in kwargs.items()})  # fmt: skip
            assert kwargs["qo_indptr"] is meta.qo_indptr and kwargs["kv_indptr"] is meta.kv_indptr
            assert kwargs["kv_len_arr"] is meta.kv_lens and kwargs["kv_indices"] is meta.kv_indices

    spec = deepseek_spec()
    meta._wrappers[("auto", spec, torch.bfloat16, torch.bfloat16)] = StandIn()
    FlashInferMLABackend.prepare_replay(meta, step_record(buf, [1, 3, 2], [20, 33, 2]))
    FlashInferMLABackend.prepare_replay(meta, step_record(buf, [1, 1, 1, 1], [9, 80, 1, 16]))
    assert [p["qo_indptr"] for p in plans] == [[0, 1, 4, 6, 11, 16], [0, 1, 2, 3, 4, 16]]
    assert [p["kv_len_arr"] for p in plans] == [[20, 33, 2, 5, 5], [9, 80, 1, 16, 12]]
    assert [p["kv_indptr"] for p in plans] == [[0, 5, 10, 0, 0, 0], [0, 5, 10, 15, 0, 0]]
    assert all(p["causal"] is True and p["page_size"] == BS and p["sm_scale"] == spec.scale for p in plans)


# ---------------------------------------------------------------- GPU: kernels vs the fp32 reference


def deepseek_case(query_lens: list[int], seq_lens: list[int], *, pad_tokens: int = 0, seed: int = 0) -> MLACase:
    """make_mla_case's cache, block tables and latents at L 512 + R 64, pages of 16, bf16; q and kv_b_proj
    at DeepSeek's nope 128 / v 128 (make_mla_case's own are 16 / 12), and DeepSeek's scale (nope + rope)^-0.5."""
    case = make_mla_case(query_lens, seq_lens, num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=BS,
                         dtype=torch.bfloat16, pad_tokens=pad_tokens, device="cuda", seed=seed)  # fmt: skip
    spec, g = deepseek_spec(), torch.Generator().manual_seed(seed + 1)
    q = torch.randn(case.q.shape[0], spec.num_heads, 128 + 64, generator=g)
    kv_b = torch.randn(spec.num_heads * (128 + 128), 512, generator=g) * 512**-0.5
    return dataclasses.replace(case, spec=spec, q=q.to(case.q), kv_b_weight=kv_b.to(case.q))


def poison_outside_contexts(case: MLACase) -> MLACase:
    """NaN in every cache row no request's context covers (the null block, unused blocks, page tails)."""
    common, width = case.common, case.kv_cache.shape[-1]
    keep = torch.zeros(case.kv_cache.shape[:2], dtype=torch.bool, device=case.kv_cache.device)
    for r, seq_len in enumerate(common.seq_lens_cpu.tolist()):
        positions = torch.arange(seq_len, device=keep.device)
        keep[common.block_table[r, positions // BS].long(), positions % BS] = True
    cache = case.kv_cache.masked_fill(~keep[..., None].expand(-1, -1, width), float("nan"))
    return dataclasses.replace(case, kv_cache=cache)


@pytest.fixture
def poisoned_runs(flashinfer, monkeypatch):
    """FlashInfer's output buffer is NaN before each run, and run() takes keywords only; returns the call count."""
    calls = []
    original = flashinfer.mla.BatchMLAPagedAttentionWrapper.run

    def keyword_only_run(self, **kwargs):  # a positional argument would raise TypeError here
        kwargs["out"].fill_(float("nan"))
        calls.append(kwargs)
        return original(self, **kwargs)

    monkeypatch.setattr(flashinfer.mla.BatchMLAPagedAttentionWrapper, "run", keyword_only_run)
    return calls


def assert_close_to_ref(case: MLACase, out: torch.Tensor, cache: torch.Tensor, decode_query_len: int = 1) -> None:
    """Per token of the case's (poisoned) step: relative L2 error (over heads x v) < 1e-2 vs mla_torch_ref in fp32
    on the same values; the cache write equals mla_torch_ref's bit for bit."""
    fp32 = dataclasses.replace(case, q=case.q.float(), kv_c=case.kv_c.float(), k_pe=case.k_pe.float(),
                               kv_b_weight=case.kv_b_weight.float(), kv_cache=case.kv_cache.float())  # fmt: skip
    ref, _ = run_mla_backend("mla_torch_ref", fp32, decode_query_len=decode_query_len)
    _, ref_cache = run_mla_backend("mla_torch_ref", case, decode_query_len=decode_query_len)
    n = case.num_real_tokens
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0, equal_nan=True)
    assert torch.isfinite(out[:n]).all()
    err = (out[:n].float() - ref[:n]).flatten(1).norm(dim=1) / ref[:n].flatten(1).norm(dim=1)
    assert err.max() < REL_TOL, f"worst token {int(err.argmax())}: relative error {float(err.max()):.3g}"


def assert_matches_ref(case: MLACase, **build_kwargs) -> None:
    """The eager backend on the poisoned case is close to the reference (`assert_close_to_ref`); padding rows are
    zero."""
    case = poison_outside_contexts(case)
    out, cache = run_mla_backend("mla_flashinfer", case, **build_kwargs)
    assert_close_to_ref(case, out, cache, decode_query_len=build_kwargs.get("decode_query_len", 1))
    assert (out[case.num_real_tokens :] == 0).all()  # padding rows, as mla_torch_ref leaves them


# Decodes at 1, 15, 16, 17, 33 keys (pages of 16: before, at and after boundaries) and long ones,
# between a chunked prefill after 20 cached tokens and a fresh prefill; padding rows after.
MIXED = ([1, 1, 37, 1, 1, 1, 25, 1, 1], [1, 15, 57, 16, 17, 33, 25, 300, 2049])


@gpu
@pytest.mark.parametrize("wrapper_backend", ["auto", "fa2"])  # auto: FA3 on Hopper
def test_mixed_batch_deepseek_shapes(poisoned_runs, wrapper_backend):
    assert_matches_ref(deepseek_case(*MIXED, pad_tokens=3), wrapper_backend=wrapper_backend)
    assert len(poisoned_runs) == 1


@gpu
def test_pure_decode_batch(poisoned_runs):
    """Every row a decode (the no-gather path), contexts across page boundaries and long."""
    seq_lens = [1, 2, 15, 16, 17, 31, 32, 33, 100, 511, 512, 513, 1000, 4097]
    assert_matches_ref(deepseek_case([1] * len(seq_lens), seq_lens, seed=1))


@gpu
def test_many_decodes_long_contexts(poisoned_runs):
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 3000, (40,), generator=gen).tolist()
    assert_matches_ref(deepseek_case([1] * 40, seq_lens, seed=2))


@gpu
def test_multi_token_decode_rows_are_causal(poisoned_runs):
    """decode_query_len=4: a request's q_len rows each see the keys up to their own position."""
    assert_matches_ref(deepseek_case([3, 1, 4, 2, 9], [20, 16, 33, 2, 40], seed=3), decode_query_len=4)


@gpu
def test_prefill_only_batch_plans_nothing(poisoned_runs):
    case = deepseek_case([7, 20], [7, 40], seed=4)
    assert_matches_ref(case)
    assert poisoned_runs == []


# ---------------------------------------------------------------- GPU: planning


@gpu
def test_one_plan_per_step_and_spec_every_argument_by_keyword(flashinfer, poisoned_runs, monkeypatch):
    """Two layers of one spec share a plan; a layer of another spec (here: scale) gets its own."""
    plans = []
    original = flashinfer.mla.BatchMLAPagedAttentionWrapper.plan

    def keyword_only_plan(self, **kwargs):
        plans.append(kwargs)
        return original(self, **kwargs)

    monkeypatch.setattr(flashinfer.mla.BatchMLAPagedAttentionWrapper, "plan", keyword_only_plan)
    case = deepseek_case([1, 9, 1], [12, 21, 34], seed=5)
    other = dataclasses.replace(case.spec, scale=0.5 * case.spec.scale)
    metadata = FlashInferMLABackend.build_metadata(case.common)
    outs = [FlashInferMLABackend.make_impl(spec).forward(case.q, case.kv_c, case.k_pe, case.kv_b_weight,
                                                         case.kv_cache.clone(), metadata)
            for spec in (case.spec, case.spec, other)]  # fmt: skip
    assert len(plans) == 2 and len(poisoned_runs) == 3
    assert all(p["causal"] is True and (p["head_dim_ckv"], p["head_dim_kpe"]) == (512, 64) for p in plans)
    assert [p["sm_scale"] for p in plans] == [case.spec.scale, other.scale]
    assert plans[0]["kv_len_arr"].tolist() == [12, 34] and plans[0]["qo_indptr"].tolist() == [0, 1, 2]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    assert not torch.equal(outs[0], outs[2])


@gpu
def test_workspace_and_wrappers_live_across_steps_and_a_stale_plan_is_redone(poisoned_runs):
    case_a = deepseek_case([1, 9, 1], [12, 21, 34], seed=6)
    case_b = deepseek_case([1, 1, 50], [70, 3, 50], seed=7)
    ref_a, _ = run_mla_backend("mla_torch_ref", case_a)
    impl = FlashInferMLABackend.make_impl(case_a.spec)
    args_a = (case_a.q, case_a.kv_c, case_a.k_pe, case_a.kv_b_weight)
    meta_a = FlashInferMLABackend.build_metadata(case_a.common)
    impl.forward(*args_a, case_a.kv_cache.clone(), meta_a)
    meta_b = FlashInferMLABackend.build_metadata(case_b.common)  # the next step: same spec, same wrapper
    impl.forward(case_b.q, case_b.kv_c, case_b.k_pe, case_b.kv_b_weight, case_b.kv_cache.clone(), meta_b)
    assert meta_a.workspace is meta_b.workspace
    key = ("auto", case_a.spec, torch.bfloat16, torch.bfloat16)
    assert meta_a._wrappers[key] is meta_b._wrappers[key]
    out_a = impl.forward(*args_a, case_a.kv_cache.clone(), meta_a)  # the wrapper holds b's plan: re-plan
    n = case_a.num_real_tokens
    err = (out_a[:n].float() - ref_a[:n].float()).norm() / ref_a[:n].float().norm()
    assert err < REL_TOL


# ---------------------------------------------------------------- CUDA graphs: CPU (FlashInfer stood in by torch), GPU


class LayerAlone(torch.nn.Module):
    """One MLA layer as DecodeGraphs' model: q and the step's latents come from buffers of the graphs' largest row
    count, and the cache and kv_b_proj's weight stay where they were at capture (what a replay reads)."""

    def __init__(self, spec: MLASpec, rows: int, num_blocks: int, dtype: torch.dtype, device: str):
        super().__init__()
        self.impl = FlashInferMLABackend.make_impl(spec)
        like = dict(dtype=dtype, device=device)
        self.q = torch.zeros(rows, spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim, **like)
        self.kv_c = torch.zeros(rows, spec.kv_lora_rank, **like)
        self.k_pe = torch.zeros(rows, spec.qk_rope_head_dim, **like)
        self.kv_b = torch.zeros(spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank, **like)
        self.cache = torch.full((num_blocks, BS, spec.head_size), float("nan"), **like)

    def forward(self, input_ids, positions, attn_metadata):
        t = input_ids.shape[0]
        return self.impl.forward(self.q[:t], self.kv_c[:t], self.k_pe[:t], self.kv_b, self.cache,
                                 attn_metadata["mla_flashinfer"])  # fmt: skip


def capture_layer(cases: list[MLACase], *, sizes: list[int], query_lens: list[int], prefill_sizes: list[int],
                  capture=cuda_graph_capture) -> tuple[DecodeGraphs, LayerAlone]:  # fmt: skip
    """The graphs of one layer over step buffers that hold every case (their blocks and block tables)."""
    case, device = cases[0], cases[0].q.device
    max_blocks = max(c.common.block_table.shape[1] for c in cases)
    rows = max([max(sizes) * q for q in query_lens] + prefill_sizes)
    layer = LayerAlone(case.spec, rows, max(c.kv_cache.shape[0] for c in cases), case.q.dtype, device)
    buf = StepBuffers(max_num_tokens=rows, max_num_reqs=max(sizes), max_blocks_per_req=max_blocks, device=device)
    graphs = DecodeGraphs(layer, buf, [FlashInferMLABackend], sizes=sizes, block_size=BS, max_seq_len=max_blocks * BS,
                          query_lens=query_lens, prefill_sizes=prefill_sizes, capture=capture)  # fmt: skip
    return graphs, layer


def replay_case(graphs: DecodeGraphs, layer: LayerAlone, case: MLACase) -> tuple[torch.Tensor, torch.Tensor]:
    """Load the case into the layer and the step buffers (as the runner's input preparation does) and run the graph
    DecodeGraphs picks for it: (its token rows of the output, the case's blocks of the cache after the step)."""
    buf, common = graphs.buffers, case.common
    n, t, num_blocks = common.num_reqs, case.num_real_tokens, case.kv_cache.shape[0]
    layer.cache.fill_(float("nan"))  # the blocks of earlier cases, which stale block table rows still name
    layer.cache[:num_blocks] = case.kv_cache
    for dst, src in ((layer.q, case.q), (layer.kv_c, case.kv_c), (layer.k_pe, case.k_pe)):
        dst[:t] = src[:t]
    layer.kv_b.copy_(case.kv_b_weight)
    block_table = common.block_table.cpu().numpy()
    buf.block_table.np[:n, : block_table.shape[1]] = block_table
    buf.slot_mapping.np[:t] = common.slot_mapping[:t].cpu().numpy()
    buf.input_ids.np[:t] = buf.positions.np[:t] = 0  # the layer reads neither
    buf.request_rows.np[:n] = np.arange(n)
    step = step_record(buf, common.query_lens_cpu.tolist(), common.seq_lens_cpu.tolist())
    step = dataclasses.replace(step, block_table=buf.copy_block_table(n, block_table.shape[1]))
    return graphs.run(step).out, layer.cache[:num_blocks]


class TorchGraphWrapper:
    """FlashInfer's BatchMLAPagedAttentionWrapper in CUDA-graph mode, in torch: plan() copies its inputs into the
    buffers given at construction, as FlashInfer's does, and keeps its own copy of the plan (FlashInfer's int
    workspace); run() attends by that plan alone, as a replayed graph does, writing only the rows the plan covers."""

    made: list[TorchGraphWrapper] = []  # every instance, in order (reset by the test)

    def __init__(self, *, float_workspace_buffer, use_cuda_graph, qo_indptr, kv_indptr, kv_indices, kv_len_arr,
                 backend):  # fmt: skip
        assert use_cuda_graph and kv_indices.dtype == torch.int32
        self.buffers, self.kv_indices, self.plans, self.fresh = (qo_indptr, kv_indptr, kv_len_arr), kv_indices, 0, False
        TorchGraphWrapper.made.append(self)

    def plan(self, *, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler):  # fmt: skip
        for buf, x in zip(self.buffers, (qo_indptr, kv_indptr, kv_len_arr), strict=True):
            buf.copy_(x)
        self.kv_indices[: len(kv_indices)].copy_(kv_indices)
        self.plan_ = (qo_indptr.tolist(), kv_indptr.tolist(), kv_len_arr.tolist(), page_size, sm_scale, causal)
        self.plans, self.fresh = self.plans + 1, True

    def run(self, *, q_nope, q_pe, ckv_cache, kpe_cache, out, return_lse):
        (qo, kv_indptr, kv_lens, page, scale, causal), pages = self.plan_, self.kv_indices.long()
        assert self.fresh and causal and qo[-1] == out.shape[0], "each replay plans before its forward"
        self.fresh = False  # one layer: one run per plan
        for i, s in enumerate(kv_lens):
            m, rows = qo[i + 1] - qo[i], slice(qo[i], qo[i + 1])
            if m == 0:
                continue
            pos = torch.arange(s)
            block, offset = pages[kv_indptr[i] + pos // page], pos % page
            ckv, kpe = ckv_cache[block, offset].float(), kpe_cache[block, offset].float()  # [s, L], [s, R]
            scores = (torch.einsum("mhl,sl->hms", q_nope[rows].float(), ckv)
                      + torch.einsum("mhr,sr->hms", q_pe[rows].float(), kpe)) * scale  # fmt: skip
            seen = pos[None, :] <= (s - m + torch.arange(m))[:, None]  # causal: query j sees s - m + j + 1 keys
            scores = scores.masked_fill(~seen, float("-inf"))
            out[rows] = torch.einsum("hms,sl->mhl", scores.softmax(-1), ckv).to(out.dtype)
        return out


def test_graph_plumbing_with_flashinfer_stood_in_by_torch(monkeypatch):
    """CPU: DecodeGraphs with the re-run stand-in for capture and FlashInfer's graph-mode wrapper in torch: decode,
    verify and prefill graphs, each step needing padding rows or requests, match the reference; each replay plans
    each wrapper once, before the forward, from the step's own lengths (the stand-in attends by its last plan)."""
    import types

    from research_lm.worker.cuda_graphs import eager_capture

    monkeypatch.setattr(flashinfer_mla, "WORKSPACE_BYTES", 16)
    monkeypatch.setattr(FlashInferMLABackend, "_workspaces", {})
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    stand_in = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=TorchGraphWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", stand_in)
    monkeypatch.setattr(TorchGraphWrapper, "made", [])
    steps = [  # (query lens, seq lens) and the graph each replays
        (([1, 1, 1], [1, 17, 40]), (4, 1)),
        (([1, 3, 2], [20, 33, 2]), (4, 3)),
        (([3, 1, 3, 2], [3, 17, 30, 40]), (4, 3)),  # every request: the extra slot takes the 3 rows left
        (([7], [7]), (1, 8)),
        (([1, 1], [50, 7]), (4, 1)),
    ]
    cases = [poison_outside_contexts(make_mla_case(*lens, block_size=BS, seed=i)) for i, (lens, _) in enumerate(steps)]
    graphs, layer = capture_layer(cases, sizes=[4], query_lens=[1, 3], prefill_sizes=[8], capture=eager_capture)
    keys = []
    graphs.replay = lambda key, common: keys.append(key) or DecodeGraphs.replay(graphs, key, common)
    for case, (_, key) in zip(cases, steps, strict=True):
        planned = sum(w.plans for w in TorchGraphWrapper.made)
        out, cache = replay_case(graphs, layer, case)
        assert keys[-1] == key and sum(w.plans for w in TorchGraphWrapper.made) == planned + 1
        assert_close_to_ref(case, out, cache)
    assert len(TorchGraphWrapper.made) == 3  # a wrapper per graph, made by its first forward
    assert all(w.kv_indices.data_ptr() == graphs.buffers.block_table.gpu.data_ptr() for w in TorchGraphWrapper.made)


# (query lens, seq lens) of consecutive steps: the graph each replays; each needs padding rows or requests.
GRAPH_STEPS = [
    (([1] * 5, [1, 16, 17, 300, 2049]), (8, 1)),  # decodes at page boundaries and long
    (([1, 4, 2, 3, 1], [20, 33, 2, 40, 100]), (8, 4)),  # a verify step, short queries
    (([4, 1, 4, 2, 4, 1, 3, 4], [4, 17, 30, 2, 64, 5, 40, 90]), (8, 4)),  # every request: the extra slot pads
    (([9], [9]), (1, 16)),  # a prompt
    (([13], [43]), (1, 16)),  # a chunk after 30 cached tokens
    (([1, 1], [50, 7]), (8, 1)),  # decodes again, after the other graphs
]


@gpu
def test_graphs_replay_steps_that_need_padding(flashinfer, poisoned_runs, monkeypatch):
    """One layer captured into decode (8 x 1), verify (8 x 4) and prefill (1 x 16) graphs over the runner's step
    buffers; each step replays its graph (no forward runs in Python: FlashInfer's run() is not called again),
    planned outside the capture with the launch plan the capture recorded, and matches the fp32 reference."""
    plans = []  # (wrapper, planned while capturing, its plan info)
    original = flashinfer.mla.BatchMLAPagedAttentionWrapper.plan

    def recording_plan(self, **kwargs):
        original(self, **kwargs)
        plans.append((self, torch.cuda.is_current_stream_capturing(), tuple(int(x) for x in self._plan_info)))

    monkeypatch.setattr(flashinfer.mla.BatchMLAPagedAttentionWrapper, "plan", recording_plan)
    cases = [poison_outside_contexts(deepseek_case(*lens, seed=10 + i)) for i, (lens, _) in enumerate(GRAPH_STEPS)]
    graphs, layer = capture_layer(cases, sizes=[8], query_lens=[1, 4], prefill_sizes=[16])
    assert graphs.sizes == {1: [8], 4: [8]} and graphs.prefill == [16]
    runs_at_capture, captured = len(poisoned_runs), {w: info for w, _, info in plans}
    assert runs_at_capture == 6 and len(captured) == 3  # warm-up and capture per graph; a wrapper each
    keys = []
    graphs.replay = lambda key, common: keys.append(key) or DecodeGraphs.replay(graphs, key, common)
    for case, (_, key) in zip(cases, GRAPH_STEPS, strict=True):
        planned = len(plans)
        out, cache = replay_case(graphs, layer, case)
        assert keys[-1] == key and len(plans) == planned + 1
        assert_close_to_ref(case, out, cache)
    assert len(poisoned_runs) == runs_at_capture
    assert not any(capturing for _, capturing, _ in plans)
    assert all(info == captured[w] for w, _, info in plans), "a replay's plan left the captured launch grid"


# ---------------------------------------------------------------- GPU: the engine

# A random DeepSeek-V2 with DeepSeek-V2-Lite/V3's MLA dims: 16 heads, latent 512 + rope 64, nope 128,
# v 128; 2 layers, both dense, hidden 64 (conftest's TINY_SHAPE), no q LoRA.
ENGINE_MLA = dict(num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                  q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  first_k_dense_replace=2)  # fmt: skip


@pytest.fixture(scope="module")
def deepseek_512_checkpoint(tmp_path_factory) -> str:
    import transformers

    from tests.conftest import TINY_SHAPE, _randomize

    config = transformers.DeepseekV2Config(**(TINY_SHAPE | ENGINE_MLA))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=0)
    path = tmp_path_factory.mktemp("deepseek-v2-mla512")
    model.save_pretrained(path)
    return str(path)


@gpu
def test_engine_greedy_matches_reference(flashinfer, deepseek_512_checkpoint):
    """bf16 greedy with chunked prefill, eager steps: mixed prefill + decode steps, then decode-only ones, contexts
    crossing pages of 16 (graphs against eager: `test_engine_cuda_graphs_match_eager`).

    Two bf16 paths may round differently, so a sequence may part at a near-tie of its top two tokens;
    until then the chosen tokens' logprobs agree.
    """
    from research_lm import LLM, SamplingParams
    from tests.engine.test_generate_parity import _prompts

    knobs = dict(dtype="bfloat16", device="cuda", block_size=BS, max_num_batched_tokens=32, max_num_seqs=8,
                 num_gpu_blocks=64, max_model_len=128, cuda_graphs=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    runs = {}
    for backend in ("mla_torch_ref", "mla_flashinfer"):
        llm = LLM(deepseek_512_checkpoint, mla_backend=backend, **knobs)
        assert [b.name for b in llm.engine.runner.backends] == [backend]
        outs = llm.generate(_prompts(llm.engine.info.vocab_size), params, use_tqdm=False)
        runs[backend] = [o.outputs[0] for o in outs]
        del llm
    assert_greedy_agrees_up_to_near_ties(runs["mla_torch_ref"], runs["mla_flashinfer"], num_tokens=24)


@gpu
def test_engine_cuda_graphs_match_eager(flashinfer, deepseek_512_checkpoint):
    """bf16 greedy, graphs against eager: three requests decode in the graph of 4 (one padding request); a lone
    26-token prompt replays the prefill graph of 32, then the decode graph of 1. Eager steps send prompts through the
    naive path and graphs through FlashInfer, and a padded plan may split keys differently, so sequences may part at
    near-ties."""
    from research_lm import LLM, SamplingParams
    from tests.engine.test_generate_parity import _prompts

    knobs = dict(dtype="bfloat16", device="cuda", mla_backend="mla_flashinfer", block_size=BS,
                 max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks=64, max_model_len=128,
                 cuda_graph_sizes=[1, 2, 4])  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    eager = LLM(deepseek_512_checkpoint, cuda_graphs=False, **knobs)
    assert eager.engine.runner.cuda_graphs is None
    prompts = _prompts(eager.engine.info.vocab_size)
    batches = [prompts[1:4], prompts[6:7]]  # 14, 8, 22 tokens; 26
    want = [[o.outputs[0] for o in eager.generate(b, params, use_tqdm=False)] for b in batches]
    del eager
    llm = LLM(deepseek_512_checkpoint, cuda_graphs=True, **knobs)
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None and graphs.sizes == {1: [1, 2, 4]} and graphs.prefill == [16, 32]
    keys, replay = [], graphs.replay
    graphs.replay = lambda key, common: keys.append(key) or replay(key, common)
    got = [[o.outputs[0] for o in llm.generate(b, params, use_tqdm=False)] for b in batches]
    for w, g in zip(want, got, strict=True):
        assert_greedy_agrees_up_to_near_ties(w, g, num_tokens=16)
    assert {(4, 1), (1, 32), (1, 1)} <= set(keys), keys
