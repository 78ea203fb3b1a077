"""The wait between tries of every retry loop in the services: the coordinator reconnecting
to a worker's status stream, re-listing and re-watching EndpointSlices, and handing a
prefilled request to a busy decode pool again. Exponential backoff with a cap and optional
jitter, reset after a success; the same object serves an asyncio task or a thread."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable


class Backoff:
    """The n-th failure in a row waits `initial_s * factor**(n-1)`, at most `max_s`; with
    `jitter` j each wait is drawn uniformly from [(1 - j) * wait, wait], so that clients that
    failed together do not all come back at once. `reset()` after a success starts over.

    `sleep`, `async_sleep` and `rand` (uniform in [0, 1)) are the clock's and the dice's
    stand-ins for tests."""

    def __init__(
        self,
        initial_s: float,
        max_s: float,
        factor: float = 2.0,
        jitter: float = 0.0,
        *,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not 0 <= initial_s <= max_s or factor < 1 or not 0 <= jitter <= 1:
            raise ValueError(
                f"backoff: need 0 <= initial_s <= max_s, factor >= 1 and 0 <= jitter <= 1; "
                f"got {initial_s}, {max_s}, {factor}, {jitter}"
            )
        self.initial_s, self.max_s, self.factor, self.jitter = initial_s, max_s, factor, jitter
        self._sleep, self._async_sleep, self._rand = sleep, async_sleep, rand
        self.failures = 0  # in a row, since the last reset
        self._wait_s = initial_s  # the next failure's wait before jitter

    def reset(self) -> None:
        """A try succeeded: the next failure waits `initial_s` again."""
        self.failures, self._wait_s = 0, self.initial_s

    def next_delay(self) -> float:
        """Counts one more failure; the seconds to wait before the next try."""
        wait = self._wait_s
        self.failures += 1
        self._wait_s = min(self.max_s, wait * self.factor)
        return wait * (1.0 - self.jitter * self._rand())

    async def wait(self) -> None:
        """Counts one more failure and waits its delay (in an asyncio task)."""
        await self._async_sleep(self.next_delay())

    def wait_blocking(self) -> None:
        """Counts one more failure and waits its delay (in a thread)."""
        self._sleep(self.next_delay())
