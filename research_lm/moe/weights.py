"""Checkpoint tensors -> MoE parameters, for both expert layouts a safetensors file may hold.

transformers 5 stacks experts in memory (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]) but `save_pretrained` writes one tensor per expert and projection (checked with 5.23):

    model.layers.N.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight              Qwen2/3-MoE, DeepSeek
    model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight  (gate, up, down)  Mixtral
    model.layers.N.block_sparse_moe.gate.weight                                    Mixtral's router

Per-expert tensors are routed here to `FusedMoE`'s stacked parameters with shard id (expert, proj);
fused tensors already carry the parameter's name and go through `load_params` like any other tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from research_lm.models.base import CheckpointError, StackedParams, load_params

_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")

# checkpoint projection name -> FusedMoE shard kind
HF_EXPERT_PROJS: dict[str, str] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MIXTRAL_EXPERT_PROJS: dict[str, str] = {"w1": "gate", "w3": "up", "w2": "down"}


def load_moe_params(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedParams = (),
    skip: Callable[[str], bool] = lambda name: False,
    expert_projs: dict[str, str] = HF_EXPERT_PROJS,
    renames: tuple[tuple[str, str], ...] = (),  # (checkpoint name part, ours), e.g. (".block_sparse_moe.", ".mlp.")
) -> set[str]:
    """`load_params` plus per-expert tensors; returns the names of parameters now fully loaded."""
    params = dict(model.named_parameters())
    seen: dict[str, set] = {}
    loaded: set[str] = set()

    def others() -> Iterator[tuple[str, torch.Tensor]]:
        for ckpt_name, tensor in weights:
            name = ckpt_name
            for old, new in renames:
                name = name.replace(old, new)
            match = _EXPERT_TENSOR.match(name)
            kind = expert_projs.get(match["proj"]) if match else None
            param_name = f"{match['prefix']}.{'down_proj' if kind == 'down' else 'gate_up_proj'}" if kind else ""
            param = params.get(param_name)
            if param is None or skip(ckpt_name):
                yield name, tensor
                continue
            shard = (int(match["expert"]), kind)
            try:
                param.weight_loader(param, tensor, shard)
            except ValueError as e:
                raise CheckpointError(f"checkpoint tensor {ckpt_name!r}: {e}") from e
            seen.setdefault(param_name, set()).add(shard)
            if seen[param_name] >= set(param.shard_ids):
                loaded.add(param_name)

    loaded |= load_params(model, others(), stacked, skip)
    return loaded
