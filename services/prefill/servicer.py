"""`PrefillService`, the gRPC face of steps 3 and 6 of a request's path on a prefill worker:
`Prefill` runs the prompt in the worker's continuous batch (chunked, prefix-cached) and
returns the first token with a `KvHandle` to the blocks, leased; `TransferKv` sends them
into the receives a decode worker posted; `ReleaseKv` frees them unsent. The handoff itself
is `common/handoff`'s `KvSender`; this module turns protobuf into its domain forms and its
outcomes into status codes and spans."""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry.trace import SpanKind

from pdserve.common import faults
from pdserve.common.errors import InvalidRequestError, WorkerBusyError
from pdserve.common.handoff.leases import LeaseBusy, LeaseError
from pdserve.common.handoff.sender import KvSender
from pdserve.common.kv_transfer import KvTransferError
from pdserve.common.request import Request
from pdserve.common.tracing import context_from_metadata, record_phases, tracer
from pdserve.services.convert import logprobs_to_proto, resume_from_proto, worker_request
from pdserve.services.handoff_proto import handle_to_proto, order_from_proto
from pdserve.services.worker import Worker
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, worker: Worker, lease_s: float) -> None:
        self.worker = worker
        assert worker.transport is not None
        self.sender = KvSender(
            worker.loop.engine, worker.transport, worker.worker_id, worker.address, lease_s,
            worker.transfer_timeout_s, worker.metrics, worker.loop.call, worker.tp_addresses,
        )  # fmt: skip

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        with tracer().start_as_current_span(
            "pdserve.prefill",
            context=context_from_metadata(context.invocation_metadata()),
            kind=SpanKind.SERVER,
            attributes={"pdserve.worker": self.worker.worker_id},
        ) as span:
            response, req = await self._prefill(request, context)
            if req is not None:
                span.set_attributes({
                    "gen_ai.usage.input_tokens": req.num_prompt_tokens,
                    "pdserve.cached_tokens": req.num_cached_tokens,
                    "pdserve.kv_blocks": len(response.kv_handle.block_ids),
                })  # fmt: skip
                record_phases(span, req)
                self.worker.metrics.request_done(req)
            return response

    async def _prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> tuple[prefill_pb2.PrefillResponse, Request | None]:
        loop = self.worker.loop
        try:
            await faults.ahit("prefill.before_prefill")
        except faults.FaultInjected as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        try:
            prompt, params = worker_request(
                request.request_id, request.prompt_token_ids, request.sampling
            )
            resume = resume_from_proto(request)
            req = await loop.add(prompt, params, request.request_id, True, resume)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except WorkerBusyError as e:
            await self.worker.refuse_busy(context, e)
        try:
            final = None
            async for out in loop.stream(request.request_id):
                final = out
            assert final is not None and final.finished
            if final.finish_reason == "abort":
                await context.abort(grpc.StatusCode.ABORTED, "request aborted by the worker")
            response = prefill_pb2.PrefillResponse(
                first_token_id=final.new_token_ids[0],
                text=final.new_text,
                finish_reason=final.finish_reason or "",
                cached_tokens=final.cached_tokens,
            )
            if final.new_logprobs:
                response.first_logprobs.CopyFrom(logprobs_to_proto(final.new_logprobs)[0])
            if final.prompt_logprobs is not None:
                response.prompt_logprobs.extend(logprobs_to_proto(final.prompt_logprobs))
            if final.finish_reason is None:  # PREFILLED: hand the blocks off
                response.kv_handle.CopyFrom(handle_to_proto(self.sender.grant(req)))
                try:
                    await faults.ahit("prefill.lease_granted")
                except faults.FaultInjected as e:
                    loop.submit(lambda: self.sender.drop(req))
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            return response, req
        except asyncio.CancelledError:
            # The caller left (cancelled, deadline): no one will pull these blocks.
            loop.submit(lambda: self.sender.drop(req))
            raise

    async def TransferKv(
        self, request: prefill_pb2.TransferKvRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.TransferKvResponse:
        with tracer().start_as_current_span(
            "pdserve.kv_send",
            context=context_from_metadata(context.invocation_metadata()),
            kind=SpanKind.SERVER,
        ) as span:
            response = await self._transfer(request, context)
            span.set_attributes({
                "pdserve.kv.blocks": response.num_blocks,
                "pdserve.kv.bytes": response.num_bytes,
                "pdserve.kv.transport": self.sender.transport.kind,
            })  # fmt: skip
            return response

    async def _transfer(
        self, request: prefill_pb2.TransferKvRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.TransferKvResponse:
        order = order_from_proto(request)
        try:
            peers = self.sender.receivers(order)
            result = await self.sender.send(order, peers)
        except LeaseError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, e.args[0])
        except LeaseBusy as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KvTransferError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
        return prefill_pb2.TransferKvResponse(
            num_blocks=result.num_blocks,
            num_bytes=result.num_bytes,
            block_checksums=result.checksums,
        )

    async def ReleaseKv(
        self, request: prefill_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.ReleaseKvResponse:
        return prefill_pb2.ReleaseKvResponse(released=self.sender.release(request.lease_id))
