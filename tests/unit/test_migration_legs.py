"""The coordinator's side of live migration, with stand-in workers (the real twin:
tests/integration/test_live_migration.py). A decode worker that drains ends a stream with a
`migrate_kv` handle; the coordinator goes on on another decode worker from it, asking for
exactly what the handle covers (the prompt and every token sent but the last), the last token
as the first, resumed as a failover resumes and with nothing prefilled. A move that fails
before the new worker has the KV releases the handle's lease and falls back to a recompute
leg; so does a handle that does not cover the stream. With no other decode worker the
draining one gets the stream back."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from pdserve.common.sampling_params import SamplingParams
from pdserve.services.coordinator.request_path import Coordinator
from pdserve.services.coordinator.router import NoWorkerError
from pdserve.services.frontend import ParsedRequest
from pdserve.v1 import decode_pb2, generate_pb2, kv_pb2, prefill_pb2

PROMPT = [1, 2, 3]
MAX_TOKENS = 6


class Frontend:
    async def parse_async(self, request, fill_context=False) -> ParsedRequest:
        return ParsedRequest("r", list(PROMPT), SamplingParams(max_tokens=MAX_TOKENS))


class Call:
    """A stand-in unary call (Prefill) or stream (Decode)."""

    def __init__(self, response=None, stream=()) -> None:
        self.response, self.stream = response, list(stream)

    def __await__(self):
        async def reply():
            return self.response

        return reply().__await__()

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        for item in self.stream:
            if isinstance(item, grpc.StatusCode):
                raise grpc.aio.AioRpcError(item, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")
            yield item

    def cancel(self) -> None:
        pass


class Channel:
    """What a `PrefillServiceStub` on a decode worker's channel calls: records releases."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def unary_unary(self, method, *args, **kwargs):
        async def call(request, timeout=None):
            self.released.append(request.lease_id)

        return call


class DecodeStub:
    def __init__(self, *streams) -> None:
        self.streams = list(streams)  # one per call, in order
        self.requests: list[decode_pb2.DecodeRequest] = []

    def Decode(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        return Call(stream=self.streams.pop(0))


class PrefillStub:
    def __init__(self) -> None:
        self.requests: list[prefill_pb2.PrefillRequest] = []

    def Prefill(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        handle = kv_pb2.KvHandle(lease_id="p-lease", block_size=16, lease_ttl_ms=30_000)
        token = 100 + len(request.prompt_token_ids)
        return Call(prefill_pb2.PrefillResponse(first_token_id=token, text="P", kv_handle=handle))

    async def ReleaseKv(self, request, timeout=None):
        pass


class Worker:
    def __init__(self, name: str, stub) -> None:
        self.address, self.stub, self.channel = name, stub, Channel()


class Pool:
    block_size = 16

    def __init__(self, *workers: Worker) -> None:
        self.workers = workers

    async def pick(self, *args, exclude=(), **kwargs) -> Worker:
        for worker in self.workers:
            if worker not in exclude:
                return worker
        raise NoWorkerError("no decode worker left")

    def track(self, worker):
        return contextlib.nullcontext()

    def failed(self, worker) -> None:
        pass

    def saturated(self) -> bool:
        return False


def tokens(*ids: int, text: str = "t", finish: str = "") -> decode_pb2.DecodeResponse:
    return decode_pb2.DecodeResponse(token_ids=list(ids), text=text, finish_reason=finish)


def migrate(num_tokens: int) -> decode_pb2.DecodeResponse:
    handle = kv_pb2.KvHandle(lease_id="d-lease", block_size=16, num_tokens=num_tokens,
                             lease_ttl_ms=30_000)  # fmt: skip
    return decode_pb2.DecodeResponse(migrate_kv=handle)


HANDOFF = decode_pb2.DecodeResponse(pulled_blocks=1)
# The source: the first token came from prefill (token 103, text "P"), then 11 and 12; it
# drains with KV for the prompt, 103 and 11 (5 tokens), 12's not computed yet.
SOURCE = [HANDOFF, tokens(11, text="ab"), tokens(12, text="c"), migrate(5)]


def serve(prefill: PrefillStub, *decoders: Worker) -> list[generate_pb2.GenerateResponse]:
    async def main():
        coordinator = Coordinator(
            Frontend(),  # type: ignore[arg-type]
            prefill=Pool(Worker("p", prefill)),  # type: ignore[arg-type]
            decode=Pool(*decoders),  # type: ignore[arg-type]
            worker_id="migration-test",
        )
        out = [r async for r in coordinator.generate(generate_pb2.GenerateRequest(prompt="x"))]
        await asyncio.gather(*coordinator._background)
        return out

    return asyncio.run(main())


def test_a_drained_stream_goes_on_elsewhere_from_its_kv() -> None:
    prefill = PrefillStub()
    source = Worker("d0", DecodeStub(SOURCE))
    target = Worker(
        "d1", DecodeStub([HANDOFF, tokens(13), tokens(14), tokens(15, finish="length")])
    )
    out = serve(prefill, source, target)
    assert [t for r in out for t in r.token_ids] == [103, 11, 12, 13, 14, 15]
    assert len(prefill.requests) == 1  # nothing prefilled again
    (moved,) = target.stub.requests
    assert moved.migrated and moved.kv_handle.lease_id == "d-lease"
    assert list(moved.prompt_token_ids) == [*PROMPT, 103, 11]
    assert moved.first_token_id == 12
    assert moved.resumed.output_tokens == 2  # 103 and 11 are output, in the prompt
    assert moved.resumed.sent_chars == len("Pab")  # the text before 12's
    assert moved.sampling.max_tokens == MAX_TOKENS - 2
    assert source.channel.released == []  # pulled by the target, not released
    assert out[-1].usage.completion_tokens == 6


def test_a_move_that_fails_before_the_pull_recomputes_and_releases_the_lease() -> None:
    prefill = PrefillStub()
    source = Worker("d0", DecodeStub(SOURCE))
    target = Worker("d1", DecodeStub(
        [grpc.StatusCode.UNAVAILABLE],  # the pull failed
        [HANDOFF, tokens(20), tokens(21, finish="length")],
    ))  # fmt: skip
    out = serve(prefill, source, target)
    assert [t for r in out for t in r.token_ids] == [103, 11, 12, 106, 20, 21]
    assert len(prefill.requests) == 2  # the recompute leg: prompt and every token sent
    assert list(prefill.requests[1].prompt_token_ids) == [*PROMPT, 103, 11, 12]
    assert source.channel.released == ["d-lease"]
    assert not target.stub.requests[1].migrated


def test_a_handle_that_does_not_cover_the_stream_recomputes() -> None:
    prefill = PrefillStub()
    source = Worker("d0", DecodeStub([*SOURCE[:-1], migrate(4)]))
    target = Worker("d1", DecodeStub([HANDOFF, tokens(20), tokens(21, finish="length")]))
    out = serve(prefill, source, target)
    assert [t for r in out for t in r.token_ids] == [103, 11, 12, 106, 20, 21]
    assert len(prefill.requests) == 2
    assert source.channel.released == ["d-lease"]


def test_with_no_other_decode_worker_the_draining_one_takes_the_stream_back() -> None:
    prefill = PrefillStub()
    source = Worker("d0", DecodeStub(SOURCE, [HANDOFF, tokens(13), tokens(14, finish="length")]))
    out = serve(prefill, source)
    assert [t for r in out for t in r.token_ids] == [103, 11, 12, 13, 14]
    assert len(prefill.requests) == 1
    back = source.stub.requests[1]
    assert back.migrated and back.kv_handle.lease_id == "d-lease"
