"""Model definitions keyed by Hugging Face architecture name, and the checkpoint loader.

`load_model(path, device=..., dtype=..., attention_backend=...)` is the usual entry point; a new
family is one file here plus one line in `registry.MODELS`. transformers is imported only
when a config or tokenizer is read.
"""

from research_lm.models.base import CausalLM, CheckpointError, ModelBuildContext
from research_lm.models.loader import (
    build_model,
    builtin_models,
    init_random_weights,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from research_lm.models.registry import get_model_class, register_model, supported_architectures

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ModelBuildContext",
    "build_model",
    "builtin_models",
    "get_model_class",
    "init_random_weights",
    "load_config",
    "load_model",
    "load_tokenizer",
    "register_model",
    "resolve_model_path",
    "supported_architectures",
]
