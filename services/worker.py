"""One worker's shared parts (prefill, decode or colocated), which its servicers and its
status stream are handed: the engine loop, the KV transport bound to the engine's cache,
the metrics, and who the worker is. The process around them is `worker_process.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NoReturn

import grpc

from pdserve.common.errors import WorkerBusyError
from pdserve.common.kv_transfer import KvTransport
from pdserve.services.convert import RETRY_AFTER_KEY
from pdserve.services.engine_loop import EngineLoop
from pdserve.services.metrics import WorkerMetrics


@dataclass
class Worker:
    role: str
    worker_id: str
    address: str  # host:port of this worker's gRPC server
    loop: EngineLoop
    transport: KvTransport | None
    metrics: WorkerMetrics
    transfer_timeout_s: float
    # Expert parallelism: this worker is rank `group_rank` of `group_size` ranks named `group`.
    group: str = ""
    group_rank: int = 0
    group_size: int = 1
    # Tensor parallelism: the transport address of every rank of this worker's group.
    tp_addresses: list[bytes] = field(default_factory=list)

    @property
    def tensor_parallel(self) -> int:
        return max(1, len(self.tp_addresses))

    async def refuse_busy(self, context: grpc.aio.ServicerContext, e: WorkerBusyError) -> NoReturn:
        """End the call with RESOURCE_EXHAUSTED and, in trailing metadata, when to retry
        (`retry-after`, whole seconds, as HTTP's header: the coordinator relays it)."""
        self.metrics.refused(e.reason)
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            str(e),
            trailing_metadata=((RETRY_AFTER_KEY, str(max(1, math.ceil(e.retry_after_s)))),),
        )
        raise AssertionError("unreachable: abort raises")
