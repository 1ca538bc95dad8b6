"""Published head layouts load exactly as released, and bad heads fail at load with a sentence.

The writers below fabricate tiny heads tensor by tensor, with the names and shapes of the
published checkpoints (they are also what test_eagle.py / test_medusa.py load):
- EAGLE-1 `yuhuili/EAGLE-*`: config.json ("bias" = fc bias) + pytorch_model.bin with fc.*,
  layers.N.* (no layers.0.input_layernorm), optional embed_tokens / rotary inv_freq buffers.
- EAGLE-3 `yuhuili/EAGLE3-*`: config.json (LlamaForCausalLMEagle3, draft_vocab_size) +
  pytorch_model.bin with fc.weight [H, 3H], midlayer.* (q/k/v take 2H), norm, lm_head, d2t, t2d.
- Medusa `FasterDecoding/medusa-*`: config.json (medusa_num_heads, medusa_num_layers) +
  medusa_lm_head.pt with {head}.{layer}.linear.weight|bias and {head}.{num_layers}.weight.
Pickles are read with `torch.load(weights_only=True)` only: one that would run code is refused.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from research_lm import LLM, SamplingParams
from research_lm.models import CheckpointError
from research_lm.worker.spec import speculative_method
from tests.conftest import TINY_SHAPE

H, V = TINY_SHAPE["hidden_size"], TINY_SHAPE["vocab_size"]
HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 16, TINY_SHAPE["intermediate_size"]
KNOBS = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
             num_gpu_blocks=64, max_model_len=64)


def _rand(gen: torch.Generator, *shape: int, std: float = 0.1) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _norm(gen: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + _rand(gen, n)


def _llama_head_config(**extra) -> dict:
    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", hidden_size=H,
        intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_hidden_layers=1,
        vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
        torch_dtype="float16", transformers_version="4.28.1",
    )
    cfg.update(extra)
    return cfg


def _attn_mlp(gen: torch.Generator, prefix: str, qkv_in: int) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.self_attn.q_proj.weight": _rand(gen, HEADS * HEAD_DIM, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": _rand(gen, KV_HEADS * HEAD_DIM, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": _rand(gen, KV_HEADS * HEAD_DIM, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": _rand(gen, H, HEADS * HEAD_DIM),
        f"{prefix}.post_attention_layernorm.weight": _norm(gen, H),
        f"{prefix}.mlp.gate_proj.weight": _rand(gen, INTER, H),
        f"{prefix}.mlp.up_proj.weight": _rand(gen, INTER, H),
        f"{prefix}.mlp.down_proj.weight": _rand(gen, H, INTER),
    }


def _save(out: Path, config: dict, tensors: dict[str, torch.Tensor], filename: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if filename.endswith(".safetensors"):
        save_file(tensors, str(out / filename))
    else:
        torch.save(tensors, out / filename)
    return out


def eagle1_tensors(seed: int, *, fc_bias: bool = True, embed: bool = False, rotary: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    t = {"fc.weight": _rand(gen, H, 2 * H)}
    if fc_bias:
        t["fc.bias"] = _rand(gen, H)
    t.update(_attn_mlp(gen, "layers.0", H))
    if embed:
        t["embed_tokens.weight"] = _rand(gen, V, H)
    if rotary:  # checkpoints saved by transformers 4.28 carry the rotary table
        t["layers.0.self_attn.rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    return {k: v.half() if v.is_floating_point() else v for k, v in t.items()}


def write_eagle1(out: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    cfg = _llama_head_config(bias="fc.bias" in tensors, **config)
    return _save(out, cfg, tensors, "pytorch_model.bin")


def eagle3_tensors(seed: int, draft_ids: Sequence[int], num_aux: int = 3) -> dict:
    """draft_ids: the target ids of the draft vocabulary, ascending (as EAGLE-3's scan builds it)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(sorted(draft_ids), dtype=torch.int64)
    t = {
        "fc.weight": _rand(gen, H, num_aux * H),
        "midlayer.input_layernorm.weight": _norm(gen, H),
        "midlayer.hidden_norm.weight": _norm(gen, H),
        **_attn_mlp(gen, "midlayer", 2 * H),
        "norm.weight": _norm(gen, H),
        "lm_head.weight": _rand(gen, len(ids), H, std=0.3),
    }
    t = {k: v.half() for k, v in t.items()}
    t["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    return t


def write_eagle3(out: Path, tensors: dict[str, torch.Tensor], filename: str = "pytorch_model.bin", **config) -> Path:
    cfg = _llama_head_config(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(tensors["d2t"]),
                             **config)
    return _save(out, cfg, tensors, filename)


def medusa_tensors(seed: int, num_heads: int = 4, num_layers: int = 1, hidden: int = H, vocab: int = V) -> dict:
    gen = torch.Generator().manual_seed(seed)
    t = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            t[f"{h}.{layer}.linear.weight"] = _rand(gen, hidden, hidden)
            t[f"{h}.{layer}.linear.bias"] = _rand(gen, hidden)
        t[f"{h}.{num_layers}.weight"] = _rand(gen, vocab, hidden, std=0.3)
    return {k: v.half() for k, v in t.items()}


def write_medusa(out: Path, tensors: dict[str, torch.Tensor], filename: str = "medusa_lm_head.pt", **config) -> Path:
    heads = 1 + max(int(k.split(".")[0]) for k in tensors if k.split(".")[0].isdigit())
    layers = sum(1 for k in tensors if k.startswith("0.") and k.endswith(".linear.weight"))
    cfg = dict(medusa_num_heads=heads, medusa_num_layers=layers, base_model_name_or_path="tiny-llama")
    cfg.update(config)
    return _save(out, cfg, tensors, filename)


# ---------------------------------------------------------------------------------------------------


def _run(target: Path, spec: dict, max_tokens: int = 6):
    llm = LLM(str(target), **KNOBS, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm, llm.generate([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]], params, use_tqdm=False)


def _load_error(target: Path, spec: dict) -> str:
    with pytest.raises(CheckpointError) as info:
        LLM(str(target), **KNOBS, speculative_config=spec)
    return str(info.value)


@pytest.fixture(scope="module")
def target(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


def test_published_layouts_load_and_draft(target, tmp_path):
    eagle = write_eagle1(tmp_path / "eagle", eagle1_tensors(1, embed=True, rotary=True))
    eagle_no_bias = write_eagle1(tmp_path / "eagle-nobias", eagle1_tensors(2, fc_bias=False))
    eagle3 = write_eagle3(tmp_path / "eagle3", eagle3_tensors(3, range(0, V, 2)),
                          eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    eagle3_st = write_eagle3(tmp_path / "eagle3-st", eagle3_tensors(4, range(V)), "model.safetensors")
    shared = {k: v for k, v in eagle3_tensors(4, range(V)).items() if k not in ("lm_head.weight", "d2t", "t2d")}
    eagle3_shared = _save(tmp_path / "eagle3-shared", _llama_head_config(eagle_aux_hidden_state_layer_ids=[0, 1, 2]),
                          shared, "model.safetensors")  # vLLM: no lm_head / d2t -> the target's lm_head
    medusa = write_medusa(tmp_path / "medusa", medusa_tensors(5, num_layers=2))
    st = {f"medusa_head.{k}": v for k, v in medusa_tensors(6).items()}  # Medusa-2 safetensors naming
    medusa_st = write_medusa(tmp_path / "medusa-st", medusa_tensors(6), "medusa_lm_head.safetensors")
    save_file(st, str(medusa_st / "medusa_lm_head.safetensors"))
    cases = [
        {"method": "eagle", "model": str(eagle)},
        {"method": "eagle", "model": str(eagle_no_bias)},
        {"method": "eagle3", "model": str(eagle3)},
        {"method": "eagle3", "model": str(eagle3_st), "eagle_aux_hidden_state_layer_ids": [1, 2, 0]},
        {"method": "eagle3", "model": str(eagle3_shared)},
        {"method": "medusa", "model": str(medusa)},
        {"method": "medusa", "model": str(medusa_st)},
    ]
    for spec in cases:
        llm, outs = _run(target, {**spec, "num_speculative_tokens": 3})
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs), spec
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0, spec
    head = llm.engine.runner.proposer.heads
    assert len(head) == 4 and len(head[0]) == 2  # 4 heads of 1 ResBlock + lm_head
    torch.testing.assert_close(head[2][0].linear.bias, medusa_tensors(6)["2.0.linear.bias"].float())


def test_method_is_inferred_from_the_model_as_vllm_does(target, tmp_path):
    """No "method": an EAGLE-3 head by its architecture, Medusa by medusa_num_heads, EAGLE-1 (a plain Llama
    config) by its name, "ngram" by itself, any other model as a draft model; then it drafts."""
    eagle3 = write_eagle3(tmp_path / "head-a", eagle3_tensors(3, range(0, V, 2)),
                          eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    eagle = write_eagle1(tmp_path / "EAGLE-tiny", eagle1_tensors(1))
    medusa = write_medusa(tmp_path / "head-b", medusa_tensors(5))
    plain_llama = write_eagle1(tmp_path / "head-c", eagle1_tensors(1))  # not named EAGLE: read as a draft model
    cases = {str(eagle3): "eagle3", str(eagle): "eagle", str(medusa): "medusa", str(target): "draft_model",
             str(plain_llama): "draft_model", "ngram": "ngram", "[ngram]": "ngram", "tiny-llama-eagle3": "eagle3"}
    assert {m: speculative_method({"model": m}) for m in cases} == cases
    assert speculative_method({"method": "eagle", "model": str(eagle3)}) == "eagle"  # an explicit method wins
    llm, outs = _run(target, {"model": str(eagle3), "num_speculative_tokens": 3})
    assert type(llm.engine.runner.proposer.head).__name__ == "Eagle3Head"
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_speculative_config_refuses_keys_its_method_does_not_read(target):
    """A misspelt knob is an error naming the valid keys, not a silent default; vLLM's draft_tensor_parallel_size
    is accepted at 1, the one size there is."""
    with pytest.raises(ValueError, match=r"unknown speculative_config key\(s\) \['prompt_lookup_maxx'\] for 'ngram'; "
                                         r"valid ones: .*'prompt_lookup_max'"):
        LLM(str(target), **KNOBS, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_maxx": 4})
    with pytest.raises(ValueError, match=r"\['prompt_lookup_max'\] for 'eagle3'"):  # an ngram knob on EAGLE-3
        LLM(str(target), **KNOBS, speculative_config={"model": "tiny-llama-eagle3", "num_speculative_tokens": 3,
                                                      "prompt_lookup_max": 4})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2"):
        LLM(str(target), **KNOBS, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "draft_tensor_parallel_size": 2})
    _, outs = _run(target, {"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1})
    assert all(o.outputs[0].token_ids for o in outs)


def test_eagle3_default_aux_layers_follow_vllm(tiny_checkpoint, tmp_path):
    """No ids in the config: vLLM's (2, L // 2, L - 3), here L = 3 -> (2, 1, 0)."""
    target = tiny_checkpoint("llama-gqa1")  # 3 layers, 1 KV head
    head = write_eagle3(tmp_path / "eagle3", eagle3_tensors(7, range(V)))
    llm, _ = _run(target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
    assert llm.engine.runner.proposer.aux_hidden_state_layers == (2, 1, 0)
    assert llm.engine.runner.taps.layers == (2, 1, 0)
    with pytest.raises(ValueError, match="must be distinct and in"):
        LLM(str(tiny_checkpoint("llama")), **KNOBS,
            speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})


class _RunsCode:
    """Unpickling this calls os.system: the kind of payload weights_only must refuse."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
@pytest.mark.parametrize("fmt", ["torch.save", "raw pickle"])
def test_pickle_that_runs_code_is_refused(target, tmp_path, method, fmt):
    marker = tmp_path / "pwned"
    tensors: dict = {"medusa": medusa_tensors(8), "eagle": eagle1_tensors(8), "eagle3": eagle3_tensors(8, range(V))}[
        method]
    head = {"medusa": write_medusa, "eagle": write_eagle1, "eagle3": write_eagle3}[method](tmp_path / "head", tensors)
    weights = head / ("medusa_lm_head.pt" if method == "medusa" else "pytorch_model.bin")
    evil = {"fc.weight" if method != "medusa" else "0.0.linear.weight": _RunsCode(marker)}
    if fmt == "torch.save":  # a real checkpoint with one poisoned entry
        torch.save({**tensors, **evil}, weights)
    else:  # a bare pickle stream, as an attacker would write it
        weights.write_bytes(pickle.dumps(evil, protocol=2))
    msg = _load_error(target, {"method": method, "model": str(head), "num_speculative_tokens": 2})
    assert not marker.exists(), "the pickle ran code"
    assert "weights-only" in msg and weights.name in msg, msg
    assert "system" in msg, msg  # torch names the global it refused


def test_corrupt_files_fail_at_load(target, tmp_path):
    head = write_medusa(tmp_path / "medusa", medusa_tensors(9))
    (head / "medusa_lm_head.pt").write_bytes(b"\x00not a checkpoint" * 10)
    assert "medusa_lm_head.pt" in _load_error(target, {"method": "medusa", "model": str(head),
                                                        "num_speculative_tokens": 2})
    head = write_eagle3(tmp_path / "eagle3", eagle3_tensors(9, range(V)), "model.safetensors")
    data = (head / "model.safetensors").read_bytes()
    (head / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated download
    assert "model.safetensors" in _load_error(target, {"method": "eagle3", "model": str(head),
                                                        "num_speculative_tokens": 2})
    (head / "config.json").write_text("{not json")
    assert "config.json" in _load_error(target, {"method": "eagle3", "model": str(head),
                                                  "num_speculative_tokens": 2})


def test_mismatched_heads_name_the_mismatch(target, tmp_path):
    def err(method: str, head: Path, **extra) -> str:
        return _load_error(target, {"method": method, "model": str(head), "num_speculative_tokens": 2, **extra})

    # Hidden size: a head trained for a 32-wide target.
    t = medusa_tensors(10, hidden=32)
    assert "hidden size 32" in err("medusa", write_medusa(tmp_path / "m-h", t)) and "64" in err(
        "medusa", tmp_path / "m-h")
    msg = err("eagle", write_eagle1(tmp_path / "e-h", eagle1_tensors(10), hidden_size=32))
    assert "hidden_size 32" in msg and "target's hidden size is 64" in msg, msg
    t3 = eagle3_tensors(10, range(V))
    t3["fc.weight"] = t3["fc.weight"][:, : 2 * H]  # fused from 2 layers, not 3
    msg = err("eagle3", write_eagle3(tmp_path / "e3-fc", t3, eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    assert "fc.weight" in msg and "(64, 128)" in msg and "(64, 192)" in msg, msg
    # Vocabulary: heads of a 512-token tokenizer.
    msg = err("medusa", write_medusa(tmp_path / "m-v", medusa_tensors(11, vocab=512)))
    assert "vocabulary of 512" in msg and "target has 256" in msg, msg
    msg = err("eagle", write_eagle1(tmp_path / "e-v", eagle1_tensors(11), vocab_size=512))
    assert "vocabulary of 512" in msg and "target has 256" in msg, msg
    t3 = eagle3_tensors(11, range(V))
    t3["d2t"] = t3["d2t"] + 300  # draft ids mapped past the target's vocabulary
    msg = err("eagle3", write_eagle3(tmp_path / "e3-v", t3, eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    assert "d2t" in msg and "[0, 256)" in msg, msg
    t3 = eagle3_tensors(12, range(0, V, 2))
    t3["t2d"] = ~t3["t2d"]
    msg = err("eagle3", write_eagle3(tmp_path / "e3-t2d", t3, eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    assert "t2d" in msg, msg
    # Missing and foreign tensors; one layout given to another method.
    t = eagle1_tensors(13)
    del t["layers.0.mlp.down_proj.weight"]
    assert "layers.0.mlp.down_proj.weight" in err("eagle", write_eagle1(tmp_path / "e-miss", t))
    t = eagle1_tensors(13)
    t["layers.0.self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
    assert "q_norm" in err("eagle", write_eagle1(tmp_path / "e-extra", t))
    e3 = write_eagle3(tmp_path / "e3", eagle3_tensors(14, range(V)))
    assert "EAGLE-3 layout" in err("eagle", e3)
    assert "not an EAGLE-3 checkpoint" in err("eagle3", write_eagle1(tmp_path / "e1", eagle1_tensors(14)))
    assert "not a Medusa checkpoint" in err("medusa", e3)


def test_draft_model_vocabulary_must_cover_the_target(target, tmp_path):
    small = tmp_path / "small-vocab"
    shutil.copytree(target, small)
    cfg = json.loads((small / "config.json").read_text())
    cfg["vocab_size"] = 128
    (small / "config.json").write_text(json.dumps(cfg))
    weights = load_file(small / "model.safetensors")
    weights = {k: v[:128] if k in ("model.embed_tokens.weight", "lm_head.weight") else v for k, v in weights.items()}
    save_file(weights, str(small / "model.safetensors"))
    msg = _load_error(target, {"method": "draft_model", "model": str(small), "num_speculative_tokens": 2})
    assert "vocabulary of 128 tokens" in msg and "256" in msg, msg
