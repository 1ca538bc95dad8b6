"""The shell every causal LM shares: a backbone, a (possibly tied) lm_head, embedding accessors, fp32 logits.

A family subclasses `CausalLMShell`, implements `make_backbone(hf_config, build)` and `forward`, and names
its backbone / embedding attributes after its checkpoint (`model.embed_tokens`, `backbone.embeddings`).
A family that shards over tensor-parallel ranks (`build.tp`) sets `tensor_parallel = True`; the others are refused
with `tensor_parallel_refusal` when built with a group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from research_lm.models.base import ModelBuildContext, build_scope
from research_lm.models.layers import ParallelLMHead, compute_logits

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class CausalLMShell(nn.Module):
    backbone_attr = "model"  # checkpoint prefix of the backbone
    embeddings_attr = "embed_tokens"  # the backbone's token embedding
    tensor_parallel = False  # whether its layers shard over `build.tp`
    tensor_parallel_refusal = "its layers are not split across ranks"

    def __init__(self, hf_config: PretrainedConfig, build: ModelBuildContext):
        super().__init__()
        if build.tp is not None and not self.tensor_parallel:
            raise ValueError(f"{type(self).__name__} does not support tensor parallelism "
                             f"({self.tensor_parallel_refusal}); run it with tensor_parallel_size=1")
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        with build_scope(build):
            setattr(self, self.backbone_attr, self.make_backbone(hf_config, build))
            if self.tie_word_embeddings:
                self.lm_head = self.embed_tokens
            else:
                self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, build.tp)

    @property
    def embed_tokens(self) -> nn.Module:
        return getattr(getattr(self, self.backbone_attr), self.embeddings_attr)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        return compute_logits(self.lm_head, hidden)
