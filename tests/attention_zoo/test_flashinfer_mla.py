"""The `mla_flashinfer` backend matches `mla_torch_ref`; the engine on it generates mla_torch_ref's greedy tokens.

CPU tests check what needs no GPU: the registry entry, the build-time refusals (which must not
import flashinfer), and the page lists handed to FlashInfer's plan. The `@pytest.mark.gpu` tests skip
without CUDA or without `flashinfer`; they run DeepSeek-V2-Lite/V3 MLA shapes (kv_lora_rank 512,
rope 64, nope 128, v 128, 16 heads) in bf16 against the reference computed in fp32 on the same
(bf16-valued) inputs, with cache rows outside every context and FlashInfer's output buffer
poisoned with NaN. Every plan is JIT-built once per (kernel family, dtype): bf16 FA3 (the "auto"
choice on Hopper) and bf16 FA2 (one parametrised test).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from attention_zoo import registry
from attention_zoo.base import AttentionSpec
from attention_zoo.flashinfer_mla import FlashInferMLABackend, decode_pages
from attention_zoo.mla import MLASpec
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
    assert not caps.cuda_graphs


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


def assert_matches_ref(case: MLACase, **build_kwargs) -> None:
    """Per token: relative L2 error (over heads x v) < 1e-2 vs mla_torch_ref in fp32 on the same values;
    the cache write equals mla_torch_ref's bit for bit; padding rows are zero."""
    decode_query_len = build_kwargs.get("decode_query_len", 1)
    case = poison_outside_contexts(case)
    fp32 = dataclasses.replace(case, q=case.q.float(), kv_c=case.kv_c.float(), k_pe=case.k_pe.float(),
                               kv_b_weight=case.kv_b_weight.float(), kv_cache=case.kv_cache.float())  # fmt: skip
    ref, _ = run_mla_backend("mla_torch_ref", fp32, decode_query_len=decode_query_len)
    _, ref_cache = run_mla_backend("mla_torch_ref", case, decode_query_len=decode_query_len)
    out, cache = run_mla_backend("mla_flashinfer", case, **build_kwargs)
    n = case.num_real_tokens
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0, equal_nan=True)
    assert torch.isfinite(out[:n]).all()
    assert (out[n:] == 0).all()  # padding rows, as mla_torch_ref leaves them
    err = (out[:n].float() - ref[:n]).flatten(1).norm(dim=1) / ref[:n].flatten(1).norm(dim=1)
    assert err.max() < REL_TOL, f"worst token {int(err.argmax())}: relative error {float(err.max()):.3g}"


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
    """bf16 greedy with chunked prefill: mixed prefill + decode steps, then decode-only ones, contexts
    crossing pages of 16.

    Two bf16 paths may round differently, so a sequence may part at a near-tie of its top two tokens;
    until then the chosen tokens' logprobs agree.
    """
    from research_lm import LLM, SamplingParams
    from tests.engine.test_generate_parity import _prompts

    knobs = dict(dtype="bfloat16", device="cuda", block_size=BS, max_num_batched_tokens=32, max_num_seqs=8,
                 num_gpu_blocks=64, max_model_len=128)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    runs = {}
    for backend in ("mla_torch_ref", "mla_flashinfer"):
        llm = LLM(deepseek_512_checkpoint, mla_backend=backend, **knobs)
        assert [b.name for b in llm.engine.runner.backends] == [backend]
        outs = llm.generate(_prompts(llm.engine.info.vocab_size), params, use_tqdm=False)
        runs[backend] = [o.outputs[0] for o in outs]
        del llm
    assert_greedy_agrees_up_to_near_ties(runs["mla_torch_ref"], runs["mla_flashinfer"], num_tokens=24)
