"""KV block transfer between workers: one interface, a UCX implementation for real
processes and an in-process one for unit tests. See `base.py` for the contract."""

from pdserve.common.kv_transfer.base import KvTransferError, KvTransport, TransferResult, settled

__all__ = ["KvTransferError", "KvTransport", "TransferResult", "create_transport", "settled"]


def create_transport(kind: str, **kwargs: object) -> KvTransport:
    """`ucx` (real processes) or `inproc` (one process, unit tests)."""
    if kind == "ucx":
        from pdserve.common.kv_transfer.ucx import UcxTransport

        return UcxTransport(**kwargs)  # type: ignore[arg-type]
    if kind == "inproc":
        from pdserve.common.kv_transfer.inproc import InprocTransport

        return InprocTransport(**kwargs)  # type: ignore[arg-type]
    raise ValueError(f"kv_transport: must be 'ucx' or 'inproc', got {kind!r}")
