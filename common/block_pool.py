"""The KV block pool: fixed-size blocks, reference counts, an LRU free list and the prefix
cache's hash index. It deals only in block ids, counts and hashes; the tensors live in the
model runner's KV cache.

A block whose reference count drops to zero goes to the tail of the free list but keeps its
hash, so a later request with the same prefix can take it back (a prefix-cache hit) until
it is reused for new data, which happens in LRU order from the head of the list."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.common.block_events import BlockEventLog


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and its KV written; cleared when the block is reused.
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    # False: when evicted, drop it rather than spill it to a tier (its request was preempted
    # to be recomputed: keeping its KV costs more than computing it again).
    spill: bool = True
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) pop from the head (the least
    recently freed), append at the tail, and removal from the middle (a cache hit)."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}
        # (stored?, hash) changes of `cached`: what a worker streams to the router.
        self.events = BlockEventLog()
        # Called with a cached block about to be reused for new data (its KV still in
        # place): the KV manager's hook that spills it to the tier below.
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the LRU head, evicting their cached hashes."""
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        taken = []
        for _ in range(n):
            block = self.free_queue.popleft()
            hook = self.on_evict
            if (
                hook is not None
                and block.spill
                and self.cached.get(block.block_hash or -1) is block
            ):
                hook(block)
            block.spill = True
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """A cached block holding exactly these tokens after this parent chain, or None.
        Token ids are compared too, so a 64-bit hash collision can never serve wrong KV."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            block.spill = True  # wanted again: worth keeping after all

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; pass them in eviction order (first evicted first)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: int, token_ids: Sequence[int]) -> None:
        """Register a full block whose KV is written. A hash already held by another block
        stays with that block (this one is then simply not shared)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        self.events.add(True, block_hash)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.events.add(False, block.block_hash)
            block.block_hash = None
            block.token_ids = None

    def record_events(self) -> None:
        """From now on, log every hash stored in or evicted from the prefix cache."""
        self.events.record()

    def drain_events(self) -> list[tuple[bool, int]]:
        """The (stored?, hash) changes since the last drain, oldest first."""
        return self.events.drain()

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)
