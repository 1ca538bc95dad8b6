"""Paged KV cache bookkeeping: a block pool with an LRU prefix cache, and the per-request block tables.

No tensors live here: a block is an id into the runner's KV tensors (`block_size` token slots each).

Invariants (asserted by tests/test_kv_cache.py):
- Block 0 is the *null block*: never allocated, never freed, never cached. Block tables hold it for
  slots that need no KV (sliding-window positions out of the window, padding).
- For every other block, `ref_cnt` equals the number of block-table entries that hold it; a block is
  in the free queue iff `ref_cnt == 0`; so `num_free_blocks + num_used_blocks == num_blocks - 1`.
- A block is shared by several requests only through a prefix-cache hit: it carries a `block_hash`,
  and `cached[h] is block` for that hash.
- A cached block whose `ref_cnt` drops to 0 keeps its hash (reusable by a later hit) until it is
  allocated again, which evicts the hash. The free queue is LRU: blocks without a hash sit at its
  head (nothing to lose), freed cached blocks join its tail, and allocation takes from the head.

Hash chain: the hash of full block i of a request's tokens is `hash((hash of block i-1, tokens of
block i))`, with `_ROOT_HASH` before block 0, so equal hashes mean equal prefixes (up to 64-bit
collisions of Python's tuple hash, which is deterministic for ints across processes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from research_lm.engine.request import Request

NULL_BLOCK_ID = 0
_ROOT_HASH = 0x5EED


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the prefix cache


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens: `queries` looked up, `hits` found computed."""

    queries: int = 0
    hits: int = 0

    def record(self, num_queries: int, num_hits: int) -> None:
        self.queries += num_queries
        self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Owns every block's ref count and hash, the LRU free queue and the `hash -> block` map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Head = next to allocate (and evict). An OrderedDict gives O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def get_cached_block(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop `n` blocks from the head of the free queue (evicting their hashes); each gets ref_cnt 1."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit); a free one leaves the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in eviction order (the first to reach 0 is evicted first)."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                continue
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full block under `block_hash`; False when caching is off, the block already has
        a hash, or another block already holds this content (the first one stays the cached copy)."""
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every hash; blocks in use stay allocated and valid, they just cannot be hit."""
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None


class KVCacheManager:
    """Per-request block tables over a `BlockPool`, with hash-chained prefix caching.

    A request's table covers at least `request.num_computed_tokens` token slots (plus what the last
    `allocate_slots` asked for); entry i holds tokens [i * block_size, (i + 1) * block_size).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        recompute_last_hit_block: bool = False,
    ) -> None:
        """`recompute_last_hit_block`: EAGLE heads cache, at position p, a row that depends on the token
        at p + 1, which lies past a cache hit; dropping the last hit block recomputes those rows."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.recompute_last_hit_block = recompute_last_hit_block
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._req_blocks: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading table entries already hash-registered

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks in use (ref_cnt > 0)."""
        return 1.0 - self.pool.num_free_blocks / (self.pool.num_blocks - 1)

    @property
    def max_num_tokens(self) -> int:
        """Most tokens one request can hold: every non-null block."""
        return (self.pool.num_blocks - 1) * self.block_size

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._req_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._req_blocks.get(request_id, ()))

    # ---- prefix cache ------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of full blocks of `request.all_token_ids`, never covering the last
        token (its logits must be computed). Pure lookup: no ref counts change."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.recompute_last_hit_block and hits:
            hits.pop()
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the hashes of the request's blocks that are full of computed real tokens.

        `num_computed_tokens` must not exceed `request.num_tokens` (drafts are never cached); tokens past the
        known ones (async scheduling's outputs in flight) wait until their ids are known."""
        if not self.enable_prefix_caching:
            return
        assert num_computed_tokens <= request.num_tokens, "only real (non-draft) tokens can be cached"
        num_computed_tokens = min(num_computed_tokens, request.num_known_tokens)
        blocks = self._req_blocks[request.request_id]
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, num_full):
            if blocks[i] != NULL_BLOCK_ID:
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` over the request's full blocks (tokens never change, so the
        chain only grows)."""
        hashes, bs = request.block_hashes, self.block_size
        prompt, output = request.prompt_token_ids, request.output_token_ids
        n_prompt = len(prompt)
        for i in range(len(hashes), request.num_known_tokens // bs):  # outputs in flight have no ids here yet
            start, end = i * bs, (i + 1) * bs
            if end <= n_prompt:
                tokens = tuple(prompt[start:end])
            else:
                tokens = tuple(prompt[start:end]) + tuple(output[max(start - n_prompt, 0) : end - n_prompt])
            hashes.append(hash((hashes[-1] if hashes else _ROOT_HASH, tokens)))

    # ---- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Grow the request's table to cover `num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens + num_lookahead_tokens` slots, taking a reference on the prefix
        hits `new_computed_blocks` (only for a request without a table). Returns a copy of the whole
        table, or None, changing nothing, when the free queue cannot supply it."""
        req_id = request.request_id
        blocks = self._req_blocks.get(req_id, [])
        if blocks and not new_computed_blocks:  # the common decode step: often no new block at all
            num_required = -(-(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens) // self.block_size)
            if num_required <= len(blocks):
                return list(blocks)
        assert not (blocks and new_computed_blocks), "prefix hits only apply to a request's first blocks"
        num_tokens = (
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_new_tokens
            + num_lookahead_tokens
        )
        num_required = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        num_revived = sum(1 for b in new_computed_blocks if self.pool.is_free(b))
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)  # before allocating, so the hits cannot be evicted
        blocks.extend(new_computed_blocks)
        blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        self._req_blocks[req_id] = blocks
        if new_computed_blocks:
            self._num_cached_blocks[req_id] = len(new_computed_blocks)
        return list(blocks)

    def free(self, request: Request) -> None:
        """Release the request's table. Tail blocks are freed first, so they are evicted first and a
        later request sharing the prefix still finds its head."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def free_blocks_outside_window(self, request: Request, sliding_window: int) -> list[int]:
        """Swap the request's blocks that lie wholly outside the attention window for the null block
        and release them; returns the released ids.

        The next token computed is at position p = `num_computed_tokens`; it attends to keys at
        positions > p - sliding_window, so blocks ending at or before p - sliding_window are dead.
        Only valid when every layer that reads this table uses that window."""
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return []
        first_useful_pos = max(0, request.num_computed_tokens - sliding_window + 1)
        num_dead = min(first_useful_pos // self.block_size, len(blocks))
        released = []
        for i in range(num_dead):
            if blocks[i] != NULL_BLOCK_ID:
                released.append(blocks[i])
                blocks[i] = NULL_BLOCK_ID
        self.pool.free(reversed(released))
        return released


def num_blocks_from_memory(budget_bytes: int, page_size_bytes_per_block: int) -> int:
    """How many KV blocks fit in `budget_bytes` (floored, at least 2: the null block plus one)."""
    if page_size_bytes_per_block <= 0:
        raise ValueError(f"page_size_bytes_per_block must be > 0, got {page_size_bytes_per_block}")
    return max(2, int(budget_bytes) // int(page_size_bytes_per_block))
