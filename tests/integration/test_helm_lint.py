"""The chart (helm/pdserve) as helm and Kubernetes see it, offline: `helm lint --strict`
with the default values and every value set in helm_values/, `helm template` refusing a
Kubernetes version outside Chart.yaml's kubeVersion, and every rendered manifest against the
Kubernetes schemas of the oldest and newest versions Chart.yaml claims
(`kubernetes-validate --strict`)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from helm_chart import CHART, RELEASE, VALUE_SETS, VALUES_DIR, helm, kube_versions, render
from kubernetes_validate.utils import SchemaNotFoundError


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
                # two, cert-manager's Certificate) are checked field by field in test_helm_tls.py.
                assert doc["kind"] in ("ServiceMonitor", "PrometheusRule", "Certificate"), what
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{what}: {exc}")
