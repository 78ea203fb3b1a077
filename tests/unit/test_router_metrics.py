"""The router counts each decision in `pdserve_router_decisions_total`: one `picked` per pick,
labelled with the pool, the policy and the chosen worker, and one `no_worker` per pick from
an empty pool."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from pdserve.services.coordinator.router import NoWorkerError, Router, WorkerState

NAME = "pdserve_router_decisions_total"


def _count(pool: str, policy: str, outcome: str, target: str) -> float:
    labels = {"pool": pool, "policy": policy, "outcome": outcome, "target": target}
    return REGISTRY.get_sample_value(NAME, labels) or 0.0


def test_each_pick_is_counted_by_pool_policy_and_target() -> None:
    workers = [WorkerState("127.0.0.1:1"), WorkerState("127.0.0.1:2")]
    router = Router("decode", "least_loaded")
    before = {w.address: _count("decode", "least_loaded", "picked", w.address) for w in workers}
    chosen = [router.pick(workers).address for _ in range(6)]
    for address, was in before.items():
        assert _count("decode", "least_loaded", "picked", address) - was == chosen.count(address)
    rr = Router("prefill", "round_robin")
    pair = [WorkerState("a:1"), WorkerState("b:2")]
    was = _count("prefill", "round_robin", "picked", "a:1")
    rr.pick(pair), rr.pick(pair), rr.pick(pair)
    assert _count("prefill", "round_robin", "picked", "a:1") - was == 2


def test_an_empty_pool_counts_no_worker() -> None:
    router = Router("colocated", "round_robin")
    was = _count("colocated", "round_robin", "no_worker", "")
    for _ in range(3):
        with pytest.raises(NoWorkerError):
            router.pick([])
    assert _count("colocated", "round_robin", "no_worker", "") - was == 3
    assert _count("colocated", "round_robin", "picked", "") == 0


def test_a_departed_workers_series_are_removed() -> None:
    router = Router("decode", "round_robin")
    gone = WorkerState("10.9.9.9:1")
    router.pick([gone])
    assert _count("decode", "round_robin", "picked", gone.address) == 1
    router.forget(gone.address)
    labels = {
        "pool": "decode",
        "policy": "round_robin",
        "outcome": "picked",
        "target": gone.address,
    }
    assert REGISTRY.get_sample_value(NAME, labels) is None
    router.forget(gone.address)  # forgetting twice is harmless
