"""Every worker's `WorkerStatusService`: what routing needs to know about this worker, as a
stream to each coordinator. Every `interval` the hub takes, on the engine thread between
steps, the prefix cache's changes (hashes stored and evicted) and the load (running,
waiting, free blocks), and sends them to every watcher; a new watcher's first report with
the cache is the whole index, so a restarted coordinator rebuilds its view from the truth.
While one step runs longer than `HEARTBEAT_S`, the last load is sent again meanwhile, so a
coordinator does not take a busy worker for a dead one. Draining (SIGTERM)
is reported at once, so routers stop sending new work before the worker goes away. If taking
a report fails, the stream of every watcher there when the round began ends with UNAVAILABLE
naming the failure (its cache view may have missed changes; its coordinator reconnects and
gets the whole index again), and the hub goes on with the next round.

Bounded for every watcher: the interval is the worker's (`--status-interval`), a watcher
that stops reading has at most `WATCHER_QUEUE` reports queued (past that its queue is
emptied and its next report is a fresh snapshot, so it resyncs instead of growing), and at
most `MAX_WATCHERS` watch at once. Both count on /metrics (`pdserve_status_resyncs_total`,
`pdserve_status_watchers_refused_total`). Each report carries the worker's advertised
address, so a coordinator learns how the worker spells itself in its KV handles."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from pdserve.common.kv_tiers import KVTier

from pdserve.services.convert import RETRY_AFTER_KEY, RETRY_AFTER_S
from pdserve.services.metrics import STATUS_RESYNCS, STATUS_WATCHERS, STATUS_WATCHERS_REFUSED
from pdserve.services.worker import Worker
from pdserve.v1 import worker_pb2, worker_pb2_grpc

DEFAULT_INTERVAL_S = 0.1
MIN_INTERVAL_S = 0.05
WATCHER_QUEUE = 32
MAX_WATCHERS = 64
IDLE_DRAIN_S = 1.0  # with no watcher, the event log is still emptied this often
HEARTBEAT_S = 1.0  # while a step runs longer, the last load is reported this often
# A cache's (stored?, hash) changes since the last report, and its whole index when asked.
Changes = tuple[list[tuple[bool, int]], list[int] | None]
NO_CHANGES: tuple[Changes, Changes, Changes] = (([], None), ([], None), ([], None))
logger = logging.getLogger(__name__)


class CollectFailed:
    """Put on a watcher's queue in place of a report: its stream ends with this reason."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


Item = worker_pb2.WatchResponse | CollectFailed | None  # None: the stream ends cleanly


class StatusHub(worker_pb2_grpc.WorkerStatusServiceServicer):
    def __init__(self, worker: Worker, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.worker = worker
        engine = worker.loop.engine
        self.pool = engine.kv_cache.pool
        self.pool.record_events()
        for tier in (engine.kv_cache.tiers.host, engine.kv_cache.tiers.disk):
            if tier is not None:
                tier.record_events()
        self.block_size = engine.kv_cache.block_size
        self._watchers: dict[int, asyncio.Queue[Item]] = {}
        self._fresh: set[int] = set()  # watchers whose first report (the index) is due
        self._interval = max(MIN_INTERVAL_S, interval_s)
        self.resyncs = 0  # lagging watchers sent a fresh snapshot instead of a backlog
        labels = worker.metrics.labels
        self._resync_count = STATUS_RESYNCS.labels(**labels)
        self._refused_count = STATUS_WATCHERS_REFUSED.labels(**labels)
        STATUS_WATCHERS.labels(**labels).set_function(lambda: len(self._watchers))
        self._wake = asyncio.Event()
        self.draining = False
        self._last_load: dict = {}  # the load of the last report (none before the first)
        self._failure = ""  # the last failed round's error, logged in full once
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for key in list(self._watchers):
            self._end(key)

    async def drain(self, _grace_s: float) -> None:
        """Tell every watcher now that this worker takes nothing new, then end their streams
        (so they do not hold the server's drain open)."""
        self.draining = True
        self._wake.set()
        await asyncio.sleep(2 * self._interval + 0.05)  # the draining report goes out
        for key in list(self._watchers):
            self._end(key)

    async def Watch(
        self, request: worker_pb2.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WatchResponse]:
        # request.interval_s is not honoured: one watcher must not set everyone's rate.
        if len(self._watchers) >= MAX_WATCHERS:
            self._refused_count.inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this worker already has {MAX_WATCHERS} status watchers",
                trailing_metadata=((RETRY_AFTER_KEY, str(RETRY_AFTER_S)),),
            )
        key = id(context)
        queue: asyncio.Queue[Item] = asyncio.Queue(WATCHER_QUEUE)
        self._watchers[key] = queue
        self._fresh.add(key)
        self._wake.set()
        try:
            while (report := await queue.get()) is not None:
                if isinstance(report, CollectFailed):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, report.reason)
                yield report
        finally:
            self._watchers.pop(key, None)
            self._fresh.discard(key)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                wait = self._interval if self._watchers else IDLE_DRAIN_S
                await asyncio.wait_for(self._wake.wait(), wait)
            self._wake.clear()
            watching = set(self._watchers)  # who could miss this round's changes
            try:
                await self._report()
                self._failure = ""
            except Exception as e:
                reason = f"this worker could not take its status: {e!r:.200}"
                if reason != self._failure:  # a failure that repeats is logged once
                    logger.exception("taking a status report failed")
                self._failure = reason
                for key in watching & set(self._watchers):
                    self._end(key, CollectFailed(reason))

    async def _report(self) -> None:
        """One round: the changes and load from the engine thread, to every watcher."""
        loop = self.worker.loop
        fresh = set(self._fresh)
        self._fresh.clear()
        collecting = asyncio.ensure_future(loop.call(lambda f=bool(fresh): self._collect(f)))
        # The engine thread answers between steps, and one step can outlast a
        # coordinator's patience (STALE_AFTER_S: a long prefill chunk on one slow core).
        # Meanwhile the last load goes out every HEARTBEAT_S, with no cache changes, so
        # a busy worker is not taken for a dead one; fresh watchers get their index after.
        try:
            while not (await asyncio.wait({collecting}, timeout=HEARTBEAT_S))[0]:
                self._send(set(), NO_CHANGES, self._last_load)
        finally:
            collecting.cancel()  # only if a heartbeat failed: it has its result otherwise
        changes, self._last_load = collecting.result()
        self._send(fresh, changes, self._last_load)

    def _send(self, fresh: set[int], changes: tuple[Changes, Changes, Changes], load: dict) -> None:
        """One report to every watcher: the whole indexes to the `fresh` ones, else the
        changes since the last report."""
        if not self._watchers:
            return
        (events, index), (tier_events, tier_index), (host_events, host_index) = changes
        stored = [h for added, h in events if added]
        evicted = [h for added, h in events if not added]
        tier_stored = [h for added, h in tier_events if added]
        tier_evicted = [h for added, h in tier_events if not added]
        host_stored = [h for added, h in host_events if added]
        host_evicted = [h for added, h in host_events if not added]
        for key, queue in self._watchers.items():
            report = worker_pb2.WatchResponse(
                worker_id=self.worker.worker_id,
                role=self.worker.role,
                group=self.worker.group,
                group_rank=self.worker.group_rank,
                group_size=self.worker.group_size,
                block_size=self.block_size,
                draining=self.draining,
                address=self.worker.address,
                **load,
            )
            if key in fresh:
                report.reset = True
                report.stored.extend(index or ())
                report.offload_stored.extend(tier_index or ())
                report.host_stored.extend(host_index or ())
            else:
                report.stored.extend(stored)
                report.evicted.extend(evicted)
                report.offload_stored.extend(tier_stored)
                report.offload_evicted.extend(tier_evicted)
                report.host_stored.extend(host_stored)
                report.host_evicted.extend(host_evicted)
            if queue.full():  # a watcher not reading: drop its backlog, resync it
                while not queue.empty():
                    queue.get_nowait()
                self._fresh.add(key)
                self.resyncs += 1
                self._resync_count.inc()
                self._wake.set()
            else:
                queue.put_nowait(report)

    def _end(self, key: int, last: CollectFailed | None = None) -> None:
        """End a watcher's stream (with `last`'s reason, if given), even when its queue is
        full; it gets no report after that, so nothing can push its end out of the queue."""
        queue = self._watchers.pop(key)
        self._fresh.discard(key)
        while queue.full():
            queue.get_nowait()
        queue.put_nowait(last)

    def _collect(self, with_index: bool) -> tuple[tuple[Changes, Changes, Changes], dict]:
        """On the engine thread: the pool's, the disk tier's and the host tier's changes (and
        whole indexes if asked), and the load."""
        engine = self.worker.loop.engine
        kv = engine.kv_cache
        load = {
            "num_running": len(engine.scheduler.running),
            "num_waiting": len(engine.scheduler.waiting) + len(engine.scheduler.remote.pending),
            "saturated": engine.scheduler.remote.is_saturated,
            "free_blocks": self.pool.num_free_blocks,
            "total_blocks": self.pool.num_blocks,
            "offload_cost": engine.tier_cost(kv.tiers.disk),
            "host_cost": engine.tier_cost(kv.tiers.host),
        }
        pool = self.pool.drain_events(), list(self.pool.cached) if with_index else None
        disk, host = _changes(kv.tiers.disk, with_index), _changes(kv.tiers.host, with_index)
        return (pool, disk, host), load


def _changes(tier: KVTier | None, with_index: bool) -> Changes:
    if tier is None:
        return [], None
    return tier.drain_events(), tier.held_hashes() if with_index else None
