"""Kubernetes worker discovery with the real `kubernetes` client against an emulated API
server (kmock, its own process on 127.0.0.1): configuration from a kubeconfig, EndpointSlices
created, patched and deleted through the API, and the sets the coordinator is told. kmock
ignores label selectors (so foreign slices reach the client and must be dropped there) and
resourceVersion (a resumed watch replays every slice, which must not repeat a report);
resume-from-version and 410 relisting are covered by tests/unit/test_discovery.py."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")

from pdserve.common.retry import Backoff
from pdserve.services.coordinator.discovery import (
    Discovery,
    KubernetesDiscovery,
    KubernetesSliceSource,
    LabelSelector,
    add_discovery_args,
    build_discovery,
    kubernetes_client,
)

NAMESPACE = "llm"
PREFILL = "kubernetes.io/service-name=llm-pdserve-prefill-headless"
DECODE = "kubernetes.io/service-name=llm-pdserve-decode-headless"
WAIT_S = 20.0  # bound of every wait
SERVER = Path(__file__).parent / "kmock_apiserver.py"


@pytest.fixture
def apiserver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The emulator's URL; KUBECONFIG points at it (context namespace `llm`)."""
    proc = subprocess.Popen(
        [sys.executable, str(SERVER)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
        assert ready, "the emulated API server printed no port"
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": url}}],
            "users": [{"name": "tester", "user": {"token": "unused"}}],
            "contexts": [
                {
                    "name": "kmock",
                    "context": {"cluster": "kmock", "user": "tester", "namespace": NAMESPACE},
                }
            ],
            "current-context": "kmock",
        }
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig))
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=WAIT_S)


class Slices:
    """EndpointSlices written through the official client, as the EndpointSlice controller
    would write them."""

    def __init__(self) -> None:
        from kubernetes.client import DiscoveryV1Api

        api_client, _ = kubernetes_client()
        self.api = DiscoveryV1Api(api_client)

    def create(
        self,
        name: str,
        service: str,
        endpoints: list[dict],
        family: str = "IPv4",
        ranks: int = 1,
    ) -> None:
        """`ranks` > 1: the ports of an expert-parallel worker (grpc, grpc-ep1, ...)."""
        port = 50061 if "prefill" in service else 50071
        ports = [{"name": "grpc", "port": port}]
        ports += [{"name": f"grpc-ep{r}", "port": port + r} for r in range(1, ranks)]
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "labels": {"kubernetes.io/service-name": service},
            },
            "addressType": family,
            "ports": ports,
            "endpoints": endpoints,
        }
        self.api.create_namespaced_endpoint_slice(NAMESPACE, body, _preload_content=False)

    def set_endpoints(self, name: str, endpoints: list[dict]) -> None:
        self.api.patch_namespaced_endpoint_slice(
            name, NAMESPACE, {"endpoints": endpoints}, _preload_content=False
        )

    def delete(self, name: str) -> None:
        self.api.delete_namespaced_endpoint_slice(name, NAMESPACE, _preload_content=False)


def ep(address: str, ready: bool = True, terminating: bool = False) -> dict[str, Any]:
    return {"addresses": [address], "conditions": {"ready": ready, "terminating": terminating}}


class Observed:
    """What on_change was told, in order, per role."""

    def __init__(self) -> None:
        self.changes: dict[str, list[frozenset[str]]] = {}

    def __call__(self, role: str, addresses: frozenset[str]) -> None:
        self.changes.setdefault(role, []).append(addresses)

    def now(self, role: str) -> frozenset[str] | None:
        seen = self.changes.get(role)
        return seen[-1] if seen else None

    async def until(self, check: Callable[[], bool], what: str) -> None:
        async def poll() -> None:
            while not check():
                await asyncio.sleep(0.02)

        try:
            await asyncio.wait_for(poll(), WAIT_S)
        except TimeoutError:
            pytest.fail(f"never saw {what}; saw {self.changes}")

    async def becomes(self, role: str, *addresses: str) -> None:
        want = frozenset(addresses)
        await self.until(lambda: self.now(role) == want, f"{role} = {sorted(want)}")


@contextlib.asynccontextmanager
async def running(discovery: Discovery, observed: Observed):
    task = asyncio.create_task(discovery.run(observed))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def discovery_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_discovery_args(parser)
    return parser.parse_args(list(argv))


def test_slices_through_the_real_client(apiserver: str) -> None:
    slices = Slices()
    slices.create("p-a", "llm-pdserve-prefill-headless", [ep("10.0.0.1")])
    slices.create("other", "some-other-service", [ep("10.9.9.9")])  # kmock sends it anyway
    args = discovery_args(
        "--discovery", "kubernetes", "--prefill-selector", PREFILL, "--decode-selector", DECODE
    )
    discovery = build_discovery(args, {"prefill": [], "decode": [], "colocated": []})
    assert discovery.roles == {"prefill", "decode"}
    observed = Observed()

    async def scenario() -> None:
        async with running(discovery, observed):
            await observed.becomes("prefill", "10.0.0.1:50061")
            await observed.becomes("decode")  # no slices: an empty set, reported
            run = asyncio.to_thread
            # Not ready: nothing changes (the next change of the same stream proves it passed).
            await run(slices.set_endpoints, "p-a", [ep("10.0.0.1"), ep("10.0.0.2", ready=False)])
            await run(slices.set_endpoints, "other", [ep("10.9.9.8")])
            await run(slices.create, "p-b", "llm-pdserve-prefill-headless", [ep("10.0.0.5")])
            await observed.becomes("prefill", "10.0.0.1:50061", "10.0.0.5:50061")
            await run(slices.set_endpoints, "p-a", [ep("10.0.0.1"), ep("10.0.0.2")])
            await observed.becomes("prefill", "10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.5:50061")
            await run(slices.create, "d-a", "llm-pdserve-decode-headless", [ep("fd00::1")], "IPv6")
            await observed.becomes("decode", "[fd00::1]:50071")
            await run(
                slices.set_endpoints, "p-a", [ep("10.0.0.1", terminating=True), ep("10.0.0.2")]
            )
            await observed.becomes("prefill", "10.0.0.2:50061", "10.0.0.5:50061")
            await run(slices.delete, "p-b")
            await run(slices.delete, "d-a")
            await observed.becomes("prefill", "10.0.0.2:50061")
            await observed.becomes("decode")

    asyncio.run(scenario())
    f = frozenset
    assert observed.changes == {
        "prefill": [
            f({"10.0.0.1:50061"}),
            f({"10.0.0.1:50061", "10.0.0.5:50061"}),
            f({"10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.5:50061"}),
            f({"10.0.0.2:50061", "10.0.0.5:50061"}),
            f({"10.0.0.2:50061"}),
        ],
        "decode": [f(), f({"[fd00::1]:50071"}), f()],
    }


class CountingSource:
    """The real source, counting the watches it opens."""

    def __init__(self, inner: KubernetesSliceSource) -> None:
        self.inner = inner
        self.watches = 0

    async def list(self, selector: str) -> tuple[list[dict], str]:
        return await self.inner.list(selector)

    def watch(self, selector: str, resource_version: str):
        self.watches += 1
        return self.inner.watch(selector, resource_version)


def test_a_watch_that_breaks_resumes_without_repeating(apiserver: str) -> None:
    """The client's read timeout breaks idle watches here (as a dead connection would); each
    new watch gets every slice again from kmock, which must not show as a change."""
    slices = Slices()
    slices.create("p-a", "llm-pdserve-prefill-headless", [ep("10.0.0.1")])
    api_client, namespace = kubernetes_client()
    assert namespace == NAMESPACE  # from the kubeconfig context
    source = CountingSource(KubernetesSliceSource(api_client, NAMESPACE, read_timeout_s=0.3))
    selector = {"prefill": LabelSelector.parse(PREFILL)}
    discovery = KubernetesDiscovery(selector, source, backoff=lambda: Backoff(0.01, 0.05))
    observed = Observed()

    async def scenario() -> None:
        async with running(discovery, observed):
            await observed.becomes("prefill", "10.0.0.1:50061")
            await observed.until(lambda: source.watches >= 3, "two watches broken and resumed")
            await asyncio.to_thread(
                slices.create, "p-b", "llm-pdserve-prefill-headless", [ep("10.0.0.2")]
            )
            await observed.becomes("prefill", "10.0.0.1:50061", "10.0.0.2:50061")
            resumed = source.watches
            await observed.until(lambda: source.watches > resumed, "one more resume")
            # A change, not a deletion: kmock ignores resourceVersion, so a deletion that fell
            # between two watches would never reach the resumed one (a real API server
            # replays it); a changed slice comes again with the next watch's objects.
            await asyncio.to_thread(slices.set_endpoints, "p-a", [ep("10.0.0.3")])
            await observed.becomes("prefill", "10.0.0.3:50061", "10.0.0.2:50061")

    asyncio.run(scenario())
    assert observed.changes["prefill"] == [
        frozenset({"10.0.0.1:50061"}),
        frozenset({"10.0.0.1:50061", "10.0.0.2:50061"}),
        frozenset({"10.0.0.3:50061", "10.0.0.2:50061"}),
    ]


def test_expert_parallel_ranks_through_the_real_client(apiserver: str) -> None:
    """An EP-2 decode pod's slice carries grpc and grpc-ep1: one address per rank, beside an
    EP-1 pod in a slice of its own (as during a rollout)."""
    slices = Slices()
    slices.create("d-old", "llm-pdserve-decode-headless", [ep("10.0.1.1")])
    args = discovery_args(
        "--discovery", "kubernetes", "--prefill-selector", PREFILL, "--decode-selector", DECODE
    )
    discovery = build_discovery(args, {"prefill": [], "decode": [], "colocated": []})
    observed = Observed()

    async def scenario() -> None:
        async with running(discovery, observed):
            await observed.becomes("decode", "10.0.1.1:50071")
            await asyncio.to_thread(
                slices.create, "d-ep", "llm-pdserve-decode-headless", [ep("10.0.1.2")], ranks=2
            )
            await observed.becomes("decode", "10.0.1.1:50071", "10.0.1.2:50071", "10.0.1.2:50072")
            await asyncio.to_thread(slices.delete, "d-old")
            await observed.becomes("decode", "10.0.1.2:50071", "10.0.1.2:50072")

    asyncio.run(scenario())
