"""Live migration on a decode worker (the whole story: `common/handoff/migration.py`).

As the source: on SIGTERM the worker stops taking requests, and between engine steps moves
every decoding stream's KV under a lease, the stream's last message carrying the handle
(`Migrator.drain`); meanwhile it serves the pulls of those leases as a prefill worker serves
its own (`MigrationSource`: `TransferKv`, `ReleaseKv`; `Prefill` is refused). Once nothing is
left to move or pull (or the drain's grace is spent), the ordinary drain runs: it must come
after, since a stopping gRPC server takes no new calls and the pulls are new calls. So
SIGTERM comes here first (`ServiceProcess.before_drain`) and the server's own drain follows.

As the destination: a `Decode` whose handle is another decode worker's (`migrated`) pulls
through a channel to that worker (`MigrationSources`). The address is the coordinator's word,
as the prefill pools it names (`SetPrefillWorkers`) are: a caller that may do one may do the
other; channels are few and closed once unused."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import grpc

from pdserve.common.config import GRPC_KEEPALIVE
from pdserve.common.engine import RequestOutput
from pdserve.common.handoff import migration
from pdserve.common.handoff.handle import KvHandle
from pdserve.common.handoff.leases import LeaseError
from pdserve.common.handoff.sender import KvSender
from pdserve.common.request import Request
from pdserve.services.decode.prefill_peers import address_key
from pdserve.services.grpc_server import keepalive_channel_options
from pdserve.services.prefill.servicer import PrefillServicer
from pdserve.services.tls import internal_channel
from pdserve.services.worker import Worker
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

POLL_S = 0.02  # how often a drain looks for streams that came to decode, or pulls that ended
MAX_SOURCES = 8  # channels to draining decode workers kept open; the oldest closes first


class MigrationSource(PrefillServicer):
    """The `PrefillService` of a decode worker: `TransferKv` and `ReleaseKv` of the leases
    its drain granted. `sender` is the `KvSender` the `Migrator` leases with."""

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "a decode worker does not prefill: its PrefillService serves the KV of the "
            "streams it migrates (TransferKv, ReleaseKv)",
        )
        raise AssertionError("unreachable: abort raises")


class Migrator:
    def __init__(self, worker: Worker, sender: KvSender) -> None:
        self.worker = worker
        self.sender = sender
        self.draining = False  # no new request is taken but migrated ones (which stay)
        self.moved = 0  # streams handed to other workers
        # Streams moved here while this worker drains: they stay and finish here (when every
        # decode worker drains at once, streams are exchanged once, never back and forth).
        self.staying: set[str] = set()

    async def drain(self, grace_s: float) -> None:
        """Move every stream out (those still pulling or in a prompt once they decode), and
        wait until their leases end (pulled, released or expired), for `grace_s` at most."""
        self.draining = True
        end = time.monotonic() + grace_s
        loop = self.worker.loop
        while await loop.call(self._move) and time.monotonic() < end:
            await asyncio.sleep(POLL_S)
        logger.info("drain: %d streams moved to other decode workers", self.moved)

    def reclaim(self, lease_id: str, request_id: str) -> Request:
        """Engine thread: a stream this worker moved out comes back under `request_id` (no
        other decode worker could take it): its request, paused under the lease, rejoins
        the batch as it was. Raises `LeaseError` when the lease is gone or being pulled."""
        scheduler = self.worker.loop.engine.scheduler
        request = scheduler.leases.release(lease_id)
        if request is None:
            raise LeaseError(f"kv_handle.lease_id: {lease_id!r} is not held here, unsent")
        request.request_id = request_id
        scheduler.add_running(request)
        return request

    def _move(self) -> bool:
        """Engine thread: lease the KV of each decoding stream and end its stream with the
        handle (after its outputs so far: the same hop delivers them in order); whether
        anything is left to move or be pulled."""
        scheduler = self.worker.loop.engine.scheduler
        moved = migration.pause(scheduler, self.sender, self.staying)
        if moved:
            self.worker.loop.push([migrate_output(r, h) for r, h in moved])
            self.moved += len(moved)
            self.worker.metrics.migrated(len(moved))
        return migration.busy(scheduler)


def migrate_output(request: Request, handle: KvHandle) -> RequestOutput:
    """A stream's last output when its request moves: the handle, nothing else new."""
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason=None,
        prompt_tokens=request.num_prompt_tokens,
        cached_tokens=request.num_cached_tokens,
        token_ids=request.output_token_ids,
        text=request.output_text,
        migrate_kv=handle,
    )


class MigrationSources:
    """Channels to the draining decode workers this worker pulls migrated streams from."""

    def __init__(self, keepalive_s: float = GRPC_KEEPALIVE.default) -> None:
        self._options = keepalive_channel_options(keepalive_s)
        self._stubs: OrderedDict[
            str, tuple[grpc.aio.Channel, prefill_pb2_grpc.PrefillServiceStub]
        ] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        """The stub for a draining worker's address; raises ValueError for one that is not
        host:port."""
        key = address_key(address)
        entry = self._stubs.get(key)
        if entry is None:
            channel = internal_channel(key, self._options)
            entry = self._stubs[key] = (channel, prefill_pb2_grpc.PrefillServiceStub(channel))
            while len(self._stubs) > MAX_SOURCES:
                old, _ = self._stubs.popitem(last=False)[1]
                task = asyncio.ensure_future(old.close(grace=5.0))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        self._stubs.move_to_end(key)
        return entry[1]
