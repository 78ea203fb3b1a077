"""What the handoff reports of each transfer, whoever counts it (a worker's Prometheus
metrics, `services/metrics.py`; nothing in tests that do not look)."""

from __future__ import annotations

from typing import Protocol


class TransferMetrics(Protocol):
    def transfer(
        self, transport: str, direction: str, blocks: int, num_bytes: int, seconds: float
    ) -> None:
        """A transfer done: `direction` "send" (prefill) or "receive" (decode)."""

    def transfer_failed(self, transport: str, direction: str) -> None:
        """A transfer that failed, was cancelled or timed out."""


class NoMetrics:
    def transfer(
        self, transport: str, direction: str, blocks: int, num_bytes: int, seconds: float
    ) -> None:
        pass

    def transfer_failed(self, transport: str, direction: str) -> None:
        pass
