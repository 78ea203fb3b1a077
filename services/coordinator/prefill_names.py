"""The coordinator's side of the decode workers' pull list: every decode worker is told the
coordinator's prefill pool (`DecodeService.SetPrefillWorkers`) when it connects, before it
is routable, and again whenever discovery changes the prefill pool or a prefill worker's
advertised address becomes known. A decode worker pulls KV only from addresses named so (or
in its own `--prefill-workers`), so a KV handle cannot make it dial anywhere else.

Each prefill worker is named twice when the spellings differ: as dialled (what discovery or
`--prefill-workers` says: a headless Service name, `localhost:PORT`, `0.0.0.0:PORT` under
`serve --host 0.0.0.0`) and as it advertises itself in its status stream (what its KV
handles carry: its pod or host IP). The advertised address is vouched for by the worker
itself over the coordinator's own (mTLS when configured) connection to it, and a prefill
worker becomes routable only after every decode worker was told it (or failed to answer),
so no handle it issues is refused for its spelling. Every list carries a growing `generation`, so
a decode worker ignores an older list that arrives after a newer one."""

from __future__ import annotations

import asyncio
import itertools
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
        self._generation = itertools.count(1)
        self._background: set[asyncio.Task[None]] = set()
        decode.on_connect = self.tell
        prefill.on_change = self.prefill_changed
        prefill.on_advertised = self.advertised

    def addresses(self) -> list[str]:
        """The prefill pool as dialled, and as its workers advertise themselves."""
        named = set(self.prefill.workers)
        named.update(w.advertised for w in self.prefill.workers.values() if w.advertised)
        return sorted(named)

    def request(self) -> decode_pb2.SetPrefillWorkersRequest:
        return decode_pb2.SetPrefillWorkersRequest(
            coordinator_id=self.coordinator_id,
            addresses=self.addresses(),
            generation=next(self._generation),
        )

    async def tell(self, worker: WorkerEndpoint) -> None:
        """Raises `grpc.aio.AioRpcError` when the worker cannot be told (it then stays out
        of routing and is retried)."""
        await worker.stub.SetPrefillWorkers(self.request(), timeout=CALL_TIMEOUT_S)

    def prefill_changed(self) -> None:
        for worker in list(self.decode.workers.values()):
            self._spawn(worker)

    async def advertised(self, _prefill_worker: WorkerEndpoint) -> None:
        """A prefill worker's advertised address is new: tell every decode worker and wait
        for the answers (each call is bounded by `CALL_TIMEOUT_S`; one to a worker that is
        down fails at once), also those connecting now, whose own list may predate it."""
        told = [self._spawn(w) for w in list(self.decode.workers.values())]
        if told:
            await asyncio.wait(told)

    def _spawn(self, worker: WorkerEndpoint) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self._tell_quietly(worker))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _tell_quietly(self, worker: WorkerEndpoint) -> None:
        try:
            await self.tell(worker)
        except grpc.aio.AioRpcError as e:  # its next connect tells it again
            if worker.healthy:
                logger.warning("could not name the prefill pool to %s: %s", worker.address, e)
