"""Step 2 and 5 of a request's path: which worker of a pool takes it. Policies:
`least_loaded` (fewest requests this coordinator has in flight there, round-robin among
ties; the default) and `round_robin`. Prefix-aware routing comes with scale-out.

Every decision is counted in `pdserve_router_decisions_total{pool, policy, outcome, target}`:
`outcome` is `picked` (`target` the chosen worker's address) or `no_worker` (`target`
empty)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import grpc
from prometheus_client import Counter

POLICIES = ("least_loaded", "round_robin")

DECISIONS = Counter(
    "pdserve_router_decisions",
    "Routing decisions of the coordinator, by pool, policy and outcome (picked / no_worker)",
    ("pool", "policy", "outcome", "target"),
)


class NoWorkerError(RuntimeError):
    """The pool has no worker to send to."""


@dataclass(eq=False)
class WorkerEndpoint:
    address: str
    stub: Any
    channel: grpc.aio.Channel
    in_flight: int = 0


class WorkerPool:
    def __init__(
        self,
        role: str,
        addresses: Sequence[str],
        make_stub: Callable[[grpc.aio.Channel], Any],
        policy: str = "least_loaded",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.role = role
        self.policy = policy
        self.workers: list[WorkerEndpoint] = []
        for address in addresses:
            channel = grpc.aio.insecure_channel(address)
            self.workers.append(WorkerEndpoint(address, make_stub(channel), channel))
        self._turn = itertools.count()

    def __len__(self) -> int:
        return len(self.workers)

    def pick(self) -> WorkerEndpoint:
        if not self.workers:
            DECISIONS.labels(self.role, self.policy, "no_worker", "").inc()
            raise NoWorkerError(f"no {self.role} worker is configured")
        start = next(self._turn) % len(self.workers)
        order = self.workers[start:] + self.workers[:start]
        by_load = attrgetter("in_flight")
        chosen = order[0] if self.policy == "round_robin" else min(order, key=by_load)
        DECISIONS.labels(self.role, self.policy, "picked", chosen.address).inc()
        return chosen

    @contextlib.contextmanager
    def track(self, worker: WorkerEndpoint) -> Iterator[WorkerEndpoint]:
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1

    async def close(self) -> None:
        for worker in self.workers:
            await worker.channel.close()
