"""The TTFT target's admission on real processes: a prefill worker with `--ttft-target-ms`
serves while its step costs are unmeasured, then refuses a prompt whose first token it
predicts past the target before the prompt holds anything; the coordinator answers 429
with the worker's `Retry-After` over HTTP and RESOURCE_EXHAUSTED with a `retry-after`
trailer over gRPC, and every KV block stays free. (Which prompts fit a target is the unit
tests' part, from known step costs: here the target is 1 ms, which no prompt meets.)"""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import post, running, wait_idle

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--threads", "1", "--kv-cache-tokens", "4096"]
BODY = {"prompt": "Name three rivers in Europe.", "max_tokens": 2}
MAX_REQUESTS = 30  # the step-cost model is fitted after 8 steps: this bounds the loop


def test_a_worker_past_its_ttft_target_refuses_with_retry_after():
    with (
        running("prefill", *WORKER_ARGS, "--ttft-target-ms", "1") as prefill,
        running("decode", *WORKER_ARGS) as decode,
        running(
            "coordinator",
            f"--prefill-workers={prefill.grpc}",
            f"--decode-workers={decode.grpc}",
            "--http-port=0",
            "--no-log-requests",
        ) as coordinator,
    ):
        workers = {"prefill": prefill, "decode": decode}
        free = {role: w.free_blocks() for role, w in workers.items()}
        http = coordinator.info["http"]
        served = 0
        for _ in range(MAX_REQUESTS):
            status, headers, body = post(http, "/v1/completions", BODY)
            if status != 200:
                break
            served += 1
        # Served until the costs were measured (its first prompts are never refused) ...
        assert 4 <= served < MAX_REQUESTS, (served, status, body)
        # ... then refused early, with the worker's hint of when to come back.
        assert status == 429, (status, body)
        assert int(headers["Retry-After"]) >= 1
        assert "--ttft-target-ms 1" in body["error"]["message"], body
        assert prefill.metric("pdserve_requests_refused_total", reason="ttft_target") >= 1

        with grpc.insecure_channel(coordinator.grpc) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            request = generate_pb2.GenerateRequest(
                prompt=BODY["prompt"], sampling=generate_pb2.SamplingParams(max_tokens=2)
            )
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailer = dict(refused.value.trailing_metadata() or ())
        assert int(trailer["retry-after"]) >= 1, trailer

        assert wait_idle(workers, free) == free
        for service in (prefill, decode, coordinator):
            assert service.proc.poll() is None
