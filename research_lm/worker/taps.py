"""Hidden-state taps: the residual streams entering chosen decoder layers, recorded from outside the model.

A proposer asks for them (`Proposer.aux_hidden_state_layers`, EAGLE-3's fused target features); the runner installs
one forward pre-hook per tapped layer, and the model knows nothing of speculation. Tap i is the stream entering
decoder layer i (hidden + residual, as transformers' `hidden_states[i]`); i == num_layers taps the stream entering
the final norm. Each hook writes into a persistent buffer, so a CUDA graph records the write and every graph fills
the same buffers: after a forward, eager or replayed, `values(num_tokens)` are its rows.
"""

from __future__ import annotations

import torch
from torch import nn

from research_lm.models.llama import PreNormDecoderLayer


class HiddenStateTaps:
    def __init__(self, model: nn.Module, layers: tuple[int, ...], max_num_tokens: int):
        backbone = getattr(model, getattr(model, "backbone_attr", "model"), None)
        decoder = getattr(backbone, "layers", None)
        if decoder is None or not all(isinstance(layer, PreNormDecoderLayer) for layer in decoder):
            raise ValueError(f"{type(model).__name__} does not expose hidden-state taps (EAGLE-3): its layers are "
                             "not pre-norm decoder layers with a residual stream")
        n = len(decoder)
        if len(set(layers)) != len(layers) or not all(0 <= i <= n for i in layers):
            raise ValueError(f"hidden-state taps {list(layers)} must be distinct and in [0, {n}]")
        hidden = backbone.norm.weight
        self.layers = layers
        self.buffers = [torch.empty(max_num_tokens, hidden.shape[0], dtype=hidden.dtype, device=hidden.device)
                        for _ in layers]  # [max_num_tokens, hidden] each
        self._handles = [(decoder[i] if i < n else backbone.norm).register_forward_pre_hook(self._recorder(buffer))
                         for i, buffer in zip(layers, self.buffers, strict=True)]

    @staticmethod
    def _recorder(buffer: torch.Tensor):
        def record(module: nn.Module, args: tuple) -> None:
            hidden, residual = args[0], args[1]  # [T, hidden] each; residual None before the first layer
            out = buffer[: hidden.shape[0]]
            if residual is None:
                out.copy_(hidden)
            else:
                torch.add(hidden, residual, out=out)

        return record

    def values(self, num_tokens: int) -> list[torch.Tensor]:  # per tap, [num_tokens, hidden]: the last forward's
        return [buffer[:num_tokens] for buffer in self.buffers]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
