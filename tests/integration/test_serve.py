"""`pdserve serve` as a person runs it: one command starts every process, prints the ready
line, answers `pdserve complete` through the public API, is reachable by independent gRPC
tools through reflection, and stops every child on Ctrl-C. Colocated mode answers the same
greedy tokens as the disaggregated path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest

from pdserve.v1 import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)
SMALL = ["--kv-cache-tokens", "8192"]


def _serve(*args: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [f"{BIN}/pdserve", "serve", "--port", "0", "--http-port", "0", *SMALL, *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(240)
    if not box or not box[0]:
        proc.kill()
        raise RuntimeError(f"pdserve serve did not become ready (exit code {proc.poll()})")
    return proc, json.loads(box[0])


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _greedy_tokens(address: str, question: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(role="user", content=question)],
            sampling=generate_pb2.SamplingParams(max_tokens=16, temperature=0),
        )
        return [t for r in stub.Generate(request) for t in r.token_ids]


@pytest.fixture(scope="module")
def disaggregated():
    proc, ready = _serve()
    try:
        yield proc, ready
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def test_http_api_answers_like_grpc(disaggregated):
    """The README's curl call: the ready line's HTTP address serves the OpenAI API."""
    _, ready = disaggregated
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}  # fmt: skip
    request = urllib.request.Request(
        f"http://{ready['http']}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.load(response)
    tokens = _greedy_tokens(ready["coordinator"], "What is the capital of France?")
    assert reply["usage"]["completion_tokens"] == len(tokens)
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_ready_line_lists_every_process(disaggregated):
    _, ready = disaggregated
    assert ready["event"] == "ready"
    assert sorted(w["role"] for w in ready["workers"]) == ["decode", "prefill"]
    for worker in ready["workers"]:
        assert worker["metrics"].startswith("http://") and worker["metrics"].endswith("/metrics")


def test_complete_streams_an_answer(disaggregated):
    _, ready = disaggregated
    out = subprocess.run(
        [f"{BIN}/pdserve", "complete", "--chat", "What is the capital of France?",
         "--address", ready["coordinator"], "--max-tokens", "20"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_chat_keeps_the_conversation(disaggregated):
    _, ready = disaggregated
    out = subprocess.run(
        [f"{BIN}/pdserve", "chat", "--address", ready["coordinator"], "--max-tokens", "20"],
        input="What is the capital of France?\nAnd of Italy?\n\n",
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    answers = [line for line in out.stdout.splitlines() if line.strip()]
    assert "Paris" in answers[0] and "Rome" in out.stdout


def test_grpcurl_sees_the_api_through_reflection(disaggregated):
    _, ready = disaggregated
    grpcurl = f"{BIN}/grpcurl"
    listed = subprocess.run([grpcurl, "-plaintext", ready["coordinator"], "list"],
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    for service in ("pdserve.v1.GenerateService", "grpc.health.v1.Health"):
        assert service in listed.stdout
    for worker in ready["workers"]:
        described = subprocess.run([grpcurl, "-plaintext", worker["grpc"], "list"],
                                   capture_output=True, text=True, timeout=30)  # fmt: skip
        name = {"prefill": "PrefillService", "decode": "DecodeService"}[worker["role"]]
        assert f"pdserve.v1.{name}" in described.stdout
    reply = subprocess.run(
        [grpcurl, "-plaintext", "-d",
         '{"prompt": "The capital of France is", "sampling": {"max_tokens": 4, '
         '"temperature": 0}}', ready["coordinator"], "pdserve.v1.GenerateService/Generate"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert reply.returncode == 0, reply.stderr
    assert '"finish_reason": "length"' in reply.stdout and " Paris" in reply.stdout
    health = subprocess.run(
        [grpcurl, "-plaintext", "-d", '{"service": ""}', ready["coordinator"],
         "grpc.health.v1.Health/Check"], capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert '"SERVING"' in health.stdout


def test_colocated_answers_the_same_tokens(disaggregated):
    _, ready = disaggregated
    question = "Name three colours of the rainbow."
    expected = _greedy_tokens(ready["coordinator"], question)
    proc, colocated = _serve("--colocated")
    try:
        assert [w["role"] for w in colocated["workers"]] == ["colocated"]
        assert _greedy_tokens(colocated["coordinator"], question) == expected
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_sigint_stops_every_process():
    proc, _ = _serve("--colocated")
    children = _children(proc.pid)
    assert len(children) == 2  # the worker and the coordinator
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert not any(_alive(pid) for pid in children)
