"""An in-process KV transport for unit tests: transports in one process find each other in
a registry and copy blocks between their pools. Same contract as the UCX one (tags, futures,
timeouts, cancellation); its real twin runs between processes in the integration tests."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from pdserve.common.kv_transfer.base import KvTransferError, KvTransport, TransferResult

_registry: dict[bytes, InprocTransport] = {}
_registry_lock = threading.Lock()


@dataclass
class _Receive:
    block_ids: list[int]
    future: Future[TransferResult]
    posted: float
    timer: threading.Timer
    buffers: dict[int, torch.Tensor] | None = None  # a buffer receive: index → buffer
    nbytes: int = 0  # bytes of its buffers filled so far


class InprocTransport(KvTransport):
    kind = "inproc"

    def __init__(self) -> None:
        super().__init__()
        self._address = f"inproc:{uuid.uuid4().hex}".encode()
        self._pool: torch.Tensor | None = None
        self._receives: dict[int, _Receive] = {}
        self._lock = threading.Lock()
        with _registry_lock:
            _registry[self._address] = self

    @property
    def address(self) -> bytes:
        return self._address

    def register_pool(self, kv_cache: torch.Tensor) -> None:
        self._pool = kv_cache

    def post_receive(
        self, tag: int, block_ids: Sequence[int], timeout: float
    ) -> Future[TransferResult]:
        pool = self._require_pool()
        self.check_blocks(block_ids, pool.shape[0])
        future: Future[TransferResult] = Future()
        timer = threading.Timer(timeout, self._fail, (tag, f"timed out after {timeout:.1f} s"))
        timer.daemon = True
        with self._lock:
            self._receives[tag] = _Receive(list(block_ids), future, time.monotonic(), timer)
        timer.start()
        return future

    def send(
        self, peer: bytes, tag: int, block_ids: Sequence[int], timeout: float
    ) -> Future[TransferResult]:
        future: Future[TransferResult] = Future()
        start = time.monotonic()
        try:
            src = self._require_pool()
            self.check_blocks(block_ids, src.shape[0])
            with _registry_lock:
                target = _registry.get(peer)
            if target is None:
                raise KvTransferError(f"peer {peer!r} is not reachable")
            receive = target._take(tag)
            if receive is None:
                raise KvTransferError(f"no receive is posted under tag {tag:#x} at the peer")
            if len(receive.block_ids) != len(block_ids):
                error = KvTransferError(
                    f"block count mismatch: sending {len(block_ids)}, "
                    f"receiver expects {len(receive.block_ids)}"
                )
                receive.future.set_exception(error)
                raise error
            dst = target._require_pool()
            src_idx = torch.tensor(list(block_ids), device=src.device)
            dst_idx = torch.tensor(receive.block_ids, device=dst.device)
            dst.index_copy_(0, dst_idx, src.index_select(0, src_idx).to(dst.device))
            nbytes = len(block_ids) * src[0].numel() * src.element_size()
            now = time.monotonic()
            receive.future.set_result(TransferResult(len(block_ids), nbytes, now - receive.posted))
            future.set_result(TransferResult(len(block_ids), nbytes, now - start))
        except KvTransferError as e:
            future.set_exception(e)
        return future

    def post_receive_buffers(
        self, tag: int, buffers: Sequence[tuple[int, torch.Tensor]], timeout: float
    ) -> Future[TransferResult]:
        future: Future[TransferResult] = Future()
        timer = threading.Timer(timeout, self._fail, (tag, f"timed out after {timeout:.1f} s"))
        timer.daemon = True
        with self._lock:
            indices = [i for i, _ in buffers]  # counted as its "blocks"
            self._receives[tag] = _Receive(indices, future, time.monotonic(), timer, dict(buffers))
        timer.start()
        return future

    def send_buffers(
        self, peer: bytes, tag: int, buffers: Sequence[tuple[int, torch.Tensor]], timeout: float
    ) -> Future[TransferResult]:
        """Copy each buffer into the peer's receive buffer of the same index; the receive
        completes once all of its buffers came (from one or several senders)."""
        future: Future[TransferResult] = Future()
        start = time.monotonic()
        with _registry_lock:
            target = _registry.get(peer)
        with target._lock if target is not None else threading.Lock():
            receive = target._receives.get(tag) if target is not None else None
            wanted = receive.buffers if receive is not None else None
            if wanted is None or any(i not in wanted for i, _ in buffers):
                future.set_exception(
                    KvTransferError(f"no buffer receive for these indices under tag {tag:#x}")
                )
                return future
            nbytes = 0
            for index, buffer in buffers:
                wanted.pop(index).copy_(buffer)
                nbytes += buffer.numel() * buffer.element_size()
            receive.nbytes += nbytes
            complete = not wanted
            if complete:
                target._receives.pop(tag)
        now = time.monotonic()
        if complete:
            receive.timer.cancel()
            receive.future.set_result(
                TransferResult(len(receive.block_ids), receive.nbytes, now - receive.posted)
            )
        future.set_result(TransferResult(len(buffers), nbytes, now - start))
        return future

    def cancel(self, tag: int) -> None:
        self._fail(tag, "cancelled")

    def close(self) -> None:
        with _registry_lock:
            _registry.pop(self._address, None)
        for tag in list(self._receives):
            self._fail(tag, "transport closed")

    def _take(self, tag: int) -> _Receive | None:
        with self._lock:
            receive = self._receives.pop(tag, None)
        if receive is not None:
            receive.timer.cancel()
        return receive

    def _fail(self, tag: int, why: str) -> None:
        receive = self._take(tag)
        if receive is not None and not receive.future.done():
            receive.future.set_exception(KvTransferError(f"receive {tag:#x}: {why}"))

    def _require_pool(self) -> torch.Tensor:
        if self._pool is None:
            raise KvTransferError("register_pool must be called before a transfer")
        return self._pool
