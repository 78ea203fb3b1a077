"""A pool of workers of one role as the coordinator holds it: a gRPC channel per worker, a
status stream from each (`WorkerStatusService.Watch`: load, draining, prefix-cache changes,
opened once `grpc.health.v1` says SERVING) keeping its `WorkerState` and the prefix index
current, and membership that discovery may
change at any time. A worker whose stream breaks or goes quiet leaves the routing table at
once and is retried with backoff until it answers again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Counter

from pdserve.common.config import GRPC_KEEPALIVE
from pdserve.common.retry import Backoff
from pdserve.services.coordinator.prefix_index import PrefixIndex, ProvisionalHolds
from pdserve.services.coordinator.router import (
    NoWorkerError,
    Router,
    RouterWeights,
    WorkerState,
)
from pdserve.services.decode.prefill_peers import valid_address
from pdserve.services.grpc_server import keepalive_channel_options
from pdserve.services.tls import internal_channel
from pdserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

LOCAL_PREFILLS = Counter(
    "pdserve_router_local_prefills",
    "Requests sent straight to a decode worker that computed the prompt itself (its cache "
    "held all but a short tail, so no KV moved)",
    ("pool", "target"),
)

REPORT_INTERVAL_S = 0.1
STALE_AFTER_S = 3.0  # no report for this long: the worker is taken out of routing
BACKOFF_S = (0.2, 2.0)  # reconnect delay: first, most


@dataclass(eq=False)
class WorkerEndpoint(WorkerState):
    stub: Any = None
    channel: grpc.aio.Channel | None = None
    monitor: asyncio.Task[None] | None = field(default=None, repr=False)
    # Where the worker says peers reach it (its status reports' `address`): what its KV
    # handles name, which may be spelled otherwise than the address dialled. "" until known.
    advertised: str = ""
    refused_address: str = field(default="", repr=False)  # an advertised one not taken


class WorkerPool:
    """`kv_events`: keep the prefix index from the workers' reports (True) or from this
    coordinator's own decisions (False: approximate). `keepalive_s`: a worker that stops
    answering pings for twice this fails its calls UNAVAILABLE (`keepalive_channel_options`),
    which the request path routes around like a dead worker."""

    def __init__(
        self,
        role: str,
        addresses: Sequence[str],
        make_stub: Callable[[grpc.aio.Channel], Any],
        policy: str = "prefix_aware",
        weights: RouterWeights | None = None,
        kv_events: bool = True,
        wait_for_worker_s: float = 5.0,
        keepalive_s: float = GRPC_KEEPALIVE.default,
    ) -> None:
        self.role = role
        self.channel_options = keepalive_channel_options(keepalive_s)
        self.make_stub = make_stub
        self.index = PrefixIndex()
        self.offload_index = PrefixIndex()  # what the disk tiers below the workers' pools hold
        self.host_index = PrefixIndex()  # what their host-memory tiers hold
        self.provisional = ProvisionalHolds()  # prompts sent to a worker, not reported yet
        self.router = Router(
            role, policy, weights, self.index, self.offload_index, self.host_index,
            self.provisional,
        )  # fmt: skip
        self.kv_events = kv_events
        self.wait_for_worker_s = wait_for_worker_s
        self.block_size = 0  # from the first report; 0: prompts are not hashed yet
        self.workers: dict[str, WorkerEndpoint] = {}
        self._changed = asyncio.Event()
        self._closed = False
        self._pending = list(addresses)
        self._background: set[asyncio.Task[None]] = set()
        # Called once a worker answers SERVING, before it is routable (a failure retries).
        self.on_connect: Callable[[WorkerEndpoint], Awaitable[None]] | None = None
        # Called whenever discovery changes the pool's membership.
        self.on_change: Callable[[], None] | None = None
        # Called when a worker's advertised address is first known or changes, before the
        # report carrying it is applied (so before the worker is routable); must not raise.
        self.on_advertised: Callable[[WorkerEndpoint], Awaitable[None]] | None = None

    @property
    def policy(self) -> str:
        return self.router.policy

    def __len__(self) -> int:
        return len(self.workers)

    def start(self) -> None:
        """Connect to the initial workers (needs the running event loop)."""
        self.set_addresses(self._pending)

    def set_addresses(self, addresses: Iterable[str]) -> None:
        """Discovery's view of the pool: new workers are connected, gone ones retired
        (calls in flight there finish on their own)."""
        wanted = set(addresses)
        for address in wanted - set(self.workers):
            channel = internal_channel(address, self.channel_options)
            worker = WorkerEndpoint(
                address, healthy=False, stub=self.make_stub(channel), channel=channel
            )
            self.workers[address] = worker
            worker.monitor = asyncio.ensure_future(self._monitor(worker))
        for address in set(self.workers) - wanted:
            self._retire(self.workers.pop(address))
        self._changed.set()
        if self.on_change is not None:
            self.on_change()

    def _retire(self, worker: WorkerEndpoint) -> None:
        self._set_healthy(worker, False)
        for index in (self.index, self.offload_index, self.host_index, self.provisional):
            index.remove_worker(worker.address)
        self.router.forget(worker.address)
        with contextlib.suppress(KeyError):
            LOCAL_PREFILLS.remove(self.role, worker.address)
        if worker.monitor is not None:
            worker.monitor.cancel()

        async def close_when_idle() -> None:
            while worker.in_flight:
                await asyncio.sleep(0.5)
            if worker.channel is not None:
                await worker.channel.close()

        task = asyncio.ensure_future(close_when_idle())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def pick(
        self,
        hashes: Sequence[int] = (),
        blocks_needed: int = 0,
        exclude: Collection[WorkerState] = (),
    ) -> WorkerEndpoint:
        """A worker for this request; waits up to `wait_for_worker_s` when none is routable
        yet (at start-up, or while a worker comes back). Raises `NoWorkerError`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_for_worker_s
        self.provisional.expire()
        while True:
            try:
                chosen = self.router.pick(
                    list(self.workers.values()), hashes, blocks_needed, exclude, False
                )
                break
            except NoWorkerError:
                left = deadline - loop.time()
                if left <= 0 or self._closed:
                    self.router.no_worker()
                    raise
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
        if not self.kv_events and hashes:
            self.index.record(chosen.address, hashes)
        elif hashes and self.router.pool == "prefill" and self.router.policy == "prefix_aware":
            self.provisional.add(chosen.address, hashes)
        return chosen  # type: ignore[return-value]

    def saturated(self) -> bool:
        """Whether every routable worker (one at least) reports itself saturated."""
        routable = [w for w in self.workers.values() if w.routable]
        return bool(routable) and all(w.saturated for w in routable)

    def local_prefill_worker(
        self, hashes: Sequence[int], num_tokens: int, max_uncached: int, blocks_needed: int,
        exclude: Collection[WorkerState] = (),
    ) -> WorkerEndpoint | None:  # fmt: skip
        """A worker of this (decode) pool that caches all but at most `max_uncached` of the
        prompt, has room for it and would rather compute the rest than receive KV; None
        when there is none."""
        if not hashes or not self.block_size:
            return None
        best: WorkerEndpoint | None = None
        best_key = (0, 0)
        for address, overlap in self.index.overlaps(hashes).items():
            worker = self.workers.get(address)
            if worker is None or not worker.routable or worker in exclude:
                continue
            if worker.total_blocks and worker.free_blocks < blocks_needed:
                continue
            if num_tokens - overlap * self.block_size > max_uncached:
                continue
            key = (overlap, -worker.queue)
            if best is None or key > best_key:
                best, best_key = worker, key
        if best is not None:
            LOCAL_PREFILLS.labels(self.role, best.address).inc()
        return best

    def failed(self, worker: WorkerEndpoint) -> None:
        """A call to `worker` failed as if it were gone: route around it until its status
        stream says otherwise."""
        self._set_healthy(worker, False)

    def _set_healthy(self, worker: WorkerEndpoint, healthy: bool) -> None:
        if worker.healthy == healthy:
            return
        worker.healthy = healthy
        if worker.group:
            self._check_group(worker.group)

    def _check_group(self, group: str) -> None:
        """An expert-parallel group steps in lockstep: with one rank gone the others cannot
        run a step, so every rank of it is routable only while all of its ranks are known
        and healthy."""
        members = [w for w in self.workers.values() if w.group == group]
        whole = all(w.healthy for w in members) and len(members) >= members[0].group_size
        for w in members:
            if w.group_whole != whole:
                w.group_whole = whole
                self._changed.set()

    @contextlib.contextmanager
    def track(self, worker: WorkerEndpoint) -> Iterator[WorkerEndpoint]:
        worker.in_flight += 1
        worker.update_queue()
        try:
            yield worker
        finally:
            worker.in_flight -= 1
            worker.update_queue()

    async def close(self) -> None:
        self._closed = True
        self._changed.set()
        for worker in self.workers.values():
            if worker.monitor is not None:
                worker.monitor.cancel()
            if worker.channel is not None:
                await worker.channel.close()

    async def _monitor(self, worker: WorkerEndpoint) -> None:
        assert worker.channel is not None
        stub = worker_pb2_grpc.WorkerStatusServiceStub(worker.channel)
        health = health_pb2_grpc.HealthStub(worker.channel)
        backoff = Backoff(*BACKOFF_S)
        while not self._closed:
            call = stub.Watch(worker_pb2.WatchRequest(interval_s=REPORT_INTERVAL_S))
            try:
                # grpc.health.v1 first: a worker still loading its model, or draining,
                # says so there before it has a status to report.
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=STALE_AFTER_S)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    raise StopAsyncIteration
                if self.on_connect is not None:
                    await self.on_connect(worker)

                reports = aiter(call)
                while True:
                    report = await asyncio.wait_for(anext(reports), STALE_AFTER_S)
                    await self._learn_address(worker, report.address)
                    self._apply(worker, report)
                    backoff.reset()
            except (grpc.aio.AioRpcError, TimeoutError, StopAsyncIteration) as e:
                if worker.healthy:
                    logger.warning("%s worker %s left routing: %s", self.role, worker.address, e)
            finally:
                call.cancel()
            self._set_healthy(worker, False)
            if self.kv_events:
                for index in (self.index, self.offload_index, self.host_index, self.provisional):
                    index.remove_worker(worker.address)
            await backoff.wait()

    async def _learn_address(self, worker: WorkerEndpoint, address: str) -> None:
        if not address or address == worker.advertised:
            return
        if not valid_address(address):  # it could not be named to anyone
            if worker.refused_address != address:  # said once, not on every report
                worker.refused_address = address
                logger.warning(
                    "%s worker %s advertises %r, not a host:port; using the address dialled",
                    self.role, worker.address, address[:300],
                )  # fmt: skip
            return
        worker.advertised = address
        if self.on_advertised is not None:
            await self.on_advertised(worker)

    def _apply(self, worker: WorkerEndpoint, report: worker_pb2.WatchResponse) -> None:
        was = worker.routable
        worker.num_running = report.num_running
        worker.num_waiting = report.num_waiting
        worker.update_queue()
        worker.free_blocks = report.free_blocks
        worker.total_blocks = report.total_blocks
        worker.draining = report.draining
        worker.saturated = report.saturated
        regrouped = (report.group, report.group_size or 1) != (worker.group, worker.group_size)
        if regrouped:  # first report, or a restarted worker with other flags
            old = worker.group
            worker.group, worker.group_size = report.group, report.group_size or 1
            if old:
                self._check_group(old)
        self._set_healthy(worker, True)
        if regrouped and worker.group:
            self._check_group(worker.group)
        self.block_size = self.block_size or report.block_size
        worker.offload_cost, worker.host_cost = report.offload_cost, report.host_cost
        if self.kv_events:
            for index, stored, evicted in (
                (self.index, report.stored, report.evicted),
                (self.offload_index, report.offload_stored, report.offload_evicted),
                (self.host_index, report.host_stored, report.host_evicted),
            ):
                if report.reset or stored or evicted:
                    index.apply(worker.address, stored, evicted, report.reset)
            if self.provisional.index.has_any():  # only prefill pools ever hold any
                self.provisional.resolved(worker.address, [*report.stored, *report.evicted])
        if worker.routable != was:
            self._changed.set()
