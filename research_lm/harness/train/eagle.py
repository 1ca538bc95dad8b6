"""EAGLE-1 head (Li et al., 2024) in the published `yuhuili/EAGLE-*` layout, trained on the target's features.

Published tensors (state_dict of `EagleHead`):
    fc.weight                                     [hidden, 2 * hidden]  over (token embedding ++ feature)
    layers.{i}.self_attn.{q,k,v,o}_proj.weight    a Llama decoder layer per i
    layers.{i}.mlp.{gate,up,down}_proj.weight
    layers.{i}.post_attention_layernorm.weight
    layers.{i}.input_layernorm.weight             for i >= 1 only: layer 0 reads fc's output unnormalised
There is no final norm: the output is a predicted target feature (after the target's final norm) and the
target's lm_head turns it into logits; embedding and lm_head are the target's (not written).
config.json: a Llama config with `num_hidden_layers` = the head's layers and `bias: false` (no fc.bias).

Training (EAGLE's recipe, self-distilled): at position t the head reads the target feature f_t and the
embedding of token t+1 and regresses f_{t+1}: smooth-L1 on the features (weight 1.0) plus the
cross-entropy of lm_head(prediction) against the target's distribution for token t+2 (weight 0.1).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from research_lm.harness.train.artifacts import save_safetensors, write_json
from research_lm.harness.train.layers import MLP, Attention, RMSNorm, init_weights, rope_cos_sin
from research_lm.harness.train.teacher import FrozenTarget

WEIGHTS_NAME = "model.safetensors"


class EagleLayer(nn.Module):
    def __init__(self, index: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 eps: float):
        super().__init__()
        if index != 0:
            self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, hidden, heads, kv_heads, head_dim)
        self.mlp = MLP(hidden, intermediate)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn(h, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    def __init__(self, *, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 num_layers: int = 1):
        super().__init__()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(EagleLayer(i, hidden, intermediate, heads, kv_heads, head_dim, eps)
                                    for i in range(num_layers))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> torch.Tensor:
        """embeds (of token t+1), features (of position t): [B, T, hidden] -> predicted f_{t+1}."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class EagleObjective:
    reports_ppl = False

    def __init__(self, target: FrozenTarget, *, num_layers: int = 1, intermediate_size: int | None = None,
                 feature_weight: float = 1.0, token_weight: float = 0.1):
        if num_layers < 1:
            raise ValueError(f"train.head.num_layers must be >= 1, got {num_layers}")
        cfg = target.config
        self.target = target
        self.theta = target.rope_theta()
        self.head_dim = getattr(cfg, "head_dim", None) or target.hidden_size // cfg.num_attention_heads
        self.shape = dict(hidden=target.hidden_size, intermediate=intermediate_size or cfg.intermediate_size,
                          heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=self.head_dim,
                          eps=cfg.rms_norm_eps, num_layers=num_layers)
        self.feature_weight, self.token_weight = feature_weight, token_weight
        head = EagleHead(**self.shape)
        init_weights(head)
        self.module = head.to(target.device)

    def loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        t = input_ids.shape[1]
        feats = self.target.features(input_ids)
        pos = torch.arange(t, device=input_ids.device)
        cos, sin = rope_cos_sin(pos, self.head_dim, self.theta)
        next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
        pred = self.module(F.embedding(next_ids, self.target.embed_weight), feats.hidden, cos, sin).float()
        # Position t < T-1 has a next feature f_{t+1}; the last position has none.
        pred, target_feat = pred[:, :-1], feats.hidden[:, 1:].float()  # [B, T-1, hidden]
        feature_loss = F.smooth_l1_loss(pred, target_feat, reduction="none").mean(-1).mean()
        logits = F.linear(pred, self.target.lm_head_weight.float())  # [B, T-1, vocab]
        target_logits = feats.logits[:, 1:]  # the target's distribution for token t+2
        token_loss = -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()
        acc = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
        loss = self.feature_weight * feature_loss + self.token_weight * token_loss
        return loss, {"feature_loss": feature_loss.detach(), "token_loss": token_loss.detach(), "acc_0": acc}

    def save(self, out: Path, dtype: torch.dtype) -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_safetensors(self.module.state_dict(), out / WEIGHTS_NAME, dtype)
        cfg, s = self.target.config, self.shape
        write_json(out / "config.json", {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": s["hidden"], "intermediate_size": s["intermediate"], "num_hidden_layers": s["num_layers"],
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
            "hidden_act": "silu", "rms_norm_eps": s["eps"], "rope_theta": self.theta, "rope_scaling": None,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": self.target.vocab_size,
            "tie_word_embeddings": False, "bias": False,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
            "torch_dtype": str(dtype).removeprefix("torch."),
        })
