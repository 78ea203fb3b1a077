"""The HTTP front's own limits, on the FastAPI app with a stand-in coordinator (the real
twin is tests/integration/test_security.py): a crash answers 500 without any internal text,
a body over the limit answers 413 whether its length is declared or streamed (each counted
once in `pdserve_http_request_too_large_total`), a request id that could not travel back in
a header is a 400, and keys are checked before anything."""

from __future__ import annotations

from typing import ClassVar

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from transformers import AutoTokenizer

from pdserve.services.auth import ApiKeys
from pdserve.services.coordinator.http_api import OpenAIServer

SECRET = "worker 10.1.2.3:50061 token=hunter2"


class CrashingCoordinator:
    metric_labels: ClassVar[dict[str, str]] = {
        "model": "m",
        "role": "coordinator",
        "worker": "http-hardening",
    }

    def generate(self, request, headers=(), fill_context=False):
        raise RuntimeError(SECRET)


@pytest.fixture(scope="module")
def server(default_model_dir) -> OpenAIServer:
    return OpenAIServer(
        CrashingCoordinator(),  # type: ignore[arg-type]
        AutoTokenizer.from_pretrained(default_model_dir),
        ["m"],
        64,
        ApiKeys("k"),
        max_body_bytes=2048,
    )


@pytest.fixture(scope="module")
def client(server) -> TestClient:
    return TestClient(server.app, raise_server_exceptions=False)


AUTH = {"Authorization": "Bearer k"}
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_a_crash_is_500_without_internal_text(client, caplog) -> None:
    r = client.post("/v1/chat/completions", json=BODY, headers=AUTH)
    assert r.status_code == 500
    error = r.json()["error"]
    assert "hunter2" not in r.text and "10.1.2.3" not in r.text and "RuntimeError" not in r.text
    assert error["message"].startswith("internal error (reference ")
    ref = error["message"].split("reference ")[1].rstrip(")")
    assert any(ref in rec.getMessage() for rec in caplog.records)  # the log has the details


def too_large() -> float:
    value = REGISTRY.get_sample_value(
        "pdserve_http_request_too_large_total", CrashingCoordinator.metric_labels
    )
    assert value is not None  # exported from the start, at 0
    return value


def test_bodies_over_the_limit_are_413(client) -> None:
    before = too_large()
    big = {"messages": [{"role": "user", "content": "x" * 4096}]}
    r = client.post("/v1/chat/completions", json=big, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"
    assert "2048" in r.json()["error"]["message"]
    assert too_large() == before + 1

    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(8):
            yield b"y" * 512
        yield b'"}]}'

    streamed = client.post(
        "/v1/chat/completions",
        content=chunks(),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert streamed.status_code == 413
    assert too_large() == before + 2  # the streamed one, once
    assert "pdserve_http_request_too_large_total" in client.get("/metrics").text


def test_request_ids_must_fit_a_header(client) -> None:
    for rid in ("", "x" * 257, "naïve", "a b", "日本"):
        r = client.post("/v1/chat/completions", json={**BODY, "request_id": rid}, headers=AUTH)
        if rid == "":
            assert r.status_code == 500  # empty means "make one": it reaches the coordinator
            continue
        assert r.status_code == 400, rid
        assert r.json()["error"]["param"] == "request_id"


def test_keys_are_checked_first(client) -> None:
    assert client.post("/v1/chat/completions", json=BODY).status_code == 401
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers=AUTH).status_code == 200
    assert client.get("/health").status_code == 200
