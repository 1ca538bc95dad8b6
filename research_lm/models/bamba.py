"""Bamba (IBM): a hybrid of Mamba2 mixer layers and a few attention layers, each followed by a SwiGLU MLP.

`config.layers_block_type[i]` (from `attn_layer_indices`) is "full_attention" — Llama-style GQA with
RoPE on the first half of each head (`partial_rotary_factor` 0.5), served by `build.attention_backend`
— or "linear_attention" — the Mamba2 mixer of `models.mamba2`, served by `build.extra["mamba_backend"]`.
The runner allocates both caches (paged KV blocks, per-request state slots) from one budget.
Tensor parallelism (`build.tp`): the attention layers and MLPs split as Llama's, the Mamba2 mixers as
`models.mamba2` describes (SSM heads, B/C groups), the embedding and LM head by vocabulary rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from research_lm.models.base import ModelBuildContext, is_rotary_buffer, load_params
from research_lm.models.causal_lm import CausalLMShell
from research_lm.models.layers import (
    GatedMLP,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    VocabParallelEmbedding,
    rope_parameters,
)
from research_lm.models.llama import STACKED_PARAMS, LlamaAttention, LlamaVariant, head_size
from research_lm.models.mamba2 import Mamba2Mixer, Mamba2MixerConfig, time_step_limit
from research_lm.models.registry import register_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def bamba_mixer_config(hf: PretrainedConfig) -> Mamba2MixerConfig:
    return Mamba2MixerConfig(
        hidden_size=hf.hidden_size, num_heads=hf.mamba_n_heads, head_dim=hf.mamba_d_head,
        n_groups=hf.mamba_n_groups, state_size=hf.mamba_d_state, conv_kernel=hf.mamba_d_conv,
        chunk_size=hf.mamba_chunk_size, conv_bias=hf.mamba_conv_bias, proj_bias=hf.mamba_proj_bias,
        norm_eps=hf.rms_norm_eps, time_step_limit=time_step_limit(hf.time_step_limit), activation=hf.hidden_act,
        heads_field="mamba_n_heads", groups_field="mamba_n_groups",
    )


class BambaDecoderLayer(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, layer_type: str, build: ModelBuildContext):
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.feed_forward = GatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act, hf_config.mlp_bias,
                                     build.tp)
        self.is_mamba = layer_type == "linear_attention"
        if self.is_mamba:
            self.mamba = Mamba2Mixer(bamba_mixer_config(hf_config), build)
        elif layer_type == "full_attention":
            bias = getattr(hf_config, "attention_bias", False)
            self.self_attn = LlamaAttention(hf_config, LlamaVariant(qkv_bias=bias, o_bias=bias), None, build)
        else:
            raise ValueError(f"Bamba layer type {layer_type!r} is not supported; supported: linear_attention, "
                             "full_attention")

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: the previous layer's output
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None at layer 0
        rope: Rope,
        attn_metadata: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, residual); the stream is their sum
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_mamba:
            hidden = self.mamba(hidden, attn_metadata)
        else:
            hidden = self.self_attn(hidden, rope, attn_metadata)
        hidden, residual = self.pre_ff_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class BambaModel(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, build: ModelBuildContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, build.tp)
        self.rotary_emb = RotaryEmbedding(
            head_size(hf_config), rope_parameters(hf_config), hf_config.max_position_embeddings
        )
        self.layers = nn.ModuleList(
            BambaDecoderLayer(hf_config, layer_type, build) for layer_type in hf_config.layers_block_type
        )
        self.final_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: dict[str, Any],
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size], final norm applied
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        rope = self.rotary_emb(positions)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, attn_metadata)
        hidden, _ = self.final_layernorm(hidden, residual)
        return hidden


@register_model("BambaForCausalLM")
class BambaForCausalLM(CausalLMShell):
    tensor_parallel = True  # attention heads, SSM heads, B/C groups, MLP columns and vocabulary split over `build.tp`

    def make_backbone(self, hf_config: PretrainedConfig, build: ModelBuildContext) -> nn.Module:
        return BambaModel(hf_config, build)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: dict[str, Any],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.model(input_ids, positions, attn_metadata, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def skip(name: str) -> bool:
            return is_rotary_buffer(name) or (self.tie_word_embeddings and name == "lm_head.weight")

        return load_params(self, weights, STACKED_PARAMS, skip)

    @torch.no_grad()
    def init_random_weights(self, gen: torch.Generator, std: float = 0.02) -> None:
        for name, param in self.named_parameters():
            if ".mamba." in name:
                continue
            if param.dim() >= 2:
                param.normal_(0.0, std, generator=gen)
            else:
                param.fill_(1.0 if "norm" in name else 0.0)
        for layer in self.model.layers:
            if layer.is_mamba:
                layer.mamba.init_random_weights(gen, std)
