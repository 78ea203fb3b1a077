"""The door of the coordinator's public ports: API keys. With keys set, every HTTP `/v1/*`
call and every gRPC `GenerateService` (and reflection) call must carry
`authorization: Bearer KEY` (an HTTP header or gRPC metadata) naming one of them; health
stays open for probes. Keys come from `--api-key` / `PDSERVE_API_KEY` or from a file
(`--api-key-file`, one key per line, `#` comments), which is read again when it changes, so
keys rotate without a restart: add the new key, move clients, remove the old one. Every
compare is constant-time over all keys."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

RELOAD_EVERY_S = 1.0
# gRPC methods the key guards: the public API and reflection (which lists it).
GUARDED_METHODS = ("/pdserve.v1.GenerateService/", "/grpc.reflection.")


class ApiKeyError(ValueError):
    """The configured keys cannot be used (empty, unreadable file)."""


class ApiKeys:
    def __init__(self, key: str | None = None, key_file: str | None = None) -> None:
        if key is not None and not key.strip():
            raise ApiKeyError(
                "api key: the key is empty (PDSERVE_API_KEY is set but blank?); give a "
                "non-empty key, or unset it to serve without one"
            )
        self._fixed = [key.strip()] if key is not None else []
        self._file = Path(key_file) if key_file else None
        self._from_file: list[str] = []
        self._mtime: float | None = None
        self._checked = 0.0
        if self._file is not None:
            self._load()

    @classmethod
    def configured(cls, key: str | None, key_file: str | None) -> ApiKeys | None:
        """The keys the flags name, or None when neither is given (no auth)."""
        if key is None and not key_file:
            return None
        return cls(key, key_file)

    def _load(self) -> None:
        assert self._file is not None
        try:
            mtime = self._file.stat().st_mtime
            if mtime == self._mtime:
                return
            lines = self._file.read_text().splitlines()
        except OSError as e:
            if self._mtime is None:
                raise ApiKeyError(f"api key file: cannot read {self._file}: {e}") from None
            return  # a file being replaced: keep the keys we have
        keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not keys:
            if self._mtime is None:
                raise ApiKeyError(f"api key file: {self._file} holds no key")
            return
        self._from_file, self._mtime = keys, mtime

    def keys(self) -> list[str]:
        now = time.monotonic()
        if self._file is not None and now - self._checked >= RELOAD_EVERY_S:
            self._checked = now
            self._load()
        return self._fixed + self._from_file

    def allows(self, authorization: str | bytes) -> bool:
        """Whether an `authorization` header / metadata value names a key."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode("utf-8", "replace")
        ok = False
        for key in self.keys():  # every key, so the time says nothing about which matched
            ok |= secrets.compare_digest(given, key.encode())
        return ok and scheme.lower() == "bearer"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses `GUARDED_METHODS` calls without a known key with UNAUTHENTICATED."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(GUARDED_METHODS):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self.keys.allows(metadata.get("authorization", "")):
            return handler
        return _refusing(handler)


REFUSED = "missing or wrong API key: send metadata 'authorization: Bearer KEY'"


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def unary(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

    async def streaming(_request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
        yield  # never reached: makes this an async generator

    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)
