"""The engine inside a service: `LLMEngine` stepping in its own thread (the one that loaded
it, `EngineThread`), talking to the gRPC event loop.

The engine thread is the only one that touches the scheduler, the KV manager and the
model; everything else reaches them through `call` (run a function between two steps and
get its result as an awaitable). Each step's outputs go back to the event loop in one hop
and are routed to the per-request queues that `stream` reads. torch releases the GIL in its
kernels, so the event loop keeps serving RPCs while a step computes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pdserve.common import faults
from pdserve.common.engine import LLMEngine, Prompt, RequestOutput
from pdserve.common.errors import InvalidRequestError, WorkerBusyError
from pdserve.common.request import Request, Resume
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_thread import EngineThread, run_call

logger = logging.getLogger(__name__)
T = TypeVar("T")
OutputQueue = asyncio.Queue[RequestOutput]

IDLE_WAIT_S = 0.05  # how often an idle engine thread runs its housekeeping hooks


class EngineLoop:
    stop_join_s = 10.0  # how long `stop` waits for the engine thread to end

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        thread: EngineThread | None = None,
    ) -> None:
        """`thread`: the one that loaded `engine` (see `EngineThread`); None: a new one."""
        self.engine = engine
        self._loop = loop
        self.fault_point: str | None = None  # the step's name in `common/faults.py`
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._wake = threading.Condition()
        self._queues: dict[str, OutputQueue] = {}
        # The worker's own upkeep, run in the engine thread before every step and at least
        # every IDLE_WAIT_S when idle (metrics, a tensor-parallel group's keepalive).
        self.housekeeping: list[Callable[[], None]] = []
        # A handoff that ends off the engine thread (a pull landed, a lease ended) wakes it.
        engine.scheduler.remote.notify = engine.scheduler.leases.notify = self.wake
        self._stopped = False
        self._woken = False  # `wake` since the engine thread last looked
        self._thread = thread
        self.steps = 0
        # Requests that may wait for the batch at once (0: no limit); more are refused.
        self.max_pending = 0
        # A prompt whose first token is predicted later than this is refused (0: never).
        self.ttft_target_s = 0.0
        self._adding = 0  # submitted to the engine thread, not yet in its waiting queue

    def start(self) -> None:
        self._thread = self._thread or EngineThread()
        self._thread.submit(self._run).add_done_callback(_log_failure)
        self._thread.close()  # the thread ends with the loop

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=self.stop_join_s)

    # ---- called from the event loop ----------------------------------------------------

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` in the engine thread between steps; its exception is raised here."""
        return await asyncio.wrap_future(self.submit(fn))

    async def cleanup(self, fn: Callable[[], Any]) -> None:
        """Run `fn` (a request's cleanup) in the engine thread, queued before this returns
        control (so before anything a later request queues: a reused request id can never
        be aborted in its place, nor be refused as still in the engine), and wait for it
        even if the caller is cancelled meanwhile."""
        await asyncio.shield(asyncio.wrap_future(self.submit(fn)))

    def wake(self) -> None:
        """Have an idle engine thread look at its work again now (any thread)."""
        with self._wake:
            self._woken = True
            self._wake.notify()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn` for the engine thread without waiting for it (any thread)."""
        future: Future[T] = Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compile a structured-output constraint in a worker thread (once per distinct
        constraint: the engine thread then finds it compiled). Raises
        `InvalidRequestError` naming the field when it cannot be compiled."""
        if params.structured is not None:
            engine = self.engine
            await asyncio.to_thread(lambda: engine.grammars().compile(params.structured))

    async def add(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        prefill_only: bool = False,
        resume: Resume | None = None,
    ) -> Request:
        """Queue a request; its outputs go to `stream(request_id)`. If the caller is
        cancelled meanwhile, the request is dropped once the engine has it. Raises
        `WorkerBusyError` when `max_pending` requests already wait, or when its first token
        would miss `ttft_target_s`."""
        await self.compile_constraint(params)
        waiting = len(self.engine.scheduler.waiting) + self._adding
        if self.max_pending and waiting >= self.max_pending:
            raise WorkerBusyError(
                f"this worker has {waiting} requests waiting, its limit (--max-pending "
                f"{self.max_pending}); retry later or elsewhere"
            )
        queue = self.open_stream(request_id)
        self._adding += 1
        added = self.submit(
            lambda: self.engine.add_request(
                prompt, params, request_id, prefill_only, resume, self.ttft_target_s
            )
        )
        added.add_done_callback(self._on_added)
        try:
            return await asyncio.shield(asyncio.wrap_future(added))
        except asyncio.CancelledError:
            self.close_stream(request_id, queue)
            self.submit(lambda: added.exception() is None and self.engine.drop(added.result()))
            raise
        except BaseException:
            self.close_stream(request_id, queue)
            raise

    def _on_added(self, _: Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is already closed
            self._loop.call_soon_threadsafe(self._added)

    def _added(self) -> None:
        self._adding -= 1

    def open_stream(self, request_id: str) -> OutputQueue:
        """Route a request's outputs to a queue for `stream`."""
        if request_id in self._queues:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use here")
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    def queue(self, request_id: str) -> OutputQueue:
        """The queue `open_stream` (or `add`) made for the request now using this id."""
        return self._queues[request_id]

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs until the finished one. Leaving early (cancellation, a
        client gone) aborts the request in the engine and frees its blocks."""
        queue = self._queues[request_id]
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self.close_stream(request_id, queue)
            if not finished:
                await self.cleanup(lambda: self.engine.abort_request(request_id))

    def close_stream(self, request_id: str, queue: OutputQueue) -> None:
        """Stop routing outputs to `queue`. Only that one: once a request's stream ended,
        a new request may use its id (and have a queue of its own) before the old one's
        cleanup is done."""
        if self._queues.get(request_id) is queue:
            del self._queues[request_id]

    # ---- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                if not self._calls and not engine.has_unfinished_requests() and not self._stopped:
                    self._wake.wait(IDLE_WAIT_S)
                if self._stopped:
                    break
                calls, self._calls = self._calls, []
                self._woken = False
            self._run_calls(calls)
            if not engine.has_unfinished_requests():
                continue
            try:
                if self.fault_point is not None:
                    faults.hit(self.fault_point)  # a test's fault at this step, if armed
                outputs = engine.step()
            except Exception:
                if engine.runner.tp is not None:  # the other ranks are mid-step: fatal
                    logger.exception("tensor-parallel step failed")
                    print("pdserve: error: tensor-parallel step failed; exiting",
                          file=sys.stderr, flush=True)  # fmt: skip
                    os._exit(1)
                logger.exception("engine step failed; aborting its requests")
                outputs = self._abort_all()
            self.steps += 1
            if outputs:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
            elif engine.last_batch_size == 0:
                # Requests wait for blocks (held by leases or pulls) or only leases are held:
                # do not spin; a call or a handoff's end wakes us, leases expire on time.
                with self._wake:
                    if not self._calls and not self._woken and not self._stopped:
                        self._wake.wait(IDLE_WAIT_S)

    def _run_calls(self, calls: list[tuple[Callable[[], Any], Future[Any]]]) -> None:
        """The calls queued since the last step, then the housekeeping hooks."""
        for fn, future in calls:
            run_call(fn, future)
        for hook in self.housekeeping:
            try:
                hook()
            except Exception:
                logger.exception("engine housekeeping failed")

    def _abort_all(self) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self.engine.scheduler.requests):
            request = self.engine.scheduler.abort(request_id)
            if request is not None:
                outputs.append(aborted_output(request))
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def push(self, outputs: list[RequestOutput]) -> None:
        """From the engine thread: deliver outputs made outside a step."""
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)


def _log_failure(done: Future[Any]) -> None:
    if not done.cancelled() and done.exception() is not None:
        logger.error("the engine loop ended", exc_info=done.exception())


def aborted_output(request: Request) -> RequestOutput:
    request.finish_time = request.finish_time or time.monotonic()
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="abort",
        prompt_tokens=request.num_prompt_tokens,
        cached_tokens=request.num_cached_tokens,
        token_ids=request.output_token_ids,
        text=request.output_text,
    )
