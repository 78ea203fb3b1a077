"""The coordinator's side of the decode workers' pull list: every decode worker is told the
coordinator's prefill pool (`DecodeService.SetPrefillWorkers`) when it connects, before it
is routable, and again whenever discovery changes the prefill pool. A decode worker pulls
KV only from addresses named so (or in its own `--prefill-workers`), so a KV handle cannot
make it dial anywhere else."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket

import grpc

from pdserve.services.coordinator.pool import WorkerEndpoint, WorkerPool
from pdserve.v1 import decode_pb2

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0


class PrefillNames:
    def __init__(self, prefill: WorkerPool, decode: WorkerPool) -> None:
        self.prefill, self.decode = prefill, decode
        self.coordinator_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._background: set[asyncio.Task[None]] = set()
        decode.on_connect = self.tell
        prefill.on_change = self.prefill_changed

    def request(self) -> decode_pb2.SetPrefillWorkersRequest:
        return decode_pb2.SetPrefillWorkersRequest(
            coordinator_id=self.coordinator_id, addresses=sorted(self.prefill.workers)
        )

    async def tell(self, worker: WorkerEndpoint) -> None:
        """Raises `grpc.aio.AioRpcError` when the worker cannot be told (it then stays out
        of routing and is retried)."""
        await worker.stub.SetPrefillWorkers(self.request(), timeout=CALL_TIMEOUT_S)

    def prefill_changed(self) -> None:
        for worker in list(self.decode.workers.values()):
            task = asyncio.ensure_future(self._tell_quietly(worker))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _tell_quietly(self, worker: WorkerEndpoint) -> None:
        try:
            await self.tell(worker)
        except grpc.aio.AioRpcError as e:  # its next connect tells it again
            if worker.healthy:
                logger.warning("could not name the prefill pool to %s: %s", worker.address, e)
