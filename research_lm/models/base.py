"""What every model shares: the build context, the interface the runner relies on, weight loading.

A model family is one file in this package: a class `Model(hf_config, build)` decorated with
`@register_model("XForCausalLM", ...)` and listed in `registry.MODELS`. Its parameters are
named like the Hugging Face checkpoint's tensors (after stacking, see `load_params`), and each one
carries a `weight_loader(param, tensor, shard_id=None)`: the one place that slices a checkpoint tensor to what
this tensor-parallel rank holds (`ModelBuildContext.tp`, research_lm/worker/parallel.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from research_lm.worker.parallel import TensorParallel

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory we cannot load: the message names the file or tensor and what is wrong."""


@dataclass
class ModelBuildContext:
    device: torch.device
    dtype: torch.dtype  # parameters and activations; rotary tables and softmax stay fp32
    attention_backend: str  # an attention_zoo registry name
    extra: dict[str, Any] = field(default_factory=dict)  # model-family knobs (MoE/EPLB, Mamba, ...)
    tp: TensorParallel | None = None  # the tensor-parallel group the layers shard over; None: whole weights


class CausalLM(Protocol):
    """The surface the runner and the proposers use; every registered model provides it."""

    embed_tokens: nn.Module
    lm_head: nn.Module

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn_metadata: dict[str, Any],  # backend name -> that backend's metadata for this step
    ) -> torch.Tensor: ...  # [num_tokens, hidden], final norm applied (taps: research_lm/worker/taps.py)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [n, hidden] -> [n, vocab] fp32

    def get_input_embeddings(self) -> nn.Module: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...


@contextlib.contextmanager
def build_scope(build: ModelBuildContext) -> Iterator[None]:
    """Create tensors directly on `build.device` in `build.dtype` (no CPU fp32 copy of a large model).

    NOTE: torch's default dtype is process-wide; it is restored on exit, so do not build two models
    concurrently from different threads.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(build.dtype)
    try:
        with torch.device(build.device):
            yield
    finally:
        torch.set_default_dtype(previous)


def default_weight_loader(param: torch.Tensor, tensor: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole checkpoint tensor into `param`, converting dtype and device."""
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"shape {tuple(tensor.shape)} does not fit parameter of shape {tuple(param.shape)}")
    param.data.copy_(tensor)


def set_weight_loader(param: nn.Parameter, loader: Callable, shard_ids: tuple | None = None) -> None:
    """Attach the loader; `shard_ids` lists the pieces a stacked parameter needs before it counts loaded."""
    param.weight_loader = loader
    if shard_ids is not None:
        param.shard_ids = shard_ids


# (our parameter's name part, the checkpoint's name part, shard id passed to the weight loader)
StackedParams = tuple[tuple[str, str, Any], ...]


def _map_stacked(name: str, stacked: StackedParams) -> tuple[str, Any]:
    for param_part, ckpt_part, shard_id in stacked:
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}.", 1), shard_id
    return name, None


def load_params(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedParams = (),
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Route checkpoint tensors to parameters; return the names of parameters now fully loaded.

    A stacked parameter (qkv_proj, gate_up_proj) counts as loaded once every shard in its
    `shard_ids` arrived, or once a checkpoint tensor of its own name (already stacked) did.
    Checkpoint tensors no parameter takes are logged and ignored.
    """
    params = dict(model.named_parameters())
    seen_shards: dict[str, set] = {}
    loaded: set[str] = set()
    unused: list[str] = []
    for ckpt_name, tensor in weights:
        if skip(ckpt_name):
            continue
        name, shard_id = _map_stacked(ckpt_name, stacked)
        param = params.get(name)
        if param is None:
            unused.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as e:
            raise CheckpointError(f"checkpoint tensor {ckpt_name!r}: {e}") from e
        seen_shards.setdefault(name, set()).add(shard_id)
        if shard_id is None or seen_shards[name] >= set(getattr(param, "shard_ids", ())):
            loaded.add(name)  # whole tensor, or the last missing shard
    if unused:
        logger.warning("ignored %d checkpoint tensors no parameter takes, e.g. %s", len(unused), unused[:5])
    return loaded


def is_rotary_buffer(name: str) -> bool:
    """Old checkpoints save rotary tables; we recompute them."""
    return "rotary_emb." in name
