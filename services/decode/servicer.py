"""`DecodeService`, the gRPC face of steps 6 and 7 of a request's path on a decode worker: a
prefilled request's KV handle is checked, the request arrives in the engine (queued for
blocks), its blocks are pulled from the prefill worker, and it joins the continuous batch;
tokens after the first stream back. The handoff itself is `common/handoff`'s `KvReceiver`;
this module turns protobuf into its domain forms and its outcomes into status codes and
spans. Whatever happens, a request's blocks here are given back (`KvReceiver.abandon`).
Live migration (`migration.py`): a handle may be a draining decode worker's (`migrated`),
and as this worker drains, its streams end with their KV's handle instead of a finish."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pdserve.common import faults
from pdserve.common.config import GRPC_KEEPALIVE
from pdserve.common.engine import RequestOutput
from pdserve.common.errors import InvalidRequestError, WorkerBusyError
from pdserve.common.handoff.handle import KvHandle
from pdserve.common.handoff.leases import LeaseError
from pdserve.common.handoff.receiver import KvReceiver, PullFailed
from pdserve.common.handoff.remote_queue import RemoteQueueFull
from pdserve.common.request import Request
from pdserve.common.tracing import context_from_metadata, record_phases, tracer
from pdserve.services.convert import (
    RETRY_AFTER_KEY,
    RETRY_AFTER_S,
    logprobs_to_proto,
    resume_from_proto,
    worker_request,
)
from pdserve.services.decode.migration import MigrationSources, Migrator
from pdserve.services.decode.prefill_link import GrpcPrefillLink
from pdserve.services.decode.prefill_peers import PrefillPeers, UnknownPrefillWorker
from pdserve.services.handoff_proto import handle_from_proto, handle_to_proto
from pdserve.services.worker import Worker
from pdserve.v1 import decode_pb2, decode_pb2_grpc

# A refusal for want of room here: when to retry (the coordinator relays it).
_RETRY_SOON = ((RETRY_AFTER_KEY, str(RETRY_AFTER_S)),)

# A failed pull's status: about the handle (no retry of it helps), or about the way to it.
_PULL_CODES = {
    PullFailed.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    PullFailed.STALE: grpc.StatusCode.FAILED_PRECONDITION,
    PullFailed.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
}


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self,
        worker: Worker,
        max_pending: int,
        prefill_workers: Iterable[str] = (),
        max_wait_s: float = 0.0,
        keepalive_s: float = GRPC_KEEPALIVE.default,
    ) -> None:
        self.worker = worker
        assert worker.transport is not None
        loop = worker.loop
        # A prefill worker that hangs mid-pull: its TransferKv fails within twice
        # `keepalive_s` (the channel's pings), and blocks it said it sent land within that.
        landing_s = 2 * keepalive_s if keepalive_s > 0 else None
        self.receiver = KvReceiver(
            loop.engine, worker.transport, worker.transfer_timeout_s, worker.metrics, loop.call,
            worker.tp_addresses, max_pending, max_wait_s, landing_s,
        )  # fmt: skip
        self.peers = PrefillPeers(prefill_workers, keepalive_s=keepalive_s)
        # Live migration: this worker's drain (set by its process) and the draining decode
        # workers it pulls migrated streams from.
        self.migrator: Migrator | None = None
        self.sources = MigrationSources(keepalive_s)

    async def SetPrefillWorkers(
        self, request: decode_pb2.SetPrefillWorkersRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.SetPrefillWorkersResponse:
        try:
            taken = self.peers.set_named(
                request.coordinator_id, request.addresses, request.generation
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if taken:  # in force once this returns: its host names' addresses too
            await self.peers.resolve_new()
        return decode_pb2.SetPrefillWorkersResponse()

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        span = tracer().start_span(
            "pdserve.decode",
            context=context_from_metadata(context.invocation_metadata()),
            kind=SpanKind.SERVER,
            attributes={"pdserve.worker": self.worker.worker_id},
        )
        try:
            async for response in self._decode(request, context, span):
                yield response
        except BaseException as e:
            span.set_status(Status(StatusCode.ERROR, str(e) or type(e).__name__))
            raise
        finally:
            span.end()

    async def _decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext, span: Span
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        migrator = self.migrator
        if migrator is not None and migrator.draining and request.migrated:
            migrator.staying.add(request.request_id)  # taken, to finish here: see `Migrator`
        elif migrator is not None and migrator.draining:
            # A handoff is offered elsewhere with its lease intact; a local prefill is a
            # leg the coordinator starts again elsewhere.
            handoff = request.HasField("kv_handle")
            self.worker.metrics.refused("draining")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED if handoff else grpc.StatusCode.UNAVAILABLE,
                "this decode worker is draining",
                trailing_metadata=_RETRY_SOON,
            )
        if not request.HasField("kv_handle"):
            async for response in self._local(request, context, span):
                yield response
            return
        loop, receiver = self.worker.loop, self.receiver
        rid = request.request_id
        # First: the lease's time left counts down on this host's clock from its arrival.
        handle = handle_from_proto(request.kv_handle)
        if migrator is not None and request.migrated and handle.worker_id == self.worker.worker_id:
            async for response in self._reclaimed(migrator, handle, rid, context, span):
                yield response
            return
        try:
            # Before anything is held, and before any connection to the named address.
            if not request.migrated:  # else a draining decode worker: see `migration.py`
                await self.peers.admit(handle.grpc_address)
        except UnknownPrefillWorker as e:
            self.worker.metrics.refused("unknown_prefill_worker")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        try:
            prompt, params = worker_request(rid, request.prompt_token_ids, request.sampling)
            receiver.check(handle, len(request.prompt_token_ids))
            first = request.first_token_id
            resume = resume_from_proto(request)
            await loop.compile_constraint(params)
            queue = loop.open_stream(rid)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finished = migrated = False
        req: Request | None = None
        try:
            # The request's one call into the engine thread: made, and queued for blocks.
            arrived = loop.submit(lambda: receiver.arrive(prompt, first, params, rid, resume))
            try:
                req, admitted = await asyncio.shield(asyncio.wrap_future(arrived))
            except asyncio.CancelledError:  # the caller left: whatever arrives goes back
                arrived.add_done_callback(
                    lambda f: f.exception() is None and receiver.abandon(f.result()[0])
                )
                raise
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RemoteQueueFull as e:
                self.worker.metrics.refused("max_pending")
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), trailing_metadata=_RETRY_SOON
                )
            # Waiting for blocks past the prefill lease would only pull from nothing.
            try:
                num_cached = await asyncio.wait_for(
                    asyncio.shield(asyncio.wrap_future(admitted)),
                    max(0.0, handle.lease_left() - 1.0),
                )
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "this decode worker had no free KV blocks or batch slot before the "
                    "prefill lease ran out; retry later or elsewhere",
                    trailing_metadata=_RETRY_SOON,
                )
            try:  # admitted on arrival; its pool may have changed while it waited for blocks
                stub = (
                    self.sources.stub(handle.grpc_address)
                    if request.migrated
                    else self.peers.stub(handle.grpc_address)
                )
            except UnknownPrefillWorker as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except ValueError as e:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"kv_handle.grpc_address: {e}"
                )
            link = GrpcPrefillLink(stub, self.worker.transfer_timeout_s)
            try:
                await faults.ahit("decode.before_pull")
                pulled = await receiver.pull(req, handle, num_cached, link, span)
            except PullFailed as e:
                await context.abort(_PULL_CODES[e.reason], str(e))
            except faults.FaultInjected as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            receiver.landed(req)
            yield decode_pb2.DecodeResponse(pulled_blocks=pulled)
            async for out in loop.stream(rid):
                finished = out.finished
                migrated = out.migrate_kv is not None
                if finished and out.finish_reason == "abort":  # its step failed here
                    await context.abort(
                        grpc.StatusCode.ABORTED,
                        f"decode worker {self.worker.worker_id}: a step failed; the request "
                        "goes on elsewhere",
                    )
                await faults.ahit("decode.before_stream_write")
                yield _response(out)
        finally:
            loop.close_stream(rid, queue)
            if self.migrator is not None:
                self.migrator.staying.discard(rid)
            if req is not None:  # else refused before the engine made it, or given back there
                if not finished:  # refused, failed, or the caller left
                    receiver.abandon(req)
                span.set_attribute("gen_ai.usage.output_tokens", req.num_output_tokens)
                record_phases(span, req)
                if finished and not migrated:
                    self.worker.metrics.request_done(req)

    async def _reclaimed(
        self,
        migrator: Migrator,
        handle: KvHandle,
        rid: str,
        context: grpc.aio.ServicerContext,
        span: Span,
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """A stream this worker moved out as it drained comes back (the coordinator found
        no other decode worker): it goes on here from where it paused, nothing pulled."""
        loop = self.worker.loop
        span.set_attribute("pdserve.migration_reclaimed", True)
        try:
            queue = loop.open_stream(rid)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            req = await loop.call(lambda: migrator.reclaim(handle.lease_id, rid))
        except LeaseError as e:
            loop.close_stream(rid, queue)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        finished = migrated = False
        try:
            # Inside the try: a caller gone at this first message must free the request too.
            yield decode_pb2.DecodeResponse(pulled_blocks=0)
            async for out in loop.stream(rid):
                finished = out.finished
                migrated = out.migrate_kv is not None
                yield _response(out)
        finally:
            migrator.staying.discard(rid)
            if not finished:  # the stream never started, or ended early: end it here
                loop.close_stream(rid, queue)
                await loop.cleanup(lambda: loop.engine.drop(req))
            if finished and not migrated:
                self.worker.metrics.request_done(req)

    async def _local(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext, span: Span
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """No KV handle: prefill here (the coordinator found the prompt mostly cached here,
        so moving KV would cost more than computing the rest)."""
        loop = self.worker.loop
        span.set_attribute("pdserve.local_prefill", True)
        try:
            prompt, params = worker_request(
                request.request_id, request.prompt_token_ids, request.sampling
            )
            req = await loop.add(
                prompt, params, request.request_id, resume=resume_from_proto(request)
            )
            queue = loop.queue(request.request_id)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except WorkerBusyError as e:
            await self.worker.refuse_busy(context, e)
        finished = migrated = False
        try:
            # Inside the try: a caller gone at this first message must free the request too.
            yield decode_pb2.DecodeResponse(pulled_blocks=0)
            async for out in loop.stream(request.request_id):
                finished = out.finished
                migrated = out.migrate_kv is not None
                response = _response(out)
                if out.finished and not migrated:
                    response.cached_tokens = out.cached_tokens
                yield response
        finally:
            if not finished:  # the stream never started, or ended early: end it here
                loop.close_stream(request.request_id, queue)
                await loop.cleanup(lambda: loop.engine.drop(req))
            span.set_attribute("gen_ai.usage.output_tokens", req.num_output_tokens)
            record_phases(span, req)
            if finished and not migrated:
                self.worker.metrics.request_done(req)


def _response(out: RequestOutput) -> decode_pb2.DecodeResponse:
    """The tokens one engine step gave a request, for the stream (or, as the worker
    drains, the handle of its KV for the worker it moves to)."""
    response = decode_pb2.DecodeResponse(
        token_ids=out.new_token_ids,
        text=out.new_text,
        finish_reason=out.finish_reason or "",
        logprobs=logprobs_to_proto(out.new_logprobs),
    )
    if out.migrate_kv is not None:
        response.migrate_kv.CopyFrom(handle_to_proto(out.migrate_kv))
    return response
