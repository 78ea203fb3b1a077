"""KV handoff between tensor-parallel groups: a prefill group of P ranks and a decode group
of D (either may be one process; P = D = 1 is the plain whole-block path of `sender.py` and
`receiver.py`).

Every rank of a group has its own transport on its own pool; rank 0 gathers their addresses
at start (`gather_addresses`). The prefill KV handle names the prefill group's size and
addresses, decode's TransferKv call the decode group's. Both rank 0s compute the same
`head_slices.plan` and each slice travels straight from the rank that holds its heads to the
rank that keeps them, one message each under tag | slice index:

- decode: rank 0 posts its own receives and has the other ranks post theirs (a `post`
  command over the group's step channel, `tp_steps`), calls TransferKv, waits for its own
  slices, then has the others wait for and copy in theirs (`land`); any failure is the
  pull's failure and every rank cancels (`drop`);
- prefill: rank 0 sends its slices and has the other ranks send theirs (`send`); each rank
  copies its slices out of its blocks when it gets the command, so the lease's blocks may
  be freed as soon as rank 0's own sends are done.

Commands run in order with the group's steps, so no step writes a block between a rank's
copy and the transfer it belongs to."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import torch.distributed as dist

from pdserve.common.kv_transfer import KvTransport
from pdserve.common.kv_transfer.base import KvTransferError, TransferResult
from pdserve.common.kv_transfer.head_slices import HeadSlice, empty_buffer, pack, unpack

logger = logging.getLogger(__name__)


def gather_addresses(transport: KvTransport) -> list[bytes]:
    """Every rank's transport address, in rank order (a collective of the whole group)."""
    addresses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, transport.address)
    return [bytes(a) for a in addresses]


def send_slices(
    transport: KvTransport,
    kv_cache: torch.Tensor,
    block_ids: Sequence[int],
    slices: Sequence[HeadSlice],
    peers: Sequence[bytes],
    tag: int,
    timeout: float,
) -> list[Future[TransferResult]]:
    """Copy these slices out of the blocks and send them, one send per receiving rank."""
    by_rank: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for s in slices:
        by_rank.setdefault(s.dst_rank, []).append((s.index, pack(kv_cache, list(block_ids), s)))
    return [
        transport.send_buffers(peers[rank], tag, buffers, timeout)
        for rank, buffers in by_rank.items()
    ]


def all_of(futures: Sequence[Future[TransferResult]], num_blocks: int) -> Future[TransferResult]:
    """One future for several transfers of the same `num_blocks` blocks' slices: their
    bytes summed, the longest time; the first failure fails it (once all have finished)."""
    combined: Future[TransferResult] = Future()
    combined.set_running_or_notify_cancel()
    pending = list(futures)
    lock = threading.Lock()

    def finished(_: Future[TransferResult]) -> None:
        with lock:
            if not all(f.done() for f in pending) or combined.done():
                return
            _settle(combined, pending, num_blocks)

    if not pending:
        combined.set_result(TransferResult(num_blocks, 0, 0.0))
    for f in pending:
        f.add_done_callback(finished)
    return combined


def _settle(
    combined: Future[TransferResult], pending: list[Future[TransferResult]], num_blocks: int
) -> None:
    failed = next((f.exception() for f in pending if f.exception() is not None), None)
    if failed is not None:
        combined.set_exception(failed)
        return
    results = [f.result() for f in pending]
    combined.set_result(TransferResult(
        num_blocks, sum(r.num_bytes for r in results), max(r.seconds for r in results)
    ))  # fmt: skip


class SliceReceive:
    """One rank's receive of its slices of a transfer, copied into its blocks by `land`."""

    def __init__(
        self,
        transport: KvTransport,
        kv_cache: torch.Tensor,
        block_ids: Sequence[int],
        slices: Sequence[HeadSlice],
        tag: int,
        timeout: float,
    ) -> None:
        self.transport, self.kv_cache, self.tag = transport, kv_cache, tag
        self.block_ids = list(block_ids)
        self.slices = list(slices)
        self.buffers = [empty_buffer(kv_cache, len(self.block_ids), s) for s in self.slices]
        self.future = transport.post_receive_buffers(
            tag, [(s.index, b) for s, b in zip(self.slices, self.buffers, strict=True)], timeout
        )

    def land(self) -> None:
        """Once every slice came: copy them into the blocks."""
        self.future.result()
        for s, buffer in zip(self.slices, self.buffers, strict=True):
            unpack(self.kv_cache, self.block_ids, s, buffer)

    def drop(self, wait_s: float = 10.0) -> None:
        """Cancel, and wait until the transport is done with the buffers."""
        self.transport.cancel(self.tag)
        with contextlib.suppress(KvTransferError, FutureTimeout):
            self.future.result(timeout=wait_s)


class FollowerKv:
    """Ranks 1..N-1: the KV commands rank 0 sends (`ModelRunner.follow`'s handler)."""

    def __init__(
        self, rank: int, transport: KvTransport, kv_cache: torch.Tensor, timeout_s: float
    ) -> None:
        self.rank, self.transport, self.kv_cache = rank, transport, kv_cache
        self.timeout_s = timeout_s
        self.receives: dict[int, SliceReceive] = {}

    def __call__(self, command: dict[str, Any]) -> int:
        kind, tag = command["kind"], command["tag"]
        if kind == "send":
            mine = [s for s in command["plan"] if s.src_rank == self.rank]
            for future in send_slices(self.transport, self.kv_cache, command["blocks"], mine,
                                      command["peers"], tag, self.timeout_s):  # fmt: skip
                future.add_done_callback(_log_failure)
            return 0
        if kind == "post":
            mine = [s for s in command["plan"] if s.dst_rank == self.rank]
            self.receives[tag] = SliceReceive(
                self.transport, self.kv_cache, command["blocks"], mine, tag, self.timeout_s
            )
            return 0
        receive = self.receives.pop(tag, None)
        if kind == "land":
            if receive is None:
                return 1
            try:
                receive.land()
            except KvTransferError as e:
                logger.warning("KV slices under tag %#x did not arrive: %s", tag, e)
                return 1
            return 0
        if kind == "drop":
            if receive is not None:
                receive.drop()
            return 0
        raise ValueError(f"unknown tensor-parallel KV command {kind!r}")


def _log_failure(future: Future[TransferResult]) -> None:
    if future.exception() is not None:
        logger.warning("tensor-parallel KV send failed: %s", future.exception())
