"""The chart's containers read back by the services' real CLI (pdserve's argparse
parsers): every PDSERVE_* variable a flag of its command (or one pdserve's code reads), the
container ports and probes on the ports the services listen on, grace periods longer than the
drain, and the model from the bundled cache, a PVC or an image copied by an init container."""

from __future__ import annotations

import pytest
from helm_chart import (
    FIELD_SAMPLES,
    ROOT,
    VALUE_SETS,
    WORKERS,
    container,
    deployment,
    env_of,
    manifests,
    parse_container,
    render,
)

# PDSERVE_* variables read by pdserve's code rather than by a CLI flag.
NON_FLAG_VARS = {"PDSERVE_CACHE_DIR": "common/model_files.py", "PDSERVE_BUILD_DIR": "kernels"}


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
        # Expert-parallel rank r listens on port + r and metrics port + r
        # (services/worker_process.py).
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
        if component == "decode":  # moving its streams out, then the drain
            assert grace > preStop + 2 * args.drain_timeout
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
