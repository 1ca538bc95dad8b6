"""Decode CUDA graphs (research_lm/worker/cuda_graphs.py).

Invariants: a padded decode batch is a prefix view of the persistent step buffers, so every metadata
tensor keeps the address it had at capture (data_ptr equality, step after step); padded rows have
query length 0, seq_len 0 and slot -1, so replaying a padded batch emits the same tokens as eager.
On CPU the graph is stood in for by a re-run over the same buffers (`eager_capture`) with the Triton
backend under the interpreter; on CUDA the real graphs replay (`-m gpu`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.worker.buffers import StepBuffers
from research_lm.worker.cuda_graphs import (
    DecodeGraphs,
    buffer_addresses,
    default_capture_sizes,
    default_prefill_sizes,
    eager_capture,
    gc_frozen,
    graph_metadata,
    pad_step_inputs,
    uncapturable_reason,
    unsupported_reason,
)

CPU = torch.device("cpu")


def test_default_capture_sizes():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_pad_decode_inputs_marks_rows_past_the_batch_as_empty():
    buf = StepBuffers(max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=4, device=CPU)
    n = 3
    buf.input_ids.np[:8] = 7
    buf.slot_mapping.np[:8] = 5
    buf.query_start_loc.np[: n + 1] = np.arange(n + 1)
    buf.query_start_loc.np[n + 1 :] = 99  # stale values of an earlier step
    buf.seq_lens.np[:8] = 11
    buf.request_rows.np[:8] = 2
    pad_step_inputs(buf, n, n, 8, 8)  # a decode step: one token per request
    assert buf.input_ids.np[:n].tolist() == [7] * n and buf.input_ids.np[n:8].tolist() == [0] * 5
    assert buf.slot_mapping.np[n:8].tolist() == [-1] * 5 and buf.slot_mapping.np[:n].tolist() == [5] * n
    assert buf.query_start_loc.np[:9].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert buf.seq_lens.np[n:8].tolist() == [0] * 5 and buf.seq_lens.np[:n].tolist() == [11] * n
    assert buf.request_rows.np[n:8].tolist() == [-1] * 5
    query_lens = np.diff(buf.query_start_loc.np[:9])
    assert query_lens.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


def test_graph_metadata_is_views_of_the_buffers():
    buf = StepBuffers(max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=4, device=CPU)
    base = buffer_addresses(buf)
    for b in (1, 4, 8):
        common = graph_metadata(buf, b, block_size=16, max_seq_len=64)
        assert buffer_addresses(buf, common) == base
        assert (common.num_reqs, common.num_tokens, common.max_query_len) == (b, b, 1)
        assert common.query_start_loc.shape == (b + 1,) and common.block_table.shape == (b, 4)
        assert common.is_pure_decode


class _Recorder(torch.nn.Module):
    def forward(self, input_ids, positions, attn_metadata):
        return input_ids.float()[:, None]


def test_padded_size_picks_the_smallest_captured_size_and_refuses_other_steps():
    buf = StepBuffers(max_num_tokens=64, max_num_reqs=16, max_blocks_per_req=4, device=CPU)
    graphs = DecodeGraphs(_Recorder(), buf, [], sizes=[1, 2, 4, 8, 99], block_size=16, max_seq_len=64,
                          capture=eager_capture)
    assert graphs.sizes == {1: [1, 2, 4, 8]}  # sizes past max_num_seqs are dropped
    assert sorted(graphs.addresses) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    decode = [graph_metadata(buf, n, 16, 64) for n in range(1, 11)]
    assert [graphs.padded_size(c) for c in decode] == [(1, 1), (2, 1), (4, 1), (4, 1)] + [(8, 1)] * 4 + [None] * 2
    prefill = graph_metadata(buf, 2, 16, 64)
    prefill.max_query_len, prefill.num_tokens = 3, 4
    assert graphs.padded_size(prefill) is None


def test_verify_graphs_serve_queries_up_to_their_length_within_the_token_budget():
    """Query length 4 (k = 3 drafts): sizes whose B * 4 tokens fit the budget of 16; a step whose longest
    query is 2 .. 4 tokens replays the smallest B >= n; decode steps keep the query-length-1 graphs."""
    buf = StepBuffers(max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=4, device=CPU)
    graphs = DecodeGraphs(_Recorder(), buf, [], sizes=[1, 2, 4, 8], query_lens=[1, 4], block_size=16,
                          max_seq_len=64, capture=eager_capture)
    assert graphs.sizes == {1: [1, 2, 4, 8], 4: [1, 2, 4]}
    verify = graph_metadata(buf, 3, 16, 64, query_len=4)
    assert (verify.num_tokens, verify.max_query_len, verify.is_pure_decode) == (12, 4, False)
    assert graphs.padded_size(verify) == (4, 4)
    verify.max_query_len, verify.num_tokens = 2, 5  # fewer drafts: lengths (2, 2, 1)
    assert graphs.padded_size(verify) == (4, 4)
    assert graphs.padded_size(graph_metadata(buf, 3, 16, 64)) == (4, 1)
    too_long = graph_metadata(buf, 1, 16, 64, query_len=5)
    assert graphs.padded_size(too_long) is None
    assert graphs.padded_size(graph_metadata(buf, 5, 16, 64, query_len=3)) is None  # 8 x 4 > 16 tokens


def test_prefill_graphs_serve_one_request_up_to_their_length():
    """Prefill sizes longer than every uniform graph's query and within the token budget are captured at B = 1:
    one request's prompt or chunk replays the smallest that holds it, forward only (no logits); several
    requests, or a longer prompt, run eagerly; decode and verify steps keep their graphs."""
    assert default_prefill_sizes(2048) == [16, 32, 64, 128, 256, 512] and default_prefill_sizes(40) == [16, 32]
    buf = StepBuffers(max_num_tokens=32, max_num_reqs=8, max_blocks_per_req=4, device=CPU)
    vocab = 10
    graphs = DecodeGraphs(_Recorder(), buf, [], sizes=[1, 2, 4], query_lens=[1, 4], block_size=16, max_seq_len=64,
                          compute_logits=lambda h: h.expand(-1, vocab), vocab_size=vocab,
                          prefill_sizes=[4, 8, 16, 32, 64], capture=eager_capture)
    assert graphs.prefill == [8, 16, 32]  # 4: the verify graphs' length; 64: past the budget
    assert sorted(graphs.addresses) == [(1, 1), (1, 4), (1, 8), (1, 16), (1, 32), (2, 1), (2, 4), (4, 1), (4, 4)]
    assert graphs.logits.shape == (16, vocab)  # sized by the uniform graphs (4 x 4), not the prefill ones
    assert all("logits" not in graphs.addresses[1, q] for q in graphs.prefill)
    assert [graphs.key_for(1, n) for n in (1, 3, 4, 5, 8, 9, 17, 32, 33)] == \
        [(1, 1), (1, 4), (1, 4), (1, 8), (1, 8), (1, 16), (1, 32), (1, 32), None]
    assert graphs.key_for(2, 5) is None and graphs.key_for(3, 4) == (4, 4)
    buf.input_ids.np[:5] = [5, 6, 7, 8, 9]
    buf.query_start_loc.np[:2] = [0, 5]
    common = graph_metadata(buf, 1, 16, 64)
    common.num_tokens, common.max_query_len = 5, 5
    step = graphs.run(common)
    assert step.out.flatten().tolist() == [5, 6, 7, 8, 9] and step.logits is None and step.greedy_ids is None


def test_verify_replay_pads_tokens_and_requests():
    """Three requests of 2, 3, 1 tokens in the (4 requests, 3 tokens) graph: token rows 6 .. 12 and
    request row 3 are padding (token 0, slot -1, query length 0); the step's rows come back."""
    buf = StepBuffers(max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=4, device=CPU)
    seen = {}

    class Spy(_Recorder):
        def forward(self, input_ids, positions, attn_metadata):
            seen.update(ids=input_ids.tolist(), slots=attn_metadata["spy"].slot_mapping.tolist(),
                        qsl=attn_metadata["spy"].query_start_loc.tolist(), n=attn_metadata["spy"].num_tokens)
            return super().forward(input_ids, positions, attn_metadata)

    class SpyBackend:
        name = "spy"

        @staticmethod
        def build_graph_metadata(common):
            return common

        @staticmethod
        def prepare_replay(metadata, common):
            pass

    graphs = DecodeGraphs(Spy(), buf, [SpyBackend()], sizes=[4], query_lens=[1, 3], block_size=16,
                          max_seq_len=64, capture=eager_capture)
    buf.input_ids.np[:6] = [5, 6, 7, 8, 9, 10]
    buf.slot_mapping.np[:6] = range(20, 26)
    buf.query_start_loc.np[:4] = [0, 2, 5, 6]
    common = graph_metadata(buf, 3, 16, 64)
    common.num_tokens, common.max_query_len = 6, 3
    step = graphs.run(common)
    assert seen == dict(ids=[5, 6, 7, 8, 9, 10] + [0] * 6, slots=list(range(20, 26)) + [-1] * 6,
                        qsl=[0, 2, 5, 6, 6], n=12)
    assert step.out.flatten().tolist() == [5, 6, 7, 8, 9, 10]


def test_each_replay_first_refreshes_the_graphs_own_metadata_with_the_steps_record():
    """The capture hooks: a graph records the metadata `build_graph_metadata` made for its padded shape, and each
    replay hands that same object, with the step's own record (its n requests and T tokens), to `prepare_replay`
    before the recording runs; what prepare_replay writes into it is what the recorded forward reads."""
    buf = StepBuffers(max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=4, device=CPU)
    calls = []

    class Planned:  # a host-planned backend's record: one persistent tensor the forward reads
        def __init__(self, b):
            self.b, self.plan = b, torch.zeros(1)

    class PlanningBackend:
        name = "planning"

        @staticmethod
        def build_graph_metadata(common):
            return Planned(common.num_reqs)

        @staticmethod
        def prepare_replay(metadata, common):
            calls.append((metadata.b, common.num_reqs, common.num_tokens))
            metadata.plan.fill_(common.num_tokens)  # in place: the recording keeps the tensor

    class ReadsPlan(torch.nn.Module):
        def forward(self, input_ids, positions, attn_metadata):
            return input_ids.float()[:, None] + attn_metadata["planning"].plan

    graphs = DecodeGraphs(ReadsPlan(), buf, [PlanningBackend()], sizes=[2, 4], block_size=16, max_seq_len=64,
                          capture=eager_capture)
    buf.input_ids.np[:3] = [5, 6, 7]
    buf.query_start_loc.np[:4] = [0, 1, 2, 3]
    common = graph_metadata(buf, 3, 16, 64)
    step = graphs.run(common)
    assert calls == [(4, 3, 3)]  # the (4, 1) graph's metadata, planned for the step's 3 requests
    assert step.out.flatten().tolist() == [8.0, 9.0, 10.0]


def test_host_planned_backends_stay_out_of_graphs_whose_lengths_only_the_device_knows():
    from dataclasses import replace

    from attention_zoo.registry import get_backend

    class HostPlanned:
        name = "host_planned"
        capabilities = replace(get_backend("triton").capabilities, graphs_plan_on_host=True)

    model = torch.nn.Linear(2, 2)
    assert uncapturable_reason(model, [HostPlanned]) is None  # the target's graphs: the host knows the lengths
    assert "host_planned" in uncapturable_reason(model, [HostPlanned], lengths_on_device=True)  # a draft chain
    assert uncapturable_reason(model, [get_backend("triton")], lengths_on_device=True) is None


def test_unsupported_reason():
    from attention_zoo.registry import get_backend

    model = torch.nn.Linear(2, 2)
    assert "CUDA device" in unsupported_reason(model, [get_backend("triton")], CPU)
    cuda = torch.device("cuda")
    assert "torch_ref" in unsupported_reason(model, [get_backend("torch_ref")], cuda)
    assert unsupported_reason(model, [get_backend("triton")], cuda) is None

    class Syncs(torch.nn.Module):
        cuda_graphs = False

    assert "Syncs" in unsupported_reason(torch.nn.Sequential(Syncs()), [get_backend("triton")], cuda)


def test_gc_frozen_keeps_the_collector_off_and_earlier_objects_out_of_reach_until_it_ends():
    import gc
    import weakref

    class Cycle:
        pass

    garbage = Cycle()
    garbage.me = garbage
    dead = weakref.ref(garbage)
    del garbage  # cyclic garbage: the collection on entry frees it (frozen, it would outlive every collection)
    frozen_before = gc.get_freeze_count()
    with pytest.raises(RuntimeError, match="capture failed"), gc_frozen():
        assert dead() is None
        assert not gc.isenabled()
        assert gc.get_freeze_count() > frozen_before
        raise RuntimeError("capture failed")
    assert gc.isenabled() and gc.get_freeze_count() == frozen_before


def test_graph_logits_and_argmax_land_in_persistent_buffers():
    """Every size's graph writes rows 0 .. B of the same logits / greedy_ids buffers; run() hands out
    rows 0 .. n, at the captured addresses, with greedy_ids = argmax of the real rows' logits."""
    buf = StepBuffers(max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=4, device=CPU)
    vocab = 10

    def peaked_at_input_id(hidden):  # [b, 1] -> [b, vocab]: argmax = the row's input id
        return -((hidden - torch.arange(vocab)) ** 2)

    graphs = DecodeGraphs(_Recorder(), buf, [], sizes=[1, 2, 4, 8], block_size=16, max_seq_len=64,
                          compute_logits=peaked_at_input_id, vocab_size=vocab, capture=eager_capture)
    assert graphs.logits.shape == (8, vocab) and graphs.greedy_ids.shape == (8,)
    logits_ptr, ids_ptr = graphs.logits.data_ptr(), graphs.greedy_ids.data_ptr()
    assert all(a["logits"] == logits_ptr and a["greedy_ids"] == ids_ptr for a in graphs.addresses.values())
    for n, ids in [(3, [7, 1, 4]), (1, [9]), (8, [0, 1, 2, 3, 4, 5, 6, 7]), (2, [5, 5])]:
        buf.input_ids.np[:n] = ids
        buf.query_start_loc.np[: n + 1] = np.arange(n + 1)
        step = graphs.run(graph_metadata(buf, n, 16, 64))
        assert step.logits.shape == (n, vocab) and step.greedy_ids.shape == (n,)
        assert (step.logits.data_ptr(), step.greedy_ids.data_ptr()) == (logits_ptr, ids_ptr)
        assert step.greedy_ids.tolist() == ids
        assert torch.equal(step.logits, peaked_at_input_id(torch.tensor(ids, dtype=torch.float32)[:, None]))


def test_graph_sizes_stop_at_the_token_budget():
    buf = StepBuffers(max_num_tokens=3, max_num_reqs=8, max_blocks_per_req=4, device=CPU)
    graphs = DecodeGraphs(_Recorder(), buf, [], sizes=[1, 2, 4, 8], block_size=16, max_seq_len=64,
                          capture=eager_capture)
    assert graphs.sizes == {1: [1, 2]}
    assert graphs.logits is None and graphs.run(graph_metadata(buf, 2, 16, 64)).logits is None


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in (5, 9, 3)]


@dataclass
class _Run:
    tokens: list[list[int]]
    logprobs: list[list[dict] | None]
    addresses: list[dict[str, int]]  # per replay: every device buffer the graph reads or writes
    sampled: int  # steps whose tokens came from the sampler; the others took the graph's argmax

    @property
    def replays(self) -> int:
        return len(self.addresses)


def _generate_with_graphs(llm: LLM, prompts, params) -> _Run:
    """Generate, recording the buffer addresses of every replay and counting the sampler's calls."""
    runner = llm.engine.runner
    graphs, sampler = runner.cuda_graphs, runner.sampler
    addresses: list[dict[str, int]] = []
    sampled = 0

    def recording_replay(key, common):
        step = DecodeGraphs.replay(graphs, key, common)
        seen = buffer_addresses(runner.buffers)
        if step.logits is not None:
            seen |= {"logits": step.logits.data_ptr(), "greedy_ids": step.greedy_ids.data_ptr()}
        addresses.append(seen)
        return step

    def counting_sampler(logits, batch):
        nonlocal sampled
        sampled += 1
        return sampler(logits, batch)

    graphs.replay, runner.sampler = recording_replay, counting_sampler
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del graphs.replay
        runner.sampler = sampler
    return _Run([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], addresses, sampled)


def _params(max_tokens: list[int], **first) -> list[SamplingParams]:
    """Greedy; `first` goes to the first request only. Different lengths shrink the batch, e.g.
    3 -> 2 -> 1, so padded sizes (3 -> 4) are replayed too."""
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **(first if i == 0 else {}))
            for i, n in enumerate(max_tokens)]


def _graph_capturing(runner, sizes: list[int]) -> DecodeGraphs:
    """The graphs `runner.capture_cuda_graphs` builds, captured by the re-run stand-in."""
    return DecodeGraphs(runner.forward, runner.buffers, runner.backends, sizes=sizes, block_size=runner.block_size,
                        max_seq_len=runner.max_model_len, compute_logits=runner.model.compute_logits,
                        vocab_size=runner.vocab_size, capture=eager_capture)


CPU_KNOBS = dict(dtype="float32", device="cpu", attention_backend="triton", block_size=4, max_num_batched_tokens=32,
                 max_num_seqs=4, num_gpu_blocks=24, max_model_len=48, enable_prefix_caching=False)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="the Triton interpreter variant; the GPU tests cover CUDA")


@pytest.fixture(scope="module")
def cpu_llms(tiny_checkpoint) -> tuple[LLM, LLM]:
    """(eager, graphs) over the same checkpoint; no prefix caching, so step shapes do not depend on
    which test ran first."""
    path = str(tiny_checkpoint("llama"))
    eager, llm = LLM(path, **CPU_KNOBS), LLM(path, **CPU_KNOBS)
    llm.engine.runner.cuda_graphs = _graph_capturing(llm.engine.runner, [1, 2, 4])
    return eager, llm


def _eager_tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@cpu_only
def test_padded_replay_matches_eager_on_cpu(cpu_llms):
    """The graph path with a re-run stand-in: padding, buffer plumbing and the Triton kernels (interpreter);
    every decode step takes the graph's argmax, none runs the sampler."""
    eager, llm = cpu_llms
    prompts = _prompts(eager.engine.info.vocab_size)
    params = _params([6, 4, 2])
    run = _generate_with_graphs(llm, prompts, params)
    assert run.tokens == _eager_tokens(eager, prompts, params)
    assert run.replays == 5  # decode steps: 1 at batch 3 (padded to 4), 2 at 2, 2 at 1
    assert run.sampled == 1  # the prefill step
    assert all(a == llm.engine.runner.cuda_graphs.addresses[4, 1] for a in run.addresses)


@cpu_only
def test_prefill_graphs_match_eager_on_cpu(tiny_checkpoint):
    """One request at a time, as at batch 1: prompts of 5 and 13 tokens replay the (1, 8) and (1, 16) prefill
    graphs (the runner's capture, with the re-run stand-in), a 30-token prompt runs eagerly, and a prompt cut
    into chunks (max_num_batched_tokens 16) replays one graph per chunk; the tokens are the eager ones."""
    knobs = dict(CPU_KNOBS, max_num_seqs=1)
    path = str(tiny_checkpoint("llama"))
    eager, llm = LLM(path, **knobs), LLM(path, **knobs)
    runner = llm.engine.runner
    assert runner.capture_cuda_graphs([1], prefill_sizes=[8, 16], capture=eager_capture) is None
    assert runner.cuda_graphs.prefill == [8, 16]
    short = LLM(path, **dict(knobs, max_model_len=24)).engine.runner  # budget 32 tokens, positions 0 .. 23
    assert short.capture_cuda_graphs([1], prefill_sizes=[8, 16, 32], capture=eager_capture) is None
    assert short.cuda_graphs.prefill == [8, 16]  # a capture of 32 would run positions past max_model_len
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(eager.engine.info.vocab_size, (n,), generator=g).tolist() for n in (5, 13, 30)]
    params = _params([4, 3, 3])
    keys = []
    replay = runner.cuda_graphs.replay
    runner.cuda_graphs.replay = lambda key, n: keys.append(key) or replay(key, n)
    assert _eager_tokens(llm, prompts, params) == _eager_tokens(eager, prompts, params)
    assert keys.count((1, 8)) == 1 and keys.count((1, 16)) == 1 and keys.count((1, 1)) == 3 + 2 + 2
    chunked = LLM(path, **dict(knobs, max_num_batched_tokens=16))
    runner = chunked.engine.runner
    runner.capture_cuda_graphs([1], prefill_sizes=[8, 16], capture=eager_capture)
    keys.clear()
    replay = runner.cuda_graphs.replay
    runner.cuda_graphs.replay = lambda key, n: keys.append(key) or replay(key, n)
    assert _eager_tokens(chunked, prompts[2:], params[2:]) == _eager_tokens(eager, prompts[2:], params[2:])
    assert keys == [(1, 16), (1, 16), (1, 1), (1, 1)]  # chunks of 16 + 14 tokens, then 2 decodes


@cpu_only
@pytest.mark.parametrize("n", [1, 3, 4])
def test_graph_argmax_matches_eager_at_each_batch_size(cpu_llms, n):
    """n equal requests: every decode step replays size n (3: padded to 4) and emits the eager tokens."""
    eager, llm = cpu_llms
    prompts = (_prompts(eager.engine.info.vocab_size) + [[1, 2, 3, 4]])[:n]
    params = _params([5] * n)
    run = _generate_with_graphs(llm, prompts, params)
    assert run.tokens == _eager_tokens(eager, prompts, params)
    assert (run.replays, run.sampled) == (4, 1)


@cpu_only
@pytest.mark.parametrize("first, sampled_decode_steps", [
    (dict(repetition_penalty=1.3), 5),  # changes the argmax on every step
    (dict(logprobs=2), 5),  # the argmax is right, but logprobs need the sampler
    (dict(min_tokens=3), 2),  # positions 1, 2 ban the stop id; from 3 on the raw argmax is the token
])
def test_greedy_rows_the_raw_argmax_would_get_wrong_take_the_sampler(cpu_llms, first, sampled_decode_steps):
    """The first of three greedy requests asks for processing; while it does, the whole step samples
    from the graph's logits, and the tokens (and logprobs) are the eager ones."""
    eager, llm = cpu_llms
    prompts = _prompts(eager.engine.info.vocab_size)
    if "min_tokens" in first:  # ban the token plain greedy emits at position 1
        stop = _eager_tokens(eager, prompts, _params([6, 4, 2]))[0][1]
        first = dict(first, stop_token_ids=[stop])
    params = _params([6, 4, 2], **first)
    want = eager.generate(prompts, params, use_tqdm=False)
    run = _generate_with_graphs(llm, prompts, params)
    assert run.tokens == [o.outputs[0].token_ids for o in want]
    assert run.sampled == 1 + sampled_decode_steps
    if "min_tokens" in first:
        assert run.tokens[0][1] != first["stop_token_ids"][0]
    for got, ref in zip(run.logprobs, (o.outputs[0].logprobs for o in want), strict=True):
        assert (got is None) == (ref is None)
        for g, r in zip(got or [], ref or [], strict=True):
            assert g.keys() == r.keys()
            assert [x.logprob for x in g.values()] == pytest.approx([x.logprob for x in r.values()], abs=1e-5)


@cpu_only
def test_decode_shaped_step_with_a_prompt_chunk_samples_eagerly(tiny_checkpoint):
    """A budget of 2 tokens: a request's last prompt token (sampled) or decode token rides with a
    one-token chunk of another prompt (not sampled). The step is decode-shaped, so the graph runs it,
    but logits_indices is not arange: the sampled row's logits come from compute_logits as in eager."""
    knobs = dict(CPU_KNOBS, max_num_batched_tokens=2, max_num_seqs=2)
    path = str(tiny_checkpoint("llama"))
    eager, llm = LLM(path, **knobs), LLM(path, **knobs)
    llm.engine.runner.cuda_graphs = _graph_capturing(llm.engine.runner, [1, 2])
    prompts, params = [[3, 4, 5], [6, 7, 8, 9, 10]], _params([4, 2])
    run = _generate_with_graphs(llm, prompts, params)
    assert run.tokens == _eager_tokens(eager, prompts, params)
    # steps (r0 prompt 3, 4 tokens; r1 prompt 5, 2 tokens): 1 [r0 2-chunk] (eager, samples nothing);
    # 2..5 [r0 last prompt token or decode, r1 1-chunk] replayed, sampling r0 alone through the sampler;
    # 6 [r1 last prompt token], 7 [r1 decode] replayed, taking the graph's argmax.
    assert (run.replays, run.sampled) == (6, 5)


@cpu_only
@pytest.mark.parametrize("asynchronous", [False, True])
def test_graph_steps_gather_their_inputs_from_the_device_tables(tiny_checkpoint, asynchronous):
    """Decode steps under graphs, padded batches (3 -> 4) included, with async scheduling too (whose input token is
    still on the device when the step is launched): the gather writes what the eager steps compute from, so the
    tokens are the eager ones."""
    path = str(tiny_checkpoint("llama"))
    llm = LLM(path, async_scheduling=asynchronous, **CPU_KNOBS)
    runner = llm.engine.runner
    runner.cuda_graphs = _graph_capturing(runner, [1, 2, 4])
    prompts, params = _prompts(llm.engine.info.vocab_size), _params([6, 4, 2])
    got, keys = _verify_graph_run(llm, prompts, params)
    assert got == _eager_tokens(LLM(path, **CPU_KNOBS), prompts, params)
    assert (4, 1) in keys and (1, 1) in keys


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def _verify_graph_run(llm: LLM, prompts, params) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Tokens, and the (batch size, query length) of every replay."""
    graphs, keys = llm.engine.runner.cuda_graphs, []

    def recording_replay(key, common):
        keys.append(key)
        return DecodeGraphs.replay(graphs, key, common)

    graphs.replay = recording_replay
    try:
        return _eager_tokens(llm, prompts, params), keys
    finally:
        del graphs.replay


@cpu_only
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spec_verify_steps_replay_graphs_on_cpu(tiny_checkpoint, temperature):
    """ngram drafts (k = 3) on prompts that repeat: verify steps (queries of 2 .. 4 tokens) replay the
    query-length-4 graphs and emit the eager speculative run's tokens; greedy, also plain decoding's."""
    path = str(tiny_checkpoint("llama"))
    eager, llm = (LLM(path, speculative_config=NGRAM, **CPU_KNOBS) for _ in range(2))
    runner = llm.engine.runner
    runner.cuda_graphs = DecodeGraphs(
        runner.forward, runner.buffers, runner.backends, sizes=[1, 2, 4], query_lens=[1, 4],
        block_size=runner.block_size, max_seq_len=runner.max_model_len,
        compute_logits=runner.model.compute_logits, vocab_size=runner.vocab_size, capture=eager_capture)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5], [7, 8, 9, 7, 8]]
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate([9, 7, 5])]
    got, keys = _verify_graph_run(llm, prompts, params)
    assert got == _eager_tokens(eager, prompts, params)
    assert (4, 4) in keys  # the first verify step: three requests padded to four
    if temperature == 0.0:
        assert got == _eager_tokens(LLM(path, **CPU_KNOBS), prompts, params)


# ---- CUDA ----------------------------------------------------------------------------------------


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_matches_eager_on_cuda(dtype, tiny_checkpoint):
    """Same greedy tokens with and without graphs, every step's metadata at the captured addresses.

    max_model_len < 512 keeps the split-KV count at 1 in both paths; with equal batch sizes (bf16: 4
    requests of equal length, so no padding) eager and replay then run the same kernels on the same
    shapes, and bf16 tokens must agree exactly. fp32 also replays padded batches (3 -> 4)."""
    _needs_cuda()
    path = str(tiny_checkpoint("llama"))
    knobs = dict(dtype=dtype, device="cuda", attention_backend="triton", block_size=4, max_num_batched_tokens=64,
                 max_num_seqs=4, num_gpu_blocks=64, max_model_len=64, cuda_graph_sizes=[1, 2, 4])
    eager = LLM(path, cuda_graphs=False, **knobs)
    assert eager.engine.runner.cuda_graphs is None
    vocab = eager.engine.info.vocab_size
    if dtype == "float32":
        prompts, params = _prompts(vocab), _params([12, 8, 4])
    else:
        prompts, params = [[i + 1] * 7 for i in range(4)], _params([10] * 4)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, cuda_graphs=True, **knobs)
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None and graphs.sizes == {1: [1, 2, 4]}
    run = _generate_with_graphs(llm, prompts, params)
    assert run.tokens == want
    assert run.replays == (9 if dtype == "bfloat16" else 11)  # decode steps (the first token comes from prefill)
    assert run.sampled == 1  # the prefill; every decode step took the graph's argmax
    assert all(a == graphs.addresses[1, 1] for a in run.addresses)
    assert all(graphs.addresses[b, 1] == graphs.addresses[1, 1] for b in graphs.sizes[1])
    assert graphs.logits.shape == (4, vocab) and graphs.logits.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("first, sampled", [({}, 1), (dict(repetition_penalty=1.3), 10), (dict(logprobs=3), 10)])
def test_graph_argmax_and_sampler_fallback_match_eager_in_bf16_on_cuda(tiny_checkpoint, first, sampled):
    """bf16, the real graphs: a plain greedy batch emits the graph's argmax (the sampler runs only for
    the prefill), a batch with a repetition penalty or logprobs samples from the graph's logits; both
    give the eager tokens exactly (4 equal requests: no padding, so eager runs the lm_head GEMM on the
    same [4, hidden] shape as the graph)."""
    _needs_cuda()
    path = str(tiny_checkpoint("llama"))
    knobs = dict(dtype="bfloat16", device="cuda", attention_backend="triton", block_size=4,
                 max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=64, max_model_len=64,
                 cuda_graph_sizes=[1, 2, 4])
    prompts, params = [[i + 1] * 7 for i in range(4)], _params([10] * 4, **first)
    want = LLM(path, cuda_graphs=False, **knobs).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, cuda_graphs=True, **knobs)
    run = _generate_with_graphs(llm, prompts, params)
    assert run.tokens == [o.outputs[0].token_ids for o in want]
    assert (run.replays, run.sampled) == (9, sampled)
    if "logprobs" in first:
        got, ref = run.logprobs[0], want[0].outputs[0].logprobs
        assert [d.keys() for d in got] == [d.keys() for d in ref]


@pytest.mark.gpu
def test_cuda_graphs_off_for_torch_ref(tiny_checkpoint):
    _needs_cuda()
    llm = LLM(str(tiny_checkpoint("llama")), device="cuda", attention_backend="torch_ref", cuda_graphs=True,
              num_gpu_blocks=16, max_model_len=64)
    assert llm.engine.runner.cuda_graphs is None


@pytest.mark.gpu
def test_spec_verify_graphs_match_eager_on_cuda(tiny_checkpoint):
    """fp32, the real graphs, ngram drafts (k = 3): verify steps replay the query-length-4 graphs, and
    greedy tokens equal the eager speculative run's and plain decoding's."""
    _needs_cuda()
    path = str(tiny_checkpoint("llama"))
    knobs = dict(dtype="float32", device="cuda", attention_backend="triton", block_size=4,
                 max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=64, max_model_len=64,
                 cuda_graph_sizes=[1, 2, 4])
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4, 5], [7, 8, 9, 7, 8]]
    params = _params([12, 9, 6])
    want = _eager_tokens(LLM(path, speculative_config=NGRAM, cuda_graphs=False, **knobs), prompts, params)
    llm = LLM(path, speculative_config=NGRAM, cuda_graphs=True, **knobs)
    assert llm.engine.runner.cuda_graphs.sizes == {1: [1, 2, 4], 4: [1, 2, 4]}
    got, keys = _verify_graph_run(llm, prompts, params)
    assert got == want == _eager_tokens(LLM(path, **knobs), prompts, params)
    assert (4, 4) in keys


def test_verify_graphs_accept_greedily_what_verify_drafts_accepts():
    """A verify graph also keeps each request's drafts while they equal the argmax of the row before them (only its
    first num_drafts[row] slots hold real drafts), packed for the host copy over its padded B requests; for 3
    requests padded to 4 it emits what `verify_drafts` emits for the same step."""
    from research_lm.api.outputs import ScheduledRequest
    from research_lm.worker.verification import verify_drafts

    vocab, k, n = 8, 3, 3
    buf = StepBuffers(max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=4, device=CPU)
    num_drafts = torch.tensor([3, 1, 0, 2, 3], dtype=torch.int32)  # the device table, per request row

    def logits_of(hidden):  # row t's argmax: its input id + 1 (mod vocab)
        return torch.nn.functional.one_hot((hidden[:, 0].long() + 1) % vocab, vocab).float()

    graphs = DecodeGraphs(_Recorder(), buf, [], sizes=[4], query_lens=[1, k + 1], block_size=16, max_seq_len=64,
                          compute_logits=logits_of, vocab_size=vocab, num_drafts=num_drafts, capture=eager_capture)
    # argmax = id + 1: request 0 keeps 2 drafts (its 3rd is wrong), 1 keeps 1, 2 keeps its one real draft only
    ids = [[1, 2, 3, 5], [4, 5, 7, 0], [6, 7, 0, 1]]
    rows = [0, 3, 1]  # their table rows: 3, 2 and 1 real drafts
    buf.input_ids.np[: n * (k + 1)] = sum(ids, [])
    buf.input_ids.copy_to_gpu(16)
    buf.request_rows.np[:4] = rows + [-1]
    buf.request_rows.copy_to_gpu(4)
    common = graph_metadata(buf, n, 16, 64, query_len=k + 1)
    common.num_tokens = n * (k + 1)
    step = graphs.replay((4, k + 1), common)
    t = 4 * (k + 1)
    packed = step.accepted
    assert packed.shape == (t + 8,)
    emitted, counts, real = packed[:t].view(4, k + 1)[:n], packed[t : t + n], packed[t + 4 : t + 4 + n]

    class _Req:
        def __init__(self, i):
            self.request_id = str(i)

    scheduled = [ScheduledRequest(_Req(i), k + 1, [], num_spec_tokens=k) for i in range(n)]
    want, want_counts, want_real, _ = verify_drafts(
        scheduled, list(range(n)), np.arange(0, (n + 1) * (k + 1), k + 1), step.logits, step.greedy_ids,
        buf.input_ids.gpu[: n * (k + 1)], num_drafts[rows], None, {})
    assert emitted.tolist() == want.tolist() == [[2, 3, 4, -1], [5, 6, -1, -1], [7, 0, -1, -1]]
    assert counts.tolist() == want_counts.tolist() == [3, 2, 2]
    assert real.tolist() == want_real.tolist() == [3, 2, 1]
