"""Reusable building blocks: RMSNorm, rotary embedding, linear layers with sliceable loaders, gated MLP.

RMSNorm, RotaryEmbedding and GatedMLP run fused Triton kernels on CUDA (`research_lm.ops`; each module's
`fused_ops` switch, `set_fused_ops(model, False)` for all); on CPU and under torch.compile, the torch code.
With `batch_invariant` on (`set_batch_invariant(model, True)`), the linear layers, the LM head and RMSNorm take
kernels whose reduction order per row does not depend on the batch (`research_lm.ops.batch_invariant`) for CUDA
tensors; on CPU the switch changes nothing.

Parameters are created with torch's current default device and dtype: build them inside
`base.build_scope`. Every parameter gets a `weight_loader`. The `*Parallel*` layers take an optional
`TensorParallel` (research_lm/worker/parallel.py): with it they hold this rank's share of the weights, sliced from
the full checkpoint tensor by their loader, and run the collective their split needs; without it, everything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from research_lm.models.base import default_weight_loader, set_weight_loader
from research_lm.ops import (
    SKINNY_MAX_ROWS,
    apply_rotary,
    on_kernel_device,
    rms_norm_ref,
    rope_cos_sin,
    silu_and_mul_ref,
    skinny_linear_ref,
    use_batch_invariant,
    use_fused,
)
from research_lm.worker.parallel import TensorParallel, split_size


class RMSNorm(nn.Module):
    """y = w * x / rms(x), the statistics in fp32 (as transformers does). Optionally fused with the residual add.

    On CUDA one Triton kernel (`research_lm.ops`), unless `fused_ops` is off; else `rms_norm_ref`. With
    `batch_invariant` on, CUDA takes the kernel whatever `fused_ops` says: it reduces each row in one program
    sized from hidden_size alone, where torch's mean picks its reduction layout from the whole tensor's shape."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        set_weight_loader(self.weight, default_weight_loader)
        self.fused_ops = True
        self.batch_invariant = False

    def forward(
        self,
        x: torch.Tensor,  # [..., hidden_size]
        residual: torch.Tensor | None = None,  # [..., hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, with a residual, (norm(x + residual), x + residual): the new residual stream."""
        if use_fused(self, x) or use_batch_invariant(self, x):
            from research_lm.ops.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_ref(x, self.weight, self.eps, residual)


# ---------------------------------------------------------------------------------------------------
# Rotary position embedding (GPT-NeoX layout: the two halves of the rotated dims form the pairs)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's RoPE dict with at least `rope_type` and `rope_theta`, from transformers 5's
    `rope_parameters` or the older `rope_theta` + `rope_scaling` pair."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params = dict(params)
    if "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported yet")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    return params


def _base_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:  # [rotary_dim // 2] fp32
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any], max_positions: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p.get("original_max_position_embeddings") or max_positions
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    inv_freq: torch.Tensor, p: dict[str, Any], rotary_dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate low frequencies, extrapolate high ones, scale attention."""
    base = p["rope_theta"]
    orig_len = p.get("original_max_position_embeddings") or max_positions
    factor = p.get("factor") or max_positions / orig_len
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(orig_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 keeps the original frequency, 0 divides it by factor
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attention_factor)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(
    params: dict[str, Any], rotary_dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:  # ([rotary_dim // 2] fp32, scale applied to cos and sin)
    rope_type = params.get("rope_type", "default")
    inv_freq = _base_inv_freq(params["rope_theta"], rotary_dim)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params, max_positions), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, params, rotary_dim, max_positions)
    raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")


class Rope(NamedTuple):
    """One forward's rotary inputs, made once by `RotaryEmbedding` and handed to every attention layer."""

    positions: torch.Tensor  # [num_tokens] int64
    inv_freq: torch.Tensor  # [rotary_dim // 2] fp32
    attention_scaling: float
    # [num_tokens, rotary_dim // 2] fp32, scaled: the torch path's table; None where the kernel computes them
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """positions -> `Rope`; cos/sin computed on the fly in fp32 (no per-position table to keep).

    On CUDA the fused kernel computes cos/sin itself while rotating (unless `fused_ops` is off)."""

    def __init__(self, head_size: int, params: dict[str, Any], max_positions: int):
        super().__init__()
        self.rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
        inv_freq, self.attention_scaling = rope_inv_freq(params, self.rotary_dim, max_positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # fp32, on the build device
        self.fused_ops = True

    def forward(self, positions: torch.Tensor) -> Rope:  # positions: [num_tokens] int64
        inv_freq = self.inv_freq.float()  # a no-op unless someone cast the model's buffers
        if use_fused(self, positions):
            return Rope(positions, inv_freq, self.attention_scaling)
        cos, sin = rope_cos_sin(positions, inv_freq, self.attention_scaling)
        return Rope(positions, inv_freq, self.attention_scaling, cos, sin)


def apply_rope(
    rope: Rope,
    q: torch.Tensor,  # [num_tokens, num_heads, head_size]
    k: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_size]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # q and k rotated (new tensors)
    """Rotate q and k at rope.positions: one fused kernel for both, or `apply_rotary` with rope's cos/sin."""
    if rope.cos is None:
        from research_lm.ops.rotary import rotary_embedding

        return rotary_embedding(q, k, rope.positions, rope.inv_freq, rope.attention_scaling)
    return apply_rotary(q, rope.cos, rope.sin), None if k is None else apply_rotary(k, rope.cos, rope.sin)


# ---------------------------------------------------------------------------------------------------
# Linear layers (Megatron's split: column-parallel in, row-parallel out, one all-reduce per pair)


def batch_invariant_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N], x's dtype
    """F.linear through `research_lm.ops.batch_invariant.linear` (every leading dim flattened into its rows)."""
    from research_lm.ops.batch_invariant import linear

    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Module):
    """y = x W^T + b, replicated on every rank. The parallel subclasses hold this rank's share of W (their
    `weight_loader` slices the checkpoint tensor) and add the collective their split needs.

    With `batch_invariant` on, CUDA inputs take `batch_invariant_linear` instead of cuBLAS."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):  # sizes: this rank's
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        set_weight_loader(self.weight, self.weight_loader, self._shard_ids())
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            set_weight_loader(self.bias, self.weight_loader, self._shard_ids())
        else:
            self.register_parameter("bias", None)
        self.batch_invariant = False
        self.skinny_rows = 0  # EngineConfig.skinny_rows: above 1, `skinny` holds all of a step's rows in one program

    def _shard_ids(self) -> tuple | None:
        return None

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        default_weight_loader(param, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input_size] -> [..., output_size]
        return self._matmul(x, self.bias)

    def _matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None  # x: [..., input_size], bias: [output_size]
    ) -> torch.Tensor:  # [..., output_size]
        if use_batch_invariant(self, x):
            return batch_invariant_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def skinny(
        self,
        x: torch.Tensor,  # [M, input_size], M <= ops.SKINNY_MAX_ROWS
        norm: RMSNorm | None = None,  # rms-normalize x with it first
        residual: torch.Tensor | None = None,  # [M, output_size]: added to the output
        silu_mul: bool = False,  # a gate | up projection: return silu(gate) * up
    ) -> torch.Tensor:  # [M, output_size (/ 2 with silu_mul)]
        """This projection of a few rows with its neighbours in one kernel (`ops.skinny_linear`) on CUDA; the same
        numbers from torch ops elsewhere. Whole weights only: the caller checks there is no tensor parallelism.
        skinny_rows 1 takes the one-row kernel, more the all-rows one, at every M: each sums in its own order."""
        kwargs = {"norm_weight": None if norm is None else norm.weight, "eps": 0.0 if norm is None else norm.eps,
                  "silu_mul": silu_mul, "residual": residual}
        if on_kernel_device(x):
            from research_lm.ops.skinny_linear import skinny_linear

            rows = 1 if self.skinny_rows <= 1 else SKINNY_MAX_ROWS
            return skinny_linear(x, self.weight, self.bias, rows_per_program=rows, **kwargs)
        return skinny_linear_ref(x, self.weight, self.bias, **kwargs)


class Block(NamedTuple):
    """One checkpoint projection stacked in a column-parallel weight: its rows in the checkpoint, and the
    contiguous slice [start, start + size) of them this rank holds."""

    full: int
    start: int
    size: int


def stacked_rows(tensor: torch.Tensor, blocks: list[Block]) -> torch.Tensor:  # [sum(full), ...] -> [sum(size), ...]
    """This rank's rows of a checkpoint tensor that stacks the blocks' projections on dim 0, in block order: each
    block's slice, cut from its own projection and concatenated."""
    full = [b.full for b in blocks]
    if tensor.shape[0] != sum(full):
        raise ValueError(f"shape {tuple(tensor.shape)} does not fit a stacked output of {sum(full)} rows")
    parts = [t.narrow(0, b.start, b.size) for t, b in zip(tensor.split(full), blocks, strict=True)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def stacked_rows_loader(blocks: list[Block]) -> Callable[..., None]:
    """A `weight_loader` that keeps `stacked_rows(tensor, blocks)` of the checkpoint tensor (for parameters outside
    the linear layers that split like them: a conv's channels, per-head vectors)."""

    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        default_weight_loader(param, stacked_rows(tensor, blocks))

    return load


def _column_blocks(sizes: list[int], tp: TensorParallel | None, what: str) -> list[Block]:
    if tp is None:
        return [Block(n, 0, n) for n in sizes]
    return [Block(n, tp.rank * tp.split(n, what), tp.split(n, what)) for n in sizes]


class ColumnParallelLinear(Linear):
    """Splits the output dim (rows of W, and the bias) over the ranks: each rank computes its columns of y.

    The weight stacks one or more checkpoint projections (`blocks`); each rank holds its slice of each."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TensorParallel | None = None,
                 *, blocks: list[Block] | None = None):
        self.blocks = blocks or _column_blocks([output_size], tp, "output size")
        super().__init__(input_size, sum(b.size for b in self.blocks), bias)

    def _slice(self, tensor: torch.Tensor, block: Block) -> torch.Tensor:  # this rank's rows of one projection
        if tensor.shape[0] != block.full:
            raise ValueError(f"shape {tuple(tensor.shape)} does not fit parameter of shape "
                             f"{(block.full, *tensor.shape[1:])}")
        return tensor.narrow(0, block.start, block.size)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        """shard_id None: the whole stacked tensor (every block, in order)."""
        default_weight_loader(param, stacked_rows(tensor, self.blocks))


class RowParallelLinear(Linear):
    """Splits the input dim (columns of W) over the ranks: each rank's x holds its share of the features
    (a column-parallel layer's output), the partial products are all-reduced, then the bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TensorParallel | None = None):
        self.tp = tp
        self.full_input_size = input_size
        super().__init__(split_size(input_size, tp, "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        if self.tp is not None and param is self.weight:
            if tensor.dim() != 2 or tensor.shape[1] != self.full_input_size:
                raise ValueError(f"shape {tuple(tensor.shape)} does not fit a weight of {self.full_input_size} "
                                 "input features")
            tensor = tensor.narrow(1, self.tp.rank * self.input_size, self.input_size)
        default_weight_loader(param, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., input_size] (this rank's) -> [..., output_size]
        if self.tp is None:
            return self._matmul(x, self.bias)
        y = self.tp.all_reduce(self._matmul(x, None))
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stacked on the output dim (e.g. gate_up_proj), each
    split over the ranks on its own: rank r holds [gate_r; up_r].

    The checkpoint holds them separately; shard id i loads the i-th block of rows. With tp None the stack is
    replicated (DeepSeek's fused q_a / kv_a projection, which every head reads).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, shard_ids: tuple = (),
                 tp: TensorParallel | None = None, *, blocks: list[Block] | None = None):
        self.shard_names = tuple(shard_ids) or tuple(range(len(output_sizes)))
        blocks = blocks or _column_blocks(list(output_sizes), tp, "output size")
        super().__init__(input_size, sum(output_sizes), bias, blocks=blocks)

    def _shard_ids(self) -> tuple:
        return self.shard_names

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the stacked tensor
            super().weight_loader(param, tensor)
            return
        index = self.shard_names.index(shard_id)
        offset = sum(b.size for b in self.blocks[:index])
        block = self.blocks[index]
        default_weight_loader(param.data.narrow(0, offset, block.size), self._slice(tensor, block))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections stacked: output = [num_heads + 2 * num_kv_heads] * head_size (this rank's heads).

    Under tensor parallelism each rank takes num_heads / N query heads and num_kv_heads / N KV heads; with
    fewer KV heads than ranks each rank holds the one KV head its query heads read (replicated, as in vLLM)."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: TensorParallel | None = None):
        self.head_size = head_size
        self.num_heads = split_size(num_heads, tp, "num_attention_heads")
        self.num_kv_heads, kv_start = kv_heads_of_rank(num_kv_heads, tp)
        q_full, kv_full = num_heads * head_size, num_kv_heads * head_size
        q = Block(q_full, (tp.rank if tp else 0) * self.num_heads * head_size, self.num_heads * head_size)
        kv = Block(kv_full, kv_start * head_size, self.num_kv_heads * head_size)
        super().__init__(hidden_size, [q_full, kv_full, kv_full], bias, shard_ids=("q", "k", "v"),
                         blocks=[q, kv, kv])


def kv_heads_of_rank(num_kv_heads: int, tp: TensorParallel | None,
                     what: str = "num_key_value_heads") -> tuple[int, int]:
    """(how many KV heads this rank holds, the first one's index): num_kv_heads / N of them, or, with fewer KV
    heads than ranks, the one its query heads read (rank r of N: KV head r * num_kv_heads // N). Mamba2's B/C
    groups split the same way (`what` names the config field in the error)."""
    if tp is None:
        return num_kv_heads, 0
    if num_kv_heads % tp.size and tp.size % num_kv_heads:
        raise ValueError(f"{what} ({num_kv_heads}) neither divides nor is divisible by "
                         f"tensor_parallel_size ({tp.size})")
    if num_kv_heads >= tp.size:
        local = num_kv_heads // tp.size
        return local, tp.rank * local
    return 1, tp.rank * num_kv_heads // tp.size


# ---------------------------------------------------------------------------------------------------
# Embedding, LM head, MLP


class VocabParallelEmbedding(nn.Module):
    """Token embedding table [vocab, hidden]; under tensor parallelism rank r holds rows [r V/N, (r+1) V/N):
    it looks up the ids in its range, zeros the others, and the all-reduce sums the one non-zero row per id."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        local = split_size(num_embeddings, tp, "vocab_size")
        self.vocab_start = tp.rank * local if tp is not None else 0
        self.weight = nn.Parameter(torch.empty(local, embedding_dim))
        set_weight_loader(self.weight, self.weight_loader)
        self.batch_invariant = False  # read by `compute_logits` (the lookup itself is exact)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        if self.tp is not None:
            if tensor.shape[0] != self.num_embeddings:
                raise ValueError(f"shape {tuple(tensor.shape)} does not fit a vocabulary of {self.num_embeddings}")
            tensor = tensor.narrow(0, self.vocab_start, param.shape[0])
        default_weight_loader(param, tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if self.tp is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])  # [num_tokens]
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[:, None]
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection [vocab, hidden], split on the vocab like the embedding; used through
    `compute_logits`, never called."""


def compute_logits(
    lm_head: VocabParallelEmbedding, hidden: torch.Tensor  # hidden: [n, hidden]
) -> torch.Tensor:  # [n, vocab] fp32
    """Works for a `ParallelLMHead` and for a tied `VocabParallelEmbedding`; under tensor parallelism each rank
    computes its vocabulary slice and the all-gather gives every rank the whole row (so every rank samples the
    same tokens from the same logits). With the head's `batch_invariant` on, CUDA takes `batch_invariant_linear`."""
    if use_batch_invariant(lm_head, hidden):
        logits = batch_invariant_linear(hidden, lm_head.weight)
    else:
        logits = F.linear(hidden, lm_head.weight)
    tp = getattr(lm_head, "tp", None)
    return (logits if tp is None else tp.all_gather(logits)).float()


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one merged projection; under tensor parallelism each rank
    holds intermediate_size / N of the columns (gate_up column-parallel, down row-parallel)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 tp: TensorParallel | None = None):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: ['silu']")
        split_size(intermediate_size, tp, "intermediate_size")  # the config's name in the error
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)
        self.fused_ops = True  # silu(gate) * up in one Triton kernel on CUDA
        self.takes_prenorm = tp is None  # whole weights: forward(prenorm=...) may fuse the norm and the residual

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        prenorm: RMSNorm | None = None,  # x is the residual stream: return x + mlp(prenorm(x)), fused (skinny)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if prenorm is not None:
            act = self.gate_up_proj.skinny(x, prenorm, silu_mul=True)
            return self.down_proj.skinny(act, residual=x)
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate (this rank's)]
        if use_fused(self, gate_up):
            from research_lm.ops.silu_and_mul import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        return self.down_proj(silu_and_mul_ref(gate_up))
