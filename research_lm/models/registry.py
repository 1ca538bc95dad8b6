"""Model registry keyed by the Hugging Face `architectures` name; families are imported only when used."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture name -> module that defines it. Importing the module runs its @register_model.
_MODEL_MODULES: dict[str, str] = {
    "LlamaForCausalLM": "research_lm.models.llama",
    "MistralForCausalLM": "research_lm.models.llama",
    "Qwen2ForCausalLM": "research_lm.models.llama",
    "Qwen3ForCausalLM": "research_lm.models.llama",
    "Mamba2ForCausalLM": "research_lm.models.mamba2",
    "BambaForCausalLM": "research_lm.models.bamba",
    "DeepseekV2ForCausalLM": "research_lm.models.deepseek",
    "DeepseekV3ForCausalLM": "research_lm.models.deepseek",
    "MixtralForCausalLM": "research_lm.models.mixtral",
    "Qwen2MoeForCausalLM": "research_lm.models.qwen_moe",
    "Qwen3MoeForCausalLM": "research_lm.models.qwen_moe",
}
_MODELS: dict[str, type[nn.Module]] = {}


def register_model(*arch_names: str):
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        for name in arch_names:
            _MODELS[name] = cls
        return cls

    return wrap


def supported_architectures() -> list[str]:
    return sorted(set(_MODEL_MODULES) | set(_MODELS))


def get_model_class(arch: str) -> type[nn.Module]:
    if arch not in _MODELS:
        if arch not in _MODEL_MODULES:
            raise ValueError(f"unsupported model architecture {arch!r}; supported: {supported_architectures()}")
        importlib.import_module(_MODEL_MODULES[arch])
    return _MODELS[arch]


def resolve_architecture(hf_config: Any) -> tuple[str, type[nn.Module]]:
    """The first of the config's `architectures` we implement, and its class."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS or arch in _MODEL_MODULES:
            return arch, get_model_class(arch)
    raise ValueError(
        f"unsupported model architecture {archs or '(config.json names none)'}; "
        f"supported: {supported_architectures()}"
    )
