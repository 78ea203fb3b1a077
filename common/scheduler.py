"""The continuous-batching scheduler: each engine step, decide which requests advance and
by how many tokens.

There are no prefill or decode phases. Every request has `num_computed_tokens`; a step has
a token budget (`max_num_batched_tokens`). Running requests go first, oldest first: a
decoding request needs one token, a request still in its prompt takes as much of the budget
as is left (chunked prefill). Then waiting requests are admitted, each first looking up its
prompt's prefix in the cache, while the budget, `max_num_seqs` and free KV blocks allow.
When a running request cannot get a block, the newest running request is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed later (its
full blocks usually survive in the prefix cache, so recomputation is often a cache hit).
With a KV tier, a preemption either swaps (the freed full blocks go to the tier when the
pool evicts them, and come back from it on resume) or recomputes (they are dropped), by the
measured cost of each (`KVCacheManager.swap_pays`). Before admission, a request's prefix
blocks in a tier are read back into the pool (`load_from_tier`).

With a TPOT target, a step that carries decodes takes only the prefill tokens its measured
cost allows (`StepPlan`): prompt chunks shrink while streams run and grow when none do.

The two ends of the KV handoff meet the batch here too, before each step schedules: on a
prefill worker, the blocks of leases that ended (pulled, released) or expired go back
(`leases`); on a decode worker, requests whose KV another worker computed wait for blocks,
are pulled, and join the running batch (`remote`; see `common/handoff`)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.common.errors import InvalidRequestError
from pdserve.common.handoff.leases import LeaseTable
from pdserve.common.handoff.remote_queue import RemoteKvQueue
from pdserve.common.kv_cache_manager import KVCacheManager
from pdserve.common.request import Request, RequestStatus
from pdserve.common.step_cost import StepCostModel, StepPlan, attention_pairs

logger = logging.getLogger(__name__)
TARGET_WARNING_INTERVAL_S = 60.0  # an unmeetable TPOT target is logged at most this often


@dataclass
class ScheduledBatch:
    """One step's work. Requests advancing by one token (decodes) come first, then the
    prefill chunks; `num_new_tokens[i]` belongs to `requests[i]`."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class SchedulerStats:
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    num_preemptions_swapped: int = 0  # of which kept their KV for the tiers
    num_finished: int = 0  # requests that left for good (stopped, length, aborted)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        step_cost: StepCostModel | None = None,
        tpot_target_s: float = 0.0,
    ) -> None:
        """`step_cost` (learned by the engine) and `tpot_target_s` (0: none) size the
        prefill chunks of steps that carry decodes."""
        self.kv_cache = kv_cache
        self.step_cost = step_cost or StepCostModel()
        self.tpot_target_s = tpot_target_s
        self._next_target_warning = 0.0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        # The handoff's two ends (a prefill worker's leases, a decode worker's line of
        # requests whose KV comes from elsewhere); each worker configures its own.
        self.leases = LeaseTable(lease_s=30.0)
        self.remote = RemoteKvQueue(self)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(
                "request_id", f"{request.request_id!r} is already in use here"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.kv_cache.prefetch(request)

    def has_unfinished(self) -> bool:
        """Requests in the batch or its queue, or handoffs whose state only a step moves
        (leases to expire or free, requests waiting for, or done with, a pull)."""
        return bool(self.requests) or self.leases.busy() or self.remote.busy()

    def settle_handoffs(self) -> None:
        """Free the blocks of leases that ended or expired; let pulled requests join,
        abandoned ones go, and waiting ones take blocks while they fit."""
        for request in self.leases.collect():
            self.kv_cache.free(request)
        self.remote.step()

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> ScheduledBatch:
        self.settle_handoffs()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        plan = self._plan()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 1:  # a prompt chunk: as much as the step's time allows
                num_new = plan.prefill_tokens(request.num_computed_tokens, num_new)
                if num_new == 0:
                    i += 1
                    continue
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1
                continue
            break

        # Admitting new work right after a preemption would only cause more of it.
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            # Its prefix blocks in the tier below come back first; an engine with nothing
            # running waits for the reads, a busy one tries again next step.
            if not self.kv_cache.load_from_tier(request, wait=not self.running):
                break
            cached = self.kv_cache.find_cached_prefix(request)
            num_cached = len(cached) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if num_new > 1:
                num_new = plan.prefill_tokens(num_cached, num_new)
                if num_new == 0:
                    break
            if not self.kv_cache.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:  # first admission, not a resume
                request.scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
                self.stats.prefix_cache_queries += request.num_tokens
                self.stats.prefix_cache_hits += num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

        decodes = [(r, n) for r, n in scheduled if n == 1]
        prefills = [(r, n) for r, n in scheduled if n != 1]
        ordered = decodes + prefills
        return ScheduledBatch(
            requests=[r for r, _ in ordered],
            num_new_tokens=[n for _, n in ordered],
            num_decodes=len(decodes),
            preempted=preempted,
        )

    def _plan(self) -> StepPlan:
        decodes = [] if not self.tpot_target_s else [
            r for r in self.running if r.num_tokens - r.num_computed_tokens == 1
        ]  # fmt: skip
        attention = sum(attention_pairs(r.num_computed_tokens, 1) for r in decodes)
        plan = StepPlan(
            self.step_cost, self.tpot_target_s, len(decodes), attention,
            min_chunk=self.kv_cache.block_size, warmup_chunk=8 * self.kv_cache.block_size,
        )  # fmt: skip
        now = time.monotonic()
        prompts_wait = bool(self.waiting) or len(decodes) < len(self.running)
        if prompts_wait and now >= self._next_target_warning:
            unmet = plan.unmet_target()
            if unmet is not None:
                self._next_target_warning = now + TARGET_WARNING_INTERVAL_S
                logger.warning(unmet)
        return plan

    def prefill_wait_s(self, request: Request) -> float | None:
        """Predicted seconds until `request`, queued now, has its first token: the prompts
        still to prefill ahead of it (running chunks, then the waiting queue, each after its
        cached prefix) and its own, beside the streams decoding now and the prompts ahead
        that join them once prefilled (None while the step costs are unmeasured)."""

        def outputs_left(r: Request) -> int:  # at most: max_tokens, not a stop, bounds it
            return r.sampling_params.max_tokens - r.num_output_tokens

        def prompt(r: Request, start: int) -> tuple[int, int, int]:
            # A prefilled prompt makes its first token, then decodes the rest here unless
            # it is handed off (a prefill worker's).
            return (start, r.num_tokens - start, 0 if r.prefill_only else outputs_left(r) - 1)

        prompts: list[tuple[int, int, int]] = []
        streams: list[tuple[int, int]] = []
        for r in self.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                streams.append((r.num_computed_tokens, outputs_left(r)))
            else:
                prompts.append(prompt(r, r.num_computed_tokens))
        for r in (*self.waiting, request):
            prompts.append(
                prompt(r, len(self.kv_cache.find_cached_prefix(r)) * self.kv_cache.block_size)
            )
        return self.step_cost.prefill_wait_s(
            prompts, streams, self.tpot_target_s, self.kv_cache.block_size,
            self.max_num_batched_tokens,
        )  # fmt: skip

    def on_step_computed(self, batch: ScheduledBatch) -> None:
        """The batch's KV is written: advance each request and register its full blocks."""
        for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            request.num_computed_tokens += num_new
            self.kv_cache.cache_full_blocks(request)

    def add_running(self, request: Request) -> None:
        """Join a request whose KV is already in its blocks (pulled from a prefill worker)
        straight into the running batch."""
        if request.request_id in self.requests:
            raise InvalidRequestError(
                "request_id", f"{request.request_id!r} is already in use here"
            )
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stopped, length, aborted) and give back its blocks at once; a
        PREFILLED request keeps its blocks (the caller frees them after the handoff)."""
        assert status.finished
        if request.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        if status != RequestStatus.PREFILLED:
            self.kv_cache.free(request)
            self.stats.num_finished += 1
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _preempt(self, request: Request) -> None:
        # Swap (keep its blocks for the tiers) or recompute, by measured cost.
        swap = self.kv_cache.swap_pays(request)
        if swap:
            self.stats.num_preemptions_swapped += 1
        self.kv_cache.free(request, keep=swap)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)
