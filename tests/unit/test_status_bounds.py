"""A worker's status stream stays bounded whatever its watchers do: the report interval is
the worker's (a watcher asking for another changes nothing), a watcher that stops reading
holds at most `WATCHER_QUEUE` reports and then gets a fresh snapshot instead of a backlog,
and at most `MAX_WATCHERS` watch at once; resyncs and refused watchers are counted on
/metrics, and every report names the worker's advertised address. A stand-in worker; the
real twin is every integration test's coordinator watching real workers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import REGISTRY

from pdserve.services import status
from pdserve.services.status import StatusHub
from pdserve.v1 import worker_pb2


class Pool:
    num_free_blocks, num_blocks, cached = 10, 16, [11, 22]

    def record_events(self) -> None:
        pass

    def drain_events(self) -> list:
        return [(True, 33)]


class Loop:
    async def call(self, fn):
        return fn()


def fake_worker() -> SimpleNamespace:
    engine = SimpleNamespace(
        kv_cache=SimpleNamespace(
            pool=Pool(), block_size=16, tiers=SimpleNamespace(disk=None, host=None)
        ),
        scheduler=SimpleNamespace(
            running=[], waiting=[], remote=SimpleNamespace(pending=[], is_saturated=False)
        ),
        tier_cost=lambda tier: 0.0,
    )
    loop = Loop()
    loop.engine = engine  # type: ignore[attr-defined]
    return SimpleNamespace(
        loop=loop, worker_id="w", role="prefill", group="", group_rank=0, group_size=1,
        address="10.0.0.7:50061",
        metrics=SimpleNamespace(labels=LABELS),
    )  # fmt: skip


LABELS = {"model": "m", "role": "prefill", "worker": "status-bounds"}


def counted(name: str) -> float:
    value = REGISTRY.get_sample_value(name, LABELS)
    assert value is not None, name  # exported from the hub's start, at 0
    return value


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details, trailing_metadata=()):
        raise Aborted(code, details, trailing_metadata)


def test_interval_is_the_workers_and_a_lagging_watcher_resyncs(monkeypatch) -> None:
    monkeypatch.setattr(status, "WATCHER_QUEUE", 4)

    async def main() -> None:
        hub = StatusHub(fake_worker(), interval_s=0.05)  # type: ignore[arg-type]
        resyncs = counted("pdserve_status_resyncs_total")
        hub.start()
        lagging = hub.Watch(worker_pb2.WatchRequest(interval_s=0.001), Context())
        first = await anext(lagging)
        assert first.reset and list(first.stored) == [11, 22]
        assert first.address == "10.0.0.7:50061"  # how its KV handles spell it
        assert hub._interval == 0.05  # the watcher's 1 ms was not taken
        await asyncio.sleep(0.8)  # ~16 reports were due; the watcher read none
        [queue] = hub._watchers.values()
        assert queue.qsize() <= 4 and hub.resyncs >= 1
        assert counted("pdserve_status_resyncs_total") == resyncs + hub.resyncs
        for _ in range(8):  # its backlog was dropped: a fresh snapshot comes soon
            report = await asyncio.wait_for(anext(lagging), 1.0)
            if report.reset:
                break
        assert report.reset and list(report.stored) == [11, 22]
        await lagging.aclose()
        await hub.stop()

    asyncio.run(main())


def test_watchers_are_capped(monkeypatch) -> None:
    monkeypatch.setattr(status, "MAX_WATCHERS", 2)

    async def main() -> None:
        hub = StatusHub(fake_worker(), interval_s=0.05)  # type: ignore[arg-type]
        refused = counted("pdserve_status_watchers_refused_total")
        hub.start()
        streams = [hub.Watch(worker_pb2.WatchRequest(), Context()) for _ in range(3)]
        await anext(streams[0])
        await anext(streams[1])
        with pytest.raises(Aborted) as e:
            await anext(streams[2])
        assert e.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.args[2] == (("retry-after", "1"),)
        assert counted("pdserve_status_watchers_refused_total") == refused + 1
        for s in streams[:2]:
            await s.aclose()
        assert not hub._watchers
        await hub.stop()

    asyncio.run(main())


def test_a_step_longer_than_the_heartbeat_still_reports_the_load(monkeypatch) -> None:
    """The engine thread answers between steps; while one step runs long (a big prefill
    chunk on one slow core can take longer than a coordinator waits for a report), the last
    load goes out every HEARTBEAT_S with no cache changes, draining included, and the
    changes follow once the step ends."""
    monkeypatch.setattr(status, "HEARTBEAT_S", 0.02)

    async def main() -> None:
        worker = fake_worker()
        hub = StatusHub(worker, interval_s=0.05)  # type: ignore[arg-type]
        hub.start()
        watcher = hub.Watch(worker_pb2.WatchRequest(), Context())
        first = await anext(watcher)
        assert first.reset and first.free_blocks == 10
        step_over = asyncio.Event()

        async def long_step(fn):
            await step_over.wait()
            return fn()

        worker.loop.call = long_step
        for _ in range(3):
            beat = await asyncio.wait_for(anext(watcher), 5)
            assert not beat.reset and not beat.stored and not beat.evicted
            assert (beat.free_blocks, beat.total_blocks) == (10, 16)
        hub.draining = True
        for _ in range(20):  # heartbeats queued before it, then one saying so
            if (await asyncio.wait_for(anext(watcher), 5)).draining:
                break
        else:
            pytest.fail("draining was not reported during the step")
        step_over.set()
        for _ in range(20):
            report = await asyncio.wait_for(anext(watcher), 5)
            if list(report.stored) == [33]:
                break
        else:
            pytest.fail("the step's cache changes never came")
        await hub.stop()

    asyncio.run(main())


def test_a_failed_report_ends_every_stream_and_the_hub_goes_on(monkeypatch, caplog) -> None:
    """Taking a report can fail on the engine thread; the watchers' cache views may then have
    missed changes, so every stream ends with UNAVAILABLE naming the failure (a coordinator
    takes the worker out of routing and reconnects), a lagging watcher's included (later
    rounds must not push its end out of its full queue); a failure that repeats is logged
    once; and the next watcher is served again from a whole index: the hub goes on."""
    monkeypatch.setattr(status, "WATCHER_QUEUE", 4)

    async def ends_unavailable(stream, reports: int = 40) -> None:
        with pytest.raises(Aborted) as e:
            for _ in range(reports):  # reports queued before the failure come first
                await asyncio.wait_for(anext(stream), 5)
        assert e.value.args[0] == grpc.StatusCode.UNAVAILABLE
        assert "ZeroDivisionError" in e.value.args[1]

    async def main() -> None:
        worker = fake_worker()
        hub = StatusHub(worker, interval_s=0.05)  # type: ignore[arg-type]
        hub.start()
        reader, lagging = (hub.Watch(worker_pb2.WatchRequest(), Context()) for _ in range(2))
        for stream in (reader, lagging):
            assert (await asyncio.wait_for(anext(stream), 5)).reset
        pool = worker.loop.engine.kv_cache.pool
        pool.drain_events = lambda: 1 / 0  # type: ignore[method-assign]
        await ends_unavailable(reader)
        await ends_unavailable(hub.Watch(worker_pb2.WatchRequest(), Context()))  # again
        failed = [r for r in caplog.records if r.getMessage() == "taking a status report failed"]
        assert len(failed) == 1
        rounds = 0

        def counted_drain() -> list:
            nonlocal rounds
            rounds += 1
            return Pool.drain_events(pool)

        pool.drain_events = counted_drain  # type: ignore[method-assign]
        while rounds <= status.WATCHER_QUEUE:  # enough good rounds to fill a lagging queue
            await asyncio.sleep(0.01)
        await ends_unavailable(lagging, reports=status.WATCHER_QUEUE + 1)
        assert not hub._watchers
        again = hub.Watch(worker_pb2.WatchRequest(), Context())
        report = await asyncio.wait_for(anext(again), 5)
        assert report.reset and list(report.stored) == [11, 22]
        await again.aclose()
        await hub.stop()

    asyncio.run(main())
