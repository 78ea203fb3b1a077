"""The prefill side of the handoff (steps 3 and 6 of a request's path). A prefilled request
keeps its blocks under a lease (`grant`, which makes the `KvHandle`); a decode worker that
posted its receives has them sent (`send`: whole blocks, or head slices when either side
is tensor-parallel), after which the lease ends and the next engine step frees the blocks;
`release` ends a lease unsent, and a lease nobody pulls expires in the engine's step
(`Scheduler.settle_handoffs`). Runs on the event loop; only tensor-parallel commands to
the group's other ranks go through the engine thread (`run_in_engine`), in order with its
steps."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pdserve.common import faults
from pdserve.common.handoff.checksums import block_checksums
from pdserve.common.handoff.handle import KvHandle, TransferOrder
from pdserve.common.handoff.leases import LeaseTable
from pdserve.common.handoff.slices import all_of, send_slices
from pdserve.common.handoff.transfer_metrics import TransferMetrics
from pdserve.common.kv_transfer import KvTransferError, KvTransport, TransferResult, settled
from pdserve.common.kv_transfer.head_slices import plan
from pdserve.common.request import Request

if TYPE_CHECKING:
    from pdserve.common.engine import LLMEngine

RunInEngine = Callable[[Callable[[], Any]], Awaitable[Any]]


class KvSender:
    def __init__(
        self,
        engine: LLMEngine,
        transport: KvTransport,
        worker_id: str,
        grpc_address: str,
        lease_s: float,
        timeout_s: float,
        metrics: TransferMetrics,
        run_in_engine: RunInEngine,
        tp_addresses: Sequence[bytes] = (),
    ) -> None:
        self.engine, self.transport = engine, transport
        self.worker_id, self.grpc_address = worker_id, grpc_address
        self.leases: LeaseTable = engine.scheduler.leases
        self.leases.lease_s = lease_s
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.run_in_engine = run_in_engine
        self.tp_addresses = list(tp_addresses)  # every rank's transport address, rank 0 first

    @property
    def tensor_parallel(self) -> int:
        return max(1, len(self.tp_addresses))

    def grant(self, request: Request, num_tokens: int | None = None) -> KvHandle:
        """Lease a PREFILLED request's blocks: the handle a decode worker pulls them by.
        `num_tokens`: the tokens whose KV the handle covers (default: the prompt; a running
        request migrating off a draining decode worker gives its computed tokens)."""
        engine = self.engine
        if num_tokens is None:
            num_tokens = request.num_prompt_tokens
        lease = self.leases.grant(request, -(-num_tokens // engine.config.block_size))
        return KvHandle(
            worker_id=self.worker_id,
            grpc_address=self.grpc_address,
            transport=self.transport.kind,
            transport_address=self.transport.address,
            lease_id=lease.lease_id,
            block_ids=tuple(lease.block_ids),
            num_tokens=num_tokens,
            block_size=engine.config.block_size,
            layout_fingerprint=engine.runner.layout_fingerprint,
            lease_deadline=lease.expires_at,
            tensor_parallel=self.tensor_parallel if self.tensor_parallel > 1 else 0,
            rank_transport_addresses=tuple(self.tp_addresses[1:]),
        )

    def release(self, lease_id: str) -> bool:
        """End a lease unsent (a decode worker had every block cached); a lease under
        transfer is left to that transfer. Whether a lease ended."""
        return self.leases.end(lease_id, unless_sending=True)

    def drop(self, request: Request) -> None:
        """Engine thread: the caller of `Prefill` left; no one will pull these blocks."""
        self.engine.drop(request)

    def receivers(self, order: TransferOrder) -> list[bytes]:
        """The decode ranks' transport addresses, rank 0 first, each well formed and (with
        tensor parallelism on either side) as many as the receiving group has ranks that
        split the model's kv heads; else a ValueError naming the field. Checked before the
        lease is touched: a malformed receiver must not cost it."""
        sliced = self.tensor_parallel > 1 or order.receiver_tensor_parallel > 1
        peers = [order.receiver]  # without slices rank 0 sends all to rank 0
        if sliced:
            peers += order.rank_receivers
        for i, peer in enumerate(peers):
            field = "receiver_address" if i == 0 else f"rank_receiver_addresses[{i - 1}]"
            if not peer:
                raise ValueError(f"{field}: is empty")
            try:
                self.transport.check_peer(peer)
            except KvTransferError as e:
                raise ValueError(f"{field}: {e}") from e
        if not sliced:
            return peers
        dst_tp = max(1, order.receiver_tensor_parallel)
        if len(peers) != dst_tp:
            raise ValueError(
                f"rank_receiver_addresses: a receiving group of {dst_tp} needs "
                f"{dst_tp - 1}, got {len(peers) - 1}"
            )
        try:
            plan(self._num_kv_heads(), self.tensor_parallel, dst_tp)
        except ValueError as e:
            raise ValueError(f"receiver_tensor_parallel: {dst_tp}: {e}") from e
        return peers

    async def send(self, order: TransferOrder, peers: list[bytes]) -> TransferResult:
        """Send the lease's blocks to `peers` (`receivers(order)`), then end the lease (sent
        or failed, its blocks are done with). Raises `LeaseError` (unknown lease),
        `LeaseBusy` (already being pulled) or ValueError (a field that does not match the
        lease) before anything is sent, and `KvTransferError` when the transfer fails."""
        blocks = list(self.leases.begin_send(order.lease_id, order.first_block, order.num_blocks))
        transport = self.transport
        future: Future[TransferResult] | None = None
        sums: asyncio.Future[list[int]] | None = None
        try:
            try:
                await faults.ahit("prefill.before_send")
            except faults.FaultInjected as e:
                raise KvTransferError(str(e)) from None
            if self.tensor_parallel > 1 or order.receiver_tensor_parallel > 1:
                future = await self._send_slices(order, peers, blocks)
            else:
                future = transport.send(order.receiver, order.tag, blocks, self.timeout_s)
                # Hashed while the transfer runs: leased blocks are not written.
                kv = self.engine.runner.kv_cache
                sums = asyncio.ensure_future(asyncio.to_thread(block_checksums, kv, blocks))
            result = await asyncio.wrap_future(future)
            if sums is not None:
                result = replace(result, checksums=tuple(await sums))
        except (KvTransferError, asyncio.CancelledError):  # failed, or the decode side left
            transport.cancel(order.tag)
            if future is not None:
                await settled(future)
            if sums is not None:
                await asyncio.gather(sums, return_exceptions=True)
            self.metrics.transfer_failed(transport.kind, "send")
            raise
        finally:
            self.leases.end(order.lease_id)  # release on pull
        self.metrics.transfer(
            transport.kind, "send", result.num_blocks, result.num_bytes, result.seconds
        )
        return result

    async def _send_slices(
        self, order: TransferOrder, peers: list[bytes], block_ids: list[int]
    ) -> Future[TransferResult]:
        """Tensor parallelism on either side: every rank of this group sends the head slices
        it holds to the decode ranks that keep them (`slices.py`). The future is this
        rank's sends; the other ranks' arrive at the decode ranks, which wait for all."""
        runner = self.engine.runner
        slices = plan(self._num_kv_heads(), self.tensor_parallel, len(peers))
        mine = [s for s in slices if s.src_rank == 0]
        futures = send_slices(self.transport, runner.kv_cache, block_ids, mine, peers,
                              order.tag, self.timeout_s)  # fmt: skip
        if self.tensor_parallel > 1:
            command = {"kind": "send", "tag": order.tag, "blocks": block_ids,
                       "plan": slices, "peers": peers}  # fmt: skip
            sender = runner.step_sender
            assert sender is not None
            if await self.run_in_engine(lambda: sender.command(command)):
                raise KvTransferError("a tensor-parallel rank could not send its KV slices")
        return all_of(futures, len(block_ids))

    def _num_kv_heads(self) -> int:
        return self.engine.runner.hf_config.num_key_value_heads
