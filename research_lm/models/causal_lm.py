"""The shell every causal LM shares: a backbone, a (possibly tied) lm_head, embedding accessors, fp32 logits.

A family subclasses `CausalLMShell`, implements `make_backbone(hf_config, build)` and `forward`, and names
its backbone / embedding attributes after its checkpoint (`model.embed_tokens`, `backbone.embeddings`).
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

    def __init__(self, hf_config: PretrainedConfig, build: ModelBuildContext):
        super().__init__()
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        with build_scope(build):
            setattr(self, self.backbone_attr, self.make_backbone(hf_config, build))
            if self.tie_word_embeddings:
                self.lm_head = self.embed_tokens
            else:
                self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)

    @property
    def embed_tokens(self) -> nn.Module:
        return getattr(getattr(self, self.backbone_attr), self.embeddings_attr)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        return compute_logits(self.lm_head, hidden)
