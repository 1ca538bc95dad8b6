"""Mamba2 mixers: per-request conv + SSM state slots, the torch reference backend `mamba_torch_ref`.

A Mamba2 layer keeps no paged KV. Each live request owns one state slot per layer (its runner row,
`metadata.request_rows[i]`): the last `conv_kernel - 1` inputs of the causal depthwise conv and the
SSM state `h` [num_heads, head_dim, state_size]. Per token t of a request (Mamba2, arXiv 2405.21060):

    x, B, C = split(silu(conv1d(xBC)))           B, C shared by the heads of a group (n_groups)
    dt_t    = clamp(softplus(dt_t + dt_bias), time_step_limit);   A = -exp(A_log)   (per head)
    h_t     = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T
    y_t     = h_t C_t + D x_t

A request whose `num_computed_tokens == 0` starts from zero state, whatever its slot holds: slot reuse
after finish and recompute after preemption need no reset. A later chunk (chunked prefill, decode)
continues from the slot. Prefill chunks use the chunked SSD form (intra-chunk quadratic, inter-chunk
recurrent), decodes the single-step update. Since the state summarizes the whole prefix, a cached
prefix of KV blocks cannot restore it: the engine turns prefix caching off for these models.

The gate z, the gated RMSNorm and the in/out projections stay in the model (`research_lm.models.mamba2`);
the cache-facing part here maps (xBC, dt) -> y, like `Attention` maps (q, k, v) -> o.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from attention_zoo.base import AttentionBackend, AttentionSpec, BackendCapabilities
from attention_zoo.layer import CacheLayer
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.registry import register_backend

MambaCache = tuple[torch.Tensor, torch.Tensor]  # (conv_state, ssm_state), see `MambaBackend.allocate_cache`


@dataclass(frozen=True, kw_only=True)
class MambaSpec(AttentionSpec):
    """A Mamba2 mixer layer. The attention fields are reused: `num_heads` = SSM heads, `num_kv_heads` =
    B/C groups (`n_groups`, the GQA analogue), `head_size` = head_dim; `scale` is unused."""

    state_size: int  # N: SSM state per head and channel
    conv_kernel: int  # causal depthwise conv width over xBC
    chunk_size: int = 256  # SSD chunk of the reference prefill (numerics only, not semantics)
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    activation: str = "silu"  # after the conv
    ssm_state_dtype: torch.dtype | None = torch.float32  # None: the model dtype (as transformers: fp32)
    scale: float = 1.0
    kind: str = "mamba"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"n_groups={self.num_kv_heads} must divide the {self.num_heads} SSM heads")
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"Mamba conv activation {self.activation!r} is not supported; supported: ['silu']")
        if self.conv_kernel < 1:
            raise ValueError(f"conv_kernel must be >= 1, got {self.conv_kernel}")

    @property
    def n_groups(self) -> int:
        return self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.head_size

    @property
    def intermediate_size(self) -> int:  # width of x (and of z, y)
        return self.num_heads * self.head_size

    @property
    def conv_dim(self) -> int:  # width of xBC
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def conv_state_shape(self, num_slots: int) -> tuple[int, int, int]:
        # time-major: a decode reads/writes contiguous channels of each past input
        return (num_slots, self.conv_kernel - 1, self.conv_dim)

    def ssm_state_shape(self, num_slots: int) -> tuple[int, int, int, int]:
        return (num_slots, self.num_heads, self.head_size, self.state_size)

    def state_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:  # (conv, ssm)
        return dtype, self.ssm_state_dtype or dtype

    def page_size_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return 0

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv_dtype, ssm_dtype = self.state_dtypes(dtype)
        conv = math.prod(self.conv_state_shape(1)) * conv_dtype.itemsize
        return conv + math.prod(self.ssm_state_shape(1)) * ssm_dtype.itemsize


class MambaWeights(NamedTuple):
    """The layer's own parameters the mixer needs (they live in the model, under checkpoint names)."""

    conv_weight: torch.Tensor  # [conv_dim, conv_kernel]
    conv_bias: torch.Tensor | None  # [conv_dim]
    A_log: torch.Tensor  # [num_heads]; A = -exp(A_log)
    D: torch.Tensor  # [num_heads]
    dt_bias: torch.Tensor  # [num_heads]


@dataclass
class MambaMetadata:
    """One step's batch as the mixers see it; built once per step by `MambaBackend.build_metadata`."""

    common: CommonAttentionMetadata
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    state_slots: torch.Tensor  # [num_reqs] int32, device: the request's state slot (runner row)
    has_initial_state: torch.Tensor  # [num_reqs] bool, device: num_computed_tokens > 0
    decode_req_idx: torch.Tensor  # [num_decodes] int32, device: requests with one query token
    prefill_req_idx: torch.Tensor  # [num_prefills] int32, device: requests with more than one
    # Host copies (the torch reference's loop); empty in a CUDA graph's metadata, which no replay could refresh.
    query_start_loc_cpu: list[int]  # [num_reqs + 1]
    has_initial_state_cpu: list[bool]  # [num_reqs]
    num_reqs: int
    max_query_len: int

    @property
    def num_decodes(self) -> int:
        return self.decode_req_idx.shape[0]

    @property
    def num_prefills(self) -> int:
        return self.prefill_req_idx.shape[0]


def build_mamba_metadata(common: CommonAttentionMetadata) -> MambaMetadata:
    device = common.query_start_loc.device
    query_lens = common.query_lens_cpu[: common.num_reqs]
    has_initial = common.num_computed_tokens_cpu[: common.num_reqs] > 0
    decode_idx = torch.nonzero(query_lens == 1).flatten().to(torch.int32)
    prefill_idx = torch.nonzero(query_lens > 1).flatten().to(torch.int32)  # empty chunks are in neither
    return MambaMetadata(
        common=common,
        query_start_loc=common.query_start_loc,
        state_slots=common.request_rows,
        has_initial_state=has_initial.to(device, non_blocking=True),
        decode_req_idx=decode_idx.to(device, non_blocking=True),
        prefill_req_idx=prefill_idx.to(device, non_blocking=True),
        query_start_loc_cpu=common.query_start_loc_cpu[: common.num_reqs + 1].tolist(),
        has_initial_state_cpu=has_initial.tolist(),
        num_reqs=common.num_reqs,
        max_query_len=common.max_query_len,
    )


def build_mamba_graph_metadata(common: CommonAttentionMetadata) -> MambaMetadata:
    """The metadata a CUDA graph of `common`'s padded shape (B requests of q tokens, over the runner's persistent
    step buffers) records: every device tensor lives as long as the graph, and none depends on the step.

    The split is fixed by q: a graph of q = 1 replays pure decodes only, so all B requests take the single-step
    update; q > 1 (one request's prompt or chunk) sends all B through the chunked scan, which reads each request's
    length from query_start_loc (a request of 1 token too). Padding requests (no tokens, state slot -1) are
    skipped by the kernels. has_initial_state is a buffer of B that `refresh_graph_has_initial_state` recomputes
    before each replay."""
    b, q = common.num_reqs, common.max_query_len
    every = torch.arange(b, dtype=torch.int32, device=common.query_start_loc.device)
    metadata = MambaMetadata(
        common=common,
        query_start_loc=common.query_start_loc,
        state_slots=common.request_rows,
        has_initial_state=torch.zeros(b, dtype=torch.bool, device=every.device),
        decode_req_idx=every if q == 1 else every[:0],
        prefill_req_idx=every[:0] if q == 1 else every,
        query_start_loc_cpu=[],
        has_initial_state_cpu=[],
        num_reqs=b,
        max_query_len=q,
    )
    refresh_graph_has_initial_state(metadata)
    return metadata


def refresh_graph_has_initial_state(metadata: MambaMetadata) -> None:
    """has_initial_state = num_computed_tokens > 0, in place and on the device, from the graph's own record: a
    request's computed tokens are its seq_len less its query length (padding: 0 and 0). No host value and no
    copy, so a step launched before the previous one is collected needs nothing from the host. Before each replay,
    outside the graph."""
    qsl = metadata.query_start_loc  # [B + 1]
    torch.gt(metadata.common.seq_lens + qsl[:-1], qsl[1:], out=metadata.has_initial_state)


class MambaImpl(ABC):
    """Per-layer compute: run this step's tokens through the conv and the SSM, update the slots."""

    def __init__(self, spec: MambaSpec):
        self.spec = spec

    @abstractmethod
    def forward(
        self,
        xbc: torch.Tensor,  # [num_tokens, conv_dim], before the conv; may be a strided column slice
        dt: torch.Tensor,  # [num_tokens, num_heads], raw (before dt_bias and softplus)
        weights: MambaWeights,
        cache: MambaCache,
        metadata: MambaMetadata,
    ) -> torch.Tensor:  # y: [num_tokens, num_heads * head_dim], xbc's dtype (D skip included, not gated)
        ...


class MambaBackend(AttentionBackend):
    """What every Mamba backend shares: the state layout, its allocation and the step metadata."""

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, spec: AttentionSpec) -> tuple[int, ...]:
        raise ValueError("Mamba layers keep per-request state slots, not paged KV: use allocate_cache")

    @classmethod
    def allocate_cache(
        cls, spec: AttentionSpec, *, num_blocks: int, block_size: int, num_slots: int,
        dtype: torch.dtype, device: torch.device,
    ) -> MambaCache:
        """(conv_state [num_slots, conv_kernel - 1, conv_dim], ssm_state [num_slots, heads, head_dim, state_size])."""
        assert isinstance(spec, MambaSpec), spec
        conv_dtype, ssm_dtype = spec.state_dtypes(dtype)
        return (
            torch.zeros(spec.conv_state_shape(num_slots), dtype=conv_dtype, device=device),
            torch.zeros(spec.ssm_state_shape(num_slots), dtype=ssm_dtype, device=device),
        )

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> MambaMetadata:
        return build_mamba_metadata(common)


class MambaMixer(CacheLayer):
    """The cache-facing part of a Mamba2 mixer: (xBC, dt) -> y over this layer's state slots."""

    spec: MambaSpec

    @torch.compiler.disable  # see CacheLayer
    def forward(
        self,
        xbc: torch.Tensor,  # [num_tokens, conv_dim]
        dt: torch.Tensor,  # [num_tokens, num_heads]
        weights: MambaWeights,
        attn_metadata: dict[str, Any],  # backend name -> that backend's metadata for this step
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        return self.impl.forward(xbc, dt, weights, self.kv_cache, attn_metadata[self.backend.name])


# ---------------------------------------------------------------------------------------------------
# The reference math, one request at a time (transformers' Mamba2Mixer torch path, with a state slot)


def discretize_dt(
    dt: torch.Tensor,  # [n, num_heads], raw
    dt_bias: torch.Tensor,  # [num_heads]
    time_step_limit: tuple[float, float],
) -> torch.Tensor:  # [n, num_heads] fp32
    dt = F.softplus(dt.float() + dt_bias.float())
    lo, hi = time_step_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def causal_conv1d_ref(
    x: torch.Tensor,  # [n, conv_dim]
    conv_state: torch.Tensor,  # [conv_kernel - 1, conv_dim]: the inputs before x
    weight: torch.Tensor,  # [conv_dim, conv_kernel]
    bias: torch.Tensor | None,  # [conv_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [n, conv_dim] before the activation, new conv state)
    window = torch.cat([conv_state.to(weight.dtype), x.to(weight.dtype)])  # [conv_kernel - 1 + n, conv_dim]
    out = F.conv1d(window.t()[None], weight[:, None, :], bias, groups=weight.shape[0])[0].t()
    return out, window[window.shape[0] - conv_state.shape[0]:]


def _segment_sum(a: torch.Tensor) -> torch.Tensor:  # [..., L] -> [..., L, L]
    """out[..., i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the diagonal (transformers' stable form)."""
    L = a.shape[-1]
    a = a[..., None].expand(*a.shape, L)
    a = a.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), -1), 0)
    out = torch.cumsum(a, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device)), -math.inf)


def ssd_chunk_scan_ref(
    x: torch.Tensor,  # [n, H, P] fp32
    dt: torch.Tensor,  # [n, H] fp32, discretized
    A: torch.Tensor,  # [H] fp32, negative
    B: torch.Tensor,  # [n, H, N] fp32 (group rows repeated per head)
    C: torch.Tensor,  # [n, H, N] fp32
    chunk_size: int,
    initial_state: torch.Tensor,  # [H, P, N] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # (y [n, H, P] without the D skip, final state [H, P, N])
    """The chunked SSD scan (transformers' `mamba2_chunk_scan` for one sequence). Letters: c chunk,
    l/s position in a chunk, h head, p head_dim, n state."""
    n = x.shape[0]
    pad = (-n) % chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [c, chunk_size, ...], zero-padded
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).reshape(-1, chunk_size, *t.shape[1:])

    x, B, C = chunks(x * dt[..., None]), chunks(B), chunks(C)
    A = chunks(A * dt).permute(2, 0, 1)  # [h, c, l]
    A_cumsum = torch.cumsum(A, dim=-1)
    # 1. within each chunk: attention-like, weights C_l . B_s decayed by exp(A_{s+1} + ... + A_l)
    L = torch.exp(_segment_sum(A))  # [h, c, l, s]
    G = torch.einsum("clhn,cshn->clsh", C, B)
    y_diag = torch.einsum("clsh,cshp->clhp", G * L.permute(1, 2, 3, 0), x)
    # 2. the state each chunk adds at its end
    decay_states = torch.exp(A_cumsum[:, :, -1:] - A_cumsum)  # [h, c, l]
    states = torch.einsum("clhn,clhp->chpn", B * decay_states.permute(1, 2, 0)[..., None], x)
    # 3. recurrence over chunks: the state entering each chunk, and the final state
    states = torch.cat([initial_state[None], states])  # [c + 1, h, p, n]
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, -1], (1, 0))))  # [h, c + 1, c + 1]
    states = torch.einsum("hzc,chpn->zhpn", decay_chunk, states)
    states, final_state = states[:-1], states[-1]
    # 4. the entering state read out at each position
    y_off = torch.einsum("clhn,chpn->clhp", C, states) * torch.exp(A_cumsum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, *x.shape[2:])[:n]
    return y, final_state


def selective_state_update_ref(
    state: torch.Tensor,  # [H, P, N] fp32
    x: torch.Tensor,  # [H, P] fp32
    dt: torch.Tensor,  # [H] fp32, discretized
    A: torch.Tensor,  # [H] fp32
    B: torch.Tensor,  # [H, N] fp32
    C: torch.Tensor,  # [H, N] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # (y [H, P] without the D skip, new state [H, P, N])
    """One recurrent step: h = exp(dt A) h + dt x B^T; y = h C."""
    state = state * torch.exp(dt * A)[:, None, None] + (dt[:, None] * x)[..., None] * B[:, None, :]
    return torch.einsum("hpn,hn->hp", state, C), state


def mamba_mixer_ref(
    spec: MambaSpec,
    xbc: torch.Tensor,  # [n, conv_dim], one request's chunk
    dt: torch.Tensor,  # [n, num_heads]
    weights: MambaWeights,
    conv_state: torch.Tensor,  # [conv_kernel - 1, conv_dim], the slot's (zeros for a new request)
    ssm_state: torch.Tensor,  # [num_heads, head_dim, state_size]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (y [n, H * P] fp32, new conv state, new ssm state)
    n, H, P, N, G = xbc.shape[0], spec.num_heads, spec.head_dim, spec.state_size, spec.n_groups
    conv_out, conv_state = causal_conv1d_ref(xbc, conv_state, weights.conv_weight, weights.conv_bias)
    conv_out = F.silu(conv_out).to(xbc.dtype).float()
    x, B, C = conv_out.split([H * P, G * N, G * N], dim=-1)
    x = x.reshape(n, H, P)
    B = B.reshape(n, G, N).repeat_interleave(H // G, dim=1)  # head h reads group h // (H / G)
    C = C.reshape(n, G, N).repeat_interleave(H // G, dim=1)
    dt = discretize_dt(dt, weights.dt_bias, spec.time_step_limit)
    A = -torch.exp(weights.A_log.float())
    if n == 1:
        y, ssm_state = selective_state_update_ref(ssm_state.float(), x[0], dt[0], A, B[0], C[0])
        y = y[None]
    else:
        y, ssm_state = ssd_chunk_scan_ref(x, dt, A, B, C, spec.chunk_size, ssm_state.float())
    y = y + weights.D.float()[:, None] * x
    return y.reshape(n, H * P), conv_state, ssm_state


class MambaTorchRefImpl(MambaImpl):
    def forward(self, xbc, dt, weights, cache, metadata: MambaMetadata):
        conv_state, ssm_state = cache
        y = torch.zeros(xbc.shape[0], self.spec.intermediate_size, dtype=xbc.dtype, device=xbc.device)
        qsl = metadata.query_start_loc_cpu
        slots = metadata.state_slots.tolist()
        for i in range(metadata.num_reqs):
            start, end, slot = qsl[i], qsl[i + 1], slots[i]
            if end == start:
                continue
            conv0, ssm0 = conv_state[slot], ssm_state[slot]
            if not metadata.has_initial_state_cpu[i]:  # a new or recomputed request: whatever the slot holds
                conv0, ssm0 = torch.zeros_like(conv0), torch.zeros_like(ssm0)
            y_i, conv1, ssm1 = mamba_mixer_ref(self.spec, xbc[start:end], dt[start:end], weights, conv0, ssm0)
            conv_state[slot] = conv1.to(conv_state.dtype)
            ssm_state[slot] = ssm1.to(ssm_state.dtype)
            y[start:end] = y_i.to(y.dtype)
        return y


@register_backend("mamba_torch_ref")
class MambaTorchRefBackend(MambaBackend):
    capabilities = BackendCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kinds=frozenset({"mamba"}),
        cuda_graphs=False,
    )

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> MambaImpl:
        assert isinstance(spec, MambaSpec), spec
        return MambaTorchRefImpl(spec)
