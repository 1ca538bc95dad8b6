"""Decode CUDA graphs (research_lm/cuda_graphs.py).

Invariants: a padded decode batch is a prefix view of the persistent step buffers, so every metadata
tensor keeps the address it had at capture (data_ptr equality, step after step); padded rows have
query length 0, seq_len 0 and slot -1, so replaying a padded batch emits the same tokens as eager.
On CPU the graph is stood in for by a re-run over the same buffers (`eager_capture`) with the Triton
backend under the interpreter; on CUDA the real graphs replay (`-m gpu`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.buffers import StepBuffers
from research_lm.cuda_graphs import (
    DecodeGraphs,
    buffer_addresses,
    decode_metadata,
    default_capture_sizes,
    eager_capture,
    pad_decode_inputs,
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
    pad_decode_inputs(buf, n, 8)
    assert buf.input_ids.np[:n].tolist() == [7] * n and buf.input_ids.np[n:8].tolist() == [0] * 5
    assert buf.slot_mapping.np[n:8].tolist() == [-1] * 5 and buf.slot_mapping.np[:n].tolist() == [5] * n
    assert buf.query_start_loc.np[:9].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert buf.seq_lens.np[n:8].tolist() == [0] * 5 and buf.seq_lens.np[:n].tolist() == [11] * n
    assert buf.request_rows.np[n:8].tolist() == [-1] * 5
    query_lens = np.diff(buf.query_start_loc.np[:9])
    assert query_lens.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


def test_decode_metadata_is_views_of_the_buffers():
    buf = StepBuffers(max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=4, device=CPU)
    base = buffer_addresses(buf)
    for b in (1, 4, 8):
        common = decode_metadata(buf, b, block_size=16, max_seq_len=64)
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
    assert graphs.sizes == [1, 2, 4, 8]  # sizes past max_num_seqs are dropped
    assert sorted(graphs.addresses) == [1, 2, 4, 8]
    decode = [decode_metadata(buf, n, 16, 64) for n in range(1, 11)]
    assert [graphs.padded_size(c) for c in decode] == [1, 2, 4, 4, 8, 8, 8, 8, None, None]
    prefill = decode_metadata(buf, 2, 16, 64)
    prefill.max_query_len, prefill.num_tokens = 3, 4
    assert graphs.padded_size(prefill) is None


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


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in (5, 9, 3)]


def _generate_with_graphs(llm: LLM, prompts, params) -> tuple[list[list[int]], list[dict[str, int]], int]:
    """Generate, recording the metadata addresses of every step; returns (tokens, addresses, replays)."""
    runner = llm.engine.runner
    graphs = runner.cuda_graphs
    seen: list[dict[str, int]] = []
    replays = 0
    prepare, run = runner._prepare_inputs, graphs.run

    def recording_prepare(scheduled):
        common, rows = prepare(scheduled)
        if graphs.covers(common):
            seen.append(buffer_addresses(runner.buffers, common))
        return common, rows

    def counting_run(common):
        nonlocal replays
        replays += 1
        return run(common)

    runner._prepare_inputs, graphs.run = recording_prepare, counting_run
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], seen, replays


def _params(max_tokens: list[int]) -> list[SamplingParams]:
    # different lengths: the batch shrinks 3 -> 2 -> 1, so padded sizes (3 -> 4) are replayed too
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter variant; the GPU tests cover CUDA")
def test_padded_replay_matches_eager_on_cpu(tiny_checkpoint):
    """The graph path with a re-run stand-in: padding, buffer plumbing and the Triton kernels (interpreter)."""
    knobs = dict(dtype="float32", device="cpu", attention_backend="triton", block_size=4,
                 max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks=24, max_model_len=48)
    path = str(tiny_checkpoint("llama"))
    eager = LLM(path, **knobs)
    prompts = _prompts(eager.engine.info.vocab_size)
    params = _params([6, 4, 2])
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    llm = LLM(path, **knobs)
    runner = llm.engine.runner
    runner.cuda_graphs = DecodeGraphs(runner.model, runner.buffers, runner.backends, sizes=[1, 2, 4],
                                      block_size=4, max_seq_len=48, capture=eager_capture)
    got, seen, replays = _generate_with_graphs(llm, prompts, params)
    assert got == want
    assert replays == 5  # decode steps: 1 at batch 3 (padded to 4), 2 at 2, 2 at 1
    assert seen and all(a == runner.cuda_graphs.addresses[4] for a in seen)


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
    eager = LLM(path, **knobs)
    assert eager.engine.runner.cuda_graphs is None
    vocab = eager.engine.info.vocab_size
    if dtype == "float32":
        prompts, params = _prompts(vocab), _params([12, 8, 4])
    else:
        prompts, params = [[i + 1] * 7 for i in range(4)], _params([10] * 4)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, cuda_graphs=True, **knobs)
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    got, seen, replays = _generate_with_graphs(llm, prompts, params)
    assert got == want
    assert replays == (9 if dtype == "bfloat16" else 11)  # decode steps (the first token comes from prefill)
    assert len(seen) == replays and all(a == graphs.addresses[1] for a in seen)
    assert all(graphs.addresses[b] == graphs.addresses[1] for b in graphs.sizes)


@pytest.mark.gpu
def test_cuda_graphs_off_for_torch_ref(tiny_checkpoint):
    _needs_cuda()
    llm = LLM(str(tiny_checkpoint("llama")), device="cuda", attention_backend="torch_ref", cuda_graphs=True,
              num_gpu_blocks=16, max_model_len=64)
    assert llm.engine.runner.cuda_graphs is None
