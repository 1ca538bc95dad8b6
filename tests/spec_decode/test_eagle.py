"""EAGLE-1 / EAGLE-3 heads in their published layouts, drafting through their own paged KV cache.

Invariants:
- Greedy decoding with either head is token-identical to greedy decoding without speculation,
  under chunked prefill, preemption, prefix caching and mixed greedy/sampled batches.
- Every greedy proposal equals what an independent plain-torch implementation of the published
  head computes from scratch on the full context (target features from `transformers`): this pins
  the layout semantics (shift by one, fc order, norms, d2t, aux taps) and shows the paged head KV
  stays in sync after rejections, preemption and prefix-cache hits.
- A head that is always wrong gives identical outputs with no draft accepted (tau = 1).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from research_lm import LLM, SamplingParams
from tests.spec_decode.spying import draft_values, record_drafts
from tests.spec_decode.test_spec_formats import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    V,
    eagle1_tensors,
    eagle3_tensors,
    write_eagle1,
    write_eagle3,
)

AUX = [0, 1, 2]  # the tiny target has 2 layers: embedding stream, after layer 0, before the final norm
EPS = 1e-5
KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=5,
             num_gpu_blocks=26, max_model_len=64)
K = 3


# ---------------------------------------------------------------------------------------------------
# An independent reference: the published heads in plain torch, full causal recompute, no cache


def _rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x, pos):  # x [T, heads, d], GPT-NeoX halves, theta 1e4
    inv = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    f = pos[:, None].float() * inv
    cos, sin = f.cos()[:, None, :], f.sin()[:, None, :]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attn(x, w, p):
    T = x.shape[0]
    pos = torch.arange(T)
    q = _rope((x @ w[f"{p}.self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM), pos)
    k = _rope((x @ w[f"{p}.self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM), pos)
    v = (x @ w[f"{p}.self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)
    return out @ w[f"{p}.self_attn.o_proj.weight"].T


def _mlp(x, w, p):
    gate, up = x @ w[f"{p}.mlp.gate_proj.weight"].T, x @ w[f"{p}.mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T


def eagle1_reference(w, embed, lm_head, tokens, feats, k):
    """EAGLE-1 (cnets1.py): rows (embed x[t+1], h_t); fc; layer 0 without input norm; no final norm."""
    E, Fs = embed[torch.tensor(tokens[1:])], feats
    drafts, gaps = [], []
    for _ in range(k):
        h = torch.cat([E, Fs], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        h = h + _attn(h, w, "layers.0")
        out = h + _mlp(_rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0")
        logits = out[-1] @ lm_head.T
        top = logits.topk(2).values
        drafts.append(int(logits.argmax()))
        gaps.append(float(top[0] - top[1]))
        E, Fs = torch.cat([E, embed[drafts[-1]][None]]), torch.cat([Fs, out[-1:]])
    return drafts, gaps


def eagle3_reference(w, embed, tokens, aux, k):
    """EAGLE-3 (traineagle3/cnets.py): g = fc(cat aux); midlayer over [norm(embed); hidden_norm(g)]."""
    d2t = w["d2t"]
    E, G = embed[torch.tensor(tokens[1:])], torch.cat(aux, -1) @ w["fc.weight"].T
    drafts, gaps = [], []
    for _ in range(k):
        x = torch.cat([_rms(E, w["midlayer.input_layernorm.weight"]), _rms(G, w["midlayer.hidden_norm.weight"])], -1)
        h = G + _attn(x, w, "midlayer")
        out = h + _mlp(_rms(h, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer")
        logits = _rms(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T
        top = logits.topk(2).values
        d = int(logits.argmax())
        drafts.append(d + int(d2t[d]))
        gaps.append(float(top[0] - top[1]))
        E, G = torch.cat([E, embed[drafts[-1]][None]]), torch.cat([G, out[-1:]])
    return drafts, gaps


@torch.no_grad()
def target_features(hf, tokens, aux_ids):
    """(final normed hidden states [n, H], the residual streams entering layers aux_ids) of x[0:n]."""
    taps, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: taps.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True))
    num_layers = len(hf.model.layers)
    hooks.append(hf.model.norm.register_forward_pre_hook(lambda m, args: taps.__setitem__(num_layers, args[0])))
    try:
        final = hf.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
    finally:
        for h in hooks:
            h.remove()
    return final, [taps[i][0] for i in aux_ids]


def check_against_reference(records, reference):
    """Every proposal equals the reference's drafts, up to near-ties of the reference's logits."""
    compared = 0
    for context, drafts in records:
        want, gaps = reference(context, len(drafts))
        for got, exp, gap in zip(drafts, want, gaps):
            if gap < 1e-3:
                break  # a near tie: fp32 summation order may pick either; later drafts depend on it
            assert got == exp, (context, drafts, want)
            compared += 1
    assert compared > 20, compared


# ---------------------------------------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 11, 17, 23, 9)]
    return prompts + [prompts[3], list(prompts[2])]  # repeats: prefix-cache hits


def _params(n: int) -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_k=50, max_tokens=20, ignore_eos=True, seed=7)
    return [sampled if i == 4 else greedy for i in range(n)]  # request 4 samples: q goes to the verifier


def _spy(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(context, drafts) of every greedy request's drafts; q kept exactly for the drafts of a step where some drafting
    request samples."""
    proposer = llm.engine.runner.proposer
    propose = proposer.propose

    def checked(outcome):
        drafts = propose(outcome)
        values = draft_values(outcome, drafts)
        sampling = any(not r.sampling_params.greedy for r in outcome.requests if values[r.request_id])
        for req in outcome.requests:
            assert (req.request_id in drafts.probs) == (bool(values[req.request_id]) and sampling)
        return drafts

    proposer.propose = checked
    return record_drafts(proposer)[0]


@pytest.fixture(scope="module")
def baseline(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    prompts = _prompts()
    outs = LLM(path, **KNOBS).generate(prompts, _params(len(prompts)), use_tqdm=False)
    return path, prompts, [o.outputs[0].token_ids for o in outs]


def _run_spec(baseline, spec):
    path, prompts, want = baseline
    llm = LLM(path, **KNOBS, speculative_config={**spec, "num_speculative_tokens": K})
    records = _spy(llm)
    outs = llm.generate(prompts, _params(len(prompts)), use_tqdm=False)
    greedy = [i for i in range(len(prompts)) if i != 4]
    assert [outs[i].outputs[0].token_ids for i in greedy] == [want[i] for i in greedy]
    assert len(outs[4].outputs[0].token_ids) == 20
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_blocks - 1
    assert all(o.metrics.num_draft_tokens > 0 for o in outs)
    return outs, records


def test_eagle1_greedy_identity_and_reference_drafts(baseline, hf_model, tmp_path):
    tensors = eagle1_tensors(21)
    head = write_eagle1(tmp_path / "eagle", tensors)
    _, records = _run_spec(baseline, {"method": "eagle", "model": str(head)})
    hf = hf_model("llama")
    w = {k: v.float() for k, v in tensors.items()}
    embed, lm_head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()

    def reference(context, k):
        final, _ = target_features(hf, context[:-1], [])
        return eagle1_reference(w, embed, lm_head, context, final, k)

    check_against_reference(records, reference)


def test_eagle3_greedy_identity_and_reference_drafts(baseline, hf_model, tmp_path):
    tensors = eagle3_tensors(22, sorted(random.Random(0).sample(range(V), 96)))  # a 96-token draft vocab
    head = write_eagle3(tmp_path / "eagle3", tensors, eagle_aux_hidden_state_layer_ids=AUX)
    _, records = _run_spec(baseline, {"method": "eagle3", "model": str(head)})
    hf = hf_model("llama")
    w = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    embed = hf.model.embed_tokens.weight.detach()

    def reference(context, k):
        _, aux = target_features(hf, context[:-1], AUX)
        return eagle3_reference(w, embed, context, aux, k)

    check_against_reference(records, reference)


def _no_accepts(baseline, spec):
    path, prompts, want = baseline
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(path, **KNOBS, speculative_config={**spec, "num_speculative_tokens": K})
    outs = llm.generate(prompts[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[:4]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == 0  # tau = 1


def test_always_wrong_heads_accept_nothing(baseline, tiny_checkpoint, tmp_path):
    """EAGLE-3 whose draft vocab misses every token the target emits; EAGLE-1 whose fc bias steers
    its feature to the lm_head row of such a token (all other weights zero)."""
    _, _, want = baseline
    emitted = {t for out in want for t in out}
    never = [t for t in range(V) if t not in emitted]
    t3 = eagle3_tensors(23, never[:32])
    _no_accepts(baseline, {"method": "eagle3", "model": str(write_eagle3(tmp_path / "e3", t3,
                                                                        eagle_aux_hidden_state_layer_ids=AUX))})

    lm_head = load_file(tiny_checkpoint("llama") / "model.safetensors")["lm_head.weight"]
    z = next(t for t in never if int((lm_head @ lm_head[t]).argmax()) == t)
    t1 = {k: torch.zeros_like(v) for k, v in eagle1_tensors(24).items()}
    t1["fc.bias"] = (10 * lm_head[z]).half()
    _no_accepts(baseline, {"method": "eagle", "model": str(write_eagle1(tmp_path / "e1", t1))})
