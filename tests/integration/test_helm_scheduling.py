"""Where the chart's pods run and what they ask for, read from `helm template`: the prefill
and decode pools on distinct GPU node pools (node selectors, tolerations, anti-affinity within
each pool), GPU requests (none with the cpu-only values), replicas and autoscalers,
PodDisruptionBudgets selecting their own pools, and RDMA, UCX and shared memory."""

from __future__ import annotations

import yaml
from helm_chart import (
    FULLNAME,
    WORKERS,
    container,
    deployment,
    env_of,
    find,
    manifests,
    one,
    pod_labels,
    selects,
)


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
