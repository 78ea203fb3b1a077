"""The disk tier on a real colocated worker (the default model): with a pool too small for
four conversations, greedy tokens equal a worker whose pool holds everything, the repeats are
served from disk (its counters say so), no block leaks, the metrics pass promtool, and a
worker started again on the same folder finds the blocks its predecessor wrote. In 1P+1D,
the decode worker's tier counts as cached, the prefill worker serves a transfer from blocks
it loaded back (also under a --no-kv-events coordinator), the router follows the tiers, and
a shared folder carries a conversation to another worker."""

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


def _settled(service: RunningService, name: str, at_least: float, **labels: str) -> float:
    deadline = time.monotonic() + 10  # counters trail the engine by a step
    while (value := service.metric(name, **labels)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_disk_tier_serves_repeats_with_the_same_tokens(tmp_path):
    with running("colocated", *ARGS, "--kv-cache-tokens", "4096") as unbounded:
        expected = _run(unbounded)
    tier_args = [*ARGS, "--kv-cache-tokens", "256", "--kv-offload-dir", str(tmp_path)]
    with running("colocated", *tier_args) as worker:
        assert _run(worker) == expected
        assert _settled(worker, "pdserve_kv_offload_hits_total", 1) > 0
        assert worker.metric("pdserve_kv_offload_stores_total") > 0
        assert worker.metric("pdserve_kv_offload_corrupt_total") == 0
        free, total = worker.blocks_once_idle()
        assert free == total
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
        free, total = again.blocks_once_idle()
        assert free == total


def test_decode_worker_pulls_only_what_its_tier_lacks(tmp_path):
    """Prefill with a pool for everything; decode with a small pool and a disk tier. On the
    second round each conversation's history is in the decode worker's tier, so it pulls
    only the new tail, and the tokens equal the first round's path through a big pool."""
    with running("colocated", *ARGS, "--kv-cache-tokens", "4096") as unbounded:
        expected = _run(unbounded)
    with (
        running("prefill", *ARGS, "--kv-cache-tokens", "4096") as prefill,
        running(
            "decode", *ARGS, "--kv-cache-tokens", "256", "--kv-offload-dir", str(tmp_path)
        ) as decode,
        running(
            "coordinator", f"--prefill-workers={prefill.grpc}", f"--decode-workers={decode.grpc}"
        ) as coordinator,
    ):
        pulled = []
        got = []
        for prompts in ROUNDS:
            before = decode.metric("pdserve_kv_transfer_blocks_total", direction="receive")
            got += [_generate(coordinator.grpc, prompt) for prompt in prompts]
            after = _settled(decode, "pdserve_kv_transfer_blocks_total", before)
            pulled.append(after - before)
        assert got == expected
        assert decode.metric("pdserve_kv_offload_hits_total") > 0
        # Round 1 pulls every conversation's 7 blocks; round 2 at most the new last block.
        assert pulled[0] == len(HISTORIES) * 7 and pulled[1] <= len(HISTORIES), pulled
        free, total = decode.blocks_once_idle()
        assert free == total


def test_router_sends_a_conversation_to_the_tier_that_holds_it(tmp_path):
    """Two prefill workers whose pools hold one conversation each, both with a disk tier:
    by the second round half the histories are only in a tier. The workers report what
    their tiers hold, so every second-round turn goes to the worker holding its history
    (in its pool or its tier) and finds all of it cached."""
    small = [*ARGS, "--kv-cache-tokens", "112"]  # 7 blocks: one conversation exactly
    with (
        running("prefill", *small, "--kv-offload-dir", str(tmp_path / "p0")) as p0,
        running("prefill", *small, "--kv-offload-dir", str(tmp_path / "p1")) as p1,
        running("decode", *ARGS, "--kv-cache-tokens", "4096") as decode,
        running(
            "coordinator",
            f"--prefill-workers={p0.grpc},{p1.grpc}",
            f"--decode-workers={decode.grpc}",
        ) as coordinator,
    ):
        cached = []
        # Round-robin ties put round 1 on p0, p1, p0, p1; round 2 comes in another order, so
        # a router blind to the tiers would send some turns to the wrong worker.
        second = [ROUNDS[1][i] for i in (1, 0, 3, 2)]
        for r, prompts in enumerate([ROUNDS[0], second]):
            if r:
                time.sleep(1.0)  # the workers' status reports (every 0.1 s) reach it
            for prompt in prompts:
                with grpc.insecure_channel(coordinator.grpc) as channel:
                    stub = generate_pb2_grpc.GenerateServiceStub(channel)
                    request = generate_pb2.GenerateRequest(
                        token_ids=prompt,
                        sampling=generate_pb2.SamplingParams(max_tokens=2, temperature=0),
                    )
                    cached.append(list(stub.Generate(request, timeout=120))[-1].usage.cached_tokens)
        hits = sum(p.metric("pdserve_kv_offload_hits_total") for p in (p0, p1))
        assert cached[: len(HISTORIES)] == [0] * len(HISTORIES)
        assert cached[len(HISTORIES) :] == [len(HISTORIES[0])] * len(HISTORIES), cached
        assert hits > 0  # some of them came back from a tier


def test_shared_tier_carries_a_conversation_to_another_worker(tmp_path):
    """Two colocated workers on one --kv-shared-dir: a conversation answered by the first
    is a prefix hit on the second, which never saw it (as after a failover or scale-in),
    with the same tokens."""
    shared = [*ARGS, "--kv-cache-tokens", "4096", "--kv-shared-dir", str(tmp_path)]
    prompts = ROUNDS[0][:2]
    with running("colocated", *shared) as first:
        expected = [_generate(first.grpc, p) for p in prompts]
        assert _settled(first, "pdserve_kv_offload_stores_total", 12) >= 12
    with running("colocated", *shared) as second:
        cached = []
        for prompt in prompts:
            with grpc.insecure_channel(second.grpc) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                request = generate_pb2.GenerateRequest(
                    token_ids=prompt,
                    sampling=generate_pb2.SamplingParams(
                        max_tokens=4, temperature=0, ignore_eos=True
                    ),
                )
                responses = list(stub.Generate(request, timeout=120))
            assert [t for r in responses for t in r.token_ids] == expected[len(cached)]
            cached.append(responses[-1].usage.cached_tokens)
        assert cached == [len(HISTORIES[0])] * len(prompts)
        assert second.metric("pdserve_kv_offload_hits_total", tier="shared") > 0
        free, total = second.blocks_once_idle()
        assert free == total


def _ask(address: str, token_ids: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens the prefill found cached."""
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            token_ids=token_ids,
            sampling=generate_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        )
        responses = list(stub.Generate(request, timeout=120))
    return [t for r in responses for t in r.token_ids], responses[-1].usage.cached_tokens


def test_prefill_worker_serves_a_transfer_from_blocks_it_loaded_back(tmp_path):
    """Prefill with a 16-block pool and a disk tier; decode with a 16-block pool and no
    tier, so it keeps no copy of its own. A conversation is prefilled, pushed out of both
    pools by the three others, then asked again: the prefill worker loads its history back
    from its tier and the decode worker pulls every block of it from there, with the first
    run's tokens. A second coordinator in --no-kv-events mode serves the same setup."""
    small = [*ARGS, "--kv-cache-tokens", "256"]
    prompt, others = ROUNDS[0][0], ROUNDS[0][1:]
    with (
        running("prefill", *small, "--kv-offload-dir", str(tmp_path)) as prefill,
        running("decode", *small) as decode,
        running(
            "coordinator", f"--prefill-workers={prefill.grpc}", f"--decode-workers={decode.grpc}"
        ) as coordinator,
        running(
            "coordinator", "--no-kv-events",
            f"--prefill-workers={prefill.grpc}", f"--decode-workers={decode.grpc}",
        ) as blind,
    ):  # fmt: skip
        first, cached = _ask(coordinator.grpc, prompt)
        assert cached == 0
        for other in others:  # 21 blocks more: the conversation leaves both 16-block pools
            _ask(coordinator.grpc, other)
        for address in (coordinator.grpc, blind.grpc):
            hits = _settled(prefill, "pdserve_kv_offload_hits_total", 0)
            pulled = _settled(decode, "pdserve_kv_transfer_blocks_total", 0, direction="receive")
            again, cached = _ask(address, prompt)
            assert again == first
            assert cached == len(HISTORIES[0])  # the history came back from the tier
            assert _settled(prefill, "pdserve_kv_offload_hits_total", hits + 1) > hits
            after = _settled(decode, "pdserve_kv_transfer_blocks_total", pulled + 7,
                             direction="receive")  # fmt: skip
            assert after - pulled == 7  # all of it: decode had no copy
            for other in others:  # and out of the pools again
                _ask(coordinator.grpc, other)
        free, total = decode.blocks_once_idle()
        assert free == total
        assert prefill.metric("pdserve_kv_offload_corrupt_total") == 0
