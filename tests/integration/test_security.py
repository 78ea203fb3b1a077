"""Every door of a running system, with real processes (a prefill worker that lets one
request wait, a decode worker, a coordinator with keys from a file and HTTP on): the gRPC
API and reflection need a key (health does not), keys rotate by editing the file, an empty
key stops the coordinator at start; bad values of every kind get 400 / INVALID_ARGUMENT
naming the field, bodies and prompts over their bounds are refused before any work, a full
worker answers 429 with Retry-After, a subnormal temperature samples greedy, and a caller
that leaves a local prefill at its first message frees the request. No block leaks."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.services.frontend import longest_token_chars
from pdserve.services.grpc_server import message_limit
from pdserve.v1 import decode_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc
from services import post, start, wait_idle

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
WORKER_ARGS = ["--kv-cache-tokens", "8192", "--threads", "1"]
KEYS = ("first-key", "second-key")


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# rotated by editing\n{KEYS[0]}\n{KEYS[1]}\n")
    return path


@pytest.fixture(scope="module")
def cluster(key_file):
    # One request may run and one wait on the prefill worker: concurrency past that is
    # refused there, which the overload test needs.
    prefill = start("prefill", *WORKER_ARGS, "--max-num-seqs", "1", "--max-pending", "1")
    decode = start("decode", *WORKER_ARGS)  # its own context is the model's: 8192
    coordinator = start(
        "coordinator",
        f"--prefill-workers={prefill.grpc}",
        f"--decode-workers={decode.grpc}",
        "--http-port=0",
        f"--max-model-len={MAX_MODEL_LEN}",
        f"--api-key-file={key_file}",
    )
    try:
        yield {"prefill": prefill, "decode": decode, "coordinator": coordinator}
    finally:
        for service in (coordinator, decode, prefill):
            service.stop()


@pytest.fixture(scope="module")
def http(cluster) -> str:
    return cluster["coordinator"].info["http"]


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def metadata(key: str = KEYS[0]) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def greedy_request(max_tokens: int = 6, **sampling) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(role="user", content="What is the capital of France?")],
        sampling=generate_pb2.SamplingParams(
            max_tokens=max_tokens, **{"temperature": 0.0, **sampling}
        ),
    )


def token_ids(stub, request, key: str = KEYS[0]) -> list[int]:
    return [t for r in stub.Generate(request, metadata=metadata(key)) for t in r.token_ids]


def test_grpc_api_and_reflection_need_a_key_and_health_does_not(cluster):
    with grpc.insecure_channel(cluster["coordinator"].grpc) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for md in ([], [("authorization", "Bearer wrong")], [("authorization", KEYS[0])]):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(greedy_request(), metadata=md))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
        assert token_ids(stub, greedy_request(), KEYS[0]) == token_ids(
            stub, greedy_request(), KEYS[1]
        )
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(reflection.ServerReflectionInfo(iter([ask])))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        [listed] = list(reflection.ServerReflectionInfo(iter([ask]), metadata=metadata()))
        names = {s.name for s in listed.list_services_response.service}
        assert "pdserve.v1.GenerateService" in names


def test_keys_rotate_by_editing_the_file(cluster, http, key_file):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert post(http, "/v1/chat/completions", body, auth(KEYS[1]))[0] == 200
    assert post(http, "/v1/chat/completions", body)[0] == 401
    key_file.write_text(f"{KEYS[0]}\nthird-key\n")  # second-key retired, third-key added
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if post(http, "/v1/chat/completions", body, auth("third-key"))[0] == 200:
                break
            time.sleep(0.3)
        assert post(http, "/v1/chat/completions", body, auth("third-key"))[0] == 200
        assert post(http, "/v1/chat/completions", body, auth(KEYS[1]))[0] == 401
        with grpc.insecure_channel(cluster["coordinator"].grpc) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                token_ids(stub, greedy_request(), KEYS[1])
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert token_ids(stub, greedy_request(2), "third-key")
    finally:
        key_file.write_text(f"{KEYS[0]}\n{KEYS[1]}\n")


def test_an_empty_key_stops_the_coordinator_at_start():
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.services.cli", "coordinator", "--port", "0",
         "--prefill-workers=127.0.0.1:9", "--decode-workers=127.0.0.1:9"],
        env={**os.environ, "PDSERVE_API_KEY": ""}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "empty" in run.stderr and "Traceback" not in run.stderr


BAD_FIELDS = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2**32}, "max_tokens"),
    ({"top_k": 2**31}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop_token_ids": [2**32]}, "stop_token_ids"),
    ({"min_tokens": -3}, "min_tokens"),
    ({"top_logprobs": 2**40, "logprobs": True}, "top_logprobs"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"stop": ["x" * 300]}, "stop"),
    ({"temperature": 1e300}, "temperature"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "\udc00", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "hacker", "content": "hi"}]}, "messages[0].role"),  # OpenAI's 400
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "User", "content": "x"}]},
        "messages[1].role",
    ),
    ({"request_id": "r" * 300}, "request_id"),
]


def test_bad_values_are_400_naming_the_field(cluster, http):
    free = {r: cluster[r].free_blocks() for r in ("prefill", "decode")}
    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key=KEYS[0], max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:  # the issue's own reproducer
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=-1,
        )
    assert err.value.body["param"] == "max_tokens"
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for fields, param in BAD_FIELDS:
        status, _, payload = post(http, "/v1/chat/completions", {**base, **fields}, auth())
        assert status == 400, (fields, payload)
        assert payload["error"]["param"] == param, (fields, payload)
    hi = b'{"messages": [{"role": "user", "content": "Hi"}], '
    for raw, param in ((b'"temperature": NaN}', "temperature"), (b'"top_p": Infinity}', "top_p")):
        status, _, payload = post(http, "/v1/chat/completions", hi + raw, auth())
        assert status == 400 and payload["error"]["param"] == param, payload
    status, _, payload = post(http, "/v1/completions", {"prompt": [1, 2**33]}, auth())
    assert status == 400 and payload["error"]["param"] == "prompt"
    assert post(http, "/v1/chat/completions", base, auth())[0] == 200
    assert wait_idle(cluster, free) == free


def test_grpc_bad_values_are_invalid_argument(cluster):
    with grpc.insecure_channel(cluster["coordinator"].grpc) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for sampling, field in (
            ({"temperature": float("nan")}, "sampling.temperature"),
            ({"temperature": float("inf")}, "sampling.temperature"),
            ({"stop": ["a"] * 17}, "sampling.stop"),
            ({"stop_token_ids": list(range(300))}, "sampling.stop_token_ids"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                token_ids(stub, greedy_request(**sampling))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, sampling
            assert err.value.details().startswith(field), err.value.details()
        request = greedy_request()
        request.messages.add(role="hacker", content="hi")  # not one of OpenAI's roles
        with pytest.raises(grpc.RpcError) as err:
            token_ids(stub, request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("messages[1].role"), err.value.details()


def test_oversized_bodies_and_prompts_are_refused_before_any_work(cluster, http):
    from transformers import AutoTokenizer

    from pdserve.common.model_files import resolve_model

    max_chars = MAX_MODEL_LEN * longest_token_chars(
        AutoTokenizer.from_pretrained(resolve_model(None))
    )
    limit = message_limit(max_chars)
    body = {"prompt": "z" * (limit + 10), "max_tokens": 2}
    status, _, payload = post(http, "/v1/completions", body, auth())
    assert status == 413 and str(limit) in payload["error"]["message"]
    status, _, payload = post(
        http, "/v1/completions", {"prompt": "a " * (max_chars // 2 + 1), "max_tokens": 2}, auth()
    )
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload
    assert "characters" in payload["error"]["message"]
    with grpc.insecure_channel(cluster["coordinator"].grpc) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            token_ids(stub, generate_pb2.GenerateRequest(prompt="q" * (limit + 10)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # over gRPC's limit


def test_a_full_worker_answers_429_with_retry_after(cluster, http):
    free = {r: cluster[r].free_blocks() for r in ("prefill", "decode")}
    refused = cluster["prefill"].metric("pdserve_requests_refused_total", reason="max_pending")
    body = {"prompt": "Tell me a long story about the sea. " * 5, "max_tokens": 2}

    def one(_: int) -> tuple:
        status, headers, payload = post(http, "/v1/completions", body, auth())
        return status, headers.get("Retry-After"), payload

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, results
    assert 200 in statuses and 429 in statuses, statuses
    assert all(int(retry) >= 1 for s, retry, _ in results if s == 429)
    assert cluster["prefill"].metric(
        "pdserve_requests_refused_total", reason="max_pending"
    ) >= refused + statuses.count(429)
    assert wait_idle(cluster, free) == free


def test_a_subnormal_temperature_samples_greedy(cluster):
    with grpc.insecure_channel(cluster["coordinator"].grpc) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        greedy = token_ids(stub, greedy_request(8))
        tiny = token_ids(stub, greedy_request(8, temperature=1e-39, seed=3))
    assert tiny == greedy and 0 not in tiny


def test_leaving_a_local_prefill_at_its_first_message_frees_it(cluster):
    decode = cluster["decode"]
    free = {"decode": decode.free_blocks()}
    with grpc.insecure_channel(decode.grpc) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        call = stub.Decode(
            decode_pb2.DecodeRequest(
                request_id="leaves-early",
                prompt_token_ids=list(range(100, 140)),
                sampling=generate_pb2.SamplingParams(max_tokens=4000, ignore_eos=True),
            )
        )
        first = next(call)
        assert first.pulled_blocks == 0 and not first.token_ids  # the handoff message
        call.cancel()
    # Left running it would take 4000 steps (over a minute here); freed, it is gone at once.
    assert wait_idle({"decode": decode}, free, timeout_s=10) == free
    assert decode.metric("pdserve_num_requests_running") == 0
