"""`recompute_last_hit_block` (EAGLE heads): a prefix hit leaves its last block to be recomputed."""

from __future__ import annotations

from research_lm.api.sampling_params import SamplingParams
from research_lm.engine.kv_cache import KVCacheManager
from research_lm.engine.request import Request


def _cached_then_lookup(recompute: bool) -> tuple[list[int], int]:
    kv = KVCacheManager(num_blocks=16, block_size=4, recompute_last_hit_block=recompute)
    first = Request("a", list(range(13)), SamplingParams(), seed=0)
    kv.get_computed_blocks(first)
    kv.allocate_slots(first, 13)
    first.num_computed_tokens = 13
    kv.cache_blocks(first, 13)
    kv.free(first)
    second = Request("b", list(range(12)) + [99, 100], SamplingParams(), seed=0)
    return kv.get_computed_blocks(second)


def test_last_hit_block_is_dropped_only_when_asked():
    blocks, tokens = _cached_then_lookup(recompute=False)
    assert tokens == 12 and len(blocks) == 3
    blocks, tokens = _cached_then_lookup(recompute=True)
    assert tokens == 8 and len(blocks) == 2
