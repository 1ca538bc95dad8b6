"""Tiny random Hugging Face checkpoints built on the fly, for presets whose architecture has no built-in
checkpoint (sliding-window Mistral, DeepSeek MLA, Mamba2, MoE models).

    path = build_random_checkpoint(run_dir / "model", "MistralConfig", {"sliding_window": 64, ...}, seed=0)

The checkpoint is written by `transformers` itself (`AutoModelForCausalLM.from_config(...)
.save_pretrained(dir)`), so it takes exactly the loading path a user's real checkpoint takes; the
built-in tokenizer (`tiny-llama`'s BPE over the stdlib) is copied beside it, so text workloads run.
Weights are `transformers`' own initialisation under `torch.manual_seed(seed)`: deterministic, and
meaningless for anything that depends on weight values (acceptance rates, routing skew). Speed and
memory do not depend on weight values.

A `model` config group option selects one with a `random:` block (conf/model/random-*.yaml):

    random:
      architecture: MistralConfig   # a transformers config class
      seed: ${seed}
      config: {hidden_size: 256, ...}  # its keyword arguments
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from research_lm.models.loader import resolve_model_path

RECIPE = "random_recipe.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def recipe_hash(architecture: str, config: dict[str, Any], seed: int, tokenizer: str | None) -> str:
    blob = json.dumps({"architecture": architecture, "config": config, "seed": seed, "tokenizer": tokenizer},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_random_checkpoint(out_dir: str | Path, architecture: str, config: dict[str, Any] | None = None, *,
                            seed: int = 0, tokenizer: str | None = "tiny-llama", dtype: str = "float32") -> Path:
    """Write a seeded random checkpoint of `architecture` (a transformers config class name, e.g.
    "MistralConfig") with `config` keyword arguments to out_dir; return out_dir. A directory already
    holding the same recipe is reused. `tokenizer`: a built-in name or directory whose tokenizer files
    are copied beside the weights; its vocabulary size, eos and pad ids fill the config's defaults.
    `dtype`: the saved weights' dtype (bfloat16 halves the bytes of a GPU-sized model)."""
    import transformers

    out = Path(out_dir)
    config = dict(config or {})
    digest = recipe_hash(architecture, {**config, "__dtype__": dtype}, seed, tokenizer)
    recipe_file = out / RECIPE
    if recipe_file.is_file() and json.loads(recipe_file.read_text()).get("hash") == digest:
        return out
    config_class = getattr(transformers, architecture, None)
    if config_class is None or not isinstance(config_class, type) or not architecture.endswith("Config"):
        raise ValueError(f"random model architecture {architecture!r} is not a transformers config class "
                         "(e.g. LlamaConfig, MistralConfig, DeepseekV2Config, Mamba2Config)")
    tok_dir = resolve_model_path(tokenizer) if tokenizer else None
    if tok_dir is not None:
        tok_cfg = json.loads((tok_dir / "config.json").read_text()) if (tok_dir / "config.json").is_file() else {}
        for key in ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id"):
            if key in tok_cfg:
                config.setdefault(key, tok_cfg[key])
    hf_config = config_class(**config)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype))
    finally:
        torch.random.set_rng_state(state)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    if tok_dir is not None:
        for name in _TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copy(tok_dir / name, out / name)
    num_params = sum(p.numel() for p in model.parameters())
    recipe_file.write_text(json.dumps({"hash": digest, "architecture": architecture, "config": config,
                                       "seed": seed, "tokenizer": tokenizer, "dtype": dtype, "num_params": num_params,
                                       "weights": "random: transformers init under torch.manual_seed(seed)"},
                                      indent=2, default=str) + "\n")
    return out
