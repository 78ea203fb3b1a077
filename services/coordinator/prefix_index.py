"""Which worker caches which prompt prefix: the prefix-aware router's view of every worker's
prefix cache, kept from the workers' own reports (hashes stored / evicted, see
`services/status.py`) or, when those are off, from the router's own past decisions.

An inverted index (block hash -> workers holding it) makes a decision cost proportional to
how far the prompt's prefix is actually shared, not to the number of workers: walking the
prompt's block hashes in order, the set of workers still matching shrinks until it is empty,
and each worker's overlap is where it dropped out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

WorkerKey = Hashable


class PrefixIndex:
    """`approx_capacity`: in approximate mode (no reports), how many hashes per worker are
    remembered (oldest forgotten first), standing in for the worker's cache size."""

    def __init__(self, approx_capacity: int = 65536) -> None:
        self._holders: dict[int, set[WorkerKey]] = {}
        self._held: dict[WorkerKey, OrderedDict[int, None]] = {}
        self.approx_capacity = approx_capacity

    def __len__(self) -> int:
        """Hashes indexed, over all workers."""
        return sum(len(h) for h in self._held.values())

    def apply(
        self,
        worker: WorkerKey,
        stored: Iterable[int],
        evicted: Iterable[int] = (),
        reset: bool = False,
    ) -> None:
        """A worker's report: with `reset`, `stored` is its whole index."""
        if reset:
            self.remove_worker(worker)
        held = self._held.setdefault(worker, OrderedDict())
        for h in evicted:
            if h in held:
                del held[h]
                holders = self._holders.get(h)
                if holders is not None:
                    holders.discard(worker)
                    if not holders:
                        del self._holders[h]
        for h in stored:
            if h not in held:
                held[h] = None
                self._holders.setdefault(h, set()).add(worker)

    def record(self, worker: WorkerKey, hashes: Sequence[int]) -> None:
        """Approximate mode: the worker was sent this prompt, so it will cache its blocks."""
        held = self._held.setdefault(worker, OrderedDict())
        for h in hashes:
            if h in held:
                held.move_to_end(h)
        self.apply(worker, hashes)
        overflow = len(held) - self.approx_capacity
        if overflow > 0:
            oldest = [h for h, _ in zip(held, range(overflow), strict=False)]
            self.apply(worker, (), oldest)

    def remove_worker(self, worker: WorkerKey) -> None:
        for h in self._held.pop(worker, ()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def overlaps(self, hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """For each worker caching at least the first block: how many leading blocks of
        `hashes` it caches."""
        if not hashes:
            return {}
        active = set(self._holders.get(hashes[0], ()))
        out: dict[WorkerKey, int] = {}
        for i, h in enumerate(hashes[1:], start=1):
            if not active:
                break
            holders = self._holders.get(h, ())
            for worker in active - holders if holders else active:
                out[worker] = i
            active = active & holders if holders else set()
        for worker in active:
            out[worker] = len(hashes)
        return out

    def has_any(self) -> bool:
        return bool(self._holders)

    def overlaps_with(
        self, others: Sequence[PrefixIndex], hashes: Sequence[int]
    ) -> dict[WorkerKey, int]:
        """As `overlaps`, a block counting as held where this index or any of `others`
        holds it (a worker's pool and the tiers below it)."""
        if not hashes:
            return {}

        def holders(h: int) -> set[WorkerKey]:
            held = set(self._holders.get(h, ()))
            for other in others:
                held |= other._holders.get(h, set())
            return held

        active = holders(hashes[0])
        out: dict[WorkerKey, int] = {}
        for i, h in enumerate(hashes[1:], start=1):
            if not active:
                break
            held = holders(h)
            for worker in active - held:
                out[worker] = i
            active &= held
        for worker in active:
            out[worker] = len(hashes)
        return out

    def holds(self, worker: WorkerKey, block_hash: int) -> bool:
        return block_hash in self._held.get(worker, ())
