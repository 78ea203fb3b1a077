"""The coordinator's request path, shared by its gRPC and HTTP fronts.

1. validate and tokenize (`Frontend`); 2. pick a prefill worker (`router.py`) and call
`Prefill`; 3. send the first token to the client at once; 4. pick a decode worker and call
`Decode` with the KV handle; 5. relay its tokens, then the finish reason and usage.
(Colocated: one `Generate` call to one worker.) A lost worker is routed around: see
`_disaggregated`. The client's deadline goes to every worker call; a client that leaves
cancels the worker call in flight, which frees the request's blocks there. Failures end as
one `RequestFailed` carrying a gRPC status code; each front maps it to its own errors."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import replace

import grpc
from opentelemetry.trace import SpanKind

from pdserve.common import faults
from pdserve.common.block_hashing import block_hashes
from pdserve.common.errors import InvalidRequestError
from pdserve.common.handoff import lease_clock
from pdserve.common.retry import Backoff
from pdserve.common.tracing import context_from_metadata, metadata_for_call, tracer
from pdserve.services.convert import RETRY_AFTER_KEY, params_to_proto
from pdserve.services.coordinator.metrics import RequestTimer
from pdserve.services.coordinator.pool import WorkerEndpoint, WorkerPool
from pdserve.services.coordinator.router import NoWorkerError
from pdserve.services.frontend import ContextLengthError, Frontend, ParsedRequest, usage
from pdserve.v1 import decode_pb2, generate_pb2, kv_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request that cannot go on: `code` says why, `field` names a bad input field."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        field: str | None = None,
        context_length: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.context_length = context_length  # the prompt does not fit the context
        self.usage: generate_pb2.Usage | None = None  # what was generated before it failed
        self.retry_after_s: int | None = None  # a refusal's hint: when to try again


def request_attributes(request: generate_pb2.GenerateRequest, model: str) -> dict:
    """The OpenTelemetry GenAI attributes known when a request arrives."""
    sampling = request.sampling
    attributes: dict = {
        "gen_ai.operation.name": "chat" if request.messages else "text_completion",
        "gen_ai.request.model": model,
    }
    if sampling.HasField("max_tokens"):
        attributes["gen_ai.request.max_tokens"] = sampling.max_tokens
    if sampling.HasField("temperature"):
        attributes["gen_ai.request.temperature"] = sampling.temperature
    return attributes


def worker_request_id(request_id: str) -> str:
    """The id workers see: the client's plus a random suffix, so two clients that pick the
    same id never collide on a worker."""
    return f"{request_id}.{secrets.token_hex(4)}"


# A worker refusing the coordinator itself (a certificate, a pull list) is the system's own
# wiring failing, not the client's doing: the client sees UNAVAILABLE.
_INTERNAL_REFUSALS = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})


def _worker_error(role: str, address: str, e: grpc.aio.AioRpcError) -> RequestFailed:
    code = grpc.StatusCode.UNAVAILABLE if e.code() in _INTERNAL_REFUSALS else e.code()
    error = RequestFailed(code, f"{role} worker {address}: {e.details()}")
    error.retry_after_s = retry_after(e.trailing_metadata())
    return error


def retry_after(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """A worker's `retry-after` trailer (whole seconds), if it sent a valid one."""
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY and isinstance(value, str) and value.isdigit():
            return int(value)
    return None


# A call that ended so means the worker (or the way to it) is gone, not that the request is
# bad: the request may go on elsewhere. CANCELLED too: the coordinator never reads a call
# after cancelling it, and a stopping gRPC server drops the calls it has not handed to a
# handler yet as CANCELLED (grpc/grpc#41785; a draining worker's last arrivals).
WORKER_GONE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
)


class LegFailed(Exception):
    """A worker was lost; the request may continue on others."""

    def __init__(self, error: RequestFailed) -> None:
        super().__init__(error.message)
        self.error = error


class DecodeBusy(Exception):
    """A decode worker refused a handoff (RESOURCE_EXHAUSTED before pulling any block)."""

    def __init__(self, error: RequestFailed) -> None:
        super().__init__(error.message)
        self.error = error


class Migrating(Exception):
    """A draining decode worker handed a running stream over: `handle` leases its KV there
    (every token sent but the last) on `source`."""

    def __init__(self, handle: kv_pb2.KvHandle, source: WorkerEndpoint) -> None:
        super().__init__(f"decode worker {source.address} drains")
        self.handle = handle
        self.source = source


class MigrationFailed(Exception):
    """A migrated leg ended before its new decode worker had the KV: the stream recomputes."""


# A handoff a decode worker refused as busy is retried after 20 ms, doubling up to 0.2 s,
# while the prefill lease has more than `LEASE_MARGIN_S` left (decode gives up waiting for
# blocks 1 s before the lease ends; a pull needs time too).
HANDOFF_BACKOFF_S = (0.02, 0.2)
LEASE_MARGIN_S = 2.0


class Coordinator:
    """Routes requests over a prefill and a decode pool, or over colocated workers. At most
    `max_inflight` requests are in flight, counted from arrival (waiting for the tokenizer
    too); past that a request is refused at once (RESOURCE_EXHAUSTED, retry after 1 s)
    rather than queued without bound. While prefilled requests wait for a busy decode pool
    to take them, new disaggregated requests are refused the same way: decode is the
    bottleneck then, and a new prefill would only add a lease waiting behind them."""

    def __init__(
        self,
        frontend: Frontend,
        prefill: WorkerPool | None = None,
        decode: WorkerPool | None = None,
        colocated: WorkerPool | None = None,
        model: str = "",
        worker_id: str = "coordinator",
        max_inflight: int = 1024,
        max_retries: int = 2,
        local_prefill_tokens: int = 0,
    ) -> None:
        if colocated is None and (prefill is None or decode is None):
            raise ValueError("workers: give prefill and decode workers, or colocated ones")
        if max_inflight < 1:
            raise ValueError(f"max_inflight: must be at least 1, got {max_inflight}")
        self.frontend = frontend
        self.prefill = prefill
        self.decode = decode
        self.colocated = colocated
        self.model = model
        self.max_inflight = max_inflight
        self.max_retries = max_retries
        self.local_prefill_tokens = local_prefill_tokens
        self.inflight = 0
        self.handoffs_waiting = 0  # prefilled requests a busy decode pool has not taken yet
        self._background: set[asyncio.Task[None]] = set()
        self.metric_labels = {"model": model, "role": "coordinator", "worker": worker_id}

    def _refusal(self) -> str | None:
        """Why a new request is refused at arrival, or None to take it."""
        if self.inflight >= self.max_inflight:
            return (
                f"coordinator: {self.inflight} requests in flight, the limit "
                f"(--max-inflight-requests {self.max_inflight}); retry later"
            )
        if self.handoffs_waiting and self.colocated is None:
            return (
                f"coordinator: {self.handoffs_waiting} prefilled requests wait for a decode "
                "worker to take them (every decode admission queue is full); retry later"
            )
        if self.colocated is None and self.decode is not None and self.decode.saturated():
            return (
                "coordinator: every decode worker is saturated (a new handoff would wait past "
                "its --handoff-wait-ms for a batch slot); retry later"
            )
        return None

    async def generate(
        self,
        request: generate_pb2.GenerateRequest,
        trace_carrier: Iterable[tuple[str, str | bytes]] | None = None,
        timeout: float | None = None,
        fill_context: bool = False,
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The request's responses; raises `RequestFailed`. `trace_carrier` holds the
        caller's headers or metadata (a `traceparent` there becomes the parent span);
        `fill_context`: see `Frontend.parse`."""
        span = tracer().start_span(
            "pdserve.generate",
            context=context_from_metadata(trace_carrier),
            kind=SpanKind.SERVER,
            attributes=request_attributes(request, self.model),
        )
        timer = RequestTimer(self.metric_labels, span)
        timer.request_id = request.request_id
        message = self._refusal()
        if message is not None:
            timer.failed("overloaded", message)
            refused = RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            refused.retry_after_s = 1
            raise refused
        # Counted from here, tokenizing included: a flood of long prompts waiting for the
        # tokenizer's thread is bounded by the same limit as requests on the workers.
        self.inflight += 1
        finished = False
        try:
            try:
                parsed = await self.frontend.parse_async(request, fill_context)
            except InvalidRequestError as e:
                finished = True
                timer.failed("invalid_argument", str(e))
                raise RequestFailed(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    str(e),
                    e.field,
                    context_length=isinstance(e, ContextLengthError),
                ) from None
            span.set_attribute("pdserve.request_id", parsed.request_id)
            timer.request_id = parsed.request_id
            path = self._colocated if self.colocated is not None else self._disaggregated
            echo_prompt = parsed.params.prompt_logprobs is not None
            try:
                async for response in path(parsed, timeout, timer):
                    if echo_prompt:  # the first response says what the logprobs are of
                        response.prompt_token_ids.extend(parsed.token_ids)
                        echo_prompt = False
                    await faults.ahit("coordinator.before_stream_write")
                    timer.on_tokens(len(response.token_ids))
                    if response.finish_reason:
                        finished = True
                        timer.finished(
                            response.finish_reason,
                            len(parsed.token_ids),
                            response.usage.cached_tokens,
                        )
                    yield response
            except RequestFailed as e:
                finished = True
                timer.failed(e.code.name.lower(), e.message)
                raise
            except NoWorkerError as e:
                finished = True
                timer.failed("no_worker", str(e))
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        finally:
            self.inflight -= 1
            if not finished:  # the client left (cancelled, deadline) or the call broke
                timer.failed("cancelled")

    async def _colocated(
        self, parsed: ParsedRequest, timeout: float | None, timer: RequestTimer
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        assert self.colocated is not None
        span = timer.span
        worker = await self.colocated.pick()
        span.set_attribute("pdserve.colocated_worker", worker.address)
        with self.colocated.track(worker):
            call = worker.stub.Generate(
                generate_pb2.GenerateRequest(
                    token_ids=parsed.token_ids,
                    request_id=worker_request_id(parsed.request_id),
                    sampling=params_to_proto(parsed.params),
                ),
                timeout=timeout,
                metadata=metadata_for_call(span),
            )
            try:
                async for response in call:
                    response.request_id = parsed.request_id
                    yield response
            except grpc.aio.AioRpcError as e:
                if e.code() in WORKER_GONE:
                    self.colocated.failed(worker)
                raise _worker_error("colocated", worker.address, e) from None
            finally:
                call.cancel()

    async def _disaggregated(
        self, parsed: ParsedRequest, timeout: float | None, timer: RequestTimer
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Prefill then decode, surviving lost workers: a prefill worker that fails before
        the first token is replaced by another; a decode worker lost mid-stream is replaced
        by a new leg (prefill of the prompt plus every token already sent, then decode), so
        the client's stream goes on without a token repeated or skipped. Up to
        `max_retries` replacements per request. A draining decode worker hands its streams
        over with their KV (`Migrating`): each goes on on another decode worker from that KV
        (`_migrated_leg`), or, when that fails, as after a lost worker."""
        assert self.prefill is not None and self.decode is not None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - loop.time())

        prompt = list(parsed.token_ids)
        generated: list[int] = []
        sent_chars = 0  # characters of text the client has
        cached_tokens: int | None = None
        failed: list = []  # workers this request failed on, or that drained
        drained = 0  # of which drained (no retry spent on them)
        chars_before_last = 0  # characters the client had before the last token's text
        last_tokens = 0  # tokens in the last response that carried any
        migration: Migrating | None = None
        while True:
            if migration is not None:
                leg = self._migrated_leg(
                    parsed, prompt, generated, chars_before_last, migration, remaining, timer,
                    failed,
                )  # fmt: skip
            else:
                leg = self._leg(parsed, prompt, generated, sent_chars, remaining, timer, failed)
            migration = None
            try:
                async for response, cached in leg:
                    if cached_tokens is None:
                        cached_tokens = cached
                    if response.token_ids:
                        chars_before_last, last_tokens = sent_chars, len(response.token_ids)
                    generated.extend(response.token_ids)
                    sent_chars += len(response.text)
                    if response.finish_reason:
                        response.usage.CopyFrom(
                            usage(len(prompt), len(generated), cached_tokens or 0)
                        )
                    yield response
                return
            except Migrating as e:
                failed.append(e.source)
                drained += 1
                why = self._unmovable(e.handle, len(prompt) + len(generated) - 1, last_tokens)
                if why is None:
                    migration = e
                else:
                    self._release_moved(e)
                    timer.migrated("recomputed", why)
                    logger.warning("request %s: %s; recomputing", parsed.request_id, why)
                continue
            except MigrationFailed as e:
                timer.migrated("recomputed", str(e))
                logger.warning("request %s: %s; recomputing", parsed.request_id, e)
                continue
            except (LegFailed, NoWorkerError) as e:
                error = (
                    e.error
                    if isinstance(e, LegFailed)
                    else RequestFailed(grpc.StatusCode.UNAVAILABLE, str(e))
                )
                if isinstance(e, NoWorkerError) or len(failed) - drained > self.max_retries:
                    error.usage = usage(len(prompt), len(generated), cached_tokens or 0)
                    if generated:
                        error.message += f" ({len(generated)} tokens were sent before)"
                    raise error from None
                timer.span.add_event(
                    "pdserve.retry", {"reason": error.message, "tokens_sent": len(generated)}
                )
                logger.warning("request %s: %s; retrying", parsed.request_id, error.message)

    async def _leg(
        self,
        parsed: ParsedRequest,
        prompt: list[int],
        generated: list[int],
        sent_chars: int,
        remaining: Callable[[], float | None],
        timer: RequestTimer,
        failed: list,
    ) -> AsyncIterator[tuple[generate_pb2.GenerateResponse, int]]:
        """One prefill + decode of `prompt + generated`, continuing the request after the
        tokens already sent (and `sent_chars` characters of their text). Yields (response,
        prefill's cached tokens); raises `LegFailed` when a worker is lost (the failed one
        is appended to `failed`)."""
        assert self.prefill is not None and self.decode is not None
        span = timer.span
        rid = parsed.request_id
        wid = worker_request_id(rid)
        tokens = prompt + generated
        params = parsed.params
        left = params.max_tokens - len(generated)
        sampling = params_to_proto(
            replace(params, max_tokens=left, min_tokens=max(0, params.min_tokens - len(generated)))
        )
        resumed = None
        if generated:
            resumed = generate_pb2.ResumedOutput(
                output_tokens=len(generated), sent_chars=sent_chars
            )
        if self.local_prefill_tokens > 0:
            bs = self.decode.block_size
            blocks = -(-(len(tokens) + left) // max(1, bs))
            local = self.decode.local_prefill_worker(
                block_hashes(tokens[:-1], bs) if bs else [],
                len(tokens),
                self.local_prefill_tokens,
                blocks,
                exclude=failed,
            )
            if local is not None:
                call = local.stub.Decode(
                    decode_pb2.DecodeRequest(
                        request_id=wid,
                        prompt_token_ids=tokens,
                        sampling=sampling,
                        resumed=resumed,
                    ),
                    timeout=remaining(),
                    metadata=metadata_for_call(span),
                )
                span.set_attribute("pdserve.decode_worker", local.address)
                span.set_attribute("pdserve.local_prefill", True)
                async for item in self._relay_decode(call, local, rid, timer, failed, None):
                    yield item
                return
        block_size = self.prefill.block_size
        hashes = block_hashes(tokens[:-1], block_size) if block_size else []
        worker = await self.prefill.pick(hashes, exclude=failed)
        span.set_attribute("pdserve.prefill_worker", worker.address)
        await faults.ahit("coordinator.before_prefill")
        with self.prefill.track(worker):
            call = worker.stub.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=wid, prompt_token_ids=tokens, sampling=sampling, resumed=resumed
                ),
                timeout=remaining(),
                metadata=metadata_for_call(span),
            )
            try:
                prefilled = await call
            except grpc.aio.AioRpcError as e:
                error = _worker_error("prefill", worker.address, e)
                if e.code() not in WORKER_GONE:
                    raise error from None
                self.prefill.failed(worker)
                failed.append(worker)
                raise LegFailed(error) from None
            finally:
                call.cancel()
        first = generate_pb2.GenerateResponse(
            request_id=rid, token_ids=[prefilled.first_token_id], text=prefilled.text
        )
        if prefilled.HasField("first_logprobs"):
            first.logprobs.append(prefilled.first_logprobs)
        first.prompt_logprobs.extend(prefilled.prompt_logprobs)
        if prefilled.finish_reason:
            first.finish_reason = prefilled.finish_reason
            yield first, prefilled.cached_tokens
            return

        handle = prefilled.kv_handle
        # The lease's end on this host's monotonic clock: the handle carries the time left.
        lease_end = lease_clock.deadline(handle.lease_ttl_ms)
        pulled = False  # decode's first message says the blocks are in place
        waiting = False  # counted in `handoffs_waiting`: a busy decode pool refused it
        try:
            yield first, prefilled.cached_tokens
            blocks = -(-(len(tokens) + left) // max(1, handle.block_size))
            request = decode_pb2.DecodeRequest(
                request_id=wid,
                prompt_token_ids=tokens,
                first_token_id=prefilled.first_token_id,
                sampling=sampling,
                kv_handle=handle,
                resumed=resumed,
            )
            backoff = Backoff(*HANDOFF_BACKOFF_S)
            while True:
                decoder = await self.decode.pick(blocks_needed=blocks, exclude=failed)
                span.set_attribute("pdserve.decode_worker", decoder.address)
                request.kv_handle.lease_ttl_ms = lease_clock.ttl_ms(lease_end)  # left now
                await faults.ahit("coordinator.before_decode")
                call = decoder.stub.Decode(
                    request, timeout=remaining(), metadata=metadata_for_call(span)
                )
                try:
                    async for item in self._relay_decode(
                        call, decoder, rid, timer, failed, prefilled
                    ):
                        pulled = True  # decode has the blocks (a pulled lease's release: no-op)
                        if waiting:
                            waiting = False
                            self.handoffs_waiting -= 1
                        yield item
                    return
                except DecodeBusy as e:
                    if not waiting:
                        waiting = True
                        self.handoffs_waiting += 1
                    await self._wait_to_hand_off(e.error, backoff, lease_end, remaining, timer)
        finally:
            if waiting:
                self.handoffs_waiting -= 1
            if not pulled:  # failed or cancelled before the pull: free prefill's blocks
                self._release(worker, handle.lease_id)

    async def _wait_to_hand_off(
        self,
        error: RequestFailed,
        backoff: Backoff,
        lease_end: float,
        remaining: Callable[[], float | None],
        timer: RequestTimer,
    ) -> None:
        """A decode worker refused a handoff as busy (its admission queue full). The client
        already has the first token and prefill holds the blocks under a lease, so the
        request waits and tries again (another decode worker, if one is less loaded) while
        the lease and the deadline last; back-pressure reaches new requests at prefill,
        whose blocks the waiting leases hold. `lease_end`: the lease's end on this host's
        monotonic clock. Raises `error` when time is up."""
        wait = backoff.next_delay()
        lease_left = lease_clock.left(lease_end)
        left = remaining()
        if lease_left - wait < LEASE_MARGIN_S or (left is not None and left <= wait):
            raise error
        timer.handoff_retried(error.message)
        await asyncio.sleep(wait)

    async def _relay_decode(
        self,
        call: grpc.aio.UnaryStreamCall,
        decoder: WorkerEndpoint,
        rid: str,
        timer: RequestTimer,
        failed: list,
        prefilled: prefill_pb2.PrefillResponse | None,
        migrated: bool = False,
    ) -> AsyncIterator[tuple[generate_pb2.GenerateResponse, int]]:
        """Decode's stream as (response, cached prompt tokens); its first message (blocks in
        place) is the handoff. A lost decode worker raises `LegFailed`; one refusing a
        handoff as busy, `DecodeBusy`; one that drains, `Migrating`. A `migrated` leg that
        fails before its first message raises `MigrationFailed`."""
        assert self.decode is not None
        with self.decode.track(decoder):
            try:
                handed_off = False
                async for step in call:
                    if not handed_off:
                        handed_off = True
                        if prefilled is not None:
                            timer.handed_off()
                    if step.HasField("migrate_kv"):
                        raise Migrating(step.migrate_kv, decoder)
                    if not (step.token_ids or step.text or step.finish_reason):
                        continue
                    out = generate_pb2.GenerateResponse(
                        request_id=rid,
                        token_ids=step.token_ids,
                        text=step.text,
                        logprobs=step.logprobs,
                        finish_reason=step.finish_reason,
                    )
                    yield out, (prefilled.cached_tokens if prefilled else step.cached_tokens)
            except grpc.aio.AioRpcError as e:
                error = _worker_error("decode", decoder.address, e)
                if migrated and not handed_off:  # the new worker is not to blame for a pull
                    raise MigrationFailed(f"migration to {error.message}") from None
                busy = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                if busy and not handed_off and prefilled is not None:
                    raise DecodeBusy(error) from None
                if e.code() not in WORKER_GONE:
                    raise error from None
                self.decode.failed(decoder)
                failed.append(decoder)
                raise LegFailed(error) from None
            finally:
                call.cancel()

    async def _migrated_leg(
        self,
        parsed: ParsedRequest,
        prompt: list[int],
        generated: list[int],
        chars_before_last: int,
        migration: Migrating,
        remaining: Callable[[], float | None],
        timer: RequestTimer,
        failed: list,
    ) -> AsyncIterator[tuple[generate_pb2.GenerateResponse, int]]:
        """Go on on another decode worker from the KV a draining one leased: the prompt and
        every token sent but the last are the computed tokens, the last is this leg's first
        token, and the output state resumes as after a lost worker (`_leg`). Nothing is
        prefilled. With no other decode worker, the draining one takes the stream back.
        Raises `MigrationFailed` until the new worker has the KV, then as `_leg`."""
        assert self.decode is not None
        span = timer.span
        rid = parsed.request_id
        params = parsed.params
        n = len(generated) - 1  # output tokens among the computed ones
        left = params.max_tokens - n
        sampling = params_to_proto(
            replace(params, max_tokens=left, min_tokens=max(0, params.min_tokens - n))
        )
        handle = migration.handle
        lease_end = lease_clock.deadline(handle.lease_ttl_ms)
        request = decode_pb2.DecodeRequest(
            request_id=worker_request_id(rid),
            prompt_token_ids=prompt + generated[:-1],
            first_token_id=generated[-1],
            sampling=sampling,
            kv_handle=handle,
            resumed=generate_pb2.ResumedOutput(output_tokens=n, sent_chars=chars_before_last)
            if n
            else None,
            migrated=True,
        )
        blocks = -(-(len(prompt) + n + left) // max(1, handle.block_size))
        try:
            decoder = await self.decode.pick(blocks_needed=blocks, exclude=failed)
        except NoWorkerError:
            # No other decode worker: the draining one takes the stream back and finishes it
            # (as a drain did before streams moved), its KV never having left.
            decoder = migration.source
        span.set_attribute("pdserve.decode_worker", decoder.address)
        request.kv_handle.lease_ttl_ms = lease_clock.ttl_ms(lease_end)  # left now
        call = decoder.stub.Decode(request, timeout=remaining(), metadata=metadata_for_call(span))
        moved = False
        try:
            async for item in self._relay_decode(
                call, decoder, rid, timer, failed, None, migrated=True
            ):
                if not moved:
                    moved = True
                    timer.migrated("kept" if decoder is migration.source else "migrated")
                yield item
        except MigrationFailed:
            self._release_moved(migration)
            raise

    @staticmethod
    def _unmovable(handle: kv_pb2.KvHandle, computed: int, last_tokens: int) -> str | None:
        """Why a stream handed over cannot go on from `handle` (None: it can). `computed`:
        the prompt and every token sent but the last; `last_tokens`: the tokens of the last
        response that had any (the text the client had before them must be known)."""
        if handle.num_tokens != computed:
            return (
                f"the migrated KV covers {handle.num_tokens} tokens, the stream has "
                f"{computed} before its last"
            )
        if last_tokens != 1:
            return f"the last response carried {last_tokens} tokens, not one"
        return None

    def _release_moved(self, migration: Migrating) -> None:
        """Free a migrated lease that will not be pulled (in the background: one that cannot
        be reached expires with the source's drain)."""
        stub = prefill_pb2_grpc.PrefillServiceStub(migration.source.channel)
        self._background_release(stub, migration.source.address, migration.handle.lease_id)

    def _release(self, worker: WorkerEndpoint, lease_id: str) -> None:
        """Ask the prefill worker to free a lease, in the background (a lease that was
        already pulled is a no-op there; one that cannot be reached expires)."""
        self._background_release(worker.stub, worker.address, lease_id)

    def _background_release(
        self, stub: prefill_pb2_grpc.PrefillServiceStub, address: str, lease_id: str
    ) -> None:
        async def release() -> None:
            try:
                await stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(lease_id=lease_id), timeout=5)
            except grpc.aio.AioRpcError as e:
                logger.warning("release of %s on %s failed: %s", lease_id, address, e.details())

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
