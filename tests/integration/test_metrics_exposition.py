"""Every service's `/metrics`, scraped from real processes after real requests: it passes
`promtool check metrics`, it holds every series the dashboard and the recording rules read,
and the prefix-cache and router counters count what happened."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from promql import DASHBOARD, RULES, dashboard_queries, declared_series, metric_names, run_promtool

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import RunningService, start

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--kv-cache-tokens", "4096", "--threads", "1"]
# Long enough for several full blocks, so a second request finds them in the prefix cache.
PROMPT = " ".join(["A stitch in time saves nine, and a penny saved is a penny earned."] * 5)
# Series that only appear once something fails on the KV path; they are declared all the same.
ONLY_ON_FAILURE = {"pdserve_kv_transfer_failures_total"}


@pytest.fixture(scope="module")
def cluster():
    started: list[RunningService] = []
    try:
        for role in ("prefill", "decode", "colocated"):
            started.append(start(role, *WORKER_ARGS))
        prefill, decode, _ = started
        started.append(
            start("coordinator", "--prefill-workers", prefill.grpc,
                  "--decode-workers", decode.grpc)
        )  # fmt: skip
        yield {s.role: s for s in started}
    finally:
        for service in reversed(started):
            service.stop()


def _generate(address: str, prompt: str, max_tokens: int = 4) -> generate_pb2.GenerateResponse:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            prompt=prompt,
            sampling=generate_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True
            ),
        )
        *_, last = stub.Generate(request, timeout=120)
    return last


def _scrape(service: RunningService) -> str:
    with urllib.request.urlopen(service.metrics_url, timeout=10) as response:
        return response.read().decode()


def _wait_for(service: RunningService, name: str, at_least: float, **labels: str) -> float:
    """The metric once it reaches `at_least` (workers sync counters between engine steps)."""
    deadline = time.monotonic() + 10
    while (value := service.metric(name, **labels)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def traffic(cluster) -> dict[str, str]:
    """A few requests through every path (one refused), then every service's scrape."""
    for i in range(3):
        _generate(cluster["coordinator"].grpc, f"Request {i}: what is the capital of France?")
        _generate(cluster["colocated"].grpc, f"Request {i}: name a planet.")
    with pytest.raises(grpc.RpcError):
        _generate(cluster["coordinator"].grpc, "", max_tokens=0)
    _wait_for(cluster["decode"], "pdserve_request_decode_time_seconds_count", 3)
    _wait_for(cluster["colocated"], "pdserve_request_decode_time_seconds_count", 3)
    return {role: _scrape(service) for role, service in cluster.items()}


@pytest.mark.parametrize("role", ["coordinator", "prefill", "decode", "colocated"])
def test_metrics_pass_promtool_check_metrics(traffic, role) -> None:
    assert "pdserve_" in traffic[role]
    result = run_promtool("check", "metrics", stdin=traffic[role])
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (result.stdout + result.stderr).strip()  # not even a lint warning


def test_dashboard_and_rules_read_only_series_the_services_export(traffic) -> None:
    used = set()
    for query in dashboard_queries(json.loads(DASHBOARD.read_text())):
        used |= metric_names(query)
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            used |= metric_names(rule["expr"])
    declared = set().union(*(declared_series(text) for text in traffic.values()))
    sampled = {
        sample.name
        for text in traffic.values()
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert used <= declared, used - declared
    assert used - sampled <= ONLY_ON_FAILURE, used - sampled


def test_prefix_cache_counters_count_reused_prompt_tokens(cluster) -> None:
    prefill = cluster["prefill"]
    queries0 = prefill.metric("pdserve_prefix_cache_queries_total")
    hits0 = prefill.metric("pdserve_prefix_cache_hits_total")
    prompt_tokens = _generate(cluster["coordinator"].grpc, PROMPT).usage.prompt_tokens
    assert prompt_tokens > 64
    _wait_for(prefill, "pdserve_prefix_cache_queries_total", queries0 + prompt_tokens)
    hits1 = prefill.metric("pdserve_prefix_cache_hits_total")
    second = _generate(cluster["coordinator"].grpc, PROMPT)
    queries = _wait_for(prefill, "pdserve_prefix_cache_queries_total", queries0 + 2 * prompt_tokens)
    hits = _wait_for(prefill, "pdserve_prefix_cache_hits_total", hits1 + 16)
    assert queries - queries0 == 2 * prompt_tokens  # every prompt token looked up, each time
    # The second time, every full block but the one holding the last prompt token is a hit.
    full_blocks = (prompt_tokens - 1) // 16
    assert hits - hits1 == full_blocks * 16 == second.usage.cached_tokens
    assert hits1 >= hits0
    # The decode worker looks up the same prompt before pulling it: its counters move too.
    assert _wait_for(cluster["decode"], "pdserve_prefix_cache_hits_total", full_blocks * 16) > 0


def test_router_counts_each_pick(cluster) -> None:
    coordinator = cluster["coordinator"]

    def picks(pool: str, target: str) -> float:
        return coordinator.metric(
            "pdserve_router_decisions_total", pool=pool, outcome="picked", target=target,
            policy="prefix_aware",
        )  # fmt: skip

    before = {p: picks(p, cluster[p].grpc) for p in ("prefill", "decode")}
    for i in range(2):
        _generate(coordinator.grpc, f"Routing check {i}.")
    for pool, was in before.items():
        assert picks(pool, cluster[pool].grpc) - was == 2
    assert coordinator.metric("pdserve_router_decisions_total", outcome="no_worker") == 0
