"""The `mla_triton` backend matches `mla_torch_ref`: the latent write, the absorbed decode kernel, split-KV,
and its CUDA-graph metadata (one recording serving steps of fewer requests, other lengths, padding).

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set below before anything
imports Triton) at tiny fp32/fp16 shapes, and a graph is stood in for by re-running the forward over the
same buffers (`eager_capture`); `@pytest.mark.gpu` tests run DeepSeek shapes in bf16 and the real graphs.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attention_zoo import CommonAttentionMetadata, get_backend  # noqa: E402
from attention_zoo.mla import write_latent as ref_write_latent  # noqa: E402
from attention_zoo.triton_kernels.mla_decode import merge_splits, write_latent  # noqa: E402
from research_lm.worker.cuda_graphs import eager_capture  # noqa: E402
from tests.attention_zoo.test_mla import MIXED, MLACase, dense_oracle, make_mla_case, run_mla_backend  # noqa: E402

ON_CPU = not torch.cuda.is_available()
DEVICE = "cpu" if ON_CPU else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True, scope="module")
def _interpreter_or_cuda():
    if ON_CPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("no CUDA and TRITON_INTERPRET is not 1: Triton kernels cannot run here")


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


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


def test_merge_splits_gives_zero_for_rows_without_keys():
    """A padding row (0 keys) has every split empty (lse -inf): it merges to 0, not NaN, beside a real row."""
    part_out = torch.zeros(2, 1, 3, 4)
    part_out[0, 0, 1] = 2.0
    part_lse = torch.full((2, 1, 3), float("-inf"))
    part_lse[0, 0, 1] = 5.0
    merged = merge_splits(part_out, part_lse)
    assert merged[0].eq(2.0).all() and merged[1].eq(0.0).all()


# ---- CUDA-graph metadata --------------------------------------------------------------------------


class GraphBuffers:
    """What a runner keeps for one graph of b requests x q tokens: step buffers, the layer's inputs and its
    cache, allocated once. `record` is the padded record the graph captures over; its host mirrors keep the
    capture's values (never refreshed), so a forward that read them would go wrong."""

    def __init__(self, b: int, q: int, cases: list[MLACase], max_seq_len: int):
        """Sized for every step of `cases` (their shapes but the batch agree)."""
        t, case = b * q, cases[0]
        max_blocks = max(c.common.block_table.shape[1] for c in cases)
        num_blocks = max(c.kv_cache.shape[0] for c in cases)
        g = torch.Generator().manual_seed(99)
        garbage = lambda *shape: (torch.randn(*shape, generator=g) * 50).to(case.q.dtype).to(DEVICE)  # noqa: E731
        self.q = garbage(t, *case.q.shape[1:])  # padding rows: finite garbage
        self.kv_c, self.k_pe = garbage(t, case.kv_c.shape[-1]), garbage(t, case.k_pe.shape[-1])
        self.kv_cache = garbage(num_blocks, *case.kv_cache.shape[1:])
        # the capture: b requests of q tokens at positions 0 .. q-1 of the null block 0, writing no KV
        qsl = torch.arange(0, t + 1, q, dtype=torch.int32)
        seq_lens = torch.full((b,), q, dtype=torch.int32)
        self.record = CommonAttentionMetadata(
            query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(DEVICE),
            seq_lens_cpu=seq_lens, num_computed_tokens_cpu=torch.zeros(b, dtype=torch.int32),
            block_table=torch.zeros(b, max_blocks, dtype=torch.int32, device=DEVICE),
            slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=DEVICE),
            request_rows=torch.zeros(b, dtype=torch.int32, device=DEVICE),
            num_reqs=b, num_tokens=t, max_query_len=q, max_seq_len=max_seq_len, block_size=case.kv_cache.shape[1],
        )  # fmt: skip

    def load(self, case: MLACase) -> None:
        """Write a step of n <= b requests and T <= b * q tokens into the buffers, in place, padded as the
        runner pads (query length 0, seq_len 0, request row -1, slot -1); its cache into the cache's prefix."""
        c, r = case.common, self.record
        n, t = c.num_reqs, case.num_real_tokens
        r.query_start_loc[: n + 1] = c.query_start_loc
        r.query_start_loc[n + 1 :] = t
        r.seq_lens.zero_()[:n] = c.seq_lens
        r.block_table.zero_()[:n, : c.block_table.shape[1]] = c.block_table
        r.slot_mapping.fill_(-1)[:t] = c.slot_mapping[:t]
        r.request_rows.fill_(-1)[:n] = c.request_rows
        for buf, x in ((self.q, case.q), (self.kv_c, case.kv_c), (self.k_pe, case.k_pe)):
            buf[:t] = x[:t]
        self.kv_cache[: case.kv_cache.shape[0]] = case.kv_cache


def replay_steps(b: int, q: int, steps: list[tuple[list[int], list[int]]], max_seq_len: int = 64, *,
                 capture=eager_capture, case_kwargs: dict | None = None, **build_kwargs):  # fmt: skip
    """Capture the forward of a (b, q) graph, then replay it for each step (query lens, seq lens): the graph's
    metadata and, per step, (the graph's output [b * q, H, V], the cache after it, the step's case)."""
    cases = [make_mla_case(*step, device=DEVICE, seed=10 + i, **(case_kwargs or {})) for i, step in enumerate(steps)]
    bufs = GraphBuffers(b, q, cases, max_seq_len)
    backend = get_backend("mla_triton")
    meta = backend.build_graph_metadata(bufs.record, **build_kwargs)
    impl = backend.make_impl(cases[0].spec)
    kv_b = cases[0].kv_b_weight  # the weights: the same tensor for every step, as a model's are
    replay = capture(lambda: impl.forward(bufs.q, bufs.kv_c, bufs.k_pe, kv_b, bufs.kv_cache, meta), None)
    replay()  # the stand-in's capture (a real graph: one more replay over the capture's inputs)
    outs = []
    for case in cases:
        case.kv_b_weight = kv_b
        bufs.load(case)
        backend.prepare_replay(meta, case.common)
        outs.append((replay().clone(), bufs.kv_cache[: case.kv_cache.shape[0]].clone(), case))
    return meta, outs


GRAPH_CASES = {
    # (b, q): steps of fewer requests (padding rows) and other lengths than the capture's
    "decode": (4, 1, [([1, 1, 1], [5, 17, 9]), ([1, 1], [30, 2]), ([1] * 4, [1, 4, 12, 8])]),
    # verify steps: queries of 1 .. 4 tokens (an idle request too), padding tokens and a padding request
    "verify": (4, 4, [([3, 0, 4], [10, 6, 7]), ([2, 1], [9, 1]), ([4, 4, 4, 4], [4, 9, 13, 20])]),
    # batch-1 prefill graph: a fresh prompt, a chunk after cached context
    "prefill": (1, 16, [([11], [11]), ([9], [20]), ([16], [16])]),
}


@pytest.mark.parametrize("name", list(GRAPH_CASES))
@pytest.mark.parametrize("num_splits", [None, 3])  # 3: split-KV, where padding rows' empty splits are merged too
def test_graph_metadata_serves_smaller_steps_of_other_lengths(name, num_splits):
    """One recording (the metadata of the graph's padded shape, re-run over the same buffers) equals the reference
    backend on every step's real rows, with nothing refreshed between steps; padding rows come out 0."""
    b, q, steps = GRAPH_CASES[name]
    for out, cache, case in replay_steps(b, q, steps, force_num_splits=num_splits)[1]:
        ref_out, ref_cache = run_mla_backend("mla_torch_ref", case)  # prompts: the naive (unabsorbed) path
        t = case.num_real_tokens
        torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
        torch.testing.assert_close(out[:t], ref_out[:t], atol=1e-5, rtol=1e-5)
        assert out[t:].eq(0).all()


def test_graph_plan_is_fixed_at_capture_from_max_model_len():
    """B = 1 under a long max_model_len splits the keys (more than the stand-in's 16 SMs would fill); each split
    takes at least MIN_TOKENS_PER_SPLIT keys, so a short context uses one split and a 300-key one two, both exact.
    The plan does not move with the step."""
    meta, results = replay_steps(1, 1, [([1], [7]), ([1], [300])], max_seq_len=4096)
    plan = meta.plan
    assert plan.num_splits(4) == 16 and plan._splits == {4: 16} and plan.min_split_tokens == 256
    for out, _, case in results:
        ref_out, _ = run_mla_backend("mla_torch_ref", case)
        torch.testing.assert_close(out[:1], ref_out[:1], atol=1e-5, rtol=1e-5)


def test_graph_capabilities():
    caps = get_backend("mla_triton").capabilities
    assert caps.cuda_graphs and caps.cuda_graphs_multi_token and not caps.graphs_plan_on_host


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_deepseek_shapes_bf16_on_gpu(num_splits):
    """128 heads, latent 512 + rope 64, pages of 16, long and short contexts, bf16."""
    _needs_cuda()
    case = make_mla_case([1] * 6, [1, 15, 16, 17, 900, 3000], num_heads=128, kv_lora_rank=512, rope_dim=64,
                         block_size=16, dtype=torch.bfloat16, device="cuda")  # fmt: skip
    assert_matches_ref(case, force_num_splits=num_splits)


def test_split_count_follows_the_grid_fill():
    """Few rows with long contexts split the keys; rows x head blocks that fill the (16 stand-in) SMs do not."""
    from attention_zoo.mla_triton import MLATritonBackend

    long = MLATritonBackend.build_metadata(make_mla_case([1], [1024], block_size=64).common).plan
    assert long.num_splits(128) > 1 and long.num_splits(128) == long._splits[128]
    many = MLATritonBackend.build_metadata(make_mla_case([1] * 8, [1024] * 8, block_size=64).common).plan
    assert many.num_splits(128) == 1
    mixed = MLATritonBackend.build_metadata(make_mla_case([5, 1], [1024, 9], block_size=64).common)
    assert mixed.num_decode_tokens == 1 and mixed.max_decode_kv_len == 9 and mixed.plan.num_splits(128) == 1


# ---- graphs through the engine: a tiny DeepSeek-V2 (every layer MLA, dense MLPs) ------------------

ENGINE_KNOBS = dict(dtype="float32", mla_backend="mla_triton", block_size=4, max_num_seqs=4, num_gpu_blocks=24,
                    max_model_len=48, enable_prefix_caching=False)  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
cpu_only = pytest.mark.skipif(not ON_CPU, reason="the Triton interpreter variant; the GPU tests cover CUDA")


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _greedy(max_tokens: list[int]):
    from research_lm import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]


def _recording_replays(llm) -> list[tuple[int, int]]:
    """The (B, q) of every replay from now on."""
    graphs, keys = llm.engine.runner.cuda_graphs, []
    replay = graphs.replay
    graphs.replay = lambda key, common: keys.append(key) or replay(key, common)
    return keys


@cpu_only
def test_engine_graphs_match_eager_on_cpu(tiny_checkpoint):
    """The runner's capture with the re-run stand-in: prompts one at a time replay the (1, 8) and (1, 16) prefill
    graphs (a 30-token prompt runs eagerly), then a batch of three decodes padded to four; the greedy tokens are
    the eager ones (whose prompts take the naive path: the graphs' absorbed rows compute the same attention)."""
    from research_lm import LLM

    path, knobs = str(tiny_checkpoint("deepseek-v2")), dict(ENGINE_KNOBS, device="cpu", max_num_batched_tokens=32)
    eager, llm = LLM(path, **knobs), LLM(path, **knobs)
    assert llm.engine.runner.capture_cuda_graphs([1, 2, 4], prefill_sizes=[8, 16], capture=eager_capture) is None
    assert llm.engine.runner.cuda_graphs.prefill == [8, 16]
    keys = _recording_replays(llm)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(eager.engine.info.vocab_size, (n,), generator=g).tolist() for n in (5, 13, 30)]
    for prompt, params in zip(prompts, _greedy([4, 3, 3])):
        assert _tokens(llm, [prompt], [params]) == _tokens(eager, [prompt], [params])
    # 5 tokens: graph (1, 8), 3 decodes; 13: graph (1, 16), 2 decodes; 30: an eager prefill, 2 decodes
    assert keys == [(1, 8)] + [(1, 1)] * 3 + [(1, 16)] + [(1, 1)] * 4
    keys.clear()
    prompts, params = [p[:n] for p, n in zip(prompts, (5, 9, 3))], _greedy([6, 4, 2])
    assert _tokens(llm, prompts, params) == _tokens(eager, prompts, params)
    assert keys == [(4, 1), (2, 1), (2, 1), (1, 1), (1, 1)]  # after the (eager) prefill of all three


@cpu_only
def test_engine_verify_graphs_match_eager_on_cpu(tiny_checkpoint):
    """ngram drafts (k = 3): verify steps (queries of 2 .. 4 tokens, three requests padded to four) replay the
    query-length-4 graphs and give the eager speculative run's tokens, which are plain greedy decoding's."""
    from research_lm import LLM

    path, knobs = str(tiny_checkpoint("deepseek-v2")), dict(ENGINE_KNOBS, device="cpu", max_num_batched_tokens=32)
    eager, llm = (LLM(path, speculative_config=NGRAM, **knobs) for _ in range(2))
    assert llm.engine.runner.capture_cuda_graphs([1, 2, 4], prefill_sizes=[], capture=eager_capture) is None
    assert llm.engine.runner.cuda_graphs.sizes == {1: [1, 2, 4], 4: [1, 2, 4]}
    keys = _recording_replays(llm)
    prompts, params = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5], [7, 8, 9, 7, 8]], _greedy([9, 7, 5])
    got = _tokens(llm, prompts, params)
    assert got == _tokens(eager, prompts, params) == _tokens(LLM(path, **knobs), prompts, params)
    assert (4, 4) in keys


GPU_KNOBS = dict(ENGINE_KNOBS, device="cuda", max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks=64,
                 cuda_graph_sizes=[1, 2, 4])  # fmt: skip


@pytest.mark.gpu
def test_engine_decode_graphs_match_eager_on_gpu(tiny_checkpoint):
    """fp32, the real graphs: three requests of different lengths, so decode steps replay 4 (padded), 2 and 1;
    the greedy tokens equal eager's exactly, and every decode step is a replay."""
    from research_lm import LLM

    _needs_cuda()
    path = str(tiny_checkpoint("deepseek-v2"))
    eager = LLM(path, cuda_graphs=False, **GPU_KNOBS)
    llm = LLM(path, cuda_graphs=True, **GPU_KNOBS)
    assert llm.engine.runner.cuda_graphs is not None and llm.engine.runner.cuda_graphs.sizes == {1: [1, 2, 4]}
    keys = _recording_replays(llm)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(eager.engine.info.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3)]
    params = _greedy([8, 5, 3])
    assert _tokens(llm, prompts, params) == _tokens(eager, prompts, params)
    # the first token of each comes from the eager prefill of all three; then 2 steps at 3 (padded to 4), 2 at 2,
    # 3 at 1
    assert sorted(keys) == [(1, 1)] * 3 + [(2, 1)] * 2 + [(4, 1)] * 2


@pytest.mark.gpu
def test_engine_prefill_and_verify_graphs_match_eager_on_gpu(tiny_checkpoint):
    """fp32, the real graphs: prompts one at a time replay the batch-1 prefill graphs (16, 32; 40 tokens: 64), and
    ngram verify steps replay the query-length-4 graphs; the greedy tokens are the eager ones."""
    from research_lm import LLM

    _needs_cuda()
    path = str(tiny_checkpoint("deepseek-v2"))
    eager, llm = LLM(path, cuda_graphs=False, **GPU_KNOBS), LLM(path, cuda_graphs=True, **GPU_KNOBS)
    assert llm.engine.runner.cuda_graphs.prefill == [16, 32, 64]
    keys = _recording_replays(llm)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(eager.engine.info.vocab_size, (n,), generator=g).tolist() for n in (5, 20, 40)]
    for prompt, params in zip(prompts, _greedy([4, 3, 3])):
        assert _tokens(llm, [prompt], [params]) == _tokens(eager, [prompt], [params])
    assert [k for k in keys if k[1] > 1] == [(1, 16), (1, 32), (1, 64)]
    eager = LLM(path, cuda_graphs=False, speculative_config=NGRAM, **GPU_KNOBS)
    llm = LLM(path, cuda_graphs=True, speculative_config=NGRAM, **GPU_KNOBS)
    assert llm.engine.runner.cuda_graphs.sizes == {1: [1, 2, 4], 4: [1, 2, 4]}
    keys = _recording_replays(llm)
    prompts, params = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5], [7, 8, 9, 7, 8]], _greedy([12, 9, 6])
    assert _tokens(llm, prompts, params) == _tokens(eager, prompts, params)
    assert (4, 4) in keys


GPU_GRAPH_CASES = {  # DeepSeek shapes, contexts long enough for the split-KV plan fixed at max_model_len 4096
    "decode": (4, 1, [([1, 1, 1], [700, 17, 1500]), ([1, 1], [3000, 2]), ([1] * 4, [1, 260, 999, 64])]),
    "verify": (4, 4, [([3, 0, 4], [900, 6, 2000]), ([2, 1], [17, 1]), ([4] * 4, [4, 300, 1300, 20])]),
    "prefill": (1, 64, [([50], [50]), ([64], [1200])]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_GRAPH_CASES))
def test_real_graph_replays_deepseek_shapes_bf16_on_gpu(name):
    """`cuda_graph_capture` records the forward once (128 heads, latent 512 + rope 64, pages of 16, bf16, the split
    count of max_model_len 4096); replays for steps of fewer requests and other lengths match the reference."""
    from research_lm.worker.cuda_graphs import cuda_graph_capture

    _needs_cuda()
    b, q, steps = GPU_GRAPH_CASES[name]
    case_kwargs = dict(num_heads=128, kv_lora_rank=512, rope_dim=64, block_size=16, dtype=torch.bfloat16)
    meta, results = replay_steps(b, q, steps, max_seq_len=4096, capture=cuda_graph_capture, case_kwargs=case_kwargs)
    if name == "decode":
        assert meta.plan.num_splits(128) > 1  # 4 rows x 8 head blocks underfill the GPU
    for out, cache, case in results:
        # the reference's absorbed path (fp32 from bf16 inputs): bf16 error only, not that of two associations
        ref_out, ref_cache = run_mla_backend("mla_torch_ref", case, decode_query_len=q)
        t = case.num_real_tokens
        torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
        torch.testing.assert_close(out[:t].float(), ref_out[:t].float(), atol=2e-2, rtol=2e-2)
        assert out[t:].eq(0).all()
