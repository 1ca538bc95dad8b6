"""The `mla_triton` backend matches `mla_torch_ref`: the latent write, the absorbed decode kernel, split-KV.

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set below before anything
imports Triton) at tiny fp32/fp16 shapes; `@pytest.mark.gpu` tests run DeepSeek shapes in bf16.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attention_zoo.mla import write_latent as ref_write_latent  # noqa: E402
from attention_zoo.triton_kernels.mla_decode import merge_splits, write_latent  # noqa: E402
from tests.attention_zoo.test_mla import MIXED, dense_oracle, make_mla_case, run_mla_backend  # noqa: E402

ON_CPU = not torch.cuda.is_available()
DEVICE = "cpu" if ON_CPU else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True, scope="module")
def _interpreter_or_cuda():
    if ON_CPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("no CUDA and TRITON_INTERPRET is not 1: Triton kernels cannot run here")


def assert_matches_ref(case, **build_kwargs) -> torch.Tensor:
    decode_query_len = build_kwargs.get("decode_query_len", 1)
    ref_out, ref_cache = run_mla_backend("mla_torch_ref", case, decode_query_len=decode_query_len)
    out, cache = run_mla_backend("mla_triton", case, **build_kwargs)
    n, tol = case.num_real_tokens, TOL[case.q.dtype]
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out[:n].float(), ref_out[:n].float(), atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_latent_write_matches_reference_and_skips_padding(dtype):
    case = make_mla_case([3, 1, 6], [3, 9, 17], dtype=dtype, pad_tokens=2, device=DEVICE)
    wide = torch.cat([case.kv_c, case.k_pe, case.kv_c], dim=-1)  # non-contiguous rows
    kv_c, k_pe = wide[:, : case.kv_c.shape[1]], wide[:, case.kv_c.shape[1] : -case.kv_c.shape[1]]
    ref, ours = case.kv_cache.clone(), case.kv_cache.clone()
    ref_write_latent(ref, kv_c, k_pe, case.common.slot_mapping)
    write_latent(ours, kv_c, k_pe, case.common.slot_mapping)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch_matches_reference(dtype):
    """Prefills (reference path) and decodes at block boundaries in one batch, padding rows after."""
    case = make_mla_case(*MIXED, dtype=dtype, pad_tokens=2, device=DEVICE)
    out = assert_matches_ref(case)
    if dtype == torch.float32:
        torch.testing.assert_close(out[: case.num_real_tokens].double().cpu(), dense_oracle(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads", [4, 20])  # one head block, padded; two blocks, the second partial
def test_pure_decode_across_head_blocks(num_heads):
    case = make_mla_case([1, 1, 1], [1, 16, 17], num_heads=num_heads, device=DEVICE, seed=1)
    assert_matches_ref(case)


@pytest.mark.parametrize("num_splits", [2, 3, 8])  # 8 > tiles of the short rows: empty splits
def test_split_kv_matches_reference(num_splits):
    case = make_mla_case([1, 1, 1], [2, 37, 70], device=DEVICE, seed=2)
    assert_matches_ref(case, force_num_splits=num_splits)


def test_multi_token_decode_rows_are_causal():
    """decode_query_len=3: a 3-token request (draft verification) is 3 kernel rows, each seeing its prefix."""
    case = make_mla_case([3, 1, 5], [11, 6, 9], device=DEVICE, seed=4)
    assert_matches_ref(case, decode_query_len=3)


def test_power_of_two_latent():
    case = make_mla_case([1, 2], [9, 7], kv_lora_rank=32, block_size=8, device=DEVICE, seed=6)
    assert_matches_ref(case, decode_query_len=2, force_num_splits=2)


def test_merge_splits_is_a_softmax_over_the_union():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 10, generator=g)  # natural-log scores of 10 keys
    v = torch.randn(10, 5, generator=g)
    parts = [(0, 4), (4, 7), (7, 10)]
    part_out = torch.stack([torch.softmax(s[..., a:b], -1) @ v[a:b] for a, b in parts], 2)
    part_lse = torch.stack([torch.logsumexp(s[..., a:b], -1) for a, b in parts], 2) / math.log(2)  # base 2
    full = torch.softmax(s, -1) @ v
    torch.testing.assert_close(merge_splits(part_out, part_lse), full, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_deepseek_shapes_bf16_on_gpu(num_splits):
    """128 heads, latent 512 + rope 64, pages of 16, long and short contexts, bf16."""
    case = make_mla_case([1] * 6, [1, 15, 16, 17, 900, 3000], num_heads=128, kv_lora_rank=512, rope_dim=64,
                         block_size=16, dtype=torch.bfloat16, device="cuda")  # fmt: skip
    assert_matches_ref(case, force_num_splits=num_splits)


def test_split_count_follows_the_grid_fill():
    """Few rows with long contexts split the keys; rows x head blocks that fill the (16 stand-in) SMs do not."""
    from attention_zoo.mla_triton import MLATritonBackend

    long = MLATritonBackend.build_metadata(make_mla_case([1], [1024], block_size=64).common)
    assert long.num_splits(128) > 1 and long.num_splits(128) == long._splits[128]
    many = MLATritonBackend.build_metadata(make_mla_case([1] * 8, [1024] * 8, block_size=64).common)
    assert many.num_splits(128) == 1
    mixed = MLATritonBackend.build_metadata(make_mla_case([5, 1], [1024, 9], block_size=64).common)
    assert mixed.num_decode_tokens == 1 and mixed.max_decode_kv_len == 9 and mixed.num_splits(128) == 1
