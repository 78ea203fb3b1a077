"""TLS between the pods, TLS on the coordinator's public ports, and API keys, as the chart
renders them: the Secret's files mounted whole and read-only where the PDSERVE_TLS_* variables
point, the plain health port the probes move to, nothing of it when off, cert-manager's
Certificate field by field (kubernetes-validate has no schema for it), a trust bundle in place
of the Secret's CA, the API-key file the coordinator rereads and the test hook sends, and the
template's refusals of bad values."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helm_chart import (
    FULLNAME,
    RELEASE,
    VALUE_SETS,
    WORKERS,
    assert_render_refuses,
    container,
    deployment,
    env_of,
    find,
    manifests,
    mount,
    one,
    parse_container,
    render,
    volume,
)

TLS_VARS = ("PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA", "PDSERVE_TLS_SERVER_NAME")
TLS_DIR = "/etc/pdserve/tls"
OWN_SECRET = ("tls.enabled=true", "tls.secretName=pdserve-internal-tls")


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
    assert_render_refuses(sets, message)
