"""A decode worker that refuses a handoff as busy (RESOURCE_EXHAUSTED before pulling a
block) after the client already has its first token: the coordinator waits and tries again
while the prefill lease lasts, so the stream completes; once the lease is too short, the
request fails with the refusal and prefill's lease is released. Stand-in pools and stubs
(their real twin: tests/integration/test_overload.py, a real decode worker's full queue)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.services.coordinator.request_path import Coordinator, RequestFailed
from pdserve.services.frontend import ParsedRequest
from pdserve.v1 import decode_pb2, generate_pb2, kv_pb2, prefill_pb2


class Frontend:
    async def parse_async(self, request, fill_context=False) -> ParsedRequest:
        return ParsedRequest("r", [1, 2, 3], SamplingParams(max_tokens=3))


class PrefillCall:
    def __init__(self, response) -> None:
        self.response = response

    def __await__(self):
        async def reply():
            return self.response

        return reply().__await__()

    def cancel(self) -> None:
        pass


BUSY = "4 requests already wait for KV blocks on this decode worker"


class DecodeCall:
    """Fails with `code` before the handoff, or streams the handoff message and two
    tokens."""

    def __init__(self, code: grpc.StatusCode | None) -> None:
        self.code = code

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        if self.code is not None:
            raise grpc.aio.AioRpcError(
                self.code,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(("retry-after", "1")),
                BUSY if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "CANCELLED",
            )
        yield decode_pb2.DecodeResponse(pulled_blocks=1)
        yield decode_pb2.DecodeResponse(token_ids=[11], text="b")
        yield decode_pb2.DecodeResponse(token_ids=[12], text="c", finish_reason="length")

    def cancel(self) -> None:
        pass


class Stub:
    def __init__(
        self,
        refusals: int,
        lease_s: float,
        code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
    ) -> None:
        self.refusals, self.lease_s, self.code = refusals, lease_s, code
        self.decode_calls = 0
        self.released: list[str] = []

    def Prefill(self, request, timeout=None, metadata=None):
        handle = kv_pb2.KvHandle(
            lease_id="lease-1", block_size=16, lease_ttl_ms=int(self.lease_s * 1000)
        )
        return PrefillCall(
            prefill_pb2.PrefillResponse(first_token_id=10, text="a", kv_handle=handle)
        )

    def Decode(self, request, timeout=None, metadata=None):
        self.decode_calls += 1
        return DecodeCall(self.code if self.decode_calls <= self.refusals else None)

    async def ReleaseKv(self, request, timeout=None):
        self.released.append(request.lease_id)


class Worker:
    def __init__(self, stub: Stub) -> None:
        self.stub, self.address = stub, "127.0.0.1:1"


class Pool:
    block_size = 16

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.failures = 0

    async def pick(self, *args, **kwargs) -> Worker:
        return self.worker

    def track(self, worker):
        return contextlib.nullcontext()

    def failed(self, worker) -> None:
        self.failures += 1

    def saturated(self) -> bool:
        return False


def coordinator_over(stub: Stub) -> Coordinator:
    """A coordinator whose prefill and decode pools are one stand-in worker on `stub`."""
    worker = Worker(stub)
    return Coordinator(
        Frontend(),  # type: ignore[arg-type]
        prefill=Pool(worker),  # type: ignore[arg-type]
        decode=Pool(worker),  # type: ignore[arg-type]
        worker_id="handoff-retry-test",
    )


def serve(
    stub: Stub, coordinator: Coordinator | None = None
) -> tuple[list[generate_pb2.GenerateResponse], Exception | None]:
    async def main():
        nonlocal coordinator
        coordinator = coordinator or coordinator_over(stub)
        responses: list[generate_pb2.GenerateResponse] = []
        error = None
        try:
            async for response in coordinator.generate(generate_pb2.GenerateRequest(prompt="x")):
                responses.append(response)
        except RequestFailed as e:
            error = e
        await asyncio.gather(*coordinator._background)
        return responses, error

    return asyncio.run(main())


def test_a_refused_handoff_is_retried_and_the_stream_completes() -> None:
    stub = Stub(refusals=2, lease_s=30)
    responses, error = serve(stub)
    assert error is None
    assert stub.decode_calls == 3  # refused twice, then served
    assert [t for r in responses for t in r.token_ids] == [10, 11, 12]
    assert responses[-1].finish_reason == "length"
    assert stub.released == []  # decode pulled the lease's blocks


def test_a_decode_call_cancelled_by_a_stopping_server_goes_on_elsewhere() -> None:
    """A server that stops drops the calls it had not handed to a handler yet as CANCELLED
    (grpc/grpc#41785, a draining decode worker): that is the worker going away, not the
    client's cancel, so the request continues as after a lost worker."""
    stub = Stub(refusals=1, lease_s=30, code=grpc.StatusCode.CANCELLED)
    coordinator = coordinator_over(stub)
    responses, error = serve(stub, coordinator)
    assert error is None
    assert stub.decode_calls == 2
    assert coordinator.decode is not None and coordinator.decode.failures == 1  # type: ignore[attr-defined]
    assert responses[-1].finish_reason == "length"


@pytest.mark.parametrize("lease_s", [0.5, 0.0])
def test_a_refusal_near_the_lease_end_fails_and_releases_the_lease(lease_s: float) -> None:
    stub = Stub(refusals=100, lease_s=lease_s)
    responses, error = serve(stub)
    assert isinstance(error, RequestFailed)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "already wait for KV blocks" in error.message
    assert stub.decode_calls == 1  # no time left to try again
    assert [t for r in responses for t in r.token_ids] == [10]
    assert stub.released == ["lease-1"]


def test_new_requests_are_refused_while_a_handoff_waits() -> None:
    """Back-pressure: while a prefilled request waits for a busy decode pool, a new request
    is refused at arrival (RESOURCE_EXHAUSTED, retry after 1 s) rather than prefilled to
    wait behind it; once the handoff is taken, new requests are served again."""

    async def main():
        stub = Stub(refusals=3, lease_s=30)
        coordinator = coordinator_over(stub)
        first = coordinator.generate(generate_pb2.GenerateRequest(prompt="x"))
        assert (await anext(first)).token_ids == [10]
        waiting = asyncio.ensure_future(anext(first))  # refused by decode, now waiting
        while stub.decode_calls < 2:
            await asyncio.sleep(0.005)
        assert coordinator.handoffs_waiting == 1
        with pytest.raises(RequestFailed) as refused:
            await anext(coordinator.generate(generate_pb2.GenerateRequest(prompt="y")))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.retry_after_s == 1
        assert "wait for a decode worker" in refused.value.message
        assert (await waiting).token_ids == [11]
        assert coordinator.handoffs_waiting == 0
        assert [t async for r in first for t in r.token_ids] == [12]
        later = [
            t
            async for r in coordinator.generate(generate_pb2.GenerateRequest())
            for t in r.token_ids
        ]
        await asyncio.gather(*coordinator._background)
        return later

    assert asyncio.run(main()) == [10, 11, 12]
