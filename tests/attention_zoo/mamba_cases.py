"""Random ragged batches for Mamba mixer backends: xBC/dt rows, weights, pre-filled state slots, metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from attention_zoo.mamba import MambaSpec, MambaWeights
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.registry import get_backend


def mamba_common_metadata(
    query_lens: list[int], num_computed: list[int], slots: list[int], device: str | torch.device = "cpu"
) -> CommonAttentionMetadata:
    """The runner's record for a batch of state layers (no paged KV: block table and slots are dummies)."""
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    seq_lens = torch.tensor([c + q for c, q in zip(num_computed, query_lens)], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens, num_computed_tokens_cpu=torch.tensor(num_computed, dtype=torch.int32),
        block_table=torch.zeros(len(query_lens), 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int64, device=device),
        request_rows=torch.tensor(slots, dtype=torch.int32, device=device), num_reqs=len(query_lens),
        num_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()), block_size=16,
    )


@dataclass
class MambaCase:
    spec: MambaSpec
    xbc: torch.Tensor  # [num_tokens + pad, conv_dim], a strided column slice like in_proj's output
    dt: torch.Tensor  # [num_tokens + pad, num_heads], strided too
    weights: MambaWeights
    cache: tuple[torch.Tensor, torch.Tensor]  # (conv_state, ssm_state), every slot pre-filled with noise
    common: CommonAttentionMetadata

    @property
    def num_real_tokens(self) -> int:
        return self.common.num_tokens


def make_mamba_case(
    query_lens: list[int],
    has_initial: list[bool],
    slots: list[int],
    *,
    num_heads: int = 4,
    head_dim: int = 16,
    n_groups: int = 2,
    state_size: int = 16,
    conv_kernel: int = 4,
    chunk_size: int = 8,
    num_slots: int = 8,
    time_step_limit: tuple[float, float] = (0.0, math.inf),
    conv_bias: bool = True,
    dtype: torch.dtype = torch.float32,
    pad_tokens: int = 0,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> MambaCase:
    spec = MambaSpec(
        num_heads=num_heads, num_kv_heads=n_groups, head_size=head_dim, state_size=state_size,
        conv_kernel=conv_kernel, chunk_size=chunk_size, time_step_limit=time_step_limit,
    )
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(device=device, dtype=dtype)

    num_rows = sum(query_lens) + pad_tokens
    proj = randn(num_rows, spec.conv_dim + num_heads + 3)
    weights = MambaWeights(
        conv_weight=randn(spec.conv_dim, conv_kernel, std=0.5),
        conv_bias=randn(spec.conv_dim, std=0.2) if conv_bias else None,
        A_log=randn(num_heads, std=0.5), D=randn(num_heads), dt_bias=randn(num_heads, std=0.5),
    )
    backend = get_backend("mamba_torch_ref")
    conv_state, ssm_state = backend.allocate_cache(
        spec, num_blocks=0, block_size=16, num_slots=num_slots, dtype=dtype, device=torch.device(device)
    )
    conv_state.copy_(torch.randn(conv_state.shape, generator=gen))
    ssm_state.copy_(torch.randn(ssm_state.shape, generator=gen))
    num_computed = [5 if init else 0 for init in has_initial]
    return MambaCase(
        spec=spec, xbc=proj[:, 1 : 1 + spec.conv_dim], dt=proj[:, 1 + spec.conv_dim : 1 + spec.conv_dim + num_heads],
        weights=weights, cache=(conv_state, ssm_state), common=mamba_common_metadata(query_lens, num_computed, slots,
                                                                                   device),
    )


def run_mamba_backend(name: str, case: MambaCase) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(y, cache after the step) of backend `name` on a copy of the case's cache."""
    backend = get_backend(name)
    cache = tuple(c.clone() for c in case.cache)
    metadata: Any = backend.build_metadata(case.common)
    y = backend.make_impl(case.spec).forward(case.xbc, case.dt, case.weights, cache, metadata)
    return y, cache
