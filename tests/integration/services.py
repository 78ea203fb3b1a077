"""The one way tests run pdserve service processes: start `pdserve <role> --port 0` as a
real process, read its "listening" line, wait until `grpc.health.v1` says SERVING, and
always stop it (SIGTERM, then SIGKILL) — also when the test fails. Plus small readers for
a service's Prometheus metrics (through `prometheus_client.parser`)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pdserve.services.grpc_server import wait_healthy
from pdserve.services.launcher import ServiceChild
from pdserve.services.tls import TlsFiles

START_TIMEOUT_S = 180.0


@dataclass
class RunningService:
    role: str
    proc: subprocess.Popen
    info: dict = field(default_factory=dict)

    @property
    def grpc(self) -> str:
        return self.info["grpc"]

    @property
    def metrics_url(self) -> str:
        return self.info["metrics"]

    def metrics(self) -> list[Sample]:
        """Every sample on /metrics (name as printed, labels, value)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name` over samples whose labels include `labels`."""
        return sum(
            (
                s.value
                for s in self.metrics()
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
            ),
            0.0,
        )

    def free_blocks(self) -> int:
        return int(self.metric("pdserve_kv_cache_blocks_free"))

    def blocks_once_idle(self, timeout_s: float = 30.0) -> tuple[int, int]:
        """(free, total) KV blocks once all are free again or the deadline passed: a
        stream's blocks are freed just after its last token was sent, so a test that
        checks for leaks right after a response polls rather than races."""
        total = int(self.metric("pdserve_kv_cache_num_blocks"))
        deadline = time.monotonic() + timeout_s
        while (free := self.free_blocks()) != total and time.monotonic() < deadline:
            time.sleep(0.2)
        return free, total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: the process dies without cleaning up, as on a crash."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start(
    role: str, *args: str, env: dict[str, str] | None = None, stderr: Any = None
) -> RunningService:
    """`args` may name `--port` (and `--metrics-port`) again: the last one counts."""
    child = ServiceChild(
        role, ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *args], env, stderr
    )
    service = RunningService(role, child.proc)
    try:
        service.info = child.wait_listening(START_TIMEOUT_S)
        if "health" in service.info:  # the plain health port, where no certificate is asked
            asyncio.run(wait_healthy(service.info["health"], START_TIMEOUT_S))
        else:
            tls = TlsFiles.from_env(env or {}) if role != "coordinator" else None
            asyncio.run(wait_healthy(service.grpc, START_TIMEOUT_S, tls))
    except BaseException:
        service.kill()
        raise
    return service


@contextlib.contextmanager
def running(role: str, *args: str, env: dict[str, str] | None = None) -> Iterator[RunningService]:
    service = start(role, *args, env=env)
    try:
        yield service
    finally:
        service.stop()


def post(address: str, path: str, body: object, headers: dict | None = None) -> tuple:
    """Raw HTTP POST of JSON (or of `body` bytes as they are): (status, headers, parsed
    JSON body)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    payload = json.loads(response.read() or b"null")
    conn.close()
    return response.status, response.headers, payload


def wait_idle(workers: dict, free: dict[str, int], timeout_s: float = 30.0) -> dict[str, int]:
    """Free blocks per worker (`workers[role]`) once they are back to `free` (or the
    deadline passed): frees happen just after a stream ends."""
    deadline = time.monotonic() + timeout_s
    now = {}
    while time.monotonic() < deadline:
        now = {role: workers[role].free_blocks() for role in free}
        if now == free:
            break
        time.sleep(0.2)
    return now
