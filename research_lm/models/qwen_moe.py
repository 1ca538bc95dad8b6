"""Qwen2-MoE and Qwen3-MoE: the Llama decoder with MoE MLPs (see mixtral.py), differing only in data.

- Layer i is sparse when i is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0; other
  layers get a dense GatedMLP of `intermediate_size`. Experts have `moe_intermediate_size`.
- Router: softmax, top-k, renormalised when `norm_topk_prob`.
- Qwen2-MoE: q/k/v biases from `qkv_bias` (default true); a shared expert of
  `shared_expert_intermediate_size` added to every token, scaled by sigmoid(x · shared_expert_gate).
- Qwen3-MoE: `attention_bias` on q/k/v/o, RMSNorm per head on q and k; no shared expert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from research_lm.models.layers import GatedMLP
from research_lm.models.llama import LlamaVariant
from research_lm.models.mixtral import MoeCausalLM
from research_lm.models.registry import register_model
from research_lm.moe.config import MoeOptions
from research_lm.moe.layer import MoeBlock
from research_lm.moe.router import RouterConfig
from research_lm.worker.parallel import TensorParallel

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def is_sparse_layer(hf_config: PretrainedConfig, layer_idx: int) -> bool:
    """transformers' rule for Qwen MoE families."""
    mlp_only = getattr(hf_config, "mlp_only_layers", None) or []
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return layer_idx not in mlp_only and hf_config.num_experts > 0 and (layer_idx + 1) % step == 0


class QwenMoeCausalLM(MoeCausalLM):
    shared_expert: bool = False

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int, options: MoeOptions,
                 tp: TensorParallel | None) -> nn.Module:
        act = getattr(hf_config, "hidden_act", "silu")
        if not is_sparse_layer(hf_config, layer_idx):
            return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, act, tp=tp)
        router = RouterConfig(top_k=hf_config.num_experts_per_tok, renormalize=bool(hf_config.norm_topk_prob))
        shared = hf_config.shared_expert_intermediate_size if self.shared_expert else 0
        return MoeBlock(
            hf_config.hidden_size, hf_config.moe_intermediate_size, hf_config.num_experts, router, options,
            shared_intermediate_size=shared, shared_expert_gate=bool(shared), hidden_act=act,
        )


@register_model("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(QwenMoeCausalLM):
    shared_expert = True

    @classmethod
    def variant(cls, hf_config: PretrainedConfig) -> LlamaVariant:
        return LlamaVariant(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)))


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(QwenMoeCausalLM):
    @classmethod
    def variant(cls, hf_config: PretrainedConfig) -> LlamaVariant:
        attention_bias = getattr(hf_config, "attention_bias", False)
        return LlamaVariant(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
