"""Mamba2 (arXiv 2405.21060): the mixer layer every Mamba-bearing family reuses, and `Mamba2ForCausalLM`.

The mixer is transformers' `Mamba2Mixer`: in_proj -> (z, xBC, dt); the SSM over its per-request state
slots (`attention_zoo.mamba.MambaMixer`, backend from `build.extra["mamba_backend"]`); gated RMSNorm
of y with z (per group); out_proj. Parameters carry the checkpoint's names (`in_proj`, `conv1d`,
`dt_bias`, `A_log`, `D`, `norm`, `out_proj`).

Tensor parallelism (`build.tp`, as vLLM's MambaMixer2): rank r of N holds num_heads / N SSM heads and the B/C
groups they read (`MixerShard`: n_groups / N of them, or, with fewer groups than ranks, its heads' one group,
replicated). in_proj is column-parallel and its loader cuts z, x, B, C and dt out of the fused checkpoint rows one
by one; conv1d's channels (x, B, C), A_log / D / dt_bias and the norm's weight are cut the same way; out_proj is
row-parallel. The gated norm stays exact: a group split across ranks all-reduces its sum of squares. Each rank's
state slots hold only its heads and groups (the `MambaSpec` is built from the shard).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from attention_zoo.mamba import MambaMixer, MambaSpec, MambaWeights
from research_lm.models.base import (
    ModelBuildContext,
    default_weight_loader,
    load_params,
    set_weight_loader,
)
from research_lm.models.causal_lm import CausalLMShell
from research_lm.models.layers import (
    Block,
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_of_rank,
    stacked_rows_loader,
)
from research_lm.models.registry import register_model
from research_lm.worker.parallel import TensorParallel, split_size

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_MAMBA_BACKEND = "auto"


@dataclass(frozen=True)
class Mamba2MixerConfig:
    """The mixer's shape, whatever config family it comes from (Mamba2, Bamba, ...)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    norm_eps: float
    time_step_limit: tuple[float, float]
    activation: str = "silu"
    heads_field: str = "num_heads"  # the config's names, for the tensor-parallel refusals
    groups_field: str = "n_groups"

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @classmethod
    def from_mamba2(cls, hf: PretrainedConfig) -> Mamba2MixerConfig:
        return cls(
            hidden_size=hf.hidden_size, num_heads=hf.num_heads, head_dim=hf.head_dim, n_groups=hf.n_groups,
            state_size=hf.state_size, conv_kernel=hf.conv_kernel, chunk_size=hf.chunk_size,
            conv_bias=hf.use_conv_bias, proj_bias=hf.use_bias, norm_eps=hf.layer_norm_epsilon,
            time_step_limit=time_step_limit(hf.time_step_limit), activation=hf.hidden_act,
        )


def time_step_limit(limit: Any) -> tuple[float, float]:
    return (0.0, math.inf) if limit is None else (float(limit[0]), float(limit[1]))


@dataclass(frozen=True)
class MixerShard:
    """A rank's share of a mixer: SSM heads [first_head, first_head + num_heads) and the B/C groups
    [first_group, first_group + n_groups) they read (head h reads group h // (heads / groups)). Without tensor
    parallelism, everything."""

    cfg: Mamba2MixerConfig
    num_heads: int
    first_head: int
    n_groups: int
    first_group: int

    @classmethod
    def of(cls, cfg: Mamba2MixerConfig, tp: TensorParallel | None) -> MixerShard:
        """n_groups / N groups per rank, or (fewer groups than ranks) the one group its heads read."""
        num_heads = split_size(cfg.num_heads, tp, cfg.heads_field)
        n_groups, first_group = kv_heads_of_rank(cfg.n_groups, tp, cfg.groups_field)
        return cls(cfg, num_heads, (tp.rank if tp else 0) * num_heads, n_groups, first_group)

    def heads(self, width: int = 1) -> Block:
        """This rank's rows of a per-head tensor of `width` rows per head (x and z: head_dim; dt, A, D: 1)."""
        return Block(self.cfg.num_heads * width, self.first_head * width, self.num_heads * width)

    def groups(self) -> Block:  # this rank's rows of B (or C): state_size per group
        n = self.cfg.state_size
        return Block(self.cfg.n_groups * n, self.first_group * n, self.n_groups * n)

    @property
    def xbc_blocks(self) -> list[Block]:  # conv1d's channels, and xBC's share of in_proj
        return [self.heads(self.cfg.head_dim), self.groups(), self.groups()]

    @property
    def intermediate_size(self) -> int:  # width of this rank's x, z and y
        return self.num_heads * self.cfg.head_dim

    @property
    def conv_dim(self) -> int:  # width of this rank's xBC
        return self.intermediate_size + 2 * self.n_groups * self.cfg.state_size


class GatedRMSNorm(nn.Module):
    """w * rmsnorm_per_group(y * silu(z)), in fp32 (transformers' MambaRMSNormGated, norm_before_gate=False).

    y and z hold whole groups, or (a rank's share of a group split across ranks: hidden_size < group_size) part of
    group `group` of `n_groups`: then the ranks sharing it all-reduce its sum of squares, so the statistics are the
    whole group's, as without tensor parallelism."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, tp: TensorParallel | None = None,
                 group: int = 0, n_groups: int = 1):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.tp, self.group, self.n_groups = tp, group, n_groups
        self.split_group = hidden_size < group_size
        self.weight = nn.Parameter(torch.ones(hidden_size))
        set_weight_loader(self.weight, default_weight_loader)

    def forward(
        self, y: torch.Tensor, z: torch.Tensor  # [num_tokens, hidden_size] each
    ) -> torch.Tensor:  # [num_tokens, hidden_size], y's dtype
        h = y.float() * F.silu(z.float())
        if self.split_group:
            h = h * torch.rsqrt(self._group_mean_square(h) + self.eps)
        else:
            h = h.unflatten(-1, (-1, self.group_size))
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * h.to(y.dtype)

    def _group_mean_square(self, h: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size] -> [num_tokens, 1]
        """One all-reduce of [num_tokens, n_groups] sums of squares, each rank's in its group's column: the
        columns add up the ranks that share a group."""
        sums = h.new_zeros(h.shape[0], self.n_groups)
        sums[:, self.group] = h.pow(2).sum(-1)
        return self.tp.all_reduce(sums)[:, self.group, None] / self.group_size


class CausalConv1d(nn.Module):
    """Holds the depthwise conv's checkpoint tensors (`conv1d.weight` [conv_dim, 1, kernel], `conv1d.bias`);
    the backend applies them over the request's conv state. `blocks`: the channels (x, B, C) this rank holds."""

    def __init__(self, blocks: list[Block], kernel: int, bias: bool):
        super().__init__()
        channels = sum(b.size for b in blocks)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        set_weight_loader(self.weight, stacked_rows_loader(blocks))
        if bias:
            self.bias = nn.Parameter(torch.empty(channels))
            set_weight_loader(self.bias, stacked_rows_loader(blocks))
        else:
            self.register_parameter("bias", None)


class Mamba2Mixer(nn.Module):
    """Under tensor parallelism (`build.tp`) every tensor holds this rank's `shard` (see the module docstring)."""

    def __init__(self, cfg: Mamba2MixerConfig, build: ModelBuildContext):
        super().__init__()
        self.cfg = cfg
        self.shard = shard = MixerShard.of(cfg, build.tp)
        x_rows, H = shard.heads(cfg.head_dim), shard.num_heads
        # in_proj's checkpoint rows are [z | x | B | C | dt]: each piece is split on its own
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size + cfg.conv_dim + cfg.num_heads,
                                            cfg.proj_bias, blocks=[x_rows, *shard.xbc_blocks, shard.heads()])
        self.conv1d = CausalConv1d(shard.xbc_blocks, cfg.conv_kernel, cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        for p in (self.dt_bias, self.A_log, self.D):
            set_weight_loader(p, stacked_rows_loader([shard.heads()]))
        self.norm = GatedRMSNorm(shard.intermediate_size, cfg.intermediate_size // cfg.n_groups, cfg.norm_eps,
                                 build.tp, shard.first_group, cfg.n_groups)
        set_weight_loader(self.norm.weight, stacked_rows_loader([x_rows]))
        self.out_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.proj_bias, build.tp)
        spec = MambaSpec(  # this rank's heads and groups: the state slots hold only theirs
            num_heads=H, num_kv_heads=shard.n_groups, head_size=cfg.head_dim, state_size=cfg.state_size,
            conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size, time_step_limit=cfg.time_step_limit,
            activation=cfg.activation,
        )
        backend = build.extra.get("mamba_backend") or DEFAULT_MAMBA_BACKEND
        self.ssm = MambaMixer(spec, backend, build.device, build.dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        attn_metadata: dict[str, Any],
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        shard = self.shard  # this rank's sizes
        z, xbc, dt = self.in_proj(hidden).split([shard.intermediate_size, shard.conv_dim, shard.num_heads], dim=-1)
        weights = MambaWeights(self.conv1d.weight.flatten(1), self.conv1d.bias, self.A_log, self.D, self.dt_bias)
        y = self.ssm(xbc, dt, weights, attn_metadata)  # [num_tokens, intermediate_size (this rank's)]
        return self.out_proj(self.norm(y, z).to(hidden.dtype))

    @torch.no_grad()
    def init_random_weights(self, gen: torch.Generator, std: float = 0.02) -> None:
        """transformers' init (A = 1..H, D = 1, dt in [1e-3, 0.1]) for speed runs without a checkpoint; a
        tensor-parallel rank takes its heads' values."""
        heads = slice(self.shard.first_head, self.shard.first_head + self.shard.num_heads)
        self.A_log.copy_(torch.log(torch.arange(1, self.cfg.num_heads + 1, dtype=torch.float32)[heads]))
        self.D.fill_(1.0)
        u = torch.rand(self.cfg.num_heads, generator=gen, device=gen.device).cpu()[heads]
        dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.norm.weight.fill_(1.0)
        for p in (self.in_proj.weight, self.conv1d.weight, self.out_proj.weight):
            p.normal_(0.0, std, generator=gen)
        for p in (self.in_proj.bias, self.conv1d.bias, self.out_proj.bias):
            if p is not None:
                p.zero_()


class Mamba2Block(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, build: ModelBuildContext):
        super().__init__()
        self.residual_in_fp32 = bool(getattr(hf_config, "residual_in_fp32", True))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(Mamba2MixerConfig.from_mamba2(hf_config), build)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: the residual stream (fp32 if residual_in_fp32)
        attn_metadata: dict[str, Any],
    ) -> torch.Tensor:  # the new residual stream
        residual = hidden.float() if self.residual_in_fp32 else hidden
        return residual + self.mixer(self.norm(hidden.to(self.norm.weight.dtype)), attn_metadata)


class Mamba2Model(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, build: ModelBuildContext):
        super().__init__()
        self.embeddings = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, build.tp)
        self.layers = nn.ModuleList(Mamba2Block(hf_config, build) for _ in range(hf_config.num_hidden_layers))
        self.norm_f = RMSNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        attn_metadata: dict[str, Any],
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size], final norm applied, in the model dtype
        hidden = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        dtype = hidden.dtype
        for layer in self.layers:
            hidden = layer(hidden, attn_metadata)
        return self.norm_f(hidden).to(dtype)


@register_model("Mamba2ForCausalLM")
class Mamba2ForCausalLM(CausalLMShell):
    """Attention-free: positions are ignored, every layer is a Mamba2 mixer over per-request state."""

    backbone_attr = "backbone"
    embeddings_attr = "embeddings"
    tensor_parallel = True  # SSM heads, B/C groups and vocabulary split over `build.tp` (see the module docstring)

    def make_backbone(self, hf_config: PretrainedConfig, build: ModelBuildContext) -> nn.Module:
        return Mamba2Model(hf_config, build)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64, unused: the state carries the order
        attn_metadata: dict[str, Any],
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.backbone(input_ids, attn_metadata, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:  # original state-spaces checkpoints say `embedding`
                yield name.replace("backbone.embedding.", "backbone.embeddings."), tensor

        def skip(name: str) -> bool:
            return self.tie_word_embeddings and name == "lm_head.weight"

        return load_params(self, renamed(), skip=skip)

    @torch.no_grad()
    def init_random_weights(self, gen: torch.Generator, std: float = 0.02) -> None:
        for name, param in self.named_parameters():
            if ".mixer." in name:
                continue
            if param.dim() >= 2:
                param.normal_(0.0, std, generator=gen)
            else:  # the RMSNorm scales
                param.fill_(1.0)
        for layer in self.backbone.layers:
            layer.mixer.init_random_weights(gen, std)
