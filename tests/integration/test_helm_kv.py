"""The KV cache's disk tiers in the chart: each pool's own tier (kvOffload, on an emptyDir
sized for it or on an existing claim) and the tier shared by the worker pods of the listed
pools (kvShared, one ReadWriteMany claim): their PDSERVE_* variables parsed by the real CLI,
their mounts and volumes, `kubernetes-validate --strict`, nothing of them when off, and the
template's refusals of bad values."""

from __future__ import annotations

import json
from collections.abc import Sequence

import kubernetes_validate
import pytest
import yaml
from helm_chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    WORKERS,
    assert_render_refuses,
    container,
    deployment,
    env_of,
    helm,
    kube_versions,
    manifests,
    mount,
    parse_container,
    render,
    volume,
)

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


def assert_valid_strict(label: str, sets: Sequence[str]) -> None:
    """Every manifest rendered with `sets` passes `kubernetes-validate --strict` on each
    Kubernetes version the chart claims."""
    for version in kube_versions():
        for doc in render("default", *sets, kube=version):
            what = f"{label} k8s {version}: {doc['kind']}/{doc['metadata']['name']}"
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{what}: {exc}")


@pytest.mark.parametrize("role", WORKERS)
def test_kv_offload_manifests_pass_kubernetes_validate_strict(role: str) -> None:
    assert_valid_strict(f"kvOffload {role}", KV_OFFLOAD[role])


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
    assert_render_refuses(sets, message)


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
    assert_valid_strict(f"kvShared {sets}", sets)


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
    assert_render_refuses(sets, message)
