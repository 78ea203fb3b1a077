"""The helm chart (helm/pdserve) and the Dockerfile, checked offline: `helm lint --strict`,
`helm template` with several value sets, every manifest against the Kubernetes schemas of the
versions Chart.yaml claims, and the rendered YAML read back against what the services really
accept (their argparse parsers), against each other (selectors, ports, RBAC) and against the
schema's rejections. `make install` puts the real helm binary in .venv/bin."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError
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

from pdserve.services.cli import build_parser
from pdserve.services.coordinator.discovery import (
    LabelSelector,
    StaticDiscovery,
    build_discovery,
    slice_endpoints,
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdserve"
VALUES_DIR = Path(__file__).parent / "helm_values"
HELM = Path(sys.executable).parent / "helm"
HADOLINT = Path(sys.executable).parent / "hadolint"
RELEASE, NAMESPACE = "demo", "llm"
FULLNAME = f"{RELEASE}-pdserve"
VALUE_SETS = ["default", *sorted(p.stem for p in VALUES_DIR.glob("*.yaml"))]
WORKERS = ("prefill", "decode")
# PDSERVE_* variables read by pdserve's code rather than by a CLI flag.
NON_FLAG_VARS = {"PDSERVE_CACHE_DIR": "common/model_files.py", "PDSERVE_BUILD_DIR": "kernels"}
TLS_VARS = ("PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA", "PDSERVE_TLS_SERVER_NAME")
# What downward-API fields stand for when the CLI parses a container's environment.
FIELD_SAMPLES = {"status.podIP": "10.1.2.3", "metadata.name": "demo-pdserve-prefill-abc12"}
LATENCY_HISTOGRAMS = (
    "pdserve_time_to_first_token_seconds",
    "pdserve_request_time_per_output_token_seconds",
    "pdserve_inter_token_latency_seconds",
    "pdserve_e2e_request_latency_seconds",
    "pdserve_kv_handoff_seconds",
)


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


# --- helm itself ------------------------------------------------------------------------------


def test_helm_lint_strict() -> None:
    result = helm("lint", "--strict", str(CHART), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for value_set in VALUE_SETS[1:]:
        result = helm(
            "lint", "--strict", str(CHART), "-f", str(VALUES_DIR / f"{value_set}.yaml"), check=False
        )
        assert result.returncode == 0, f"{value_set}: {result.stdout}{result.stderr}"


def test_kube_version_outside_the_claim_is_refused() -> None:
    low, _ = kube_versions()
    older = f"1.{int(low.split('.')[1]) - 1}.0"
    result = helm("template", RELEASE, str(CHART), "--kube-version", older, check=False)
    assert result.returncode != 0 and "kubeVersion" in result.stderr


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_manifest_passes_kubernetes_validate_strict(value_set: str) -> None:
    for version in kube_versions():
        docs = render(value_set, kube=version)
        assert len(docs) > 10
        for doc in docs:
            what = f"{value_set} k8s {version}: {doc['kind']}/{doc['metadata']['name']}"
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except SchemaNotFoundError:
                # CRDs have no bundled schema; the chart's three (the Prometheus Operator's
                # two, cert-manager's Certificate) are checked field by field below.
                assert doc["kind"] in ("ServiceMonitor", "PrometheusRule", "Certificate"), what
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{what}: {exc}")


# --- scheduling and resources -----------------------------------------------------------------


def test_pools_land_on_distinct_gpu_pools_by_default() -> None:
    docs = manifests("default")
    specs = {r: deployment(docs, r)["spec"]["template"]["spec"] for r in WORKERS}
    assert specs["prefill"]["nodeSelector"] != specs["decode"]["nodeSelector"]
    assert specs["prefill"]["nodeSelector"] and specs["decode"]["nodeSelector"]
    assert specs["prefill"]["tolerations"] != specs["decode"]["tolerations"]
    for role, spec in specs.items():
        assert {"key": "pdserve.io/pool", "operator": "Equal", "value": role} in [
            {k: t[k] for k in ("key", "operator", "value") if k in t} for t in spec["tolerations"]
        ]
        limits = container(deployment(docs, role))["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == 1
        assert env_of(container(deployment(docs, role)))["PDSERVE_DEVICE"] == "cuda"
        # Anti-affinity within the pool: its own pods, spread over nodes.
        term = spec["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        selector = term[0]["podAffinityTerm"]["labelSelector"]
        assert selects(selector, pod_labels(deployment(docs, role)))
        other = "decode" if role == "prefill" else "prefill"
        assert not selects(selector, pod_labels(deployment(docs, other)))
    assert "nvidia.com/gpu" not in str(deployment(docs, "coordinator"))


def test_cpu_only_requests_no_gpu() -> None:
    docs = manifests("cpu-only")
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(docs)
    for role in WORKERS:
        c = container(deployment(docs, role))
        assert env_of(c)["PDSERVE_DEVICE"] == "cpu"
        assert env_of(c)["PDSERVE_THREADS"] == "4"
        assert "nodeSelector" not in deployment(docs, role)["spec"]["template"]["spec"]


def test_replicas_and_hard_anti_affinity() -> None:
    docs = manifests("scale-3p-5d")
    assert deployment(docs, "prefill")["spec"]["replicas"] == 3
    assert deployment(docs, "decode")["spec"]["replicas"] == 5
    anti = deployment(docs, "prefill")["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    )


def test_autoscaling_targets_each_deployment_and_drops_fixed_replicas() -> None:
    docs = manifests("autoscaling")
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in find(docs, "HorizontalPodAutoscaler")}
    assert set(hpas) == {f"{FULLNAME}-{c}" for c in ("coordinator", *WORKERS)}
    for component in ("coordinator", *WORKERS):
        assert "replicas" not in deployment(docs, component)["spec"]
    assert hpas[f"{FULLNAME}-decode"]["spec"]["maxReplicas"] == 10
    assert not find(manifests("default"), "HorizontalPodAutoscaler")


def test_pdbs_select_their_pools() -> None:
    docs = manifests("default")
    for component in ("coordinator", *WORKERS):
        pdb = one(docs, "PodDisruptionBudget", f"{FULLNAME}-{component}")
        for other in ("coordinator", *WORKERS):
            matched = selects(pdb["spec"]["selector"], pod_labels(deployment(docs, other)))
            assert matched == (other == component)


def test_rdma_ucx_and_shared_memory() -> None:
    docs = manifests("everything")
    for role in WORKERS:
        dep = deployment(docs, role)
        c = container(dep)
        assert int(c["resources"]["limits"]["rdma/hca_shared_devices_a"]) == 1
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        env = env_of(c)
        assert env["UCX_TLS"] == "rc,self,tcp,cuda_copy"
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert env["UCX_RNDV_THRESH"] == "8192"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
        shm = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    default = container(deployment(manifests("default"), "prefill"))
    assert not any(n.startswith(("UCX_", "OTEL_EXPORTER")) for n in env_of(default))


# --- the services' real flags ----------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_env_ports_and_probes_match_the_cli(value_set: str, monkeypatch) -> None:
    docs = manifests(value_set)
    for component in ("coordinator", *WORKERS):
        c = container(deployment(docs, component))
        assert c["args"][0] == component
        args, dests, env = parse_container(c, monkeypatch)
        for name, value in env.items():
            if not name.startswith("PDSERVE_"):
                continue
            if name in NON_FLAG_VARS:
                where = ROOT / NON_FLAG_VARS[name]
                files = [where] if where.is_file() else list(where.rglob("*.py"))
                assert any(name in f.read_text() for f in files), f"{name} is read nowhere"
                continue
            dest = name.removeprefix("PDSERVE_").lower()
            assert dest in dests, f"{component}: {name} is no flag of `pdserve {component}`"
            parsed = getattr(args, dest)
            if isinstance(parsed, bool):
                assert parsed is True, f"{component}: {name}={value!r}"
            elif isinstance(parsed, int | float):
                assert parsed == float(value), f"{component}: {name}={value!r} -> {parsed}"
            else:
                assert parsed == value, f"{component}: {name}={value!r} -> {parsed!r}"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == args.port
        assert ports["metrics"] == args.metrics_port != 0
        # Expert-parallel rank r listens on port + r and metrics port + r (services/worker.py).
        ranks = getattr(args, "expert_parallel", 1)
        for prefix, base in (("grpc", args.port), ("metrics", args.metrics_port)):
            named = {n: p for n, p in ports.items() if n.startswith(f"{prefix}-ep")}
            assert named == {f"{prefix}-ep{r}": base + r for r in range(1, ranks)}, component
        # Probes: the gRPC port, or the plain health port where the chart turns one on.
        probed = int(env.get("PDSERVE_HEALTH_PORT", args.port))
        if "PDSERVE_HEALTH_PORT" in env:
            assert ports["health"] == probed != args.port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == probed, f"{component} {probe}"
        grace = deployment(docs, component)["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
        preStop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
        assert grace > preStop + args.drain_timeout
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    workers = {r: parse_container(container(deployment(docs, r)), monkeypatch) for r in WORKERS}
    # Workers listen on their pod IP: the address a prefill worker hands decode in its KV handles.
    for args, _, _ in workers.values():
        assert args.host == FIELD_SAMPLES["status.podIP"]


def test_model_from_a_pvc_reaches_every_service(monkeypatch) -> None:
    docs = manifests("model-pvc")
    for component in ("coordinator", *WORKERS):
        dep = deployment(docs, component)
        args, _, _ = parse_container(container(dep), monkeypatch)
        assert args.model == "/models/llama"
        assert args.max_model_len == 8192  # the coordinator's comes from its args
        (vol,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"]
        assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        (mount,) = [m for m in container(dep)["volumeMounts"] if m["name"] == "model"]
        assert mount["subPath"] == "Llama-3.1-8B-Instruct" and mount["readOnly"] is True
    args, _, _ = parse_container(container(deployment(docs, "prefill")), monkeypatch)
    assert args.no_prefix_caching is True and args.dtype == "bfloat16"


def test_model_image_is_copied_by_an_init_container() -> None:
    spec = deployment(manifests("everything"), "decode")["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    assert init["image"] == "registry.example.com/models/qwen2-7b:1"
    assert init["command"] == ["cp", "-R", "/model/.", "/model-dest/"]
    assert env_of(spec["containers"][0])["PDSERVE_MODEL"] == "/models"


def test_bundled_model_cache_is_writable_unless_baked() -> None:
    for value_set, expected in [("default", "/var/cache/pdserve"), ("everything", None)]:
        c = container(deployment(manifests(value_set), "prefill"))
        env = env_of(c)
        if expected:
            assert env["PDSERVE_CACHE_DIR"] == expected
            assert {"name": "cache", "mountPath": expected} in c["volumeMounts"]
        assert env["PDSERVE_BUILD_DIR"].startswith("/var/cache/pdserve/")
    baked = render("default", "image.modelBaked=true")
    assert env_of(container(deployment(baked, "decode")))["PDSERVE_CACHE_DIR"] == (
        "/opt/pdserve/cache"
    )


# --- discovery, services, RBAC, network policy -------------------------------------------------


def endpointslice_labels(svc: dict) -> dict[str, str]:
    """The labels Kubernetes' EndpointSlice controller gives the slices of a Service: the
    Service's own plus the two it adds."""
    return {
        **svc["metadata"]["labels"],
        "kubernetes.io/service-name": svc["metadata"]["name"],
        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
    }


def discovery_of(args: argparse.Namespace):
    static = {r: [a for a in getattr(args, f"{r}_workers", "").split(",") if a] for r in WORKERS}
    return build_discovery(args, static)


@pytest.mark.parametrize("value_set", ["default", "scale-3p-5d"])
def test_coordinator_watches_each_pools_endpointslices(
    value_set: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Default: Kubernetes discovery, whose selectors pick exactly the slices of each pool's
    headless Service, on the port the workers listen on, in the release's namespace."""
    pytest.importorskip("kubernetes")
    docs = manifests(value_set)
    args, _, env = parse_container(container(deployment(docs, "coordinator")), monkeypatch)
    assert args.discovery == "kubernetes" and args.k8s_namespace == NAMESPACE
    assert "PDSERVE_PREFILL_WORKERS" not in env and "PDSERVE_DECODE_WORKERS" not in env
    slice_labels = {s["metadata"]["name"]: endpointslice_labels(s) for s in find(docs, "Service")}
    assert len(slice_labels) == 3
    for role in WORKERS:
        selector = LabelSelector.parse(getattr(args, f"{role}_selector"))
        svc = one(docs, "Service", f"{FULLNAME}-{role}-headless")
        assert svc["spec"]["clusterIP"] == "None" and not svc["spec"]["publishNotReadyAddresses"]
        for name, labels in slice_labels.items():
            assert selector.matches(labels) == (name == svc["metadata"]["name"]), name
        for component in ("coordinator", *WORKERS):
            matched = selects(
                {"matchLabels": svc["spec"]["selector"]}, pod_labels(deployment(docs, component))
            )
            assert matched == (component == role)
        # A slice's port carries the Service port's name and the pod's target port number.
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == args.k8s_port_name]
        worker = container(deployment(docs, role))
        (target,) = [p for p in worker["ports"] if p["name"] == port["targetPort"]]
        worker_args, _, _ = parse_container(worker, monkeypatch)
        assert target["containerPort"] == worker_args.port
    # The coordinator can read them: its pods run as the ServiceAccount the Role is bound to.
    (role,) = find(docs, "Role")
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"])
    spec = deployment(docs, "coordinator")["spec"]["template"]["spec"]
    assert spec.get("automountServiceAccountToken", True) is True
    # And build_discovery takes these flags (a kubeconfig stands in for the in-cluster config;
    # nothing connects).
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    args, _, _ = parse_container(container(deployment(docs, "coordinator")), monkeypatch)
    assert discovery_of(args).roles == set(WORKERS)


@pytest.mark.parametrize("value_set", ["default", "scale-3p-5d"])
def test_static_discovery_points_at_the_headless_services(value_set: str, monkeypatch) -> None:
    docs = render(value_set, "coordinator.discovery=static")
    args, _, env = parse_container(container(deployment(docs, "coordinator")), monkeypatch)
    assert args.discovery == "static"
    assert not any(n.endswith("_SELECTOR") or n.startswith("PDSERVE_K8S_") for n in env)
    for role, addresses in [("prefill", args.prefill_workers), ("decode", args.decode_workers)]:
        svc = one(docs, "Service", f"{FULLNAME}-{role}-headless")
        host, port = addresses.rsplit(":", 1)
        assert host == f"{FULLNAME}-{role}-headless.{NAMESPACE}.svc.cluster.local"
        grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert int(port) == grpc_port["port"]
    discovery = discovery_of(args)
    assert isinstance(discovery, StaticDiscovery) and discovery.roles == set(WORKERS)
    coord = one(docs, "Service", FULLNAME)
    assert selects(
        {"matchLabels": coord["spec"]["selector"]}, pod_labels(deployment(docs, "coordinator"))
    )
    assert sorted(p["name"] for p in coord["spec"]["ports"]) == ["grpc", "http", "metrics"]


def test_notes_say_how_workers_are_found() -> None:
    def notes(*sets: str) -> str:
        args = ["install", RELEASE, str(CHART), "--dry-run", "--namespace", NAMESPACE]
        for s in sets:
            args += ["--set", s]
        out = helm(*args).stdout
        return out[out.index("NOTES:") :]

    default = notes("decode.replicas=3")
    assert f"EndpointSlices of {FULLNAME}-prefill-headless and {FULLNAME}-decode-headless" in (
        default
    )
    assert "pick_first" not in default and "issue 5" not in default
    static = notes("decode.replicas=3", "coordinator.discovery=static")
    assert "pick_first" in static and "EndpointSlices" not in static
    assert "must be allowed to list and watch" in notes("rbac.create=false")
    assert "Expert parallelism" not in default
    ep = notes("decode.expertParallel=2", "decode.gpus=2")
    assert "every decode pod runs 2 ranks" in ep and "gRPC ports 50071-50072" in ep
    assert "metrics 9090-9091" in ep and "prefill pod runs" not in ep


def test_coordinator_serves_the_http_api(monkeypatch: pytest.MonkeyPatch) -> None:
    c = container(deployment(manifests("default"), "coordinator"))
    env = env_of(c)
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(c["args"])
    assert args.command == "coordinator" and args.http_port == 8000 and args.api_key is None
    docs = render(
        "default",
        "coordinator.http.apiKeySecret.name=pdserve-key",
        "coordinator.http.servedModelName=smol",
    )
    env = env_of(container(deployment(docs, "coordinator")))
    assert env["PDSERVE_API_KEY_FILE"] == "/etc/pdserve/api-keys/api-key"
    assert "PDSERVE_API_KEY" not in env
    assert env["PDSERVE_SERVED_MODEL_NAME"] == "smol"
    off = render("default", "coordinator.http.enabled=false")
    c = container(deployment(off, "coordinator"))
    assert "PDSERVE_HTTP_PORT" not in env_of(c) and "http" not in [p["name"] for p in c["ports"]]
    assert "http" not in [p["name"] for p in one(off, "Service", FULLNAME)["spec"]["ports"]]


def test_services_target_named_container_ports() -> None:
    docs = manifests("everything")
    for svc in find(docs, "Service"):
        component = svc["metadata"]["labels"]["app.kubernetes.io/component"]
        ports = {p["name"] for p in container(deployment(docs, component))["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"{svc['metadata']['name']}: {p}"
    coord = one(docs, "Service", FULLNAME)
    assert "http" in [p["name"] for p in coord["spec"]["ports"]]


def test_rbac_grants_only_endpointslice_reads() -> None:
    docs = manifests("default")
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    (role,) = find(docs, "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    (binding,) = find(docs, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (sa,) = find(docs, "ServiceAccount")
    coord_spec = deployment(docs, "coordinator")["spec"]["template"]["spec"]
    assert coord_spec["serviceAccountName"] == sa["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]
    for role_name in WORKERS:  # workers need no API access at all
        spec = deployment(docs, role_name)["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("value_set", ["default", "everything", "expert-parallel", "tls"])
def test_network_policies_match_the_pods(value_set: str) -> None:
    docs = manifests(value_set)
    labels = {c: pod_labels(deployment(docs, c)) for c in ("coordinator", *WORKERS)}
    policies = {p["metadata"]["name"]: p for p in find(docs, "NetworkPolicy")}
    assert set(policies) == {f"{FULLNAME}-{c}" for c in labels}
    test_pod = find(docs, "Pod")[0]["metadata"]["labels"]

    def sources(rule: dict) -> set[str]:
        """The chart components a rule admits ('*' for any peer)."""
        if "from" not in rule:
            return {"*"}
        out = set()
        for peer in rule["from"]:
            if "podSelector" in peer and "namespaceSelector" not in peer:
                out |= {c for c, lab in labels.items() if selects(peer["podSelector"], lab)}
                if selects(peer["podSelector"], test_pod):
                    out.add("test")
            else:
                out.add("external")
        return out

    for component in labels:
        policy = policies[f"{FULLNAME}-{component}"]["spec"]
        for other, other_labels in labels.items():
            assert selects(policy["podSelector"], other_labels) == (other == component)
        assert policy["policyTypes"] == ["Ingress"]
        ports = {p["name"] for p in container(deployment(docs, component))["ports"]}
        grpc_from: set[str] = set()
        all_ports_from: set[str] = set()
        for rule in policy["ingress"]:
            named = {p["port"] for p in rule.get("ports", [])}
            assert named <= ports, f"{component}: {named - ports} is no container port"
            # The plain health port is kubelet's (from the node): no rule opens it to pods.
            assert not {p for p in named if p.startswith("health")}, component
            if not named:
                all_ports_from |= sources(rule)
            elif "grpc" in named:
                grpc_from |= sources(rule)
                # Every expert-parallel rank's gRPC port is open to the same peers as rank 0's.
                assert {p for p in ports if p.split("-ep")[0] == "grpc"} <= named, component
            elif "metrics" in named:
                assert {p for p in ports if p.split("-ep")[0] == "metrics"} <= named, component
        if component == "prefill":
            assert grpc_from == {"coordinator"} and all_ports_from == {"decode"}
        elif component == "decode":
            assert grpc_from == {"coordinator"} and all_ports_from == {"prefill"}
        else:
            assert not all_ports_from
            expected = {"external", "test"} if value_set == "everything" else {"*"}
            assert grpc_from == expected


# --- observability ---------------------------------------------------------------------------


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


# --- tensor parallelism ------------------------------------------------------------------------


def test_tensor_parallel_pools_get_the_flag_and_a_gpu_per_rank(monkeypatch) -> None:
    docs = manifests("tensor-parallel")
    for role, ranks in (("prefill", 4), ("decode", 2)):
        c = container(deployment(docs, role))
        args, _, env = parse_container(c, monkeypatch)
        assert args.tensor_parallel == ranks and env["PDSERVE_TENSOR_PARALLEL"] == str(ranks)
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == ranks
        assert int(c["resources"]["requests"]["nvidia.com/gpu"]) == ranks
        assert [p["name"] for p in c["ports"]] == ["grpc", "metrics"]  # one endpoint
    # One GPU asked for but 2 ranks: the pod asks for 2; on CPU (gpus 0) for none.
    docs = render("default", "decode.tensorParallel=2")
    c = container(deployment(docs, "decode"))
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 2
    docs = render("cpu-only", "decode.tensorParallel=2")
    c = container(deployment(docs, "decode"))
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    args, _, env = parse_container(container(deployment(render("default"), "decode")), monkeypatch)
    assert args.tensor_parallel == 1 and "PDSERVE_TENSOR_PARALLEL" not in env


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["decode.tensorParallel=0"], "decode.tensorParallel must be an integer >= 1"),
        (["prefill.tensorParallel=1.5"], "prefill.tensorParallel must be an integer >= 1"),
        (
            ["decode.tensorParallel=2", "decode.expertParallel=2", "decode.gpus=2"],
            "decode.tensorParallel and decode.expertParallel cannot both be > 1",
        ),
        (
            ["decode.tensorParallel=2", "decode.device=cuda:1"],
            "decode.device cuda:1 would put every rank on one GPU",
        ),
    ],
)
def test_bad_tensor_parallel_values_fail_the_render(sets, message) -> None:
    for skip in ([], ["--skip-schema-validation"]):
        args = ["template", RELEASE, str(CHART), *skip]
        for s in sets:
            args += ["--set", s]
        result = helm(*args, check=False)
        assert result.returncode != 0
        if not skip and "values don't meet the specifications of the schema" in result.stderr:
            continue  # the schema caught it first
        assert message in result.stderr, result.stderr


# --- expert parallelism ------------------------------------------------------------------------


def test_expert_parallel_pools_get_the_flags_and_a_port_per_rank(monkeypatch) -> None:
    docs = render("default", "decode.expertParallel=2", "decode.gpus=2")
    c = container(deployment(docs, "decode"))
    args, _, env = parse_container(c, monkeypatch)
    assert args.expert_parallel == 2 and args.redundant_experts == 0
    assert "PDSERVE_REDUNDANT_EXPERTS" not in env
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 2
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [
        ("grpc", 50071),
        ("grpc-ep1", 50072),
        ("metrics", 9090),
        ("metrics-ep1", 9091),
    ]
    svc = one(docs, "Service", f"{FULLNAME}-decode-headless")
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("grpc", 50071, "grpc"),
        ("grpc-ep1", 50072, "grpc-ep1"),
        ("metrics", 9090, "metrics"),
        ("metrics-ep1", 9091, "metrics-ep1"),
    ]
    # The other pool, and the default, stay single-rank.
    prefill_args, _, prefill_env = parse_container(
        container(deployment(docs, "prefill")), monkeypatch
    )
    assert prefill_args.expert_parallel == 1 and "PDSERVE_EXPERT_PARALLEL" not in prefill_env
    assert "-ep1" not in yaml.safe_dump_all(manifests("default"))


def test_expert_parallel_ranks_reach_the_coordinator_as_workers(monkeypatch) -> None:
    """The EndpointSlice Kubernetes derives from each headless Service (its port names, the
    pod's port numbers), read by the coordinator's own discovery code with its own flags: one
    worker address per rank, on the port that rank listens on."""
    docs = manifests("expert-parallel")
    coord, _, _ = parse_container(container(deployment(docs, "coordinator")), monkeypatch)
    for role, ranks, redundant in (("prefill", 4, 4), ("decode", 2, 0)):
        c = container(deployment(docs, role))
        args, _, _ = parse_container(c, monkeypatch)
        assert (args.expert_parallel, args.redundant_experts) == (ranks, redundant)
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= ranks
        numbers = {p["name"]: p["containerPort"] for p in c["ports"]}
        svc = one(docs, "Service", f"{FULLNAME}-{role}-headless")
        ports = [
            {"name": p["name"], "port": numbers[p["targetPort"]]} for p in svc["spec"]["ports"]
        ]
        ref = {"kind": "Pod", "name": f"{role}-abc", "uid": "u1"}
        endpoint = {"addresses": [args.host], "conditions": {"ready": True}, "targetRef": ref}
        eslice = {"addressType": "IPv4", "ports": ports, "endpoints": [endpoint]}
        found = {a for _, a in slice_endpoints(eslice, coord.k8s_port_name).values()}
        assert found == {f"{args.host}:{args.port + r}" for r in range(ranks)}


def test_static_discovery_lists_every_rank_of_a_single_pod(monkeypatch) -> None:
    docs = render(
        "default", "decode.expertParallel=2", "decode.gpus=2", "coordinator.discovery=static"
    )
    args, _, _ = parse_container(container(deployment(docs, "coordinator")), monkeypatch)
    host = f"{FULLNAME}-decode-headless.{NAMESPACE}.svc.cluster.local"
    assert args.decode_workers.split(",") == [f"{host}:50071", f"{host}:50072"]
    assert "," not in args.prefill_workers
    assert discovery_of(args).roles == set(WORKERS)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["decode.expertParallel=0"], "decode.expertParallel must be an integer >= 1"),
        (["prefill.expertParallel=two"], "prefill.expertParallel must be an integer >= 1"),
        (["decode.expertParallel=1.5"], "decode.expertParallel must be an integer >= 1"),
        (
            ["decode.expertParallel=2"],
            "decode.gpus is 1 but decode.expertParallel is 2: each rank uses a GPU of its own",
        ),
        (
            ["decode.expertParallel=2", "decode.gpus=2", "decode.redundantExperts=3"],
            "decode.redundantExperts must be a multiple of decode.expertParallel (2), got 3",
        ),
        (["decode.redundantExperts=2"], "decode.redundantExperts needs decode.expertParallel >= 2"),
        (
            ["decode.expertParallel=2", "decode.gpus=2", "decode.device=cuda:0"],
            "decode.device cuda:0 would put every rank on one GPU",
        ),
        (
            ["decode.expertParallel=2", "decode.gpus=2", "decode.port=9089"],
            "decode: gRPC ports 9089..9090 and metrics ports 9090..9091 overlap",
        ),
        (
            [
                "decode.expertParallel=2",
                "decode.gpus=2",
                "decode.replicas=2",
                "coordinator.discovery=static",
            ],
            "decode.expertParallel > 1 with coordinator.discovery=static needs decode.replicas: 1",
        ),
    ],
)
def test_bad_expert_parallel_values_fail_the_render(sets: list[str], message: str) -> None:
    """The template's own checks, which also hold with --skip-schema-validation (the schema
    rejects the non-integers and values below 1 first: see test_schema_rejects_bad_values)."""
    for skip in ([], ["--skip-schema-validation"]):
        args = ["template", RELEASE, str(CHART), *skip]
        for s in sets:
            args += ["--set", s]
        result = helm(*args, check=False)
        assert result.returncode != 0
        if not skip and "values don't meet the specifications of the schema" in result.stderr:
            continue  # the schema caught it first
        assert message in result.stderr, result.stderr


# --- TLS between the pods, TLS on the public ports, API keys ------------------------------------

TLS_DIR = "/etc/pdserve/tls"
OWN_SECRET = ("tls.enabled=true", "tls.secretName=pdserve-internal-tls")


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


def file_of(dep: dict, path: str) -> tuple[dict, str]:
    """The volume that holds `path` in the pod's only container, and the name of the file
    in it (the Secret's or ConfigMap's key). The mount must be whole, read-only, with no
    subPath: kubelet does not update subPath mounts, and rotation needs those updates."""
    c = container(dep)
    (m,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert m.get("readOnly") is True and "subPath" not in m, m
    name = path[len(m["mountPath"].rstrip("/")) + 1 :]
    vol = volume(dep, m["name"])
    assert vol is not None
    source = vol.get("secret") or vol.get("configMap")
    assert source is not None, vol
    items = source.get("items")
    if items is None:
        return vol, name
    (item,) = [i for i in items if i["path"] == name]
    return vol, item["key"]


@pytest.mark.parametrize(
    ("value_set", "sets", "secret"),
    [("tls", (), f"{FULLNAME}-tls"), ("default", OWN_SECRET, "pdserve-internal-tls")],
)
def test_tls_mounts_the_secret_in_every_pod_and_probes_the_health_port(
    value_set: str, sets: tuple[str, ...], secret: str
) -> None:
    docs = render(value_set, *sets)
    server_name = "pdserve.llm.internal" if value_set == "tls" else "pdserve-internal"
    for component in ("coordinator", *WORKERS):
        dep = deployment(docs, component)
        c = container(dep)
        env = env_of(c)
        assert set(TLS_VARS) <= set(env), component
        assert env["PDSERVE_TLS_SERVER_NAME"] == server_name
        for var, key in (
            ("PDSERVE_TLS_CERT", "tls.crt"),
            ("PDSERVE_TLS_KEY", "tls.key"),
            ("PDSERVE_TLS_CA", "ca.crt"),
        ):
            assert env[var].startswith(TLS_DIR + "/")
            vol, found = file_of(dep, env[var])
            assert vol["secret"]["secretName"] == secret and found == key, component
        # Group-readable by the pod's fsGroup, and no more.
        assert volume(dep, "tls")["secret"]["defaultMode"] == 0o440
        # The plain health port: a named container port, PDSERVE_HEALTH_PORT, every probe.
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["health"] == int(env["PDSERVE_HEALTH_PORT"]) == 8086
        assert len(set(ports.values())) == len(ports), f"{component}: ports collide: {ports}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": ports["health"]}, f"{component} {probe}"
        # An expert-parallel rank r serves health on health + r, like its other ports.
        ranks = int(env.get("PDSERVE_EXPERT_PARALLEL", 1))
        named = {n: p for n, p in ports.items() if n.startswith("health-ep")}
        assert named == {f"health-ep{r}": 8086 + r for r in range(1, ranks)}, component
        if value_set == "tls" and component == "decode":
            assert ranks == 2
        # The public ports stay plain unless coordinator.publicTls is set.
        assert not {"PDSERVE_PUBLIC_TLS_CERT", "PDSERVE_PUBLIC_TLS_KEY"} & set(env)
        assert volume(dep, "public-tls") is None
    # No Service publishes the health port (kubelet probes the pod itself).
    for svc in find(docs, "Service"):
        assert "health" not in {p["targetPort"] for p in svc["spec"]["ports"]}
    # The helm test Pod calls the coordinator's plain public port: no certificate.
    (pod,) = find(docs, "Pod")
    assert not set(TLS_VARS) & set(env_of(pod["spec"]["containers"][0]))
    assert bool(find(docs, "Certificate")) == (value_set == "tls")


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_without_tls_no_pod_gets_any_of_it(value_set: str) -> None:
    # The tls value set with tls.enabled off keeps only its Certificate.
    docs = render("tls", "tls.enabled=false") if value_set == "tls" else manifests(value_set)
    assert bool(find(docs, "Certificate")) == (value_set == "tls")
    for component in ("coordinator", *WORKERS):
        dep = deployment(docs, component)
        c = container(dep)
        env = env_of(c)
        assert not {*TLS_VARS, "PDSERVE_HEALTH_PORT"} & set(env), component
        assert not {"PDSERVE_PUBLIC_TLS_CERT", "PDSERVE_PUBLIC_TLS_KEY"} & set(env)
        assert not [p for p in c["ports"] if p["name"].startswith("health")]
        assert volume(dep, "tls") is None and mount(c, "tls") is None
        assert volume(dep, "tls-ca") is None
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": grpc_port}, f"{component} {probe}"


# The fields of cert-manager.io/v1 Certificate this chart writes, from cert-manager's CRD:
# kubernetes-validate ships no CRD schemas, so the Certificate is checked here instead.
CERTIFICATE_SPEC_FIELDS = {
    "secretName", "dnsNames", "usages", "duration", "renewBefore", "privateKey", "issuerRef",
}  # fmt: skip
CERTIFICATE_USAGES = {
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
    "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
}  # fmt: skip


def test_cert_manager_renders_the_certificate_the_pods_mount() -> None:
    docs = manifests("tls")
    (cert,) = find(docs, "Certificate")
    assert cert["apiVersion"] == "cert-manager.io/v1"
    assert cert["metadata"]["name"] == f"{FULLNAME}-tls"
    assert cert["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    spec = cert["spec"]
    assert set(spec) <= CERTIFICATE_SPEC_FIELDS, set(spec) - CERTIFICATE_SPEC_FIELDS
    assert spec["dnsNames"] == ["pdserve.llm.internal"]
    assert {"server auth", "client auth"} <= set(spec["usages"]) <= CERTIFICATE_USAGES
    assert spec["issuerRef"] == {
        "name": "pdserve-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert (spec["duration"], spec["renewBefore"]) == ("720h", "240h")
    assert spec["privateKey"] == {"rotationPolicy": "Always"}  # a new key at every renewal
    # The Secret it writes is the one every pod mounts; the name peers verify is the SAN.
    for component in ("coordinator", *WORKERS):
        dep = deployment(docs, component)
        assert volume(dep, "tls")["secret"]["secretName"] == spec["secretName"]
        assert env_of(container(dep))["PDSERVE_TLS_SERVER_NAME"] in spec["dnsNames"]
    # A Secret name of one's own; cert-manager's defaults for the lifetime; the Certificate
    # alone (tls.enabled off), so the Secret exists before the pods first mount it.
    docs = render(
        "tls",
        "tls.enabled=false",
        "tls.secretName=my-tls",
        "tls.certManager.duration=",
        "tls.certManager.renewBefore=",
    )
    (cert,) = find(docs, "Certificate")
    assert cert["spec"]["secretName"] == "my-tls"
    assert "duration" not in cert["spec"] and "renewBefore" not in cert["spec"]
    assert not any(volume(deployment(docs, c), "tls") for c in ("coordinator", *WORKERS))
    assert not find(render("default", *OWN_SECRET), "Certificate")


def test_a_trust_bundle_replaces_the_secrets_ca() -> None:
    """While the CA changes, the pods trust a bundle holding both (e.g. trust-manager's)."""
    docs = render("tls", "tls.trustBundle.configMapName=pdserve-ca-bundle")
    for component in ("coordinator", *WORKERS):
        dep = deployment(docs, component)
        env = env_of(container(dep))
        vol, key = file_of(dep, env["PDSERVE_TLS_CA"])
        assert vol["configMap"]["name"] == "pdserve-ca-bundle" and key == "ca.crt"
        vol, key = file_of(dep, env["PDSERVE_TLS_CERT"])
        assert vol["secret"]["secretName"] == f"{FULLNAME}-tls" and key == "tls.crt"


def test_public_tls_mounts_into_the_coordinator_only(monkeypatch) -> None:
    docs = render("default", "coordinator.publicTls.secretName=pdserve-public-tls")
    coord = deployment(docs, "coordinator")
    c = container(coord)
    args, _, env = parse_container(c, monkeypatch)
    assert (args.public_tls_cert, args.public_tls_key) == (
        env["PDSERVE_PUBLIC_TLS_CERT"],
        env["PDSERVE_PUBLIC_TLS_KEY"],
    )
    assert args.health_port == int(env["PDSERVE_HEALTH_PORT"]) and args.tls_cert is None
    for var, key in (("PDSERVE_PUBLIC_TLS_CERT", "tls.crt"), ("PDSERVE_PUBLIC_TLS_KEY", "tls.key")):
        vol, found = file_of(coord, env[var])
        assert vol["secret"]["secretName"] == "pdserve-public-tls" and found == key
    # Its gRPC port now speaks TLS, which kubelet's gRPC probes do not: they move to health.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["health"] == int(env["PDSERVE_HEALTH_PORT"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": ports["health"]}
    assert not set(TLS_VARS) & set(env)  # internal mTLS is a separate switch
    svc = {p["name"]: p for p in one(docs, "Service", FULLNAME)["spec"]["ports"]}
    assert svc["http"]["appProtocol"] == "https" and svc["grpc"]["appProtocol"] == "grpc"
    for role in WORKERS:
        dep = deployment(docs, role)
        worker_env = env_of(container(dep))
        assert not {"PDSERVE_PUBLIC_TLS_CERT", "PDSERVE_HEALTH_PORT"} & set(worker_env)
        assert volume(dep, "public-tls") is None
    plain = {p["name"]: p for p in one(manifests("default"), "Service", FULLNAME)["spec"]["ports"]}
    assert plain["http"]["appProtocol"] == "http"
    both = render("default", *OWN_SECRET, "coordinator.publicTls.secretName=pdserve-public-tls")
    env = env_of(container(deployment(both, "coordinator")))
    assert set(TLS_VARS) <= set(env) and "PDSERVE_PUBLIC_TLS_CERT" in env


def test_api_keys_arrive_as_a_file_the_coordinator_rereads(tmp_path: Path, monkeypatch) -> None:
    from pdserve.services.auth import ApiKeys

    docs = manifests("tls")
    coord = deployment(docs, "coordinator")
    args, _, env = parse_container(container(coord), monkeypatch)
    assert "PDSERVE_API_KEY" not in env and args.api_key is None
    assert args.api_key_file == env["PDSERVE_API_KEY_FILE"]
    vol, key = file_of(coord, args.api_key_file)
    assert vol["secret"]["secretName"] == "pdserve-api-keys" and key == "keys"
    for role in WORKERS:
        assert "PDSERVE_API_KEY_FILE" not in env_of(container(deployment(docs, role)))
        assert volume(deployment(docs, role), "api-keys") is None
    # The Secret's value during a rotation: the old key and the new one, a line each.
    keys = tmp_path / "keys"
    keys.write_text("old-key\nnew-key\n")
    accepted = ApiKeys.configured(None, str(keys))
    assert accepted is not None
    assert accepted.allows("Bearer old-key") and accepted.allows("Bearer new-key")
    assert not accepted.allows("Bearer other")
    # The key guards gRPC too, so it is set with the HTTP API off as well.
    off = render(
        "default", "coordinator.http.enabled=false", "coordinator.http.apiKeySecret.name=k"
    )
    assert "PDSERVE_API_KEY_FILE" in env_of(container(deployment(off, "coordinator")))
    assert volume(deployment(manifests("default"), "coordinator"), "api-keys") is None


def test_helm_test_hook_sends_the_first_api_key(tmp_path: Path) -> None:
    """The hook's script with the mounted key file (a comment, then the keys of a
    rotation): the stand-in `pdserve` answers only when PDSERVE_API_KEY is the first key."""
    docs = render("default", "coordinator.http.apiKeySecret.name=pdserve-api-keys")
    (pod,) = find(docs, "Pod")
    (c,) = pod["spec"]["containers"]
    env = env_of(c)
    (m,) = [m for m in c["volumeMounts"] if env["API_KEY_FILE"].startswith(m["mountPath"] + "/")]
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == m["name"]]
    assert vol["secret"]["secretName"] == "pdserve-api-keys" and m["readOnly"] is True
    keys = tmp_path / "api-key"
    keys.write_text("# rotating\n\n  first-key  \nsecond-key\n")
    stub = tmp_path / "pdserve"
    stub.write_text(
        '#!/bin/sh\n[ "$PDSERVE_API_KEY" = first-key ] && echo "Paris." || echo "denied"\n'
    )
    stub.chmod(0o755)
    env = {**env, "API_KEY_FILE": str(keys), "PATH": f"{tmp_path}:/usr/bin:/bin"}
    result = subprocess.run(
        [*c["command"], *c["args"]], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["tls.enabled=true"], "tls.enabled needs tls.secretName"),
        (
            ["tls.certManager.enabled=true"],
            "tls.certManager.enabled needs tls.certManager.issuerRef.name",
        ),
        (
            [*OWN_SECRET, "tls.healthPort=9090"],
            "health ports 9090..9090 (tls.healthPort + rank) overlap metrics.port 9090..9090",
        ),
        (
            ["coordinator.publicTls.secretName=p", "tls.healthPort=8000"],
            "coordinator: health ports 8000..8000 (tls.healthPort + rank) overlap "
            "coordinator.http.port 8000..8000",
        ),
        (
            [*OWN_SECRET, "decode.expertParallel=2", "decode.gpus=2", "tls.healthPort=50070"],
            "decode: health ports 50070..50071 (tls.healthPort + rank) overlap decode.port "
            "50071..50072",
        ),
        (
            [*OWN_SECRET, "prefill.expertParallel=2", "prefill.gpus=2", "tls.healthPort=65535"],
            "prefill: health ports 65535..65536 (tls.healthPort + rank) go past 65535",
        ),
    ],
)
def test_bad_tls_values_fail_the_render(sets: list[str], message: str) -> None:
    for skip in ([], ["--skip-schema-validation"]):
        args = ["template", RELEASE, str(CHART), *skip]
        for s in sets:
            args += ["--set", s]
        result = helm(*args, check=False)
        assert result.returncode != 0
        if not skip and "values don't meet the specifications of the schema" in result.stderr:
            continue  # the schema caught it first
        assert message in result.stderr, result.stderr


# --- the KV disk tier ------------------------------------------------------------------------

KV_DIR = "/var/cache/pdserve-kv"
KV_VARS = ("PDSERVE_KV_OFFLOAD_DIR", "PDSERVE_KV_OFFLOAD_GB")
# Each pool's tier on its own: prefill on an emptyDir, decode on an existing claim.
KV_OFFLOAD = {
    "prefill": ("prefill.kvOffload.enabled=true",),
    "decode": ("decode.kvOffload.enabled=true", "decode.kvOffload.claimName=kv"),
}


def render_json(*sets: str) -> list[dict]:
    """helm template with --set-json (plain --set turns 0.5 into a string)."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        args += ["--set-json", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def assert_no_kv_offload(dep: dict) -> None:
    assert not set(KV_VARS) & set(env_of(container(dep)))
    assert volume(dep, "kv-offload") is None and mount(container(dep), "kv-offload") is None


@pytest.mark.parametrize("role", WORKERS)
def test_kv_offload_manifests_pass_kubernetes_validate_strict(role: str) -> None:
    for version in kube_versions():
        for doc in render("default", *KV_OFFLOAD[role], kube=version):
            what = f"kvOffload {role} k8s {version}: {doc['kind']}/{doc['metadata']['name']}"
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{what}: {exc}")


def test_kv_offload_on_an_emptydir(monkeypatch) -> None:
    docs = render("default", *KV_OFFLOAD["prefill"])
    dep = deployment(docs, "prefill")
    c = container(dep)
    args, dests, env = parse_container(c, monkeypatch)
    assert {"kv_offload_dir", "kv_offload_gb"} <= dests
    assert env["PDSERVE_KV_OFFLOAD_DIR"] == KV_DIR == args.kv_offload_dir
    assert env["PDSERVE_KV_OFFLOAD_GB"] == "4" and args.kv_offload_gb == 4.0
    assert mount(c, "kv-offload") == {"name": "kv-offload", "mountPath": KV_DIR}
    # ceil(4 GiB x 1.1): a little more than the tier, so kubelet does not evict the pod.
    assert volume(dep, "kv-offload") == {"name": "kv-offload", "emptyDir": {"sizeLimit": "5Gi"}}
    assert "strategy" not in dep["spec"]
    assert_no_kv_offload(deployment(docs, "decode"))
    assert_no_kv_offload(deployment(docs, "coordinator"))


@pytest.mark.parametrize(
    ("values", "size_gb", "empty_dir"),
    [
        ({"sizeGb": 10}, 10.0, {"sizeLimit": "11Gi"}),
        ({"sizeGb": 0.5}, 0.5, {"sizeLimit": "1Gi"}),
        ({"sizeGb": 2.3, "emptyDir": {"medium": "Memory"}}, 2.3,
         {"medium": "Memory", "sizeLimit": "3Gi"}),
        ({"mountPath": "/scratch/kv/"}, 4.0, {"sizeLimit": "5Gi"}),
    ],
)  # fmt: skip
def test_kv_offload_emptydir_sizes(
    values: dict, size_gb: float, empty_dir: dict, monkeypatch
) -> None:
    docs = render_json(f"decode.kvOffload={json.dumps({'enabled': True, **values})}")
    dep = deployment(docs, "decode")
    args, _, _ = parse_container(container(dep), monkeypatch)
    assert args.kv_offload_gb == size_gb
    path = values.get("mountPath", KV_DIR).rstrip("/")
    assert args.kv_offload_dir == path == mount(container(dep), "kv-offload")["mountPath"]
    assert volume(dep, "kv-offload") == {"name": "kv-offload", "emptyDir": empty_dir}


def test_kv_offload_emptydir_holds_a_tier_per_expert_parallel_rank(monkeypatch) -> None:
    """Each rank keeps a tier of sizeGb of its own (subfolder epR): ceil(4 x 1.1 x 2) = 9."""
    docs = render("default", *KV_OFFLOAD["prefill"], "prefill.expertParallel=2", "prefill.gpus=2")
    dep = deployment(docs, "prefill")
    args, _, _ = parse_container(container(dep), monkeypatch)
    assert args.kv_offload_gb == 4.0 and args.expert_parallel == 2
    assert volume(dep, "kv-offload")["emptyDir"] == {"sizeLimit": "9Gi"}


def test_kv_offload_on_a_claim(monkeypatch) -> None:
    docs = render("default", *KV_OFFLOAD["decode"], "decode.kvOffload.sizeGb=20")
    dep = deployment(docs, "decode")
    c = container(dep)
    args, _, env = parse_container(c, monkeypatch)
    assert env["PDSERVE_KV_OFFLOAD_DIR"] == KV_DIR == args.kv_offload_dir
    assert env["PDSERVE_KV_OFFLOAD_GB"] == "20" and args.kv_offload_gb == 20.0
    assert mount(c, "kv-offload") == {"name": "kv-offload", "mountPath": KV_DIR}
    assert volume(dep, "kv-offload") == {
        "name": "kv-offload",
        "persistentVolumeClaim": {"claimName": "kv"},
    }
    # One pod per folder: the old pod lets go of the claim before the new one mounts it.
    assert dep["spec"]["strategy"] == {"type": "Recreate"} and dep["spec"]["replicas"] == 1
    assert_no_kv_offload(deployment(docs, "prefill"))
    # A claim with autoscaling up to one pod is fine too.
    docs = render(
        "default",
        *KV_OFFLOAD["decode"],
        "decode.autoscaling.enabled=true",
        "decode.autoscaling.maxReplicas=1",
    )
    assert volume(deployment(docs, "decode"), "kv-offload")["persistentVolumeClaim"] == {
        "claimName": "kv"
    }


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_without_kv_offload_no_pod_gets_any_of_it(value_set: str) -> None:
    docs = manifests(value_set)
    for component in ("coordinator", *WORKERS):
        dep = deployment(docs, component)
        assert not [n for n in env_of(container(dep)) if n.startswith("PDSERVE_KV_OFFLOAD")]
        assert_no_kv_offload(dep)
        assert "strategy" not in dep["spec"]
    # Nor does a claim name alone, with the tier off.
    docs = render("default", "decode.kvOffload.claimName=kv", "decode.replicas=3")
    assert_no_kv_offload(deployment(docs, "decode"))


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            [*KV_OFFLOAD["decode"], "decode.replicas=2"],
            "decode.kvOffload.claimName kv would be one folder for several decode pods",
        ),
        (
            [*KV_OFFLOAD["decode"], "decode.autoscaling.enabled=true"],
            "decode.kvOffload.claimName kv would be one folder for several decode pods",
        ),
        (
            [*KV_OFFLOAD["prefill"], "prefill.kvOffload.mountPath=/tmp"],
            "prefill.kvOffload.mountPath /tmp is already a volume of the pod",
        ),
        (
            [*KV_OFFLOAD["prefill"], "model.source=pvc", "model.pvc.claimName=m",
             "prefill.kvOffload.mountPath=/models/"],
            "prefill.kvOffload.mountPath /models is already a volume of the pod",
        ),
        (
            [*KV_OFFLOAD["prefill"], "prefill.kvOffload.sizeGb=0"],
            "prefill.kvOffload.sizeGb must be > 0 (GiB), got 0",
        ),
        (
            [*KV_OFFLOAD["decode"], "decode.kvOffload.mountPath=kv"],
            'decode.kvOffload.mountPath must be an absolute path other than /, got "kv"',
        ),
    ],
)  # fmt: skip
def test_bad_kv_offload_values_fail_the_render(sets: list[str], message: str) -> None:
    for skip in ([], ["--skip-schema-validation"]):
        args = ["template", RELEASE, str(CHART), *skip]
        for s in sets:
            args += ["--set", s]
        result = helm(*args, check=False)
        assert result.returncode != 0
        if not skip and "values don't meet the specifications of the schema" in result.stderr:
            continue  # the schema caught it first
        assert message in result.stderr, result.stderr


# --- the shared KV tier ---------------------------------------------------------------------

KV_SHARED_DIR = "/var/cache/pdserve-kv-shared"
# One ReadWriteMany claim for every worker pod of kvShared.pools (both pools by default).
KV_SHARED = ("kvShared.enabled=true", "kvShared.claimName=kv-rwx")


def assert_no_kv_shared(dep: dict) -> None:
    assert not [n for n in env_of(container(dep)) if n.startswith("PDSERVE_KV_SHARED")]
    assert volume(dep, "kv-shared") is None and mount(container(dep), "kv-shared") is None


def assert_kv_shared(
    dep: dict,
    monkeypatch: pytest.MonkeyPatch,
    size_gb: float = 16.0,
    path: str = KV_SHARED_DIR,
    claim: str = "kv-rwx",
) -> None:
    """The pool's worker gets the shared tier: the real CLI reads its flags from the env."""
    c = container(dep)
    args, dests, env = parse_container(c, monkeypatch)
    assert {"kv_shared_dir", "kv_shared_gb"} <= dests
    assert env["PDSERVE_KV_SHARED_DIR"] == path == args.kv_shared_dir
    assert float(env["PDSERVE_KV_SHARED_GB"]) == size_gb == args.kv_shared_gb
    assert mount(c, "kv-shared") == {"name": "kv-shared", "mountPath": path}
    assert volume(dep, "kv-shared") == {
        "name": "kv-shared",
        "persistentVolumeClaim": {"claimName": claim},
    }
    # Sharing is the point: no Recreate strategy (and no replica limit, see below).
    assert "strategy" not in dep["spec"]


@pytest.mark.parametrize(
    "sets",
    [
        KV_SHARED,
        (*KV_SHARED, "kvShared.pools={decode}"),
        (*KV_SHARED, *KV_OFFLOAD["prefill"], *KV_OFFLOAD["decode"]),
    ],
    ids=["both-pools", "decode-only", "with-kv-offload"],
)
def test_kv_shared_manifests_pass_kubernetes_validate_strict(sets: tuple[str, ...]) -> None:
    for version in kube_versions():
        for doc in render("default", *sets, kube=version):
            what = f"kvShared {sets} k8s {version}: {doc['kind']}/{doc['metadata']['name']}"
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{what}: {exc}")


def test_kv_shared_on_every_worker_pod(monkeypatch) -> None:
    docs = render("default", *KV_SHARED, "prefill.replicas=3", "decode.autoscaling.enabled=true")
    for role in WORKERS:
        assert_kv_shared(deployment(docs, role), monkeypatch)
        assert_no_kv_offload(deployment(docs, role))
    # Many pods on one claim: the replicas and the autoscaler stay as they were.
    assert deployment(docs, "prefill")["spec"]["replicas"] == 3
    assert "replicas" not in deployment(docs, "decode")["spec"]
    assert_no_kv_shared(deployment(docs, "coordinator"))


def test_kv_shared_on_the_listed_pools_only(monkeypatch) -> None:
    # prefill is not listed, so its prefix caching may be off.
    docs = render(
        "default", *KV_SHARED, "kvShared.pools={decode}", "prefill.engine.prefixCaching=false"
    )
    assert_kv_shared(deployment(docs, "decode"), monkeypatch)
    assert_no_kv_shared(deployment(docs, "prefill"))
    assert_no_kv_shared(deployment(docs, "coordinator"))
    docs = render("default", *KV_SHARED, "kvShared.pools={prefill}")
    assert_kv_shared(deployment(docs, "prefill"), monkeypatch)
    assert_no_kv_shared(deployment(docs, "decode"))


def test_kv_shared_sizes_and_paths(monkeypatch) -> None:
    shared = {"enabled": True, "claimName": "shared", "sizeGb": 0.5, "mountPath": "/kv/shared/"}
    docs = render_json(f"kvShared={json.dumps(shared)}")
    for role in WORKERS:
        assert_kv_shared(deployment(docs, role), monkeypatch, 0.5, "/kv/shared", "shared")


def test_kv_shared_beside_the_pods_own_tier(monkeypatch) -> None:
    docs = render("default", *KV_SHARED, *KV_OFFLOAD["prefill"], "kvShared.sizeGb=64")
    dep = deployment(docs, "prefill")
    assert_kv_shared(dep, monkeypatch, size_gb=64.0)
    args, _, _ = parse_container(container(dep), monkeypatch)
    assert args.kv_offload_dir == KV_DIR != args.kv_shared_dir
    assert volume(dep, "kv-offload") == {"name": "kv-offload", "emptyDir": {"sizeLimit": "5Gi"}}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_without_kv_shared_no_pod_gets_any_of_it(value_set: str) -> None:
    docs = manifests(value_set)
    text = yaml.safe_dump_all(docs)
    assert "PDSERVE_KV_SHARED" not in text and "kv-shared" not in text
    for component in ("coordinator", *WORKERS):
        assert_no_kv_shared(deployment(docs, component))
    # Nor does a claim name alone, with the tier off.
    docs = render("default", "kvShared.claimName=kv-rwx")
    assert "kv-shared" not in yaml.safe_dump_all(docs)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["kvShared.enabled=true"],
            "kvShared.claimName is required with kvShared.enabled",
        ),
        (
            [*KV_SHARED, "kvShared.pools={prefill,coordinator}"],
            'kvShared.pools: "coordinator" is not a worker pool (prefill or decode)',
        ),
        (
            [*KV_SHARED, "json:kvShared.pools=[]"],
            "kvShared.pools lists no pool",
        ),
        (
            [*KV_SHARED, "kvShared.pools=decode"],
            "kvShared.pools must be a list of worker pools (prefill, decode), got decode",
        ),
        (
            [*KV_SHARED, "kvShared.sizeGb=0"],
            "kvShared.sizeGb must be > 0 (GiB), got 0",
        ),
        (
            [*KV_SHARED, "kvShared.mountPath=kv"],
            'kvShared.mountPath must be an absolute path other than /, got "kv"',
        ),
        (
            [*KV_SHARED, "kvShared.mountPath=/dev/shm/"],
            "kvShared.mountPath /dev/shm is already a volume of the pod",
        ),
        (
            [*KV_SHARED, "tls.enabled=true", "tls.secretName=t",
             "kvShared.mountPath=/etc/pdserve/tls"],
            "kvShared.mountPath /etc/pdserve/tls is already a volume of the pod",
        ),
        (
            [*KV_SHARED, *KV_OFFLOAD["decode"], f"kvShared.mountPath={KV_DIR}/"],
            f"kvShared.mountPath {KV_DIR} is decode.kvOffload.mountPath too",
        ),
        (
            [*KV_SHARED, "decode.engine.prefixCaching=false"],
            "kvShared holds prefix-cache blocks: decode.engine.prefixCaching must be on",
        ),
    ],
)  # fmt: skip
def test_bad_kv_shared_values_fail_the_render(sets: list[str], message: str) -> None:
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


# --- security, the test hook ----------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_security_contexts(value_set: str) -> None:
    for doc in manifests(value_set):
        if doc["kind"] not in ("Deployment", "Pod"):
            continue
        spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "privileged" not in sc


def test_helm_test_hook_sends_one_generate() -> None:
    docs = manifests("default")
    (pod,) = find(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    env = env_of(c)
    assert env["ADDRESS"] == f"{FULLNAME}:50051"
    assert env["EXPECT"] == "Paris"
    script = c["args"][0]
    line = next(ln for ln in script.splitlines() if "pdserve complete" in ln)
    command = line.split("$(", 1)[1].rsplit(")", 1)[0]
    command = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], command)
    argv = shlex.split(command)
    assert argv[0] == "pdserve"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "complete" and args.chat
    assert args.address == env["ADDRESS"] and args.max_tokens == 32
    assert args.prompt == env["PROMPT"]
    assert not find(render("default", "helmTest.enabled=false"), "Pod")


@pytest.mark.parametrize(
    ("answer", "passes"),
    [("The capital of France is Paris.", True), ("I do not know.", False), ("  ", False)],
)
def test_helm_test_hook_checks_the_answer(answer: str, passes: bool, tmp_path: Path) -> None:
    """The hook's shell script, run with a stand-in `pdserve` that prints `answer`."""
    (c,) = find(manifests("default"), "Pod")[0]["spec"]["containers"]
    stub = tmp_path / "pdserve"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$STUB_ANSWER"\n')
    stub.chmod(0o755)
    env = {**env_of(c), "STUB_ANSWER": answer, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    result = subprocess.run(
        [*c["command"], *c["args"]], env=env, capture_output=True, text=True, timeout=30
    )
    assert (result.returncode == 0) == passes, result.stdout + result.stderr
    assert ("OK" in result.stdout) == passes


# --- values: schema and README --------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("prefill.replicas=three", "at '/prefill/replicas': got string, want integer"),
        ("prefill.replica=3", "at '/prefill': additional properties 'replica' not allowed"),
        ("decode.engine.kvCacheGB=4", "additional properties 'kvCacheGB' not allowed"),
        ("surprise=1", "additional properties 'surprise' not allowed"),
        ("model.source=s3", "at '/model/source'"),
        ("model.source=pvc", "at '/model/pvc/claimName'"),
        ("coordinator.port=70000", "at '/coordinator/port'"),
        ("decode.podAntiAffinity=always", "at '/decode/podAntiAffinity'"),
        ("ucx.env.NOT_UCX=1", "'NOT_UCX' does not match pattern '^UCX_[A-Z0-9_]+$'"),
        ("coordinator.discovery=dns", "at '/coordinator/discovery'"),
        ("decode.expertParallel=0", "at '/decode/expertParallel': minimum: got 0, want 1"),
        ("prefill.redundantExperts=-4", "at '/prefill/redundantExperts'"),
        ("tls.enabled=yes", "at '/tls/enabled': got string, want boolean"),
        ("tls.serverName=Pdserve_Internal", "at '/tls/serverName'"),
        ("tls.healthPort=0", "at '/tls/healthPort': minimum: got 0, want 1"),
        ("tls.secretName=Not/A/Name", "at '/tls/secretName'"),
        ("tls.certManager.enabled=true", "at '/tls/certManager/issuerRef/name': minLength"),
        ("tls.certManager.duration=90d", "at '/tls/certManager/duration'"),
        ("tls.certManager.issuerRef.kind=issuer", "at '/tls/certManager/issuerRef/kind'"),
        ("tls.certManager.issuerRef.namespace=x", "additional properties 'namespace' not allowed"),
        ("tls.trustBundle.key=a/b", "at '/tls/trustBundle/key'"),
        ("coordinator.publicTls.cert=x", "additional properties 'cert' not allowed"),
        ("coordinator.http.apiKeySecret.key=keys/a", "at '/coordinator/http/apiKeySecret/key'"),
        ("prefill.kvOffload.sizeGb=0", "at '/prefill/kvOffload/sizeGb': exclusiveMinimum"),
        ("decode.kvOffload.sizeGb=-1", "at '/decode/kvOffload/sizeGb': exclusiveMinimum"),
        ("decode.kvOffload.enabled=on", "at '/decode/kvOffload/enabled': got string"),
        ("prefill.kvOffload.size=4", "additional properties 'size' not allowed"),
        ("decode.kvOffload.mountPath=kv", "at '/decode/kvOffload/mountPath'"),
        ("prefill.kvOffload.emptyDir.medium=HugePages", "at '/prefill/kvOffload/emptyDir/medium'"),
        ("prefill.kvOffload.emptyDir.sizeLimit=1Gi", "additional properties 'sizeLimit' not"),
        ("decode.kvOffload.claimName=Not_A_Claim", "at '/decode/kvOffload/claimName'"),
        ("kvShared.enabled=true", "at '/kvShared/claimName': minLength: got 0, want 1"),
        ("kvShared.sizeGb=0", "at '/kvShared/sizeGb': exclusiveMinimum"),
        ("kvShared.pools={prefill,coordinator}", "at '/kvShared/pools/1': value must be one of"),
        ("kvShared.pools={decode,decode}", "at '/kvShared/pools': items at 0 and 1 are equal"),
        ("kvShared.pools=decode", "at '/kvShared/pools': got string, want array"),
        ("kvShared.mountPath=kv", "at '/kvShared/mountPath'"),
        ("kvShared.enabled=yes", "at '/kvShared/enabled': got string, want boolean"),
        ("kvShared.claimName=Not_A_Claim", "at '/kvShared/claimName'"),
        ("kvShared.size=4", "additional properties 'size' not allowed"),
    ],
)
def test_schema_rejects_bad_values(override: str, message: str) -> None:
    result = helm("template", RELEASE, str(CHART), "--set", override, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


def test_schema_closes_every_object() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            fixed = "properties" in node
            if fixed and node.get("additionalProperties") is not False:
                open_objects.append(path)
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk({k: v for k, v in schema.items() if k != "allOf"}, "")
    assert not open_objects


def leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in leaf_paths(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")]


def test_readme_documents_every_value() -> None:
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [p for p in leaf_paths(values) if f"`{p}`" not in readme]
    assert not missing, f"README.md lacks: {missing}"


# --- the image -------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [str(HADOLINT), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_pdserve_as_non_root() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = [ln for ln in text.splitlines() if ln.startswith("FROM ")]
    assert len(stages) >= 2 and stages[0].startswith("FROM ${BASE} AS ")
    assert re.search(r"^ARG BASE=\S+", text, re.M)
    final = text[text.rindex("\nFROM ") :]
    (user,) = re.findall(r"^USER (\S+)", final, re.M)
    assert user.split(":")[0] not in ("root", "0")
    (entrypoint,) = re.findall(r"^ENTRYPOINT (.+)$", final, re.M)
    assert json.loads(entrypoint) == ["pdserve"]
    (cmd,) = re.findall(r"^CMD (.+)$", final, re.M)
    args = build_parser().parse_args(json.loads(cmd))
    assert args.command == "serve" and args.host == "0.0.0.0"
    # The chart's commands and the test hook's run on this entrypoint.
    assert "--build-arg BASE=nvidia/cuda:" in text and "BAKE_MODEL" in text
    ignored = (ROOT / ".dockerignore").read_text()
    for path in ("pyproject.toml", "README.md", "protos/", "common/", "kernels/", "services/"):
        assert f"!{path}" in ignored
