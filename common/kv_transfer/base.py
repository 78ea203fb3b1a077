"""The KV transfer contract, in the request's path between prefill and decode.

Each worker owns one transport bound to its KV cache pool (block-major, so a block is one
contiguous buffer). A handoff is a "pull" in two halves that meet on a 64-bit tag:

1. decode allocates free blocks, then `post_receive(tag, dst_block_ids)` — one receive per
   block, straight into its cache memory;
2. decode asks prefill (over gRPC) to send; prefill calls `send(peer, tag, src_block_ids)`
   with decode's `address`; block i of the send lands in block i of the receive.

Both halves return a `concurrent.futures.Future` that resolves to a `TransferResult` or fails
with `KvTransferError` — on a peer that vanished, on `cancel(tag)`, or when `timeout` seconds
pass: a transfer never hangs. After `cancel`, free the blocks only once the future has
finished (`settled`): the transport may still be finishing a block. Tags come from
`new_tag()`; the low `INDEX_BITS` bits number the blocks inside one transfer."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

INDEX_BITS = 20  # up to ~1M blocks in one transfer
MAX_BLOCKS_PER_TRANSFER = 1 << INDEX_BITS


async def settled(future: Future[TransferResult], timeout: float = 10.0) -> None:
    """Wait until an aborted transfer's future has finished (it fails): only then is the
    transport done with its blocks, and may they be freed. A cancellation of the caller
    meanwhile is held back until then (up to `timeout`) and raised after."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    cancelled = False
    while not future.done() and loop.time() < deadline:
        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), deadline - loop.time()
            )
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # the failure we waited for, or the timeout
            break
    if cancelled:
        raise asyncio.CancelledError


class KvTransferError(RuntimeError):
    """A transfer failed, was cancelled or timed out. Its blocks are no longer written."""


@dataclass(frozen=True)
class TransferResult:
    num_blocks: int
    num_bytes: int
    seconds: float  # from posting to the last block in place (or sent)
    # XXH3-64 of each block sent, as it is in the sender's cache (`handoff/checksums.py`);
    # empty where the sender hashed none.
    checksums: tuple[int, ...] = ()


class KvTransport(ABC):
    """One per worker process. Thread-safe: any thread may post; the transport's own
    machinery completes the futures."""

    #: transport kind, e.g. "ucx" or "inproc"; reported in metrics and handles
    kind: str

    def __init__(self) -> None:
        self._tags = itertools.count(1)

    @property
    @abstractmethod
    def address(self) -> bytes:
        """Where peers send to: opaque bytes (a UCX worker address, a registry key)."""

    @abstractmethod
    def register_pool(self, kv_cache: torch.Tensor) -> None:
        """Bind the transport to the worker's KV cache `[num_blocks, ...]`; block `i` is
        `kv_cache[i]`, one contiguous region. Called once, before any transfer."""

    @abstractmethod
    def post_receive(
        self, tag: int, block_ids: Sequence[int], timeout: float
    ) -> Future[TransferResult]:
        """Receive `len(block_ids)` blocks sent under `tag` into these blocks of the pool."""

    @abstractmethod
    def send(
        self, peer: bytes, tag: int, block_ids: Sequence[int], timeout: float
    ) -> Future[TransferResult]:
        """Send these blocks of the pool, in order, to the receive posted under `tag` at
        `peer` (its `address`)."""

    @abstractmethod
    def post_receive_buffers(
        self, tag: int, buffers: Sequence[tuple[int, torch.Tensor]], timeout: float
    ) -> Future[TransferResult]:
        """Receive messages sent under `tag` into contiguous buffers that are not the pool:
        `(index, buffer)` gets the message sent under `tag | index` (by any peer). Tensor
        parallelism's head slices travel so (`head_slices.py`)."""

    @abstractmethod
    def send_buffers(
        self, peer: bytes, tag: int, buffers: Sequence[tuple[int, torch.Tensor]], timeout: float
    ) -> Future[TransferResult]:
        """Send each `(index, buffer)` under `tag | index` to `peer`."""

    def check_peer(self, peer: bytes) -> None:
        """Raise `KvTransferError` when `peer` cannot be an address of this transport (a
        caller's mistake, found before anything is sent)."""
        if not peer:
            raise KvTransferError("peer address is empty")

    @abstractmethod
    def cancel(self, tag: int) -> None:
        """Abort a posted receive or send under `tag`: its future fails with
        `KvTransferError`. Unknown or finished tags are ignored."""

    @abstractmethod
    def close(self) -> None:
        """Fail everything pending and release the transport's resources."""

    def new_tag(self) -> int:
        """A tag no other live transfer to this worker uses (the counter), drawn afresh
        for each transfer in its top bits: a peer that was not told a receive's tag cannot
        aim blocks at it."""
        fresh = secrets.randbits(24) << 40
        return fresh | ((next(self._tags) % (1 << 20)) << INDEX_BITS)

    @staticmethod
    def check_blocks(block_ids: Sequence[int], num_blocks: int) -> None:
        if not block_ids:
            raise KvTransferError("block_ids: a transfer needs at least one block")
        if len(block_ids) > MAX_BLOCKS_PER_TRANSFER:
            raise KvTransferError(
                f"block_ids: at most {MAX_BLOCKS_PER_TRANSFER} blocks per transfer, "
                f"got {len(block_ids)}"
            )
        bad = next((b for b in block_ids if not 0 <= b < num_blocks), None)
        if bad is not None:
            raise KvTransferError(f"block_ids: must be in [0, {num_blocks}), got {bad}")
