"""Per-request KV block bookkeeping on top of the block pool: prefix-cache lookups when a
request is first scheduled, allocation of the slots each step needs (all or nothing, so the
scheduler can preempt), registration of full blocks once their KV is written, and freeing.

A prefix hit never covers the last prompt token: that token must be computed to produce the
logits the first output token is sampled from.

With a tier below the pool (`attach_tier`), a cached block the pool reuses is first copied
to the tier, and a request's prefix blocks that the pool lacks but the tier holds are read
back into pool blocks (registered in the prefix cache like any other) before the request is
admitted: from then on they are ordinary pool hits."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.common.block_hashing import ROOT_HASH, block_hashes
from pdserve.common.block_pool import BlockPool, KVCacheBlock
from pdserve.common.request import Request

if TYPE_CHECKING:
    import torch

    from pdserve.common.kv_host_tier import HostTier
    from pdserve.common.kv_offload import DiskTier

    Tier = DiskTier | HostTier

# An idle engine waits for its tier's reads (nothing else to run); at most this long.
TIER_WAIT_S = 5.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.host_tier: HostTier | None = None  # host memory, above `tier`: evictions go here
        self.tier: DiskTier | None = None  # this worker's own tier: evicted blocks go there
        self.shared_tier: DiskTier | None = None  # shared by workers: every block goes there
        self._kv: torch.Tensor | None = None
        self.tier_hit_tokens = 0  # prompt tokens read back from the tiers into the pool
        # The engine's measured prefill time per token (what recomputing KV costs).
        self.prefill_seconds_per_token: float | None = None

    def attach_tier(self, tier: DiskTier, kv_cache: torch.Tensor) -> None:
        """Spill evicted cached blocks of `kv_cache` (block-major) to `tier`, and read
        them back on a hit."""
        if not self.enable_prefix_caching:
            return
        self.tier = tier
        self._kv = kv_cache
        self.pool.on_evict = self._spill

    def attach_host_tier(self, tier: HostTier, kv_cache: torch.Tensor) -> None:
        """Spill evicted cached blocks to `tier` (host memory) first; it hands its own
        evictions down to the disk tier, if any."""
        if not self.enable_prefix_caching:
            return
        self.host_tier = tier
        self._kv = kv_cache
        self.pool.on_evict = self._spill

    def attach_shared_tier(self, tier: DiskTier, kv_cache: torch.Tensor) -> None:
        """Write every block of `kv_cache` the prefix cache registers through to `tier`, a
        folder other workers share, and read blocks back from it on a hit (after the own
        tier): a conversation moved to another worker keeps its cache."""
        if not self.enable_prefix_caching:
            return
        self.shared_tier = tier
        self._kv = kv_cache

    @property
    def tiers(self) -> list[Tier]:
        """Fastest first: host memory, the own disk tier, the shared one."""
        return [t for t in (self.host_tier, self.tier, self.shared_tier) if t is not None]

    def _spill(self, block: KVCacheBlock) -> None:
        tier = self.host_tier or self.tier
        assert tier is not None and self._kv is not None
        assert block.block_hash is not None and block.token_ids is not None
        tier.store(block.block_hash, block.token_ids, self._kv[block.block_id])

    def _write_through(self, request: Request, start: int, blocks: list[KVCacheBlock]) -> None:
        """Store `blocks`, the request's blocks `start ..` just registered in the pool, in the
        shared tier, and make the chain's blocks before them the most recent there: tail
        first, so the chain's head is the most recent and its tail is evicted first."""
        tier = self.shared_tier
        if tier is None or not blocks:
            return
        assert self._kv is not None
        bs = self.block_size
        for i in reversed(range(start, start + len(blocks))):
            tokens = request.all_token_ids[i * bs : (i + 1) * bs]
            tier.store(request.block_hashes[i], tokens, self._kv[blocks[i - start].block_id])
        tier.touch(request.block_hashes[:start])

    def _tier_candidates(self, request: Request) -> tuple[int, list[int]]:
        """(pool hits, the hashes after them up to the last full prompt block)."""
        self._update_hashes(request)
        start = len(self.find_cached_prefix(request))
        max_blocks = (request.num_tokens - 1) // self.block_size
        return start, request.block_hashes[start:max_blocks]

    def prefetch(self, request: Request) -> None:
        """Start reading the tiers' blocks of this request's prefix (on arrival, so the
        reads overlap its wait in the queue)."""
        for tier in self.tiers:
            tier.lookup(self._tier_candidates(request)[1])

    def load_from_tier(self, request: Request, wait: bool = False) -> bool:
        """Bring the tiers' blocks of this request's prefix into the pool, fastest tier
        first, again while any of them adds blocks (a prefix can lie partly in host memory,
        partly on disk). False while some are still being read (unless `wait`: then wait
        for them, bounded)."""
        ready = True
        for _ in range(4):
            added = 0
            for tier in self.tiers:
                tier_ready, promoted = self._load_from(tier, request, wait)
                ready, added = ready and tier_ready, added + promoted
            if not added or len(self.tiers) == 1:
                break
        return ready

    def _load_from(self, tier: Tier, request: Request, wait: bool) -> tuple[bool, int]:
        """(whether nothing is still being read, blocks promoted) for one tier."""
        deadline = time.monotonic() + TIER_WAIT_S
        promoted = 0
        for _ in range(4):  # a block written to disk meanwhile is read, then looked up again
            start, hashes = self._tier_candidates(request)
            held, ready = tier.lookup(hashes)
            if held == 0:
                return True, promoted
            if not ready and (not wait or time.monotonic() >= deadline):
                return False, promoted
            n = self._promote_run(tier, request, start, held, None if ready else deadline)
            promoted += n
            if ready and n in (0, held):
                return True, promoted
        return True, promoted  # still changing under us: go on with what the pool has

    def _promote_run(
        self, tier: Tier, request: Request, start: int, held: int, deadline: float | None
    ) -> int:
        """Bring the tier's blocks `start ..` (`held` of them) into free pool blocks and
        register them; returns how many (fewer when the pool runs out or a block is not
        ready). With a `deadline`, wait until then for the blocks still being read, reading
        the queued ones straight into their pool blocks (a CPU pool)."""
        hits = self.find_cached_prefix(request)
        self.pool.touch(hits)  # taking blocks below must not evict the pool's own hits
        assert self._kv is not None
        bs, n = self.block_size, min(held, self.pool.num_free_blocks)
        spans = [(request.block_hashes[i], request.all_token_ids[i * bs : (i + 1) * bs])
                 for i in range(start, start + n)]  # fmt: skip
        # Blocks first: taking them may spill others into a tier, which must happen before
        # this tier hands out its blocks (a host tier's are views of slots it may reuse).
        blocks = self.pool.get_new_blocks(n)
        hashes = [h for h, _ in spans]
        try:
            if deadline is not None:
                if self._kv.device.type == "cpu":
                    dests = zip(hashes, blocks, strict=True)
                    tier.read_into({h: self._kv[b.block_id] for h, b in dests})
                tier.wait_ready(hashes, deadline - time.monotonic())
            return self._promote(tier, request, start, spans, blocks)
        finally:
            tier.release(hashes)
            self.pool.free_blocks(reversed(blocks))
            self.pool.free_blocks(reversed(hits))

    def _promote(
        self,
        tier: Tier,
        request: Request,
        start: int,
        spans: list[tuple[int, list[int]]],
        blocks: list[KVCacheBlock],
    ) -> int:
        assert self._kv is not None
        kvs = tier.take_ready(spans)
        copy_start = time.perf_counter()
        for (block_hash, tokens), kv, block in zip(spans, kvs, blocks, strict=False):
            dest = self._kv[block.block_id]
            if kv.data_ptr() != dest.data_ptr():  # not read straight into it
                dest.copy_(kv)
            self.pool.cache_block(block, block_hash, tokens)
        tier.stats.load_seconds += time.perf_counter() - copy_start  # part of bringing it back
        self._write_through(request, start, blocks[: len(kvs)])
        self.tier_hit_tokens += len(kvs) * self.block_size
        return len(kvs)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached full blocks matching the request's tokens, capped so
        the last token is still computed. Does not take references."""
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        bs = self.block_size
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, request.all_token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after
        `cached_blocks`, the prefix hit taken on first scheduling). All or nothing."""
        cached_blocks = cached_blocks or []
        num_cached = len(cached_blocks) * self.block_size
        total = request.num_computed_tokens + num_cached + num_new_tokens
        need = self.blocks_needed(total) - len(request.blocks) - len(cached_blocks)
        # Cache hits that sit in the free list stop being evictable once touched.
        evictable_hits = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            request.blocks.extend(cached_blocks)
            request.num_registered_blocks = len(request.blocks)
        if need > 0:
            request.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV has been computed."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        bs = self.block_size
        start = request.num_registered_blocks
        for i in range(start, num_full):
            self.pool.cache_block(
                request.blocks[i],
                request.block_hashes[i],
                request.all_token_ids[i * bs : (i + 1) * bs],
            )
        self._write_through(request, start, request.blocks[start:num_full])
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def swap_pays(self, request: Request) -> bool:
        """Whether a preempted request's KV should be kept (its full blocks spilled to the
        tiers and read back on resume) rather than recomputed: its blocks' measured write and
        read time against its tokens' measured prefill time. True while either is unmeasured
        (a tier read is usually far cheaper than a prefill); False without a tier."""
        tier = self.host_tier or self.tier
        if tier is None:
            return False
        stats = tier.stats
        per_token = self.prefill_seconds_per_token
        if not stats.stores or not per_token:
            return True
        write = stats.store_seconds / stats.stores
        read = tier.seconds_per_load() or write
        blocks = request.num_computed_tokens // self.block_size
        return blocks * (write + read) < request.num_computed_tokens * per_token

    def free(self, request: Request, keep: bool = True) -> None:
        """Return the request's blocks, tail first: the end of a sequence is the least
        likely to be shared, so it is evicted before the prefix. `keep=False`: blocks no
        one else holds are dropped when evicted instead of spilled to a tier."""
        if not keep:
            for block in request.blocks:
                if block.ref_cnt == 1:
                    block.spill = False
        self.pool.free_blocks(reversed(request.blocks))
        request.blocks = []
        request.num_registered_blocks = 0

    def _update_hashes(self, request: Request) -> None:
        have = len(request.block_hashes)
        if request.num_tokens // self.block_size > have:
            parent = request.block_hashes[-1] if have else ROOT_HASH
            request.block_hashes.extend(
                block_hashes(request.all_token_ids, self.block_size, have, parent)
            )
