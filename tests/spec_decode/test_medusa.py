"""Medusa heads (`FasterDecoding/medusa-*` layout): top-1 chain proposals from the target's last
verified hidden state.

Invariants:
- Greedy decoding with Medusa is token-identical to greedy decoding without speculation, under
  chunked prefill, preemption, prefix caching and a mixed greedy/sampled batch.
- Greedy draft j is argmax(lm_head_j(ResBlocks_j(h[n-1]))), h[n-1] the target's final normed hidden
  state at the position whose logits gave the newest token (computed here with `transformers`).
- Heads that always propose a token the target never emits: identical outputs, nothing accepted.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from research_lm import LLM, SamplingParams
from tests.spec_decode.spying import record_drafts
from tests.spec_decode.test_spec_formats import H, V, medusa_tensors, write_medusa

KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=5,
             num_gpu_blocks=24, max_model_len=64)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (4, 13, 19, 22, 8)]
    return prompts + [prompts[2]]


def _params(n: int) -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True, seed=3)
    return [sampled if i == 1 else greedy for i in range(n)]


def _reference(w: dict[str, torch.Tensor], hidden: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """FasterDecoding's MedusaModel.forward on one hidden state: head h = ResBlock(s) then lm_head."""
    drafts, gaps = [], []
    for h in range(k):
        x = hidden
        x = x + F.silu(x @ w[f"{h}.0.linear.weight"].T + w[f"{h}.0.linear.bias"])
        logits = x @ w[f"{h}.1.weight"].T
        top = logits.topk(2).values
        drafts.append(int(logits.argmax()))
        gaps.append(float(top[0] - top[1]))
    return drafts, gaps


def test_medusa_greedy_identity_and_reference_drafts(tiny_checkpoint, hf_model, tmp_path):
    path, prompts = str(tiny_checkpoint("llama")), _prompts()
    want = [o.outputs[0].token_ids for o in LLM(path, **KNOBS).generate(prompts, _params(len(prompts)),
                                                                         use_tqdm=False)]
    tensors = medusa_tensors(31, num_heads=4)
    head = write_medusa(tmp_path / "medusa", tensors)
    llm = LLM(path, **KNOBS, speculative_config={"method": "medusa", "model": str(head), "num_speculative_tokens": 3})
    records, on_device = record_drafts(llm.engine.runner.proposer)
    outs = llm.generate(prompts, _params(len(prompts)), use_tqdm=False)
    greedy = [i for i in range(len(prompts)) if i != 1]
    assert [outs[i].outputs[0].token_ids for i in greedy] == [want[i] for i in greedy]
    assert llm.engine.scheduler.num_preemptions > 0 and sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_blocks - 1

    hf = hf_model("llama")
    w = {k: v.float() for k, v in tensors.items()}
    compared = 0
    for context, drafts in records:
        with torch.no_grad():
            hidden = hf.model(input_ids=torch.tensor([context[:-1]])).last_hidden_state[0, -1]
        ref, gaps = _reference(w, hidden, len(drafts))
        for got, exp, gap in zip(drafts, ref, gaps):
            if gap > 1e-3:
                assert got == exp, (context, drafts, ref)
                compared += 1
    assert compared > 50
    assert any(on_device)  # the all-greedy steps drafted at launch, on the device


def test_always_wrong_medusa_accepts_nothing(tiny_checkpoint, tmp_path):
    """Zero ResBlock weights and a large bias on dim 0 make x + SiLU(b) point at e_0, and every lm_head
    row but token z's (= e_0) is zero: each head always proposes z, a token the target never emits."""
    path, prompts = str(tiny_checkpoint("llama")), _prompts()[:4]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **KNOBS).generate(prompts, params, use_tqdm=False)]
    z = min(set(range(V)) - {t for out in want for t in out})
    tensors = {k: torch.zeros_like(v) for k, v in medusa_tensors(32, num_heads=3).items()}
    for h in range(3):
        tensors[f"{h}.0.linear.bias"][0] = 100.0
        tensors[f"{h}.1.weight"][z] = torch.eye(H)[0].half()
    head = write_medusa(tmp_path / "medusa", tensors)
    llm = LLM(path, **KNOBS, speculative_config={"method": "medusa", "model": str(head), "num_speculative_tokens": 3})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == 0


def test_stacked_heads_compute_what_the_heads_compute_one_by_one(tmp_path):
    """`MedusaHeads.stack` (one batched matmul per layer, weights as views of one tensor) against the per-head loop,
    with two ResBlock layers, biases, and fewer heads than it has."""
    from research_lm.models.base import ModelBuildContext
    from spec_decode.medusa import load_medusa_heads

    head = write_medusa(tmp_path / "medusa", {k: v.float() for k, v in medusa_tensors(7, num_layers=2).items()})
    build = ModelBuildContext("cpu", torch.float32, "torch_ref")
    heads = load_medusa_heads(head, hidden_size=H, vocab_size=V, build=build)
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    want = heads(hidden, 3)
    heads.stack()
    assert torch.allclose(heads(hidden, 3), want, atol=1e-5) and heads(hidden).shape == (3, 4, V)
    weights, _, lm_head = heads._stacked  # the parameters are views of the stacked tensors: nothing held twice
    assert heads[1][-1].weight.data_ptr() == lm_head[1].data_ptr()
    assert heads[2][1].linear.weight.data_ptr() == weights[1][2].data_ptr()


def test_independent_drafts_in_one_batch_equal_drafts_picked_one_at_a_time():
    """Medusa's sampled drafts (`Drafting.add_independent`): one `pick_tokens` batch over every (request, draft) row
    gives the tokens and q that `add` gives draft by draft, for seeded and greedy rows and uneven budgets."""
    from research_lm.engine.request import Request
    from spec_decode.heads import start_drafting

    def requests():
        return [Request(f"r{i}", [1, 2, 3, 4], SamplingParams(temperature=t, seed=s, max_tokens=40), seed=i)
                for i, (t, s) in enumerate([(1.0, 7), (0.0, None), (0.7, None), (1.3, 11)])]

    emitted = [[5], [6, 7], [8], [9, 10, 11]]
    logits = torch.randn(4, 3, V, generator=torch.Generator().manual_seed(0)) * 3
    batched = start_drafting(requests(), emitted, 3, max_model_len=10)
    assert batched.budget == [3, 3, 3, 2] and batched.pick_rule(V) == "sample"  # r3: room for two drafts
    batched.add_independent(logits, V)
    one_by_one = start_drafting(requests(), emitted, 3, max_model_len=10)
    for j in range(3):
        active = one_by_one.active(j)
        one_by_one.add(active, logits[active, j], V)
    assert batched.tokens == one_by_one.tokens
    assert len({tuple(t) for t in batched.tokens}) == 4  # the rows drew different drafts
    for got, want in zip(batched.probs, one_by_one.probs, strict=True):
        assert torch.equal(torch.stack(got), torch.stack(want))
