"""Medusa heads (Cai et al., 2024) in the published `FasterDecoding/medusa-*` layout, self-distilled.

Published tensors (`medusa_lm_head.safetensors`, the state_dict of a ModuleList of Sequentials):
    {head}.{layer}.linear.weight   [hidden, hidden]   ResBlock: x + SiLU(linear(x)), layer < num_layers
    {head}.{layer}.linear.bias     [hidden]
    {head}.{num_layers}.weight     [vocab, hidden]    the head's own lm_head (no bias)
config.json: `medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path` (+ hidden_size, vocab_size).

Head k reads the target's last feature at position t (after the final norm) and predicts token t+2+k
(the target's own lm_head predicts t+1): cross-entropy against the target's distribution at position
t+1+k, weighted 0.8^k as in Medusa. ResBlocks start as the identity and each lm_head as the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from research_lm.harness.train.artifacts import save_safetensors, write_json
from research_lm.harness.train.teacher import FrozenTarget

WEIGHTS_NAME = "medusa_lm_head.safetensors"


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # the identity at start (Medusa zeroes the weight; we also the bias)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def medusa_heads(num_heads: int, num_layers: int, hidden: int, vocab: int) -> nn.ModuleList:
    return nn.ModuleList(
        nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
        for _ in range(num_heads))


class MedusaObjective:
    reports_ppl = False

    def __init__(self, target: FrozenTarget, *, num_heads: int = 4, num_layers: int = 1, decay: float = 0.8):
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"train.head.num_heads and num_layers must be >= 1, got {num_heads}, {num_layers}")
        self.target, self.num_heads, self.num_layers, self.decay = target, num_heads, num_layers, decay
        heads = medusa_heads(num_heads, num_layers, target.hidden_size, target.vocab_size)
        with torch.no_grad():
            for head in heads:
                head[-1].weight.copy_(target.lm_head_weight.float().cpu())
        self.module = heads.to(target.device)

    def loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        t = input_ids.shape[1]
        feats = self.target.features(input_ids)
        total = torch.zeros((), device=input_ids.device)
        metrics: dict[str, torch.Tensor] = {}
        for k, head in enumerate(self.module):
            n = t - 1 - k  # positions t with a target distribution at t+1+k
            if n <= 0:
                break
            logits = head(feats.hidden[:, :n]).float()  # [B, n, vocab]
            target_logits = feats.logits[:, 1 + k:]  # [B, n, vocab]
            ce = -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()
            total = total + self.decay ** k * ce
            metrics[f"loss_{k}"] = ce.detach()
            metrics[f"acc_{k}"] = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
        return total, metrics

    def save(self, out: Path, dtype: torch.dtype) -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_safetensors(self.module.state_dict(), out / WEIGHTS_NAME, dtype)
        write_json(out / "config.json", {
            "medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
            "base_model_name_or_path": str(self.target.path), "hidden_size": self.target.hidden_size,
            "vocab_size": self.target.vocab_size, "torch_dtype": str(dtype).removeprefix("torch."),
        })
