"""Mixtral, and the Llama decoder with a MoE MLP that the Qwen MoE families reuse.

Attention, norms, rotary, the decoder's forward and the causal-LM surface are llama.py's; a MoE family
only says which MLP each layer gets (`make_mlp`) and how its checkpoint names experts. The MoE block,
its router and the EPLB placement live in `research_lm.moe`.

Mixtral: every layer is sparse; softmax router, top-k renormalised; checkpoint experts are
`block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up, down), read into our `mlp.experts.*`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from research_lm.models.base import ModelBuildContext, is_rotary_buffer
from research_lm.models.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding, rope_parameters
from research_lm.models.llama import (
    STACKED_PARAMS,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    LlamaVariant,
    PreNormDecoderLayer,
    head_size,
    layer_sliding_windows,
)
from research_lm.models.registry import register_model
from research_lm.moe.config import MoeOptions
from research_lm.moe.layer import MoeBlock
from research_lm.moe.router import RouterConfig
from research_lm.moe.weights import HF_EXPERT_PROJS, MIXTRAL_EXPERT_PROJS, load_moe_params
from research_lm.worker.parallel import TensorParallel

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MoeDecoderLayer(PreNormDecoderLayer):
    """Llama attention with the MLP given: a `MoeBlock` or a dense `GatedMLP`."""

    def __init__(
        self, hf_config: PretrainedConfig, variant: LlamaVariant, sliding_window: int | None,
        build: ModelBuildContext, mlp: nn.Module,
    ):
        attn = LlamaAttention(hf_config, variant, sliding_window, build)
        super().__init__(hf_config.hidden_size, hf_config.rms_norm_eps, attn, mlp)


class MoeLlamaModel(LlamaModel):
    """LlamaModel (its forward) whose layer i gets the MLP `make_mlp(i)`."""

    def __init__(
        self, hf_config: PretrainedConfig, variant: LlamaVariant, build: ModelBuildContext,
        make_mlp: Callable[[int], nn.Module],
    ):
        nn.Module.__init__(self)  # NOTE: LlamaModel.__init__ would build dense decoder layers
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, build.tp)
        self.rotary_emb = RotaryEmbedding(
            head_size(hf_config), rope_parameters(hf_config), hf_config.max_position_embeddings
        )
        windows = layer_sliding_windows(hf_config)
        self.layers = nn.ModuleList(
            MoeDecoderLayer(hf_config, variant, windows[i], build, make_mlp(i))
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class MoeCausalLM(LlamaForCausalLM):
    """A Llama-style causal LM with MoE MLPs. Subclasses define `make_mlp` and the checkpoint naming."""

    expert_projs: dict[str, str] = HF_EXPERT_PROJS  # checkpoint projection name -> gate / up / down
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # (checkpoint name part, ours)

    def make_backbone(self, hf_config: PretrainedConfig, build: ModelBuildContext) -> nn.Module:
        options = MoeOptions.from_extra(build.extra, build.device)
        return MoeLlamaModel(hf_config, self.variant(hf_config), build,
                             lambda i: self.make_mlp(hf_config, i, options, build.tp))

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int, options: MoeOptions,
                 tp: TensorParallel | None) -> nn.Module:
        """Layer `layer_idx`'s MLP; a dense one splits over `tp`, a MoE block's experts over `options.ep_group`."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def skip(name: str) -> bool:
            return is_rotary_buffer(name) or (self.tie_word_embeddings and name == "lm_head.weight")

        return load_moe_params(self, weights, STACKED_PARAMS, skip, self.expert_projs, self.checkpoint_renames)


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(MoeCausalLM):
    expert_projs = MIXTRAL_EXPERT_PROJS
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    @classmethod
    def variant(cls, hf_config: PretrainedConfig) -> LlamaVariant:
        return LlamaVariant()

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int, options: MoeOptions,
                 tp: TensorParallel | None) -> nn.Module:
        router = RouterConfig(top_k=hf_config.num_experts_per_tok, renormalize=True)
        return MoeBlock(
            hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_local_experts, router, options,
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
        )
