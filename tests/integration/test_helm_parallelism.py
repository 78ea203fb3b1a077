"""Tensor and expert parallelism in the chart: the flags the real CLI reads, a GPU per
rank, a gRPC and a metrics port per expert-parallel rank, each rank reaching the coordinator's
discovery as a worker of its own, and the template's own refusals of bad values."""

from __future__ import annotations

import pytest
import yaml
from helm_chart import (
    FULLNAME,
    NAMESPACE,
    WORKERS,
    assert_render_refuses,
    container,
    deployment,
    discovery_of,
    manifests,
    one,
    parse_container,
    render,
)

from pdserve.services.coordinator.discovery import slice_endpoints

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
    assert_render_refuses(sets, message)


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
    rejects the non-integers and values below 1 first: see test_schema_rejects_bad_values
    in test_helm_values.py)."""
    assert_render_refuses(sets, message)
