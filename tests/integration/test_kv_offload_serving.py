"""The disk tier on a real colocated worker (the default model): with a pool too small for
four conversations, greedy tokens equal a worker whose pool holds everything, the repeats are
served from disk (its counters say so), no block leaks, the metrics pass promtool, and a
worker started again on the same folder finds the blocks its predecessor wrote."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from promql import run_promtool

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import RunningService, running

pytestmark = pytest.mark.slow

ARGS = ["--threads", "1", "--max-num-seqs", "1"]
# Four conversations with their own 96-token history (6 blocks), each asked twice: a pool of
# 16 blocks holds about two of them, so the second round finds the others only on disk.
HISTORIES = [list(range(2000 + 300 * c, 2096 + 300 * c)) for c in range(4)]
ROUNDS = [[[*h, 30, 31 + r, 32] for h in HISTORIES] for r in range(2)]


def _generate(address: str, token_ids: list[int]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            token_ids=token_ids,
            sampling=generate_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        )
        return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]


def _run(service: RunningService, rounds=ROUNDS) -> list[list[int]]:
    return [_generate(service.grpc, prompt) for prompts in rounds for prompt in prompts]


def _settled(service: RunningService, name: str, at_least: float) -> float:
    deadline = time.monotonic() + 10  # counters trail the engine by a step
    while (value := service.metric(name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_disk_tier_serves_repeats_with_the_same_tokens(tmp_path):
    with running("colocated", *ARGS, "--kv-cache-tokens", "4096") as unbounded:
        expected = _run(unbounded)
    tier_args = [*ARGS, "--kv-cache-tokens", "256", "--kv-offload-dir", str(tmp_path)]
    with running("colocated", *tier_args) as worker:
        all_free = worker.free_blocks()
        assert _run(worker) == expected
        assert _settled(worker, "pdserve_kv_offload_hits_total", 1) > 0
        assert worker.metric("pdserve_kv_offload_stores_total") > 0
        assert worker.metric("pdserve_kv_offload_corrupt_total") == 0
        assert worker.free_blocks() == all_free
        with urllib.request.urlopen(worker.metrics_url, timeout=10) as response:
            exposition = response.read().decode()
        result = run_promtool("check", "metrics", stdin=exposition)
        assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
            result.stdout + result.stderr
        )
    # SIGTERM finished the pending writes; a new worker indexes them at start.
    with running("colocated", *tier_args) as again:
        assert again.metric("pdserve_kv_offload_blocks") > 0
        assert _run(again, ROUNDS[:1]) == expected[: len(HISTORIES)]
        assert _settled(again, "pdserve_kv_offload_hits_total", 1) > 0
        assert again.free_blocks() == again.metric("pdserve_kv_cache_num_blocks")
