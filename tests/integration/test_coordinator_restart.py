"""A coordinator killed mid-stream and started again (real processes: 2 prefill + 1 decode
workers, the default model). Every in-flight client gets a clear `UNAVAILABLE`, never a
hang; the workers, whose caller is gone, free every KV block and lease on their own; a fresh
coordinator rebuilds its view of the workers from their status reports, serves the same
greedy tokens as before, and routes a conversation back to the prefill worker that caches its
prefix (its cache hit shows in the usage)."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
from chat_prompts import QUESTIONS

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import start

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--kv-cache-tokens", "8192", "--threads", "1"]
STREAMS = 6


def _request(question: str, max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(role="user", content=question)],
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


def _generate(address: str, request: generate_pb2.GenerateRequest):
    """(token ids, usage) of one stream, or the gRPC status code it ended with."""
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        try:
            responses = list(stub.Generate(request))
        except grpc.RpcError as e:
            return e.code()
        return [t for r in responses for t in r.token_ids], responses[-1].usage


def _idle(worker) -> bool:
    return (
        worker.free_blocks() == int(worker.metric("pdserve_kv_cache_num_blocks"))
        and worker.metric("pdserve_kv_leases_held") == 0
        and worker.metric("pdserve_num_requests_running") == 0
    )


def _poll(condition, what: str, bound_s: float = 120.0) -> None:
    """Poll `condition` (a bounded loop: a test never hangs); fail naming `what`."""
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def workers():
    services = {}
    try:
        for name in ("p0", "p1", "d0"):
            services[name] = start("prefill" if name[0] == "p" else "decode", *WORKER_ARGS)
        yield services
    finally:
        for service in services.values():
            service.stop()


def _coordinator(workers):
    return start(
        "coordinator",
        f"--prefill-workers={workers['p0'].grpc},{workers['p1'].grpc}",
        f"--decode-workers={workers['d0'].grpc}",
    )


def test_killed_coordinator_gives_unavailable_and_workers_free_everything(workers):
    first = _coordinator(workers)
    conversation = _request(QUESTIONS[0], 8)
    reference, usage = _generate(first.grpc, conversation)
    assert usage.cached_tokens == 0

    # Which prefill worker caches the conversation now (its prefix-cache queries went up).
    def queries(p: str) -> float:
        return workers[p].metric("pdserve_prefix_cache_queries_total")

    _poll(lambda: queries("p0") + queries("p1") > 0, "the prefill worker counts the prompt")
    cached_on = max(("p0", "p1"), key=queries)
    try:
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
            futures = [
                pool.submit(_generate, first.grpc, _request(QUESTIONS[i % len(QUESTIONS)], 400))
                for i in range(STREAMS)
            ]
            # The fault hits the phase it names: streams decoding on the decode worker.
            _poll(lambda: workers["d0"].metric("pdserve_num_requests_running") >= 2,
                  "two streams decoding")  # fmt: skip
            first.kill()
            codes = [f.result() for f in futures]
    finally:
        first.kill()
    assert codes == [grpc.StatusCode.UNAVAILABLE] * STREAMS
    for name, worker in workers.items():
        _poll(lambda w=worker: _idle(w), f"{name} frees every block and lease")

    second = _coordinator(workers)
    try:
        # The same greedy tokens, and the conversation's next turn goes to the prefill
        # worker that caches its prefix (the fresh coordinator learnt it from the workers).
        def hits() -> float:
            return workers[cached_on].metric("pdserve_prefix_cache_hits_total")

        hits_before = hits()
        again, usage = _generate(second.grpc, conversation)
        assert again == reference
        assert usage.cached_tokens > 0
        _poll(lambda: hits() > hits_before, f"the hit on {cached_on}, which caches the prompt")
    finally:
        second.stop()
    for name, worker in workers.items():
        _poll(lambda w=worker: _idle(w), f"{name} idle at the end")
