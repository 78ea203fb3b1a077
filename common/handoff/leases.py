"""Prefilled requests whose KV blocks wait for a decode worker, on the prefill side of the
handoff. A lease pins the blocks until they are pulled (release on pull), released, or
expired. Expiry is on this host's monotonic clock; the handle carries the time left, never a
wall-clock time (hosts' clocks differ).

The table has its own lock so that the gRPC handlers grant leases and start transfers
without waiting for the engine thread (a prefill step can take seconds on a CPU); it never
frees blocks itself. A lease that ends (`end`: pulled or released) or expires leaves its
request for the engine's next step (`collect`), the only place that touches the block pool:
the scheduler frees them before it schedules."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.common.request import Request, RequestStatus


@dataclass
class Lease:
    lease_id: str
    request: Request
    expires_at: float  # time.monotonic() of this host: never another host's clock
    sending: bool = False  # a transfer is under way: it does not expire meanwhile
    # The leased blocks, in sequence order: the request's, or (a running request migrating
    # off a draining decode worker) those of its computed tokens.
    block_ids: list[int] = field(default_factory=list)


class LeaseError(KeyError):
    """The lease is unknown: never granted, already pulled or released, or expired."""


class LeaseBusy(RuntimeError):
    """The lease is being pulled right now."""


class LeaseTable:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._leases: dict[str, Lease] = {}
        self._ended: list[Request] = []  # leases over: their blocks to free at the next step
        self._lock = threading.Lock()
        self.num_expired = 0
        # Wakes an idle engine when there are blocks to free (set by the engine's loop).
        self.notify: Callable[[], None] = lambda: None

    def __len__(self) -> int:
        return len(self._leases)

    def busy(self) -> bool:
        """Leases held or ended: the engine's steps have work here (expiry, frees)."""
        return bool(self._leases or self._ended)

    def grant(self, request: Request, num_blocks: int | None = None) -> Lease:
        """Lease a PREFILLED request's blocks: all of them, or its first `num_blocks`."""
        assert request.status == RequestStatus.PREFILLED and request.blocks
        lease_id = f"{request.request_id}/{secrets.token_hex(8)}"
        block_ids = request.block_ids[:num_blocks]
        lease = Lease(lease_id, request, time.monotonic() + self.lease_s, block_ids=block_ids)
        with self._lock:
            self._leases[lease_id] = lease
        return lease

    def begin_send(self, lease_id: str, first_block: int, num_blocks: int = 0) -> list[int]:
        """The blocks to send, from `first_block` on; the lease stops expiring.
        `num_blocks`: what the receiver expects (0: unchecked); a mismatch raises
        ValueError and leaves the lease as it was."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise LeaseError(
                    f"lease_id: {lease_id!r} is not held here (never granted, already pulled "
                    "or released, or expired)"
                )
            if lease.sending:
                raise LeaseBusy(f"lease_id: {lease_id!r} is already being pulled")
            block_ids = lease.block_ids
            if not 0 <= first_block < len(block_ids):
                raise ValueError(
                    f"first_block: must be in [0, {len(block_ids)}) for this lease, "
                    f"got {first_block}"
                )
            if num_blocks and num_blocks != len(block_ids) - first_block:
                raise ValueError(
                    f"num_blocks: this lease holds {len(block_ids) - first_block} blocks from "
                    f"first_block {first_block}, the receiver posted {num_blocks} (the KV "
                    "handle does not match its lease)"
                )
            lease.sending = True
            return block_ids[first_block:]

    def pop(self, lease_id: str) -> Request | None:
        """End the lease; the caller frees the request's blocks (engine thread)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        return None if lease is None else lease.request

    def release(self, lease_id: str) -> Request | None:
        """End the lease unless a transfer is reading its blocks (that transfer frees them
        when it settles); the caller frees the request's blocks."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.sending:
                return None
            del self._leases[lease_id]
        return lease.request

    def pop_request(self, request: Request) -> bool:
        """End the lease of this request if it has one."""
        with self._lock:
            for lease_id, lease in self._leases.items():
                if lease.request is request:
                    del self._leases[lease_id]
                    return True
        return False

    def end(self, lease_id: str, unless_sending: bool = False) -> bool:
        """End the lease (pulled, or released: `unless_sending` then leaves a lease under
        transfer to that transfer); its blocks are freed at the engine's next step."""
        request = self.release(lease_id) if unless_sending else self.pop(lease_id)
        if request is None:
            return False
        with self._lock:
            self._ended.append(request)
        self.notify()
        return True

    def collect(self) -> list[Request]:
        """Engine thread, before a step: the requests whose blocks go back now (their lease
        ended or expired)."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended + self.pop_expired()

    def pop_expired(self) -> list[Request]:
        """The requests whose lease ran out unpulled; the caller frees their blocks."""
        now = time.monotonic()
        with self._lock:
            expired = [k for k, v in self._leases.items() if v.expires_at <= now and not v.sending]
            requests = [self._leases.pop(k).request for k in expired]
        self.num_expired += len(requests)
        return requests
