"""DeepSeek MTP layers (`"method": "mtp"` / `"deepseek_mtp"`), read from the target's own checkpoint in DeepSeek-V3's
published layout (`model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj, shared_head.*, embed_tokens, ...}`).

Invariants:
- Greedy decoding with MTP drafts is token-identical to plain greedy decoding, under chunked prefill, preemption,
  prefix caching and a mixed greedy/sampled batch; for a dense MTP layer that shares the target's embedding and head
  (single safetensors file) and for a routed-experts one (DeepSeek-V3 routing) with its own copies (an index).
- Every greedy draft equals what transformers' own DeepSeek decoder layer computes from scratch on the full context
  with the published MTP step (shift by one, embedding zeroed at position 0, [enorm(embed); hnorm(h)], the stream fed
  back as h): this pins the layout and keeps the paged MTP cache honest after rejections, preemption and cache hits.
- Without num_speculative_tokens k is num_nextn_predict_layers (vLLM's default); "model" may name the directory
  holding the layers; a layer without its own embedding or head uses the target's.
- A checkpoint without MTP layers, or a target of another family, is refused in one sentence.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from research_lm import LLM, SamplingParams
from research_lm.models import CheckpointError
from tests.spec_decode.spying import record_drafts
from tests.spec_decode.test_eagle import check_against_reference

V = 256
KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=5,
             num_gpu_blocks=26, max_model_len=64)
K = 3
MTP_FILE = "model-mtp.safetensors"


def _random_like(template: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors of the template's names and shapes: N(0, 0.1^2), norm scales 1 + N(0, 0.1^2)."""
    out = {}
    for name, t in template.items():
        noise = torch.randn(t.shape, generator=gen) * 0.1
        out[name] = 1.0 + noise if "norm" in name else noise
    return out


def write_mtp_checkpoint(src: Path, out: Path, *, own_embed_head: bool, indexed: bool, seed: int,
                         **config) -> dict[str, torch.Tensor]:
    """A copy of the checkpoint at src with one random MTP layer after its last (its decoder layer shaped like the last
    one: the config overrides must keep the MTP layer's MLP kind equal to it); returns the layer's tensors, by name
    without the `model.layers.{L}.` prefix."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, **config)
    (out / "config.json").write_text(json.dumps(cfg))
    last, layer = cfg["num_hidden_layers"] - 1, cfg["num_hidden_layers"]
    weights = load_file(out / "model.safetensors")
    decoder = {n.removeprefix(f"model.layers.{last}."): t for n, t in weights.items()
               if n.startswith(f"model.layers.{last}.")}
    hidden = cfg["hidden_size"]
    template = {**decoder, "enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
                "eh_proj.weight": torch.ones(hidden, 2 * hidden), "shared_head.norm.weight": torch.ones(hidden)}
    if own_embed_head:
        template |= {"embed_tokens.weight": torch.ones(V, hidden), "shared_head.head.weight": torch.ones(V, hidden)}
    tensors = _random_like(template, torch.Generator().manual_seed(seed))
    named = {f"model.layers.{layer}.{n}": t for n, t in tensors.items()}
    if indexed:
        save_file(named, out / MTP_FILE)
        weight_map = {n: "model.safetensors" for n in weights} | {n: MTP_FILE for n in named}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(weights | named, out / "model.safetensors")
    return tensors


# ---------------------------------------------------------------------------------------------------
# An independent reference: transformers' decoder layer, full causal recompute, no cache


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _hf_layer(path: Path, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' DeepSeek decoder layer at index num_hidden_layers, holding the MTP layer's decoder tensors
    (per-expert checkpoint tensors stacked the way transformers keeps them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "eager"
    shell = AutoModelForCausalLM.from_config(config)
    layer = type(shell.model.layers[0])(config, config.num_hidden_layers)
    own = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
    state = {n: t for n, t in tensors.items() if not n.startswith(own)}
    experts = sorted({int(n.split(".")[2]) for n in state if n.startswith("mlp.experts.")})
    if experts:
        def stack(proj):
            return torch.stack([state.pop(f"mlp.experts.{e}.{proj}.weight") for e in experts])
        gate, up = stack("gate_proj"), stack("up_proj")
        state["mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        state["mlp.experts.down_proj"] = stack("down_proj")
    layer.load_state_dict(state, strict=True)
    layer.rotary = shell.model.rotary_emb
    return layer.eval()


@torch.no_grad()
def mtp_reference(hf, layer, w, eps, context, k):
    """Drafts (and their top-2 gaps) of the published MTP step chained k times from context x[0..n]."""
    embed = w.get("embed_tokens.weight", hf.model.embed_tokens.weight)
    head = w.get("shared_head.head.weight", hf.lm_head.weight)
    feats = hf.model(input_ids=torch.tensor([context[:-1]])).last_hidden_state[0]
    embeds = embed[torch.tensor(context[1:])]
    drafts, gaps = [], []
    for _ in range(k):
        t = embeds.shape[0]
        e = embeds.clone()
        e[0] = 0.0  # vLLM zeroes the embedding at position 0
        x = torch.cat([_rms(e, w["enorm.weight"], eps), _rms(feats, w["hnorm.weight"], eps)], -1)
        x = x @ w["eh_proj.weight"].T
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=pos,
                    position_embeddings=layer.rotary(x[None], pos))[0]
        logits = _rms(out[-1], w["shared_head.norm.weight"], eps) @ head.T
        top = logits.topk(2).values
        drafts.append(int(logits.argmax()))
        gaps.append(float(top[0] - top[1]))
        embeds, feats = torch.cat([embeds, embed[drafts[-1]][None]]), torch.cat([feats, out[-1:]])
    return drafts, gaps


# ---------------------------------------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 11, 17, 23, 9)]
    return prompts + [prompts[3], list(prompts[2])]  # repeats: prefix-cache hits


def _params(n: int) -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_k=50, max_tokens=20, ignore_eos=True, seed=7)
    return [sampled if i == 4 else greedy for i in range(n)]  # request 4 samples: q goes to the verifier


# (fixture, config overrides keeping the MTP layer's MLP kind the last layer's, own embed/head, indexed, method)
CASES = {
    "dense-shared": ("deepseek-v2", {"first_k_dense_replace": 3}, False, False, "mtp"),
    "moe-own": ("deepseek-v3-moe", {}, True, True, "deepseek_mtp"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identity_and_reference_drafts(case, tiny_checkpoint, hf_model, tmp_path):
    name, overrides, own, indexed, method = CASES[case]
    path = tmp_path / "target"
    tensors = write_mtp_checkpoint(tiny_checkpoint(name), path, own_embed_head=own, indexed=indexed, seed=11,
                                   **overrides)
    prompts = _prompts()
    want = [o.outputs[0].token_ids for o in LLM(str(path), **KNOBS).generate(prompts, _params(len(prompts)),
                                                                              use_tqdm=False)]
    llm = LLM(str(path), **KNOBS, speculative_config={"method": method, "num_speculative_tokens": K})
    records, _ = record_drafts(llm.engine.runner.proposer)
    outs = llm.generate(prompts, _params(len(prompts)), use_tqdm=False)
    greedy = [i for i in range(len(prompts)) if i != 4]
    assert [outs[i].outputs[0].token_ids for i in greedy] == [want[i] for i in greedy]
    assert len(outs[4].outputs[0].token_ids) == 20
    assert llm.engine.scheduler.num_preemptions > 0 and sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_blocks - 1
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0  # a random layer still guesses some

    hf = hf_model(name)
    layer = _hf_layer(path, tensors)
    eps = hf.config.rms_norm_eps
    check_against_reference(records, lambda context, k: mtp_reference(hf, layer, tensors, eps, context, k))


def test_a_checkpoint_without_mtp_layers_is_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="no num_nextn_predict_layers"):
        LLM(str(tiny_checkpoint("deepseek-v2")), **KNOBS, speculative_config={"method": "mtp"})
    path = tmp_path / "counted"
    shutil.copytree(tiny_checkpoint("deepseek-v2"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match="lacks model.layers.2.eh_proj.weight"):
        LLM(str(path), **KNOBS, speculative_config={"method": "mtp"})


def test_a_target_of_another_family_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="DeepSeek-V2/V3 multi-token-prediction layers.*LlamaForCausalLM"):
        LLM(str(tiny_checkpoint("llama")), **KNOBS, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_k_defaults_to_the_layer_count_and_shared_modules_are_the_targets(tiny_checkpoint, tmp_path):
    path = tmp_path / "target"
    write_mtp_checkpoint(tiny_checkpoint("deepseek-v2"), path, own_embed_head=False, indexed=True, seed=12,
                         first_k_dense_replace=3)
    llm = LLM(str(tiny_checkpoint("deepseek-v2")), **KNOBS, speculative_config={"method": "mtp", "model": str(path)})
    proposer = llm.engine.runner.proposer
    assert proposer.num_speculative_tokens == 1  # num_nextn_predict_layers, as in vLLM
    assert proposer.head.embed_tokens is None and proposer.head.shared_head.head is None
    assert proposer._embedding() is llm.engine.model.get_input_embeddings()
