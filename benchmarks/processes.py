"""pdserve service processes for the benchmarks that run real ones (`abort_storm.py`,
`migration.py`): started with `pdserve <role> --port 0` (or a given port), ready once gRPC
health says SERVING, read through their Prometheus metrics, stopped by their pid."""

from __future__ import annotations

import asyncio
import subprocess
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.grpc_server import wait_healthy
from pdserve.services.launcher import ServiceChild


class Service:
    def __init__(self, role: str, *args: str, port: int = 0) -> None:
        self.role, self.args = role, args
        argv = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", *args]
        self.child = ServiceChild(role, argv)
        self.info = self.child.wait_listening(300)
        asyncio.run(wait_healthy(self.info["grpc"], 300))

    @property
    def port(self) -> int:
        return int(self.info["grpc"].rsplit(":", 1)[1])

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(self.info["metrics"], timeout=10) as r:
            text = r.read().decode()
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def restarted(self) -> Service:
        """The same worker again, on the same port (so the coordinator finds it)."""
        return Service(self.role, *self.args, port=self.port)

    def stop(self) -> None:
        proc = self.child.proc
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
