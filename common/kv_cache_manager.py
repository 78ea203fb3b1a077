"""Per-request KV block bookkeeping on top of the block pool: prefix-cache lookups when a
request is first scheduled, allocation of the slots each step needs (all or nothing, so the
scheduler can preempt), registration of full blocks once their KV is written, and freeing.

A prefix hit never covers the last prompt token: that token must be computed to produce the
logits the first output token is sampled from.

Below the pool, `tiers` (`common/kv_tiers.py`'s `TierStore`) holds blocks the pool evicts
(host memory, disk) and every block it registers (a shared folder); before a request is
admitted, its prefix blocks that the pool lacks and a tier holds are read back into pool
blocks and registered like any other: from then on they are ordinary pool hits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.common.block_hashing import ROOT_HASH, block_hashes
from pdserve.common.block_pool import BlockPool, KVCacheBlock
from pdserve.common.kv_tiers import KVTier, TierStore
from pdserve.common.request import Request

if TYPE_CHECKING:
    import torch


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.tiers = TierStore(self.pool, block_size, self.find_cached_prefix)
        # The engine's measured prefill time per token (what recomputing KV costs).
        self.prefill_seconds_per_token: float | None = None

    def attach_tiers(
        self,
        kv_cache: torch.Tensor,
        *,
        host: KVTier | None = None,
        disk: KVTier | None = None,
        shared: KVTier | None = None,
    ) -> None:
        """Put tiers below the pool, whose KV is `kv_cache` (block-major): `host` memory and
        then this worker's `disk` take the cached blocks the pool evicts, a `shared` folder
        every block the prefix cache registers; all serve hits. Nothing without prefix
        caching (a tier holds prefix-cache blocks)."""
        if self.enable_prefix_caching:
            self.tiers.attach(kv_cache, host=host, disk=disk, shared=shared)

    def prefetch(self, request: Request) -> None:
        """Start reading the tiers' blocks of this request's prefix (see `TierStore`)."""
        self.tiers.prefetch(request)

    def load_from_tier(self, request: Request, wait: bool = False) -> bool:
        """Bring the tiers' blocks of this request's prefix into the pool; False while some
        are still being read (unless `wait`). See `TierStore.load`."""
        return self.tiers.load(request, wait)

    def swap_pays(self, request: Request) -> bool:
        """Whether a preempted request's KV is worth keeping in the tiers rather than
        recomputed, by measured cost (see `TierStore.swap_pays`)."""
        return self.tiers.swap_pays(request, self.prefill_seconds_per_token)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached full blocks matching the request's tokens, capped so
        the last token is still computed. Does not take references. None for a request that
        asks for prompt logprobs: those come from computing every prompt position."""
        if not self.enable_prefix_caching or request.computing_prompt_logprobs:
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
        self.tiers.write_through(request, start, request.blocks[start:num_full])
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

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
