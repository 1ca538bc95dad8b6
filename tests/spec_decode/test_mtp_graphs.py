"""MTP drafting from draft graphs (CPU: `eager_capture` re-runs over the graphs' buffers, kernels under the
interpreter): the graph path must draft what the eager path drafts. Session 31 found three bugs here: the GPU capture
of MTP's k = 1 graphs failed on a [n, 1] drafts buffer's column stride (tests/ops/test_step_inputs.py); the draft
graphs built MLA's step metadata instead of its graph metadata, so a replay reused the capture's host-planned
prefill / decode split (k = 2: the second draft differed; that split also sent a graph's padded rows into MLA's naive
prefill with an empty context)."""

from __future__ import annotations

import pytest
import torch

from research_lm import LLM, SamplingParams
from tests.spec_decode.test_draft_graphs import _run, _with_verify_graphs
from tests.spec_decode.test_mtp import write_mtp_checkpoint

KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
             num_gpu_blocks=40, max_model_len=48, attention_backend="triton", mla_backend="mla_triton",
             enable_prefix_caching=False, cuda_graphs=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant")
@pytest.mark.parametrize("k", [1, 2])
def test_mtp_drafts_from_graphs_as_eagerly(k, tiny_checkpoint, tmp_path, monkeypatch):
    import tests.spec_decode.test_draft_graphs as dg

    monkeypatch.setattr(dg, "K", k)
    path = tmp_path / "target"
    write_mtp_checkpoint(tiny_checkpoint("deepseek-v2"), path, own_embed_head=False, indexed=True, seed=11,
                         first_k_dense_replace=3)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    eager = LLM(str(path), speculative_config=spec, **KNOBS)
    llm = LLM(str(path), speculative_config=spec, **KNOBS)
    _with_verify_graphs(llm)
    prompts = [[3, 5, 7, 11, 13], [2, 4, 6, 8, 10, 12, 14, 16, 18], [9, 9, 9, 1, 2, 3, 4]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 7, 5)]
    want, want_proposals, _ = _run(eager, prompts, params)
    got, proposals, _ = _run(llm, prompts, params)
    assert got == want
    assert proposals == want_proposals


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2])
def test_mtp_graph_drafts_match_eager_on_cuda(k, tiny_checkpoint, tmp_path, monkeypatch):
    """Real graphs (mla_triton, float32): MTP's graph drafts equal its eager drafts, and its greedy tokens plain
    decoding's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import tests.spec_decode.test_draft_graphs as dg
    from research_lm.worker.cuda_graphs import cuda_graph_capture

    monkeypatch.setattr(dg, "K", k)
    path = tmp_path / "target"
    write_mtp_checkpoint(tiny_checkpoint("deepseek-v2"), path, own_embed_head=False, indexed=True, seed=11,
                         first_k_dense_replace=3)
    # (mla_triton named: "auto" may pick mla_flashinfer, whose host-planned replays draft graphs refuse)
    eager, llm = dg._pair(str(path), {"method": "mtp"}, "cuda", cuda_graph_capture, mla_backend="mla_triton")
    prompts = [[3, 5, 7, 11, 13], [2, 4, 6, 8, 10, 12, 14, 16, 18], [9, 9, 9, 1, 2, 3, 4]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 7, 5)]
    want, want_proposals, _ = _run(eager, prompts, params)
    got, proposals, replays = _run(llm, prompts, params)
    plain = LLM(str(path), device="cuda", **(dg.KNOBS | dict(mla_backend="mla_triton"))).generate(
        prompts, params, use_tqdm=False)
    assert got == want == [o.outputs[0].token_ids for o in plain]
    assert dg._same_proposals(proposals, want_proposals) and replays
