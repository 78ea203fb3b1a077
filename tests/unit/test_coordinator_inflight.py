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


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0)


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


def test_new_requests_are_refused_once_the_decode_lines_have_no_room() -> None:
    """A decode worker with `--handoff-wait-ms` reports how many more handoffs its line has
    room for within that bound. While the requests this coordinator has in prefill would
    fill the room of every routable decode worker, a new request is refused at arrival
    (RESOURCE_EXHAUSTED with a retry hint), before the tokenizer or any prefill; a worker
    reporting no limit (no line) lifts it, and a request leaving prefill gives its count
    back. Requests stay "in prefill" here by waiting for a prefill worker (there is none)."""
    from pdserve.services.coordinator.pool import WorkerEndpoint, WorkerPool
    from pdserve.v1 import worker_pb2

    async def main() -> None:
        frontend = BlockedFrontend()
        frontend.release.set()
        decode = WorkerPool("decode", [], lambda c: c)
        prefill = WorkerPool("prefill", [], lambda c: c, wait_for_worker_s=600)
        workers = [WorkerEndpoint(f"10.0.0.{i}:5000") for i in (1, 2)]
        for worker in workers:
            decode.workers[worker.address] = worker
        coordinator = Coordinator(
            frontend,  # type: ignore[arg-type]
            prefill=prefill,
            decode=decode,
            worker_id="saturation-test",
        )
        taken: list[asyncio.Future] = []

        async def run() -> None:
            async for _ in coordinator.generate(generate_pb2.GenerateRequest(prompt="x")):
                pass

        async def take() -> None:
            """A request that is taken: it reaches prefill and waits there."""
            taken.append(asyncio.ensure_future(run()))
            await until(lambda: coordinator.prefilling == len(taken))

        async def refused() -> RequestFailed:
            entered = frontend.entered
            with pytest.raises(RequestFailed) as e:
                await run()
            assert frontend.entered == entered  # refused before the tokenizer
            return e.value

        def report(worker: WorkerEndpoint, room: int | None) -> None:
            decode._apply(worker, worker_pb2.WatchResponse(handoff_room=room))

        report(workers[0], 1)
        await take()  # the other worker sets no limit
        report(workers[1], 0)  # saturated: room 1 in all, and one request in prefill
        error = await refused()
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_after_s == 1
        assert "saturated" in error.message and "room for 1 more" in error.message
        report(workers[0], 3)
        await take()
        await take()
        await refused()  # three in prefill, room for three
        workers[1].draining = True  # leaving: its room counts for nothing, its limit neither
        await refused()
        taken.pop().cancel()  # a request leaves prefill: its count goes back
        await until(lambda: coordinator.prefilling == len(taken))
        await take()
        report(workers[0], None)  # its line is gone: no limit
        await take()
        for task in taken:
            task.cancel()
        await asyncio.gather(*taken, return_exceptions=True)
        assert coordinator.prefilling == 0 and coordinator.inflight == 0
        await decode.close()
        await prefill.close()

    asyncio.run(main())
