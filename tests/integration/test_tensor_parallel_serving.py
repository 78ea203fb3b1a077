"""Disaggregated serving between tensor-parallel groups of different sizes, real processes
(gloo within a group, UCX between groups): every decode rank pulls exactly its KV heads'
slices from the prefill ranks that hold them.

- Greedy ids for P TP 2 -> D TP 1, P TP 1 -> D TP 2 and P TP 2 -> D TP 2 equal transformers'
  in float32; in bfloat16, P 2 -> D 2 equals the offline engine at TP 2 (every number is
  computed at the same TP); every KV block of both groups is free afterwards.
- SIGKILL of rank 1 of a decode group mid-stream takes the group down and its streams go
  on on another decode worker, every token equal to transformers' (float32)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from chat_prompts import QUESTIONS
from oracle import engine, load_reference, reference_greedy

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import start

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
WORKER = ["--threads", "1", "--kv-cache-tokens", "4096"]


def stream(address: str, question: str, max_tokens: int = NEW_TOKENS) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(role="user", content=question)],
            sampling=generate_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True
            ),
        )
        return [t for r in stub.Generate(request, timeout=300) for t in r.token_ids]


@pytest.fixture(scope="module")
def reference(default_model_dir) -> dict[str, list[int]]:
    """transformers' float32 greedy ids for every question (40 tokens; shorter runs compare
    a prefix)."""
    eng = engine(default_model_dir, kv_cache_tokens=64)
    model = load_reference(default_model_dir)
    return {
        q: reference_greedy(model, eng.tokenize([{"role": "user", "content": q}]), 40, None)
        for q in QUESTIONS
    }


def serve_pair(prefill_tp: int, decode_tp: int, *extra: str) -> list:
    started = []
    try:
        for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            started.append(start(role, *WORKER, "--tensor-parallel", str(tp), *extra))
        prefill, decode = started
        started.append(start("coordinator", f"--prefill-workers={prefill.grpc}",
                             f"--decode-workers={decode.grpc}"))  # fmt: skip
    except BaseException:
        for service in reversed(started):
            service.stop()
        raise
    return started


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_float32_greedy_ids_equal_transformers(reference, prefill_tp, decode_tp):
    started = serve_pair(prefill_tp, decode_tp, "--dtype", "float32")
    prefill, decode, coordinator = started
    try:
        for q in QUESTIONS[:4]:
            assert stream(coordinator.grpc, q) == reference[q][:NEW_TOKENS], q
        for worker in (prefill, decode):
            free, total = worker.blocks_once_idle()
            assert free == total
        pulled = decode.metric("pdserve_kv_transfer_bytes_total", direction="receive")
        assert pulled > 0  # the blocks came over the transport, not recomputed
    finally:
        for service in reversed(started):
            service.stop()


def test_bf16_p2_d2_equals_the_offline_engine_at_tp2(tmp_path):
    lines = [{"messages": [{"role": "user", "content": q}], "max_tokens": NEW_TOKENS,
              "ignore_eos": True} for q in QUESTIONS]  # fmt: skip
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.services.cli", "generate", "--input", str(src),
         "--output", str(dst), "--no-progress", "--threads", "1", "--tensor-parallel", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    offline = [json.loads(line)["token_ids"] for line in dst.read_text().splitlines()]
    started = serve_pair(2, 2)
    try:
        assert [stream(started[2].grpc, q) for q in QUESTIONS] == offline
    finally:
        for service in reversed(started):
            service.stop()


def test_killed_decode_rank_fails_its_group_and_streams_go_on(reference, capfd):
    started = []
    try:
        prefill = start("prefill", *WORKER, "--dtype", "float32")
        started.append(prefill)
        group = start("decode", *WORKER, "--dtype", "float32", "--tensor-parallel", "2")
        started.append(group)
        spare = start("decode", *WORKER, "--dtype", "float32")
        started.append(spare)
        coordinator = start("coordinator", f"--prefill-workers={prefill.grpc}",
                            f"--decode-workers={group.grpc},{spare.grpc}")  # fmt: skip
        started.append(coordinator)
        capfd.readouterr()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream, coordinator.grpc, q, 40) for q in QUESTIONS]
            deadline = time.monotonic() + 120
            while group.metric("pdserve_num_requests_running") < 2:
                assert time.monotonic() < deadline, "no stream reached the group"
                assert not any(f.done() for f in futures), "streams ended before the kill"
                time.sleep(0.02)
            moved = coordinator.metric("pdserve_router_decisions_total", pool="decode",
                                       target=spare.grpc)  # fmt: skip
            os.kill(group.info["rank_pids"][0], signal.SIGKILL)
            outs = [f.result(timeout=300) for f in futures]
        assert group.proc.wait(timeout=120) != 0  # rank 0 fails fast, never hangs
        assert "tensor-parallel rank 1 exited" in capfd.readouterr().err
        for q, out in zip(QUESTIONS, outs, strict=True):
            assert out == reference[q], q
        assert coordinator.metric("pdserve_request_failure_total") == 0
        after = coordinator.metric("pdserve_router_decisions_total", pool="decode",
                                   target=spare.grpc)  # fmt: skip
        assert after >= moved + 2  # the group's streams went on on the spare
    finally:
        for service in reversed(started):
            service.stop()
