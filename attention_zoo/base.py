"""The attention backend interface: a cache spec, capabilities as data, a metadata builder and an impl.

A backend is one file: subclass `AttentionBackend`, decorate it with `@register_backend("name")`,
and list its module in `registry.BACKENDS` so it is imported only when chosen.

Per step the runner calls `build_metadata` once (eager steps). A backend that declares `cuda_graphs` is
recorded into graphs with `build_graph_metadata` at capture, and `prepare_replay` makes that metadata serve
each step the graph replays: the two capture hooks are all a backend implements to reach the runner's graphs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attention_zoo.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer needs from a backend and from the KV cache."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # a token attends to the last `sliding_window` positions
    kind: str = "attention"  # "attention" | "mla" | "mamba": which family of backends serves it

    def page_size_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one KV block of this layer (K and V). Layers with per-request state return 0."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * block_size * self.num_kv_heads * self.head_size * itemsize

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of per-request state (Mamba conv + SSM state); 0 for paged KV layers."""
        return 0


@dataclass(frozen=True)
class BackendCapabilities:
    devices: frozenset[str]  # device types: "cpu", "cuda"
    dtypes: frozenset[torch.dtype]
    kinds: frozenset[str] = frozenset({"attention"})
    sliding_window: bool = False
    cuda_graphs: bool = False
    # A captured graph may also hold steps of several query tokens per request (spec verification, one
    # request's prompt): the launch plan fixed at capture serves any query lengths up to the captured one.
    cuda_graphs_multi_token: bool = False
    # `prepare_replay` plans from the step's lengths on the host (FlashInfer): graphs whose lengths only the
    # device knows (draft chains, a verify step launched before the previous one is verified) cannot use it.
    graphs_plan_on_host: bool = False
    # The eager path reads the step's lengths on the host (torch references, the MLA prefill split, FlashInfer's
    # plan). On CUDA those are the host's guesses ahead of an unverified step, so such a step is never launched ahead.
    eager_plans_on_host: bool = False
    # Honours `CommonAttentionMetadata.tree_bits` (token-tree verify steps); others serve causal steps only.
    token_trees: bool = False
    # With the impl's `batch_invariant` on (CUDA), each query row's output is the same bits whatever the other
    # requests of the step, its own request's query length (decode, verify, a prefill chunk) and how its context
    # was split into steps: a KV tile and split policy fixed by the head shape. The engine refuses the others.
    batch_invariant: bool = False
    # The impl's forward takes `rope` (positions, inv_freq, attention_scaling) and rotates q and k itself as it writes
    # the cache (one kernel for the rotary embedding and the KV write); the others get q and k rotated.
    rope_in_kv_write: bool = False

    def missing(self, spec: AttentionSpec, device: torch.device, dtype: torch.dtype) -> str | None:
        """A sentence naming what this backend lacks for (spec, device, dtype), or None if it serves it."""
        if spec.kind not in self.kinds:
            return f"does not implement {spec.kind} layers"
        if device.type not in self.devices:
            return f"does not run on {device.type}"
        if dtype not in self.dtypes:
            return f"does not support dtype {dtype}"
        if spec.sliding_window is not None and not self.sliding_window:
            return "does not support sliding-window attention"
        return None


class AttentionImpl(ABC):
    """Per-layer compute. `forward` writes this step's K/V into the cache, then attends."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        # Set through the layer (`Attention.batch_invariant`); read by backends whose capabilities claim it.
        self.batch_invariant = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # backend layout, see `AttentionBackend.kv_cache_shape`
        metadata: Any,  # what `AttentionBackend.build_metadata` returned this step
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        ...


class AttentionBackend(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]

    @classmethod
    @abstractmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, spec: AttentionSpec) -> tuple[int, ...]: ...

    @classmethod
    def allocate_cache(
        cls, spec: AttentionSpec, *, num_blocks: int, block_size: int, num_slots: int,
        dtype: torch.dtype, device: torch.device,
    ) -> Any:
        """This layer's cache: paged KV by default; state backends override (one slot per request row)."""
        return torch.zeros(cls.kv_cache_shape(num_blocks, block_size, spec), dtype=dtype, device=device)

    @classmethod
    def move_slots(cls, kv_cache: Any, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K and V entries of flat slots src -> dst (slot = block * block_size + offset, as slot_mapping):
        a token tree's accepted path to a chain's slots, for every layer of every verify step.

        `src`, `dst`: [m] int64 slots on the cache's device. All sources are gathered before any write, so
        overlapping sets are safe; a slot written twice must get the same value (a row copied onto itself: the
        caller's way to skip an entry without a host sync). One gather and one scatter, capturable in a CUDA graph.
        Default: the [2, num_blocks, block_size, num_kv_heads, head_size] layout."""
        flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])  # [2, num_slots, num_kv_heads, head_size]
        flat.index_copy_(1, dst, flat.index_select(1, src))

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """Once per step, before the forward. Default: kernels read the common record directly."""
        return common

    @classmethod
    def build_graph_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """At capture: the metadata a CUDA graph records. `common` is the graph's padded shape (num_reqs = B,
        max_query_len = q, num_tokens = B * q, max_seq_len = max_model_len) over the runner's persistent step
        buffers. Every device tensor the metadata holds must live as long as the graph (`prepare_replay` refreshes
        them in place). Default: `build_metadata`, for kernels that read only the record's device buffers and plan
        from its host integers."""
        return cls.build_metadata(common)

    @classmethod
    def prepare_replay(cls, metadata: Any, common: CommonAttentionMetadata) -> None:
        """Before each replay of a graph recorded with `metadata` (from `build_graph_metadata`): make it serve this
        step. `common` is the step's own record: its n <= B requests and T <= B * q tokens, host mirrors included;
        the step buffers already hold its inputs, padded to the graph's shape. Runs on the host, outside the graph.
        Default: nothing to refresh."""
        return None

    @classmethod
    @abstractmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl: ...
