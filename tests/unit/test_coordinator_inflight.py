"""`--max-inflight-requests` counts a request from its arrival, while it waits for the
tokenizer too: a flood of long prompts queues there no further than the limit, the next one
is refused at once (RESOURCE_EXHAUSTED with a retry hint) without reaching the tokenizer,
and every way out (refused after tokenizing, cancelled while tokenizing, failed later, done)
gives its place back. A stand-in frontend whose tokenizing waits on an event (no timing)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.coordinator.request_path import Coordinator, RequestFailed
from pdserve.services.coordinator.router import NoWorkerError
from pdserve.services.frontend import ParsedRequest
from pdserve.v1 import generate_pb2


class BlockedFrontend:
    """`parse_async` waits until released; then refuses prompts saying "bad", parses the
    others."""

    def __init__(self) -> None:
        self.entered = 0
        self.release = asyncio.Event()

    async def parse_async(self, request, fill_context=False) -> ParsedRequest:
        self.entered += 1
        await self.release.wait()
        if request.prompt == "bad":
            raise InvalidRequestError("prompt", "refused after tokenizing")
        return ParsedRequest("r", [1, 2, 3], SamplingParams(max_tokens=1))


class NoWorkers:
    async def pick(self, *args, **kwargs):
        raise NoWorkerError("no colocated worker")


async def until(condition, timeout_s: float = 10.0) -> None:
    """Let the loop run until `condition()` holds; fails rather than hangs if it never does."""

    async def polled() -> None:
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(polled(), timeout_s)


def test_the_limit_counts_requests_still_being_tokenized() -> None:
    async def main() -> None:
        frontend = BlockedFrontend()
        coordinator = Coordinator(
            frontend,  # type: ignore[arg-type]
            colocated=NoWorkers(),  # type: ignore[arg-type]
            max_inflight=3,
            worker_id="inflight-test",
        )

        async def run(prompt: str) -> None:
            async for _ in coordinator.generate(generate_pb2.GenerateRequest(prompt=prompt)):
                pass

        waiting = [asyncio.ensure_future(run(p)) for p in ("bad", "good", "leaves")]
        await until(lambda: frontend.entered == 3)
        assert coordinator.inflight == 3
        with pytest.raises(RequestFailed) as refused:
            await run("one too many")
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.retry_after_s == 1
        assert frontend.entered == 3  # refused before the tokenizer saw it
        waiting[2].cancel()  # its client left while it waited for the tokenizer
        await until(lambda: coordinator.inflight == 2)
        frontend.release.set()
        with pytest.raises(RequestFailed) as bad:
            await waiting[0]
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(RequestFailed) as no_worker:
            await waiting[1]
        assert no_worker.value.code == grpc.StatusCode.UNAVAILABLE
        assert coordinator.inflight == 0  # every way out gave its place back
        with pytest.raises(RequestFailed) as again:
            await run("good")  # and new requests get in
        assert again.value.code == grpc.StatusCode.UNAVAILABLE
        assert coordinator.inflight == 0

    asyncio.run(main())


def test_new_requests_are_refused_while_every_decode_worker_is_saturated() -> None:
    """A decode worker reports `saturated` (a new handoff would wait past its
    `--handoff-wait-ms`): while every routable one does, a new request is refused at
    arrival (RESOURCE_EXHAUSTED with a retry hint), before the tokenizer or any prefill."""
    from pdserve.services.coordinator.pool import WorkerEndpoint, WorkerPool
    from pdserve.v1 import worker_pb2

    async def main() -> None:
        frontend = BlockedFrontend()
        frontend.release.set()
        decode = WorkerPool("decode", [], lambda c: c)
        prefill = WorkerPool("prefill", [], lambda c: c, wait_for_worker_s=0)  # none: 503
        workers = [WorkerEndpoint(f"10.0.0.{i}:5000") for i in (1, 2)]
        for worker in workers:
            decode.workers[worker.address] = worker
        coordinator = Coordinator(
            frontend,  # type: ignore[arg-type]
            prefill=prefill,
            decode=decode,
            worker_id="saturation-test",
        )

        async def outcome() -> grpc.StatusCode | None:
            try:
                async for _ in coordinator.generate(generate_pb2.GenerateRequest(prompt="x")):
                    pass
            except RequestFailed as e:
                return e.code
            return None

        def report(worker: WorkerEndpoint, saturated: bool) -> None:
            decode._apply(worker, worker_pb2.WatchResponse(saturated=saturated))

        report(workers[0], True)
        entered = frontend.entered
        assert await outcome() == grpc.StatusCode.UNAVAILABLE  # the other one is not: taken
        assert frontend.entered == entered + 1  # (then no prefill worker to serve it)
        report(workers[1], True)
        with pytest.raises(RequestFailed) as refused:
            async for _ in coordinator.generate(generate_pb2.GenerateRequest(prompt="x")):
                pass
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "saturated" in refused.value.message and refused.value.retry_after_s == 1
        assert frontend.entered == entered + 1  # refused before the tokenizer
        workers[1].draining = True  # saturated or leaving: still none to take it
        assert await outcome() == grpc.StatusCode.RESOURCE_EXHAUSTED
        report(workers[0], False)  # cleared
        assert await outcome() == grpc.StatusCode.UNAVAILABLE
        await decode.close()
        await prefill.close()

    asyncio.run(main())
