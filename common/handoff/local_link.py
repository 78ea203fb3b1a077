"""A decode side and a prefill side of the handoff in one process: the `PrefillLink` that
calls a `KvSender` directly, where between processes the gRPC link calls `TransferKv` and
`ReleaseKv` (`services/decode/prefill_link.py`). The handoff's unit tests drive the real
sender and receiver through it over the in-process transport."""

from __future__ import annotations

from opentelemetry.trace import Span

from pdserve.common.handoff.handle import TransferOrder
from pdserve.common.handoff.leases import LeaseBusy, LeaseError
from pdserve.common.handoff.receiver import PullFailed
from pdserve.common.handoff.sender import KvSender
from pdserve.common.kv_transfer import KvTransferError


class LocalLink:
    def __init__(self, sender: KvSender) -> None:
        self.sender = sender

    async def transfer(self, order: TransferOrder, span: Span) -> list[int]:
        """The prefill side's answers, as `TransferKv` gives them."""
        try:
            return list((await self.sender.send(order, self.sender.receivers(order))).checksums)
        except LeaseError as e:
            raise PullFailed(f"NOT_FOUND: {e.args[0]}", PullFailed.STALE) from e
        except LeaseBusy as e:
            raise PullFailed(f"FAILED_PRECONDITION: {e}", PullFailed.STALE) from e
        except ValueError as e:
            raise PullFailed(f"INVALID_ARGUMENT: {e}", PullFailed.INVALID) from e
        except KvTransferError as e:
            raise PullFailed(f"UNAVAILABLE: KV transfer failed: {e}") from e

    async def release(self, lease_id: str) -> None:
        self.sender.release(lease_id)
