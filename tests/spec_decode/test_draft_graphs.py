"""Graph-captured drafting steps (spec_decode/draft_graphs.py: entry forward + chain) against the eager path.

On CPU the graph is stood in for by a re-run over the same persistent buffers (`eager_capture`), with the
Triton attention kernels under the interpreter: this checks the buffer plumbing (entry rows, padding,
per-step positions, seq lens and slots, the KV-write limit, the carried EAGLE feature). The GPU test
captures real graphs. Either way, every proposal must equal the eager chain's, and greedy outputs must
equal plain decoding's.
"""

from __future__ import annotations

import random

import pytest
import torch

from research_lm import LLM, SamplingParams
from research_lm.cuda_graphs import cuda_graph_capture, eager_capture
from spec_decode.draft_graphs import DraftGraphs
from tests.spec_decode.test_draft_model import _variant
from tests.spec_decode.test_spec_formats import V, eagle1_tensors, eagle3_tensors, write_eagle1, write_eagle3

K = 3
KNOBS = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks=40,
             max_model_len=48, attention_backend="triton", enable_prefix_caching=False)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(V) for _ in range(n)] for n in (5, 9, 7)]  # three requests: padded to 4


def _greedy() -> list[SamplingParams]:  # different lengths: budgets < k at each request's end, batch shrinks
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 7, 5)]


def _spec(kind: str, tmp_path, checkpoint) -> dict:
    if kind == "eagle":
        return {"method": "eagle", "model": str(write_eagle1(tmp_path / "eagle", eagle1_tensors(21)))}
    if kind == "eagle3":
        tensors = eagle3_tensors(22, sorted(random.Random(0).sample(range(V), 96)))
        head = write_eagle3(tmp_path / "eagle3", tensors, eagle_aux_hidden_state_layer_ids=[0, 1, 2])
        return {"method": "eagle3", "model": str(head)}
    noisy = torch.Generator().manual_seed(0)  # a perturbed target: it drafts well, not perfectly
    draft = _variant(checkpoint, tmp_path / "draft",
                     lambda name, w: w + 0.05 * torch.randn(w.shape, generator=noisy) if w.dim() == 2 else w)
    return {"method": "draft_model", "model": str(draft)}


def _run(llm: LLM, prompts, params) -> tuple[list[list[int]], list[dict[str, list[int]]], list[tuple[int, int, int]]]:
    """Tokens, every step's proposal, and per graph replay (requests, requests that drafted, longest entry)."""
    proposer, proposals, replays = llm.engine.runner.proposer, [], []
    propose, graphs = proposer.propose, getattr(proposer, "graphs", None)

    def spy(outcome):
        proposal = propose(outcome)
        proposals.append(proposal.token_ids)
        return proposal

    proposer.propose = spy
    if graphs is not None:
        def counting_run(block_table, rows, tokens, starts, lens, budgets, **kwargs):
            replays.append((len(rows), sum(b > 0 for b in budgets), max(lens)))
            return DraftGraphs.run(graphs, block_table, rows, tokens, starts, lens, budgets, **kwargs)
        graphs.run = counting_run
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], proposals, replays


def _pair(path: str, spec: dict, device: str, capture, **knobs) -> tuple[LLM, LLM]:
    """(eager chain, graph chain) over the same checkpoints; the target's own graphs stay off."""
    spec, knobs = {**spec, "num_speculative_tokens": K}, KNOBS | knobs
    eager = LLM(path, device=device, cuda_graphs=False, speculative_config=spec, **knobs)
    llm = LLM(path, device=device, cuda_graphs=False, speculative_config=spec, **knobs)
    runner = llm.engine.runner
    runner.proposer.capture_cuda_graphs(sizes=[1, 2, 4], capture=capture, block_size=runner.block_size,
                                        max_blocks_per_req=runner.buffers.block_table.gpu.shape[1])
    return eager, llm


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
@pytest.mark.parametrize("kind", ["eagle3", "eagle", "draft_model"])
def test_graph_chain_drafts_what_the_eager_chain_drafts(kind, tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cpu", eager_capture)
    prompts = _prompts()
    want, want_proposals, _ = _run(eager, prompts, _greedy())
    got, proposals, replays = _run(llm, prompts, _greedy())
    assert got == want == [o.outputs[0].token_ids for o in LLM(str(checkpoint), device="cpu", **KNOBS).generate(
        prompts, _greedy(), use_tqdm=False)]
    assert proposals == want_proposals
    drafted = [d for _, d, _ in replays]
    assert 3 in drafted and 1 in drafted  # padded (3 -> 4) and single-request replays both ran
    assert len(replays) < len(proposals)  # the prompt chunks (entries longer than k + 1 rows) drafted eagerly
    assert any(len(d) < K for p in proposals for d in p.values() if d)  # budgets below k were cut


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
@pytest.mark.parametrize("kind", ["eagle3", "eagle", "draft_model"])
def test_prompt_chunks_of_at_most_k_plus_1_tokens_draft_from_the_graph(kind, tiny_checkpoint, tmp_path):
    """Entries of several rows per request (here prompt chunks of k + 1 tokens) replay with the right
    positions, slots, features and last rows."""
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cpu", eager_capture,
                       max_num_batched_tokens=K + 1)
    prompts, params = _prompts()[1:], _greedy()[1:]
    want, want_proposals, _ = _run(eager, prompts, params)
    got, proposals, replays = _run(llm, prompts, params)
    assert (got, proposals) == (want, want_proposals)
    assert max(e for _, _, e in replays) == K + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
def test_sampled_drafting_keeps_the_eager_chain(tiny_checkpoint, tmp_path):
    """A request that samples needs q and its own noise: the step drafts eagerly, with the same outputs."""
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec("eagle3", tmp_path, checkpoint), "cpu", eager_capture)
    params = _greedy()
    params[1] = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True, seed=3)
    want, want_proposals, _ = _run(eager, _prompts()[:2], params[:2])
    got, proposals, replays = _run(llm, _prompts()[:2], params[:2])
    assert (got, proposals) == (want, want_proposals)
    assert max(d for _, d, _ in replays) == 1  # only steps where request 1 (sampling) does not draft


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
def test_greedy_requests_asking_for_logprobs_still_draft_from_the_graph(tiny_checkpoint, tmp_path):
    """Logprobs are the target's, of the emitted tokens; drafts never carry them, so the graph serves the step."""
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec("eagle3", tmp_path, checkpoint), "cpu", eager_capture)
    params = [SamplingParams(**(vars(p) | dict(logprobs=2))) for p in _greedy()]
    want, want_proposals, _ = _run(eager, _prompts(), params)
    got, proposals, replays = _run(llm, _prompts(), params)
    assert (got, proposals) == (want, want_proposals)
    assert any(d == 3 for _, d, _ in replays)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["eagle3", "eagle", "draft_model"])
def test_graph_chain_matches_eager_on_cuda(kind, tiny_checkpoint, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cuda", cuda_graph_capture)
    prompts = _prompts()
    want, want_proposals, _ = _run(eager, prompts, _greedy())
    got, proposals, replays = _run(llm, prompts, _greedy())
    assert got == want and proposals == want_proposals
    assert any(d == 3 for _, d, _ in replays)


def test_a_drafter_that_syncs_in_forward_is_not_captured(tiny_checkpoint):
    """MoE routing reads expert counts on the host: a Mixtral drafter keeps the eager chain, whatever the target."""
    spec = {"method": "draft_model", "model": str(tiny_checkpoint("mixtral")), "num_speculative_tokens": K}
    llm = LLM(str(tiny_checkpoint("llama")), device="cpu", cuda_graphs=False, speculative_config=spec, **KNOBS)
    runner = llm.engine.runner
    runner.proposer.capture_cuda_graphs(sizes=[1, 2, 4], capture=eager_capture, block_size=runner.block_size,
                                        max_blocks_per_req=runner.buffers.block_table.gpu.shape[1])
    assert runner.proposer.graphs is None
