"""Between the wire and the handoff: `pdserve.v1.KvHandle` and `TransferKvRequest` to the
domain forms `common/handoff` works with (`KvHandle`, `TransferOrder`) and back. The
lease's end crosses the wire as the time it has left (`lease_ttl_ms`), turned into a
deadline on this host's monotonic clock on arrival and back into the time left on sending
(`common/handoff/lease_clock.py`)."""

from __future__ import annotations

from pdserve.common.handoff import lease_clock
from pdserve.common.handoff.handle import KvHandle, TransferOrder
from pdserve.v1 import kv_pb2, prefill_pb2


def handle_from_proto(h: kv_pb2.KvHandle) -> KvHandle:
    return KvHandle(
        worker_id=h.worker_id,
        grpc_address=h.grpc_address,
        transport=h.transport,
        transport_address=h.transport_address,
        lease_id=h.lease_id,
        block_ids=tuple(h.block_ids),
        num_tokens=h.num_tokens,
        block_size=h.block_size,
        layout_fingerprint=h.layout_fingerprint,
        lease_deadline=lease_clock.deadline(h.lease_ttl_ms),
        tensor_parallel=h.tensor_parallel,
        rank_transport_addresses=tuple(h.rank_transport_addresses),
    )


def handle_to_proto(h: KvHandle) -> kv_pb2.KvHandle:
    return kv_pb2.KvHandle(
        worker_id=h.worker_id,
        grpc_address=h.grpc_address,
        transport=h.transport,
        transport_address=h.transport_address,
        lease_id=h.lease_id,
        block_ids=h.block_ids,
        num_tokens=h.num_tokens,
        block_size=h.block_size,
        layout_fingerprint=h.layout_fingerprint,
        lease_ttl_ms=lease_clock.ttl_ms(h.lease_deadline),
        tensor_parallel=h.tensor_parallel,
        rank_transport_addresses=h.rank_transport_addresses,
    )


def order_from_proto(r: prefill_pb2.TransferKvRequest) -> TransferOrder:
    return TransferOrder(
        lease_id=r.lease_id,
        first_block=r.first_block,
        num_blocks=r.num_blocks,
        receiver=r.receiver_address,
        tag=r.tag,
        receiver_tensor_parallel=r.receiver_tensor_parallel,
        rank_receivers=tuple(r.rank_receiver_addresses),
    )


def order_to_proto(o: TransferOrder) -> prefill_pb2.TransferKvRequest:
    return prefill_pb2.TransferKvRequest(
        lease_id=o.lease_id,
        first_block=o.first_block,
        receiver_address=o.receiver,
        tag=o.tag,
        num_blocks=o.num_blocks,
        receiver_tensor_parallel=o.receiver_tensor_parallel,
        rank_receiver_addresses=o.rank_receivers,
    )
