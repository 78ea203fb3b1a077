"""Prefilled requests whose KV blocks wait for a decode worker, on the prefill side of the
handoff. A lease pins the blocks until they are pulled (release on pull), released, or
expired. Only the engine thread touches this table (through `EngineLoop.call` and its
housekeeping hook), like every other piece of KV state."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from pdserve.common.engine import LLMEngine
from pdserve.common.request import Request, RequestStatus


@dataclass
class Lease:
    lease_id: str
    request: Request
    expires_at: float  # time.monotonic()
    expires_at_unix: float  # time.time(), for the handle
    sending: bool = False  # a transfer is under way: it does not expire meanwhile


class LeaseError(KeyError):
    """The lease is unknown: never granted, already pulled or released, or expired."""


class LeaseTable:
    def __init__(self, engine: LLMEngine, lease_s: float) -> None:
        self.engine = engine
        self.lease_s = lease_s
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, request: Request) -> Lease:
        assert request.status == RequestStatus.PREFILLED and request.blocks
        lease_id = f"{request.request_id}/{secrets.token_hex(8)}"
        lease = Lease(
            lease_id, request, time.monotonic() + self.lease_s, time.time() + self.lease_s
        )
        self._leases[lease_id] = lease
        return lease

    def begin_send(self, lease_id: str, first_block: int) -> list[int]:
        """The blocks to send, from `first_block` on; the lease stops expiring."""
        lease = self._get(lease_id)
        if lease.sending:
            raise LeaseError(f"lease_id: {lease_id!r} is already being pulled")
        block_ids = lease.request.block_ids
        if not 0 <= first_block < len(block_ids):
            raise ValueError(
                f"first_block: must be in [0, {len(block_ids)}) for this lease, got {first_block}"
            )
        lease.sending = True
        return block_ids[first_block:]

    def release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.engine.free_request(lease.request)
        return True

    def release_request(self, request: Request) -> None:
        """Free a prefilled request's blocks whether or not a lease was granted for it."""
        for lease_id, lease in list(self._leases.items()):
            if lease.request is request:
                self.release(lease_id)
                return
        if request.status == RequestStatus.PREFILLED:
            self.engine.free_request(request)

    def expire(self) -> None:
        """Housekeeping: free the blocks of leases nobody pulled in time."""
        now = time.monotonic()
        for lease_id in [k for k, v in self._leases.items() if v.expires_at <= now]:
            if not self._leases[lease_id].sending:
                self.release(lease_id)
                self.num_expired += 1

    def _get(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseError(
                f"lease_id: {lease_id!r} is not held here (never granted, already pulled or "
                "released, or expired)"
            )
        return lease
