"""The one thread of a worker process that runs torch: it loads the engine, then steps it
(`EngineLoop`), so every parallel CPU kernel of the process starts from the same thread.

Why one thread: torch's CPU kernels run on OpenMP (libgomp), which keeps a team of worker
threads for each thread that starts parallel work. With the engine loaded in the main
thread and stepped in another, two teams stay alive on a 2-core host; libgomp then counts
more threads than cores and has its idle workers sleep at once instead of spinning, so
every one of a step's parallel regions first waits to wake its worker. On a 2-core AVX2 host
(float32, 4 streams) a served decode step took 28-29 ms that way and 21 ms from one thread
(docs/performance.md, "One thread for torch")."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread running the functions submitted to it, one at a time, in order,
    until `close`: the engine's load, then the engine loop."""

    def __init__(self, name: str = "engine") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn`; its result (or exception) comes back through the future."""
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future

    def close(self) -> None:
        """End the thread once the functions queued so far have run."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            run_call(*job)


def run_call(fn: Callable[[], T], future: Future[T]) -> None:
    """`fn()` into `future` (its exception too), unless the future was cancelled."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to the submitter
            future.set_exception(e)
