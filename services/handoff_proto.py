"""Between the wire and the handoff: `pdserve.v1.KvHandle` and `TransferKvRequest` to the
domain forms `common/handoff` works with (`KvHandle`, `TransferOrder`) and back. The one
field a conversion can refuse, the lease's expiry time, raises `InvalidRequestError`."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from pdserve.common.errors import InvalidRequestError
from pdserve.common.handoff.handle import KvHandle, TransferOrder
from pdserve.v1 import kv_pb2, prefill_pb2


def handle_from_proto(h: kv_pb2.KvHandle) -> KvHandle:
    try:
        expires = h.lease_expires_at.ToNanoseconds() / 1e9
    except ValueError as e:  # nanos outside [0, 1e9) or a year protobuf refuses
        raise InvalidRequestError("kv_handle.lease_expires_at", str(e)) from None
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
        lease_expires_at=expires,
        tensor_parallel=h.tensor_parallel,
        rank_transport_addresses=tuple(h.rank_transport_addresses),
    )


def handle_to_proto(h: KvHandle) -> kv_pb2.KvHandle:
    expires = Timestamp()
    expires.FromNanoseconds(int(h.lease_expires_at * 1e9))
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
        lease_expires_at=expires,
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
