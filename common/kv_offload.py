"""The disk tier of the KV cache (a `KVTier`, see `common/kv_tiers.py`): full prefix blocks
the pool evicts are written here instead of vanishing, and a later request whose prefix
misses the pool but hits this tier has them read back into pool blocks before it is
scheduled.

A block is one file, `<hash as 16 hex digits>.kvb`, under a folder named by a digest of the
worker's KV layout fingerprint (so a tier only ever serves blocks of its own layout): a
header (magic, the chained block hash, the payload's XXH3-64 checksum, the block's token
ids) and then the block's raw KV bytes, read straight into the tensor that holds them.
Files are written to a temporary name and renamed, so a crash leaves either a whole block or
none; a block whose checksum, size or tokens do not match is a miss (and deleted), never
wrong KV. The index (hash → bytes, least recently used first) is rebuilt from the folder at
start, oldest file first.

The index holds a block from the moment it is stored, before it is written: its place in
the least-recently-used order is decided on the engine thread, in the order blocks are
stored and used, not in the order the disk gets to them. A run of one chain's blocks is
stored or used tail first (`touch`), so its head is the most recent and a conversation's
tail is evicted before its head (a block whose predecessor is gone is unreachable). A block
evicted before it is written is simply never written.

All disk work runs on one I/O thread, reads before writes. The engine thread only copies a
block out (`store`: the copy waits in memory until written, and serves hits meanwhile) or
takes one that was read (`take`); neither ever waits for the disk. When more than
`max_pending_bytes` wait to be written, further stores are dropped (counted).

A block is read ahead into a tensor of its own, to be copied into a pool block when its
request is admitted. An engine that has nothing else to run waits for the reads instead:
it hands the tier the pool blocks the queued ones will fill (`read_into`), and the file is
read straight into them, saving that copy (a CPU pool: it is ordinary memory)."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import struct
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import islice
from pathlib import Path

import torch

from pdserve.common.kv_tiers import KVTier

Block = tuple[tuple[int, ...], torch.Tensor]  # token ids, KV

logger = logging.getLogger(__name__)

MAGIC = b"PDKVB2\0\0"
# magic, block hash, payload XXH3-64, payload bytes, token count; then the token ids (u32).
HEADER = struct.Struct("<8sQQQI")
SUFFIX = ".kvb"
LOADING = object()  # `take`: the block is being read; ask again later
STALE_TMP_S = 600.0  # a shared folder's temporary file older than this is a dead write
READ_AHEAD = 8  # queued reads whose files the kernel is asked to start reading


# Tiers still open at exit finish their writes first (an I/O thread cut off inside torch at
# interpreter teardown aborts the process).
_open_tiers: weakref.WeakSet[DiskTier] = weakref.WeakSet()


@atexit.register
def _close_open_tiers() -> None:
    for tier in list(_open_tiers):
        tier.close()


def checksum(payload: object) -> int:
    import xxhash  # only a worker with a tier needs it

    return xxhash.xxh3_64_intdigest(payload)


def layout_folder(root: Path, fingerprint: str) -> Path:
    return root / hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


class DiskTier(KVTier):
    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int,
        fingerprint: str,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        max_pending_bytes: int = 256 * 2**20,
        shared: bool = False,
    ) -> None:
        super().__init__()
        # A shared tier's folder is written by other workers too: a block missing from the
        # index is looked for on disk, and a block gone from disk is a miss, not corruption.
        self.shared = shared
        self.folder = layout_folder(Path(root), fingerprint)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "LAYOUT").write_text(fingerprint + "\n")
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = torch.empty(self.block_shape, dtype=dtype).nbytes
        self.capacity_bytes = capacity_bytes
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Condition()
        # Every block held (on disk or to be written): hash -> file bytes, least recently
        # used first.
        self._index: OrderedDict[int, int] = OrderedDict()
        self._pending: dict[int, Block] = {}  # to be written (also in the index)
        # Read back (or kept after writing) for a request, until it takes them; None: being
        # read. At most `max_pending_bytes` of them: the oldest untaken go first.
        self._loaded: OrderedDict[int, Block | None] = OrderedDict()
        self._wanted: set[int] = set()  # pending blocks a request looked up: keep once written
        # Queued reads to do straight into these (pool blocks; `read_into`), and the one the
        # I/O thread is reading now.
        self._dests: dict[int, torch.Tensor] = {}
        self._reading: int | None = None
        self._hinted: set[int] = set()  # queued reads the kernel was told of (I/O thread)
        self._read_done: dict[int, threading.Event] = {}  # set when that block's read ends
        self._reads: deque[int] = deque()
        self._writes: deque[int] = deque()
        self._stopped = False
        self.used_bytes = 0
        self._recover()
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-offload", daemon=True)
        self._thread.start()
        _open_tiers.add(self)

    # ---- the engine thread ---------------------------------------------------------------

    def store(self, block_hash: int, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Offer a block: `kv` is copied now and written later; it becomes the most
        recently used block (store a chain's blocks tail first). Never waits."""
        with self._lock:
            if block_hash in self._index or self._discover(block_hash):
                self._index.move_to_end(block_hash)  # held already: now the most recent
                return
            if (len(self._pending) + 1) * self.block_bytes > self.max_pending_bytes:
                self.stats.dropped += 1
                return
            copy = torch.empty(self.block_shape, dtype=self.dtype)
            copy.copy_(kv)
            self._pending[block_hash] = (tuple(token_ids), copy)
            self._index[block_hash] = HEADER.size + 4 * len(token_ids) + self.block_bytes
            self.used_bytes += self._index[block_hash]
            self._writes.append(block_hash)
            self.events.add(True, block_hash)
            self._lock.notify()

    def touch(self, hashes: Sequence[int]) -> None:
        with self._lock:
            for h in reversed(hashes):
                if h in self._index:
                    self._index.move_to_end(h)

    def holds(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def held_hashes(self) -> list[int]:
        """Every hash this tier holds (on disk or being written), least recently used first."""
        with self._lock:
            return list(self._index)

    def lookup(self, hashes: Sequence[int]) -> tuple[int, bool]:
        """How many of `hashes`, from the first, this tier holds, and whether all of those
        can be taken now. Blocks on disk that are not read yet are queued for reading."""
        held, ready = 0, True
        with self._lock:
            for h in hashes:
                if h in self._pending:
                    self._wanted.add(h)
                elif self._loaded.get(h) is not None:
                    pass
                elif h in self._loaded:  # being read
                    ready = False
                elif h in self._index or self._discover(h):
                    self._loaded[h] = None
                    self._reads.append(h)
                    ready = False
                else:
                    break
                held += 1
            if not ready:
                self._lock.notify()
        return held, ready

    def wait_ready(self, hashes: Sequence[int], timeout: float) -> None:
        """Wait (at most `timeout` seconds) until none of `hashes` is being read."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                reading = [h for h in hashes if h in self._loaded and self._loaded[h] is None]
                if not reading or self._stopped:
                    return
                # Woken when the last of them is read (reads finish in the order they were
                # queued), not at every block: a wake-up per block costs as much as its read.
                done = self._read_done.setdefault(reading[-1], threading.Event())
            left = deadline - time.monotonic()
            if left <= 0:
                return
            done.wait(left)

    def read_into(self, dests: dict[int, torch.Tensor]) -> None:
        """Read the blocks among `dests` (hash -> a contiguous tensor of one block, in host
        memory) that are queued and not started straight into their tensor; `take` then
        hands that tensor back. Every call is paired with `release`."""
        with self._lock:
            for h, dest in dests.items():
                if h in self._loaded and self._loaded[h] is None and h != self._reading:
                    self._dests[h] = dest

    def release(self, hashes: Sequence[int]) -> None:
        """Undo `read_into` for `hashes`: once this returns, no read writes into their
        tensors (a read in flight is waited for) and none of them is handed out."""
        wanted = set(hashes)
        with self._lock:
            while self._reading in wanted and self._reading in self._dests:
                self._lock.wait()
            for h in wanted:
                dest = self._dests.pop(h, None)
                loaded = self._loaded.get(h)
                if dest is not None and loaded is not None and loaded[1] is dest:
                    del self._loaded[h]  # read, not taken: it is still on disk

    def take(self, block_hash: int, token_ids: Sequence[int]) -> torch.Tensor | object | None:
        """The block's KV if this tier holds it with these tokens (a tensor to read, not
        write), `LOADING` while it is being read, else None (a miss). A block on disk that
        was not prefetched is queued for reading and reported `LOADING`."""
        with self._lock:
            kv = self._take(block_hash, tuple(token_ids))
            if isinstance(kv, torch.Tensor):
                self.touch([block_hash])
            return kv

    def take_ready(self, blocks: Sequence[tuple[int, Sequence[int]]]) -> list[torch.Tensor]:
        """The KV of the leading (hash, token ids) blocks that can be taken now, at once (a
        block cannot go from pending to being read halfway through). The run taken becomes
        the most recently used, tail first."""
        out: list[torch.Tensor] = []
        with self._lock:
            for block_hash, token_ids in blocks:
                kv = self._take(block_hash, tuple(token_ids))
                if not isinstance(kv, torch.Tensor):
                    break
                out.append(kv)
            self.touch([h for h, _ in blocks[: len(out)]])
        return out

    def _take(self, block_hash: int, tokens: tuple[int, ...]) -> torch.Tensor | object | None:
        pending = self._pending.get(block_hash)
        if pending is not None:
            self._wanted.discard(block_hash)
            if pending[0] != tokens:
                return None
            self.stats.hits += 1
            return pending[1]  # never written after `store` made it: no copy needed
        if block_hash in self._loaded:
            loaded = self._loaded[block_hash]
            if loaded is None:
                return LOADING
            del self._loaded[block_hash]
            if loaded[0] != tokens:
                return None
            self.stats.hits += 1
            return loaded[1]
        if block_hash in self._index or self._discover(block_hash):
            self._loaded[block_hash] = None
            self._reads.append(block_hash)
            self._lock.notify()
            return LOADING
        return None

    def _discover(self, block_hash: int) -> bool:
        """Shared tier: index a block another worker wrote (under the lock)."""
        if not self.shared:
            return False
        try:
            size = self._path(block_hash).stat().st_size
        except OSError:
            return False
        self._index[block_hash] = size
        self.used_bytes += size
        return True

    def num_blocks(self) -> int:
        with self._lock:
            return len(self._index)

    def check_consistent(self) -> list[str]:
        """What is wrong with this tier's bookkeeping once its work is done (empty: nothing):
        blocks still to be written, read but never taken, or looked up and never taken; an
        index that differs from the files on disk (a shared folder may hold more, written by
        other workers); used bytes that are not the index's sum, or past the capacity."""
        self.flush()
        problems = []
        with self._lock:
            if self._pending:
                problems.append(f"{len(self._pending)} blocks still to be written")
            if self._loaded:
                problems.append(f"{len(self._loaded)} blocks read (or being read), not taken")
            if self._wanted:
                problems.append(f"{len(self._wanted)} blocks looked up, never taken")
            index = dict(self._index)
            if self.used_bytes != sum(index.values()):
                problems.append(
                    f"used {self.used_bytes} B, the index holds {sum(index.values())} B"
                )
            if self.used_bytes > self.capacity_bytes:
                problems.append(f"used {self.used_bytes} B of {self.capacity_bytes} B")
        files = {int(p.stem, 16): p.stat().st_size for p in self.folder.glob(f"*{SUFFIX}")}
        if self.shared:
            files = {h: size for h, size in files.items() if h in index}
        if files != index:
            missing, extra = index.keys() - files.keys(), files.keys() - index.keys()
            wrong = sum(files[h] != index[h] for h in files.keys() & index.keys())
            problems.append(
                f"index vs disk: {len(missing)} not on disk, {len(extra)} not in the index, "
                f"{wrong} of another size"
            )
        return problems

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every pending block is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.05))
            return not self._pending

    def close(self) -> None:
        _open_tiers.discard(self)
        if self._stopped:
            return
        self.flush(timeout=10.0)
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
            for done in self._read_done.values():
                done.set()
        self._thread.join(timeout=10.0)

    # ---- the I/O thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._reads and not self._writes and not self._stopped:
                    self._lock.wait()
                if self._stopped:
                    return
                if self._reads:
                    job, h = "read", self._reads.popleft()
                    ahead = [x for x in islice(self._reads, READ_AHEAD) if x not in self._hinted]
                else:
                    job, h = "write", self._writes.popleft()
            try:
                if job == "read":
                    self._hint(ahead)
                    self._read(h)
                    self._hinted.discard(h)
                else:
                    self._write(h)
            except Exception:  # a full or failing disk must not take the worker down
                logger.exception("KV offload: %s of block %016x failed", job, h)
                with self._lock:
                    if job == "read":
                        self._loaded.pop(h, None)
                    elif self._pending.pop(h, None) is not None:
                        self._forget(h)
                    self._lock.notify_all()

    def _hint(self, hashes: list[int]) -> None:
        """Tell the kernel the next queued blocks' files will be read: those on the device,
        not in the page cache, are then read in parallel while this thread reads the first."""
        for h in hashes:
            self._hinted.add(h)
            with contextlib.suppress(OSError):
                fd = os.open(self._path(h), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    def _path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:016x}{SUFFIX}"

    def _forget(self, block_hash: int) -> None:
        """Drop a block from the index (under the lock)."""
        size = self._index.pop(block_hash, None)
        if size is not None:
            self.used_bytes -= size
            self.events.add(False, block_hash)

    def _write(self, block_hash: int) -> None:
        with self._lock:
            if block_hash not in self._pending:  # evicted before its turn
                return
            tokens, kv = self._pending[block_hash]
        start = time.perf_counter()
        payload = kv.view(torch.uint8).numpy().reshape(-1)
        header = HEADER.pack(MAGIC, block_hash, checksum(payload), payload.nbytes, len(tokens))
        ids = struct.pack(f"<{len(tokens)}I", *tokens)
        size = len(header) + len(ids) + payload.nbytes
        self._make_room()
        with self._lock:
            if block_hash not in self._pending:  # it was the least recently used itself
                return
        tmp = self.folder / f".{block_hash:016x}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(ids)
            f.write(memoryview(payload))
        os.replace(tmp, self._path(block_hash))
        with self._lock:
            del self._pending[block_hash]
            if block_hash in self._wanted:  # a request is about to take it: keep it at hand
                self._wanted.discard(block_hash)
                self._keep(block_hash, (tokens, kv))
            self.stats.stores += 1
            self.stats.store_bytes += size
            self.stats.store_seconds += time.perf_counter() - start
            self._lock.notify_all()

    def _keep(self, block_hash: int, block: Block) -> None:
        """Hold a block ready for `take` (under the lock), dropping the oldest untaken ones
        past the memory budget (they stay on disk)."""
        self._loaded[block_hash] = block
        self._loaded.move_to_end(block_hash)
        budget = self.max_pending_bytes // self.block_bytes
        if len(self._loaded) <= budget:  # the ready ones fit, whatever the rest
            return
        ready = [h for h, b in self._loaded.items() if b is not None]
        for h in ready[: max(0, len(ready) - budget)]:
            del self._loaded[h]

    def _make_room(self) -> None:
        """Evict least recently used blocks until what the tier holds fits its capacity:
        delete their files, or drop them before they are written."""
        while True:
            with self._lock:
                if not self._index or self.used_bytes <= self.capacity_bytes:
                    return
                victim = next(iter(self._index))
                self._forget(victim)
                self.stats.evictions += 1
                if self._pending.pop(victim, None) is not None:
                    self._wanted.discard(victim)
                    self._lock.notify_all()
                    continue
            self._path(victim).unlink(missing_ok=True)

    def _read(self, block_hash: int) -> None:
        start = time.perf_counter()
        with self._lock:
            self._reading = block_hash  # until its outcome is recorded (see `release`)
            dest = self._dests.get(block_hash)
        try:
            self._read_and_record(block_hash, dest, start)
        finally:
            with self._lock:
                self._reading = None
                done = self._read_done.pop(block_hash, None)
                self._lock.notify_all()
            if done is not None:
                done.set()

    def _read_and_record(self, block_hash: int, dest: torch.Tensor | None, start: float) -> None:
        path = self._path(block_hash)
        block = self._read_file(path, block_hash, dest)
        vanished = block is None and not path.exists()  # another worker deleted it
        if block is None and not vanished:
            path.unlink(missing_ok=True)
        with self._lock:
            if block_hash not in self._loaded:  # forgotten meanwhile
                return
            if block is None:
                del self._loaded[block_hash]
                self._forget(block_hash)
                self.stats.corrupt += not vanished
            else:
                self._keep(block_hash, block)  # its place in the index: when it is taken
                self.stats.loads += 1
                self.stats.loads_into_pool += dest is not None
                self.stats.load_bytes += block[1].nbytes
                self.stats.load_seconds += time.perf_counter() - start

    def _read_file(
        self, path: Path, block_hash: int, into: torch.Tensor | None = None
    ) -> Block | None:
        """A whole, well-formed block file of `block_hash` (its payload read straight into
        `into`, or a fresh tensor), else None (`into` then holds anything)."""
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(HEADER.size)
                if len(head) < HEADER.size:
                    return None
                magic, h, digest, nbytes, ntokens = HEADER.unpack(head)
                ids = f.read(4 * ntokens)
                if (magic, h, nbytes) != (MAGIC, block_hash, self.block_bytes) or (
                    size != HEADER.size + 4 * ntokens + nbytes or len(ids) != 4 * ntokens
                ):
                    return None
                kv = torch.empty(nbytes, dtype=torch.uint8) if into is None else into
                payload = kv.view(torch.uint8).view(-1).numpy()
                if f.readinto(memoryview(payload)) != nbytes:
                    return None
        except OSError:
            return None
        if checksum(payload) != digest:  # just read: still in the CPU's cache
            return None
        tokens = struct.unpack(f"<{ntokens}I", ids)
        return tokens, kv if into is not None else kv.view(self.dtype).view(self.block_shape)

    def _recover(self) -> None:
        """Rebuild the index from the folder: files whose header and size check out, oldest
        first (the checksum is checked when a block is read). Leftover temporary files and
        blocks past the capacity are deleted."""
        found = []
        for path in self.folder.iterdir():
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):  # another worker's write, unless stale
                    if not self.shared or time.time() - path.stat().st_mtime > STALE_TMP_S:
                        path.unlink(missing_ok=True)
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                block_hash = int(path.stem, 16)
                stat = path.stat()
                with open(path, "rb") as f:
                    head = f.read(HEADER.size)
            except (ValueError, OSError):
                continue
            if len(head) < HEADER.size:
                path.unlink(missing_ok=True)
                continue
            magic, h, _, nbytes, ntokens = HEADER.unpack(head)
            expected = HEADER.size + 4 * ntokens + nbytes
            if magic != MAGIC or h != block_hash or nbytes != self.block_bytes:
                path.unlink(missing_ok=True)
                continue
            if stat.st_size != expected:
                path.unlink(missing_ok=True)
                self.stats.corrupt += 1
                continue
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self.used_bytes += size
        self._make_room()
        if self._index:
            logger.info(
                "KV offload: %d blocks (%.2f GiB) recovered from %s",
                len(self._index), self.used_bytes / 2**30, self.folder,
            )  # fmt: skip
