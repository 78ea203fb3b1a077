"""The tiers below the KV pool, driven by the tier store (`common/kv_tiers.py`): the KV
manager spills evicted blocks and reads them back as prefix hits without leaking a block,
an idle engine reads them straight into pool blocks, host memory hands its least recently
used block down to the disk, a prefix split between tiers comes back whole, the store keeps
its tiers fastest first and closes them in that order, and keeping a preempted request's KV
needs a tier that takes evicted blocks. Each tier (disk, host, shared) evicts a request's
chain tail first, after a spill, a read-back or a write-through. The block-event log keeps
changes only while recording and loses none drained while another thread adds."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.common.block_events import BlockEventLog
from pdserve.common.block_hashing import block_hashes
from pdserve.common.kv_cache_manager import KVCacheManager
from pdserve.common.kv_host_tier import HostTier
from pdserve.common.kv_offload import HEADER, LOADING, DiskTier
from pdserve.common.request import Request
from pdserve.common.sampling_params import SamplingParams

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, kv heads, head dim
BS = SHAPE[2]
LAYOUT = "test/float32/block=4"


def _tier(root, blocks: int = 16, **kw) -> DiskTier:
    """A disk tier with room for `blocks` blocks."""
    file_bytes = HEADER.size + 4 * BS + torch.empty(SHAPE).nbytes
    return DiskTier(root, blocks * file_bytes, LAYOUT, SHAPE, torch.float32, **kw)


def _kv(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _read(tier: DiskTier, h: int, tokens) -> torch.Tensor | None:
    """Take a block, waiting for its read."""
    held, _ = tier.lookup([h])
    if held:
        tier.wait_ready([h], 10)
    out = tier.take(h, tokens)
    assert out is not LOADING
    return out  # type: ignore[return-value]


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams())


def _prefill(kv: KVCacheManager, cache: torch.Tensor, request: Request) -> int:
    """Admit and compute a request's prompt (its KV: a function of token and position) the
    way the scheduler does; free it. Returns the prefix-hit tokens."""
    assert kv.load_from_tier(request, wait=True)
    cached = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens - len(cached) * BS, cached)
    for i, block in enumerate(request.blocks[len(cached) :], start=len(cached)):
        tokens = request.all_token_ids[i * BS : (i + 1) * BS]
        cache[block.block_id] = float(sum(tokens) + 1000 * i)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    for i, block in enumerate(request.blocks[: request.num_tokens // BS]):
        tokens = request.all_token_ids[i * BS : (i + 1) * BS]
        assert torch.all(cache[block.block_id] == float(sum(tokens) + 1000 * i)), i
    kv.free(request)
    return len(cached) * BS


def test_manager_spills_evicted_blocks_and_reads_them_back(tmp_path):
    cache = torch.zeros((6, *SHAPE))
    kv = KVCacheManager(6, BS)
    kv.attach_tiers(cache, disk=_tier(tmp_path))
    a = list(range(100, 121))  # 5 full blocks and a token
    b = list(range(500, 521))
    assert _prefill(kv, cache, _request("a1", a)) == 0
    assert _prefill(kv, cache, _request("b1", b)) == 0  # evicts a's blocks: spilled
    assert kv.tiers.disk is not None and kv.tiers.disk.stats.dropped == 0
    assert _prefill(kv, cache, _request("a2", a)) == 20  # all of a's full blocks, from disk
    assert kv.tiers.hit_tokens > 0
    assert _prefill(kv, cache, _request("b2", b)) == 20
    assert kv.num_free_blocks == 6
    kv.tiers.close()


def test_waiting_engine_reads_blocks_straight_into_the_pool(tmp_path):
    cache = torch.zeros((6, *SHAPE))
    kv = KVCacheManager(6, BS)
    tier = _tier(tmp_path)
    kv.attach_tiers(cache, disk=tier)
    a, b = list(range(100, 121)), list(range(500, 521))
    _prefill(kv, cache, _request("a1", a))
    _prefill(kv, cache, _request("b1", b))
    assert tier.flush()  # a's blocks are on disk only: reads, not pending copies
    # Block 2 of a's chain is corrupt: blocks 0-1 are read into the pool, the rest computed.
    chain = block_hashes(a, BS)
    bad = tier.folder / f"{chain[2]:016x}.kvb"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    # Reads wait until the manager has named the pool blocks (else the I/O thread may start
    # one into a tensor of its own first: correct, only not what this test is about).
    named, read, read_into = threading.Event(), tier._read, tier.read_into
    tier._read = lambda h: (named.wait(10), read(h))[1]  # type: ignore[method-assign]
    tier.read_into = lambda dests: (read_into(dests), named.set())[0]  # type: ignore[method-assign]
    assert _prefill(kv, cache, _request("a2", a)) == 2 * BS  # contents checked there
    # Every well-formed block was read into the pool; those past the corrupt one go unused.
    assert tier.stats.hits == 2 and tier.stats.corrupt == 1
    assert tier.stats.loads == tier.stats.loads_into_pool == 4
    assert kv.num_free_blocks == 6 and tier.check_consistent() == []
    tier.close()


def test_host_tier_hands_its_least_recently_used_block_down(tmp_path):
    """Host memory above the disk: when its slots are full, the least recently used block
    moves down to the disk tier before the slot is reused; both serve it back exactly."""
    disk = _tier(tmp_path)
    host = HostTier(2 * torch.empty(SHAPE).nbytes, SHAPE, torch.float32, pin=False,
                    below=disk.store)  # fmt: skip
    host.record_events()
    for h in (1, 2):
        host.store(h, [h] * 4, _kv(h))
    assert host.lookup([1, 2, 3]) == (2, True)
    assert torch.equal(host.take_ready([(1, [1] * 4)])[0], _kv(1))  # 1 is now the newest
    host.store(3, [3] * 4, _kv(3))  # full: 2 goes down
    assert host.lookup([2]) == (0, True) and disk.flush() and disk.holds(2)
    assert torch.equal(_read(disk, 2, [2] * 4), _kv(2))
    assert host.take_ready([(3, [0] * 4)]) == []  # other tokens: a miss
    assert host.drain_events() == [(True, 1), (True, 2), (False, 2), (True, 3)]
    host.close()  # what host memory held goes down to the disk tier
    assert disk.flush() and disk.holds(1) and disk.holds(3)
    disk.close()


# ---- eviction by LRU on the hash chain: a conversation's tail goes first ---------------
# Each test takes one request's real chain (block i's hash chains blocks 0..i), lets the KV
# manager spill, read back or write through its blocks, then stores unrelated blocks into
# the tier until some of the chain must go: what is left must be the chain's head (a block
# whose predecessor is gone can never be a prefix hit again).

CHAIN = list(range(700, 721))  # 5 full blocks and a token
OTHER = list(range(900, 921))


def _tiered(tmp_path, kind: str, blocks: int) -> tuple[KVCacheManager, torch.Tensor]:
    """A 6-block pool over a `kind` tier ("disk", "host" or "shared") of `blocks` blocks."""
    cache = torch.zeros((6, *SHAPE))
    kv = KVCacheManager(6, BS)
    if kind == "host":
        kv.attach_tiers(cache, host=HostTier(blocks * cache[0].nbytes, SHAPE, cache.dtype, False))
    elif kind == "disk":
        kv.attach_tiers(cache, disk=_tier(tmp_path, blocks=blocks))
    else:
        kv.attach_tiers(cache, shared=_tier(tmp_path, blocks=blocks, shared=True))
    return kv, cache


def _press(tier, n: int) -> None:
    """Store `n` unrelated blocks, each then the most recently used."""
    for h in range(1, n + 1):
        tier.store(h, [h] * BS, _kv(h))
    assert tier.flush()


def _chain_held(tier, tokens: list[int]) -> list[int]:
    """The positions of the chain's blocks the tier still holds."""
    return [i for i, h in enumerate(block_hashes(tokens, BS)) if tier.holds(h)]


@pytest.mark.parametrize("kind", ["disk", "host"])
def test_first_spill_keeps_the_chains_head(tmp_path, kind):
    """The pool evicts a finished request's blocks tail first, and the tier stores them in
    that order: under pressure the tail goes first, the head stays a prefix hit."""
    kv, cache = _tiered(tmp_path, kind, blocks=8)
    _prefill(kv, cache, _request("a1", CHAIN))
    _prefill(kv, cache, _request("b1", OTHER))  # evicts the chain's 5 full blocks: spilled
    [tier] = kv.tiers
    assert _chain_held(tier, CHAIN) == [0, 1, 2, 3, 4]
    _press(tier, 5)  # 10 blocks for 8 places: two of the chain's go
    assert _chain_held(tier, CHAIN) == [0, 1, 2]  # still a 3-block prefix hit
    assert tier.check_consistent() == []
    tier.close()


@pytest.mark.parametrize("kind", ["disk", "host"])
def test_read_back_makes_the_chains_head_the_most_recent(tmp_path, kind):
    """A chain read back from the tier becomes its most recently used run, head last: later
    pressure takes the blocks spilled meanwhile, then the chain's tail, never its head."""
    kv, cache = _tiered(tmp_path, kind, blocks=10)
    _prefill(kv, cache, _request("a1", CHAIN))
    _prefill(kv, cache, _request("b1", OTHER))  # the chain spilled
    # Read back: the pool's 5 blocks for it spill OTHER's blocks 4..1 first; OTHER's block 0
    # goes last, for the prompt's last token.
    assert _prefill(kv, cache, _request("a2", CHAIN)) == 20
    [tier] = kv.tiers
    assert tier.stats.hits == 5
    assert _chain_held(tier, OTHER) == _chain_held(tier, CHAIN) == [0, 1, 2, 3, 4]
    _press(tier, 6)  # 16 blocks for 10 places: OTHER's 4..1, then the chain's 4 and 3
    assert _chain_held(tier, OTHER) == [0]
    assert _chain_held(tier, CHAIN) == [0, 1, 2]
    assert tier.check_consistent() == []
    tier.close()


def test_shared_write_through_keeps_the_chains_head(tmp_path):
    """The shared tier gets every block as the prefix cache registers it, in chunks (a
    chunked prefill, then decode): each chunk is written tail first and the chain before it
    made more recent still, so the whole chain is ordered tail (oldest) to head."""
    kv, _ = _tiered(tmp_path, "shared", blocks=8)
    request = _request("a1", CHAIN)
    assert kv.allocate_slots(request, len(CHAIN))
    for computed in (8, 12, 21):  # blocks 0-1, then 2, then 3-4
        request.num_computed_tokens = computed
        kv.cache_full_blocks(request)
    kv.free(request)
    tier = kv.tiers.shared
    assert tier is not None and tier.flush()
    assert _chain_held(tier, CHAIN) == [0, 1, 2, 3, 4]
    _press(tier, 5)
    assert _chain_held(tier, CHAIN) == [0, 1, 2]
    assert tier.check_consistent() == []
    tier.close()


# ---- the store: its tiers in order -----------------------------------------------------


def test_store_keeps_its_tiers_fastest_first_and_closes_them_in_that_order(tmp_path):
    """However the tiers are attached, the store holds host memory, then the own disk, then
    the shared folder. Closing it closes host memory first, so the blocks it hands down are
    written before the disk tier stops."""
    cache = torch.zeros((6, *SHAPE))
    kv = KVCacheManager(6, BS)
    disk, shared = _tier(tmp_path / "disk"), _tier(tmp_path / "shared", shared=True)
    host = HostTier(2 * cache[0].nbytes, SHAPE, cache.dtype, pin=False, below=disk.store)
    kv.attach_tiers(cache, shared=shared)
    kv.attach_tiers(cache, host=host, disk=disk)
    assert list(kv.tiers) == [host, disk, shared] and len(kv.tiers) == 3
    host.store(1, [1] * BS, _kv(1))
    kv.tiers.close()
    assert not host.holds(1) and disk.holds(1)
    assert (disk.folder / f"{1:016x}.kvb").exists()  # written before the disk tier stopped
    assert disk.check_consistent() == []


def test_a_prefix_split_between_host_memory_and_disk_comes_back_whole(tmp_path):
    """Host memory for 2 blocks above a disk: a spilled chain's head stays in host memory,
    its tail goes down to the disk. Reading it back takes the head from host memory and the
    rest from the disk: the whole prefix is a hit, its KV the KV computed."""
    cache = torch.zeros((6, *SHAPE))
    kv = KVCacheManager(6, BS)
    disk = _tier(tmp_path)
    host = HostTier(2 * cache[0].nbytes, SHAPE, cache.dtype, pin=False, below=disk.store)
    kv.attach_tiers(cache, host=host, disk=disk)
    _prefill(kv, cache, _request("a1", CHAIN))
    _prefill(kv, cache, _request("b1", OTHER))  # spills the chain tail first
    assert _chain_held(host, CHAIN) == [0, 1] and _chain_held(disk, CHAIN) == [2, 3, 4]
    assert _prefill(kv, cache, _request("a2", CHAIN)) == 5 * BS  # contents checked there
    assert host.stats.hits > 0 and disk.stats.hits > 0
    assert host.stats.hits + disk.stats.hits == 5 and kv.tiers.hit_tokens == 5 * BS
    assert kv.num_free_blocks == 6
    kv.tiers.close()
    assert [t.check_consistent() for t in kv.tiers] == [[], []]


def test_without_prefix_caching_no_tier_is_attached(tmp_path):
    """A tier holds prefix-cache blocks: without prefix caching the pool never spills."""
    cache = torch.zeros((6, *SHAPE))
    kv = KVCacheManager(6, BS, enable_prefix_caching=False)
    tier = _tier(tmp_path)
    kv.attach_tiers(cache, disk=tier)
    assert len(kv.tiers) == 0 and kv.pool.on_evict is None
    assert _prefill(kv, cache, _request("a1", CHAIN)) == 0
    assert _prefill(kv, cache, _request("b1", OTHER)) == 0
    assert _prefill(kv, cache, _request("a2", CHAIN)) == 0
    assert tier.flush() and tier.num_blocks() == 0 and tier.stats.stores == 0
    tier.close()


def test_keeping_a_preempted_requests_kv_needs_a_tier_that_takes_evicted_blocks(tmp_path):
    """Without a tier, or with only the shared one (it takes registered blocks, not evicted
    ones), a preempted request is recomputed; with a disk tier its KV is kept while the
    costs are unmeasured."""
    cache = torch.zeros((6, *SHAPE))
    kv = KVCacheManager(6, BS)
    request = _request("a", CHAIN)
    request.num_computed_tokens = 5 * BS
    assert not kv.swap_pays(request)
    kv.attach_tiers(cache, shared=_tier(tmp_path / "shared", shared=True))
    assert not kv.swap_pays(request)
    kv.attach_tiers(cache, disk=_tier(tmp_path / "disk"))
    assert kv.swap_pays(request)
    kv.tiers.close()


# ---- the block-event log ---------------------------------------------------------------


def test_event_log_keeps_changes_only_while_recording_in_order():
    log = BlockEventLog()
    log.add(True, 1)
    assert log.drain() == []  # not recording yet
    log.record()
    log.add(True, 2)
    log.add(False, 2)
    log.record()  # already recording: what is logged stays
    assert log.drain() == [(True, 2), (False, 2)]
    assert log.drain() == []


def test_event_log_loses_nothing_drained_while_another_thread_adds():
    """A disk tier's I/O thread logs its evictions while the engine thread drains."""
    log = BlockEventLog()
    log.record()
    n = 20_000
    adder = threading.Thread(target=lambda: [log.add(h % 3 == 0, h) for h in range(n)])
    adder.start()
    drained: list[tuple[bool, int]] = []
    while adder.is_alive():
        drained += log.drain()
    adder.join()
    drained += log.drain()
    assert drained == [(h % 3 == 0, h) for h in range(n)]
