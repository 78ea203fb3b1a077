"""The disaggregated path end to end, with real processes: coordinator → prefill → KV over
UCX → decode, on the default model. Greedy outputs must equal the offline engine's; KV must
really move (and move less when decode already caches a prefix); cancellations, expired
leases and dead workers must free every block and end in a clear error, never a hang."""

from __future__ import annotations

import concurrent.futures
import socket
import time

import grpc
import pytest
import torch
from chat_prompts import QUESTIONS

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    kv_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services import running, start

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--kv-cache-tokens", "16384", "--threads", "1"]
MAX_TOKENS = 24


def chat(question: str) -> list[generate_pb2.ChatMessage]:
    return [generate_pb2.ChatMessage(role="user", content=question)]


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def collect(responses) -> dict:
    out = {"token_ids": [], "text": "", "finish_reason": "", "usage": None, "n": 0}
    for r in responses:
        out["n"] += 1
        out["token_ids"] += list(r.token_ids)
        out["text"] += r.text
        if r.finish_reason:
            out["finish_reason"] = r.finish_reason
            out["usage"] = r.usage
    return out


@pytest.fixture(scope="module")
def offline(default_model_dir) -> dict[str, list[int]]:
    """What the offline engine (`pdserve generate`) answers, greedy, for every question."""
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), kv_cache_tokens=16384))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = engine.generate(prompts, params)
    return {q: o.token_ids for q, o in zip(QUESTIONS, outs, strict=True)}


@pytest.fixture(scope="module")
def cluster():
    prefill = start("prefill", *WORKER_ARGS, "--kv-lease", "4")
    # No TPOT target on decode: this module checks what the path computes, and on a slow
    # host (float32, one thread, AVX2) the 50 ms default keeps some of 32 concurrent streams
    # waiting for a batch slot past the 4 s lease (RESOURCE_EXHAUSTED, by design: the
    # admission controller's behaviour is tests/unit/test_latency_targets.py's).
    decode = start("decode", *WORKER_ARGS, "--tpot-target-ms", "0")
    coordinator = start(
        "coordinator", "--prefill-workers", prefill.grpc, "--decode-workers", decode.grpc
    )
    channel = grpc.insecure_channel(coordinator.grpc)
    try:
        yield {
            "prefill": prefill,
            "decode": decode,
            "coordinator": coordinator,
            "stub": generate_pb2_grpc.GenerateServiceStub(channel),
            "prefill_stub": prefill_pb2_grpc.PrefillServiceStub(
                grpc.insecure_channel(prefill.grpc)
            ),
            "decode_stub": decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(decode.grpc)),
        }
    finally:
        channel.close()
        for service in (coordinator, decode, prefill):
            service.stop()


def wait_free(service, expected: int, timeout_s: float = 15.0) -> int:
    """Free blocks return to `expected` (frees happen just after a stream ends)."""
    deadline = time.monotonic() + timeout_s
    while (free := service.free_blocks()) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def test_greedy_matches_offline_engine(cluster, offline):
    for q in QUESTIONS:
        out = collect(cluster["stub"].Generate(generate_pb2.GenerateRequest(
            messages=chat(q), sampling=greedy())))  # fmt: skip
        assert out["token_ids"] == offline[q], q
        assert out["usage"].completion_tokens == len(offline[q])
        assert out["n"] >= 2  # the first token arrives alone, before decode's stream


def test_32_concurrent_streams_match(cluster, offline):
    free = {r: cluster[r].free_blocks() for r in ("prefill", "decode")}
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(32)]

    def one(q: str) -> list[int]:
        return collect(cluster["stub"].Generate(generate_pb2.GenerateRequest(
            messages=chat(q), sampling=greedy())))["token_ids"]  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, questions))
    for q, got in zip(questions, results, strict=True):
        assert got == offline[q], q
    for role, before in free.items():
        assert wait_free(cluster[role], before) == before, role


def test_kv_really_moves_and_decode_reuses_its_prefix(cluster, default_model_dir):
    decode = cluster["decode"]
    stub = cluster["stub"]
    elem = torch.empty((), dtype=EngineConfig().torch_dtype).element_size()  # as the workers
    block_bytes = 30 * 2 * 16 * 3 * 64 * elem  # SmolLM2: layers, K+V, block, kv heads, dim
    story = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))

    def run(prompt: str) -> tuple[dict, float, float]:
        blocks0 = decode.metric("pdserve_kv_transfer_blocks_total", direction="receive")
        bytes0 = decode.metric("pdserve_kv_transfer_bytes_total", direction="receive")
        out = collect(stub.Generate(generate_pb2.GenerateRequest(
            prompt=prompt, sampling=greedy(8))))  # fmt: skip
        blocks = decode.metric("pdserve_kv_transfer_blocks_total", direction="receive") - blocks0
        nbytes = decode.metric("pdserve_kv_transfer_bytes_total", direction="receive") - bytes0
        return out, blocks, nbytes

    first, blocks1, bytes1 = run(story + " The end.")
    prompt_tokens = first["usage"].prompt_tokens
    assert blocks1 == -(-prompt_tokens // 16)  # every block of the prompt was pulled
    assert bytes1 == blocks1 * block_bytes
    second_prompt = story + " And then?"
    second, blocks2, bytes2 = run(second_prompt)
    assert 0 < blocks2 < blocks1 / 4  # the shared story came from decode's own cache
    assert bytes2 == blocks2 * block_bytes
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), kv_cache_tokens=4096))
    expected = engine.generate([second_prompt], SamplingParams(max_tokens=8, temperature=0))
    assert second["token_ids"] == expected[0].token_ids


def test_cancel_mid_decode_frees_blocks_on_both_workers(cluster):
    free = {r: cluster[r].free_blocks() for r in ("prefill", "decode")}
    call = cluster["stub"].Generate(generate_pb2.GenerateRequest(
        messages=chat("Tell me a long story."), sampling=greedy(400, ignore_eos=True)))  # fmt: skip
    for got, _ in enumerate(call, 1):
        if got == 4:
            call.cancel()
            break
    for role, before in free.items():
        assert wait_free(cluster[role], before) == before, role
    # and the workers keep serving
    out = collect(cluster["stub"].Generate(generate_pb2.GenerateRequest(
        prompt="Hello", sampling=greedy(3))))  # fmt: skip
    assert out["finish_reason"] == "length"


def test_cancel_mid_prefill_frees_blocks(cluster):
    free = {r: cluster[r].free_blocks() for r in ("prefill", "decode")}
    long_prompt = list(range(1000, 1600))  # seconds of prefill on one core
    call = cluster["stub"].Generate(
        generate_pb2.GenerateRequest(token_ids=long_prompt, sampling=greedy(50))
    )
    prefill = cluster["prefill"]
    bound = time.monotonic() + 60  # a poll that cannot hang the suite
    while prefill.metric("pdserve_num_requests_running") < 1:  # the prefill has started
        assert time.monotonic() < bound, "the prompt never reached the prefill worker"
        time.sleep(0.01)
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        collect(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    for role, before in free.items():
        assert wait_free(cluster[role], before) == before, role


def test_unpulled_lease_expires_and_frees_blocks(cluster):
    prefill = cluster["prefill"]
    before = prefill.free_blocks()
    reply = cluster["prefill_stub"].Prefill(prefill_pb2.PrefillRequest(
        request_id="lease-test", prompt_token_ids=list(range(500, 600)),
        sampling=greedy(10)))  # fmt: skip
    assert reply.kv_handle.lease_id and len(reply.kv_handle.block_ids) == 7
    assert prefill.free_blocks() <= before - 7  # held under the lease
    assert wait_free(prefill, before, timeout_s=20) == before  # --kv-lease 4


def test_malformed_kv_handle_is_refused(cluster):
    decode = cluster["decode"]
    before = decode.free_blocks()
    good = dict(
        worker_id="p", grpc_address=cluster["prefill"].grpc, transport="ucx",
        transport_address=b"x", lease_id="l", block_ids=[1, 2], num_tokens=20, block_size=16,
        layout_fingerprint=_fingerprint(cluster),
    )  # fmt: skip
    cases = {
        "kv_handle.layout_fingerprint": dict(layout_fingerprint="other-model"),
        "kv_handle.block_ids": dict(block_ids=[1]),
        "kv_handle.lease_id": dict(lease_id=""),
        "kv_handle.num_tokens": dict(num_tokens=21),
        "kv_handle.block_size": dict(block_size=8),
        # A tensor-parallel prefill group must name its other ranks' transport addresses,
        "kv_handle.rank_transport_addresses": dict(tensor_parallel=2),
        # and be a size the model's 3 KV heads split into.
        "kv_handle.tensor_parallel": dict(tensor_parallel=4, rank_transport_addresses=[b"x"] * 3),
    }
    for field_name, change in cases.items():
        request = decode_pb2.DecodeRequest(
            request_id=f"bad-{field_name}", prompt_token_ids=list(range(20)), first_token_id=5,
            sampling=greedy(), kv_handle=kv_pb2.KvHandle(**{**good, **change}),
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            list(cluster["decode_stub"].Decode(request, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field_name)
    # A handle that passes, and a first token the engine refuses (past the vocabulary).
    request = decode_pb2.DecodeRequest(
        request_id="bad-first-token", prompt_token_ids=list(range(20)), first_token_id=49152,
        sampling=greedy(), kv_handle=kv_pb2.KvHandle(**good),
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as err:
        list(cluster["decode_stub"].Decode(request, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("first_token_id"), err.value.details()
    assert decode.free_blocks() == before


def _fingerprint(cluster) -> str:
    reply = cluster["prefill_stub"].Prefill(prefill_pb2.PrefillRequest(
        request_id="fp", prompt_token_ids=[1, 2, 3], sampling=greedy()))  # fmt: skip
    cluster["prefill_stub"].ReleaseKv(
        prefill_pb2.ReleaseKvRequest(lease_id=reply.kv_handle.lease_id)
    )
    return reply.kv_handle.layout_fingerprint


@pytest.mark.parametrize(
    ("request_kwargs", "field_name"),
    [
        (dict(), "prompt"),
        (dict(prompt="hi", token_ids=[1, 2]), "prompt"),
        (dict(token_ids=[1, 49152]), "token_ids"),
        (dict(token_ids=[7] * 9000), "token_ids"),
        (dict(prompt="hi", sampling=generate_pb2.SamplingParams(top_p=2)), "sampling.top_p"),
        (dict(prompt="hi", sampling=generate_pb2.SamplingParams(max_tokens=0)),
         "sampling.max_tokens"),
        (dict(prompt="hi", sampling=generate_pb2.SamplingParams(temperature=-1)),
         "sampling.temperature"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(cluster, request_kwargs, field_name):
    with pytest.raises(grpc.RpcError) as err:
        collect(cluster["stub"].Generate(generate_pb2.GenerateRequest(**request_kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field_name)


def test_killed_prefill_worker_gives_a_clear_error(cluster):
    """A prefill worker that dies after handing out a KV handle: the pull fails with
    UNAVAILABLE naming it, and decode frees its blocks (through the coordinator the stream
    goes on elsewhere: the fault matrix's prefill cells)."""
    decode = cluster["decode"]
    before = decode.free_blocks()
    with running("prefill", *WORKER_ARGS) as doomed:
        # Named to decode as its coordinator would (decode pulls only from workers it knows).
        cluster["decode_stub"].SetPrefillWorkers(decode_pb2.SetPrefillWorkersRequest(
            coordinator_id="test-doomed", addresses=[doomed.grpc]))  # fmt: skip
        stub = prefill_pb2_grpc.PrefillServiceStub(grpc.insecure_channel(doomed.grpc))
        prompt = list(range(2000, 2300))
        reply = stub.Prefill(prefill_pb2.PrefillRequest(
            request_id="doomed", prompt_token_ids=prompt, sampling=greedy()))  # fmt: skip
        doomed.kill()
        with pytest.raises(grpc.RpcError) as err:
            list(cluster["decode_stub"].Decode(decode_pb2.DecodeRequest(
                request_id="orphan", prompt_token_ids=prompt,
                first_token_id=reply.first_token_id, sampling=greedy(),
                kv_handle=reply.kv_handle), timeout=60))  # fmt: skip
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert doomed.grpc in err.value.details()
    assert wait_free(decode, before) == before


def test_a_kv_handle_naming_an_unknown_address_is_refused_without_connecting(cluster):
    """A decode worker dials only prefill workers it knows: a handle naming anything else
    gets PERMISSION_DENIED, no connection reaches that address, and no block is held."""
    decode = cluster["decode"]
    before = decode.free_blocks()
    refused_before = decode.metric(
        "pdserve_requests_refused_total", reason="unknown_prefill_worker"
    )
    prompt = list(range(3000, 3040))
    reply = cluster["prefill_stub"].Prefill(
        prefill_pb2.PrefillRequest(request_id="forged", prompt_token_ids=prompt, sampling=greedy())
    )
    with socket.create_server(("127.0.0.1", 0)) as trap:
        trap.settimeout(1.0)
        forged = kv_pb2.KvHandle()
        forged.CopyFrom(reply.kv_handle)
        forged.grpc_address = f"127.0.0.1:{trap.getsockname()[1]}"
        with pytest.raises(grpc.RpcError) as err:
            list(cluster["decode_stub"].Decode(decode_pb2.DecodeRequest(
                request_id="forged", prompt_token_ids=prompt,
                first_token_id=reply.first_token_id, sampling=greedy(),
                kv_handle=forged), timeout=30))  # fmt: skip
        with pytest.raises(TimeoutError):
            trap.accept()  # nothing ever dialled the named address
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "kv_handle.grpc_address" in err.value.details()
    assert (
        decode.metric("pdserve_requests_refused_total", reason="unknown_prefill_worker")
        == refused_before + 1
    )
    assert wait_free(decode, before) == before
    cluster["prefill_stub"].ReleaseKv(
        prefill_pb2.ReleaseKvRequest(lease_id=reply.kv_handle.lease_id)
    )


@pytest.mark.parametrize("host", ["localhost", "0.0.0.0"])
def test_a_prefill_worker_dialled_under_another_spelling_still_hands_off(cluster, offline, host):
    """The coordinator dials the prefill worker as `localhost:PORT` (or `0.0.0.0:PORT`, as
    `serve --host 0.0.0.0` names it) while the worker advertises `127.0.0.1:PORT` in its KV
    handles: a fresh decode worker, told the pool by that coordinator alone, takes the
    handles (the coordinator names the advertised address it learned from the status
    stream; a host name also stands for what it resolves to), and the answer is the offline
    engine's. A forged address is still refused."""
    prefill = cluster["prefill"]
    port = prefill.grpc.rsplit(":", 1)[1]
    assert prefill.grpc == f"127.0.0.1:{port}"  # what its handles carry
    with (
        running("decode", *WORKER_ARGS) as decode,
        running(
            "coordinator", "--prefill-workers", f"{host}:{port}", "--decode-workers", decode.grpc
        ) as coordinator,
    ):
        before = decode.free_blocks()
        with grpc.insecure_channel(coordinator.grpc) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            q = QUESTIONS[0]
            out = collect(stub.Generate(generate_pb2.GenerateRequest(
                messages=chat(q), sampling=greedy()), timeout=120))  # fmt: skip
        assert out["token_ids"] == offline[q]
        assert decode.metric("pdserve_kv_transfer_blocks_total", direction="receive") > 0
        assert decode.metric("pdserve_requests_refused_total", reason="unknown_prefill_worker") == 0
        with grpc.insecure_channel(decode.grpc) as channel:  # the door stays shut to others
            forged = kv_pb2.KvHandle(
                lease_id="x", grpc_address=f"127.0.0.1:{int(port) + 1}",
                transport_address=b"x", transport="ucx",
            )  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                list(decode_pb2_grpc.DecodeServiceStub(channel).Decode(decode_pb2.DecodeRequest(
                    request_id="forged", prompt_token_ids=[1, 2], sampling=greedy(),
                    kv_handle=forged), timeout=30))  # fmt: skip
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert wait_free(decode, before) == before


def test_two_clients_may_use_the_same_request_id(cluster, offline):
    q = QUESTIONS[0]

    def one(_: int) -> dict:
        return collect(cluster["stub"].Generate(generate_pb2.GenerateRequest(
            messages=chat(q), request_id="same", sampling=greedy())))  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(one, range(2)))
    assert [o["token_ids"] for o in outs] == [offline[q]] * 2
    responses = list(cluster["stub"].Generate(generate_pb2.GenerateRequest(
        prompt="Hi", request_id="mine", sampling=greedy(3))))  # fmt: skip
    assert {r.request_id for r in responses} == {"mine"}


def test_prefill_worker_refuses_bad_calls(cluster):
    stub = cluster["prefill_stub"]
    # A well-formed UCX address (the prefill worker's own, from a handle): the lease is
    # then what is wrong. A malformed one is refused first, before any lease is looked up.
    real = stub.Prefill(prefill_pb2.PrefillRequest(
        request_id="addr", prompt_token_ids=[5, 6, 7], sampling=greedy()))  # fmt: skip
    address = real.kv_handle.transport_address
    stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(lease_id=real.kv_handle.lease_id))
    before = cluster["prefill"].free_blocks()
    cases = [
        (stub.Prefill, prefill_pb2.PrefillRequest(prompt_token_ids=[1]), "request_id"),
        (stub.Prefill, prefill_pb2.PrefillRequest(request_id="e"), "prompt_token_ids"),
        (stub.Prefill, prefill_pb2.PrefillRequest(request_id="v", prompt_token_ids=[10**6]),
         "token_ids"),
        (stub.TransferKv, prefill_pb2.TransferKvRequest(lease_id="nope", receiver_address=address),
         "lease_id"),
        (stub.TransferKv, prefill_pb2.TransferKvRequest(lease_id="nope", receiver_address=b"x"),
         "receiver_address"),
        (stub.TransferKv, prefill_pb2.TransferKvRequest(lease_id="nope"), "receiver_address"),
    ]  # fmt: skip
    for method, request, field_name in cases:
        with pytest.raises(grpc.RpcError) as err:
            method(request, timeout=10)
        assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        assert err.value.details().startswith(field_name), err.value.details()
    assert not stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(lease_id="nope")).released
    assert cluster["prefill"].free_blocks() == before


def test_coordinator_records_latency_and_outcomes(cluster):
    coordinator = cluster["coordinator"]

    def count(name: str, **labels: str) -> float:
        return coordinator.metric(name, role="coordinator", **labels)

    before = {
        "ttft": count("pdserve_time_to_first_token_seconds_count"),
        "tpot": count("pdserve_request_time_per_output_token_seconds_count"),
        "itl": count("pdserve_inter_token_latency_seconds_count"),
        "length": count("pdserve_request_success_total", finished_reason="length"),
        "invalid": count("pdserve_request_failure_total", cause="invalid_argument"),
        "generated": count("pdserve_generation_tokens_total"),
        "handoff": count("pdserve_kv_handoff_seconds_count"),
    }
    phases = {
        (role, name): cluster[role].metric(f"pdserve_request_{name}_time_seconds_count")
        for role, name in [("prefill", "queue"), ("prefill", "prefill"),
                           ("decode", "queue"), ("decode", "decode")]
    }  # fmt: skip
    collect(cluster["stub"].Generate(generate_pb2.GenerateRequest(
        prompt="Count to ten:", sampling=greedy(6, ignore_eos=True))))  # fmt: skip
    with pytest.raises(grpc.RpcError):
        collect(cluster["stub"].Generate(generate_pb2.GenerateRequest()))
    assert count("pdserve_time_to_first_token_seconds_count") == before["ttft"] + 1
    assert count("pdserve_request_time_per_output_token_seconds_count") == before["tpot"] + 1
    assert count("pdserve_inter_token_latency_seconds_count") == before["itl"] + 5
    assert count("pdserve_request_success_total", finished_reason="length") == (
        before["length"] + 1
    )
    assert count("pdserve_request_failure_total", cause="invalid_argument") == (
        before["invalid"] + 1
    )
    assert count("pdserve_generation_tokens_total") == before["generated"] + 6
    assert count("pdserve_kv_handoff_seconds_count") == before["handoff"] + 1
    for (role, name), n in phases.items():  # each worker's phases, once for the good request
        deadline = time.monotonic() + 10  # recorded just after the last token leaves
        while (got := cluster[role].metric(f"pdserve_request_{name}_time_seconds_count")) < n + 1:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert got == n + 1, (role, name)
