"""Triton kernels of the `triton` attention backend; each kernel lives beside its launcher."""

from attention_zoo.triton_kernels.kv_write import reshape_and_cache, rope_and_cache
from attention_zoo.triton_kernels.unified_attention import TileConfig, batch_invariant_tile_config, unified_attention

__all__ = ["TileConfig", "batch_invariant_tile_config", "reshape_and_cache", "rope_and_cache", "unified_attention"]
