"""Head trainers: each writes exactly its published tensor layout (names, shapes, dtypes) and config
keys; spec_decode's loaders read what they write; EAGLE-3's training-time-test attention and draft
vocabulary keep their invariants; a head resumes bit-identically."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from research_lm import LLM, SamplingParams
from research_lm.harness.train import TrainConfig, train_head
from research_lm.harness.train.eagle3 import default_aux_layers, draft_vocab_maps
from research_lm.harness.train.layers import ttt_attention
from tests.spec_decode.spying import context, draft_values
from tests.train.conftest import VOCAB, Crash, CrashAt

H, HEADS, KV, HEAD_DIM, FFN = 32, 2, 1, 16, 64  # tests/train/conftest.py TINY_TARGET
DRAFT_VOCAB = 100


def _layer(prefix: str, qkv_in: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": (KV * HEAD_DIM, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": (KV * HEAD_DIM, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": (FFN, H),
        f"{prefix}.mlp.up_proj.weight": (FFN, H),
        f"{prefix}.mlp.down_proj.weight": (H, FFN),
        f"{prefix}.post_attention_layernorm.weight": (H,),
    }


# method -> (head knobs, weight file, {tensor: shape}, config keys that must be present)
LAYOUTS = {
    "eagle3": (
        {"draft_vocab_size": DRAFT_VOCAB, "ttt_steps": 2}, "model.safetensors",
        {"fc.weight": (H, 3 * H), "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
         **_layer("midlayer", 2 * H), "norm.weight": (H,), "lm_head.weight": (DRAFT_VOCAB, H),
         "d2t": (DRAFT_VOCAB,), "t2d": (VOCAB,)},
        {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": DRAFT_VOCAB,
         "vocab_size": VOCAB, "hidden_size": H, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
    ),
    "eagle": (
        {"num_layers": 2}, "model.safetensors",
        {"fc.weight": (H, 2 * H), **_layer("layers.0", H), **_layer("layers.1", H),
         "layers.1.input_layernorm.weight": (H,)},  # layer 0 has no input norm
        {"num_hidden_layers": 2, "vocab_size": VOCAB, "hidden_size": H, "bias": False},
    ),
    "medusa": (
        {"num_heads": 3, "num_layers": 1}, "medusa_lm_head.safetensors",
        {name: shape for h in range(3) for name, shape in
         {f"{h}.0.linear.weight": (H, H), f"{h}.0.linear.bias": (H,), f"{h}.1.weight": (VOCAB, H)}.items()},
        {"medusa_num_heads": 3, "medusa_num_layers": 1},
    ),
    "draft_model": (
        {"model": {"num_hidden_layers": 1}}, "model.safetensors",
        {"model.embed_tokens.weight": (VOCAB, H), **_layer("model.layers.0", H),
         "model.layers.0.input_layernorm.weight": (H,), "model.norm.weight": (H,)},  # lm_head tied
        {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "vocab_size": VOCAB},
    ),
}


@pytest.fixture(scope="module")
def heads(tiny_target, train_kwargs, tmp_path_factory):
    """method -> output directory of a 3-step run on the tiny target."""
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for method, (knobs, *_) in LAYOUTS.items():
        cfg = TrainConfig(output_dir=str(root / method), steps=3, **train_kwargs)
        result = train_head(method, cfg, target=str(tiny_target), head=knobs)
        assert result.summary["steps"] == 3 and result.summary["target"] == str(tiny_target)
        out[method] = result.output_dir
    return out


@pytest.mark.parametrize("method", list(LAYOUTS))
def test_written_layout_is_the_published_one(heads, method):
    _, weights, shapes, config_keys = LAYOUTS[method]
    tensors = load_file(heads[method] / weights)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    config = json.loads((heads[method] / "config.json").read_text())
    assert {k: config.get(k) for k in config_keys} == config_keys
    recipe = json.loads((heads[method] / "recipe.json").read_text())
    assert recipe["method"] == method and recipe["corpus_hash"] and recipe["final_val_loss"] is not None
    if method == "eagle3":
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        mapped = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
        assert tensors["t2d"].nonzero().flatten().tolist() == mapped.tolist()


@pytest.mark.skipif(importlib.util.find_spec("spec_decode.eagle") is None, reason="spec_decode loaders absent")
@pytest.mark.parametrize("method", list(LAYOUTS))
def test_spec_decode_loads_what_we_write(heads, tiny_target, method):
    """The proposer loads the head (strict names and shapes) and greedy output equals plain greedy."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9]]
    plain = LLM(str(tiny_target), device="cpu", dtype="float32").generate(prompt, params, use_tqdm=False)
    spec = {"method": method, "model": str(heads[method]), "num_speculative_tokens": 2}
    llm = LLM(str(tiny_target), device="cpu", dtype="float32", speculative_config=spec)
    out = llm.generate(prompt, params, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == list(plain[0].outputs[0].token_ids)


def _training_draft_logits(method: str, head_dir, target, ids: torch.Tensor) -> list[torch.Tensor]:
    """What training scores, per draft position j the head guesses from teacher-forced context: [T, vocab]
    logits whose row t is the guess of token t+2+j (EAGLE / EAGLE-3: j = 0 only; Medusa: one per head).
    Mirrors the objectives' forward passes (research_lm/harness/train/{eagle,eagle3,medusa}.py), loaded from the
    written checkpoint; ids: [1, T]."""
    from research_lm.harness.train.eagle import EagleObjective
    from research_lm.harness.train.eagle3 import Eagle3Objective
    from research_lm.harness.train.layers import rope_cos_sin
    from research_lm.harness.train.medusa import MedusaObjective

    t = ids.shape[1]
    if method == "medusa":
        obj = MedusaObjective(target, **LAYOUTS[method][0])
        obj.module.load_state_dict(load_file(head_dir / "medusa_lm_head.safetensors"))
        hidden = target.features(ids).hidden
        return [head(hidden)[0] for head in obj.module]
    obj = (EagleObjective(target, **LAYOUTS[method][0]) if method == "eagle" else
           Eagle3Objective(target, torch.ones(VOCAB), **LAYOUTS[method][0]))
    obj.module.load_state_dict(load_file(head_dir / "model.safetensors"))
    cos, sin = rope_cos_sin(torch.arange(t), obj.head_dim, obj.theta)
    embeds = F.embedding(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1), target.embed_weight)
    if method == "eagle":
        pred = obj.module(embeds, target.features(ids).hidden, cos, sin)
        return [F.linear(pred, target.lm_head_weight)[0]]
    head = obj.module
    hidden = head.midlayer(embeds, head.fc(target.features(ids, obj.aux_layers).aux), cos, sin, [], [])
    logits = torch.full((t, VOCAB), float("-inf"))
    logits[:, torch.arange(DRAFT_VOCAB) + head.d2t] = head.lm_head(head.norm(hidden))[0]
    return [logits]


def _scrambled(head_dir, out, embed_std: float):
    """A copy of a head whose every input matters: a 3-step head is ~ the identity on the feature (its
    attention and the embedding half of EAGLE's fc are ~0), so a token/feature misalignment would not move
    its argmax. Float tensors become N(0, 1/fan_in) (norms 1 + N(0, 0.1^2)); EAGLE's fc reads the
    embedding (std `embed_std`, next to a normed feature) scaled up to the feature's size."""
    shutil.copytree(head_dir, out)
    gen = torch.Generator().manual_seed(0)
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        for name, w in tensors.items():
            if not w.is_floating_point():
                continue
            noise = torch.randn(w.shape, generator=gen)
            tensors[name] = 1 + 0.1 * noise if w.dim() == 1 and "norm" in name else noise / w.shape[-1] ** 0.5
        if "fc.weight" in tensors and "layers.0.self_attn.q_proj.weight" in tensors:  # EAGLE-1: [embed; feature]
            tensors["fc.weight"][:, :H] /= embed_std
        save_file(tensors, file)
    return out


@pytest.mark.skipif(importlib.util.find_spec("spec_decode.eagle") is None, reason="spec_decode loaders absent")
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
@torch.no_grad()
def test_inference_drafts_are_the_training_time_argmax(heads, tiny_target, method, tmp_path):
    """Every draft the live proposer makes from verified context (EAGLE's first, each Medusa head's) is the
    argmax that training scores for the same context: same feature (post-norm / aux streams), same
    token-feature pairing, positions, d2t and head offsets. Greedy identity alone cannot catch a
    misalignment (the target corrects every bad draft); acceptance would just drop."""
    from research_lm.harness.train.teacher import FrozenTarget

    target = FrozenTarget(tiny_target, torch.device("cpu"))
    head_dir = _scrambled(heads[method], tmp_path / method, float(target.embed_weight.std()))
    k = 3 if method == "medusa" else 2
    llm = LLM(str(tiny_target), device="cpu", dtype="float32",
              speculative_config={"method": method, "model": str(head_dir), "num_speculative_tokens": k})
    proposer, drafts = llm.engine.runner.proposer, []  # (request id, known tokens N, drafts for x[N], x[N+1], ..)
    def recording(real):
        def record(outcome):
            made = real(outcome)
            if made is not None:
                for i, (req_id, values) in enumerate(draft_values(outcome, made).items()):
                    if values:
                        drafts.append((req_id, len(context(outcome, i)), values))
            return made
        return record

    for name in ("propose_on_device", "propose"):
        setattr(proposer, name, recording(getattr(proposer, name)))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 300, 40, 41, 300, 40, 41, 300, 77, 12]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    seqs = {o.request_id: torch.tensor([o.prompt_token_ids + o.outputs[0].token_ids]) for o in outs}
    logits = {rid: _training_draft_logits(method, head_dir, target, ids) for rid, ids in seqs.items()}
    checked = 0
    for rid, n, tokens in drafts:
        for j, (token, per_position) in enumerate(zip(tokens, logits[rid])):
            row = per_position[n - 2]  # position n-2 reads x[n-1] (EAGLE) / its feature guesses x[n+j]
            assert row[token] >= row.max() - 1e-4, (method, rid, n, j, token, int(row.argmax()))
            checked += 1
    assert checked >= 8, checked


def test_head_resume_matches_uninterrupted_run(tiny_target, train_kwargs, tmp_path):
    """An EAGLE-3 run killed after its step-3 checkpoint and resumed ends with the same weights."""
    knobs = {"draft_vocab_size": DRAFT_VOCAB, "ttt_steps": 2}
    full = train_head("eagle3", TrainConfig(output_dir=str(tmp_path / "a"), steps=5, **train_kwargs),
                      target=str(tiny_target), head=knobs)
    cfg = TrainConfig(output_dir=str(tmp_path / "b"), steps=5, **train_kwargs)
    with pytest.raises(Crash):
        train_head("eagle3", cfg, target=str(tiny_target), head=knobs, logger=CrashAt(4))
    cfg.resume = True
    resumed = train_head("eagle3", cfg, target=str(tiny_target), head=knobs)
    assert resumed.summary["resumed_from"] == 3
    assert resumed.summary["final_val_loss"] == full.summary["final_val_loss"]
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_head_knob_is_named(tiny_target, train_kwargs, tmp_path):
    with pytest.raises(ValueError, match="ttt_step.*valid ones"):
        train_head("eagle3", TrainConfig(output_dir=str(tmp_path / "x"), steps=1, **train_kwargs),
                   target=str(tiny_target), head={"ttt_step": 2})


def test_ttt_attention_sees_the_past_and_its_own_diagonal_only():
    """Row t attends to step-0 keys at positions <= t and to step-j keys (j >= 1) at row t only; with
    one step it is causal attention."""
    torch.manual_seed(0)
    b, h, t, d = 2, 2, 6, 8
    q = torch.randn(b, h, t, d)
    keys, values = [torch.randn(b, h, t, d) for _ in range(3)], [torch.randn(b, h, t, d) for _ in range(3)]
    assert torch.allclose(ttt_attention(q, keys[:1], values[:1]),
                          F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True), atol=1e-6)
    out = ttt_attention(q, keys, values)
    row = 3
    k2, v2 = [k.clone() for k in keys], [v.clone() for v in values]
    k2[0][:, :, row + 1:] += 5.0  # the future of step 0
    v2[0][:, :, row + 1:] -= 5.0
    for j in (1, 2):  # other rows of the unrolled steps
        k2[j][:, :, :row] += 5.0
        v2[j][:, :, row + 1:] -= 5.0
    assert torch.allclose(ttt_attention(q, k2, v2)[:, :, row], out[:, :, row], atol=1e-6)
    v2[2][:, :, row] += 1.0  # its own diagonal entry does matter
    assert not torch.allclose(ttt_attention(q, k2, v2)[:, :, row], out[:, :, row])


def test_draft_vocab_is_the_most_frequent_tokens():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = draft_vocab_maps(counts, 4)
    mapped = (torch.arange(4) + d2t).tolist()
    assert mapped == [0, 2, 3, 5]  # counts 5, 9, 9, 7: the top 4, in increasing target id
    assert t2d.nonzero().flatten().tolist() == mapped


def test_aux_layers_are_distinct_low_mid_high():
    assert default_aux_layers(32) == (2, 16, 29)  # vLLM's choice
    for layers in range(3, 12):
        low, mid, high = default_aux_layers(layers)
        assert 0 <= low < mid < high < layers
