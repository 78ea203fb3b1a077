"""Service-to-service mTLS with real processes: a prefill, a decode and a coordinator that
share a throwaway CA (`make_throwaway`, as `serve --internal-tls` makes it). Requests go
end to end (the KV handoff included) with the same greedy tokens as without TLS; every
worker port that takes work (prefill, decode, colocated) refuses a caller without a
certificate, with a certificate of another CA, or over plain text; probes get SERVING on
the plain health port, which serves nothing else; the public port stays plain and keyless;
`serve --internal-tls` comes up on the same path."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.tls import make_throwaway
from pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services import start

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--kv-cache-tokens", "4096", "--threads", "1", "--health-port", "0"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_throwaway(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def cluster(certs):
    env = certs.env()
    prefill = start("prefill", *WORKER_ARGS, env=env)
    decode = start("decode", *WORKER_ARGS, env=env)
    coordinator = start(
        "coordinator",
        f"--prefill-workers={prefill.grpc}",
        f"--decode-workers={decode.grpc}",
        env=env,
    )
    try:
        yield {"prefill": prefill, "decode": decode, "coordinator": coordinator}
    finally:
        for service in (coordinator, decode, prefill):
            service.stop()


def ask(stub) -> list[int]:
    request = generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(role="user", content="What is the capital of France?")],
        sampling=generate_pb2.SamplingParams(max_tokens=12, temperature=0),
    )
    return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]


def prefill_call(channel) -> grpc.RpcError:
    stub = prefill_pb2_grpc.PrefillServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(prefill_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1, 2]), timeout=5)
    return err.value


def test_requests_go_end_to_end_over_mtls(cluster):
    with grpc.insecure_channel(cluster["coordinator"].grpc) as channel:  # the public port
        tokens = ask(generate_pb2_grpc.GenerateServiceStub(channel))
    assert tokens
    assert cluster["decode"].metric("pdserve_kv_transfer_blocks_total", direction="receive") > 0
    without = start("colocated", "--kv-cache-tokens", "4096", "--threads", "1")
    try:  # the same tokens with no TLS anywhere
        with grpc.insecure_channel(without.grpc) as channel:
            assert ask(generate_pb2_grpc.GenerateServiceStub(channel)) == tokens
    finally:
        without.stop()


def decode_call(channel) -> grpc.RpcError:
    stub = decode_pb2_grpc.DecodeServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Decode(decode_pb2.DecodeRequest(request_id="x", prompt_token_ids=[1, 2]),
                         timeout=5))  # fmt: skip
    return err.value


def generate_call(channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        ask(generate_pb2_grpc.GenerateServiceStub(channel))
    return err.value


def assert_refuses_strangers(address: str, call, certs, stranger) -> None:
    """Plain text, TLS without a client certificate, and a certificate of another CA: each
    is refused before the call reaches the service."""
    with grpc.insecure_channel(address) as plain:
        assert call(plain).code() == grpc.StatusCode.UNAVAILABLE, address
    options = certs.channel_options()
    no_cert = grpc.ssl_channel_credentials(certs.ca.read_bytes())
    with grpc.secure_channel(address, no_cert, options=options) as anonymous:
        assert call(anonymous).code() == grpc.StatusCode.UNAVAILABLE, address
    foreign = grpc.ssl_channel_credentials(
        certs.ca.read_bytes(), stranger.key.read_bytes(), stranger.cert.read_bytes()
    )
    with grpc.secure_channel(address, foreign, options=options) as impostor:
        assert call(impostor).code() == grpc.StatusCode.UNAVAILABLE, address


def test_workers_refuse_callers_without_the_cas_certificate(cluster, certs, tmp_path):
    stranger = make_throwaway(tmp_path / "stranger")  # same name, another CA
    assert_refuses_strangers(cluster["prefill"].grpc, prefill_call, certs, stranger)
    assert_refuses_strangers(cluster["decode"].grpc, decode_call, certs, stranger)
    colocated = start("colocated", *WORKER_ARGS, env=certs.env())
    try:
        assert_refuses_strangers(colocated.grpc, generate_call, certs, stranger)
        options = certs.channel_options()
        with grpc.secure_channel(colocated.grpc, certs_credentials(certs), options=options) as ch:
            assert ask(generate_pb2_grpc.GenerateServiceStub(ch))  # a member gets through
    finally:
        colocated.stop()
    address = cluster["prefill"].grpc
    options = certs.channel_options()
    with grpc.secure_channel(address, certs_credentials(certs), options=options) as member:
        stub = prefill_pb2_grpc.PrefillServiceStub(member)  # a member gets through
        reply = stub.Prefill(
            prefill_pb2.PrefillRequest(request_id="member", prompt_token_ids=[1, 2]), timeout=30
        )
        assert reply.kv_handle.lease_id
        stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(lease_id=reply.kv_handle.lease_id))


def certs_credentials(certs) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        certs.ca.read_bytes(), certs.key.read_bytes(), certs.cert.read_bytes()
    )


def test_the_health_port_answers_probes_and_nothing_else(cluster):
    health_address = cluster["prefill"].info["health"]
    with grpc.insecure_channel(health_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert prefill_call(channel).code() == grpc.StatusCode.UNIMPLEMENTED


def test_serve_internal_tls_comes_up_and_answers(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.services.cli", "serve", "--internal-tls", "--port", "0",
         "--http-port", "-1", "--kv-cache-tokens", "4096", "--threads", "1"],
        stdout=subprocess.PIPE, text=True, env={**os.environ},
    )  # fmt: skip
    try:
        ready = None
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("{") and json.loads(line).get("event") == "ready":
                ready = json.loads(line)
                break
        assert ready is not None, "serve --internal-tls never got ready"
        with grpc.insecure_channel(ready["coordinator"]) as channel:
            assert ask(generate_pb2_grpc.GenerateServiceStub(channel))
        worker = next(w for w in ready["workers"] if w["role"] == "prefill")
        with grpc.insecure_channel(worker["grpc"]) as plain:
            assert prefill_call(plain).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_public_tls_on_the_coordinator(cluster, certs):
    import httpx2 as httpx  # openai's HTTP client (the httpx2 distribution)

    env = {**certs.env(), "PDSERVE_PUBLIC_TLS_CERT": str(certs.cert),
           "PDSERVE_PUBLIC_TLS_KEY": str(certs.key)}  # fmt: skip
    edge = start(
        "coordinator",
        f"--prefill-workers={cluster['prefill'].grpc}",
        f"--decode-workers={cluster['decode'].grpc}",
        "--http-port=0",
        "--health-port=0",
        env=env,
    )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pdserve.services.cli", "complete", "The sky is",
             "--max-tokens", "4", "--address", edge.grpc, "--public-tls-ca", str(certs.ca)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        with grpc.insecure_channel(edge.grpc) as plain:  # the public port speaks TLS only
            with pytest.raises(grpc.RpcError) as err:
                ask(generate_pb2_grpc.GenerateServiceStub(plain))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        body = {"prompt": "The sky is", "max_tokens": 4}
        url = f"https://{edge.info['http']}/v1/completions"
        verify = ssl.create_default_context(cafile=str(certs.ca))
        reply = httpx.post(url, json=body, verify=verify, timeout=120)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
    finally:
        edge.stop()
