"""The chart's observability: the ServiceMonitor selecting every metrics Service and
scraping every expert-parallel rank's metrics port, the Grafana dashboard's ConfigMap, and the
dashboard's queries and the PrometheusRule's recording rules checked with promtool (they parse,
use only metrics pdserve defines, and record the latency percentiles)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from helm_chart import FULLNAME, find, manifests, one, render, selects
from prometheus_client import REGISTRY, generate_latest
from promql import (
    DASHBOARD,
    RULES,
    dashboard_queries,
    declared_series,
    fill_variables,
    metric_names,
    rules_file_of,
    run_promtool,
)

LATENCY_HISTOGRAMS = (
    "pdserve_time_to_first_token_seconds",
    "pdserve_request_time_per_output_token_seconds",
    "pdserve_inter_token_latency_seconds",
    "pdserve_e2e_request_latency_seconds",
    "pdserve_kv_handoff_seconds",
)


def test_service_monitor_selects_every_metrics_service() -> None:
    docs = manifests("everything")
    (sm,) = find(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    matched = [
        s for s in find(docs, "Service") if selects(sm["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert len(matched) == 3
    for svc in matched:
        assert "metrics" in [p["name"] for p in svc["spec"]["ports"]]
    assert not find(manifests("default"), "ServiceMonitor")


def test_service_monitor_scrapes_every_expert_parallel_ranks_metrics_port() -> None:
    docs = render(
        "default", "decode.expertParallel=2", "decode.gpus=2", "metrics.serviceMonitor.enabled=true"
    )
    (sm,) = find(docs, "ServiceMonitor")
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics", "metrics-ep1"]
    assert {e["path"] for e in sm["spec"]["endpoints"]} == {"/metrics"}
    decode = one(docs, "Service", f"{FULLNAME}-decode-headless")
    assert selects(sm["spec"]["selector"], decode["metadata"]["labels"])
    assert {"metrics", "metrics-ep1"} <= {p["name"] for p in decode["spec"]["ports"]}
    # The widest pool sets the endpoints; a Service without a rank's port gives no target.
    (sm,) = find(manifests("expert-parallel"), "ServiceMonitor")
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [
        "metrics",
        "metrics-ep1",
        "metrics-ep2",
        "metrics-ep3",
    ]


def test_dashboard_ships_in_a_configmap_for_grafanas_sidecar() -> None:
    (cm,) = find(manifests("default"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["pdserve.json"]) == json.loads(DASHBOARD.read_text())
    assert not find(render("default", "metrics.dashboard.enabled=false"), "ConfigMap")


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    queries = [fill_variables(q) for q in dashboard_queries(json.loads(DASHBOARD.read_text()))]
    assert len(queries) >= 20
    rules = tmp_path / "dashboard.rules.yaml"
    rules.write_text(rules_file_of(queries))
    result = run_promtool("check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_dashboard_and_rules_use_only_metrics_pdserve_defines() -> None:
    """Offline: against every metric the services' modules register (tests/integration/
    test_metrics_exposition.py checks the same against live scrapes)."""
    import pdserve.services.coordinator.metrics
    import pdserve.services.coordinator.router
    import pdserve.services.metrics  # noqa: F401

    defined = declared_series(generate_latest(REGISTRY).decode())
    used = set()
    for query in dashboard_queries(json.loads(DASHBOARD.read_text())):
        used |= metric_names(query)
    for rule in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]:
        used |= metric_names(rule["expr"])
    assert len(used) >= 15
    assert used <= defined, used - defined


def test_prometheus_rule_records_latency_percentiles(tmp_path: Path) -> None:
    (rule,) = find(manifests("everything"), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    assert not find(manifests("default"), "PrometheusRule")
    records = [r["record"] for g in rule["spec"]["groups"] for r in g["rules"]]
    for metric in LATENCY_HISTOGRAMS:
        for p in ("p50", "p90", "p99"):
            assert f"namespace_model:{metric}:{p}" in records
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule["spec"]))
    result = run_promtool("check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(records)} rules found" in result.stdout
    # Their values: two coordinators' buckets, 10 fast (<= 0.5 s) and 10 slow (0.5-1 s)
    # requests a minute in all; p50 = 0.5, p90 = 0.9, p99 = 0.99 for each histogram.
    series, checks = [], []
    for metric in LATENCY_HISTOGRAMS:
        for worker in ("a", "b"):
            for le, per_minute in (("0.5", 5), ("1", 10), ("+Inf", 10)):
                labels = f'namespace="llm",model="m",role="coordinator",worker="{worker}"'
                series.append({"series": f'{metric}_bucket{{{labels},le="{le}"}}',
                               "values": f"0+{per_minute}x20"})  # fmt: skip
        for p, value in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            record = f"namespace_model:{metric}:{p}"
            checks.append({"expr": record, "eval_time": "15m", "exp_samples": [
                {"labels": f'{record}{{namespace="llm",model="m"}}', "value": value}]})  # fmt: skip
    unit = tmp_path / "rules_test.yaml"
    test = {"interval": "1m", "input_series": series, "promql_expr_test": checks}
    unit.write_text(yaml.safe_dump({"rule_files": [str(rules)], "tests": [test]}))
    result = run_promtool("test", "rules", str(unit))
    assert result.returncode == 0, result.stdout + result.stderr
