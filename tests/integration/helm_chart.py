"""What the helm chart's tests (tests/integration/test_helm_*.py) share: `helm` itself,
`helm template` of the chart (helm/pdserve) with a value set from helm_values/ and --set
overrides, the rendered manifests picked apart (Deployments, their one container, its env,
volumes and mounts), and a container's command line and PDSERVE_* env read back by the real
`pdserve` CLI. `make install` puts the real helm binary in .venv/bin."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.services.cli import build_parser
from pdserve.services.coordinator.discovery import build_discovery

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
VALUES_DIR = Path(__file__).parent / "helm_values"
HELM = Path(sys.executable).parent / "helm"
RELEASE, NAMESPACE = "demo", "llm"
FULLNAME = f"{RELEASE}-pdserve"
VALUE_SETS = ["default", *sorted(p.stem for p in VALUES_DIR.glob("*.yaml"))]
WORKERS = ("prefill", "decode")
# What downward-API fields stand for when the CLI parses a container's environment.
FIELD_SAMPLES = {"status.podIP": "10.1.2.3", "metadata.name": "demo-pdserve-prefill-abc12"}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert HELM.is_file(), f"{HELM} is missing: `make install` (or `make tools`) downloads helm"
    return subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, check=check, timeout=120
    )


def render(value_set: str = "default", *sets: str, kube: str | None = None) -> list[dict]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if value_set != "default":
        args += ["-f", str(VALUES_DIR / f"{value_set}.yaml")]
    for s in sets:
        args += ["--set", s]
    if kube:
        args += ["--kube-version", kube]
    out = helm(*args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


_cache: dict[str, list[dict]] = {}


def manifests(value_set: str) -> list[dict]:
    if value_set not in _cache:
        _cache[value_set] = render(value_set)
    return _cache[value_set]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = find(docs, kind, name)
    return doc


def deployment(docs: list[dict], component: str) -> dict:
    return one(docs, "Deployment", f"{FULLNAME}-{component}")


def container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def pod_labels(dep: dict) -> dict[str, str]:
    return dep["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"unexpected selector form: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def env_of(c: dict) -> dict[str, str]:
    out = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            out[e["name"]] = f"<secret {ref['name']}/{ref['key']}>"
        else:
            out[e["name"]] = FIELD_SAMPLES[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def kube_versions() -> tuple[str, str]:
    """The oldest and newest minor versions Chart.yaml's kubeVersion claims."""
    claim = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    low = re.search(r">=\s*1\.(\d+)", claim)
    high = re.search(r"<\s*1\.(\d+)", claim)
    assert low and high, f"kubeVersion {claim!r} should be a bounded range"
    return f"1.{low.group(1)}.0", f"1.{int(high.group(1)) - 1}.0"


def subcommand_parser(command: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return parser, sub.choices[command]


def parse_container(c: dict, monkeypatch: pytest.MonkeyPatch):
    """The container's command line as the real CLI parses it, with its PDSERVE_* env."""
    env = env_of(c)
    for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("PDSERVE_"):
            monkeypatch.setenv(name, value)
    args = [str(a) for a in c["args"]]
    parser, sub = subcommand_parser(args[0])
    dests = {a.dest for a in sub._actions}
    return parser.parse_args(args), dests, env


def pod_spec(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def volume(dep: dict, name: str) -> dict | None:
    found = [v for v in pod_spec(dep).get("volumes", []) if v["name"] == name]
    assert len(found) <= 1
    return found[0] if found else None


def mount(c: dict, name: str) -> dict | None:
    found = [m for m in c.get("volumeMounts", []) if m["name"] == name]
    assert len(found) <= 1
    return found[0] if found else None


def discovery_of(args: argparse.Namespace):
    static = {r: [a for a in getattr(args, f"{r}_workers", "").split(",") if a] for r in WORKERS}
    return build_discovery(args, static)


def assert_render_refuses(sets: list[str], message: str) -> None:
    """`helm template` with `--set` of each of `sets` (`--set-json` for one written
    "json:path=value") fails, saying `message`, both with the values schema (unless the
    schema refuses it first) and without it, so the template's own checks hold for a user
    who skips the schema."""
    for skip in ([], ["--skip-schema-validation"]):
        args = ["template", RELEASE, str(CHART), *skip]
        for s in sets:
            args += (
                ["--set-json", s.removeprefix("json:")] if s.startswith("json:") else ["--set", s]
            )
        result = helm(*args, check=False)
        assert result.returncode != 0
        if not skip and "values don't meet the specifications of the schema" in result.stderr:
            continue  # the schema caught it first
        assert message in result.stderr, result.stderr
