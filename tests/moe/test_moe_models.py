"""Mixtral, Qwen2-MoE and Qwen3-MoE match transformers: logits (batched and chunked prefill, fp32,
<= 1e-4) and greedy generation through `research_lm.LLM` with chunked prefill; both expert layouts of a
checkpoint load (per-expert names as `save_pretrained` writes them, and transformers 5's fused tensors)."""

from __future__ import annotations

import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from research_lm import LLM, SamplingParams
from research_lm.models import CheckpointError, load_model
from research_lm.moe import FusedMoE
from tests.utils import PagedBatch, forward_prefill

ATOL = 1e-4
MODELS = ["mixtral", "qwen2-moe", "qwen3-moe"]
REDUNDANT = {"eplb": {"num_redundant_experts": 2, "num_ep_ranks": 2}}  # 10 slots over 2 ranks


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _load(path, extra=None):
    model, _ = load_model(path, device="cpu", dtype=torch.float32, attention_backend="torch_ref", extra=extra)
    return model


@torch.no_grad()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("extra", [None, REDUNDANT], ids=["plain", "redundant"])
@pytest.mark.parametrize("name", MODELS)
def test_batched_prefill_matches_transformers(name, extra, tiny_checkpoint, hf_model):
    model = _load(tiny_checkpoint(name), extra)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(m.num_slots == 8 + (2 if extra else 0) for m in layers)
    seqs = [_tokens(n, seed) for seed, n in enumerate([19, 5, 33, 1])]
    for tokens, logits in zip(seqs, forward_prefill(model, seqs, block_size=4)):
        torch.testing.assert_close(logits, _hf_logits(hf_model(name), tokens), atol=ATOL, rtol=0)


def test_qwen2_moe_dense_layers_follow_mlp_only_layers(tiny_checkpoint):
    model = _load(tiny_checkpoint("qwen2-moe"))
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["MoeBlock", "GatedMLP", "MoeBlock"]
    assert model.model.layers[0].mlp.shared_expert_gate is not None


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_and_decode_match_transformers(name, tiny_checkpoint, hf_model):
    model = _load(tiny_checkpoint(name), REDUNDANT)
    seqs = [_tokens(23, 10), _tokens(12, 11)]
    schedule = [(7, 3), (9, 4), (1, 1), (1, 0), (1, 1), (1, 1), (3, 2)]
    batch = PagedBatch(model, [len(s) for s in seqs], block_size=4)
    done, got = [0, 0], [[], []]
    for step in schedule:
        chunks = [seq[d:d + n] for seq, d, n in zip(seqs, done, step)]
        for i, logits in enumerate(batch.step(chunks)):
            got[i].append(logits)
        done = [d + n for d, n in zip(done, step)]
    for tokens, pieces in zip(seqs, got):
        torch.testing.assert_close(torch.cat(pieces), _hf_logits(hf_model(name), tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_matches_transformers_generate(name, tiny_checkpoint, hf_model):
    """Through the engine: block_size 4, chunked prefill (16-token budget), 4 prompts of mixed lengths."""
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 11, 21, 30)]
    llm = LLM(str(tiny_checkpoint(name)), dtype="float32", device="cpu", block_size=4,
              max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    hf = hf_model(name)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                              min_new_tokens=8, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def _fuse_experts(src, dst, mixtral: bool) -> None:
    """Rewrite a checkpoint in transformers 5's in-memory layout: experts stacked into gate_up_proj /
    down_proj per layer (and Mixtral's block_sparse_moe renamed to mlp)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    pattern = re.compile(r"^(.+\.experts)\.(\d+)\.(\w+)\.weight$")
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for key, t in tensors.items():
        key = key.replace(".block_sparse_moe.", ".mlp.")
        m = pattern.match(key)
        if m:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
        else:
            out[key] = t
    for prefix, projs in experts.items():
        gate, up, down = (torch.stack([projs[n][e] for e in sorted(projs[n])]) for n in names)
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        out[f"{prefix}.down_proj"] = down.contiguous()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_fused_expert_checkpoint_loads_the_same(name, tiny_checkpoint, tmp_path):
    per_expert = _load(tiny_checkpoint(name), REDUNDANT)
    _fuse_experts(tiny_checkpoint(name), tmp_path / "fused", mixtral=name == "mixtral")
    fused = _load(tmp_path / "fused", REDUNDANT)
    for (n, a), (_, b) in zip(per_expert.named_parameters(), fused.named_parameters()):
        assert torch.equal(a, b), n


def test_missing_expert_tensor_is_a_checkpoint_error(tiny_checkpoint, tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("qwen3-moe"), path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="gate_up_proj"):
        _load(path)


def test_bad_redundancy_fails_at_build(tiny_checkpoint):
    with pytest.raises(ValueError, match="does not divide over eplb.num_ep_ranks"):
        _load(tiny_checkpoint("mixtral"), {"eplb": {"num_redundant_experts": 1, "num_ep_ranks": 2}})
