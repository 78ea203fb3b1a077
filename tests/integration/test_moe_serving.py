"""A mixture-of-experts model served with expert parallelism, on real processes: a worker
started with `--expert-parallel 2` is a group of two rank processes (gloo on 127.0.0.1),
each its own gRPC endpoint with its own KV cache, stepping in lockstep.

- Disaggregated, prefill EP 2 → decode EP 1 and prefill EP 1 → decode EP 2 (KV handed over
  UCX between groups of different sizes): greedy ids equal the offline engine's, the
  coordinator spreads requests over both ranks, and every rank's blocks come back.
- A colocated EP 2 group, with and without redundant experts re-placed every 2 steps,
  answers exactly and exports `pdserve_moe_expert_tokens_total{layer, expert}`: over the
  ranks, exactly top_k × the tokens it computed per MoE layer; and the imbalance gauge; the
  exposition passes `promtool check metrics`.
- A rank killed with SIGKILL takes its group down with an error naming the rank (no hang),
  and the coordinator routes the next requests to the worker that is left."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from promql import run_promtool
from test_moe_greedy import build_tiny_moe

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.grpc_server import wait_healthy
from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import RunningService, start

pytestmark = pytest.mark.slow

VOCAB = 49152
NEW_TOKENS = 12
PROMPT_LENS = (5, 17, 40, 33, 9, 24)
WORKER_ARGS = ["--kv-cache-tokens", "2048", "--threads", "1", "--max-num-batched-tokens", "64"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, default_model_dir) -> Path:
    return build_tiny_moe(tmp_path_factory.mktemp("moe") / "mixtral", "mixtral", default_model_dir)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def offline(moe_dir, prompts) -> list[list[int]]:
    """The offline engine's greedy ids (what `pdserve generate` answers)."""
    engine = LLMEngine(EngineConfig(model=str(moe_dir), kv_cache_tokens=2048))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(prompts, params)]


def start_worker(role: str, moe_dir: Path, ep: int, *flags: str) -> RunningService:
    service = start(
        role, "--model", str(moe_dir), *WORKER_ARGS, "--expert-parallel", str(ep), *flags
    )
    for rank in ranks(service):
        asyncio.run(wait_healthy(rank["grpc"], 60))
    return service


def ranks(service: RunningService) -> list[dict]:
    return service.info.get("ranks") or [service.info]


def rank_metric(rank: dict, name: str, **labels: str) -> float:
    return RunningService("rank", None, {"metrics": rank["metrics"]}).metric(name, **labels)  # type: ignore[arg-type]


def generate(address: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy ids and the completion's token count, through the public API."""
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            token_ids=prompt,
            sampling=generate_pb2.SamplingParams(
                max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True
            ),
        )
        ids: list[int] = []
        for response in stub.Generate(request, timeout=120):
            ids += response.token_ids
        return ids, len(ids)


def generate_all(address: str, prompts: list[list[int]]) -> list[list[int]]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return [ids for ids, _ in pool.map(lambda p: generate(address, p), prompts)]


@pytest.mark.parametrize(("prefill_ep", "decode_ep"), [(2, 1), (1, 2)])
def test_disaggregated_groups_of_different_sizes(moe_dir, prompts, offline, prefill_ep, decode_ep):
    started: list[RunningService] = []
    try:
        prefill = start_worker("prefill", moe_dir, prefill_ep)
        started.append(prefill)
        decode = start_worker("decode", moe_dir, decode_ep)
        started.append(decode)
        workers = {"prefill": prefill, "decode": decode}
        coordinator = start(
            "coordinator",
            "--model", str(moe_dir),
            f"--prefill-workers={','.join(r['grpc'] for r in ranks(prefill))}",
            f"--decode-workers={','.join(r['grpc'] for r in ranks(decode))}",
        )  # fmt: skip
        started.append(coordinator)

        assert generate_all(coordinator.grpc, prompts) == offline
        # A second round, so both ranks of the group surely serve (the router spreads by
        # load: all six at once cannot all go to one rank's queue first).
        assert generate_all(coordinator.grpc, prompts) == offline

        group = workers["prefill" if prefill_ep > 1 else "decode"]
        served = [
            rank_metric(rank, "pdserve_request_queue_time_seconds_count") for rank in ranks(group)
        ]
        assert all(n > 0 for n in served), f"requests per rank: {served}"
        for service in (prefill, decode):
            for rank in ranks(service):
                total = rank_metric(rank, "pdserve_kv_cache_num_blocks")
                assert rank_metric(rank, "pdserve_kv_cache_blocks_free") == total, rank
    finally:
        for service in reversed(started):
            service.stop()


@pytest.mark.parametrize("redundant", [0, 2])
def test_colocated_group_exports_expert_routing(moe_dir, prompts, offline, redundant):
    flags = ["--redundant-experts", str(redundant), "--eplb-interval", "2"] if redundant else []
    worker = start_worker("colocated", moe_dir, 2, *flags)
    try:
        coordinator = start(
            "coordinator", "--model", str(moe_dir),
            f"--colocated-workers={','.join(r['grpc'] for r in ranks(worker))}",
        )  # fmt: skip
        try:
            assert generate_all(coordinator.grpc, prompts) == offline
        finally:
            coordinator.stop()
        top_k, moe_layers = 2, 3  # the tiny Mixtral: top-2 routing in all 3 layers
        # With prefix caching every prompt token is computed once here (the prompts share
        # no block); each completion's last token is never fed back.
        computed = sum(len(p) + NEW_TOKENS - 1 for p in prompts)
        for layer in range(moe_layers):
            routed = sum(
                rank_metric(rank, "pdserve_moe_expert_tokens_total", layer=str(layer))
                for rank in ranks(worker)
            )
            assert routed == top_k * computed, f"layer {layer}"
            for rank in ranks(worker):
                ratio = rank_metric(rank, "pdserve_moe_expert_load_imbalance", layer=str(layer))
                assert 1.0 <= ratio <= 2.0, (layer, rank["worker_id"], ratio)
        per_expert = [
            rank_metric(ranks(worker)[0], "pdserve_moe_expert_tokens_total", layer="0",
                        expert=str(e))
            for e in range(8)
        ]  # fmt: skip
        assert sum(1 for n in per_expert if n) > 2, f"routing used few experts: {per_expert}"
        for rank in ranks(worker):
            assert rank_metric(rank, "pdserve_moe_alltoall_bytes_total") > 0
            rebalances = rank_metric(rank, "pdserve_moe_expert_rebalances_total")
            # Every 2 forwards, copies re-placed between steps: the answers above are exact.
            assert (rebalances > 3) if redundant else (rebalances == 0), rebalances
        with urllib.request.urlopen(ranks(worker)[1]["metrics"], timeout=10) as r:
            exposition = r.read().decode()
        assert "pdserve_moe_expert_tokens_total{" in exposition
        result = run_promtool("check", "metrics", stdin=exposition)
        assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
            result.stdout + result.stderr
        )
    finally:
        worker.stop()


def test_a_dead_rank_fails_its_group_and_the_coordinator_routes_around(
    moe_dir, prompts, offline, capfd
):
    started: list[RunningService] = []
    try:
        prefill = start_worker("prefill", moe_dir, 1)
        started.append(prefill)
        group = start_worker("decode", moe_dir, 2)
        started.append(group)
        spare = start_worker("decode", moe_dir, 1)
        started.append(spare)
        decode_addresses = [r["grpc"] for r in ranks(group)] + [spare.grpc]
        coordinator = start(
            "coordinator", "--model", str(moe_dir), f"--prefill-workers={prefill.grpc}",
            f"--decode-workers={','.join(decode_addresses)}",
        )  # fmt: skip
        started.append(coordinator)
        assert generate_all(coordinator.grpc, prompts) == offline

        capfd.readouterr()
        os.kill(ranks(group)[1]["pid"], signal.SIGKILL)
        code = group.proc.wait(timeout=120)  # rank 0 fails fast, never hangs
        assert code != 0
        assert "expert-parallel rank 1 exited" in capfd.readouterr().err
        assert generate_all(coordinator.grpc, prompts) == offline
        free, total = spare.blocks_once_idle()
        assert free == total
    finally:
        for service in reversed(started):
            service.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--expert-parallel", "3"], "--expert-parallel: must divide the model's 8 experts, got 3"),
        (["--expert-parallel", "2", "--redundant-experts", "1"],
         "redundant_experts: must be a multiple of expert_parallel (2)"),
        (["--redundant-experts", "2"], "redundant_experts: copies of experts need expert_parallel"),
        (["--expert-parallel", "2", "--redundant-experts", "16"],
         "--redundant-experts: at most the model's 8 experts, got 16"),
    ],
)  # fmt: skip
def test_bad_expert_parallel_flags_fail_before_any_rank_starts(moe_dir, flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.services.cli", "decode", "--model", str(moe_dir),
         "--port", "0", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_dense_model_refuses_expert_parallel(default_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.services.cli", "prefill", "--model",
         str(default_model_dir), "--port", "0", "--expert-parallel", "2",
         "--redundant-experts", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "is not a mixture-of-experts model" in result.stderr, result.stderr[-2000:]
