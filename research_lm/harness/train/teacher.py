"""The frozen target the heads are distilled from: a `transformers` causal LM loaded from its directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from research_lm.models.loader import resolve_model_path


@dataclass
class TargetFeatures:
    hidden: torch.Tensor  # [B, T, hidden] the last layer's output after the final norm (what lm_head reads)
    logits: torch.Tensor  # [B, T, vocab] fp32
    aux: torch.Tensor | None  # [B, T, len(aux_layers) * hidden] residual streams entering the aux layers


class FrozenTarget:
    """`FrozenTarget("outputs/train/target", device)`; `features(input_ids, aux_layers=(2, 4, 5))`."""

    def __init__(self, path: str | Path, device: torch.device, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        self.path = resolve_model_path(path)
        if not (self.path / "tokenizer.json").is_file() and not (self.path / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"target {self.path} has no tokenizer files; heads train on the corpus "
                                    "tokenized by the target's own tokenizer")
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code)
        self.model = model.to(device).eval().requires_grad_(False)
        self.config = model.config
        self.device = device

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # [vocab, hidden]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [vocab, hidden]

    def rope_theta(self) -> float:
        params = getattr(self.config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        scaling = getattr(self.config, "rope_scaling", None)
        if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"):
            raise ValueError(f"head training supports targets with default rotary embeddings; {self.path} uses "
                             f"{rope_type!r}")
        return float(params.get("rope_theta", getattr(self.config, "rope_theta", 10000.0)))

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, aux_layers: tuple[int, ...] = ()) -> TargetFeatures:
        """input_ids: [B, T] int64."""
        out = self.model.base_model(input_ids=input_ids, output_hidden_states=bool(aux_layers), use_cache=False)
        hidden = out.last_hidden_state
        logits = self.model.get_output_embeddings()(hidden).float()
        # hidden_states[i] is the residual stream entering decoder layer i (index 0: the embeddings).
        aux = torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1) if aux_layers else None
        return TargetFeatures(hidden=hidden, logits=logits, aux=aux)

    def recipe(self) -> dict[str, Any] | None:
        """The target's own recipe.json (corpus hash, steps, ...) when it was trained here."""
        path = self.path / "recipe.json"
        return json.loads(path.read_text()) if path.is_file() else None
