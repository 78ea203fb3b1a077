"""Named fault points: where a test (or `make chaos`) makes a service fail on purpose, at one
named step of a request's life, to prove what happens there.

A service calls `hit(point)` (or `await ahit(point)` on an event loop) at each step named in
`POINTS`. Nothing happens unless the process was started with `PDSERVE_FAULTS`, a `;`-separated
list of `point=action[:arg][@n]`:

- `delay:S`: sleep S seconds there (a slow peer, a slow link);
- `fail`: raise `FaultInjected` (the step fails as if its work had failed);
- `kill`: SIGKILL this process (a crash at exactly that step);
- `stop`: SIGSTOP this process (a hung peer: alive, silent, its connections open);
- `corrupt`: returned to the caller, which corrupts what it holds there (only at the points
  in `CORRUPTIBLE`: KV blocks just landed on a decode worker, before they are checked).

`@n` fires on the n-th hit of the point only (1-based); without it, on every hit. Every
fault that fires is counted in `pdserve_faults_injected_total{point, action}` and logged as a
JSON line on stderr before it acts, so a test can check its fault hit the phase it names.
Service processes read `PDSERVE_FAULTS` at start (`arm_from_env`): an unknown point or action
stops them there with an error naming it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from prometheus_client import Counter

ENV = "PDSERVE_FAULTS"

POINTS = {
    "coordinator.before_prefill": "the coordinator has a prefill worker, before calling it",
    "coordinator.before_decode": "the coordinator holds a KV handle, before calling decode",
    "coordinator.before_stream_write": "before a token is written to the client's stream",
    "prefill.before_prefill": "a prefill worker got a request, before queueing it",
    "prefill.lease_granted": "a prefill worker leased the blocks, before answering",
    "prefill.before_send": "a prefill worker is about to send a lease's blocks",
    "decode.before_pull": "a decode worker admitted a handoff, before pulling its blocks",
    "decode.before_landing": "a decode worker pulled the blocks, before using them",
    "decode.before_step": "a decode worker is about to run a step",
    "decode.before_stream_write": "a decode worker is about to send tokens",
}
ACTIONS = ("delay", "fail", "kill", "stop", "corrupt")
CORRUPTIBLE = ("decode.before_landing",)

INJECTED = Counter(
    "pdserve_faults_injected", "Faults fired at named points (PDSERVE_FAULTS)", ["point", "action"]
)


class FaultInjected(RuntimeError):
    """A `fail` fault: the step fails here."""

    def __init__(self, point: str) -> None:
        super().__init__(f"fault injected at {point}")
        self.point = point


@dataclass(frozen=True)
class Fault:
    point: str
    action: str
    seconds: float = 0.0  # delay
    nth: int | None = None  # fire on this hit only


def parse(spec: str) -> dict[str, Fault]:
    """`PDSERVE_FAULTS`'s faults by point; raises ValueError naming what is wrong."""
    faults: dict[str, Fault] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        point, sep, rest = item.partition("=")
        if not sep or point not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {point!r} (known: {', '.join(POINTS)})")
        rest, at, nth = rest.partition("@")
        action, _, arg = rest.partition(":")
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: {point}: unknown action {action!r} ({', '.join(ACTIONS)})")
        if action == "corrupt" and point not in CORRUPTIBLE:
            raise ValueError(f"{ENV}: {point}: corrupt is only for {', '.join(CORRUPTIBLE)}")
        try:
            seconds = float(arg) if action == "delay" else 0.0
            count = int(nth) if at else None
        except ValueError:
            raise ValueError(f"{ENV}: {point}: bad number in {item!r}") from None
        if (action == "delay" and not seconds >= 0) or (count is not None and count < 1):
            raise ValueError(f"{ENV}: {point}: bad number in {item!r}")
        faults[point] = Fault(point, action, seconds, count)
    return faults


class FaultPoints:
    """The process's armed faults and how often each point was hit."""

    def __init__(self, faults: dict[str, Fault]) -> None:
        self.faults = faults
        self.hits: dict[str, int] = {}
        self._lock = threading.Lock()

    def fire(self, point: str) -> Fault | None:
        """The fault to act on at this hit of `point`, counted and logged; None if none."""
        if point not in POINTS:
            raise KeyError(f"unknown fault point {point!r}")
        fault = self.faults.get(point)
        if fault is None:
            return None
        with self._lock:
            n = self.hits[point] = self.hits.get(point, 0) + 1
        if fault.nth is not None and n != fault.nth:
            return None
        INJECTED.labels(point, fault.action).inc()
        line = {"event": "fault", "point": point, "action": fault.action, "hit": n}
        print(json.dumps(line), file=sys.stderr, flush=True)
        if fault.action == "fail":
            raise FaultInjected(point)
        if fault.action in ("kill", "stop"):
            os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
        return fault


_armed = FaultPoints({})


def arm(spec: str) -> None:
    """Arm the faults of `spec` (`PDSERVE_FAULTS`'s syntax), replacing any armed before."""
    global _armed
    _armed = FaultPoints(parse(spec))


def arm_from_env() -> None:
    """A service process's start: arm what `PDSERVE_FAULTS` names (ValueError if it is bad)."""
    arm(os.environ.get(ENV, ""))


def hit(point: str) -> str | None:
    """Reach `point` (blocking): delay, fail, kill or stop here as armed; returns "corrupt"
    for the caller to act on, else None."""
    fault = _armed.fire(point) if _armed.faults else None
    if fault is None or fault.action == "delay":
        if fault is not None:
            time.sleep(fault.seconds)
        return None
    return fault.action


async def ahit(point: str) -> str | None:
    """`hit` on an event loop: a delay sleeps without blocking the loop."""
    fault = _armed.fire(point) if _armed.faults else None
    if fault is None or fault.action == "delay":
        if fault is not None:
            await asyncio.sleep(fault.seconds)
        return None
    return fault.action
