"""The checkpoint loader: formats it reads, and a one-sentence CheckpointError for each broken directory."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from research_lm.models import (
    CheckpointError,
    get_model_class,
    load_model,
    load_tokenizer,
    resolve_model_path,
    supported_architectures,
)
from research_lm.models import loader as loader_module

FAMILY = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def _load(path, dtype=torch.float32):
    return load_model(path, device="cpu", dtype=dtype, attention_backend="torch_ref")


def _copy(tiny_checkpoint, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint(name), tmp_path / name))


def test_registry_lists_supported_architectures():
    assert set(FAMILY) <= set(supported_architectures())
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_loaded_model_is_in_eval_without_grad_in_the_requested_dtype(tiny_checkpoint):
    model, hf_config = _load(tiny_checkpoint("llama"), dtype=torch.bfloat16)
    assert hf_config.architectures == ["LlamaForCausalLM"]
    assert not model.training
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32  # the build scope restored it


def test_tied_checkpoint_has_no_lm_head_tensor(tiny_checkpoint):
    path = tiny_checkpoint("llama-tied")
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model, _ = _load(path)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_sharded_and_pickled_checkpoints_are_found(tiny_checkpoint):
    assert len(loader_module.checkpoint_files(tiny_checkpoint("llama-sharded"))) > 1
    assert [f.name for f in loader_module.checkpoint_files(tiny_checkpoint("llama-bin"))] == ["pytorch_model.bin"]


def test_missing_directory():
    with pytest.raises(CheckpointError, match=r"model directory .*nowhere does not exist"):
        _load("/nonexistent/nowhere")


def test_missing_config(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, "llama", tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        _load(path)


def test_unsupported_architecture_lists_the_supported_ones(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, "llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"FooForCausalLM.*supported: \[.*Qwen2ForCausalLM"):
        _load(path)


def test_missing_shard_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, "llama-sharded", tmp_path)
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"shard {victim.name} named by model.safetensors.index.json"):
        _load(path)


@pytest.mark.parametrize(
    "drop, reported",
    [
        ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
        ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_missing_tensor_is_named(drop, reported, tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, "llama", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors[drop]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"lacks 1 tensors the model needs, e\.g\. \['{reported}'\]"):
        _load(path)


def test_wrong_shape_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, "llama", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(63)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.norm.weight'.*\(63,\)"):
        _load(path)


def test_no_weights_file(tiny_checkpoint, tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    shutil.copy(tiny_checkpoint("llama") / "config.json", path)
    with pytest.raises(CheckpointError, match="no weights in"):
        _load(path)


def test_pickled_weights_refuse_arbitrary_objects(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, "llama-bin", tmp_path)
    state = torch.load(path / "pytorch_model.bin", weights_only=True)
    state["model.norm.weight"] = datetime.datetime(2026, 1, 1)  # not on the weights-only allowlist
    torch.save(state, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights-only"):
        _load(path)


def test_resolve_model_path(tmp_path, monkeypatch):
    assets = tmp_path / "assets"
    (assets / "tiny-x").mkdir(parents=True)
    (assets / "tiny-x" / "config.json").write_text("{}")
    (assets / "not-a-model").mkdir()
    monkeypatch.setattr(loader_module, "ASSETS_DIR", assets)
    assert resolve_model_path(tmp_path) == tmp_path
    assert resolve_model_path("tiny-x") == assets / "tiny-x"
    with pytest.raises(CheckpointError, match=r"'meta-llama/Llama-3.2-1B'.*built-ins: \['tiny-x'\]"):
        resolve_model_path("meta-llama/Llama-3.2-1B")


def test_load_tokenizer(tiny_checkpoint, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert load_tokenizer(tiny_checkpoint("llama")) is None
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path)("hello world")["input_ids"] == [1, 2]


def test_build_model_with_random_weights_for_speed_runs(tiny_checkpoint):
    from research_lm.models import build_model, init_random_weights, load_config
    from tests.utils import forward_prefill

    config = load_config(tiny_checkpoint("qwen2"))
    logits = []
    for _ in range(2):
        model = build_model(config, device="cpu", dtype=torch.float32, attention_backend="torch_ref")
        init_random_weights(model, seed=3)
        logits.append(forward_prefill(model, [[1, 2, 3, 4, 5]], block_size=4)[0])
    assert torch.equal(logits[0], logits[1]) and logits[0].isfinite().all()
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.bias, torch.zeros(128))
