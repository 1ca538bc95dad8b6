"""Graph-captured drafting steps (spec_decode/draft_graphs.py: entry forward + chain) against the eager path.

On CPU the graph is stood in for by a re-run over the same persistent buffers (`eager_capture`), with the
Triton attention kernels under the interpreter: this checks the buffer plumbing (entry rows, padding,
per-step positions, seq lens and slots, the KV-write limit, the carried EAGLE feature). The GPU test
captures real graphs. Either way, every proposal must equal the eager chain's, and greedy outputs must
equal plain decoding's.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch

import research_lm.ops
from research_lm import LLM, SamplingParams
from research_lm.worker.cuda_graphs import DecodeGraphs, GraphPool, cuda_graph_capture, eager_capture
from research_lm.worker.spec import TokenTable
from spec_decode.draft_graphs import DraftGraphs, DraftSampling
from tests.spec_decode.spying import draft_values
from tests.spec_decode.test_draft_model import _variant
from tests.spec_decode.test_spec_formats import V, eagle1_tensors, eagle3_tensors, write_eagle1, write_eagle3

K = 3
KNOBS = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks=40,
             max_model_len=48, attention_backend="triton", enable_prefix_caching=False)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(V) for _ in range(n)] for n in (5, 9, 7)]  # three requests: padded to 4


def _greedy() -> list[SamplingParams]:  # different lengths: the batch shrinks
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


class Replay(NamedTuple):
    requests: int  # rows the graph ran
    drafting: int  # of which drafted
    longest_entry: int  # entry rows of the longest request
    sampled: bool  # the "sample" rule (else "argmax")


def _run(llm: LLM, prompts, params) -> tuple[list[list[int]], list[dict[str, list[int]]], list[Replay]]:
    """Tokens, every step's proposal (drafts, and q where kept), and the graph replays."""
    proposer, proposals, replays = llm.engine.runner.proposer, [], []
    graphs = getattr(proposer, "graphs", None)
    def spying(real):
        def spy(outcome):
            drafts = real(outcome)
            if drafts is not None:  # the values now: the next replay overwrites them
                proposals.append((draft_values(outcome, drafts), {r: q.cpu() for r, q in drafts.probs.items()}))
            return drafts
        return spy

    for name in ("propose_on_device", "propose"):  # at launch (the "verified" graph) or at collect
        setattr(proposer, name, spying(getattr(proposer, name)))
    if graphs is not None:
        def counting_run(block_table, rows, tokens, starts, lens, budgets, **kwargs):
            sampled = kwargs.get("sampling") is not None
            replays.append(Replay(len(rows), sum(b > 0 for b in budgets), max(lens), sampled))
            return DraftGraphs.run(graphs, block_table, rows, tokens, starts, lens, budgets, **kwargs)
        graphs.run = counting_run
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], proposals, replays


def _same_proposals(got, want) -> bool:
    """Drafts equal, and q equal to float32 rounding (graph and eager reduce over different row counts)."""
    return len(got) == len(want) and all(
        g[0] == w[0] and g[1].keys() == w[1].keys() and all(torch.allclose(g[1][r], w[1][r], atol=1e-6) for r in g[1])
        for g, w in zip(got, want))


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
@pytest.mark.parametrize("kind", ["eagle3", "draft_model"])  # (EAGLE: test_graph_chain_matches_eager_on_cuda; 20 s)
def test_graph_chain_drafts_what_the_eager_chain_drafts(kind, tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("llama")
    # max_model_len 16: request 1 (9 + 7 tokens) ends at it, where its draft budgets fall below k
    eager, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cpu", eager_capture, max_model_len=16)
    prompts = _prompts()
    want, want_proposals, _ = _run(eager, prompts, _greedy())
    graphs, cuts = llm.engine.runner.proposer.graphs, []
    graphs.split = lambda lens, *rows: cuts.append(DraftGraphs.split(graphs, lens, *rows)) or cuts[-1]
    got, proposals, replays = _run(llm, prompts, _greedy())
    assert got == want == [o.outputs[0].token_ids for o in LLM(
        str(checkpoint), device="cpu", **(KNOBS | {"max_model_len": 16})).generate(prompts, _greedy(), use_tqdm=False)]
    assert _same_proposals(proposals, want_proposals)
    drafted = [r.drafting for r in replays]
    assert 3 in drafted and 1 in drafted  # padded (3 -> 4) and single-request replays both ran
    assert len(replays) == len(proposals)  # every step replayed, prompt chunks too:
    assert any(c > 0 for cut, _, _ in cuts for c in cut)  # entries longer than k + 1 rows caught up eagerly first
    assert any(len(d) < K for p, _ in proposals for d in p.values() if d)  # budgets below k were cut


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
# (EAGLE and the draft model enter prompts through the same graphs: 110 s of CI, kept on the GPU)
@pytest.mark.parametrize("kind,sampled", [("eagle3", False)])  # (sampled: the sample graph's own test; 30 s)
def test_prompts_enter_through_prompt_graphs_without_an_eager_catch_up(kind, sampled, tiny_checkpoint, tmp_path):
    """One request at a time (batch 1): prompts of 5, 9 and 14 tokens enter whole through the (1, 8) and (1, 16)
    prompt graphs, nothing caught up eagerly; a 20-token prompt, past them, catches its first rows up eagerly and
    enters its last 16. The proposals equal the eager chain's, the outputs plain decoding's (greedy) or the eager
    chain's (sampled: the "sample" rule's prompt graphs)."""
    checkpoint = tiny_checkpoint("llama")
    knobs = dict(max_num_seqs=1, max_num_batched_tokens=32)
    eager, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cpu", eager_capture, **knobs)
    runner = llm.engine.runner
    runner.proposer.capture_cuda_graphs(sizes=[1], capture=eager_capture, block_size=runner.block_size,
                                        max_blocks_per_req=runner.buffers.block_table.gpu.shape[1],
                                        prefill_sizes=[8, 16])
    graphs, cuts = runner.proposer.graphs, []
    assert graphs.prefill == [8, 16] and graphs.entry_limit(1) == 16 and graphs.entry_limit(2) == K + 1
    graphs.split = lambda lens, *rows: cuts.append(DraftGraphs.split(graphs, lens, *rows)) or cuts[-1]
    rng = random.Random(3)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 9, 14, 20)]
    params = [SamplingParams(temperature=0.8 if sampled else 0.0, max_tokens=6, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    want, want_proposals, _ = _run(eager, prompts, params)
    got, proposals, replays = _run(llm, prompts, params)
    assert got == want and _same_proposals(proposals, want_proposals)
    if not sampled:
        plain = LLM(str(checkpoint), device="cpu", **(KNOBS | knobs)).generate(prompts, params, use_tqdm=False)
        assert got == [o.outputs[0].token_ids for o in plain]
    assert all(r.sampled == sampled for r in replays if r.drafting)
    entries, extra = [r.longest_entry for r in replays], int(kind == "draft_model")  # its entry: prompt + token 1
    assert {5 + extra, 9 + extra, 14 + extra, 16} <= set(entries) and max(entries) == 16
    assert [c for cut, _, _ in cuts for c in cut if c] == [4 + extra]  # only the 20-row prompt caught up


def test_eagle3_greedy_graph_drafts_argmax_its_draft_vocabulary(tiny_checkpoint, tmp_path):
    """The graphs' greedy pick over EAGLE-3's draft vocabulary (no scatter to the target's) equals the argmax
    of the scattered logits, ties included; a head whose draft ids do not ascend with their target ids (ties
    could break differently) keeps the scatter."""
    checkpoint = tiny_checkpoint("llama")
    ids = sorted(random.Random(0).sample(range(V), 96))

    def proposer(tensors, name):
        head = write_eagle3(tmp_path / name, tensors, eagle_aux_hidden_state_layer_ids=[0, 1, 2])
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
        return LLM(str(checkpoint), device="cpu", speculative_config=spec, **KNOBS).engine.runner.proposer

    ascending = proposer(eagle3_tensors(22, ids), "ascending")
    hidden = torch.randn(64, ascending.head.fc.weight.shape[0], generator=torch.Generator().manual_seed(0))
    hidden[:8] = 0  # every draft logit equal: the tie goes to the lowest target id either way
    want = ascending.head.compute_logits(hidden).argmax(dim=-1)
    assert torch.equal(ascending._greedy_argmax()(hidden), want) and want[0] == ids[0]
    shuffled, perm = eagle3_tensors(22, ids), list(ids)
    random.Random(1).shuffle(perm)
    shuffled["d2t"] = torch.tensor(perm) - torch.arange(len(perm))
    assert proposer(shuffled, "shuffled")._greedy_argmax() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
@pytest.mark.parametrize("kind", ["eagle3"])  # (EAGLE, the draft model: the same split; 30 s of CI)
def test_prompt_chunks_of_at_most_k_plus_1_tokens_draft_from_the_graph(kind, tiny_checkpoint, tmp_path):
    """Entries of several rows per request (here prompt chunks of k + 1 tokens) replay with the right
    positions, slots, features and last rows."""
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cpu", eager_capture,
                       max_num_batched_tokens=K + 1)
    prompts, params = _prompts()[1:], _greedy()[1:]
    want, want_proposals, _ = _run(eager, prompts, params)
    got, proposals, replays = _run(llm, prompts, params)
    assert got == want and _same_proposals(proposals, want_proposals)
    assert max(r.longest_entry for r in replays) == K + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
@pytest.mark.parametrize("kind,sampled", [("draft_model", False), ("eagle3", True)])  # (eagle3 greedy: 34 s of CI)
def test_drafts_in_the_token_table_feed_the_next_step(kind, sampled, tiny_checkpoint, tmp_path):
    """A replay's drafts go into the runner's token table on the device, where the next step's gather reads them. A
    token budget of 6 cuts drafts short and leaves a request with drafts unscheduled for a step (they wait in the
    table); the outputs equal the eager chain's, and greedy ones plain decoding's."""
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cpu", eager_capture,
                       max_num_batched_tokens=6)
    scheduler, waited = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def spy_schedule():
        out = schedule()
        ids = {s.request.request_id for s in out.scheduled}
        waited.extend(r.request_id for r in scheduler.running if r.request_id not in ids and r.num_spec_tokens)
        return out

    scheduler.schedule = spy_schedule
    rng = random.Random(5)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (3, 12, 1)]  # request 1's last prompt chunk,
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 7, 12)]  # then drafts,
    if sampled:  # push request 2 (which drafted) out of a step
        params[1] = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True, seed=3)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    if not sampled:
        plain = LLM(str(checkpoint), device="cpu", **(KNOBS | dict(max_num_batched_tokens=6)))
        assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert waited  # some request's drafts waited a step in the table


def _with_verify_graphs(llm: LLM) -> list[int]:
    """Give the target verify graphs (query length k + 1, re-run on CPU) beside the draft graphs; the batch size
    of every step that drafted before verification."""
    runner, early = llm.engine.runner, []
    runner.cuda_graphs = DecodeGraphs(
        runner.forward, runner.buffers, runner.backends, sizes=[1, 2, 4], query_lens=[1, K + 1],
        block_size=runner.block_size, max_seq_len=runner.max_model_len, compute_logits=runner.model.compute_logits,
        vocab_size=runner.vocab_size, capture=eager_capture)
    runner.proposer.propose_on_device = _counting(runner.proposer.propose_on_device, early)
    # As the runner captures them: the "verified" graphs read the verify graphs' argmax and input ids in place and
    # write the drafts into the runner's token table.
    runner.proposer.capture_cuda_graphs(sizes=[1, 2, 4], capture=eager_capture, block_size=runner.block_size,
                                        max_blocks_per_req=runner.buffers.block_table.gpu.shape[1],
                                        verified_inputs=(runner.cuda_graphs.greedy_ids, runner.buffers.input_ids.gpu,
                                                         runner.buffers.positions.gpu),
                                        tokens=runner.state.table(runner.buffers.request_rows.gpu))
    assert runner.proposer.graphs.verified_in_place and runner.proposer.graphs.drafts_verified
    return early


def _counting(propose_on_device, early: list[int]):
    """`propose_on_device`, noting the batch size of every step it drafts at launch (into the token table)."""
    def spy(outcome):
        drafts = propose_on_device(outcome)
        if drafts is not None:
            assert drafts.in_table
            early.append(len(outcome.requests))
        return drafts
    return spy


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
# (EAGLE's head as EAGLE-3's here, 65 s of CI; the draft model's "verified" entry: test_the_verified_rule_enters_...,
# its whole greedy run on the GPU, 130 s of CI)
@pytest.mark.parametrize("kind", ["eagle3"])
def test_greedy_verify_steps_draft_before_the_host_sees_their_tokens(kind, tiny_checkpoint, tmp_path):
    """An all-greedy step where every request verifies k drafts from a graph drafts from the "verified" graph right
    behind it: acceptance, entry rows, last rows and budgets computed on the device from the verify's argmax. The
    proposals equal the eager chain's, budgets cut by max_tokens and by max_model_len (the third request runs
    into it) included, and the outputs equal plain decoding's."""
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cpu", eager_capture, max_model_len=32)
    early = _with_verify_graphs(llm)
    rng = random.Random(7)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 9, 22)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, None)]
    want, want_proposals, _ = _run(eager, prompts, params)
    got, proposals, _ = _run(llm, prompts, params)
    plain = LLM(str(checkpoint), device="cpu", **(KNOBS | dict(max_model_len=32))).generate(prompts, params,
                                                                                           use_tqdm=False)
    assert got == want == [o.outputs[0].token_ids for o in plain]
    assert _same_proposals(proposals, want_proposals)
    assert 3 in early and 1 in early  # padded (3 -> 4) and single-request steps drafted early
    assert len(got[2]) == 32 - 22  # ran into max_model_len
    assert any(0 < len(d) < K for p, _ in proposals for d in p.values())  # budgets below k were cut


NEVER = 1 << 40


def _table(device: str, rows: list[int], num_tokens: list[int], num_drafts: list[int], stop_at: list[int],
           size: int) -> TokenTable:
    """A token table of 8 rows (random tokens) whose request-rows buffer holds `rows` then stale real rows (7) up to
    `size`: the graph must write nothing for padding."""
    table = TokenTable(torch.randint(V, (8, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(9)),
                       torch.zeros(8, dtype=torch.int32), torch.full((size,), 7, dtype=torch.int32),
                       torch.full((8,), K, dtype=torch.int32), torch.full((8,), NEVER, dtype=torch.int64))
    index = torch.tensor(rows)
    table.rows[: len(rows)] = index.int()
    table.num_tokens[index] = torch.tensor(num_tokens, dtype=torch.int32)
    table.num_drafts[index] = torch.tensor(num_drafts, dtype=torch.int32)
    table.stop_at[index] = torch.tensor(stop_at)
    return TokenTable(*(x.to(device) for x in (table.token_ids, table.num_tokens, table.rows, table.num_drafts,
                                                table.stop_at)))


def _verified_against_entry(proposer, device: str, capture) -> None:
    """The "verified" rule over a verify step's argmax g and input x (requests accepting 0, 1 and k drafts, and one
    whose x matches g everywhere but which verified only k - 1 real drafts; the second's room and the fourth's
    max_tokens cut their budgets) drafts and writes the drafter's KV exactly as the "argmax" rule over the rows the
    host would enter: the emitted tokens g[i, :n_acc + 1] at positions c + s .. c + s + n_acc (s: 0 for EAGLE, 1 for a
    draft model), budgets `draft_budget`. It writes each request's k drafts after its tokens in the token table and
    its budget into num_drafts, at the request's table row, and nothing for the padding rows."""
    gen = torch.Generator().manual_seed(3)
    q, n_acc, starts = K + 1, [0, 1, K, K - 1], [3, 7, 0, 2]
    n, t, max_len = len(n_acc), len(n_acc) * q, proposer.max_model_len
    rows, filled = [5, 2, 6, 0], [10, max_len - 2, 12, 9]  # table rows (out of order); tokens after the step
    table = _table(device, rows, filled, [K, K, K, K - 1], [NEVER, NEVER, NEVER, 9], size=8)
    proposer.capture_cuda_graphs(sizes=[8], capture=capture, block_size=4, max_blocks_per_req=12, tokens=table)
    graphs, shift = proposer.graphs, proposer.graphs.entry_shift
    g = torch.randint(V, (n, q), generator=gen)
    x = torch.randint(V, (n, q), generator=gen)
    for i, a in enumerate(n_acc):
        x[i, 1 : a + 1] = g[i, :a]
        if a < K:
            x[i, a + 1] = (g[i, a] + 1) % V
    x[3, 1:] = g[3, :K]  # all k match, but only k - 1 are real drafts
    features = None if graphs.features is None else torch.randn(
        t, graphs.features.shape[1], generator=gen).to(device, graphs.features.dtype)
    block_table = torch.arange(1, 1 + n * 4, dtype=torch.int32, device=device).view(n, 4)  # 16 slots each
    budgets = [K, 1, K, 0]  # the second cut by its room, the fourth by max_tokens
    before = (table.token_ids.clone(), table.num_drafts.clone())

    def kv() -> list[torch.Tensor]:
        return [layer.kv_cache.clone() for layer in proposer.cache_layers]

    for layer in proposer.cache_layers:
        layer.kv_cache.zero_()
    entered = [i * q + j for i, a in enumerate(n_acc) for j in range(a + 1)]  # the rows of the emitted tokens
    graphs.run(block_table, range(n), g.view(-1)[entered].tolist(), [c + shift for c in starts],
               [a + 1 for a in n_acc], budgets, feature_rows=None if features is None else entered,
               features=None if features is None else lambda rows, out: out.copy_(features[rows]))
    want_drafts, want_kv = graphs.drafts(range(n)).cpu(), kv()
    for layer in proposer.cache_layers:
        layer.kv_cache.zero_()
    positions = (torch.tensor(starts)[:, None] + torch.arange(q)).view(-1)
    graphs.run_verified(block_table, (g.view(-1).to(device), x.view(-1).to(device), positions.to(device)),
                        None if features is None else lambda out: out.copy_(features))
    got_drafts = graphs.drafts(range(n)).cpu()
    assert [got_drafts[i, :b].tolist() for i, b in enumerate(budgets)] == [
        want_drafts[i, :b].tolist() for i, b in enumerate(budgets)]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(kv(), want_kv, strict=True))
    token_ids, num_drafts = table.token_ids.cpu(), table.num_drafts.cpu()
    assert num_drafts[rows].tolist() == budgets
    for i, (row, f) in enumerate(zip(rows, filled, strict=True)):
        assert token_ids[row, f : f + K].tolist() == got_drafts[i].tolist()
        assert torch.equal(token_ids[row, :f], before[0][row, :f].cpu())
    assert torch.equal(token_ids[7], before[0][7].cpu()) and num_drafts[7] == before[1][7]  # padding: nothing


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
@pytest.mark.parametrize("kind", ["eagle3", "eagle", "draft_model"])
def test_the_verified_rule_enters_the_accepted_tokens(kind, tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("llama")
    _, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cpu", eager_capture)
    _verified_against_entry(llm.engine.runner.proposer, "cpu", eager_capture)


def _bookkeeping_cases(device: str, width: int) -> list[dict]:
    """`DraftGraphs.run` arguments for 3 requests: entries of 1, 2 and 4 rows with budgets k, 1 and 0 ("argmax"),
    then the same with the "sample" rule; then `run_verified` arguments with 0, 1 and k - 1 drafts accepted (the
    last matches all k, but verified k - 1 real ones: `_bookkeeping_table`)."""
    gen = torch.Generator().manual_seed(4)
    q, n = K + 1, 3
    g, x = torch.randint(V, (n, q), generator=gen), torch.randint(V, (n, q), generator=gen)
    x[0, 1], x[1, 1], x[1, 2], x[2, 1:] = g[0, 0] + 1, g[1, 0], g[1, 1] + 1, g[2, :K]  # 0, 1 and k match
    features = torch.randn(n * q, width, generator=gen)
    block_table = torch.arange(1, 13, dtype=torch.int32, device=device).view(3, 4)
    starts = [3, 7, 0]
    positions = (torch.tensor(starts)[:, None] + torch.arange(q)).view(-1)
    packed = dict(block_table=block_table, rows=range(3), starts=starts, tokens=[5, 6, 7, 8, 9, 10, 11],
                  lens=[1, 2, 4], budgets=[K, 1, 0], feature_rows=list(range(7)),
                  features=lambda rows, out: out.copy_(features[rows.cpu() % (n * q)]))
    sampling = DraftSampling(temperature=[1.0, 0.5, 1.0], greedy=[True, False, False], seeds=[1, 2, 3],
                             positions=[4, 5, 6])
    return [packed, packed | dict(sampling=sampling),
            dict(block_table=block_table, features=lambda out: out.copy_(features),
                 verified=(g.view(-1).to(device), x.view(-1).to(device), positions.to(device)))]


def _bookkeeping_table(device: str) -> TokenTable:
    """Table rows 2, 0, 3 (padding: the stale row 7); budgets k, 1 (room) and 0 (max_tokens) after the step."""
    return _table(device, [2, 0, 3], [10, 48 - 2, 12], [K, K, K - 1], [NEVER, NEVER, 12], size=4)


def _bookkeeping_of(proposer, device: str, fused: bool, monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Every record a replay leaves (entry, chain, last rows), the drafts (the padding row's are noise: its chain
    attends over nothing) and the drafter's KV, per case, from graphs
    captured with the bookkeeping kernel (`fused`) or the torch path; the rest of the forward stays on torch."""
    table = _bookkeeping_table(device)
    with monkeypatch.context() as mp:
        mp.setattr(research_lm.ops, "FUSED_DEVICE_TYPES", (device,) if fused else ())
        proposer.capture_cuda_graphs(sizes=[4], capture=eager_capture, block_size=4, max_blocks_per_req=12,
                                     tokens=table)
    graphs, out = proposer.graphs, []
    for case in _bookkeeping_cases(device, graphs.features.shape[1]):
        for layer in proposer.cache_layers:
            layer.kv_cache.zero_()
        if "verified" in case:
            graphs.run_verified(**case)
        else:
            graphs.run(**case)
        out.append({name: getattr(graphs, name).clone() for name in (
            "entry_qsl", "entry_seq_lens", "entry_slots", "query_start_loc", "seq_lens", "slot_mapping", "positions",
            "table_rows")} | {
            "drafts": graphs.drafts(range(3)), "last": graphs.last_rows[:3].clone() if fused else None,
            "kv": torch.stack([layer.kv_cache for layer in proposer.cache_layers]),
            "token_ids": table.token_ids.clone(), "num_drafts": table.num_drafts.clone()})
    return out


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant")),
    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_bookkeeping_kernel_writes_what_the_torch_path_writes(device, tiny_checkpoint, tmp_path, monkeypatch):
    """spec_decode/draft_bookkeeping.py (under the interpreter on CPU): every entry and chain record, and so the
    drafts, the drafter's KV and ("verified") the token table, equal the torch path's for the "argmax", "sample" and
    "verified" rules (padding row included)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    checkpoint = tiny_checkpoint("llama")
    _, llm = _pair(str(checkpoint), _spec("eagle3", tmp_path, checkpoint), device, eager_capture)
    proposer = llm.engine.runner.proposer
    want = _bookkeeping_of(proposer, device, False, monkeypatch)
    got = _bookkeeping_of(proposer, device, True, monkeypatch)
    for case, (w, g) in enumerate(zip(want, got, strict=True)):
        for name in w:
            if name != "last":
                assert torch.equal(w[name], g[name]), (case, name)
    assert got[2]["last"].tolist() == [0, 4 + 1, 8 + K - 1]  # "verified": 0, 1 and k - 1 accepted
    assert got[2]["num_drafts"][[2, 0, 3, 7]].tolist() == [K, 1, 0, K]  # the budgets; the padding's stale row kept
    assert got[2]["table_rows"].tolist() == [2, 0, 3, -1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
def test_steps_that_are_not_plain_greedy_verify_before_drafting(tiny_checkpoint, tmp_path):
    """A sampled request, a penalty or a min_tokens ban in the batch keeps the usual order (verify, then draft),
    with the same outputs as the eager chain; once the odd request finishes, the rest draft early."""
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec("eagle3", tmp_path, checkpoint), "cpu", eager_capture)
    early = _with_verify_graphs(llm)
    params = _greedy()
    params[0] = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    params[2] = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=1.3)
    params[1] = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True, seed=3)
    want, want_proposals, _ = _run(eager, _prompts(), params)
    got, proposals, _ = _run(llm, _prompts(), params)
    assert got == want and _same_proposals(proposals, want_proposals)
    assert early and set(early) == {1}  # only request 0, alone


def _sampled_params() -> list[SamplingParams]:
    params = _greedy()
    params[1] = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True, seed=3)
    params[2] = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=2**64 - 5)  # past int64
    return params


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
@pytest.mark.parametrize("kind", ["eagle3"])  # (the draft model's sample graph: the GPU test; 26 s of CI)
def test_sampled_drafting_replays_the_sample_graph(kind, tiny_checkpoint, tmp_path):
    """Requests that sample with a temperature (beside a greedy one) draft from the "sample" graph: the same
    drafts (seeded noise at each output position) and the same q as the eager chain, so the same outputs."""
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cpu", eager_capture)
    want, want_proposals, _ = _run(eager, _prompts(), _sampled_params())
    got, proposals, replays = _run(llm, _prompts(), _sampled_params())
    assert got == want and _same_proposals(proposals, want_proposals)
    assert any(r.sampled and r.drafting == 3 for r in replays)
    assert any(q for _, q in proposals)  # q was kept and compared


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
def test_top_p_drafting_keeps_the_eager_chain(tiny_checkpoint, tmp_path):
    """top-p (like top-k, min-p and penalties) is not in the graphs: a step where such a request drafts runs
    eagerly, with the same outputs."""
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec("eagle3", tmp_path, checkpoint), "cpu", eager_capture)
    params = _greedy()
    params[1] = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=7, ignore_eos=True, seed=3)
    want, want_proposals, _ = _run(eager, _prompts()[:2], params[:2])
    got, proposals, replays = _run(llm, _prompts()[:2], params[:2])
    assert got == want and _same_proposals(proposals, want_proposals)
    assert max(r.drafting for r in replays) == 1 and not any(r.sampled for r in replays)  # never request 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
def test_greedy_requests_asking_for_logprobs_still_draft_from_the_graph(tiny_checkpoint, tmp_path):
    """Logprobs are the target's, of the emitted tokens; drafts never carry them, so the graph serves the step."""
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec("eagle3", tmp_path, checkpoint), "cpu", eager_capture)
    params = [SamplingParams(**(vars(p) | dict(logprobs=2))) for p in _greedy()]
    want, want_proposals, _ = _run(eager, _prompts(), params)
    got, proposals, replays = _run(llm, _prompts(), params)
    assert got == want and _same_proposals(proposals, want_proposals)
    assert any(r.drafting == 3 for r in replays)


@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("kind", ["eagle3", "eagle", "draft_model"])
def test_graph_chain_matches_eager_on_cuda(kind, sampled, tiny_checkpoint, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    checkpoint = tiny_checkpoint("llama")
    eager, llm = _pair(str(checkpoint), _spec(kind, tmp_path, checkpoint), "cuda", cuda_graph_capture)
    prompts, params = _prompts(), _sampled_params if sampled else _greedy
    want, want_proposals, _ = _run(eager, prompts, params())
    got, proposals, replays = _run(llm, prompts, params())
    assert got == want and _same_proposals(proposals, want_proposals)
    assert any(r.drafting == 3 and r.sampled == sampled for r in replays)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["eagle3", "eagle", "draft_model"])
def test_drafting_before_verification_on_cuda(kind, tiny_checkpoint, tmp_path):
    """Real graphs: the "verified" rule against the entry rows, and whole greedy runs with the target's verify
    graphs on (every step that can drafts early) against the eager chain and plain decoding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    checkpoint = tiny_checkpoint("llama")
    spec = {**_spec(kind, tmp_path, checkpoint), "num_speculative_tokens": K}
    eager, graphed = _pair(str(checkpoint), spec, "cuda", cuda_graph_capture)
    _verified_against_entry(graphed.engine.runner.proposer, "cuda", cuda_graph_capture)
    # graphs on: verify and draft; synchronous, so that every step hands out its proposal (`_run` checks them)
    llm = LLM(str(checkpoint), device="cuda", speculative_config=spec, async_scheduling=False, **KNOBS)
    proposer, early = llm.engine.runner.proposer, []
    proposer.propose_on_device = _counting(proposer.propose_on_device, early)
    prompts, params = _prompts(), [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (16, 12, 9)]
    want, want_proposals, _ = _run(eager, prompts, params)
    got, proposals, _ = _run(llm, prompts, params)
    plain = LLM(str(checkpoint), device="cuda", cuda_graphs=False, **KNOBS).generate(prompts, params, use_tqdm=False)
    assert got == want == [o.outputs[0].token_ids for o in plain]
    assert _same_proposals(proposals, want_proposals) and 3 in early


def test_a_drafter_that_syncs_in_forward_is_not_captured(tiny_checkpoint):
    """MoE routing reads expert counts on the host: a Mixtral drafter keeps the eager chain, whatever the target."""
    spec = {"method": "draft_model", "model": str(tiny_checkpoint("mixtral")), "num_speculative_tokens": K}
    llm = LLM(str(tiny_checkpoint("llama")), device="cpu", cuda_graphs=False, speculative_config=spec, **KNOBS)
    runner = llm.engine.runner
    runner.proposer.capture_cuda_graphs(sizes=[1, 2, 4], capture=eager_capture, block_size=runner.block_size,
                                        max_blocks_per_req=runner.buffers.block_table.gpu.shape[1])
    assert runner.proposer.graphs is None


def test_buffers_hold_every_layout():
    """The staging copy and the entry rows are sized by the largest of all layouts, each on its own: with k = 1
    and 100 requests the decode layout stages the most (4 x 200 + 8 x 100 + 1) while the 256-row prompt layout
    has the most entry rows."""
    graphs = DraftGraphs(entry=None, step=None, logits=None, argmax=None, layers=[], num_speculative_tokens=1,
                         vocab_size=8, sizes=[100], query_len=2, block_size=4, max_blocks_per_req=4, max_seq_len=1024,
                         features=(3, torch.float32), device=torch.device("cpu"), capture=eager_capture,
                         prefill_sizes=[256])
    assert graphs.prefill == [256]
    assert graphs.staging.numel() == 4 * 200 + 8 * 100 + 1 > 4 * 256 + 8 + 1
    assert graphs.features.shape[0] == graphs.entry_slots.numel() == 256
    single = DraftGraphs(entry=None, step=None, logits=None, argmax=None, layers=[], num_speculative_tokens=1,
                         vocab_size=8, sizes=[1], query_len=1, block_size=4, max_blocks_per_req=4, max_seq_len=1024,
                         features=None, device=torch.device("cpu"), capture=eager_capture, prefill_sizes=[256])
    assert single.prefill == []  # no multi-token attention (q = 1): no prompt graphs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_drafts_gathers_graph_rows_on_the_device(device):
    """`drafts(rows)`: row i holds drafts 1 .. k of graph row rows[i], as a new contiguous int64 tensor on the device
    that the next replay does not overwrite, for a run of rows, any other order and none; on CUDA with no host sync
    (the sync debug mode raises on one)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graphs = DraftGraphs(entry=None, step=None, logits=None, argmax=None, layers=[], num_speculative_tokens=K,
                         vocab_size=8, sizes=[5], query_len=K + 1, block_size=4, max_blocks_per_req=4, max_seq_len=64,
                         features=None, device=torch.device(device), capture=eager_capture)
    graphs._drafts.copy_(torch.arange(K * 5).view(K, 5))  # draft j + 1 of graph row r: j * 5 + r
    cases = [range(5), [1, 2, 3], [3, 0, 4], [2, 2], []]
    sync_mode = torch.cuda.get_sync_debug_mode() if device == "cuda" else None
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = [graphs.drafts(rows) for rows in cases]
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(sync_mode)
    graphs._drafts.fill_(-1)  # a later replay
    for rows, d in zip(cases, got, strict=True):
        assert d.shape == (len(rows), K) and d.dtype == torch.int64 and d.device.type == device and d.is_contiguous()
        assert d.tolist() == [[j * 5 + r for j in range(K)] for r in rows]
    with pytest.raises(AssertionError, match="outside 0 .. 4"):
        graphs.drafts([0, 5])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter variant; the GPU test covers CUDA")
@pytest.mark.parametrize("kind, blocks", [("eagle3", 16)])  # (EAGLE at 40 blocks, EAGLE-3 with room: 70 / 46 s of CI)
def test_async_scheduling_launches_the_next_verify_step_before_verifying(kind, blocks, tiny_checkpoint, tmp_path):
    """Async scheduling with verify graphs and drafting behind them: a verify step verifies and drafts on the device,
    and the engine launches the next verify step before it collects this one, while the host's counts still assume
    every draft accepted. Outputs equal plain greedy decoding's, with
    requests that finish by max_tokens while a step of theirs is in flight, one stopped by a stop token, one running
    into max_model_len and (16 blocks) preemption; the draft and acceptance counts equal the synchronous eager
    engine's; every block comes back."""
    checkpoint = tiny_checkpoint("llama")
    knobs = KNOBS | dict(max_model_len=48, num_gpu_blocks=blocks)
    spec = {**_spec(kind, tmp_path, checkpoint), "num_speculative_tokens": K}
    sync = LLM(str(checkpoint), device="cpu", cuda_graphs=False, speculative_config=spec, **knobs)
    llm = LLM(str(checkpoint), device="cpu", cuda_graphs=False, async_scheduling=True, speculative_config=spec, **knobs)
    early = _with_verify_graphs(llm)
    _check_async_verify_steps(llm, sync, LLM(str(checkpoint), device="cpu", **knobs))
    assert early
    if blocks == 16:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_async_scheduling_of_verify_steps_on_cuda(kind, tiny_checkpoint, tmp_path):
    """Real graphs, async scheduling on (the CUDA default): the same as the interpreter variant above."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    checkpoint = tiny_checkpoint("llama")
    knobs = KNOBS | dict(max_model_len=48, device="cuda")
    spec = {**_spec(kind, tmp_path, checkpoint), "num_speculative_tokens": K}
    sync = LLM(str(checkpoint), async_scheduling=False, speculative_config=spec, **knobs)
    llm = LLM(str(checkpoint), speculative_config=spec, **knobs)
    assert llm.engine.async_scheduling and llm.engine.runner.cuda_graphs is not None
    _check_async_verify_steps(llm, sync, LLM(str(checkpoint), cuda_graphs=False, **knobs))


def _check_async_verify_steps(llm: LLM, sync: LLM, plain: LLM) -> None:
    """Three greedy requests (one stopped by a stop token, one running into max_model_len 48) through `llm`:
    plain's tokens and finish reasons, sync's draft and acceptance counts, steps launched ahead, every block back."""
    engine = llm.engine
    collect, ahead = engine.runner.collect, []
    engine.runner.collect = lambda pending: ahead.append(engine._in_flight is not None) or collect(pending)
    rng = random.Random(7)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 9, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, None)]
    first = plain.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    j = next(j for j in range(6, len(first)) if first[j] not in first[:j])
    params[0] = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[first[j]])
    want = plain.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    assert got[0].outputs[0].finish_reason == "stop" and len(got[0].outputs[0].token_ids) == j + 1
    assert len(got[2].outputs[0].token_ids) == 48 - 30  # ran into max_model_len
    for o, w in zip(got, sync.generate(prompts, params, use_tqdm=False), strict=True):
        assert (o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) == (
            w.metrics.num_draft_tokens, w.metrics.num_accepted_tokens)
    assert sum(ahead) >= 3, "verify steps should have the next one launched before they are collected"
    assert engine.kv_cache.num_free_blocks == engine.num_blocks - 1


@pytest.mark.parametrize("kind", ["eagle3", "draft_model"])
def test_the_target_and_the_drafter_capture_through_one_graph_pool(kind, tiny_checkpoint, tmp_path):
    """One CUDA-graph mechanism: the runner's `GraphPool` captures the target's decode / verify graphs and every draft
    graph, in one memory pool."""
    checkpoint = tiny_checkpoint("llama")
    llm = LLM(str(checkpoint), device="cpu", cuda_graphs=False, speculative_config={
        **_spec(kind, tmp_path, checkpoint), "num_speculative_tokens": K}, **KNOBS)
    runner = llm.engine.runner
    assert runner.capture_cuda_graphs([1, 2], prefill_sizes=[], capture=eager_capture) is None
    target, drafter = runner.cuda_graphs, runner.proposer.graphs
    assert isinstance(target.pool, GraphPool) and drafter.pool is target.pool
    assert target.pool.num_graphs == len(target._replay) + len(drafter._replay) > len(target._replay) == 4
