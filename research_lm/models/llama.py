"""The Llama family: Llama, Mistral, Qwen2, Qwen3. One decoder; the variants differ only in data.

- Llama / Mistral: biases from `attention_bias` / `mlp_bias`; Mistral slides every layer's window.
- Qwen2: q/k/v biases (always), no o_proj bias.
- Qwen3: `attention_bias` on q/k/v/o, and an RMSNorm per head on q and k before RoPE.
Sliding windows follow `config.layer_types` when present, else Qwen's `use_sliding_window` +
`max_window_layers`, else `sliding_window` on every layer (see `layer_sliding_windows`).
Tensor parallelism (`build.tp`): each rank holds num_heads / N query heads and their KV heads (see
`QKVParallelLinear`), intermediate_size / N MLP columns and vocab_size / N embedding and LM-head rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from attention_zoo import Attention, AttentionSpec
from research_lm.models.base import ModelBuildContext, StackedParams, is_rotary_buffer, load_params
from research_lm.models.causal_lm import CausalLMShell
from research_lm.models.layers import (
    GatedMLP,
    QKVParallelLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rope,
    rope_parameters,
)
from research_lm.models.registry import register_model
from research_lm.ops import use_fused

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Checkpoint projections that live stacked in one of our parameters.
STACKED_PARAMS: StackedParams = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


@dataclass(frozen=True)
class LlamaVariant:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_size on each q and k head, before RoPE


def head_size(hf_config: PretrainedConfig) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def layer_sliding_windows(hf_config: PretrainedConfig) -> list[int | None]:
    """The attention window of each layer (None = full causal), as transformers applies it."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None:
        return [None] * n
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if hasattr(hf_config, "use_sliding_window"):  # Qwen configs from before `layer_types`
        if not hf_config.use_sliding_window:
            return [None] * n
        return [window if i >= hf_config.max_window_layers else None for i in range(n)]
    return [window] * n


class LlamaAttention(nn.Module):
    def __init__(
        self, hf_config: PretrainedConfig, variant: LlamaVariant, sliding_window: int | None,
        build: ModelBuildContext,
    ):
        super().__init__()
        hidden, num_heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.head_size = head_size(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_size, num_heads, getattr(hf_config, "num_key_value_heads", None) or num_heads,
            variant.qkv_bias, build.tp,
        )
        # this rank's heads (all of them without tensor parallelism): the KV cache holds only these
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_size, hidden, variant.o_bias, build.tp)
        self.q_norm = RMSNorm(self.head_size, hf_config.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(self.head_size, hf_config.rms_norm_eps) if variant.qk_norm else None
        spec = AttentionSpec(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            scale=self.head_size**-0.5, sliding_window=sliding_window,
        )
        self.attn = Attention(spec, build.attention_backend, build.device, build.dtype)
        self.takes_prenorm = build.tp is None  # whole weights: forward(prenorm=...) may fuse the norm and residual

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rope: Rope,
        attn_metadata: dict[str, Any],
        prenorm: RMSNorm | None = None,  # hidden is the residual stream: return hidden + attn(prenorm(hidden))
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        qkv = self.qkv_proj(hidden) if prenorm is None else self.qkv_proj.skinny(hidden, prenorm)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.attn.takes_rope(rope):  # the backend rotates q and k, k as it writes the cache: one kernel
            out = self.attn(q, k, v, attn_metadata, rope)  # [num_tokens, num_heads, head_size]
        else:
            q, k = apply_rope(rope, q, k)
            out = self.attn(q, k, v, attn_metadata)
        out = out.reshape(num_tokens, q_size)
        return self.o_proj(out) if prenorm is None else self.o_proj.skinny(out, residual=hidden)


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)), with the residual add fused into the norms.

    The attention and the MLP are given, so Llama, MoE and DeepSeek layers share this one forward.
    In steps of up to `skinny_rows` tokens on CUDA, attention and MLP that can (`takes_prenorm`) take the norm and
    the residual add into their projections' kernels instead (`Linear.skinny`): the layer then returns the whole
    stream and no residual, as the embedding enters layer 0."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.fused_ops = True
        self.skinny_rows = 0  # EngineConfig.skinny_rows
        self.batch_invariant = False  # the skinny kernels differ from the many-row path: off when it must not

    def skinny(self, hidden: torch.Tensor) -> bool:
        return (hidden.shape[0] <= self.skinny_rows and use_fused(self, hidden) and not self.batch_invariant
                and getattr(self.self_attn, "takes_prenorm", False) and getattr(self.mlp, "takes_prenorm", False)
                and isinstance(self.input_layernorm, RMSNorm) and isinstance(self.post_attention_layernorm, RMSNorm))

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: the previous layer's output
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None at layer 0
        rope: Rope,
        attn_metadata: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # (this layer's output, residual); the stream is their sum
        if self.skinny(hidden):
            stream = hidden if residual is None else hidden + residual
            stream = self.self_attn(stream, rope, attn_metadata, prenorm=self.input_layernorm)
            return self.mlp(stream, prenorm=self.post_attention_layernorm), None
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self, hf_config: PretrainedConfig, variant: LlamaVariant, sliding_window: int | None,
        build: ModelBuildContext,
    ):
        attn = LlamaAttention(hf_config, variant, sliding_window, build)
        mlp = GatedMLP(
            hf_config.hidden_size, hf_config.intermediate_size, getattr(hf_config, "hidden_act", "silu"),
            variant.mlp_bias, build.tp,
        )
        super().__init__(hf_config.hidden_size, hf_config.rms_norm_eps, attn, mlp)


class LlamaModel(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, variant: LlamaVariant, build: ModelBuildContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, build.tp)
        self.rotary_emb = RotaryEmbedding(
            head_size(hf_config), rope_parameters(hf_config), hf_config.max_position_embeddings
        )
        windows = layer_sliding_windows(hf_config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, variant, windows[i], build) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: dict[str, Any],
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size]; replaces the lookup
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        rope = self.rotary_emb(positions)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, attn_metadata)
        out = self.norm(hidden, residual)  # (positional: hidden-state taps read the stream from the arguments)
        return out if residual is None else out[0]


@register_model("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(CausalLMShell):
    tensor_parallel = True  # heads, KV heads, MLP columns and vocabulary split over `build.tp`

    @classmethod
    def variant(cls, hf_config: PretrainedConfig) -> LlamaVariant:
        attention_bias = getattr(hf_config, "attention_bias", False)
        return LlamaVariant(
            qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=getattr(hf_config, "mlp_bias", False)
        )

    def make_backbone(self, hf_config: PretrainedConfig, build: ModelBuildContext) -> nn.Module:
        return LlamaModel(hf_config, self.variant(hf_config), build)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: dict[str, Any],
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.model(input_ids, positions, attn_metadata, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def skip(name: str) -> bool:
            return is_rotary_buffer(name) or (self.tie_word_embeddings and name == "lm_head.weight")

        return load_params(self, weights, STACKED_PARAMS, skip)


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, hf_config: PretrainedConfig) -> LlamaVariant:
        return LlamaVariant(qkv_bias=True)


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, hf_config: PretrainedConfig) -> LlamaVariant:
        attention_bias = getattr(hf_config, "attention_bias", False)
        return LlamaVariant(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
