"""The decode side of the handoff (steps 6 and 7 of a request's path). A prefilled request's
`KvHandle` is checked against this worker's layout (`check`); the request arrives in the
engine thread once (`arrive`: made, and queued for its blocks in the scheduler's
remote-KV line); once its blocks are reserved, `pull` posts receives into those after the
ones this worker's prefix cache already holds and has the prefill worker send the rest
(through a `PrefillLink`: gRPC between processes, `LocalLink` in one); then the request
`landed` joins the batch at the next step, or is `abandon`ed there. Whatever fails, no
block is freed while a transfer may still write it (`settled`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from pdserve.common import faults
from pdserve.common.handoff.checksums import CorruptBlock, corrupt, verify
from pdserve.common.handoff.handle import KvHandle, KvLayout, TransferOrder, check_handle
from pdserve.common.handoff.slices import SliceReceive
from pdserve.common.handoff.transfer_metrics import TransferMetrics
from pdserve.common.kv_transfer import KvTransferError, KvTransport, TransferResult, settled
from pdserve.common.kv_transfer.head_slices import plan
from pdserve.common.request import Request, Resume
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tracing import tracer

if TYPE_CHECKING:
    from pdserve.common.engine import LLMEngine

logger = logging.getLogger(__name__)
RunInEngine = Callable[[Callable[[], Any]], Awaitable[Any]]


class PullFailed(RuntimeError):
    """A pull that did not fill the blocks. `reason`: UNAVAILABLE when the prefill worker or
    the way to it failed (the request may go on elsewhere); STALE when the prefill worker
    refused this handle (its lease unknown or taken) and INVALID when it refused a field:
    no retry of this handle can fix those."""

    UNAVAILABLE, STALE, INVALID = "unavailable", "stale", "invalid"

    def __init__(self, message: str, reason: str = UNAVAILABLE) -> None:
        super().__init__(message)
        self.reason = reason


class PrefillLink(Protocol):
    """The decode worker's calls to one prefill worker. Both raise `PullFailed` (its message
    says why, e.g. the status the prefill worker answered)."""

    async def transfer(self, order: TransferOrder, span: Span) -> list[int]:
        """Have the prefill worker send the lease's blocks (`TransferKv`); returns once it
        sent them, with their checksums (empty: none). Cancelling the caller cancels the
        call."""

    async def release(self, lease_id: str) -> None:
        """Let the prefill worker free a lease unsent (`ReleaseKv`)."""


class KvReceiver:
    def __init__(
        self,
        engine: LLMEngine,
        transport: KvTransport,
        timeout_s: float,
        metrics: TransferMetrics,
        run_in_engine: RunInEngine,
        tp_addresses: Sequence[bytes] = (),
        max_pending: int = 64,
        max_wait_s: float = 0.0,
        landing_s: float | None = None,
    ) -> None:
        self.engine, self.transport = engine, transport
        self.timeout_s = timeout_s
        # Once the prefill worker says it sent every block, they land within this or the
        # pull fails (a sender that stopped mid-way); None: `timeout_s` alone bounds it.
        self.landing_s = landing_s
        self.metrics = metrics
        self.run_in_engine = run_in_engine
        self.tp_addresses = list(tp_addresses)  # every rank's transport address, rank 0 first
        self.remote = engine.scheduler.remote
        self.remote.max_pending = max_pending
        self.remote.max_wait_s = max_wait_s
        runner = engine.runner
        self.layout = KvLayout(
            transport.kind, runner.layout_fingerprint, engine.config.block_size,
            runner.hf_config.num_key_value_heads, self.tensor_parallel,
        )  # fmt: skip

    @property
    def tensor_parallel(self) -> int:
        return max(1, len(self.tp_addresses))

    def check(self, handle: KvHandle, num_prompt_tokens: int) -> None:
        """Raise `InvalidRequestError` where the handle does not fit this worker."""
        check_handle(handle, num_prompt_tokens, self.layout)

    def arrive(
        self,
        prompt: list[int],
        first_token_id: int,
        params: SamplingParams,
        request_id: str,
        resume: Resume | None,
    ) -> tuple[Request, Future[int]]:
        """Engine thread, the request's one call there: the prefilled request, and a future
        of the blocks its prefix cache serves, resolved once its blocks are reserved (at
        once when they fit). Raises `InvalidRequestError` or `RemoteQueueFull`."""
        return self.engine.add_prefilled(prompt, first_token_id, params, request_id, resume)

    def landed(self, request: Request) -> None:
        """The pull is done: the request joins the batch at the next step."""
        self.remote.landed(request)

    def abandon(self, request: Request) -> None:
        """The request is gone before it finished: at the next step its blocks go back."""
        self.remote.abandon(request)

    async def pull(
        self,
        request: Request,
        handle: KvHandle,
        num_cached: int,
        link: PrefillLink,
        span: Span | None = None,
    ) -> int:
        """Fill the request's blocks after the `num_cached` ones from the prefill worker.
        Returns the number of blocks pulled; raises `PullFailed`."""
        total = handle.num_blocks
        if num_cached >= total:  # everything is cached here: let prefill free its copy
            try:
                await link.release(handle.lease_id)
            except PullFailed as e:  # its lease will expire; nothing leaks
                logger.warning("release of %s failed: %s", handle.lease_id, e)
            return 0
        transport = self.transport
        dst = request.block_ids[num_cached:total]
        transfer = tracer().start_span(
            "pdserve.kv_transfer",
            context=trace.set_span_in_context(span) if span is not None else None,
            attributes={"pdserve.kv.transport": transport.kind, "pdserve.kv.from": handle.worker_id,
                        "pdserve.kv.cached_blocks": num_cached},
        )  # fmt: skip
        tag = transport.new_tag()
        # Tensor parallelism on either side: head slices to every rank (`slices.py`).
        sliced = handle.tensor_parallel > 1 or self.tensor_parallel > 1
        slices: SliceReceive | None = None
        if sliced:
            try:
                slices = await self._post_slices(handle, dst, tag)
            except KvTransferError as e:
                transfer.end()
                raise PullFailed(f"KV pull from {handle.worker_id}: {e}") from None
            received = slices.future
        else:
            received = transport.post_receive(tag, dst, self.timeout_s)
        order = TransferOrder(
            lease_id=handle.lease_id,
            first_block=num_cached,
            num_blocks=len(dst),
            receiver=transport.address,
            tag=tag,
            receiver_tensor_parallel=self.tensor_parallel if self.tensor_parallel > 1 else 0,
            rank_receivers=tuple(self.tp_addresses[1:]),
        )
        try:
            sums = await link.transfer(order, transfer)
            result = await self._landed(received)
            if slices is not None:
                result = await self._land_slices(slices, len(dst))
            else:
                await self._check_landed(dst, sums)
        except (PullFailed, KvTransferError, asyncio.CancelledError) as e:
            transport.cancel(tag)
            await settled(received)  # only then may the caller free the blocks
            if slices is not None and self.tensor_parallel > 1:
                await self._group_command({"kind": "drop", "tag": tag})
            self.metrics.transfer_failed(transport.kind, "receive")
            if isinstance(e, asyncio.CancelledError):
                transfer.end()
                raise
            transfer.set_status(Status(StatusCode.ERROR, str(e)))
            transfer.end()
            reason = e.reason if isinstance(e, PullFailed) else PullFailed.UNAVAILABLE
            raise PullFailed(
                f"KV pull from prefill worker {handle.worker_id} ({handle.grpc_address}) "
                f"failed: {e}",
                reason,
            ) from e
        self.metrics.transfer(
            transport.kind, "receive", result.num_blocks, result.num_bytes, result.seconds
        )
        transfer.set_attributes(
            {"pdserve.kv.blocks": result.num_blocks, "pdserve.kv.bytes": result.num_bytes}
        )
        transfer.end()
        return result.num_blocks

    async def _check_landed(self, dst: list[int], sums: list[int]) -> None:
        """The landed blocks against the sender's checksums (`checksums.py`), off the event
        loop; a mismatch is a failed pull (KvTransferError): no token is computed from it."""
        kv = self.engine.runner.kv_cache
        try:
            if await faults.ahit("decode.before_landing") == "corrupt":  # a test's, in transit
                corrupt(kv, dst[0])
            if sums:  # (a sender without checksums: a GPU cache)
                await asyncio.to_thread(verify, kv, dst, sums)
        except (CorruptBlock, faults.FaultInjected) as e:
            logger.warning("KV pull: %s", e)
            raise KvTransferError(str(e)) from None

    async def _landed(self, received: Future[TransferResult]) -> TransferResult:
        """The posted receives once the sender has sent them all: they complete within
        `landing_s`, or KvTransferError (the caller cancels them)."""
        if self.landing_s is None:
            return await asyncio.wrap_future(received)
        landing = asyncio.wrap_future(received)
        # Shielded: on a timeout (or the caller's cancel) the caller cancels the receives
        # and `landing` fails later, with no one left to read it; read it here.
        landing.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.wait_for(asyncio.shield(landing), self.landing_s)
        except TimeoutError:
            raise KvTransferError(
                f"the blocks had not landed {self.landing_s:g} s after the sender sent them"
            ) from None

    async def _post_slices(self, handle: KvHandle, dst: list[int], tag: int) -> SliceReceive:
        """Post this rank's receives of its head slices, and have the group's other ranks
        post theirs."""
        runner = self.engine.runner
        slices = plan(self.layout.num_kv_heads, max(1, handle.tensor_parallel),
                      self.tensor_parallel)  # fmt: skip
        mine = [s for s in slices if s.dst_rank == 0]
        receive = SliceReceive(self.transport, runner.kv_cache, dst, mine, tag, self.timeout_s)
        if self.tensor_parallel > 1:
            command = {"kind": "post", "tag": tag, "blocks": dst, "plan": slices}
            if await self._group_command(command):
                receive.drop()
                await self._group_command({"kind": "drop", "tag": tag})
                raise KvTransferError("a tensor-parallel rank could not post its receives")
        return receive

    async def _land_slices(self, receive: SliceReceive, num_blocks: int) -> TransferResult:
        """Every rank's slices in its blocks (this rank's copied in here), or KvTransferError."""
        result = receive.future.result()
        receive.land()
        if self.tensor_parallel > 1 and await self._group_command(
            {"kind": "land", "tag": receive.tag}
        ):
            raise KvTransferError("a tensor-parallel rank's KV slices did not arrive")
        return TransferResult(num_blocks, result.num_bytes, result.seconds)

    async def _group_command(self, command: dict[str, Any]) -> int:
        sender = self.engine.runner.step_sender
        assert sender is not None
        return await self.run_in_engine(lambda: sender.command(command))
