"""The `mamba_triton` kernels match `mamba_torch_ref`: outputs and every state slot after the step, eagerly and
over the metadata a CUDA graph records (padded batches replayed over the same buffers).

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set below before anything
imports Triton) at tiny fp32 shapes, and the engine's graphs are stood in for by re-runs (`eager_capture`);
`@pytest.mark.gpu` tests run bigger shapes in bf16, and the engine's real graphs, on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attention_zoo.registry import get_backend  # noqa: E402
from research_lm.worker.buffers import StepBuffers  # noqa: E402
from research_lm.worker.cuda_graphs import eager_capture, graph_metadata, pad_step_inputs  # noqa: E402
from tests.attention_zoo.mamba_cases import make_mamba_case, run_mamba_backend  # noqa: E402

ON_CPU = not torch.cuda.is_available()
DEVICE = "cpu" if ON_CPU else "cuda"
gpu = pytest.mark.gpu


def _needs_cuda():
    if ON_CPU:
        pytest.skip("needs CUDA")


@pytest.fixture(autouse=True, scope="module")
def _interpreter_or_cuda():
    if ON_CPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("no CUDA and TRITON_INTERPRET is not 1: Triton kernels cannot run here")


def assert_matches_ref(case, atol=1e-4):
    ref_y, ref_cache = run_mamba_backend("mamba_torch_ref", case)
    y, cache = run_mamba_backend("mamba_triton", case)
    n = case.num_real_tokens
    torch.testing.assert_close(y[:n].float(), ref_y[:n].float(), atol=atol, rtol=atol)
    torch.testing.assert_close(cache[0].float(), ref_cache[0].float(), atol=atol, rtol=0)  # conv states
    torch.testing.assert_close(cache[1].float(), ref_cache[1].float(), atol=atol, rtol=atol)  # ssm states


def test_mixed_batch_prefills_and_decodes_new_and_continuing():
    """Prefill chunks crossing the kernel's 16-token chunk (new and continuing), decodes (continuing and
    a 1-token prompt), an empty chunk, scattered slots over noise-filled state, padded rows."""
    case = make_mamba_case(
        [19, 1, 6, 1, 0, 3], [False, True, True, False, True, True], [3, 0, 5, 2, 1, 6], pad_tokens=2,
        device=DEVICE,
    )
    assert_matches_ref(case)


def test_pure_decode_batch():
    assert_matches_ref(make_mamba_case([1, 1, 1], [True, True, True], [7, 2, 4], seed=1, device=DEVICE))


def test_short_prefills_shorter_than_the_conv():
    """Chunks of 2 tokens: the conv reads and the state keeps inputs from before the chunk."""
    assert_matches_ref(make_mamba_case([2, 2, 3], [True, False, True], [0, 1, 2], seed=2, device=DEVICE))


def test_groups_limits_and_no_conv_bias():
    """1 group over 4 heads, head_dim 8 and state 8 (padded to the dot's 16), dt clamped, no conv bias."""
    case = make_mamba_case(
        [5, 1, 17], [True, True, False], [1, 0, 3], n_groups=1, head_dim=8, state_size=8, conv_bias=False,
        time_step_limit=(0.1, 0.8), seed=3, device=DEVICE,
    )
    assert_matches_ref(case)


# ---- CUDA graphs: the metadata a graph records, refreshed per replay ----------------------------------------


class GraphRecord:
    """A graph of B requests x q tokens over persistent step buffers, as `DecodeGraphs` records and replays it
    (research_lm/worker/cuda_graphs.py): the capture's padded shape, then each step written into the same buffers,
    padded the runner's way."""

    def __init__(self, b: int, q: int):
        self.b, self.q = b, q
        self.buf = StepBuffers(max_num_tokens=b * q, max_num_reqs=b, max_blocks_per_req=1, device=torch.device(DEVICE))
        buf = self.buf
        pad_step_inputs(buf, 0, 0, b, b * q)  # the capture's batch: b requests of q tokens, slot -1 each
        buf.query_start_loc.np[: b + 1] = range(0, b * q + 1, q)
        buf.seq_lens.np[:b] = q
        self._copy()
        self.backend = get_backend("mamba_triton")
        self.metadata = self.backend.build_graph_metadata(graph_metadata(buf, b, 16, 64, q))

    def _copy(self) -> None:
        buf, b = self.buf, self.b
        for x, rows in ((buf.query_start_loc, b + 1), (buf.seq_lens, b), (buf.num_computed, b),
                        (buf.request_rows, b)):
            x.copy_to_gpu(rows)

    def step(self, common) -> None:
        """Write the step of record `common` (n <= B requests, T <= B * q tokens) into the buffers, padded, and
        refresh the graph's metadata for it (`prepare_replay`)."""
        buf, n, t = self.buf, common.num_reqs, common.num_tokens
        buf.query_start_loc.np[: n + 1] = common.query_start_loc_cpu.numpy()
        buf.seq_lens.np[:n] = common.seq_lens_cpu.numpy()
        buf.num_computed.np[:n] = common.num_computed_tokens_cpu.numpy()
        buf.request_rows.np[:n] = common.request_rows.cpu().numpy()
        pad_step_inputs(buf, n, t, self.b, self.b * self.q)
        self._copy()
        record = replace(graph_metadata(buf, n, 16, 64, self.q), num_tokens=t, max_query_len=common.max_query_len)
        self.backend.prepare_replay(self.metadata, record)


def _replays_match_ref(b: int, q: int, steps: list[tuple[list[int], list[bool], list[int]]]) -> None:
    """Capture a (b, q) graph's metadata, run the capture's batch (every slot -1), then each step (query lens,
    has_initial, slots) over the same metadata: output rows and every state slot equal mamba_torch_ref's eager
    step from the same states; the capture and the padding requests touch no slot."""
    graph = GraphRecord(b, q)
    md = graph.metadata
    addresses = [t.data_ptr() for t in (md.query_start_loc, md.state_slots, md.has_initial_state,
                                        md.decode_req_idx, md.prefill_req_idx)]
    triton_impl = graph.backend.make_impl(make_mamba_case([1], [False], [0], device=DEVICE).spec)
    for i, (query_lens, has_initial, slots) in enumerate([([q] * b, [False] * b, [-1] * b), *steps]):
        # `pad_tokens`: garbage in the graph's padding token rows T .. B * q
        case = make_mamba_case(query_lens, has_initial, slots, seed=10 + i,
                               pad_tokens=b * q - sum(query_lens), device=DEVICE)
        if i == 0:
            cache = tuple(c.clone() for c in case.cache)  # the graph's state slots, kept from step to step
        else:
            graph.step(case.common)
        assert md.has_initial_state.tolist() == has_initial + [False] * (b - len(has_initial))
        before = tuple(c.clone() for c in cache)
        y = triton_impl.forward(case.xbc, case.dt, case.weights, cache, md)
        if i == 0:  # the capture's run: every request has slot -1
            assert all(torch.equal(c, c0) for c, c0 in zip(cache, before))
            continue
        ref_y, ref_cache = run_mamba_backend("mamba_torch_ref", replace(case, cache=before))
        t = case.num_real_tokens
        torch.testing.assert_close(y[:t], ref_y[:t], atol=1e-4, rtol=1e-4)
        for got, want, old in zip(cache, ref_cache, before):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            untouched = [s for s in range(old.shape[0]) if s not in slots]
            assert torch.equal(got[untouched], old[untouched])  # the padding requests wrote nothing
    assert [t.data_ptr() for t in (md.query_start_loc, md.state_slots, md.has_initial_state,
                                   md.decode_req_idx, md.prefill_req_idx)] == addresses


def test_decode_graph_metadata_serves_padded_batches_of_new_and_continuing_requests():
    """A decode graph of 4: steps of 3, 1 and 4 requests (new and continuing) replay its metadata; padding
    requests (query length 0, slot -1) leave every state slot alone."""
    _replays_match_ref(4, 1, [
        ([1, 1, 1], [True, False, True], [5, 0, 2]),
        ([1], [True], [7]),
        ([1, 1, 1, 1], [True, True, False, True], [2, 7, 3, 5]),
    ])


def test_prefill_graph_metadata_serves_shorter_prompts_and_continuing_chunks():
    """A batch-1 prefill graph of 16 tokens: a new 13-token prompt, a 5-token chunk continuing it (the state the
    first left), and a full 16-token chunk: the scan reads each length on the device."""
    _replays_match_ref(1, 16, [([13], [False], [3]), ([5], [True], [3]), ([16], [True], [3])])


def test_multi_token_graph_metadata_skips_padding_requests_in_the_scan():
    """A graph of 2 requests x 4 tokens holding one request of 3: the scan skips the padding request."""
    _replays_match_ref(2, 4, [([3], [True], [6]), ([4, 1], [False, True], [1, 4])])


def test_model_logits_match_the_reference_backend(tiny_checkpoint):
    """Tiny Mamba2 end to end on the Triton mixers: two mixed steps (new and continuing requests)."""
    from research_lm.models import load_model
    from tests.utils import PagedBatch

    path = tiny_checkpoint("mamba2")
    outs = {}
    for backend in ("mamba_torch_ref", "mamba_triton"):
        model, _ = load_model(path, device=DEVICE, dtype=torch.float32, attention_backend="torch_ref",
                              extra={"mamba_backend": backend})
        assert get_backend(backend).name == backend
        batch = PagedBatch(model, [10, 6], block_size=4, slots=[1, 0])
        logits = batch.step([list(range(3, 12)), [40]])  # a prefill and a 1-token prompt, both new
        logits += batch.step([[12], [41, 42, 43, 44, 45]])  # a decode and a prefill chunk, both continuing
        outs[backend] = torch.cat(logits)
    torch.testing.assert_close(outs["mamba_triton"], outs["mamba_torch_ref"], atol=1e-4, rtol=0)


# ---- the engine: greedy tokens with graphs equal eager ----------------------------------------------------------

# Decode graphs of 1, 2, 4 and prefill graphs of 8, 16 tokens; a budget of 16 tokens chunks a 30-token prompt.
ENGINE_KNOBS = dict(dtype="float32", mamba_backend="mamba_triton", attention_backend="triton", block_size=4,
                    max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks=40, max_model_len=64,
                    enable_prefix_caching=False)
# (prompt lengths, max_tokens) per generate call, and the graph each step replays: 3 requests together (their
# prompts in one mixed step: eager), decoding at batch 3 (padded to 4), 2, 2, 1, 1; then one prompt at a time:
# 5 tokens (the graph of 8), 13 (16), 30 (chunks of 16 and 14, the second continuing the first's state), each
# followed by two decodes.
ENGINE_CALLS = [([5, 8, 3], [6, 4, 2]), ([5], [3]), ([13], [3]), ([30], [3])]
ENGINE_KEYS = [(4, 1), (2, 1), (2, 1), (1, 1), (1, 1), (1, 8), (1, 1), (1, 1), (1, 16), (1, 1), (1, 1),
               (1, 16), (1, 16), (1, 1), (1, 1)]


def _generate(llm, record_keys: bool = False) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Greedy tokens of ENGINE_CALLS, and the graph key of every replay."""
    from research_lm import SamplingParams

    keys: list[tuple[int, int]] = []
    if record_keys:
        graphs = llm.engine.runner.cuda_graphs
        replay = graphs.replay
        graphs.replay = lambda key, common: keys.append(key) or replay(key, common)
    g = torch.Generator().manual_seed(4)
    tokens = []
    for lens, max_tokens in ENGINE_CALLS:
        prompts = [torch.randint(llm.engine.info.vocab_size, (n,), generator=g).tolist() for n in lens]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        tokens += [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return tokens, keys


@pytest.mark.skipif(not ON_CPU, reason="the Triton interpreter variant; the GPU test covers CUDA")
@pytest.mark.parametrize("model", ["bamba"])  # (Bamba's Mamba2 layers are mamba2's: 30 s of CI; both on the GPU)
def test_engine_graph_replays_match_eager_on_cpu(tiny_checkpoint, model):
    """Tiny Mamba2 (and Bamba, whose attention layers share the graphs) through the runner's graphs
    (`eager_capture`: re-runs over the same buffers): padded decode batches, prompts shorter than their prefill
    graph, a chunk continuing a prompt; the tokens are the eager ones."""
    from research_lm import LLM

    path = str(tiny_checkpoint(model))
    eager, llm = LLM(path, device="cpu", **ENGINE_KNOBS), LLM(path, device="cpu", **ENGINE_KNOBS)
    runner = llm.engine.runner
    assert runner.capture_cuda_graphs([1, 2, 4], prefill_sizes=[8, 16], capture=eager_capture) is None
    assert runner.cuda_graphs.sizes == {1: [1, 2, 4]} and runner.cuda_graphs.prefill == [8, 16]
    tokens, keys = _generate(llm, record_keys=True)
    assert tokens == _generate(eager)[0]
    assert keys == ENGINE_KEYS


@gpu
@pytest.mark.parametrize("model", ["mamba2", "bamba"])
def test_engine_graph_replays_match_eager_on_gpu(tiny_checkpoint, model):
    """fp32, the real graphs (async scheduling, as on any CUDA run): the same steps as on CPU replay the same
    graphs and emit the eager tokens; Bamba's attention layers (triton) share its graphs."""
    _needs_cuda()
    from research_lm import LLM

    path = str(tiny_checkpoint(model))
    knobs = dict(ENGINE_KNOBS, device="cuda", cuda_graph_sizes=[1, 2, 4], prefill_graph_sizes=[8, 16])
    want, _ = _generate(LLM(path, cuda_graphs=False, **knobs))
    llm = LLM(path, cuda_graphs=True, **knobs)
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None and graphs.sizes == {1: [1, 2, 4]} and graphs.prefill == [8, 16]
    tokens, keys = _generate(llm, record_keys=True)
    assert tokens == want
    assert keys == ENGINE_KEYS


def _as_fp32(case):
    """The same case with every tensor upcast to fp32: the oracle for a low-precision run (exact inputs)."""
    return replace(
        case, xbc=case.xbc.float(), dt=case.dt.float(), cache=tuple(c.float() for c in case.cache),
        weights=case.weights._replace(**{k: None if v is None else v.float()
                                         for k, v in case.weights._asdict().items()}),
    )


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_shapes_on_gpu(dtype):
    """Mamba2-2.7B-like head shapes (head_dim 64, state 128, 8 groups), long and short requests.

    bf16: both backends round the conv output to bf16 and sum 700-token scans in different orders, so
    elementwise closeness between them is the wrong test. Each is compared with the fp32 reference on
    the same (upcast) inputs; Triton must be as close to it as the bf16 reference is (METHOD: bf16
    operands land between 1e-3 and 1e-2 relative)."""
    _needs_cuda()
    case = make_mamba_case(
        [700, 1, 1, 129, 1], [False, True, True, True, False], [5, 0, 9, 3, 1], num_heads=16, head_dim=64,
        n_groups=8, state_size=128, num_slots=12, chunk_size=256, dtype=dtype, device="cuda",
    )
    if dtype == torch.float32:
        assert_matches_ref(case, atol=1e-3)
        return
    n = case.num_real_tokens
    oracle_y, oracle_cache = run_mamba_backend("mamba_torch_ref", _as_fp32(case))
    for name in ("mamba_torch_ref", "mamba_triton"):
        y, cache = run_mamba_backend(name, case)
        assert y.dtype == dtype and torch.isfinite(y[:n]).all()
        errors = (_rel_err(y[:n], oracle_y[:n]), _rel_err(cache[0], oracle_cache[0]),
                  _rel_err(cache[1], oracle_cache[1]))
        print(name, "relative errors y / conv state / ssm state:", errors)
        assert max(errors) < 1e-2, (name, errors)
