"""The KV handle: what a prefill worker gives the coordinator with the first token, and the
decode worker checks before it reserves anything. It names where the blocks are (the
prefill worker, its transport address, the lease that pins them), what they hold (tokens,
block size, the KV layout's fingerprint) and how they are split (the prefill group's
tensor-parallel ranks). `TransferOrder` is the decode worker's answer: where to send them.
The lease's end is a time on the monotonic clock of the host holding the handle
(`lease_clock.py`). These are the domain forms of `pdserve.v1.KvHandle` and `TransferKvRequest`
(`services/handoff_proto.py` maps them)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.errors import InvalidRequestError
from pdserve.common.handoff import lease_clock
from pdserve.common.kv_transfer.head_slices import plan


@dataclass(frozen=True)
class KvHandle:
    worker_id: str
    grpc_address: str  # the prefill worker's gRPC address (TransferKv, ReleaseKv)
    transport: str  # the transport's kind ("ucx", "inproc")
    transport_address: bytes
    lease_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    block_size: int
    layout_fingerprint: str
    lease_deadline: float  # when the lease ends: time.monotonic() of this host
    tensor_parallel: int = 0  # the prefill group's ranks (0: one process)
    rank_transport_addresses: tuple[bytes, ...] = ()  # ranks 1.. of that group

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def lease_left(self) -> float:
        """Seconds until the lease ends, by this host's monotonic clock (0 once over)."""
        return lease_clock.left(self.lease_deadline)


@dataclass(frozen=True)
class TransferOrder:
    """A decode worker's `TransferKv`: the lease's blocks from `first_block` on, into the
    receives it posted under `tag` at `receiver` (rank 0; `rank_receivers` the ranks after
    it when its group of `receiver_tensor_parallel` splits the heads)."""

    lease_id: str
    first_block: int
    num_blocks: int
    receiver: bytes
    tag: int
    receiver_tensor_parallel: int = 0
    rank_receivers: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class KvLayout:
    """What a decode worker's KV cache and transport take."""

    transport: str
    layout_fingerprint: str
    block_size: int
    num_kv_heads: int
    tensor_parallel: int = 1


def check_handle(handle: KvHandle, num_prompt_tokens: int, layout: KvLayout) -> None:
    """Raise `InvalidRequestError` naming the handle's field that does not fit this worker's
    layout and transport, or the prompt it came with."""
    h = layout
    for name in ("lease_id", "grpc_address", "transport_address"):
        if not getattr(handle, name):
            raise InvalidRequestError(f"kv_handle.{name}", "must not be empty")
    if handle.transport != h.transport:
        raise InvalidRequestError(
            "kv_handle.transport",
            f"this worker pulls over {h.transport!r}, got {handle.transport!r}",
        )
    if handle.layout_fingerprint != h.layout_fingerprint:
        raise InvalidRequestError(
            "kv_handle.layout_fingerprint",
            f"{handle.layout_fingerprint!r} does not match this worker's KV layout "
            f"{h.layout_fingerprint!r} (model, dtype or block size differ)",
        )
    if handle.tensor_parallel > 1:
        if len(handle.rank_transport_addresses) != handle.tensor_parallel - 1:
            raise InvalidRequestError(
                "kv_handle.rank_transport_addresses",
                f"a prefill group of {handle.tensor_parallel} needs "
                f"{handle.tensor_parallel - 1}, got {len(handle.rank_transport_addresses)}",
            )
        try:
            plan(h.num_kv_heads, handle.tensor_parallel, h.tensor_parallel)
        except ValueError as e:
            raise InvalidRequestError("kv_handle.tensor_parallel", str(e)) from None
    if handle.block_size != h.block_size:
        raise InvalidRequestError(
            "kv_handle.block_size", f"must be {h.block_size}, got {handle.block_size}"
        )
    if handle.num_tokens != num_prompt_tokens:
        raise InvalidRequestError(
            "kv_handle.num_tokens",
            f"must equal the prompt's length ({num_prompt_tokens}), got {handle.num_tokens}",
        )
    need = -(-handle.num_tokens // handle.block_size)
    if handle.num_blocks != need:
        raise InvalidRequestError(
            "kv_handle.block_ids",
            f"{handle.num_tokens} tokens need {need} blocks, got {handle.num_blocks}",
        )
