"""The coordinator's gRPC front: `GenerateService.Generate` over the shared request path
(`request_path.Coordinator`). A failure reaches the client with its status code and, for a
worker's failure, the worker named."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.services.convert import RETRY_AFTER_KEY, RETRY_AFTER_S
from pdserve.services.coordinator.request_path import Coordinator, RequestFailed
from pdserve.v1 import generate_pb2, generate_pb2_grpc


class CoordinatorServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        responses = self.coordinator.generate(
            request, context.invocation_metadata(), context.time_remaining()
        )
        try:
            async for response in responses:
                yield response
        except RequestFailed as e:
            retry = e.retry_after_s
            if retry is None and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                retry = RETRY_AFTER_S  # as HTTP's 429: a refusal always says when to retry
            trailer = ((RETRY_AFTER_KEY, str(retry)),) if retry else ()
            await context.abort(e.code, e.message, trailing_metadata=trailer)
        finally:
            await responses.aclose()
