"""A draft model: a smaller Llama distilled from the target (KL to the target's next-token distribution).

The output is a standard Hugging Face checkpoint with the target's tokenizer, so the `draft_model`
proposer (and any engine) loads it like any model. By default the draft starts from the target's
embedding, final norm and first `num_hidden_layers` layers wherever the shapes agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from research_lm.harness.train.target import SHAPE_KEYS, llama_config, save_hf_checkpoint
from research_lm.harness.train.teacher import FrozenTarget


class DraftObjective:
    reports_ppl = False

    def __init__(self, target: FrozenTarget, tokenizer: Any, *, model: dict[str, Any] | None = None,
                 temperature: float = 1.0, init_from_target: bool = True):
        from transformers import LlamaForCausalLM

        if temperature <= 0:
            raise ValueError(f"train.head.temperature must be > 0, got {temperature}")
        base = {k: getattr(target.config, k) for k in SHAPE_KEYS if getattr(target.config, k, None) is not None}
        base["num_hidden_layers"] = max(1, target.num_layers // 4)
        base["rope_theta"] = target.rope_theta()
        config = llama_config(tokenizer, dict(model or {}), base=base, vocab_size=target.vocab_size)
        draft = LlamaForCausalLM(config)
        self.copied = 0
        if init_from_target:
            self.copied = _copy_matching(draft, target.model)
        self.module = draft.to(target.device)
        self.target, self.tokenizer, self.temperature = target, tokenizer, temperature

    def loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        target_logits = self.target.features(input_ids).logits  # [B, T, vocab] fp32
        logits = self.module(input_ids=input_ids, use_cache=False).logits.float()
        tau = self.temperature
        log_p = torch.log_softmax(target_logits / tau, -1)
        log_q = torch.log_softmax(logits / tau, -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean() * tau**2
        acc = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
        return kl, {"acc_0": acc}

    def save(self, out: Path, dtype: torch.dtype) -> None:
        save_hf_checkpoint(self.module, self.tokenizer, out, dtype)


@torch.no_grad()
def _copy_matching(draft: torch.nn.Module, target: torch.nn.Module) -> int:
    """Copy every target tensor whose name and shape the draft shares; returns how many were copied."""
    source = target.state_dict()
    copied = 0
    for name, tensor in draft.state_dict().items():
        if name in source and source[name].shape == tensor.shape:
            tensor.copy_(source[name])
            copied += 1
    return copied
