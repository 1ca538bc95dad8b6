"""EAGLE-3 head (Li et al., 2025) in the published `yuhuili/EAGLE3-*` layout, trained on the target's features.

Published tensors (state_dict of `Eagle3Head`):
    fc.weight                                  [hidden, 3 * hidden]  fuses the low / mid / high features
    midlayer.input_layernorm.weight            [hidden]              on the token embedding
    midlayer.hidden_norm.weight                [hidden]              on the fused feature
    midlayer.self_attn.{q,k,v}_proj.weight     [heads * head_dim, 2 * hidden]  (embedding ++ feature)
    midlayer.self_attn.o_proj.weight           [hidden, heads * head_dim]
    midlayer.mlp.{gate,up,down}_proj.weight, midlayer.post_attention_layernorm.weight
    norm.weight                                [hidden]
    lm_head.weight                             [draft_vocab, hidden]
    d2t                                        [draft_vocab] int64: target id = draft id + d2t[draft id]
    t2d                                        [vocab] bool: target token is in the draft vocabulary
The embedding is the target's (not written). config.json: a Llama config with
`architectures: ["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`, `draft_vocab_size` and
`eagle_aux_hidden_state_layer_ids` (the target layers whose input residual streams are fused).

Training (EAGLE-3's recipe, self-distilled): at position t the head reads the fused target features
of t and the embedding of token t+1 and predicts the target's distribution for token t+2 over the
draft vocabulary (positions whose target argmax is outside it are masked). Training-time test
unrolls `ttt_steps` steps: step j feeds the head its own previous output instead of the target's
feature (attention per `layers.ttt_attention`), weighted 0.8^j.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from research_lm.harness.train.artifacts import save_safetensors, write_json
from research_lm.harness.train.layers import MLP, Attention, RMSNorm, init_weights, rope_cos_sin, ttt_attention
from research_lm.harness.train.teacher import FrozenTarget

WEIGHTS_NAME = "model.safetensors"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low / mid / high target layers: vLLM's (2, L // 2, L - 3) when those are distinct, else
    (1, L // 2, L - 1) (shallow targets: 4 layers -> (1, 2, 3)); (0, 1, 2) for 3 layers."""
    if num_layers < 3:
        raise ValueError(f"EAGLE-3 fuses three distinct target layers; the target has only {num_layers}")
    for ids in ((2, num_layers // 2, num_layers - 3), (1, num_layers // 2, num_layers - 1), (0, 1, 2)):
        if ids[0] < ids[1] < ids[2] and 0 <= ids[0] and ids[2] < num_layers:
            return ids
    raise AssertionError("unreachable: (0, 1, 2) fits every target of >= 3 layers")


def draft_vocab_maps(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_counts: [vocab] -> d2t [draft_vocab] int64, t2d [vocab] bool for the most frequent tokens.

    Ties go to the smaller token id; draft ids are assigned in increasing target-id order.
    """
    vocab = token_counts.numel()
    order = sorted(range(vocab), key=lambda i: (-int(token_counts[i]), i))
    used = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.int64)
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


class Eagle3Layer(nn.Module):
    """The `midlayer`: attention over [norm(embedding) ++ norm(feature)], residual on the feature."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Attention(2 * hidden, hidden, heads, kv_heads, head_dim)
        self.mlp = MLP(hidden, intermediate)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """embeds, hidden: [B, T, hidden]. Appends this step's k, v to keys/values; returns [B, T, hidden]."""
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q, k, v = self.self_attn.qkv(x, cos, sin)
        keys.append(k)
        values.append(v)
        h = residual + self.self_attn.out(ttt_attention(q, keys, values))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    def __init__(self, *, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 vocab: int, draft_vocab: int, num_aux: int = 3):
        super().__init__()
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(hidden, intermediate, heads, kv_heads, head_dim, eps)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t] <- x[:, t + n], the last n positions zero-filled (they are masked out of the loss)."""
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


class Eagle3Objective:
    reports_ppl = False

    def __init__(self, target: FrozenTarget, token_counts: torch.Tensor, *, draft_vocab_size: int | None = None,
                 ttt_steps: int = 1, aux_layers: list[int] | None = None, intermediate_size: int | None = None,
                 step_decay: float = 0.8):
        cfg = target.config
        vocab, hidden = target.vocab_size, target.hidden_size
        self.draft_vocab = min(draft_vocab_size or vocab, vocab)
        self.aux_layers = tuple(aux_layers) if aux_layers else default_aux_layers(target.num_layers)
        if len(set(self.aux_layers)) != 3 or not all(0 <= i < target.num_layers for i in self.aux_layers):
            raise ValueError(f"train.head.aux_layers must name 3 distinct target layers in "
                             f"[0, {target.num_layers}), got {list(self.aux_layers)}")
        if ttt_steps < 1:
            raise ValueError(f"train.head.ttt_steps must be >= 1, got {ttt_steps}")
        self.ttt_steps, self.step_decay = ttt_steps, step_decay
        self.target = target
        self.theta = target.rope_theta()
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
        self.shape = dict(hidden=hidden, intermediate=intermediate_size or cfg.intermediate_size,
                          heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=self.head_dim,
                          eps=cfg.rms_norm_eps, vocab=vocab, draft_vocab=self.draft_vocab)
        head = Eagle3Head(**self.shape)
        init_weights(head)
        d2t, t2d = draft_vocab_maps(token_counts, self.draft_vocab)
        with torch.no_grad():
            head.d2t.copy_(d2t)
            head.t2d.copy_(t2d)
            rows = target.lm_head_weight[t2d.to(target.device)]
            head.lm_head.weight.copy_(rows.float().cpu())  # start from the target's rows for the draft vocab
        self.module = head.to(target.device)

    def loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        head, (b, t) = self.module, input_ids.shape
        feats = self.target.features(input_ids, self.aux_layers)
        hidden = head.fc(feats.aux)  # [B, T, hidden]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        total = torch.zeros((), device=input_ids.device)
        metrics: dict[str, torch.Tensor] = {}
        pos = torch.arange(t, device=input_ids.device)
        draft_to_target = torch.arange(self.draft_vocab, device=input_ids.device) + head.d2t
        for j in range(self.ttt_steps):
            cos, sin = rope_cos_sin(pos + j, self.head_dim, self.theta)
            embeds = F.embedding(_shift(input_ids, 1 + j), self.target.embed_weight)
            hidden = head.midlayer(embeds, hidden, cos, sin, keys, values)
            logits = head.lm_head(head.norm(hidden)).float()  # [B, T, draft_vocab]
            target_logits = _shift(feats.logits, 1 + j)  # [B, T, vocab]: the distribution of token t+2+j
            target_top = target_logits.argmax(-1)
            valid = (pos < t - 1 - j).expand(b, t)
            in_draft = head.t2d[target_top] & valid
            target_p = torch.softmax(target_logits[..., head.t2d], dim=-1)
            ce = -(target_p * torch.log_softmax(logits, dim=-1)).sum(-1)
            loss_j = (ce * in_draft).sum() / in_draft.sum().clamp(min=1)
            total = total + self.step_decay ** j * loss_j
            hit = (draft_to_target[logits.argmax(-1)] == target_top) & valid
            metrics[f"acc_{j}"] = hit.sum() / valid.sum().clamp(min=1)
            metrics[f"loss_{j}"] = loss_j.detach()
        return total, metrics

    def save(self, out: Path, dtype: torch.dtype) -> None:
        out.mkdir(parents=True, exist_ok=True)
        save_safetensors(self.module.state_dict(), out / WEIGHTS_NAME, dtype)
        cfg, s = self.target.config, self.shape
        write_json(out / "config.json", {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": s["hidden"], "intermediate_size": s["intermediate"], "num_hidden_layers": 1,
            "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
            "hidden_act": "silu", "rms_norm_eps": s["eps"], "rope_theta": self.theta, "rope_scaling": None,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": s["vocab"],
            "draft_vocab_size": s["draft_vocab"], "tie_word_embeddings": False,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
        })
