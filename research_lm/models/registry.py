"""Model registry keyed by the Hugging Face `architectures` name; families are imported only when used."""

from __future__ import annotations

from typing import Any

from torch import nn

from attention_zoo.registries import Registry

# architecture name -> module that defines it. Importing the module runs its @register_model.
MODELS: Registry[type[nn.Module]] = Registry("model architecture", {
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
})
register_model = MODELS.register


def supported_architectures() -> list[str]:
    return MODELS.names()


def get_model_class(arch: str) -> type[nn.Module]:
    if arch not in MODELS:
        raise ValueError(f"unsupported model architecture {arch!r}; supported: {supported_architectures()}")
    return MODELS.get(arch)


def resolve_architecture(hf_config: Any) -> tuple[str, type[nn.Module]]:
    """The first of the config's `architectures` we implement, and its class."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODELS:
            return arch, get_model_class(arch)
    raise ValueError(
        f"unsupported model architecture {archs or '(config.json names none)'}; "
        f"supported: {supported_architectures()}"
    )
