"""`PrefillService`: steps 3 and 6 of a request's path on the prefill side. `Prefill` runs
the prompt in the worker's continuous batch (chunked, prefix-cached), returns the first token
and a `KvHandle`, and keeps the blocks under a lease; `TransferKv` sends them into the
receives a decode worker posted, then frees them; `ReleaseKv` frees them unsent."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry.trace import SpanKind

from pdserve.common.errors import InvalidRequestError, WorkerBusyError
from pdserve.common.kv_transfer import KvTransferError, TransferResult, settled
from pdserve.common.kv_transfer.head_slices import plan
from pdserve.common.request import Request
from pdserve.common.tracing import context_from_metadata, record_phases, tracer
from pdserve.services.convert import logprobs_to_proto, resume_from_proto, worker_request
from pdserve.services.prefill.leases import Lease, LeaseBusy, LeaseError, LeaseTable
from pdserve.services.tp_kv import all_of, send_slices
from pdserve.services.worker import Worker
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, worker: Worker, lease_s: float) -> None:
        self.worker = worker
        self.leases = LeaseTable(lease_s)
        worker.loop.housekeeping.append(self._housekeeping)

    def _housekeeping(self) -> None:
        """Engine thread: free the blocks of leases nobody pulled in time."""
        for request in self.leases.pop_expired():
            self.worker.loop.engine.free_request(request)
        self.worker.metrics.held = len(self.leases)

    def _free(self, request: Request | None) -> None:
        """Hand a request taken out of the lease table to the engine thread to free."""
        if request is not None:
            self.worker.loop.submit(lambda: self.worker.loop.engine.free_request(request))

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
            if final.finish_reason is None:  # PREFILLED: hand the blocks off
                lease = self.leases.grant(req)
                response.kv_handle.CopyFrom(self._handle(req, lease))
            return response, req
        except asyncio.CancelledError:
            # The caller left (cancelled, deadline): no one will pull these blocks.
            loop.submit(lambda: self._drop(req))
            raise

    def _drop(self, req: Request) -> None:
        """Engine thread: end a request whose caller left, wherever it is."""
        self.leases.pop_request(req)
        self.worker.loop.engine.drop(req)

    def _handle(self, req: Request, lease: Lease) -> kv_pb2.KvHandle:
        w = self.worker
        expires = Timestamp()
        expires.FromNanoseconds(int(lease.expires_at_unix * 1e9))
        assert w.transport is not None
        return kv_pb2.KvHandle(
            worker_id=w.worker_id,
            grpc_address=w.address,
            transport=w.transport.kind,
            transport_address=w.transport.address,
            lease_id=lease.lease_id,
            block_ids=req.block_ids,
            num_tokens=req.num_prompt_tokens,
            block_size=w.loop.engine.config.block_size,
            layout_fingerprint=w.loop.engine.runner.layout_fingerprint,
            lease_expires_at=expires,
            tensor_parallel=w.tensor_parallel if w.tensor_parallel > 1 else 0,
            rank_transport_addresses=w.tp_addresses[1:],
        )

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
                "pdserve.kv.transport": self.worker.transport.kind,  # type: ignore[union-attr]
            })  # fmt: skip
            return response

    async def _transfer(
        self, request: prefill_pb2.TransferKvRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.TransferKvResponse:
        w = self.worker
        assert w.transport is not None
        lease_id = request.lease_id
        try:  # before the lease is touched: a malformed receiver must not cost it
            peers = self._receivers(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            block_ids = self.leases.begin_send(lease_id, request.first_block, request.num_blocks)
            block_ids = list(block_ids)
        except LeaseError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, e.args[0])
        except LeaseBusy as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        transport = w.transport
        error: KvTransferError | None = None
        future: Future[TransferResult] | None = None
        try:
            if w.tensor_parallel > 1 or request.receiver_tensor_parallel > 1:
                future = await self._send_slices(request, peers, block_ids)
            else:
                future = transport.send(
                    request.receiver_address, request.tag, block_ids, w.transfer_timeout_s
                )
            result = await asyncio.wrap_future(future)
        except KvTransferError as e:
            error = e
        except asyncio.CancelledError:  # the decode worker gave up
            transport.cancel(request.tag)
            if future is not None:
                await settled(future)
            w.metrics.transfer_failed(transport.kind, "send")
            raise
        finally:
            # Release on pull: sent or failed, these blocks are done with.
            self._free(self.leases.pop(lease_id))
        if error is not None:
            transport.cancel(request.tag)
            w.metrics.transfer_failed(transport.kind, "send")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {error}")
        w.metrics.transfer(
            transport.kind, "send", result.num_blocks, result.num_bytes, result.seconds
        )
        return prefill_pb2.TransferKvResponse(
            num_blocks=result.num_blocks, num_bytes=result.num_bytes
        )

    def _receivers(self, request: prefill_pb2.TransferKvRequest) -> list[str]:
        """The decode ranks' transport addresses, rank 0 first, each well formed and (with
        tensor parallelism on either side) as many as the receiving group has ranks that
        split the model's kv heads; else a ValueError naming the field."""
        w = self.worker
        assert w.transport is not None
        sliced = w.tensor_parallel > 1 or request.receiver_tensor_parallel > 1
        peers = [request.receiver_address]  # without slices rank 0 sends all to rank 0
        if sliced:
            peers += request.rank_receiver_addresses
        for i, peer in enumerate(peers):
            field = "receiver_address" if i == 0 else f"rank_receiver_addresses[{i - 1}]"
            if not peer:
                raise ValueError(f"{field}: is empty")
            try:
                w.transport.check_peer(peer)
            except KvTransferError as e:
                raise ValueError(f"{field}: {e}") from e
        if not sliced:
            return peers
        dst_tp = max(1, request.receiver_tensor_parallel)
        if len(peers) != dst_tp:
            raise ValueError(
                f"rank_receiver_addresses: a receiving group of {dst_tp} needs "
                f"{dst_tp - 1}, got {len(peers) - 1}"
            )
        try:
            plan(w.loop.engine.runner.hf_config.num_key_value_heads, w.tensor_parallel, dst_tp)
        except ValueError as e:
            raise ValueError(f"receiver_tensor_parallel: {dst_tp}: {e}") from e
        return peers

    async def _send_slices(
        self, request: prefill_pb2.TransferKvRequest, peers: list[str], block_ids: list[int]
    ) -> Future[TransferResult]:
        """Tensor parallelism on either side: every rank of this group sends the head slices
        it holds to the decode ranks that keep them (`tp_kv.py`), `peers` (`_receivers`).
        The future is this rank's sends; the other ranks' arrive at the decode ranks, which
        wait for all."""
        w = self.worker
        assert w.transport is not None
        runner = w.loop.engine.runner
        dst_tp = len(peers)
        slices = plan(runner.hf_config.num_key_value_heads, w.tensor_parallel, dst_tp)
        timeout = w.transfer_timeout_s
        mine = [s for s in slices if s.src_rank == 0]
        futures = send_slices(w.transport, runner.kv_cache, block_ids, mine, peers,
                              request.tag, timeout)  # fmt: skip
        if w.tensor_parallel > 1:
            command = {"kind": "send", "tag": request.tag, "blocks": block_ids,
                       "plan": slices, "peers": peers}  # fmt: skip
            sender = runner.step_sender
            assert sender is not None
            if await w.loop.call(lambda: sender.command(command)):
                raise KvTransferError("a tensor-parallel rank could not send its KV slices")
        return all_of(futures, len(block_ids))

    async def ReleaseKv(
        self, request: prefill_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.ReleaseKvResponse:
        taken = self.leases.release(request.lease_id)
        self._free(taken)
        return prefill_pb2.ReleaseKvResponse(released=taken is not None)
