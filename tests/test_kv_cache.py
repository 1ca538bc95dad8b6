"""KV cache manager: block pool LRU, prefix-cache hash chain, allocation, sliding-window freeing.

The stateful test drives the manager like a runner would and keeps a fake KV memory (one prefix
hash per token slot), so a block handed to two owners or evicted while in use shows up as wrong
content, not just as a wrong counter.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from research_lm.api.sampling_params import SamplingParams
from research_lm.engine.kv_cache import NULL_BLOCK_ID, BlockPool, KVCacheManager, num_blocks_from_memory
from research_lm.engine.request import Request


def make_request(req_id: str, prompt: list[int], output: list[int] = ()) -> Request:
    return Request(req_id, list(prompt), SamplingParams(), seed=0, output_token_ids=list(output))


def prefix_chain(tokens: list[int]) -> list[int]:
    """chain[p] identifies tokens[: p + 1]: what the KV at position p depends on."""
    chain, h = [], 17
    for t in tokens:
        h = hash((h, t))
        chain.append(h)
    return chain


def assert_kv_invariants(
    kv: KVCacheManager, requests: dict[str, Request] | None = None, *, sharing_needs_hash: bool = True
) -> None:
    """Ref counts equal owners; free queue == blocks with ref 0; sharing only via hashed blocks
    (unless the prefix cache was reset, which drops the hashes of blocks still shared)."""
    pool = kv.pool
    owners: Counter[int] = Counter()
    where: dict[int, list[tuple[str, int]]] = {}
    for req_id, table in kv._req_blocks.items():
        real = [b for b in table if b != NULL_BLOCK_ID]
        assert len(real) == len(set(real)), f"{req_id} holds a block twice: {table}"
        owners.update(real)
        for i, b in enumerate(table):
            where.setdefault(b, []).append((req_id, i))
    null = pool.blocks[NULL_BLOCK_ID]
    assert null.ref_cnt == 0 and null.block_hash is None and not pool.is_free(NULL_BLOCK_ID)
    num_used = 0
    for block in pool.blocks[1:]:
        assert block.ref_cnt == owners[block.block_id], f"block {block.block_id}"
        assert pool.is_free(block.block_id) == (block.ref_cnt == 0)
        num_used += block.ref_cnt > 0
        if block.block_hash is not None:
            assert pool._cached[block.block_hash] == block.block_id
        if block.ref_cnt > 1 and sharing_needs_hash:  # shared only via a hit, at one position in all
            assert block.block_hash is not None
            if requests is not None:
                for req_id, i in where[block.block_id]:
                    assert requests[req_id].block_hashes[i] == block.block_hash
    assert len(pool._cached) == sum(b.block_hash is not None for b in pool.blocks)
    assert kv.num_free_blocks + num_used == kv.num_blocks - 1
    assert kv.usage == pytest.approx(num_used / (kv.num_blocks - 1))


# ---- BlockPool ------------------------------------------------------------------------------------


def test_null_block_is_never_allocated():
    pool = BlockPool(5, enable_caching=True)
    assert sorted(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free([NULL_BLOCK_ID, 2])  # freeing the null block is a no-op
    assert pool.num_free_blocks == 1 and pool.get_new_blocks(1) == [2]


def test_pool_rejects_fewer_than_two_blocks():
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1, enable_caching=True)


def test_lru_evicts_uncached_first_then_least_recently_freed():
    pool = BlockPool(6, enable_caching=True)
    a, b, c, d, e = pool.get_new_blocks(5)
    pool.cache_block(a, 100)
    pool.cache_block(b, 101)
    pool.cache_block(c, 102)
    pool.free([b])  # freed first: oldest cached
    pool.free([a, c])
    pool.free([d])  # uncached: jumps the queue
    assert pool.get_cached_block(101) == b
    assert pool.get_new_blocks(1) == [d]
    assert pool.get_new_blocks(1) == [b]  # evicts hash 101
    assert pool.get_cached_block(101) is None and pool.blocks[b].block_hash is None
    assert pool.get_cached_block(100) == a and pool.get_cached_block(102) == c


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 7)
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 1 and not pool.is_free(a) and pool.num_free_blocks == 1
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 2


def test_duplicate_content_keeps_the_first_cached_copy():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, 5)
    assert not pool.cache_block(b, 5)
    assert pool.get_cached_block(5) == a and pool.blocks[b].block_hash is None


def test_caching_disabled_never_registers():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_block(a, 5)
    assert pool.get_cached_block(5) is None


# ---- KVCacheManager ------------------------------------------------------------------------------


def test_hash_chain_is_incremental_and_prefix_determined():
    kv = KVCacheManager(num_blocks=16, block_size=2)
    r1 = make_request("a", [1, 2, 3, 4, 5])
    kv.get_computed_blocks(r1)
    assert len(r1.block_hashes) == 2
    first = list(r1.block_hashes)
    r1.output_token_ids += [6, 7, 8]
    kv.get_computed_blocks(r1)
    assert r1.block_hashes[:2] == first and len(r1.block_hashes) == 4
    # Same tokens split between prompt and output hash the same; any earlier change changes later hashes.
    r2 = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    r3 = make_request("c", [9, 2, 3, 4, 5, 6, 7, 8])
    kv.get_computed_blocks(r2)
    kv.get_computed_blocks(r3)
    assert r2.block_hashes == r1.block_hashes
    assert all(x != y for x, y in zip(r2.block_hashes, r3.block_hashes))


def test_prefix_hit_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r1 = make_request("a", list(range(8)))
    kv.allocate_slots(r1, 8)
    r1.num_computed_tokens = 8
    kv.cache_blocks(r1, 8)
    r2 = make_request("b", list(range(8)))  # fully cached, but the last token must be computed
    blocks, n = kv.get_computed_blocks(r2)
    assert n == 4 and blocks == kv.get_block_ids("a")[:1]
    r3 = make_request("c", list(range(9)))
    blocks, n = kv.get_computed_blocks(r3)
    assert n == 8 and blocks == kv.get_block_ids("a")


def test_allocate_with_hits_shares_blocks_and_counts_revived_ones():
    kv = KVCacheManager(num_blocks=5, block_size=2)  # 4 usable blocks
    r1 = make_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(r1, 5)
    r1.num_computed_tokens = 5
    kv.cache_blocks(r1, 5)
    kv.free(r1)
    assert kv.num_free_blocks == 4
    r2 = make_request("b", [1, 2, 3, 4, 9, 9, 9, 9])
    hits, n = kv.get_computed_blocks(r2)
    assert n == 4 and len(hits) == 2
    # 2 revived hits + 2 new blocks = all 4; one more token would need a fifth.
    assert kv.allocate_slots(r2, 5, hits) is None
    assert kv.num_free_blocks == 4 and all(kv.pool.blocks[b].ref_cnt == 0 for b in hits)
    table = kv.allocate_slots(r2, 4, hits)
    assert table[:2] == hits and kv.num_free_blocks == 0
    assert_kv_invariants(kv)


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r1 = make_request("a", list(range(10)))
    assert kv.allocate_slots(r1, 8) is not None
    r1.num_computed_tokens = 8
    before = (kv.num_free_blocks, kv.get_block_ids("a"))
    assert kv.allocate_slots(r1, 8) is None  # 16 tokens > 12 slots
    assert (kv.num_free_blocks, kv.get_block_ids("a")) == before
    assert kv.allocate_slots(r1, 4, num_lookahead_tokens=1) is None
    assert kv.allocate_slots(r1, 4) is not None and kv.num_free_blocks == 0


def test_free_releases_tail_first_so_the_prefix_survives_longest():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    r1 = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    table = kv.allocate_slots(r1, 7)
    r1.num_computed_tokens = 7
    kv.cache_blocks(r1, 7)
    kv.free(r1)
    # Partial tail block (uncached) first, then full blocks from the tail towards the head.
    assert list(kv.pool._free) == [table[3], table[2], table[1], table[0]]
    r2 = make_request("b", [8, 8, 8, 8, 8])
    kv.allocate_slots(r2, 5)  # takes 3 blocks: evicts hashes of blocks 2 and 1, keeps block 0
    _, n = kv.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5, 6, 7]))
    assert n == 2


def test_usage_and_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    r1 = make_request("a", [1, 2, 3, 4])
    kv.allocate_slots(r1, 4)
    assert kv.usage == pytest.approx(0.5)
    r1.num_computed_tokens = 4
    kv.cache_blocks(r1, 4)
    assert kv.pool.num_cached_blocks == 2
    kv.reset_prefix_cache()
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5]))[1] == 0
    kv.free(r1)
    assert kv.usage == 0.0
    assert_kv_invariants(kv)


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=5, block_size=2, enable_prefix_caching=False)
    r1 = make_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(r1, 5)
    r1.num_computed_tokens = 5
    kv.cache_blocks(r1, 5)
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)


def test_free_blocks_outside_window():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request("a", list(range(20)))
    table = kv.allocate_slots(r, 20)
    r.num_computed_tokens = 14  # next position 14 attends to positions > 14 - 6 = 8: blocks 0, 1 dead
    released = kv.free_blocks_outside_window(r, sliding_window=6)
    assert released == table[:2]
    assert kv.get_block_ids("a") == [NULL_BLOCK_ID, NULL_BLOCK_ID] + table[2:]
    assert all(kv.pool.is_free(b) for b in released)
    assert kv.free_blocks_outside_window(r, sliding_window=6) == []  # idempotent
    r.num_computed_tokens = 13  # position 13 still needs position 8 (block 2)
    assert kv.free_blocks_outside_window(r, sliding_window=6) == []
    assert_kv_invariants(kv)
    kv.free(r)
    assert kv.num_free_blocks == 9
    assert_kv_invariants(kv)


def test_num_blocks_from_memory():
    assert num_blocks_from_memory(1000, 64) == 15
    assert num_blocks_from_memory(10, 64) == 2
    with pytest.raises(ValueError):
        num_blocks_from_memory(1000, 0)


# ---- stateful property test ----------------------------------------------------------------------


class KVCacheMachine(RuleBasedStateMachine):
    """Random admit / compute / free / slide against one manager, with a fake KV memory."""

    @initialize(
        num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 4]), caching=st.booleans()
    )
    def setup(self, num_blocks, block_size, caching):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.requests: dict[str, Request] = {}
        self.memory: dict[tuple[int, int], int] = {}  # (block id, offset) -> prefix hash
        self.windowed: set[str] = set()
        self.was_reset = False
        self.next_id = 0

    def _write(self, req: Request, start: int, end: int) -> None:
        chain = prefix_chain(req.all_token_ids)
        table = self.kv.get_block_ids(req.request_id)
        bs = self.kv.block_size
        for p in range(start, end):
            block_id = table[p // bs]
            assert block_id != NULL_BLOCK_ID
            self.memory[(block_id, p % bs)] = chain[p]

    def _try_compute(self, req: Request, n: int, hits: list[int], lookahead: int) -> None:
        free_before = self.kv.num_free_blocks
        table_before = self.kv.get_block_ids(req.request_id)
        if self.kv.allocate_slots(req, n, hits, lookahead) is None:
            assert self.kv.num_free_blocks == free_before
            assert self.kv.get_block_ids(req.request_id) == table_before
            return
        start = req.num_computed_tokens + len(hits) * self.kv.block_size
        self._write(req, start, start + n)
        req.num_computed_tokens = start + n
        self.kv.cache_blocks(req, req.num_computed_tokens)
        self.requests[req.request_id] = req

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=24), data=st.data())
    def admit(self, prompt, data):
        req = make_request(f"r{self.next_id}", prompt)
        self.next_id += 1
        hits, n_hit = self.kv.get_computed_blocks(req)
        assert n_hit == len(hits) * self.kv.block_size and n_hit < req.num_tokens
        n = data.draw(st.integers(1, req.num_tokens - n_hit))
        self._try_compute(req, n, hits, data.draw(st.integers(0, 2)))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def compute(self, data):
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        if req.num_computed_tokens == req.num_tokens:  # "sample" the next token
            req.output_token_ids.append(data.draw(st.integers(0, 2)))
        n = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
        self._try_compute(req, n, [], data.draw(st.integers(0, 2)))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data):
        req = self.requests.pop(data.draw(st.sampled_from(sorted(self.requests))))
        self.kv.free(req)
        self.windowed.discard(req.request_id)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), window=st.integers(1, 8))
    def slide(self, data, window):
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        before = self.kv.get_block_ids(req.request_id)
        released = self.kv.free_blocks_outside_window(req, window)
        dead = min(max(0, req.num_computed_tokens - window + 1) // self.kv.block_size, len(before))
        assert sorted(released) == sorted(b for b in before[:dead] if b != NULL_BLOCK_ID)
        assert self.kv.get_block_ids(req.request_id) == [NULL_BLOCK_ID] * dead + before[dead:]
        if released:
            self.windowed.add(req.request_id)

    @rule()
    def reset_prefix_cache(self):
        self.kv.reset_prefix_cache()
        self.was_reset = True

    @invariant()
    def counts_are_consistent(self):
        if hasattr(self, "kv"):
            assert_kv_invariants(self.kv, sharing_needs_hash=not self.was_reset)

    @invariant()
    def every_live_slot_holds_its_own_prefix(self):
        """A prefix hit must carry the right KV, and no owner's KV is overwritten by another."""
        if not hasattr(self, "kv"):
            return
        bs = self.kv.block_size
        for req in self.requests.values():
            chain = prefix_chain(req.all_token_ids)
            table = self.kv.get_block_ids(req.request_id)
            assert len(table) * bs >= req.num_computed_tokens
            for p in range(req.num_computed_tokens):
                block_id = table[p // bs]
                if block_id == NULL_BLOCK_ID:
                    assert req.request_id in self.windowed
                    continue
                assert self.memory[(block_id, p % bs)] == chain[p], (req.request_id, p)

    def teardown(self):
        if hasattr(self, "kv"):
            for req in list(self.requests.values()):
                self.kv.free(req)
            assert self.kv.num_free_blocks == self.kv.num_blocks - 1
            assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
