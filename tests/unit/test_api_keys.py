"""The public ports' door: API keys from a flag or a file (several keys, read again when
the file changes, so keys rotate without a restart), refused when empty, checked on every
HTTP `/v1/*` call and every gRPC `GenerateService` / reflection call, never on health."""

from __future__ import annotations

import os

import grpc
import pytest

from pdserve.services import auth
from pdserve.services.auth import ApiKeyError, ApiKeyInterceptor, ApiKeys


def test_a_key_and_the_bearer_scheme() -> None:
    keys = ApiKeys("k1")
    assert keys.allows("Bearer k1") and keys.allows("bearer  k1 ") and keys.allows(b"Bearer k1")
    for header in ("", "k1", "Basic k1", "Bearer k2", "Bearer k1x", "Bearer "):
        assert not keys.allows(header), header


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_key_is_refused(key) -> None:
    with pytest.raises(ApiKeyError, match="empty"):
        ApiKeys(key)


def test_no_key_means_no_auth() -> None:
    assert ApiKeys.configured(None, None) is None
    assert ApiKeys.configured(None, "") is None


def test_a_key_file_holds_several_keys_and_rotates(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(auth, "RELOAD_EVERY_S", 0.0)
    path = tmp_path / "keys"
    path.write_text("# current and next\nold-key\n\nnew-key\n")
    keys = ApiKeys(key_file=str(path))
    assert keys.allows("Bearer old-key") and keys.allows("Bearer new-key")
    assert not keys.allows("Bearer # current and next")
    path.write_text("new-key\n")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert not keys.allows("Bearer old-key") and keys.allows("Bearer new-key")
    path.write_text("")  # a file emptied by mistake keeps the keys it had
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    assert keys.allows("Bearer new-key")


def test_a_missing_or_keyless_file_is_refused_at_start(tmp_path) -> None:
    with pytest.raises(ApiKeyError, match="cannot read"):
        ApiKeys(key_file=str(tmp_path / "absent"))
    (tmp_path / "blank").write_text("# nothing\n\n")
    with pytest.raises(ApiKeyError, match="no key"):
        ApiKeys(key_file=str(tmp_path / "blank"))


class Details:
    def __init__(self, method: str, metadata: tuple = ()) -> None:
        self.method, self.invocation_metadata = method, metadata


def _handler() -> grpc.RpcMethodHandler:
    async def serve(request, context):
        yield request

    return grpc.unary_stream_rpc_method_handler(serve)


async def _continuation(_details) -> grpc.RpcMethodHandler:
    return _handler()


@pytest.mark.parametrize(
    ("method", "metadata", "passes"),
    [
        ("/pdserve.v1.GenerateService/Generate", (), False),
        ("/pdserve.v1.GenerateService/Generate", (("authorization", "Bearer nope"),), False),
        ("/pdserve.v1.GenerateService/Generate", (("authorization", "Bearer k"),), True),
        ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", (), False),
        ("/grpc.health.v1.Health/Check", (), True),
    ],
)
def test_the_interceptor_guards_the_api_and_reflection_not_health(method, metadata, passes):
    import asyncio

    interceptor = ApiKeyInterceptor(ApiKeys("k"))
    handler = asyncio.run(interceptor.intercept_service(_continuation, Details(method, metadata)))
    # A refusal keeps the call's shape (unary-stream here) so the client reads a status.
    assert handler.response_streaming and not handler.request_streaming
    assert (handler.unary_stream.__name__ == "serve") == passes
