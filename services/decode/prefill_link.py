"""The decode worker's calls to a prefill worker in the handoff (`PrefillLink` over gRPC):
`TransferKv` (send the lease's blocks into the receives posted here) and `ReleaseKv` (free
them unsent). A failed call becomes `PullFailed`: UNAVAILABLE for the prefill worker or the
way to it, STALE or INVALID for its refusal of the handle."""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry.trace import Span

from pdserve.common.handoff.handle import TransferOrder
from pdserve.common.handoff.receiver import PullFailed
from pdserve.common.tracing import metadata_for_call
from pdserve.services.handoff_proto import order_to_proto
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc

RELEASE_TIMEOUT_S = 5.0

# What prefill's refusal of a pull says of the handle.
_REFUSALS = {
    grpc.StatusCode.NOT_FOUND: PullFailed.STALE,
    grpc.StatusCode.FAILED_PRECONDITION: PullFailed.STALE,
    grpc.StatusCode.INVALID_ARGUMENT: PullFailed.INVALID,
}


class GrpcPrefillLink:
    def __init__(self, stub: prefill_pb2_grpc.PrefillServiceStub, timeout_s: float) -> None:
        self.stub = stub
        self.timeout_s = timeout_s

    async def transfer(self, order: TransferOrder, span: Span) -> list[int]:
        call = self.stub.TransferKv(
            order_to_proto(order), timeout=self.timeout_s, metadata=metadata_for_call(span)
        )
        try:
            return list((await call).block_checksums)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as e:
            reason = _REFUSALS.get(e.code(), PullFailed.UNAVAILABLE)
            raise PullFailed(f"{e.code().name}: {e.details()}", reason) from None

    async def release(self, lease_id: str) -> None:
        try:
            await self.stub.ReleaseKv(
                prefill_pb2.ReleaseKvRequest(lease_id=lease_id), timeout=RELEASE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            raise PullFailed(e.details() or e.code().name) from None
