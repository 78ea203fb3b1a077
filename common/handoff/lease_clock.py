"""A lease's end as it crosses hosts (steps 3 to 6 of a request's path: prefill grants the
lease, the coordinator forwards its handle, decode waits for blocks within it). No two
hosts' wall clocks agree, so no host ever sends or reads a time of day: the handle carries
the milliseconds the lease has left as it is sent (`ttl_ms`), and each host that receives
it counts them down on its own monotonic clock from the moment it arrived (`deadline`),
sending on what is left (`ttl_ms` again). Torch-free: the coordinator imports it."""

from __future__ import annotations

import time

# The wire field's range (uint32 milliseconds, about 49 days): a longer lease is sent as this.
MAX_TTL_MS = 2**32 - 1


def deadline(ttl_ms: int) -> float:
    """The `time.monotonic()` on this host at which a lease with `ttl_ms` left now ends."""
    return time.monotonic() + ttl_ms / 1000


def left(end: float) -> float:
    """Seconds until a lease ending at monotonic time `end` ends (0 once over)."""
    return max(0.0, end - time.monotonic())


def ttl_ms(end: float) -> int:
    """What a lease ending at monotonic time `end` has left now, for the wire."""
    return min(MAX_TTL_MS, int(left(end) * 1000))
