"""What the fuzz tests share: how many cases to run (`PDSERVE_FUZZ_CASES`), the seed
(`PDSERVE_FUZZ_SEED`, else a fixed one in `make test` and a random one in `make fuzz`,
always printed), the figures `make fuzz` prints,
and the real system they run against: a colocated worker behind a coordinator with HTTP on,
and a prefill + decode pair behind a second coordinator. The processes are started once for
the directory's tests through tests/integration/services.py (the workers side by side) and
started again when a test left one dead, so a crash fails the test that caused it and not
the ones after it."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))  # services.py

from services import RunningService, start

# One engine configuration for every worker: a small context so prompts and outputs stay
# short on a CPU, one thread each (the machine's cores are shared), a short lease and
# transfer timeout so that blocks a fuzzed client never pulls (or sends nowhere) come back
# within the test.
MAX_MODEL_LEN = 256
KV_LEASE_S = 3.0
TRANSFER_TIMEOUT_S = 5.0
WORKER_ARGS = ["--threads", "1", "--kv-cache-tokens", "4096", "--drain-timeout", "2",
               "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
WORKERS = ("colocated", "prefill", "decode")
IDLE_TIMEOUT_S = KV_LEASE_S + TRANSFER_TIMEOUT_S + 30.0  # leases expire, transfers give up

# Cases each test runs: its share of PDSERVE_FUZZ_CASES when set (make fuzz), else the
# default below, sized so each module runs in about three minutes on a 2-core CPU.
DEFAULT_CASES = {"http": 400, "grpc": 1500}
SHARES = {"http": 0.1, "grpc": 0.9}


def budget(suite: str) -> int:
    total = os.environ.get("PDSERVE_FUZZ_CASES")
    if not total:
        return DEFAULT_CASES[suite]
    return max(1, int(int(total) * SHARES[suite]))


# `make test` runs its bounded cases from one fixed seed, so a CI run is reproducible (what
# Hypothesis advises for CI); `make fuzz` (PDSERVE_FUZZ_CASES set) explores from a new seed.
CI_SEED = 20261202


def seed() -> int:
    value = os.environ.get("PDSERVE_FUZZ_SEED")
    if value:
        return int(value)
    if not os.environ.get("PDSERVE_FUZZ_CASES"):
        return CI_SEED
    return random.SystemRandom().randrange(2**32)


@dataclass
class Figures:
    """Per test: cases run, failures (not-fine outcomes), known-bug hits, statuses seen."""

    cases: int = 0
    failures: int = 0
    known_bugs: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    seed: int | None = None
    seconds: float = 0.0
    blocks_back_s: float = 0.0  # after the last case, until every KV block was free again

    def count(self, outcome: str) -> None:
        self.cases += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


FIGURES: dict[str, Figures] = {}


def figures(test: str, seed_value: int) -> Figures:
    FIGURES[test] = Figures(seed=seed_value)
    return FIGURES[test]


def figures_json() -> str:
    total = {
        "cases": sum(f.cases for f in FIGURES.values()),
        "failures": sum(f.failures for f in FIGURES.values()),
        "known_bug_cases": sum(sum(f.known_bugs.values()) for f in FIGURES.values()),
    }
    tests = {name: vars(f) for name, f in FIGURES.items()}
    return json.dumps({"pdserve_fuzz": {**total, "tests": tests}}, sort_keys=True)


# ---- the system under test -------------------------------------------------------------


class Cluster:
    """Services by name, started on first use: "colocated" and "http_coordinator" (its
    coordinator, HTTP on), "prefill", "decode" and "coordinator" (in front of those two)."""

    def __init__(self) -> None:
        self.services: dict[str, RunningService] = {}
        self._lock = threading.Lock()
        self.all_free: dict[str, int] = {}  # free blocks per worker as started: all of them

    def get(self, name: str) -> RunningService:
        with self._lock:
            self._start(name)
            return self.services[name]

    def _start(self, name: str) -> None:
        if name in self.services:
            return
        if name == "http_coordinator":
            self._start("colocated")
            self.services[name] = start(
                "coordinator",
                f"--colocated-workers={self.services['colocated'].grpc}",
                "--http-port=0",
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--drain-timeout",
                "2",
            )
        elif name == "coordinator":
            _start_parallel(self.services, ["prefill", "decode"])
            self.services[name] = start(
                "coordinator",
                f"--prefill-workers={self.services['prefill'].grpc}",
                f"--decode-workers={self.services['decode'].grpc}",
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--drain-timeout",
                "2",
            )
        else:
            _start_parallel(self.services, [name])

    def start_all(self, names: list[str]) -> None:
        """Start the workers among `names` side by side (each loads the model), then the
        rest."""
        needs = {"http_coordinator": ["colocated"], "coordinator": ["prefill", "decode"]}
        workers = [w for n in names for w in needs.get(n, [n]) if w in WORKERS]
        with self._lock:
            _start_parallel(self.services, workers)
        self.idle_free_blocks()  # read before any request
        for name in names:
            self.get(name)
        self.idle_free_blocks()

    def idle_free_blocks(self) -> dict[str, int]:
        """What `free_blocks` reads once every request is done: each worker's free blocks
        when it started (cached-but-unused blocks count as free)."""
        with self._lock:
            for name, service in self.services.items():
                if name in WORKERS and name not in self.all_free:
                    self.all_free[name] = service.free_blocks()
            return {n: self.all_free[n] for n in self.services if n in WORKERS}

    def dead(self) -> list[str]:
        return [n for n, s in self.services.items() if s.proc.poll() is not None]

    def restart_if_dead(self) -> None:
        """Anything dead: stop everything, so the next `get` starts a consistent system
        (coordinators hold their workers' addresses)."""
        if self.dead():
            self.stop()

    def stop(self) -> None:
        for name in ("http_coordinator", "coordinator", *WORKERS):
            service = self.services.pop(name, None)
            self.all_free.pop(name, None)
            if service is not None:
                service.stop()


def _start_parallel(services: dict[str, RunningService], names: list[str]) -> None:
    todo = [n for n in dict.fromkeys(names) if n not in services]  # each once
    errors: list[BaseException] = []

    def one(name: str) -> None:
        args = list(WORKER_ARGS)
        if name in ("prefill", "decode"):
            args += ["--transfer-timeout", str(TRANSFER_TIMEOUT_S)]
        if name == "prefill":
            args += ["--kv-lease", str(KV_LEASE_S)]
        try:
            services[name] = start(name, *args)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(n,)) for n in todo]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def wait_for(predicate: Callable[[], Any], timeout_s: float, every_s: float = 0.25) -> Any:
    """Poll until `predicate()` is truthy; its last value either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every_s)


def free_blocks(services: dict[str, RunningService]) -> dict[str, int]:
    return {name: s.free_blocks() for name, s in services.items() if name in WORKERS}


def wait_blocks_back(
    services: dict[str, RunningService], before: dict[str, int], fig: Figures | None = None
) -> dict:
    """Free blocks per worker once back to `before`, or as they are at the deadline; how
    long that took goes into `fig`."""
    now: dict[str, int] = {}
    started = time.monotonic()

    def back() -> bool:
        now.update(free_blocks(services))
        return now == before

    wait_for(back, IDLE_TIMEOUT_S)
    if fig is not None:
        fig.blocks_back_s = round(time.monotonic() - started, 1)
    return now
