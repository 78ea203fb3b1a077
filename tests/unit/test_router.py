"""Routing decisions without processes: the prefix index (reports, evictions, resets,
approximate mode with its cap), each policy's choice, and unhealthy, draining or already
failed workers never picked."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.services.coordinator.pool import WorkerPool
from pdserve.services.coordinator.prefix_index import PrefixIndex, ProvisionalHolds
from pdserve.services.coordinator.router import NoWorkerError, Router, RouterWeights, WorkerState


def test_overlap_is_the_run_of_leading_blocks_held() -> None:
    index = PrefixIndex()
    index.apply("a", [1, 2, 3])
    index.apply("b", [1, 2, 9])
    index.apply("c", [2, 3])  # no first block: no overlap at all
    assert index.overlaps([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.overlaps([7, 1]) == {}
    assert index.overlaps([]) == {}


def test_evictions_and_resets_update_the_index() -> None:
    index = PrefixIndex()
    index.apply("a", [1, 2, 3])
    index.apply("a", [], evicted=[2])
    assert index.overlaps([1, 2, 3]) == {"a": 1}
    index.apply("a", [5], reset=True)
    assert index.overlaps([1]) == {} and index.overlaps([5]) == {"a": 1}
    index.remove_worker("a")
    assert len(index) == 0 and index.overlaps([5]) == {}


def test_approximate_mode_forgets_the_oldest_first() -> None:
    index = PrefixIndex(approx_capacity=4)
    index.record("a", [1, 2, 3])
    index.record("a", [1, 7])  # refreshes 1
    index.record("a", [8])  # over the cap: 2 goes, the oldest
    assert len(index) == 4
    assert index.overlaps([1, 2]) == {"a": 1} and index.overlaps([3]) == {"a": 1}


def test_prefix_aware_trades_cached_blocks_against_queue() -> None:
    index = PrefixIndex()
    a, b = WorkerState("a"), WorkerState("b")
    index.apply("a", [1, 2, 3, 4])
    router = Router("prefill", "prefix_aware", RouterWeights(1.0, 2.0), index)
    prompt = [1, 2, 3, 4, 5, 6]
    assert router.pick([a, b], prompt) is a  # 2 blocks to compute vs 6
    a.in_flight = 3
    a.update_queue()  # 2 + 3 x 2 = 8 vs 6: b
    assert router.pick([a, b], prompt) is b
    assert router.pick([a, b], [9, 9]) is b  # nothing cached anywhere: the idle one


def test_a_prompt_just_sent_counts_as_held_until_its_worker_reports() -> None:
    """A conversation's next turn can reach the router before the worker's report of the
    last turn's blocks: those blocks count as held where they were sent, the worker's own
    report then takes over, and a guess no report confirms lapses after the TTL."""
    now = [0.0]
    index, sent = PrefixIndex(), ProvisionalHolds(ttl_s=10.0, clock=lambda: now[0])
    router = Router("prefill", "prefix_aware", RouterWeights(1.0, 2.0), index, provisional=sent)
    a, b = WorkerState("a"), WorkerState("b")
    turn = [1, 2, 3, 4]
    first = router.pick([a, b], turn)
    sent.add(first.address, turn)
    other = b if first is a else a
    for _ in range(3):  # the next turn, its prefix unreported: never round-robined away
        assert router.pick([a, b], [*turn, 5, 6]) is first
    sent.resolved(first.address, [1, 2])  # the report: 1 and 2 stored (3 and 4 still pending)
    index.apply(first.address, [1, 2])
    assert sent.index.overlaps(turn) == {} and index.overlaps(turn) == {first.address: 2}
    assert router.pick([a, b], [*turn, 5, 6]) is first  # 2 reported + 2 pending
    # A prompt sent to `other` that never shows up in its reports (its prefill failed).
    sent.add(other.address, [7, 8, 9, 10])
    other.in_flight = 1
    other.update_queue()
    assert router.pick([a, b], [7, 8, 9, 10]) is other  # 0 + 1 x 2 = 2 < 4
    now[0] = 10.0
    sent.expire()
    assert router.pick([a, b], [7, 8, 9, 10]) is first  # 4 < 4 + 2: the guess has lapsed
    assert sent.index.overlaps(turn) == {}  # 3 and 4 lapsed too; the report's 1, 2 remain
    assert router.pick([a, b], [*turn, 5, 6]) is first
    sent.add(other.address, [11])
    sent.remove_worker(other.address)
    assert len(sent.index) == 0


def test_pool_holds_what_it_sent_until_the_report() -> None:
    """The pool's side: a prefill pick records the prompt's blocks as sent, the worker's
    report resolves them, and a decode pick records nothing."""
    from pdserve.services.coordinator.pool import WorkerEndpoint
    from pdserve.v1 import worker_pb2

    async def main() -> None:
        for role in ("prefill", "decode"):
            pool = WorkerPool(role, [], lambda c: c)
            worker = WorkerEndpoint("10.0.0.1:5000", healthy=False)
            pool.workers[worker.address] = worker
            sizes = {"free_blocks": 9, "total_blocks": 9, "block_size": 16}
            pool._apply(worker, worker_pb2.WatchResponse(**sizes))
            assert await pool.pick([1, 2, 3]) is worker
            held = pool.provisional.index.overlaps([1, 2, 3])
            assert held == ({worker.address: 3} if role == "prefill" else {})
            pool._apply(worker, worker_pb2.WatchResponse(stored=[1, 2, 3], **sizes))
            assert pool.provisional.index.overlaps([1, 2, 3]) == {}
            assert pool.index.overlaps([1, 2, 3]) == {worker.address: 3}
            await pool.close()

    asyncio.run(main())


def test_decode_goes_to_the_least_loaded_with_room() -> None:
    router = Router("decode", "prefix_aware")
    busy = WorkerState("busy", num_running=5, free_blocks=100, total_blocks=100)
    full = WorkerState("full", num_running=0, free_blocks=3, total_blocks=100)
    idle = WorkerState("idle", num_running=1, free_blocks=50, total_blocks=100)
    assert router.pick([busy, full, idle], blocks_needed=10) is idle
    assert router.pick([busy, full], blocks_needed=10) is busy  # full has no room
    assert router.pick([full], blocks_needed=10) is full  # no one has room: still one


@pytest.mark.parametrize("policy", ["prefix_aware", "least_loaded", "round_robin"])
def test_unroutable_and_excluded_workers_are_skipped(policy: str) -> None:
    sick = WorkerState("sick", healthy=False)
    leaving = WorkerState("leaving", draining=True)
    tried = WorkerState("tried")
    good = WorkerState("good")
    router = Router("prefill", policy, index=PrefixIndex())
    for _ in range(5):
        assert router.pick([sick, leaving, tried, good], [1], exclude=[tried]) is good
    with pytest.raises(NoWorkerError, match="of 3 is healthy and untried"):
        router.pick([sick, leaving, tried], [1], exclude=[tried])
    with pytest.raises(NoWorkerError, match="no prefill worker is configured"):
        router.pick([], [1])


def test_round_robin_and_least_loaded_spread() -> None:
    workers = [WorkerState(n) for n in ("a", "b", "c")]
    rr = Router("prefill", "round_robin")
    assert [rr.pick(workers).address for _ in range(4)] == ["a", "b", "c", "a"]
    ll = Router("decode", "least_loaded")
    workers[0].in_flight = 1
    workers[0].update_queue()
    assert {ll.pick(workers).address for _ in range(6)} == {"b", "c"}
    with pytest.raises(ValueError, match="policy: must be one of"):
        Router("prefill", "random")


def test_pool_waits_for_a_worker_then_gives_up() -> None:
    async def main() -> None:
        pool = WorkerPool("prefill", ["127.0.0.1:9"], lambda c: c, wait_for_worker_s=0.3)
        pool.start()
        with pytest.raises(NoWorkerError, match="of 1 is healthy"):
            await pool.pick()  # nothing listens on port 9: never healthy
        worker = pool.workers["127.0.0.1:9"]
        worker.healthy = True  # as a status report would
        pool._changed.set()
        assert await pool.pick() is worker
        pool.set_addresses([])
        assert len(pool) == 0
        await pool.close()

    asyncio.run(main())


def test_an_expert_parallel_group_is_routable_only_while_whole() -> None:
    """Two ranks of group "g" and a lone worker: the group's ranks are picked only once
    both have reported, and a lost rank takes its sibling out of routing with it."""
    from pdserve.services.coordinator.pool import WorkerEndpoint
    from pdserve.v1 import worker_pb2

    async def main() -> None:
        pool = WorkerPool("decode", [], lambda c: c, policy="least_loaded")
        ranks = [WorkerEndpoint(f"10.0.0.1:{5000 + r}", healthy=False) for r in range(2)]
        lone = WorkerEndpoint("10.0.0.2:5000", healthy=False)
        for w in [*ranks, lone]:
            pool.workers[w.address] = w

        def report(worker: WorkerEndpoint, **kw: object) -> None:
            pool._apply(worker, worker_pb2.WatchResponse(free_blocks=100, total_blocks=100,
                                                         block_size=16, **kw))  # fmt: skip

        group = {"group": "g", "group_size": 2}
        report(lone, num_running=5)  # busier than the ranks: picked only when they are out
        report(ranks[0], group_rank=0, **group)
        assert not ranks[0].routable, "half a group must not be routed to"
        assert await pool.pick() is lone
        report(ranks[1], group_rank=1, **group)
        assert all(r.routable for r in ranks)
        assert await pool.pick() in ranks

        pool.failed(ranks[1])  # a call to rank 1 failed as if it were gone
        assert not ranks[0].routable and not ranks[1].routable
        assert await pool.pick() is lone
        with pytest.raises(NoWorkerError, match="expert-parallel group incomplete"):
            pool.router.pick([ranks[0]])
        report(ranks[1], group_rank=1, **group)  # it reports again: the group is whole
        assert ranks[0].routable and ranks[1].routable

        # Rank 1 leaves the pool altogether (discovery no longer lists it).
        pool.set_addresses([ranks[0].address, lone.address])
        assert not ranks[0].routable
        await pool.close()

    asyncio.run(main())


def test_tier_blocks_cost_what_their_worker_measured() -> None:
    """A block in a worker's tier below its pool costs between a hit and a miss: the
    worker's measured fraction of a computed block (a default until it has one)."""
    pool, tiers = PrefixIndex(), PrefixIndex()
    a, b, c = WorkerState("a"), WorkerState("b"), WorkerState("c")
    pool.apply("a", [1, 2])  # a: 2 blocks in its pool, then 4 in its tier
    tiers.apply("a", [3, 4, 5, 6])
    pool.apply("b", [1, 2, 3, 4])  # b: 4 blocks in its pool
    assert pool.overlaps_with([tiers], [1, 2, 3, 4, 5, 6, 7]) == {"a": 6, "b": 4}
    router = Router("prefill", "prefix_aware", RouterWeights(1.0, 8.0), pool, tiers)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    a.offload_cost = 0.1  # a: 2 to compute + 4 x 0.1 = 2.4; b: 4; c: 8
    assert router.pick([a, b, c], prompt) is a
    a.offload_cost = 0.9  # a: 2 + 3.6 = 5.6 > b's 4
    assert router.pick([a, b, c], prompt) is b
    a.offload_cost = 0.0  # unmeasured: the default, 0.5: 2 + 2 = 4, a tie with b
    assert router.pick([a, c], prompt) is a
    tiers.remove_worker("a")
    assert router.pick([a, b, c], prompt) is b


def test_host_tier_blocks_cost_less_than_disk_ones() -> None:
    """Each tier at its own measured cost: the worker whose history is in host memory wins
    over the one whose history is on disk, and a block back in the pool costs nothing."""
    pool, disk, host = PrefixIndex(), PrefixIndex(), PrefixIndex()
    a, b = WorkerState("a"), WorkerState("b")
    a.host_cost = b.host_cost = 0.01
    a.offload_cost = b.offload_cost = 0.2
    host.apply("a", [1, 2, 3, 4])  # a: 4 blocks in host memory: 0.04
    disk.apply("b", [1, 2, 3, 4])  # b: 4 on disk: 0.8
    router = Router("prefill", "prefix_aware", RouterWeights(1.0, 8.0), pool, disk, host)
    assert router.pick([b, a], [1, 2, 3, 4, 5]) is a
    pool.apply("b", [1, 2, 3])  # b: 3 back in its pool, the 4th on disk: 0.2 > a's 0.04
    assert router.pick([b, a], [1, 2, 3, 4, 5]) is a
    pool.apply("b", [4])  # all 4 in b's pool: 0 < 0.04
    assert router.pick([a, b], [1, 2, 3, 4, 5]) is b
