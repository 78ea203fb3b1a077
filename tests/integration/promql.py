"""Helpers for checking PromQL against pdserve's metrics: the queries of the Grafana dashboard
(with its template variables filled in), the metric names an expression reads, the series
names a `/metrics` exposition declares, and `promtool` (from Debian's `prometheus` package,
which `make tools` unpacks into the venv)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "pdserve" / "dashboards" / "pdserve.json"
RULES = ROOT / "helm" / "pdserve" / "rules" / "pdserve.rules.yaml"
# What Grafana puts in for its built-in and our template variables when it runs a query.
VARIABLE_SAMPLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
            "_created"), "gauge": ("",), "summary": ("_sum", "_count", "_created", "")}  # fmt: skip


def promtool() -> str:
    """`make tools` unpacks it into the venv; one on PATH does too."""
    beside = Path(sys.executable).parent / "promtool"
    path = str(beside) if beside.is_file() else shutil.which("promtool")
    assert path, "promtool is missing: `make tools` unpacks it from Debian's prometheus package"
    return path


def run_promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def fill_variables(query: str) -> str:
    """The query as Grafana sends it, with sample values for the template variables."""
    query = re.sub(r"\$\{?(\w+)\}?", lambda m: VARIABLE_SAMPLES.get(m.group(1), "sample"), query)
    # label_values(metric, label) is Grafana's, not PromQL: its metric selector is the query.
    return re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query)


def rules_file_of(queries: list[str]) -> str:
    """A Prometheus rules file recording each query, for `promtool check rules` to parse."""
    rules = [{"record": f"pdserve_check:query_{i}", "expr": q} for i, q in enumerate(queries)]
    return yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})


def metric_names(expr: str) -> set[str]:
    """The pdserve series an expression reads (recording-rule names, which hold colons, aside)."""
    return set(re.findall(r"(?<![\w:])pdserve_\w+(?![\w:])", expr))


def declared_series(exposition: str) -> set[str]:
    """The series names a Prometheus text exposition declares (by its metric families, so a
    labelled counter that has not counted yet still counts as exported)."""
    names = set()
    for family in text_string_to_metric_families(exposition):  # a counter's name lacks _total
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names
