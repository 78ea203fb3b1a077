"""The host-memory tier of the KV cache (`--kv-host-offload-gb`), between a GPU worker's
device pool and its disk tier: blocks the pool evicts are copied into one slab of pinned
host memory (slots of one block each, allocated at start), and copied back on a prefix hit.
When the slab is full its least recently used block moves down to the next tier (the disk
tier, when there is one) before its slot is reused. On a CPU worker the slab is ordinary
memory: the tier then only adds room next to the pool.

A `KVTier` (`common/kv_tiers.py`) without a thread: every block it holds is ready at once,
so it has nothing to read ahead, wait for or write."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from pdserve.common.kv_tiers import KVTier


class HostTier(KVTier):
    def __init__(
        self,
        capacity_bytes: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        pin: bool,
        below: Callable[[int, tuple[int, ...], torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__()
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = torch.empty(self.block_shape, dtype=dtype).nbytes
        num_slots = max(1, capacity_bytes // self.block_bytes)
        self.capacity_bytes = num_slots * self.block_bytes
        self.slab = torch.empty((num_slots, *self.block_shape), dtype=dtype, pin_memory=pin)
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # LRU first
        self.below = below  # where an evicted block goes (hash, token ids, KV)

    @property
    def used_bytes(self) -> int:
        return len(self._held) * self.block_bytes

    def num_blocks(self) -> int:
        return len(self._held)

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._held

    def store(self, block_hash: int, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        if block_hash in self._held:
            self._held.move_to_end(block_hash)
            return
        start = time.perf_counter()
        if not self._free:
            victim, (slot, tokens) = self._held.popitem(last=False)
            if self.below is not None:
                self.below(victim, tokens, self.slab[slot])
            self._free.append(slot)
            self.stats.evictions += 1
            self.events.add(False, victim)
        slot = self._free.pop()
        self.slab[slot].copy_(kv)
        self._held[block_hash] = (slot, tuple(token_ids))
        self.events.add(True, block_hash)
        self.stats.stores += 1
        self.stats.store_bytes += self.block_bytes
        self.stats.store_seconds += time.perf_counter() - start

    def lookup(self, hashes: Sequence[int]) -> tuple[int, bool]:
        held = 0
        for h in hashes:
            if h not in self._held:
                break
            held += 1
        return held, True

    def touch(self, hashes: Sequence[int]) -> None:
        for h in reversed(hashes):
            if h in self._held:
                self._held.move_to_end(h)

    def take_ready(self, blocks: Sequence[tuple[int, Sequence[int]]]) -> list[torch.Tensor]:
        """Views of the leading blocks' slots (copy them before the next `store`); the run
        taken becomes the most recently used, tail first."""
        out = []
        for block_hash, token_ids in blocks:
            entry = self._held.get(block_hash)
            if entry is None or entry[1] != tuple(token_ids):
                break
            out.append(self.slab[entry[0]])
        self.touch([h for h, _ in blocks[: len(out)]])
        self.stats.hits += len(out)
        self.stats.loads += len(out)
        self.stats.load_bytes += len(out) * self.block_bytes
        return out  # the caller's copy into the pool is timed into load_seconds

    def held_hashes(self) -> list[int]:
        return list(self._held)

    def check_consistent(self) -> list[str]:
        """What is wrong with the slots' bookkeeping (empty: nothing): every slot is either
        free or holds exactly one block."""
        used = [slot for slot, _ in self._held.values()]
        slots = sorted(used + self._free)
        if slots == list(range(len(self.slab))):
            return []
        return [f"{len(self._free)} free + {len(used)} used slots of {len(self.slab)}, "
                f"{len(slots) - len(set(slots))} counted twice"]  # fmt: skip

    def close(self) -> None:
        """Hand every block down to the tier below (so a disk tier keeps them)."""
        if self.below is not None:
            for block_hash, (slot, tokens) in self._held.items():
                self.below(block_hash, tokens, self.slab[slot])
        self._free.extend(slot for slot, _ in self._held.values())
        self._held.clear()
