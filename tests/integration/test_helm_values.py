"""The chart's values: values.schema.json rejecting bad values with the message helm
prints and closing every object it describes, and README.md documenting every key of
values.yaml."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from helm_chart import CHART, RELEASE, helm


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
