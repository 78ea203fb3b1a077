"""Decode-side back-pressure and the "waiting for remote KV" line, step 6 of a request's
path, owned by the scheduler (vLLM v1's WAITING_FOR_REMOTE_KVS): a prefilled request is
admitted only when blocks for its prompt and first token can be allocated (reusing this
worker's cached prefix), the batch has a free slot (`max_num_seqs`, counting requests still
pulling) and a decode step with it joined is predicted within the TPOT target (by the step
costs this worker measured; `--tpot-target-ms`). Requests that do not fit wait in a bounded
FIFO, retried at every engine step; past the bound (`--max-pending`), new ones are refused.
With `--handoff-wait-ms` the worker also says when it is saturated: a new handoff would wait
longer than that for its slot, at the rate the line's head has been getting one since the
line formed (one leaving stream can free blocks for several), or, until that is known, at
the rate streams have been leaving the batch. Its status carries that to the coordinators,
which then refuse new requests at arrival (before any prefill) instead of queueing every
stream's second token behind a growing line.

Engine thread, but for `landed` and `abandon`: the pull runs on the event loop and reports
its end through them (a lock-protected list the next step reads, as vLLM's
`get_finished`), so a decode request crosses into the engine thread once, on arrival."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from pdserve.common.request import Request, RequestStatus
from pdserve.common.step_cost import attention_pairs

if TYPE_CHECKING:
    from pdserve.common.scheduler import Scheduler

# How many recent departures from the batch, and grants to the line, the prediction keeps.
EVENTS_KEPT = 8


class RemoteQueueFull(RuntimeError):
    """More requests wait for KV blocks than the queue allows."""


class RemoteKvQueue:
    def __init__(
        self,
        scheduler: Scheduler,
        max_pending: int = 64,
        max_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.kv_cache = scheduler.kv_cache
        self.max_pending = max_pending
        self.max_wait_s = max_wait_s  # 0: never saturated
        self.pending: deque[tuple[Request, Future[int]]] = deque()
        self._reserved: set[Request] = set()  # blocks allocated, pull under way
        self._clock = clock
        # Pulls that ended since the last step: (joins the batch?, request), in order.
        self._ended: list[tuple[bool, Request]] = []
        self._lock = threading.Lock()
        # Wakes an idle engine when a pull ended (set by the engine's loop).
        self.notify: Callable[[], None] = lambda: None
        self.is_saturated = False  # as of the last step (read by the status stream)
        # When streams left the batch (seen at step boundaries), the most recent last.
        self._departures: deque[float] = deque(maxlen=EVENTS_KEPT)
        # When the line's head got its slot, since the line last formed.
        self._grants: deque[float] = deque(maxlen=EVENTS_KEPT)
        self._finished_seen = scheduler.stats.num_finished

    def busy(self) -> bool:
        """Requests wait, pull or have ended a pull: the engine's steps have work here."""
        return bool(self.pending or self._reserved or self._ended)

    # ---- any thread: the end of a pull ---------------------------------------------------

    def landed(self, request: Request) -> None:
        """Its blocks are filled: it joins the running batch at the next step."""
        self._end(True, request)

    def abandon(self, request: Request) -> None:
        """It is gone before it finished (a failed pull, a caller that left): at the next
        step it leaves the line, gives back its reserved blocks, or is aborted in the
        batch."""
        self._end(False, request)

    def _end(self, joins: bool, request: Request) -> None:
        with self._lock:
            self._ended.append((joins, request))
        self.notify()

    # ---- the engine thread ---------------------------------------------------------------

    def step(self) -> None:
        """Before the scheduler schedules: landed pulls join the batch, abandoned requests
        go, and waiting ones are admitted while they fit."""
        with self._lock:
            ended, self._ended = self._ended, []
        for joins, request in ended:
            if joins:
                self.start(request)
            else:
                self.withdraw(request)
        self.admit()
        self.is_saturated = self.saturated()

    def submit(self, request: Request) -> Future[int]:
        """A future of the number of leading blocks served from the local prefix cache,
        resolved once the request's blocks are allocated."""
        future: Future[int] = Future()
        if not self.pending:
            num_cached = self._reserve(request)
            if num_cached is not None:
                future.set_result(num_cached)
                return future
        if len(self.pending) >= self.max_pending:
            raise RemoteQueueFull(
                f"{len(self.pending)} requests already wait for KV blocks on this decode "
                f"worker (max_pending {self.max_pending}); retry later or elsewhere"
            )
        if not self.pending:  # a line forms: its rate is its own
            self._grants.clear()
        self.pending.append((request, future))
        return future

    def saturated(self) -> bool:
        """Whether a new handoff is predicted to wait past `max_wait_s` for its slot."""
        if not self.max_wait_s or not self.pending:
            return False
        wait = self.predicted_wait_s(len(self.pending) + 1)
        return wait is not None and wait > self.max_wait_s

    def predicted_wait_s(self, place: int) -> float | None:
        """How long the `place`-th in line (1: the head) is predicted to wait for a slot, as
        of the last `admit`: `place` grants at the rate of the line's last few grants since it
        formed, or, until it has had grants at two moments, `place` departures at the rate
        of the last few streams to leave the batch since it was last idle (those of one step
        count as one moment). Either rate decays while nothing happens. None until known."""
        now = self._clock()
        per_place = _seconds_apart(self._grants, now)
        if per_place is None:
            per_place = _seconds_apart(self._departures, now)
        return None if per_place is None else place * per_place

    def admit(self) -> None:
        """Allocate for waiting requests, oldest first, while they fit."""
        now = self._clock()
        scheduler = self.scheduler
        finished = scheduler.stats.num_finished
        self._departures.extend([now] * min(finished - self._finished_seen, EVENTS_KEPT))
        self._finished_seen = finished
        self._grant_line(now)
        if not scheduler.running and not self._reserved:  # idle: the old rate says nothing
            self._departures.clear()

    def _grant_line(self, now: float) -> None:
        while self.pending:
            request, future = self.pending[0]
            if future.cancelled():
                self.pending.popleft()
                continue
            num_cached = self._reserve(request)
            if num_cached is None:
                return
            self.pending.popleft()
            if future.set_running_or_notify_cancel():
                self._grants.append(now)
                future.set_result(num_cached)
            else:
                self._reserved.discard(request)
                self.kv_cache.free(request)

    def start(self, request: Request) -> None:
        """The pull filled the blocks: register them and join the running batch."""
        if request not in self._reserved:  # withdrawn meanwhile
            return
        self._reserved.discard(request)
        request.num_computed_tokens = request.num_prompt_tokens
        request.scheduled_time = time.monotonic()
        self.kv_cache.cache_full_blocks(request)
        self.scheduler.add_running(request)

    def withdraw(self, request: Request) -> None:
        """The request is gone before it finished: drop it from the queue, give back its
        reserved blocks, or abort it in the batch."""
        for i, (queued, future) in enumerate(self.pending):
            if queued is request:
                del self.pending[i]
                future.cancel()
                return
        self._reserved.discard(request)
        if self.scheduler.requests.get(request.request_id) is request:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        elif not request.finished:
            self.kv_cache.free(request)

    def _reserve(self, request: Request) -> int | None:
        """Allocate blocks for the prompt and the first token, reusing this worker's cached
        prefix: how many leading blocks came from the cache (the rest must be pulled), or
        None when they do not fit now (or its blocks in the tier below the pool are still
        being read: an idle engine waits for them)."""
        scheduler = self.scheduler
        if len(scheduler.running) + len(self._reserved) >= scheduler.max_num_seqs:
            return None
        if not self._within_tpot_target(request):
            return None
        kv = self.kv_cache
        if not kv.load_from_tier(request, wait=not scheduler.running):
            return None
        cached = kv.find_cached_prefix(request)
        num_cached = len(cached) * kv.block_size
        if not kv.allocate_slots(request, request.num_tokens - num_cached, cached):
            return None
        request.num_cached_tokens = num_cached
        scheduler.stats.prefix_cache_queries += request.num_prompt_tokens
        scheduler.stats.prefix_cache_hits += num_cached
        self._reserved.add(request)
        return len(cached)

    def _within_tpot_target(self, request: Request) -> bool:
        """Whether a decode step with `request` joined is predicted within the TPOT target.
        Always true for a batch of its own, while the step costs are unmeasured, and where
        the target is out of reach (a step of one stream alone misses it: then no batch
        size meets it, and the largest batch serves the most)."""
        scheduler = self.scheduler
        target, model = scheduler.tpot_target_s, scheduler.step_cost
        batch = [*scheduler.running, *self._reserved]
        if not target or not batch:
            return True
        alone = model.predict(1, 0, attention_pairs(request.num_tokens - 1, 1))
        if alone is None or alone > target:
            return True
        attention = sum(attention_pairs(r.num_tokens - 1, 1) for r in (*batch, request))
        seconds = model.predict(len(batch) + 1, 0, attention)
        return seconds is None or seconds <= target


def _seconds_apart(events: deque[float], now: float) -> float | None:
    """The mean time per event since the oldest kept (events at one moment count together:
    one departure can let several in at once); None until one came after the oldest."""
    if not events or now <= events[0]:
        return None
    later = sum(1 for t in events if t > events[0])
    return (now - events[0]) / later if later else None
