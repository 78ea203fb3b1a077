"""What every pdserve service process has around its own servicer: a `grpc.aio` server
with `grpc.health.v1` and server reflection (v1 and v1alpha, so grpcurl 1.8 and newer tools
both work), a Prometheus `/metrics` endpoint, and a clean stop on SIGINT / SIGTERM (health
goes NOT_SERVING, in-flight RPCs get a grace period, then the process ends)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as _  # noqa: F401  (registers types)
from grpc_reflection.v1alpha._async import ReflectionServicer
from prometheus_client import start_http_server

from pdserve.common.config import GRPC_KEEPALIVE
from pdserve.services.tls import TlsFiles, internal_channel

logger = logging.getLogger(__name__)

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# Sent messages can carry a whole prefix index (status reports); received ones are bounded
# by what a request may hold (`message_limit`).
MAX_SEND_BYTES = 64 * 1024 * 1024
MIN_RECEIVE_BYTES = 1024 * 1024


# A server accepts keepalive pings this often (or as often as it sends its own, if more
# often), whatever its callers' --grpc-keepalive: a caller set shorter is not cut off for
# pinging "too often".
MIN_PING_INTERVAL_MS = 1000


def keepalive_channel_options(keepalive_s: float) -> list[tuple[str, int]]:
    """A channel to another service that pings it every `keepalive_s` seconds, calls in
    flight or not, and closes (failing its calls UNAVAILABLE) when a ping is unanswered for
    as long again: a peer that hangs (stopped, not dead) or a cut link ends its calls
    instead of holding them forever. `keepalive_s` 0: gRPC's defaults (no pings)."""
    if keepalive_s <= 0:
        return []
    ms = max(1, int(keepalive_s * 1000))
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        # Any ping, not only keepalive's: with one ping in flight at a time, a flow-control
        # (BDP) ping sent as the last data arrived would otherwise hold the keepalive ping
        # back for its own 60 s timeout.
        ("grpc.http2.ping_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # A server-streaming call sends nothing after its request: keep pinging anyway.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", ms),
    ]


def keepalive_server_options(keepalive_s: float) -> list[tuple[str, int]]:
    """A server that accepts its callers' keepalive pings (every `MIN_PING_INTERVAL_MS` or
    more often, with or without calls) and pings them itself, so that the calls of a caller
    that hangs end and free what they hold."""
    ms = max(1, int(keepalive_s * 1000)) if keepalive_s > 0 else 0
    floor = min(MIN_PING_INTERVAL_MS, ms) if ms else MIN_PING_INTERVAL_MS
    options = [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", floor),
        ("grpc.http2.min_ping_interval_without_data_ms", floor),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if ms:
        options += [
            ("grpc.keepalive_time_ms", ms),
            ("grpc.keepalive_timeout_ms", ms),
            ("grpc.http2.ping_timeout_ms", ms),
        ]
    return options


def message_limit(max_prompt_chars: int) -> int:
    """The largest request worth reading: a prompt of `max_prompt_chars` characters, each
    up to 4 bytes of UTF-8 (6 once escaped in JSON), plus room for the other fields."""
    return MIN_RECEIVE_BYTES + 6 * max_prompt_chars


def worker_message_limit(max_model_len: int) -> int:
    """A worker's requests carry token ids (at most 5 bytes each) and bounded fields."""
    return MIN_RECEIVE_BYTES + 5 * max_model_len


class _Undecodable:
    def __init__(self, why: str) -> None:
        self.why = why


class UndecodableIsInvalid(grpc.aio.ServerInterceptor):
    """A request whose bytes are not its message gets INVALID_ARGUMENT (gRPC itself would
    answer UNKNOWN, as if the service had failed). Single-message requests only; streams of
    requests (reflection) keep gRPC's own handling."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> object:
            try:
                return parse(data)
            except Exception as e:  # protobuf's DecodeError, or anything a parser raises
                return _Undecodable(f"{type(e).__name__}: {e}")

        codec = {"request_deserializer": deserialize,
                 "response_serializer": handler.response_serializer}  # fmt: skip
        method = details.method

        async def refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request: not a valid message for {method} ({request.why})",
            )

        if handler.response_streaming:
            inner_stream = handler.unary_stream

            async def stream(request: object, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                async for response in inner_stream(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(stream, **codec)
        inner_unary = handler.unary_unary

        async def unary(request: object, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await refuse(request, context)
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, **codec)


class ServiceProcess:
    """One service: register servicers with `server`, then `await run()`.
    `interceptors` see every call (the API key's door); `max_message_bytes` bounds what
    a caller may send in one message; `keepalive_s`: `keepalive_server_options`."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics_port: int | None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_message_bytes: int = MIN_RECEIVE_BYTES,
        credentials: grpc.ServerCredentials | None = None,
        health_port: int = -1,
        keepalive_s: float = GRPC_KEEPALIVE.default,
    ) -> None:
        self.server = grpc.aio.server(
            interceptors=[*interceptors, UndecodableIsInvalid()],
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", MAX_SEND_BYTES),
                ("grpc.so_reuseport", 0),
                *keepalive_server_options(keepalive_s),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if credentials is None:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        else:
            self.port = self.server.add_secure_port(f"{host}:{port}", credentials)
        if self.port == 0:
            raise OSError(f"port: cannot listen on {host}:{port}")
        self.host = host
        # Probes that cannot present a certificate ask here; nothing else is served on it.
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        if health_port >= 0:
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"{host}:{health_port}")
            if self.health_port == 0:
                raise OSError(f"health port: cannot listen on {host}:{health_port}")
        self.metrics_port = None
        if metrics_port is not None:
            http_server, _thread = start_http_server(metrics_port, addr=host)
            self.metrics_port = http_server.server_port
        self._on_stop: list[Callable[[], Awaitable[None]]] = []
        self._on_drain: list[Callable[[float], Awaitable[None]]] = []
        self._before_drain: list[Callable[[float], Awaitable[None]]] = []

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def on_stop(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run `fn` once the server has stopped."""
        self._on_stop.append(fn)

    def before_drain(self, fn: Callable[[float], Awaitable[None]]) -> None:
        """`fn(grace_s)` runs on SIGTERM (not SIGINT) while the server still takes new calls,
        before its drain: a decode worker moves its streams out, which needs calls in."""
        self._before_drain.append(fn)

    def on_drain(self, fn: Callable[[float], Awaitable[None]]) -> None:
        """Run `fn(grace_s)` beside the gRPC server's drain (another front's own drain)."""
        self._on_drain.append(fn)

    async def run(
        self,
        service_names: Sequence[str],
        on_ready: Callable[[], None] | None = None,
        grace_s: float = 30.0,
    ) -> None:
        """Serve until SIGINT / SIGTERM. `service_names`: the full names to advertise;
        `on_ready` runs once the server answers SERVING."""
        _enable_reflection([*service_names, health.SERVICE_NAME], self.server)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        for name in ["", *service_names]:
            await self.health.set(name, serving)
        stop = asyncio.Event()
        got: list[int] = []  # the signal that stopped it
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda s=sig: (got.append(s), stop.set()))
        logger.info("serving %s on %s", ", ".join(service_names), self.address)
        if on_ready is not None:
            on_ready()
        await stop.wait()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the drain
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        if got and got[0] == signal.SIGTERM:  # a Ctrl-C stops without moving anything out
            for fn in self._before_drain:
                try:
                    await fn(grace_s)
                except Exception:
                    logger.exception("before the drain: a step failed; the drain follows")
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(self.server.stop(grace_s), *(fn(grace_s) for fn in self._on_drain))
        if self.health_server is not None:
            await self.health_server.stop(0)
        for fn in self._on_stop:
            await fn()


def _enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    names = [*service_names, reflection.SERVICE_NAME, REFLECTION_V1]
    reflection.enable_server_reflection(names, server)
    # v1 has the same messages as v1alpha under a new service name: serve both.
    servicer = ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler})]
    )


async def wait_healthy(address: str, timeout_s: float, tls: TlsFiles | None = None) -> None:
    """Until the service at `address` answers SERVING (over mTLS with `tls`); raises
    TimeoutError."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with internal_channel(address, tls=tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} was not healthy within {timeout_s:.0f} s")
            await asyncio.sleep(0.2)
