"""Decode saturation on real processes: a decode worker with one batch slot and
`--handoff-wait-ms` reports itself saturated once handoffs queue behind its running stream
and it knows the rate its line moves at (two handoffs having got the slot in this busy
spell); until then a line alone refuses no one. The coordinator refuses new requests at
arrival while it is saturated (RESOURCE_EXHAUSTED with a retry hint); once the line has
drained, it takes them again and no block is left held. The unit twins:
tests/unit/test_leases_and_admission.py (the prediction) and
tests/unit/test_coordinator_inflight.py (the refusal)."""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import running, wait_idle

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--kv-cache-tokens", "8192", "--threads", "1"]


def request(prompt: str, max_tokens: int) -> generate_pb2.GenerateRequest:
    sampling = generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return generate_pb2.GenerateRequest(prompt=prompt, sampling=sampling)


def probe(stub) -> grpc.RpcError | None:
    """A one-token request (its first token ends it: no handoff, so it queues nowhere): None
    when served, else the error."""
    try:
        for _ in stub.Generate(request("Hi", 1), timeout=60):
            pass
    except grpc.RpcError as e:
        return e
    return None


def until(condition, timeout_s: float = 20.0):
    """Poll `condition()` until it returns something truthy; that value, else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    return None


def test_a_saturated_decode_worker_turns_new_requests_away():
    decode_args = ["--max-num-seqs", "1", "--tpot-target-ms", "0", "--handoff-wait-ms", "1"]
    with (
        running("prefill", *WORKER_ARGS) as prefill,
        running("decode", *WORKER_ARGS, *decode_args) as decode,
        running(
            "coordinator", f"--prefill-workers={prefill.grpc}", f"--decode-workers={decode.grpc}"
        ) as coordinator,
    ):
        workers = {"prefill": prefill, "decode": decode}
        free = {role: w.free_blocks() for role, w in workers.items()}
        channel = grpc.insecure_channel(coordinator.grpc)
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        line = 0

        def joins_the_line(prompt: str, max_tokens: int):
            nonlocal line
            stream = stub.Generate(request(prompt, max_tokens))
            assert len(next(stream).token_ids) == 1  # prefill's first token
            line += 1  # its handoff waits for the slot, behind the ones before it
            assert until(lambda: decode.metric("pdserve_num_requests_waiting") == line)
            return stream

        first = stub.Generate(request("Tell me a long story.", 4000))
        assert len(next(first).token_ids) == 1 and len(next(first).token_ids) >= 1  # decoding
        short = joins_the_line("Hello", 4)
        long = joins_the_line("Tell me another long story.", 4000)
        assert probe(stub) is None  # a line, but no rate known yet: nobody refused
        queued = joins_the_line("Hello there", 4)
        first.cancel()  # the short one gets the slot, leaves, and the long one gets it
        assert sum(len(r.token_ids) for r in short) == 3
        refused = until(lambda: probe(stub))
        assert refused is not None, "the coordinator never refused while decode was saturated"
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
        assert "saturated" in refused.details()
        assert ("retry-after", "1") in tuple(refused.trailing_metadata() or ())
        long.cancel()  # the slot frees: the queued handoff runs, the line is empty again
        assert sum(len(r.token_ids) for r in queued) == 3
        assert until(lambda: probe(stub) is None), "still refused once decode had drained"
        channel.close()
        assert wait_idle(workers, free) == free
