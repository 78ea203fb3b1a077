"""Hosts whose wall clocks disagree by hours: 1 prefill + 1 decode behind a coordinator, the
decode worker's process running three hours ahead (libfaketime preloaded into it, its
monotonic clock left alone). The KV lease crosses hosts as the time it has left, counted on
each host's monotonic clock, so the skew changes nothing: every stream gives the offline
engine's greedy tokens, handoffs that wait for decode's KV blocks wait there instead of
being refused (no handoff retried), and every lease and block is given back.

Were decode to read the prefill host's wall-clock expiry against its own clock, every lease
would look three hours gone on arrival, and a handoff that had to wait for blocks would be
refused at once."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import libfaketime
import pytest
from chat_prompts import QUESTIONS

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import running

pytestmark = pytest.mark.slow

SKEW_S = 3 * 3600
MAX_TOKENS = 24
STREAMS = 8
# Room for a few streams at once on decode: the rest wait there for blocks.
DECODE_KV_TOKENS = 256
BLOCK = 16  # tokens per KV block, the default


def skewed_env() -> dict[str, str]:
    """The environment that runs a process with its wall clock `SKEW_S` ahead."""
    _, env = libfaketime.get_reload_information()
    return {**env, "FAKETIME": f"+{SKEW_S // 3600}h", "DONT_FAKE_MONOTONIC": "1"}


def mapped_libraries(pid: int) -> set[str]:
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in lines if "/" in line}


@pytest.fixture(scope="module")
def offline(default_model_dir) -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig(model=str(default_model_dir), kv_cache_tokens=8192))
    outs = engine.generate(
        [[{"role": "user", "content": q}] for q in QUESTIONS],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
    )
    return {q: o.token_ids for q, o in zip(QUESTIONS, outs, strict=True)}


def test_the_preload_skews_the_wall_clock_and_not_the_monotonic_one():
    probe = "import time; print(time.time(), time.monotonic())"
    env = {**os.environ, **skewed_env()}
    before = time.time()
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    wall, monotonic = map(float, out.stdout.split())
    assert wall - before == pytest.approx(SKEW_S, abs=60)
    assert monotonic == pytest.approx(time.monotonic(), abs=60)


def test_a_decode_worker_hours_ahead_serves_and_frees_everything(offline):
    with (
        running("prefill", "--kv-cache-tokens", "8192", "--threads", "1") as prefill,
        running(
            "decode", "--kv-cache-tokens", str(DECODE_KV_TOKENS), "--threads", "1",
            "--tpot-target-ms", "0", env=skewed_env(),
        ) as decode,
        running(
            "coordinator", "--prefill-workers", prefill.grpc, "--decode-workers", decode.grpc
        ) as coordinator,
    ):  # fmt: skip
        assert "libfaketime.so.1" in mapped_libraries(decode.proc.pid)  # the skew is in it
        total = int(decode.metric("pdserve_kv_cache_num_blocks"))
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(STREAMS)]

        def one(question: str) -> tuple[list[int], generate_pb2.Usage]:
            with grpc.insecure_channel(coordinator.grpc) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                request = generate_pb2.GenerateRequest(
                    messages=[generate_pb2.ChatMessage(role="user", content=question)],
                    sampling=generate_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                )
                responses = list(stub.Generate(request))
                return [t for r in responses for t in r.token_ids], responses[-1].usage

        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
            outs = list(pool.map(one, questions))
        needed = sum(-(-(u.prompt_tokens + u.completion_tokens) // BLOCK) for _, u in outs)
        assert needed > total, "precondition: the streams did not outgrow decode's KV cache"
        for q, (tokens, _) in zip(questions, outs, strict=True):
            assert tokens == offline[q], q
        assert coordinator.metric("pdserve_kv_handoff_retries_total") == 0
        assert decode.metric("pdserve_requests_refused_total") == 0
        assert coordinator.metric("pdserve_request_failure_total") == 0
        assert prefill.metric("pdserve_kv_transfer_blocks_total") > 0  # KV really moved
        for service in (prefill, decode):
            free, blocks = service.blocks_once_idle()
            assert free == blocks, service.role
        assert prefill.metric("pdserve_kv_leases_held") == 0
