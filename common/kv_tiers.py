"""The KV tiers below the block pool, and the store that drives them.

Three tiers, fastest first: host memory (`common/kv_host_tier.py`'s `HostTier`), this
worker's own disk (`common/kv_offload.py`'s `DiskTier`) and a folder shared by the workers
of one layout (a shared `DiskTier`). Each is a `KVTier`: full blocks by chained hash, least
recently used first, with its counts (`TierStats`) and its event log for the router.

The `TierStore` is the pool's one way to them:
- spill: a cached block the pool is about to reuse is copied to host memory or, without
  it, to the disk (host memory hands its own evictions down to the disk);
- write through: every block the prefix cache registers is stored in the shared tier;
- prefetch and load: a request's prefix blocks that the pool lacks and a tier holds are
  read ahead when it arrives and, before it is admitted, read back into pool blocks and
  registered in the prefix cache, fastest tier first: from then on ordinary pool hits;
- swap_pays: whether a preempted request's KV is worth keeping in the tiers."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common.block_events import BlockEventLog

if TYPE_CHECKING:
    import torch

    from pdserve.common.block_pool import BlockPool, KVCacheBlock
    from pdserve.common.request import Request

# An idle engine waits for its tiers' reads (nothing else to run); at most this long.
TIER_WAIT_S = 5.0


@dataclass
class TierStats:
    """Running counts, read by the worker's metrics."""

    stores: int = 0  # blocks written to the tier
    store_bytes: int = 0
    store_seconds: float = 0.0
    loads: int = 0  # blocks read back from the tier
    loads_into_pool: int = 0  # of which read straight into a pool block (`read_into`)
    load_bytes: int = 0
    load_seconds: float = 0.0
    hits: int = 0  # blocks handed back to the pool (read, or still waiting to be written)
    evictions: int = 0  # blocks dropped (or handed down) to stay within capacity
    dropped: int = 0  # stores refused because too much waited to be written
    corrupt: int = 0  # files whose header, size, tokens or checksum did not match


class KVTier(ABC):
    """Full KV blocks by chained hash, least recently used first. A run of one chain's
    blocks is stored or used tail first, so the chain's head is its most recent block. A
    tier whose blocks are not all in memory reads them ahead: `lookup` queues them,
    `wait_ready` waits, `read_into` names pool blocks to read into, `release` ends that."""

    capacity_bytes: int
    used_bytes: int

    def __init__(self) -> None:
        self.stats = TierStats()
        self.events = BlockEventLog()  # (held?, hash): what the router learns of this tier

    @abstractmethod
    def store(self, block_hash: int, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Offer a block (`kv` is copied); it becomes the most recently used. Never waits."""

    @abstractmethod
    def lookup(self, hashes: Sequence[int]) -> tuple[int, bool]:
        """How many of `hashes`, from the first, this tier holds, and whether all of those
        can be taken now (the others are queued for reading)."""

    @abstractmethod
    def take_ready(self, blocks: Sequence[tuple[int, Sequence[int]]]) -> list[torch.Tensor]:
        """The KV of the leading (hash, token ids) blocks that can be taken now (to be copied
        before the next `store`); the run taken becomes the most recent, tail first."""

    @abstractmethod
    def touch(self, hashes: Sequence[int]) -> None:
        """Make the held ones of a run of one chain's blocks (head first, as in a prompt)
        the most recently used, tail first: the run's head ends up the most recent."""

    @abstractmethod
    def holds(self, block_hash: int) -> bool: ...

    @abstractmethod
    def held_hashes(self) -> list[int]:
        """Every hash this tier holds, least recently used first."""

    @abstractmethod
    def num_blocks(self) -> int: ...

    @abstractmethod
    def check_consistent(self) -> list[str]:
        """What is wrong with this tier's bookkeeping once its work is done (empty:
        nothing)."""

    @abstractmethod
    def close(self) -> None:
        """Finish what is under way (a restart finds it) and stop."""

    # A tier whose every block is in memory is always ready: nothing to wait for or name.
    def wait_ready(self, hashes: Sequence[int], timeout: float) -> None:
        """Wait (at most `timeout` seconds) until none of `hashes` is being read."""
        return None

    def read_into(self, dests: dict[int, torch.Tensor]) -> None:
        """Read the queued blocks among `dests` (hash -> one block's tensor in host memory)
        straight into their tensor. Every call is paired with `release`."""
        return None

    def release(self, hashes: Sequence[int]) -> None:
        """Undo `read_into`: once this returns, no read writes into those tensors."""
        return None

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every block stored is written (tests, shutdown)."""
        return True

    def seconds_per_load(self) -> float | None:
        """Measured seconds to bring one block back into the pool (None before the first)."""
        s = self.stats
        return s.load_seconds / s.loads if s.loads else None

    def record_events(self) -> None:
        self.events.record()

    def drain_events(self) -> list[tuple[bool, int]]:
        return self.events.drain()


class TierStore:
    """The tiers below one pool, fastest first, and the pool's KV tensor (block-major) that
    they copy blocks out of and into."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        prefix_hits: Callable[[Request], list[KVCacheBlock]],
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        # The pool's hits for a request (its block hashes brought up to date first).
        self._prefix_hits = prefix_hits
        self.host: KVTier | None = None  # host memory: the pool's evictions go here first
        self.disk: KVTier | None = None  # this worker's own: evictions below host memory
        self.shared: KVTier | None = None  # shared by workers: every registered block
        self._kv: torch.Tensor | None = None
        self.hit_tokens = 0  # prompt tokens read back from the tiers into the pool

    def attach(
        self,
        kv_cache: torch.Tensor,
        *,
        host: KVTier | None = None,
        disk: KVTier | None = None,
        shared: KVTier | None = None,
    ) -> None:
        """Put the given tiers below the pool whose KV is `kv_cache`."""
        self._kv = kv_cache
        self.host = host or self.host
        self.disk = disk or self.disk
        self.shared = shared or self.shared
        if self.host is not None or self.disk is not None:
            self.pool.on_evict = self.spill

    def __iter__(self) -> Iterator[KVTier]:
        """Fastest first: host memory, the own disk, the shared one."""
        return (t for t in (self.host, self.disk, self.shared) if t is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def close(self) -> None:
        """Close every tier, fastest first (host memory hands its blocks down to the disk)."""
        for tier in self:
            tier.close()

    def spill(self, block: KVCacheBlock) -> None:
        """The pool's hook for a cached block it is about to reuse (its KV still in place)."""
        tier = self.host or self.disk
        assert tier is not None and self._kv is not None
        assert block.block_hash is not None and block.token_ids is not None
        tier.store(block.block_hash, block.token_ids, self._kv[block.block_id])

    def write_through(self, request: Request, start: int, blocks: list[KVCacheBlock]) -> None:
        """Store `blocks`, the request's blocks `start ..` just registered in the pool, in the
        shared tier, and make the chain's blocks before them the most recent there: tail
        first, so the chain's head is the most recent and its tail is evicted first."""
        tier = self.shared
        if tier is None or not blocks:
            return
        assert self._kv is not None
        bs = self.block_size
        for i in reversed(range(start, start + len(blocks))):
            tokens = request.all_token_ids[i * bs : (i + 1) * bs]
            tier.store(request.block_hashes[i], tokens, self._kv[blocks[i - start].block_id])
        tier.touch(request.block_hashes[:start])

    def _candidates(self, request: Request) -> tuple[int, list[int]]:
        """(pool hits, the hashes after them up to the last full prompt block)."""
        start = len(self._prefix_hits(request))
        max_blocks = (request.num_tokens - 1) // self.block_size
        return start, request.block_hashes[start:max_blocks]

    def prefetch(self, request: Request) -> None:
        """Start reading the tiers' blocks of this request's prefix (on arrival, so the
        reads overlap its wait in the queue)."""
        for tier in self:
            tier.lookup(self._candidates(request)[1])

    def load(self, request: Request, wait: bool = False) -> bool:
        """Bring the tiers' blocks of this request's prefix into the pool, fastest tier
        first, again while any of them adds blocks (a prefix can lie partly in host memory,
        partly on disk). False while some are still being read (unless `wait`: then wait
        for them, bounded)."""
        ready = True
        for _ in range(4):
            added = 0
            for tier in self:
                tier_ready, promoted = self._load_from(tier, request, wait)
                ready, added = ready and tier_ready, added + promoted
            if not added or len(self) == 1:
                break
        return ready

    def _load_from(self, tier: KVTier, request: Request, wait: bool) -> tuple[bool, int]:
        """(whether nothing is still being read, blocks promoted) for one tier."""
        deadline = time.monotonic() + TIER_WAIT_S
        promoted = 0
        for _ in range(4):  # a block written to disk meanwhile is read, then looked up again
            start, hashes = self._candidates(request)
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
        self, tier: KVTier, request: Request, start: int, held: int, deadline: float | None
    ) -> int:
        """Bring the tier's blocks `start ..` (`held` of them) into free pool blocks and
        register them; returns how many (fewer when the pool runs out or a block is not
        ready). With a `deadline`, wait until then for the blocks still being read, reading
        the queued ones straight into their pool blocks (a CPU pool)."""
        hits = self._prefix_hits(request)
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
        tier: KVTier,
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
        self.write_through(request, start, blocks[: len(kvs)])
        self.hit_tokens += len(kvs) * self.block_size
        return len(kvs)

    def swap_pays(self, request: Request, prefill_seconds_per_token: float | None) -> bool:
        """Whether a preempted request's KV should be kept (its full blocks spilled to the
        tiers and read back on resume) rather than recomputed: its blocks' measured write and
        read time against its tokens' measured prefill time. True while either is unmeasured
        (a tier read is usually far cheaper than a prefill); False without a tier to spill
        to."""
        tier = self.host or self.disk
        if tier is None:
            return False
        stats = tier.stats
        if not stats.stores or not prefill_seconds_per_token:
            return True
        write = stats.store_seconds / stats.stores
        read = tier.seconds_per_load() or write
        blocks = request.num_computed_tokens // self.block_size
        return blocks * (write + read) < request.num_computed_tokens * prefill_seconds_per_token
