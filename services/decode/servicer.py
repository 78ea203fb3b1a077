"""`DecodeService`: steps 6 and 7 of a request's path. A prefilled request is checked
against this worker's KV layout, admitted when its blocks fit, its missing blocks pulled
from the prefill worker (receives posted into our own free blocks, then `TransferKv` asks
prefill to send), and it joins the continuous batch; tokens after the first stream back.
Whatever happens — a bad handle, a failed or stalled pull, a caller gone — the request's
blocks here are given back, and the prefill side frees its own on pull, release or expiry."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import Future

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pdserve.common.engine import RequestOutput
from pdserve.common.errors import InvalidRequestError, WorkerBusyError
from pdserve.common.kv_transfer import KvTransferError, TransferResult, settled
from pdserve.common.kv_transfer.head_slices import plan
from pdserve.common.request import Request, Resume
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tracing import context_from_metadata, metadata_for_call, record_phases, tracer
from pdserve.services.convert import (
    RETRY_AFTER_KEY,
    RETRY_AFTER_S,
    logprobs_to_proto,
    resume_from_proto,
    worker_request,
)
from pdserve.services.decode.admission import Admission, AdmissionQueueFull
from pdserve.services.decode.prefill_peers import PrefillPeers, UnknownPrefillWorker
from pdserve.services.tp_kv import SliceReceive
from pdserve.services.worker import Worker
from pdserve.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2

logger = logging.getLogger(__name__)


class PullFailed(RuntimeError):
    """`code`: UNAVAILABLE when the prefill worker or the way to it failed (the request may
    go on elsewhere); the prefill worker's own refusal otherwise (the lease is unknown or
    taken, a field is bad), which no retry of this handle can fix."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        super().__init__(message)
        self.code = code


# A refusal for want of room here: when to retry (the coordinator relays it).
_RETRY_SOON = ((RETRY_AFTER_KEY, str(RETRY_AFTER_S)),)

# What prefill's refusal of a pull becomes here: about the handle, not about this worker.
_REFUSALS = {
    grpc.StatusCode.NOT_FOUND: grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
}


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self,
        worker: Worker,
        max_pending: int,
        prefill_workers: Iterable[str] = (),
        max_wait_s: float = 0.0,
    ) -> None:
        self.worker = worker
        self.admission = Admission(worker.loop.engine, max_pending, max_wait_s)
        worker.loop.housekeeping.append(self._housekeeping)
        self.peers = PrefillPeers(prefill_workers)

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

    def _housekeeping(self) -> None:
        self.admission.admit()
        self.worker.metrics.extra_waiting = len(self.admission.pending)
        self.worker.metrics.saturated = self.admission.saturated()

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
        if not request.HasField("kv_handle"):
            async for response in self._local(request, context, span):
                yield response
            return
        loop = self.worker.loop
        rid = request.request_id
        try:
            lease_expires_s = request.kv_handle.lease_expires_at.ToNanoseconds() / 1e9
        except ValueError as e:  # nanos outside [0, 1e9) or a year protobuf refuses
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"kv_handle.lease_expires_at: {e}"
            )
        try:
            # Before anything is held, and before any connection to the named address.
            await self.peers.admit(request.kv_handle.grpc_address)
        except UnknownPrefillWorker as e:
            self.worker.metrics.refused("unknown_prefill_worker")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        try:
            prompt, params = worker_request(rid, request.prompt_token_ids, request.sampling)
            self._check(request)
            first = request.first_token_id
            resume = resume_from_proto(request)
            queue = loop.open_stream(rid)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finished = False
        req: Request | None = None
        try:
            arrived = loop.submit(lambda: self._arrive(prompt, first, params, rid, resume))
            try:
                req, admitted = await asyncio.shield(asyncio.wrap_future(arrived))
            except asyncio.CancelledError:  # the caller left: whatever arrived goes back

                def withdraw_arrived() -> None:  # queued after `arrived`: it has run
                    if arrived.exception() is None:
                        self.admission.withdraw(arrived.result()[0])

                loop.submit(withdraw_arrived)
                raise
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except AdmissionQueueFull as e:
                self.worker.metrics.refused("max_pending")
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), trailing_metadata=_RETRY_SOON
                )
            # Waiting for blocks past the prefill lease would only pull from nothing.
            lease_left = lease_expires_s - time.time()
            try:
                num_cached = await asyncio.wait_for(
                    asyncio.shield(asyncio.wrap_future(admitted)), max(0.0, lease_left - 1.0)
                )
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "this decode worker had no free KV blocks or batch slot before the "
                    "prefill lease ran out; retry later or elsewhere",
                    trailing_metadata=_RETRY_SOON,
                )
            try:
                pulled = await self._pull(req, request.kv_handle, num_cached, span)
            except PullFailed as e:
                await context.abort(e.code, str(e))
            await loop.call(lambda: self.admission.start(req))
            yield decode_pb2.DecodeResponse(pulled_blocks=pulled)
            async for out in loop.stream(rid):
                finished = out.finished
                yield _response(out)
        finally:
            loop.close_stream(rid, queue)
            if req is not None:  # else refused before the engine made it, or given back there
                if not finished:  # refused, failed, or the caller left
                    loop.submit(lambda: self.admission.withdraw(req))
                span.set_attribute("gen_ai.usage.output_tokens", req.num_output_tokens)
                record_phases(span, req)
                if finished:
                    self.worker.metrics.request_done(req)

    def _arrive(
        self,
        prompt: list[int],
        first: int,
        params: SamplingParams,
        rid: str,
        resume: Resume | None,
    ) -> tuple[Request, Future[int]]:
        """Engine thread: the prefilled request, and its admission (blocks reserved at once
        when they fit). One call rather than two, because each call waits for a step
        boundary: a handoff's second token then comes a step sooner. Raises
        `InvalidRequestError`, or `AdmissionQueueFull` having given back what it made."""
        req = self.worker.loop.engine.new_prefilled_request(prompt, first, params, rid, resume)
        try:
            return req, self.admission.submit(req)
        except AdmissionQueueFull:
            self.admission.withdraw(req)
            raise

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
        finished = False
        try:
            # Inside the try: a caller gone at this first message must free the request too.
            yield decode_pb2.DecodeResponse(pulled_blocks=0)
            async for out in loop.stream(request.request_id):
                finished = out.finished
                response = _response(out)
                if out.finished:
                    response.cached_tokens = out.cached_tokens
                yield response
        finally:
            if not finished:  # the stream never started, or ended early: end it here
                loop.close_stream(request.request_id, queue)
                await loop.cleanup(lambda: loop.engine.drop(req))
            span.set_attribute("gen_ai.usage.output_tokens", req.num_output_tokens)
            record_phases(span, req)
            if finished:
                self.worker.metrics.request_done(req)

    def _check(self, request: decode_pb2.DecodeRequest) -> None:
        """The KV handle fits this worker's layout and transport."""
        h = request.kv_handle
        w = self.worker
        assert w.transport is not None
        engine = w.loop.engine
        for name in ("lease_id", "grpc_address", "transport_address"):
            if not getattr(h, name):
                raise InvalidRequestError(f"kv_handle.{name}", "must not be empty")
        if h.transport != w.transport.kind:
            raise InvalidRequestError(
                "kv_handle.transport",
                f"this worker pulls over {w.transport.kind!r}, got {h.transport!r}",
            )
        if h.layout_fingerprint != engine.runner.layout_fingerprint:
            raise InvalidRequestError(
                "kv_handle.layout_fingerprint",
                f"{h.layout_fingerprint!r} does not match this worker's KV layout "
                f"{engine.runner.layout_fingerprint!r} (model, dtype or block size differ)",
            )
        if h.tensor_parallel > 1:
            if len(h.rank_transport_addresses) != h.tensor_parallel - 1:
                raise InvalidRequestError(
                    "kv_handle.rank_transport_addresses",
                    f"a prefill group of {h.tensor_parallel} needs {h.tensor_parallel - 1}, "
                    f"got {len(h.rank_transport_addresses)}",
                )
            try:
                plan(engine.runner.hf_config.num_key_value_heads, h.tensor_parallel,
                     w.tensor_parallel)  # fmt: skip
            except ValueError as e:
                raise InvalidRequestError("kv_handle.tensor_parallel", str(e)) from None
        if h.block_size != engine.config.block_size:
            raise InvalidRequestError(
                "kv_handle.block_size", f"must be {engine.config.block_size}, got {h.block_size}"
            )
        if h.num_tokens != len(request.prompt_token_ids):
            raise InvalidRequestError(
                "kv_handle.num_tokens",
                f"must equal the prompt's length ({len(request.prompt_token_ids)}), "
                f"got {h.num_tokens}",
            )
        need = -(-h.num_tokens // h.block_size)
        if len(h.block_ids) != need:
            raise InvalidRequestError(
                "kv_handle.block_ids",
                f"{h.num_tokens} tokens need {need} blocks, got {len(h.block_ids)}",
            )

    async def _pull(
        self, req: Request, handle: kv_pb2.KvHandle, num_cached: int, span: Span
    ) -> int:
        """Fill the request's blocks after the `num_cached` ones from the prefill worker.
        Returns the number of blocks pulled."""
        w = self.worker
        transport = w.transport
        assert transport is not None
        try:  # admitted on arrival; its pool may have changed while it waited for blocks
            stub = self.peers.stub(handle.grpc_address)
        except UnknownPrefillWorker as e:
            raise PullFailed(str(e), grpc.StatusCode.FAILED_PRECONDITION) from None
        total = len(handle.block_ids)
        if num_cached >= total:  # everything is cached here: let prefill free its copy
            try:
                await stub.ReleaseKv(
                    prefill_pb2.ReleaseKvRequest(lease_id=handle.lease_id), timeout=5
                )
            except grpc.aio.AioRpcError as e:  # its lease will expire; nothing leaks
                logger.warning("release of %s failed: %s", handle.lease_id, e.details())
            return 0
        dst = req.block_ids[num_cached:total]
        transfer = tracer().start_span(
            "pdserve.kv_transfer",
            context=trace.set_span_in_context(span),
            attributes={"pdserve.kv.transport": transport.kind, "pdserve.kv.from": handle.worker_id,
                        "pdserve.kv.cached_blocks": num_cached},
        )  # fmt: skip
        tag = transport.new_tag()
        timeout = w.transfer_timeout_s
        # Tensor parallelism on either side: head slices to every rank (`tp_kv.py`).
        sliced = handle.tensor_parallel > 1 or w.tensor_parallel > 1
        slices: SliceReceive | None = None
        if sliced:
            try:
                slices = await self._post_slices(handle, dst, tag)
            except KvTransferError as e:
                transfer.end()
                raise PullFailed(f"KV pull from {handle.worker_id}: {e}") from None
            received = slices.future
        else:
            received = transport.post_receive(tag, dst, timeout)
        call = stub.TransferKv(
            prefill_pb2.TransferKvRequest(
                lease_id=handle.lease_id,
                first_block=num_cached,
                receiver_address=transport.address,
                tag=tag,
                num_blocks=len(dst),
                receiver_tensor_parallel=w.tensor_parallel if w.tensor_parallel > 1 else 0,
                rank_receiver_addresses=w.tp_addresses[1:],
            ),
            timeout=timeout,
            metadata=metadata_for_call(transfer),
        )
        try:
            await call
            result = await asyncio.wrap_future(received)
            if slices is not None:
                result = await self._land_slices(slices, len(dst))
        except (grpc.aio.AioRpcError, KvTransferError, asyncio.CancelledError) as e:
            transport.cancel(tag)
            call.cancel()
            await settled(received)  # only then may the caller free the blocks
            if slices is not None and w.tensor_parallel > 1:
                await self._group_command({"kind": "drop", "tag": tag})
            w.metrics.transfer_failed(transport.kind, "receive")
            if isinstance(e, asyncio.CancelledError):
                transfer.end()
                raise
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else e
            transfer.set_status(Status(StatusCode.ERROR, str(why)))
            transfer.end()
            code = grpc.StatusCode.UNAVAILABLE
            if isinstance(e, grpc.aio.AioRpcError):
                code = _REFUSALS.get(e.code(), code)
            raise PullFailed(
                f"KV pull from prefill worker {handle.worker_id} ({handle.grpc_address}) "
                f"failed: {why}",
                code,
            ) from e
        w.metrics.transfer(
            transport.kind, "receive", result.num_blocks, result.num_bytes, result.seconds
        )
        transfer.set_attributes(
            {"pdserve.kv.blocks": result.num_blocks, "pdserve.kv.bytes": result.num_bytes}
        )
        transfer.end()
        return result.num_blocks

    async def _post_slices(self, handle: kv_pb2.KvHandle, dst: list[int], tag: int) -> SliceReceive:
        """Post this rank's receives of its head slices, and have the group's other ranks
        post theirs."""
        w = self.worker
        assert w.transport is not None
        runner = w.loop.engine.runner
        slices = plan(runner.hf_config.num_key_value_heads, max(1, handle.tensor_parallel),
                      w.tensor_parallel)  # fmt: skip
        mine = [s for s in slices if s.dst_rank == 0]
        receive = SliceReceive(w.transport, runner.kv_cache, dst, mine, tag, w.transfer_timeout_s)
        if w.tensor_parallel > 1:
            command = {"kind": "post", "tag": tag, "blocks": dst, "plan": slices}
            if await self._group_command(command):
                receive.drop()
                await self._group_command({"kind": "drop", "tag": tag})
                raise KvTransferError("a tensor-parallel rank could not post its receives")
        return receive

    async def _land_slices(self, receive: SliceReceive, num_blocks: int) -> TransferResult:
        """Every rank's slices in its blocks (this rank's copied in here), or KvTransferError."""
        result = receive.future.result()
        receive.land()
        if self.worker.tensor_parallel > 1 and await self._group_command(
            {"kind": "land", "tag": receive.tag}
        ):
            raise KvTransferError("a tensor-parallel rank's KV slices did not arrive")
        return TransferResult(num_blocks, result.num_bytes, result.seconds)

    async def _group_command(self, command: dict) -> int:
        sender = self.worker.loop.engine.runner.step_sender
        assert sender is not None
        return await self.worker.loop.call(lambda: sender.command(command))


def _response(out: RequestOutput) -> decode_pb2.DecodeResponse:
    """The tokens one engine step gave a request, for the stream."""
    return decode_pb2.DecodeResponse(
        token_ids=out.new_token_ids,
        text=out.new_text,
        finish_reason=out.finish_reason or "",
        logprobs=logprobs_to_proto(out.new_logprobs),
    )
