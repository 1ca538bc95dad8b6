"""draft_model: a smaller checkpoint drafts k tokens with its own paged KV in the target's blocks.

Invariants:
- The target as its own draft model: every draft is accepted (num_accepted == num_draft), also when
  requests sample (the returned q equals the verifier's p), so tau = k + 1 exactly when every
  verification carries k drafts; under chunked prefill, preemption and prefix caching.
- A draft that is always wrong (the target with its lm_head negated): identical outputs, tau = 1.
- A perturbed copy of the target (partial acceptance): greedy outputs identical, and each greedy
  proposal equals the draft model's own greedy continuation recomputed from scratch with
  `transformers`, so the draft KV stays in sync after rejections, preemption and prefix-cache hits.
- Sampled drafting is reproducible per request whatever the batch around it.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from research_lm import LLM, SamplingParams
from tests.spec_decode.spying import record_drafts

V = 256
KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=5,
             num_gpu_blocks=26, max_model_len=64)


def _variant(target: Path, out: Path, change) -> Path:
    shutil.copytree(target, out)
    weights = load_file(out / "model.safetensors")
    save_file({k: change(k, v).contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


def _prompts() -> list[list[int]]:
    rng = random.Random(2)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (6, 12, 17, 23, 3)]
    return prompts + [prompts[3], list(prompts[1])]  # repeats: prefix-cache hits


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, max_tokens=20, ignore_eos=True, seed=11)


def _mixed(n: int) -> list[SamplingParams]:
    return [SAMPLED if i == 2 else GREEDY for i in range(n)]


@pytest.fixture(scope="module")
def baseline(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = _prompts()
    outs = LLM(str(path), **KNOBS).generate(prompts, _mixed(len(prompts)), use_tqdm=False)
    return path, prompts, [o.outputs[0].token_ids for o in outs]


def _generate(path: Path, draft: Path, prompts, params, k: int = 3, **knobs):
    llm = LLM(str(path), **{**KNOBS, **knobs},
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})
    return llm, llm.generate(prompts, params, use_tqdm=False)


def _check_pressure(llm: LLM, outs) -> None:
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_blocks - 1


def test_target_as_draft_accepts_everything(baseline):
    path, prompts, want = baseline
    llm, outs = _generate(path, path, prompts, _mixed(len(prompts)))
    greedy = [i for i in range(len(prompts)) if i != 2]
    assert [outs[i].outputs[0].token_ids for i in greedy] == [want[i] for i in greedy]
    _check_pressure(llm, outs)
    for o in outs:  # the sampled request too: q == p, so min(1, p/q) = 1
        assert o.metrics.num_draft_tokens > 0 and o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens


@pytest.mark.parametrize("k", [1, 4])
def test_target_as_draft_tau_is_k_plus_1(baseline, k):
    """Without pressure every verification carries k drafts when max_tokens = 1 + m (k + 1)."""
    path, prompts, _ = baseline
    params = SamplingParams(temperature=0.0, max_tokens=1 + 4 * (k + 1), ignore_eos=True)
    llm, outs = _generate(path, path, prompts[:4], params, k=k, num_gpu_blocks=128, max_num_batched_tokens=64)
    for o in outs:
        m = o.metrics
        verify_steps = m.num_output_tokens - 1 - m.num_accepted_tokens  # each emits accepted + 1
        assert m.num_accepted_tokens == m.num_draft_tokens == 4 * k
        assert (m.num_output_tokens - 1) / verify_steps == k + 1


def test_target_as_draft_with_penalties_accepts_everything(baseline):
    """Penalties read the outputs before each position: the drafter's rows (outputs, this step's emitted tokens,
    the drafts so far) must see exactly what the verifier's rows see, or a penalised draft would be rejected."""
    path, prompts, _ = baseline
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.7, frequency_penalty=0.4),
              SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=5, repetition_penalty=1.3)]
    _, outs = _generate(path, path, prompts[:2], params, num_gpu_blocks=128, max_num_batched_tokens=64)
    plain = LLM(str(path), **{**KNOBS, "num_gpu_blocks": 128, "max_num_batched_tokens": 64}).generate(
        prompts[:1], params[:1], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    for o in outs:
        assert o.metrics.num_draft_tokens > 0 and o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens


def test_target_as_draft_with_logit_bias_and_allowed_ids_accepts_everything(baseline):
    """logit_bias and allowed_token_ids change p and q alike: the drafter's rows apply them as the verifier's do,
    so the target drafting for itself is never rejected, and greedy output equals plain decoding's."""
    path, prompts, _ = baseline
    allowed = list(range(0, 64, 3))
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed,
                             logit_bias={allowed[1]: 2.0, allowed[4]: -3.0}),
              SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=7, logit_bias={allowed[2]: 1.5})]
    _, outs = _generate(path, path, prompts[:2], params, num_gpu_blocks=128, max_num_batched_tokens=64)
    plain = LLM(str(path), **{**KNOBS, "num_gpu_blocks": 128, "max_num_batched_tokens": 64}).generate(
        prompts[:1], params[:1], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)
    for o in outs:
        assert o.metrics.num_draft_tokens > 0 and o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens


def test_always_wrong_draft_gives_tau_1(baseline, tmp_path):
    path, prompts, want = baseline
    draft = _variant(path, tmp_path / "negated", lambda k, v: -v if k == "lm_head.weight" else v)
    llm, outs = _generate(path, draft, prompts, [GREEDY] * len(prompts))
    greedy = [i for i in range(len(prompts)) if i != 2]
    assert [outs[i].outputs[0].token_ids for i in greedy] == [want[i] for i in greedy]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == 0


def test_perturbed_draft_stays_in_sync(baseline, tmp_path):
    path, prompts, want = baseline
    gen = torch.Generator().manual_seed(0)
    draft = _variant(path, tmp_path / "perturbed", lambda k, v: v + 0.006 * torch.randn(v.shape, generator=gen))
    llm = LLM(str(path), **KNOBS,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    records, _ = record_drafts(llm.engine.runner.proposer)
    outs = llm.generate(prompts, _mixed(len(prompts)), use_tqdm=False)
    greedy = [i for i in range(len(prompts)) if i != 2]
    assert [outs[i].outputs[0].token_ids for i in greedy] == [want[i] for i in greedy]
    _check_pressure(llm, outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert 0.2 * drafted < accepted < drafted, (accepted, drafted)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32, attn_implementation="eager").eval()
    compared = 0
    for context, drafts in records:
        ids = list(context)
        for got in drafts:
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([ids])).logits[0, -1]
            top = logits.topk(2)
            if float(top.values[0] - top.values[1]) < 1e-3:
                break  # a near tie: either is right, and the rest follows from it
            assert got == int(top.indices[0]), (context, drafts)
            compared += 1
            ids.append(got)
    assert compared > 100


def test_sampled_drafting_is_batch_independent(baseline, tmp_path):
    path, prompts, _ = baseline
    gen = torch.Generator().manual_seed(1)
    draft = _variant(path, tmp_path / "perturbed", lambda k, v: v + 0.03 * torch.randn(v.shape, generator=gen))
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=5)
    _, alone = _generate(path, draft, [prompts[1]], [params])
    _, batched = _generate(path, draft, prompts[:4], [GREEDY, params, SAMPLED, GREEDY])
    assert alone[0].outputs[0].token_ids == batched[1].outputs[0].token_ids
    assert 0 < batched[1].metrics.num_accepted_tokens < batched[1].metrics.num_draft_tokens
