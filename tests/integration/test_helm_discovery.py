"""How the chart's pods find and reach each other: the coordinator's Kubernetes discovery
selectors against the EndpointSlices of each pool's headless Service (built by the
coordinator's own discovery code from the rendered flags), static discovery's addresses, the
NOTES, the coordinator's HTTP API, Services targeting named container ports, RBAC granting
only EndpointSlice reads, and NetworkPolicies admitting exactly the chart's own peers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helm_chart import (
    CHART,
    FULLNAME,
    NAMESPACE,
    RELEASE,
    WORKERS,
    container,
    deployment,
    discovery_of,
    env_of,
    find,
    helm,
    manifests,
    one,
    parse_container,
    pod_labels,
    render,
    selects,
)

from pdserve.services.cli import build_parser
from pdserve.services.coordinator.discovery import LabelSelector, StaticDiscovery


def endpointslice_labels(svc: dict) -> dict[str, str]:
    """The labels Kubernetes' EndpointSlice controller gives the slices of a Service: the
    Service's own plus the two it adds."""
    return {
        **svc["metadata"]["labels"],
        "kubernetes.io/service-name": svc["metadata"]["name"],
        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
    }


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
