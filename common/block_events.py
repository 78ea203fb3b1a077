"""The log of a block cache's changes: every (held?, hash) that the prefix cache or a KV tier
starts or stops holding, kept while recording and drained by the worker's status stream
(`services/status.py`), which sends it to the coordinator's prefix-aware router."""

from __future__ import annotations

import threading


class BlockEventLog:
    """Appended from any thread (a disk tier's I/O thread evicts too), drained by one."""

    __slots__ = ("_events", "_lock")

    def __init__(self) -> None:
        self._events: list[tuple[bool, int]] | None = None  # None: not recording
        self._lock = threading.Lock()

    def record(self) -> None:
        """From now on, log every hash the cache starts or stops holding."""
        with self._lock:
            if self._events is None:
                self._events = []

    def add(self, held: bool, block_hash: int) -> None:
        if self._events is not None:
            with self._lock:
                self._events.append((held, block_hash))

    def drain(self) -> list[tuple[bool, int]]:
        """The (held?, hash) changes since the last drain, oldest first."""
        with self._lock:
            if not self._events:
                return []
            events, self._events = self._events, []
            return events
