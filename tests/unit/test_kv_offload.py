"""The disk tier below the KV pool: blocks round-trip bit-exactly (float32 and bfloat16),
least recently used blocks are deleted first, a corrupt or truncated file is a miss (never
wrong KV), the index is recovered at restart (and only for the same layout), stores never
wait for the disk, a block is ordered by when it is stored, not written, a shared folder
serves what another worker wrote, and the tiers' consistency checks can fail. The tiers
driven by the KV manager: `test_kv_tiers.py`."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.common.kv_offload import HEADER, LOADING, DiskTier

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, kv heads, head dim
LAYOUT = "test/float32/block=4"


def _tier(root, dtype=torch.float32, blocks: float = 16, layout=LAYOUT, **kw) -> DiskTier:
    return DiskTier(root, int(blocks * _file_bytes(dtype)), layout, SHAPE, dtype, **kw)


def _file_bytes(dtype=torch.float32) -> int:
    return HEADER.size + 4 * SHAPE[2] + torch.empty(SHAPE, dtype=dtype).nbytes


def _kv(seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _read(tier: DiskTier, h: int, tokens) -> torch.Tensor | None:
    """Take a block, waiting for its read."""
    held, _ = tier.lookup([h])
    if held:
        tier.wait_ready([h], 10)
    out = tier.take(h, tokens)
    assert out is not LOADING
    return out  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_bit_exact(tmp_path, dtype):
    tier = _tier(tmp_path, dtype)
    blocks = {h: (_kv(h, dtype), [h, h + 1, h + 2, h + 3]) for h in (1, 2, 3)}
    for h, (kv, tokens) in blocks.items():
        tier.store(h, tokens, kv)
    assert tier.flush()
    assert tier.stats.stores == 3 and len(list(tier.folder.glob("*.kvb"))) == 3
    for h, (kv, tokens) in blocks.items():
        assert tier.take(h, tokens) is LOADING  # on disk, not read yet: queued now
        tier.wait_ready([h], 10)
        out = tier.take(h, tokens)
        assert out.dtype == dtype and torch.equal(out, kv)
    assert tier.stats.loads == 3
    assert _read(tier, 1, [0, 0, 0, 0]) is None  # same hash, other tokens: a miss
    assert _read(tier, 99, [1, 2, 3, 4]) is None
    tier.close()


def test_least_recently_used_block_goes_first(tmp_path):
    tier = _tier(tmp_path, blocks=3)
    for h in (1, 2, 3):
        tier.store(h, [h] * 4, _kv(h))
        assert tier.flush()
    assert _read(tier, 1, [1] * 4) is not None  # a hit makes 1 the most recent
    tier.store(4, [4] * 4, _kv(4))
    assert tier.flush()
    assert tier.lookup([2]) == (0, True)  # 2 was the least recently used
    assert [tier.lookup([h])[0] for h in (1, 3, 4)] == [1, 1, 1]
    assert tier.stats.evictions == 1 and tier.used_bytes <= tier.capacity_bytes
    assert sorted(p.name for p in tier.folder.glob("*.kvb")) == [f"{h:016x}.kvb" for h in (1, 3, 4)]
    tier.close()


def test_corrupt_or_truncated_block_is_a_miss(tmp_path):
    tier = _tier(tmp_path)
    tier.store(1, [1] * 4, _kv(1))
    tier.store(2, [2] * 4, _kv(2))
    assert tier.flush()
    path = tier.folder / f"{1:016x}.kvb"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one bit of the payload
    path.write_bytes(bytes(data))
    assert _read(tier, 1, [1] * 4) is None
    assert tier.stats.corrupt == 1 and not path.exists() and tier.lookup([1]) == (0, True)
    short = tier.folder / f"{2:016x}.kvb"
    short.write_bytes(short.read_bytes()[:-7])
    assert _read(tier, 2, [2] * 4) is None and tier.stats.corrupt == 2
    tier.close()


def test_index_recovered_at_restart_for_the_same_layout_only(tmp_path):
    tier = _tier(tmp_path, blocks=3)
    for h in (1, 2, 3):
        tier.store(h, [h] * 4, _kv(h))
        assert tier.flush()
    tier.close()
    (tier.folder / f"{3:016x}.kvb").write_bytes(b"PDKVB1")  # a torn file
    (tier.folder / ".0000000000000009.123.tmp").write_bytes(b"x")  # a write cut short
    again = _tier(tmp_path, blocks=3)
    assert again.num_blocks() == 2 and again.used_bytes == 2 * _file_bytes()
    assert torch.equal(_read(again, 2, [2] * 4), _kv(2))
    assert not list(again.folder.glob("*.tmp"))
    # The oldest recovered block is the least recently used: it goes first.
    again.store(4, [4] * 4, _kv(4))
    again.store(5, [5] * 4, _kv(5))
    assert again.flush()
    assert again.lookup([1]) == (0, True) and again.lookup([2])[0] == 1
    again.close()
    other = _tier(tmp_path, layout="test/bfloat16/block=4")
    assert other.num_blocks() == 0 and other.folder != again.folder
    other.close()


def test_store_never_waits_for_the_disk(tmp_path):
    tier = _tier(tmp_path, max_pending_bytes=3 * torch.empty(SHAPE).nbytes)
    disk = threading.Event()
    write = tier._write
    tier._write = lambda h: (disk.wait(), write(h))  # type: ignore[method-assign]
    stored = threading.Event()

    def store_all() -> None:
        for h in range(1, 6):
            tier.store(h, [h] * 4, _kv(h))
        stored.set()

    threading.Thread(target=store_all, daemon=True).start()
    assert stored.wait(30), "store waited for a stalled disk"
    assert tier.stats.dropped == 2  # three fit in the pending budget
    assert torch.equal(tier.take(2, [2] * 4), _kv(2))  # a pending block serves hits
    disk.set()
    assert tier.flush()
    assert tier.stats.stores == 3
    tier.close()


def test_released_pool_block_is_never_written_or_handed_out(tmp_path):
    tier = _tier(tmp_path)
    tier.store(1, [1] * 4, _kv(1))
    tier.store(2, [2] * 4, _kv(2))
    assert tier.flush()
    reading, go = threading.Event(), threading.Event()
    read_file = tier._read_file

    def slow_read(path, block_hash, into=None):
        reading.set()
        assert go.wait(10)
        return read_file(path, block_hash, into)

    tier._read_file = slow_read  # type: ignore[method-assign]
    dests = {1: torch.zeros(SHAPE), 2: torch.zeros(SHAPE)}
    with tier._lock:  # queue both reads and name their tensors before the thread starts
        assert tier.lookup([1, 2]) == (2, False)
        tier.read_into(dests)
    assert reading.wait(10)  # block 1 is being read into its tensor, block 2 waits
    tier.release([2])  # not started: forgotten at once, read into a tensor of its own
    released = threading.Thread(target=tier.release, args=([1],))
    released.start()
    released.join(0.2)
    assert released.is_alive()  # waits for the read in flight into a tensor it names
    go.set()
    released.join(10)
    assert not released.is_alive()
    assert torch.equal(dests[1], _kv(1)) and torch.equal(dests[2], torch.zeros(SHAPE))
    tier.wait_ready([1, 2], 10)
    assert tier.take(1, [1] * 4) is LOADING  # read into a released tensor: not handed out
    got = _read(tier, 2, [2] * 4)
    assert got is not None and torch.equal(got, _kv(2)) and got is not dests[2]
    assert tier.stats.loads_into_pool == 1
    assert _read(tier, 1, [1] * 4) is not None
    tier.close()


def test_tier_reports_what_it_starts_and_stops_holding(tmp_path):
    tier = _tier(tmp_path, blocks=2)
    tier.record_events()
    for h in (1, 2, 3):
        tier.store(h, [h] * 4, _kv(h))
        assert tier.flush()
    assert tier.drain_events() == [(True, 1), (True, 2), (True, 3), (False, 1)]
    assert tier.drain_events() == []
    assert sorted(tier.held_hashes()) == [2, 3]
    tier.close()


def test_shared_tier_reads_what_another_worker_wrote(tmp_path):
    """Two tiers on one shared folder: a block one writes is found by the other (not in
    its index yet), and a block one deletes is a plain miss for the other, not corruption."""
    writer = _tier(tmp_path, shared=True, blocks=2)
    reader = _tier(tmp_path, shared=True)
    writer.store(1, [1] * 4, _kv(1))
    assert writer.flush()
    assert reader.num_blocks() == 0
    assert torch.equal(_read(reader, 1, [1] * 4), _kv(1))
    reader.store(1, [1] * 4, _kv(1))  # already there: not written again
    assert reader.flush() and reader.stats.stores == 0
    for h in (2, 3):  # the writer's budget is 2 blocks: block 1 goes
        writer.store(h, [h] * 4, _kv(h))
        assert writer.flush()
    assert writer.stats.evictions == 1
    assert _read(reader, 1, [1] * 4) is None and reader.stats.corrupt == 0
    writer.close()
    reader.close()


def test_disk_order_is_the_order_blocks_are_stored_not_written(tmp_path):
    """A block used again while it still waits to be written becomes the most recent then,
    not when the disk gets to it: the block stored after it goes first."""
    tier = _tier(tmp_path, blocks=2)
    disk = threading.Event()
    write = tier._write
    tier._write = lambda h: (disk.wait(), write(h))  # type: ignore[method-assign]
    tier.store(1, [1] * 4, _kv(1))
    tier.store(2, [2] * 4, _kv(2))
    tier.store(1, [1] * 4, _kv(1))  # used again, still pending
    disk.set()
    assert tier.flush()
    tier.store(3, [3] * 4, _kv(3))
    assert tier.flush()
    assert [tier.holds(h) for h in (1, 2, 3)] == [True, False, True]
    assert tier.check_consistent() == []
    tier.close()


def test_consistency_check_reports_what_is_off(tmp_path):
    """The tiers' bookkeeping checks can fail: a file gone behind the index, a block read
    and never taken, a host slot counted twice."""
    from pdserve.common.kv_host_tier import HostTier

    tier = _tier(tmp_path)
    for h in (1, 2):
        tier.store(h, [h] * 4, _kv(h))
    assert tier.check_consistent() == []
    (tier.folder / f"{1:016x}.kvb").unlink()
    assert any("not on disk" in p for p in tier.check_consistent())
    tier.lookup([2])
    tier.wait_ready([2], 10)
    assert any("not taken" in p for p in tier.check_consistent())
    tier.close()
    host = HostTier(2 * torch.empty(SHAPE).nbytes, SHAPE, torch.float32, pin=False)
    host.store(1, [1] * 4, _kv(1))
    assert host.check_consistent() == []
    host._free.append(host._held[1][0])
    assert host.check_consistent() != []
