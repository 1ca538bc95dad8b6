"""`train_target`: a small Llama trained from scratch on the stdlib + pydoc corpus.

    result = train_target(TrainConfig(output_dir="outputs/train/target", steps=500))
    LLM(str(result.output_dir)).generate("def main(")

The output is a standard Hugging Face checkpoint (`save_pretrained` + the tokenizer files) plus
recipe.json (corpus hash, seed, steps, final train/val loss), so every loader reads it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from research_lm.harness.train.artifacts import TrainResult, summarize, write_recipe
from research_lm.harness.train.config import TrainConfig
from research_lm.harness.train.data import PackedData, load_corpus
from research_lm.harness.train.loop import fit
from research_lm.models.loader import resolve_model_path

# Shape keys `train.model` may set; the rest of the LlamaConfig comes from the tokenizer.
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps",
              "tie_word_embeddings")


def default_shape() -> dict[str, Any]:
    """The built-in tiny-llama's shape (hidden 128, 4 layers, 4 heads, 2 KV heads)."""
    config = json.loads((resolve_model_path("tiny-llama") / "config.json").read_text())
    return {k: config[k] for k in SHAPE_KEYS if k in config and k != "rope_theta"}


def llama_config(tokenizer: Any, shape: dict[str, Any], *, base: dict[str, Any] | None = None,
                 vocab_size: int | None = None):
    """A LlamaConfig: `shape` over `base` (default: tiny-llama's shape), special tokens from `tokenizer`."""
    from transformers import LlamaConfig

    unknown = sorted(set(shape) - set(SHAPE_KEYS))
    if unknown:
        raise ValueError(f"unknown train.model key(s) {unknown}; valid ones: {list(SHAPE_KEYS)}")
    user = {k: v for k, v in shape.items() if v is not None}
    shape = {**(default_shape() if base is None else base), **user}
    rope_theta = shape.pop("rope_theta", 10000.0)
    if "head_dim" not in user:
        if shape["hidden_size"] % shape["num_attention_heads"]:
            raise ValueError(f"train.model.hidden_size ({shape['hidden_size']}) must be a multiple of "
                             f"num_attention_heads ({shape['num_attention_heads']}) unless head_dim is given")
        shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return LlamaConfig(vocab_size=vocab_size or len(tokenizer), bos_token_id=eos, eos_token_id=eos,
                       pad_token_id=pad, rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
                       **{"tie_word_embeddings": True, **shape})


class LMObjective:
    """Next-token cross-entropy on the packed corpus (transformers shifts the labels)."""

    reports_ppl = True

    def __init__(self, model: torch.nn.Module):
        self.module = model

    def loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = self.module(input_ids=input_ids, labels=input_ids, use_cache=False)
        return out.loss, {}


def save_hf_checkpoint(model: torch.nn.Module, tokenizer: Any, out: Path, dtype: torch.dtype) -> None:
    out.mkdir(parents=True, exist_ok=True)
    frozen = copy.deepcopy(model).to(device="cpu", dtype=dtype)
    frozen.config.dtype = str(dtype).removeprefix("torch.")
    frozen.save_pretrained(out)
    tokenizer.save_pretrained(out)


def train_target(cfg: TrainConfig, *, tokenizer: str = "tiny-llama", model: dict[str, Any] | None = None,
                 logger: Any = None) -> TrainResult:
    """Train a Llama of shape `model` (tiny-llama's by default) with `tokenizer`'s vocabulary."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    tok_dir = resolve_model_path(tokenizer)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    corpus = load_corpus(tok_dir, corpus_bytes=cfg.corpus_bytes, pydoc=cfg.pydoc, cache_dir=cfg.cache_dir)
    data = PackedData(corpus, cfg.seq_len, cfg.val_percent)
    config = llama_config(tok, dict(model or {}))
    if cfg.seq_len > config.max_position_embeddings:
        raise ValueError(f"train.seq_len ({cfg.seq_len}) exceeds max_position_embeddings "
                         f"({config.max_position_embeddings})")
    lm = LlamaForCausalLM(config).to(cfg.resolve_device())
    result = fit(LMObjective(lm), data, cfg, logger)
    out = Path(cfg.output_dir)
    save_hf_checkpoint(lm, tok, out, cfg.torch_save_dtype)
    summary = summarize("train_target", cfg, result, corpus, out, sum(p.numel() for p in lm.parameters()),
                        {"val_docs": data.num_val_docs})
    write_recipe(out, summary, cfg, {"tokenizer": str(tok_dir), "model": {
        k: getattr(config, k) for k in SHAPE_KEYS if hasattr(config, k)}})
    return TrainResult(out, summary, result)
