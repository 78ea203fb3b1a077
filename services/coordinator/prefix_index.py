"""Which worker caches which prompt prefix: the prefix-aware router's view of every worker's
prefix cache, kept from the workers' own reports (hashes stored / evicted, see
`services/status.py`) or, when those are off, from the router's own past decisions.
`ProvisionalHolds` bridges the two: what the router just sent a worker counts as held there
until the worker's report says so itself.

An inverted index (block hash -> workers holding it) makes a decision cost proportional to
how far the prompt's prefix is actually shared, not to the number of workers: walking the
prompt's block hashes in order, the set of workers still matching shrinks until it is empty,
and each worker's overlap is where it dropped out."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence

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


class ProvisionalHolds:
    """Blocks of prompts the router has sent a worker that the worker has not reported yet.
    A worker reports what it stored every status interval, and only after its one thread
    has run the prompt's prefill: a conversation's next turn sent as soon as the last answer
    streams out can reach the router first, and would look uncached everywhere. Until the
    worker's report lists a block (stored or evicted) or `ttl_s` passes, the block counts as
    held by the worker it was sent to; the TTL bounds a wrong guess (a prefill that failed,
    or queued longer than that)."""

    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = PrefixIndex()
        self.ttl_s = ttl_s
        self._clock = clock
        self._deadline: dict[tuple[WorkerKey, int], float] = {}
        self._queue: deque[tuple[float, WorkerKey, int]] = deque()

    def add(self, worker: WorkerKey, hashes: Sequence[int]) -> None:
        """The caller expires lapsed holds (`expire`) before each decision, not here."""
        deadline = self._clock() + self.ttl_s
        for h in hashes:
            self._deadline[(worker, h)] = deadline
            self._queue.append((deadline, worker, h))
        self.index.apply(worker, hashes)

    def resolved(self, worker: WorkerKey, hashes: Iterable[int]) -> None:
        """The worker's report named these blocks: its own word replaces the guess."""
        gone = [h for h in hashes if self._deadline.pop((worker, h), None) is not None]
        if gone:
            self.index.apply(worker, (), gone)

    def expire(self) -> None:
        now = self._clock()
        while self._queue and self._queue[0][0] <= now:
            deadline, worker, h = self._queue.popleft()
            if self._deadline.get((worker, h)) == deadline:  # not renewed since
                del self._deadline[(worker, h)]
                self.index.apply(worker, (), [h])

    def remove_worker(self, worker: WorkerKey) -> None:
        self.index.remove_worker(worker)
        for key in [k for k in self._deadline if k[0] == worker]:
            del self._deadline[key]
