"""The `triton` backend: our own Triton kernels over the same paged cache layout as `torch_ref`.

Per layer: `reshape_and_cache` writes this step's K/V, then one `unified_attention` launch serves
prefill, decode and mixed batches (GQA, causal, sliding window, token trees); decode batches with few
sequences and long contexts take the split-KV (flash-decoding) path: partial outputs + a reduce.
Every host-side choice (tile shape, split count) comes from host integers of the step's metadata,
made once per step and per layer shape, so forward never syncs and can be captured in a CUDA graph.
The kernels and their launchers live in `attention_zoo/triton_kernels/`.

Batch-invariant plan (the impl's `batch_invariant`, `EngineConfig.batch_invariant`): the tile from the head shape
alone (`batch_invariant_tile_config`) and no split-KV, for decode, verify and prefill alike. A row's online
softmax then walks the same key tiles, at absolute boundaries, in the same order, through the same dot shapes,
whatever the step holds; key tiles a row cannot see (past its position, in a longer query) leave its running
max, sum and accumulator exactly as they were. The cost: small decode batches over long contexts lose the
flash-decoding parallelism, and prefill runs 16-row instead of 64-row query tiles.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import triton

from attention_zoo.base import AttentionBackend, AttentionImpl, AttentionSpec, BackendCapabilities
from attention_zoo.metadata import CommonAttentionMetadata
from attention_zoo.registry import register_backend
from attention_zoo.triton_kernels import (
    TileConfig,
    batch_invariant_tile_config,
    reshape_and_cache,
    rope_and_cache,
    unified_attention,
)
from attention_zoo.triton_kernels.unified_attention import default_tile_config

# Under TRITON_INTERPRET=1 the kernels run (slowly) on CPU tensors; that is how CPU tests use them.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

MIN_TOKENS_PER_SPLIT = 256  # a split's fixed cost (its share of launch, workspace, reduce) needs this much work
MAX_SPLITS = 64


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # stands in for an accelerator under the interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_reqs: int, num_kv_heads: int, max_seq_len: int, is_pure_decode: bool, sm_count: int
) -> int:
    """Split the context only where the plain grid (one program per request and KV head) underfills the GPU.

    Decode-only batches with fewer than 2 (request, KV head) programs per SM, and contexts long
    enough that each split still reads >= MIN_TOKENS_PER_SPLIT keys. Aims at ~4 programs per SM; a
    power of 2 so few kernel variants are compiled. On an H200 (132 SMs, 8 KV heads) this picks the
    measured best split count at batch x context 1 x 8k, 1 x 32k, 4 x 32k, 8 x 8k, 16 x 2k, 32 x 8k.
    """
    programs = num_reqs * num_kv_heads
    if not is_pure_decode or programs == 0 or programs >= 2 * sm_count:
        return 1
    splits = min(triton.cdiv(4 * sm_count, programs), max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return 1 << (splits.bit_length() - 1) if splits >= 2 else 1


@dataclass(frozen=True)
class LaunchPlan:
    tile: TileConfig
    num_splits: int
    min_split_tokens: int = MIN_TOKENS_PER_SPLIT  # 0 where a test forces the split count


@dataclass
class TritonAttentionMetadata:
    common: CommonAttentionMetadata
    sm_count: int
    force_num_splits: int | None = None  # tests force the split-KV path on (or off) with this
    force_tile: TileConfig | None = None
    # (num_heads, num_kv_heads, head_size, batch_invariant) -> plan: decided by the first layer of that kind, reused.
    _plans: dict[tuple[int, int, int, bool], LaunchPlan] = field(default_factory=dict)

    def plan(self, spec: AttentionSpec, batch_invariant: bool = False) -> LaunchPlan:
        key = (spec.num_heads, spec.num_kv_heads, spec.head_size, batch_invariant)
        if key not in self._plans:
            c = self.common
            group = spec.num_heads // spec.num_kv_heads
            if batch_invariant:  # nothing from the step: see the module docstring
                tile = batch_invariant_tile_config(group, spec.head_size, _INTERPRET)
            else:
                tile = default_tile_config(c.max_query_len, group, spec.head_size, _INTERPRET)
            tile = self.force_tile or tile
            splits = self.force_num_splits
            if splits is not None:
                self._plans[key] = LaunchPlan(tile, splits, min_split_tokens=0)
            elif batch_invariant:
                self._plans[key] = LaunchPlan(tile, 1)
            else:
                splits = choose_num_splits(
                    c.num_reqs, spec.num_kv_heads, c.max_seq_len, c.is_pure_decode, self.sm_count
                )
                self._plans[key] = LaunchPlan(tile, splits)
        return self._plans[key]


class TritonAttentionImpl(AttentionImpl):
    def forward(self, q, k, v, kv_cache, metadata: TritonAttentionMetadata, rope=None):
        common = metadata.common
        if rope is None:
            reshape_and_cache(k, v, kv_cache, common.slot_mapping)
        else:  # q and k rotated here: k on its way into the cache (`rope_in_kv_write`)
            q = rope_and_cache(q, k, v, kv_cache, common.slot_mapping, rope.positions, rope.inv_freq,
                               rope.attention_scaling)
        out = torch.empty_like(q)
        plan = metadata.plan(self.spec, self.batch_invariant)
        return unified_attention(
            q,
            kv_cache,
            out,
            common.query_start_loc,
            common.seq_lens,
            common.block_table,
            num_reqs=common.num_reqs,
            scale=self.spec.scale,
            sliding_window=self.spec.sliding_window,
            config=plan.tile,
            num_splits=plan.num_splits,
            min_split_tokens=plan.min_split_tokens,
            upcast=_INTERPRET,
            tree_bits=common.tree_bits,
        )


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    capabilities = BackendCapabilities(
        devices=frozenset({"cuda", "cpu"} if _INTERPRET else {"cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kinds=frozenset({"attention"}),
        sliding_window=True,
        cuda_graphs=True,
        cuda_graphs_multi_token=True,  # grid and tile depend only on num_tokens, num_reqs and max_query_len > 1
        token_trees=True,  # the kernel reads tree_bits on the device: a graph's persistent buffer serves each replay
        batch_invariant=True,  # the plan of `batch_invariant_tile_config`, no split-KV (module docstring)
        rope_in_kv_write=True,  # `rope_and_cache`: the rotary embedding and the KV write in one kernel
    )

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, spec: AttentionSpec) -> tuple[int, ...]:
        return (2, num_blocks, block_size, spec.num_kv_heads, spec.head_size)

    @classmethod
    def build_metadata(
        cls,
        common: CommonAttentionMetadata,
        *,
        force_num_splits: int | None = None,
        force_tile: TileConfig | None = None,
    ) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            common,
            sm_count=_sm_count(common.query_start_loc.device),
            force_num_splits=force_num_splits,
            force_tile=force_tile,
        )

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl:
        return TritonAttentionImpl(spec)
