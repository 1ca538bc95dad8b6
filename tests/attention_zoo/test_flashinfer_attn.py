"""The `flashinfer` backend matches `torch_ref` on the same logical cache, and the engine on it matches `triton`.

The GPU tests (`@pytest.mark.gpu`) skip without CUDA or without `flashinfer`. They run bf16 only, and
put sliding windows at head size 64 only, so FlashInfer JIT-builds three kernel modules (dtype x head
size x windowed): head 128, head 64, head 64 windowed. The CPU tests check what needs no GPU: the
capability refusal (which must not import flashinfer) and the page lists handed to FlashInfer's plans.
"""

from __future__ import annotations

import sys

import pytest
import torch

from attention_zoo import registry
from attention_zoo.base import AttentionSpec
from attention_zoo.flashinfer_attn import FlashInferBackend, paged_kv
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
    assert not caps.cuda_graphs and caps.sliding_window
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
