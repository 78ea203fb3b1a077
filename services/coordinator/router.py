"""Steps 2 and 4 of a request's path: which worker of a pool takes it. Pure decisions over
what the coordinator knows of each worker (`WorkerState`), so the same code runs in the
coordinator and in `benchmarks/route_sim.py`. Policies:

- `prefix_aware` (the default): a prefill worker's cost is the prompt blocks it would have
  to compute (those its prefix cache does not hold, from `PrefixIndex`) times
  `prefix_weight`, plus its queue (requests running or waiting there) times `load_weight`;
  the cheapest wins, ties going round-robin. Blocks of a prompt just sent to a worker count
  as held there until its report arrives (`ProvisionalHolds`). A block in one of the
  worker's tiers below the pool (host memory, disk) costs the fraction of a computed block
  the worker measured for bringing one back from that tier (`host_cost`, `offload_cost`;
  `DEFAULT_OFFLOAD_COST` until it has). A decode
  worker is picked by load alone: fewest sequences running or waiting, among those with
  room for the request's blocks.
- `least_loaded`: the fewest requests in flight or queued, round-robin among ties.
- `round_robin`.

Workers that are unhealthy or draining are never picked; `exclude` skips the ones a request
already failed on. Every decision is counted in
`pdserve_router_decisions_total{pool, policy, outcome, target}`: `outcome` is `picked`
(`target` the chosen worker's address) or `no_worker` (`target` empty)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from prometheus_client import Counter

from pdserve.services.coordinator.prefix_index import PrefixIndex, ProvisionalHolds

POLICIES = ("prefix_aware", "least_loaded", "round_robin")
DEFAULT_POLICY = "prefix_aware"

DECISIONS = Counter(
    "pdserve_router_decisions",
    "Routing decisions of the coordinator, by pool, policy and outcome (picked / no_worker)",
    ("pool", "policy", "outcome", "target"),
)


_QUEUE = attrgetter("queue")
# A tier block's cost, as a fraction of computing it, before its worker has measured one.
DEFAULT_OFFLOAD_COST = 0.5


class NoWorkerError(RuntimeError):
    """The pool has no worker to send to."""


@dataclass(eq=False)
class WorkerState:
    """What the router knows of one worker: its own reports, and this coordinator's calls.
    Call `update_queue` after changing `in_flight`, `num_running` or `num_waiting`."""

    address: str
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0  # this coordinator's requests there now
    num_running: int = 0  # reported
    num_waiting: int = 0  # reported
    free_blocks: int = 0  # reported (0 while unknown)
    total_blocks: int = 0
    offload_cost: float = 0.0  # reported: a disk-tier block's load over its compute (0: unknown)
    host_cost: float = 0.0  # reported: the same for its host-memory tier
    saturated: bool = False  # reported by a decode worker: handoffs would wait past its bound
    # Expert parallelism: the ranks of one group are endpoints of their own, but routable
    # only while every rank of the group is (`group_whole`, kept by the pool).
    group: str = ""
    group_size: int = 1
    group_whole: bool = True
    # Requests it is busy with: what it reports, or what this coordinator sent there since
    # (whichever is more). Kept as a field: routing reads it for every worker of a pool.
    queue: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.update_queue()

    def update_queue(self) -> None:
        self.queue = max(self.in_flight, self.num_running + self.num_waiting)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and self.group_whole


def _state(worker: WorkerState, exclude: Collection[WorkerState]) -> str:
    if worker in exclude:
        return "tried"
    if worker.draining:
        return "draining"
    return "unreachable" if not worker.healthy else "expert-parallel group incomplete"


@dataclass(frozen=True)
class RouterWeights:
    prefix_weight: float = 1.0  # cost per prompt block to compute
    load_weight: float = 8.0  # cost per request queued on the worker, in blocks


class Router:
    def __init__(
        self,
        pool: str,
        policy: str = DEFAULT_POLICY,
        weights: RouterWeights | None = None,
        index: PrefixIndex | None = None,
        offload_index: PrefixIndex | None = None,
        host_index: PrefixIndex | None = None,
        provisional: ProvisionalHolds | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.pool = pool
        self.policy = policy
        self.weights = weights or RouterWeights()
        self.index = index
        self.offload_index = offload_index  # the disk tiers below the workers' pools
        self.host_index = host_index  # their host-memory tiers
        self.provisional = provisional  # sent to a worker, not reported by it yet
        self._turn = itertools.count()

    def pick(
        self,
        workers: Sequence[WorkerState],
        hashes: Sequence[int] = (),
        blocks_needed: int = 0,
        exclude: Collection[WorkerState] = (),
        count_no_worker: bool = True,
    ) -> WorkerState:
        """The worker for a request whose prompt has these full-block `hashes` and needs
        `blocks_needed` KV blocks. Raises `NoWorkerError` (counted unless the caller will
        try again: it then calls `no_worker` when it gives up)."""
        candidates = [w for w in workers if w.routable]
        if exclude:
            candidates = [w for w in candidates if w not in exclude]
        if not candidates:
            if count_no_worker:
                self.no_worker()
            known = len(workers)
            why = "is configured" if not known else f"of {known} is healthy and untried"
            states = ", ".join(f"{w.address}: {_state(w, exclude)}" for w in workers[:4])
            raise NoWorkerError(f"no {self.pool} worker {why}" + (f" ({states})" if states else ""))
        start = next(self._turn) % len(candidates)
        order = candidates[start:] + candidates[:start]  # ties go round-robin
        if self.policy == "round_robin":
            chosen = order[0]
        elif self.policy == "least_loaded" or self.pool != "prefill":
            chosen = self._least_loaded(order, blocks_needed)
        else:
            chosen = self._cheapest_prefill(order, hashes)
        DECISIONS.labels(self.pool, self.policy, "picked", chosen.address).inc()
        return chosen

    def no_worker(self) -> None:
        DECISIONS.labels(self.pool, self.policy, "no_worker", "").inc()

    def forget(self, address: str) -> None:
        """Drop a departed worker's series, so they do not grow with every address seen."""
        with contextlib.suppress(KeyError):
            DECISIONS.remove(self.pool, self.policy, "picked", address)

    @staticmethod
    def _least_loaded(order: list[WorkerState], blocks_needed: int) -> WorkerState:
        if blocks_needed:
            roomy = [w for w in order if w.free_blocks >= blocks_needed or not w.total_blocks]
            order = roomy or order
        return min(order, key=_QUEUE)

    def _cheapest_prefill(self, order: list[WorkerState], hashes: Sequence[int]) -> WorkerState:
        """Most workers cache nothing of a prompt: the best of those is the least loaded
        (one C-level scan); only the few that cache some of it are costed one by one."""
        w_prefix, w_load = self.weights.prefix_weight, self.weights.load_weight
        best = min(order, key=_QUEUE)
        if self.index is None or not hashes:
            return best
        sent = self._sent()
        in_pool = self.index.overlaps_with(sent, hashes) if sent else self.index.overlaps(hashes)
        tiers = [t for t in (self.host_index, self.offload_index) if t is not None and t.has_any()]
        reach = self.index.overlaps_with(sent + tiers, hashes) if tiers else in_pool
        if not reach:
            return best
        best_cost = w_prefix * len(hashes) + w_load * best.queue
        by_address = {w.address: w for w in order}
        for address, overlap in reach.items():
            worker = by_address.get(address)
            if worker is None:
                continue
            blocks = len(hashes) - overlap
            blocks += self._tier_blocks(worker, hashes, in_pool, overlap, sent)
            cost = w_prefix * blocks + w_load * worker.queue
            if cost < best_cost:
                best, best_cost = worker, cost
        return best

    def _sent(self) -> list[PrefixIndex]:
        """The provisional holds as an index to overlap with, if any."""
        held = self.provisional
        return [held.index] if held is not None and held.index.has_any() else []

    def _tier_blocks(
        self,
        worker: WorkerState,
        hashes: Sequence[int],
        in_pool: dict,
        overlap: int,
        sent: Sequence[PrefixIndex],
    ) -> float:
        """What the blocks of the reach past the worker's pool run cost, in computed blocks:
        0 for one its pool holds after all, its host tier's cost, else its disk tier's."""
        pooled = in_pool.get(worker.address, 0)
        if overlap <= pooled:
            return 0.0
        host_cost = worker.host_cost or DEFAULT_OFFLOAD_COST
        disk_cost = worker.offload_cost or DEFAULT_OFFLOAD_COST
        total = 0.0
        for h in hashes[pooled:overlap]:
            if any(i.holds(worker.address, h) for i in (self.index, *sent) if i is not None):
                continue
            if self.host_index is not None and self.host_index.holds(worker.address, h):
                total += host_cost
            else:
                total += disk_cost
        return total
