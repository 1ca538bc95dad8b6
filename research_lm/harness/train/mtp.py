"""A DeepSeek multi-token-prediction (MTP) layer trained for a frozen DeepSeek-V2/V3 target, written into a copy of
the target's checkpoint in DeepSeek-V3's published layout, which `speculative_config={"method": "mtp"}` reads.

Written tensors, L = the target's num_hidden_layers (config.json gains `num_nextn_predict_layers: 1`):
    model.layers.{L}.enorm.weight, hnorm.weight           [H]
    model.layers.{L}.eh_proj.weight                        [H, 2H]  over [enorm(embedding); hnorm(hidden)]
    model.layers.{L}.{input_layernorm, post_attention_layernorm, self_attn.*, mlp.*}  a decoder layer of the target's
        family (transformers' own class, built at index L: dense or routed experts by the target's rule; experts
        written one tensor per expert and projection, as DeepSeek-V3 ships them)
    model.layers.{L}.shared_head.norm.weight               [H]
    model.layers.{L}.embed_tokens.weight, shared_head.head.weight  [V, H]  copies of the target's (DeepSeek-V3
        ships them too), frozen in training
The target's files are copied beside them; the layer goes to `model-mtp.safetensors`, named by
`model.safetensors.index.json` with the target's tensors (transformers loads the copy as the target, skipping it).

Training (self-distilled, teacher-forced): row t reads the embedding of x[t+1] (zeroed at position 0, as vLLM's
drafter does) and the target's final normed hidden state h_t; the layer's stream, through shared_head.norm and the
target's lm_head, is scored by cross-entropy against the target's distribution of x[t+2].
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from research_lm.harness.train.artifacts import save_safetensors, write_json
from research_lm.harness.train.layers import RMSNorm
from research_lm.harness.train.teacher import FrozenTarget

MTP_WEIGHTS = "model-mtp.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class MtpLayer(nn.Module):
    """The trainable part: enorm, hnorm, eh_proj, the decoder layer (`mtp_block`), shared_head.norm."""

    def __init__(self, target: FrozenTarget):
        super().__init__()
        cfg, hidden = target.config, target.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.mtp_block = type(target.model.model.layers[0])(cfg, cfg.num_hidden_layers)
        self.shared_head = nn.ModuleDict({"norm": RMSNorm(hidden, cfg.rms_norm_eps)})
        for module in (self.eh_proj, self.mtp_block):
            module.apply(target.model._init_weights)  # the family's own initialisation

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotary: nn.Module) -> torch.Tensor:
        """embeds (of x[t+1], zero at t = 0), hidden (the target's at t): [B, T, H] -> shared_head.norm of the
        layer's stream at t, [B, T, H]. `rotary`: the target's rotary embedding module."""
        t = embeds.shape[1]
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        positions = torch.arange(t, device=x.device)[None]
        causal = torch.full((t, t), float("-inf"), device=x.device).triu(1)[None, None]  # additive, any attention impl
        stream = self.mtp_block(x, attention_mask=causal, position_ids=positions,
                                position_embeddings=rotary(x, positions))
        return self.shared_head["norm"](stream)


def published_tensors(layer: MtpLayer, target: FrozenTarget) -> dict[str, torch.Tensor]:
    """The layer's tensors under their checkpoint names (without `model.layers.{L}.`): the decoder layer's at the top,
    stacked experts split per expert and projection, plus copies of the target's embedding and lm_head."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in layer.state_dict().items():
        name = name.removeprefix("mtp_block.")
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            prefix = name.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1), strict=True)):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            prefix = name.removesuffix("down_proj")
            out.update((f"{prefix}{e}.down_proj.weight", down) for e, down in enumerate(tensor))
        else:
            out[name] = tensor
    out["embed_tokens.weight"] = target.embed_weight
    out["shared_head.head.weight"] = target.lm_head_weight
    return out


def _target_weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> weight file of the target's safetensors checkpoint."""
    from safetensors import safe_open

    index = path / SAFETENSORS_INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"train_mtp writes the MTP layer beside the target's safetensors; {path} has none")
    with safe_open(single, framework="pt", device="cpu") as reader:
        return dict.fromkeys(reader.keys(), single.name)


class MtpObjective:
    reports_ppl = False

    def __init__(self, target: FrozenTarget):
        archs = list(getattr(target.config, "architectures", None) or [])
        if not set(archs) & set(_DEEPSEEK):
            raise ValueError(f"train_mtp adds an MTP layer to a DeepSeek-V2/V3 target; {target.path} is {archs}: "
                             "set train.target=<a DeepSeek checkpoint directory with tokenizer files>")
        self.weight_map = _target_weight_map(target.path)  # checked before training: the copy needs it
        prefix = f"model.layers.{target.num_layers}."
        if any(name.startswith(prefix) for name in self.weight_map):
            raise ValueError(f"{target.path} already holds MTP layer tensors ({prefix}*); train on a target without "
                             "them")
        self.target = target
        self.module = MtpLayer(target).to(target.device)

    def loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        feats = self.target.features(input_ids)
        next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)  # x[t+1] at row t
        embeds = F.embedding(next_ids, self.target.embed_weight)
        embeds[:, 0] = 0.0  # position 0, as the drafter masks it
        # the last row has no x[t+1]
        normed = self.module(embeds, feats.hidden, self.target.model.model.rotary_emb)[:, :-1]
        logits = F.linear(normed, self.target.lm_head_weight).float()  # [B, T-1, vocab]: row t guesses x[t+2]
        target_logits = feats.logits[:, 1:]
        loss = -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()
        acc = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
        return loss, {"acc_0": acc}

    def save(self, out: Path, dtype: torch.dtype) -> None:
        """A copy of the target's checkpoint with the layer added at index num_hidden_layers."""
        src = self.target.path
        if out.resolve() == src.resolve():
            raise ValueError(f"train.output_dir must not be the target's directory {src}: the MTP layer goes into "
                             "a copy of it")
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.name not in (SAFETENSORS_INDEX, "recipe.json"):
                shutil.copy2(f, out / f.name)
        prefix = f"model.layers.{self.target.num_layers}."
        tensors = {prefix + name: t for name, t in published_tensors(self.module, self.target).items()}
        save_safetensors(tensors, out / MTP_WEIGHTS, dtype)
        weight_map = self.weight_map | dict.fromkeys(tensors, MTP_WEIGHTS)
        write_json(out / SAFETENSORS_INDEX, {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))})
        config = json.loads((src / "config.json").read_text())
        write_json(out / "config.json", {**config, "num_nextn_predict_layers": 1})
