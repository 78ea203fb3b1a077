"""The retry loops' backoff (common/retry.py): exponential waits up to a cap, jitter within
its band, reset after a success, and the same object waiting in an asyncio task or in a
thread; the clock's and the dice's stand-ins record every wait, so nothing sleeps."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.common.retry import Backoff


class Clock:
    """Records the waits asked of it, from a thread or from an asyncio task."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.threads: set[str] = set()

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.threads.add(threading.current_thread().name)

    async def async_sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.threads.add(threading.current_thread().name)


def backoff(clock: Clock, *args: float, rand: float = 0.0, **kwargs: float) -> Backoff:
    return Backoff(
        *args, **kwargs, sleep=clock.sleep, async_sleep=clock.async_sleep, rand=lambda: rand
    )


def test_waits_double_up_to_the_cap() -> None:
    clock = Clock()
    b = backoff(clock, 0.2, 2.0)
    for _ in range(7):
        b.wait_blocking()
    assert clock.waits == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0])
    assert b.failures == 7


def test_another_factor_and_a_cap_below_the_next_step() -> None:
    b = Backoff(0.5, 3.0, factor=3.0)
    assert [b.next_delay() for _ in range(4)] == pytest.approx([0.5, 1.5, 3.0, 3.0])
    assert [Backoff(0.0, 30.0).next_delay() for _ in range(3)] == [0.0, 0.0, 0.0]


def test_a_success_starts_over() -> None:
    b = Backoff(0.02, 0.2)
    first = [b.next_delay() for _ in range(5)]
    b.reset()
    assert b.failures == 0
    assert (
        [b.next_delay() for _ in range(5)] == first == pytest.approx([0.02, 0.04, 0.08, 0.16, 0.2])
    )


def test_a_long_outage_stays_at_the_cap() -> None:
    b = Backoff(0.2, 2.0)
    for _ in range(5000):  # 0.2 * 2**4999 would overflow a float
        delay = b.next_delay()
    assert delay == 2.0 and b.failures == 5000


@pytest.mark.parametrize(("rand", "expected"), [(0.0, 0.8), (0.5, 0.6), (0.999, 0.4004)])
def test_jitter_draws_within_its_band(rand: float, expected: float) -> None:
    clock = Clock()
    b = backoff(clock, 0.2, 2.0, jitter=0.5, rand=rand)
    for _ in range(3):  # the third wait is 0.8 before jitter
        b.wait_blocking()
    assert clock.waits[-1] == pytest.approx(expected)
    assert all(0.5 * w < got <= w for got, w in zip(clock.waits, [0.2, 0.4, 0.8], strict=True))


def test_jitter_does_not_compound() -> None:
    """The band is around the exponential wait, not around the last jittered one."""
    b = Backoff(1.0, 100.0, jitter=1.0, rand=lambda: 0.999)
    assert [round(b.next_delay(), 3) for _ in range(4)] == [0.001, 0.002, 0.004, 0.008]
    assert Backoff(1.0, 100.0, jitter=1.0, rand=lambda: 0.0).next_delay() == 1.0


def test_the_same_backoff_serves_a_task_and_a_thread() -> None:
    clock = Clock()
    b = backoff(clock, 0.1, 1.0)

    async def task() -> None:
        await b.wait()
        await b.wait()

    asyncio.run(task())
    worker = threading.Thread(target=b.wait_blocking, name="retry-thread")
    worker.start()
    worker.join()
    assert clock.waits == pytest.approx([0.1, 0.2, 0.4])
    assert clock.threads == {threading.current_thread().name, "retry-thread"}


def test_without_stand_ins_it_waits_on_the_real_clocks() -> None:
    b = Backoff(0.0, 0.0)  # zero waits: asyncio.sleep(0) and time.sleep(0)
    asyncio.run(b.wait())
    b.wait_blocking()
    assert b.failures == 2


@pytest.mark.parametrize(
    "args", [(-1.0, 1.0), (2.0, 1.0), (0.1, 1.0, 0.5), (0.1, 1.0, 2.0, -0.1), (0.1, 1.0, 2.0, 1.5)]
)
def test_nonsense_is_refused(args: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(*args)
