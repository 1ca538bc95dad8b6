"""The `triton` backend matches `torch_ref` on the same paged cache: KV write, the unified kernel, split-KV.

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set below before anything
imports Triton), at tiny shapes: it is slow and garbles bf16 arithmetic, so the kernels upcast to
fp32 there. `@pytest.mark.gpu` tests run real shapes in bf16 on the device machine.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attention_zoo import registry  # noqa: E402
from attention_zoo.torch_ref import write_kv  # noqa: E402
from attention_zoo.triton_attn import TritonAttentionBackend, choose_num_splits  # noqa: E402
from attention_zoo.triton_kernels import TileConfig, reshape_and_cache  # noqa: E402
from tests.attention_zoo.paged_cases import make_case as _make_case  # noqa: E402
from tests.attention_zoo.paged_cases import run_backend  # noqa: E402

ON_CPU = not torch.cuda.is_available()
DEVICE = "cpu" if ON_CPU else "cuda"
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
gpu = pytest.mark.gpu


def make_case(*args, **kwargs):
    """The shared case builder, on the GPU when there is one (the tiny cases then run compiled)."""
    return _make_case(*args, **({"device": DEVICE} | kwargs))


@pytest.fixture(autouse=True, scope="module")
def _interpreter_or_cuda():
    if ON_CPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("no CUDA and TRITON_INTERPRET is not 1: Triton kernels cannot run here")


def assert_matches_ref(case, atol=None, **build_kwargs):
    """Triton's output and cache equal torch_ref's on every real token."""
    ref_out, ref_cache = run_backend("torch_ref", case)
    out, cache = run_backend("triton", case, **build_kwargs)
    n = case.num_real_tokens
    atol = TOL[case.q.dtype] if atol is None else atol
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out[:n].float(), ref_out[:n].float(), atol=atol, rtol=atol)
    return out


# ---------------------------------------------------------------- KV write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_write_matches_reference_and_skips_padding(dtype):
    case = make_case([3, 1, 6], [3, 9, 17], num_heads=4, num_kv_heads=3, head_size=24, block_size=4,
                     dtype=dtype, pad_tokens=2)  # fmt: skip
    # non-contiguous rows: a slice of a wider tensor
    k_wide = torch.randn(case.k.shape[0], 3, 40, device=case.k.device).to(dtype)
    k_wide[..., :24] = case.k
    k = k_wide[..., :24]
    ref, ours = case.kv_cache.clone(), case.kv_cache.clone()
    write_kv(ref, k, case.v, case.common.slot_mapping)
    reshape_and_cache(k, case.v, ours, case.common.slot_mapping)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)


def test_kv_write_casts_to_cache_dtype():
    case = make_case([2], [2], num_heads=2, num_kv_heads=2, head_size=16, block_size=4, dtype=torch.float32)
    ref, ours = case.kv_cache.half(), case.kv_cache.half()
    write_kv(ref, case.k, case.v, case.common.slot_mapping)
    reshape_and_cache(case.k, case.v, ours, case.common.slot_mapping)
    torch.testing.assert_close(ours, ref, atol=0, rtol=0)


# ---------------------------------------------------------------- unified kernel

BS = 16  # page size of most cases; the interpreter's key tile is 16 too


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_block_boundaries(phase):
    """Context lengths 1, block_size - 1, block_size, block_size + 1, in one batch."""
    seq_lens = [1, BS - 1, BS, BS + 1]
    query_lens = [1] * 4 if phase == "decode" else seq_lens
    case = make_case(query_lens, seq_lens, num_heads=4, num_kv_heads=1, head_size=64, block_size=BS,
                     dtype=torch.float32)  # fmt: skip
    assert_matches_ref(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch_with_chunked_prefill_and_padding(dtype):
    """Decodes, a chunk after cached context, a fresh prefill and an empty request share one launch."""
    case = make_case([1, 7, 1, 19, 0], [30, 27, 5, 19, 4], num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=BS, dtype=dtype, pad_tokens=3)  # fmt: skip
    assert_matches_ref(case)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_ratios(group):
    case = make_case([1, 9, 2], [12, 21, 34], num_heads=2 * group, num_kv_heads=2, head_size=64,
                     block_size=BS, dtype=torch.float32, seed=group)  # fmt: skip
    assert_matches_ref(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_size_128(dtype):
    case = make_case([1, 6], [23, 6], num_heads=8, num_kv_heads=2, head_size=128, block_size=BS, dtype=dtype)
    assert_matches_ref(case)


@pytest.mark.parametrize("head_size", [16, 80])  # the tiny test models' 16; 80 is not a power of 2
def test_small_and_odd_head_sizes(head_size):
    case = make_case([1, 5], [9, 13], num_heads=6, num_kv_heads=2, head_size=head_size, block_size=BS,
                     dtype=torch.float32)  # fmt: skip
    assert_matches_ref(case)


@pytest.mark.parametrize(
    ("tile", "block_size"),
    [
        (TileConfig(block_q=3, tile_n=32), 4),  # 12 of 16 rows used; a key tile spans 8 pages
        (TileConfig(block_q=1, tile_n=16), 32),  # one token per program in a prefill; 2 tiles per page
    ],
)
def test_tile_shapes(tile, block_size):
    case = make_case([1, 8, 5], [40, 8, 29], num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=block_size, dtype=torch.float32)  # fmt: skip
    assert_matches_ref(case, force_tile=tile)


@pytest.mark.parametrize("window", [1, BS - 1, BS, BS + 1])
def test_sliding_window_boundaries(window):
    case = make_case([1, 1, 20, 6], [BS + 1, 3 * BS + 2, 20, 2 * BS + 5], num_heads=4, num_kv_heads=2,
                     head_size=64, block_size=BS, dtype=torch.float32, sliding_window=window)  # fmt: skip
    assert_matches_ref(case)


def test_sliding_window_never_reads_pages_outside_the_window():
    """Pages wholly outside every query's window may be freed (null block, stale data): poison them."""
    window, seq_len = 5, 4 * BS + 3
    case = make_case([1, 2], [seq_len, seq_len], num_heads=4, num_kv_heads=2, head_size=64, block_size=BS,
                     dtype=torch.float16, sliding_window=window)  # fmt: skip
    ref_out, _ = run_backend("torch_ref", case)
    first_needed_page = (seq_len - 2 - window + 1) // BS
    poisoned = case.kv_cache.clone()
    for r in range(2):
        stale = case.common.block_table[r, :first_needed_page].long()
        poisoned[:, stale] = float("nan")
    case.common.block_table[1, :first_needed_page] = 0  # freed: points at the null block
    poisoned[:, 0] = float("nan")
    out, _ = run_backend("triton", case, kv_cache=poisoned)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-3, rtol=2e-3)


def test_bf16_under_the_interpreter_or_gpu():
    case = make_case([1, 4], [18, 4], num_heads=4, num_kv_heads=2, head_size=64, block_size=BS,
                     dtype=torch.bfloat16, sliding_window=7)  # fmt: skip
    assert_matches_ref(case)


# ---------------------------------------------------------------- split-KV (flash-decoding)


@pytest.mark.parametrize("num_splits", [2, 8])
def test_split_kv_decode(num_splits):
    """Splits cover context lengths shorter than one tile per split (empty splits) and longer."""
    case = make_case([1] * 4, [1, BS, BS + 1, 5 * BS - 3], num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=BS, dtype=torch.float32, pad_tokens=1)  # fmt: skip
    assert_matches_ref(case, force_num_splits=num_splits)


@pytest.mark.parametrize("min_split_tokens", [2 * BS, 10 * BS])
def test_split_kv_with_a_minimum_split_size(min_split_tokens):
    """A plan of many splits (a graph's, fixed for the longest context) on short contexts: each split takes at
    least min_split_tokens keys, the splits past the context stay empty, and the result is the reference's."""
    from attention_zoo.triton_kernels.unified_attention import unified_attention

    case = make_case([1] * 4, [1, BS, 3 * BS + 1, 7 * BS - 3], num_heads=8, num_kv_heads=2, head_size=64,
                     block_size=BS, dtype=torch.float32, pad_tokens=1)  # fmt: skip
    ref_out, _ = run_backend("torch_ref", case)
    kv = case.kv_cache.clone()
    reshape_and_cache(case.k, case.v, kv, case.common.slot_mapping)
    c = case.common
    out = unified_attention(case.q, kv, torch.empty_like(case.q), c.query_start_loc, c.seq_lens, c.block_table,
                            num_reqs=c.num_reqs, scale=case.spec.scale, sliding_window=None,
                            config=TileConfig(block_q=1, tile_n=BS), num_splits=8, min_split_tokens=min_split_tokens,
                            upcast=True)  # fmt: skip
    n = case.num_real_tokens
    torch.testing.assert_close(out[:n], ref_out[:n], atol=2e-4, rtol=2e-4)


def test_split_kv_with_window_and_mixed_batch():
    case = make_case([1, 6, 1], [4 * BS, 3 * BS, 17], num_heads=8, num_kv_heads=1, head_size=64,
                     block_size=BS, dtype=torch.float16, sliding_window=BS + 3)  # fmt: skip
    assert_matches_ref(case, force_num_splits=3)


def test_split_heuristic():
    sms = 132
    assert choose_num_splits(1, 8, 32768, True, sms) == 64
    assert choose_num_splits(4, 8, 8192, True, sms) == 16  # 32 programs: ~4 per SM
    assert choose_num_splits(32, 8, 8192, True, sms) == 2
    assert choose_num_splits(1, 8, 400, True, sms) == 1  # too short to split
    assert choose_num_splits(64, 8, 32768, True, sms) == 1  # enough programs already
    assert choose_num_splits(1, 8, 32768, False, sms) == 1  # prefill or mixed batch


# ---------------------------------------------------------------- the backend as the runner sees it


def test_backend_is_registered_with_capabilities():
    device = torch.device("cpu" if ON_CPU else "cuda")
    case = make_case([1], [1], num_heads=4, num_kv_heads=2, head_size=64, block_size=BS, dtype=torch.float16,
                     sliding_window=8)  # fmt: skip
    assert registry.select_backend("triton", case.spec, device, torch.bfloat16) is TritonAttentionBackend
    assert TritonAttentionBackend.capabilities.cuda_graphs
    assert TritonAttentionBackend.kv_cache_shape(10, BS, case.spec) == (2, 10, BS, 2, 64)


def test_plan_is_made_once_per_step_and_layer_shape():
    case = make_case([1, 1], [700, 900], num_heads=4, num_kv_heads=2, head_size=64, block_size=BS,
                     dtype=torch.float16)  # fmt: skip
    metadata = TritonAttentionBackend.build_metadata(case.common)
    plan = metadata.plan(case.spec)
    assert metadata.plan(case.spec) is plan and len(metadata._plans) == 1
    assert plan.tile.block_q == 1


# ---------------------------------------------------------------- GPU: real shapes, bf16

REAL = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16, device="cuda")
needs_cuda = pytest.mark.skipif(ON_CPU, reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_gpu_decode_real_shapes(num_splits):
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1, 4096, (48,), generator=gen).tolist() + [1, 15, 16, 17, 8191]
    case = make_case([1] * len(seq_lens), seq_lens, **REAL)
    assert_matches_ref(case, force_num_splits=num_splits)


@gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 1024])
def test_gpu_mixed_batch_real_shapes(window):
    query_lens = [1] * 20 + [512, 1000, 37]
    seq_lens = [300 + 97 * i for i in range(20)] + [512, 3000, 2085]
    case = make_case(query_lens, seq_lens, sliding_window=window, pad_tokens=5, **REAL)
    assert_matches_ref(case)


@gpu
@needs_cuda
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_gpu_matches_sdpa_on_dense_cache(phase):
    """Contiguous pages, so the cache is a dense [seq, kv_heads, d] per request: compare with SDPA."""
    batch, seq_len = 4, 1536
    q_len = 1 if phase == "decode" else seq_len
    case = make_case([q_len] * batch, [seq_len] * batch, **REAL)
    pages = seq_len // 16
    case.common.block_table[:, :pages] = (torch.arange(batch * pages, device="cuda").view(batch, pages) + 1).int()
    bt = case.common.block_table.long()
    pos = torch.arange(seq_len - q_len, seq_len, device="cuda")
    case.common.slot_mapping.copy_((bt.gather(1, (pos // 16)[None].expand(batch, -1)) * 16 + pos % 16).flatten())
    out, cache = run_backend("triton", case)
    k = cache[0, 1 : 1 + batch * pages].reshape(batch, seq_len, 8, 128).transpose(1, 2)
    v = cache[1, 1 : 1 + batch * pages].reshape(batch, seq_len, 8, 128).transpose(1, 2)
    q = case.q.view(batch, q_len, 32, 128).transpose(1, 2)
    mask = torch.arange(seq_len, device="cuda")[None, :] <= pos[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.view(batch, q_len, 32, 128), ref.transpose(1, 2), atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay_follows_new_lengths():
    """Captured once (split-KV path); replays after the step's tensors change in place match torch_ref."""
    case = make_case([1] * 8, [3000] * 8, **REAL)
    impl = TritonAttentionBackend.make_impl(case.spec)
    metadata = TritonAttentionBackend.build_metadata(case.common)
    assert metadata.plan(case.spec).num_splits > 1
    cache = case.kv_cache.clone()
    impl.forward(case.q, case.k, case.v, cache, metadata)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(case.q, case.k, case.v, cache, metadata)
    c = case.common
    for step in range(2):
        lens = torch.tensor([1 + 397 * i + 5 * step for i in range(8)], dtype=torch.int32)
        pos = (lens - 1).long().cuda()
        c.seq_lens.copy_(lens), c.seq_lens_cpu.copy_(lens)
        c.slot_mapping.copy_(c.block_table.long().gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16)
        for t in (case.q, case.k, case.v):
            t.normal_()
        graph.replay()
        ref_out, _ = run_backend("torch_ref", case, kv_cache=cache)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
