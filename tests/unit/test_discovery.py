"""Worker discovery (services/coordinator/discovery.py) without a cluster: label selectors,
EndpointSlice → address rules, and KubernetesDiscovery's list / watch / resume / relist logic
against a scripted `SliceSource` that also checks every call it gets."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.retry import Backoff
from pdserve.services.coordinator.discovery import (
    Discovery,
    KubernetesDiscovery,
    LabelSelector,
    ResourceGone,
    StaticDiscovery,
    add_discovery_args,
    build_discovery,
    pod_namespace,
    slice_endpoints,
    union_addresses,
)

PREFILL = "kubernetes.io/service-name=llm-pdserve-prefill-headless"
DECODE = "kubernetes.io/service-name=llm-pdserve-decode-headless"
WAIT_S = 10.0  # bound of every wait; nothing here takes close to it

# --- label selectors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("a=b", {"a": "b"}, True),
        ("a=b", {"a": "c"}, False),
        ("a=b", {}, False),
        ("a==b", {"a": "b", "x": "y"}, True),
        ("a!=b", {}, True),
        ("a!=b", {"a": "b"}, False),
        ("a!=b", {"a": "c"}, True),
        ("a in (b, c)", {"a": "c"}, True),
        ("a in (b,c)", {"a": "d"}, False),
        ("a in (b,c)", {}, False),
        ("a notin (b,c)", {}, True),
        ("a notin (b,c)", {"a": "b"}, False),
        ("a notin (b,c)", {"a": "d"}, True),
        ("a", {"a": ""}, True),
        ("a", {"b": "a"}, False),
        ("!a", {"b": "1"}, True),
        ("!a", {"a": "1"}, False),
        ("a=", {"a": ""}, True),
        ("a=", {"a": "x"}, False),
        (
            "app.kubernetes.io/instance=llm, app.kubernetes.io/component in (prefill,decode),"
            "!pdserve.io/canary",
            {"app.kubernetes.io/instance": "llm", "app.kubernetes.io/component": "decode"},
            True,
        ),
        (
            "app.kubernetes.io/instance=llm,app.kubernetes.io/component in (prefill,decode),"
            "!pdserve.io/canary",
            {
                "app.kubernetes.io/instance": "llm",
                "app.kubernetes.io/component": "decode",
                "pdserve.io/canary": "true",
            },
            False,
        ),
        ("app.kubernetes.io/instance=llm", {"app.kubernetes.io/instance": "other"}, False),
    ],
)
def test_selector_matches_like_kubernetes(selector: str, labels: dict, expected: bool) -> None:
    assert LabelSelector.parse(selector).matches(labels) is expected


@pytest.mark.parametrize(
    "selector", ["", " , ", "a in ()", "a in (b", "a in (b c)", "a=b=c", "=b", "a b", "a in (b))"]
)
def test_selector_refuses_what_kubernetes_refuses(selector: str) -> None:
    with pytest.raises(ValueError):
        LabelSelector.parse(selector)


# --- EndpointSlice -> addresses ---------------------------------------------------------------


def endpoint(address: str, ready: bool | None = True, terminating: bool = False, pod: str = ""):
    conditions: dict[str, Any] = {"terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    out: dict[str, Any] = {"addresses": [address], "conditions": conditions}
    if pod:
        out["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "llm", "uid": f"uid-{pod}"}
    return out


def eslice(
    name: str,
    endpoints: list[dict],
    labels: str = PREFILL,
    family: str = "IPv4",
    port: int = 50061,
    version: str | None = None,
    ports: list[dict] | None = None,
) -> dict[str, Any]:
    key, _, value = labels.partition("=")
    meta: dict[str, Any] = {"name": name, "namespace": "llm", "labels": {key: value}}
    if version:
        meta["resourceVersion"] = version
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": family,
        "ports": ports
        if ports is not None
        else [
            {"name": "metrics", "port": 9090, "protocol": "TCP"},
            {"name": "grpc", "port": port, "protocol": "TCP"},
        ],
        "endpoints": endpoints,
    }


def addresses(s: dict, port_name: str = "grpc") -> set[str]:
    return {a for _, a in slice_endpoints(s, port_name).values()}


def test_only_ready_endpoints_that_are_not_terminating() -> None:
    s = eslice(
        "s",
        [
            endpoint("10.0.0.1"),
            endpoint("10.0.0.2", ready=False),
            endpoint("10.0.0.3", ready=True, terminating=True),
            endpoint("10.0.0.4", ready=None),  # unset: the API says to read it as ready
        ],
    )
    assert addresses(s) == {"10.0.0.1:50061", "10.0.0.4:50061"}


def test_the_named_port_is_used_and_a_slice_without_it_gives_nothing() -> None:
    s = eslice("s", [endpoint("10.0.0.1")])
    assert addresses(s) == {"10.0.0.1:50061"}
    assert addresses(s, "metrics") == {"10.0.0.1:9090"}
    assert addresses(s, "http") == set()
    assert addresses(eslice("s", [endpoint("10.0.0.1")], ports=[])) == set()
    unnamed = eslice("s", [endpoint("10.0.0.1")], ports=[{"port": 7000}])
    assert addresses(unnamed, "") == {"10.0.0.1:7000"}


def test_ipv6_in_brackets_and_only_the_first_address() -> None:
    s = eslice("s", [endpoint("fd00:0:0::a")], family="IPv6")
    assert addresses(s) == {"[fd00::a]:50061"}
    first = eslice("s", [{"addresses": ["10.0.0.1", "10.0.0.9"], "conditions": {"ready": True}}])
    assert addresses(first) == {"10.0.0.1:50061"}
    bad = eslice("s", [endpoint("not-an-ip"), endpoint("10.0.0.2")])
    assert addresses(bad) == {"10.0.0.2:50061"}
    fqdn = eslice("s", [endpoint("w-0.pool.llm.svc.cluster.local.")], family="FQDN")
    assert addresses(fqdn) == {"w-0.pool.llm.svc.cluster.local:50061"}


def ep_ports(port: int, ranks: int) -> list[dict]:
    """A slice's ports for workers of `ranks` expert-parallel ranks, as the chart names them."""
    out = [{"name": "grpc", "port": port, "protocol": "TCP"}]
    out += [{"name": f"grpc-ep{r}", "port": port + r, "protocol": "TCP"} for r in range(1, ranks)]
    out += [{"name": "metrics", "port": 9090, "protocol": "TCP"}]
    out += [
        {"name": f"metrics-ep{r}", "port": 9090 + r, "protocol": "TCP"} for r in range(1, ranks)
    ]
    return out


def test_an_expert_parallel_pod_is_one_address_per_rank() -> None:
    s = eslice("d", [endpoint("10.0.0.1", pod="w1")], port=50071, ports=ep_ports(50071, 2))
    assert slice_endpoints(s, "grpc") == {
        ("uid-w1", 0): (0, "10.0.0.1:50071"),
        ("uid-w1", 1): (0, "10.0.0.1:50072"),
    }
    assert addresses(s, "metrics") == {"10.0.0.1:9090", "10.0.0.1:9091"}
    # A rank that is not ready takes its whole pod (its group) with it: the pod's readiness.
    down = eslice("d", [endpoint("10.0.0.1", ready=False, pod="w1")], ports=ep_ports(50071, 2))
    assert addresses(down) == set()


def test_only_ports_named_name_ep_rank_are_ranks() -> None:
    ports = [
        {"name": "grpc", "port": 50071},
        {"name": "grpc-ep2", "port": 50073},  # ranks need not come in order
        {"name": "grpc-ep1", "port": 50072},
        {"name": "grpc-ep0", "port": 1},  # rank 0 is `grpc` itself
        {"name": "grpc-ep01", "port": 2},
        {"name": "grpc-epx", "port": 3},
        {"name": "grpcx-ep1", "port": 4},
        {"name": "xgrpc-ep1", "port": 5},
        {"name": "grpc-ep3", "port": None},
    ]
    s = eslice("d", [endpoint("10.0.0.1")], ports=ports)
    assert addresses(s) == {"10.0.0.1:50071", "10.0.0.1:50072", "10.0.0.1:50073"}
    # An unnamed port has no ranks.
    unnamed = eslice(
        "d", [endpoint("10.0.0.1")], ports=[{"port": 7000}, {"name": "-ep1", "port": 1}]
    )
    assert addresses(unnamed, "") == {"10.0.0.1:7000"}


def test_mixed_pods_and_dual_stack_count_each_rank_once() -> None:
    """During a rollout from EP 1 to EP 2 the controller puts pods with different port sets
    in different slices; a dual-stack pod is in an IPv4 and an IPv6 slice (IPv4 wins)."""
    old = eslice("d-old", [endpoint("10.0.0.1", pod="old")], port=50071)
    new = eslice(
        "d-new",
        [endpoint("10.0.0.2", pod="new"), endpoint("10.0.0.3", pod="new2")],
        ports=ep_ports(50071, 2),
    )
    new6 = eslice("d-new6", [endpoint("fd00::2", pod="new")], "IPv6", ports=ep_ports(50071, 2))
    slices = {
        name: slice_endpoints(s, "grpc")
        for name, s in [("d-old", old), ("d-new", new), ("d-new6", new6)]
    }
    assert union_addresses(slices) == {
        "10.0.0.1:50071",
        "10.0.0.2:50071",
        "10.0.0.2:50072",
        "10.0.0.3:50071",
        "10.0.0.3:50072",
    }
    del slices["d-new"]
    assert union_addresses(slices) == {"10.0.0.1:50071", "[fd00::2]:50071", "[fd00::2]:50072"}


# --- a scripted Kubernetes API ----------------------------------------------------------------


@dataclass
class List:
    items: list[dict]
    version: str = "1"
    error: Exception | None = None


@dataclass
class Watch:
    since: str  # the resourceVersion the watch must be asked for
    events: list[dict] = field(default_factory=list)
    then: Exception | None = None  # raised after the events; None: the server ends the watch


class ScriptedSource:
    """Answers each selector's calls from its own script, in order, and records them; a call
    that does not match its step (or comes after the script) blocks until cancelled."""

    def __init__(self, scripts: dict[str, list[List | Watch]]) -> None:
        self.scripts = {s: list(steps) for s, steps in scripts.items()}
        self.calls: list[tuple[str, str, str | None]] = []
        self.finished: dict[str, asyncio.Event] = {}

    def _next(self, selector: str, call: tuple[str, str | None]) -> List | Watch | None:
        self.calls.append((selector, *call))
        steps = self.scripts.get(selector, [])
        step = steps.pop(0) if steps else None
        expected = (type(step).__name__.lower(), getattr(step, "since", None)) if step else None
        if expected != call:
            self.finished.setdefault(selector, asyncio.Event()).set()
            return None
        return step

    async def list(self, selector: str) -> tuple[list[dict], str]:
        step = self._next(selector, ("list", None))
        if not isinstance(step, List):
            await asyncio.Event().wait()
            raise AssertionError("unreachable")
        if step.error:
            raise step.error
        return step.items, step.version

    async def watch(self, selector: str, since: str) -> AsyncGenerator[dict, None]:
        step = self._next(selector, ("watch", since))
        if not isinstance(step, Watch):
            await asyncio.Event().wait()
            return
        for event in step.events:
            yield event
        if step.then:
            raise step.then

    async def all_finished(self) -> None:
        for selector in self.scripts:
            await self.finished.setdefault(selector, asyncio.Event()).wait()


def ev(kind: str, obj: dict) -> dict:
    return {"type": kind, "object": obj}


def discover(
    source: ScriptedSource,
    selectors: dict[str, str],
    port_name: str = "grpc",
    waits: list[float] | None = None,
) -> list[tuple[str, frozenset[str]]]:
    """Runs KubernetesDiscovery until every script is used up; its on_change calls. Its
    backoff starts at 1 s, doubling up to 8 s, on a clock that appends to `waits` instead
    of sleeping."""

    async def sleep(seconds: float) -> None:
        (waits if waits is not None else []).append(seconds)
        await asyncio.sleep(0)

    parsed = {role: LabelSelector.parse(s) for role, s in selectors.items()}
    discovery = KubernetesDiscovery(
        parsed, source, port_name, backoff=lambda: Backoff(1.0, 8.0, async_sleep=sleep)
    )
    return run_until(discovery, source.all_finished)


def run_until(discovery: Discovery, done: Any) -> list[tuple[str, frozenset[str]]]:
    changes: list[tuple[str, frozenset[str]]] = []

    async def main() -> None:
        task = asyncio.create_task(discovery.run(lambda r, a: changes.append((r, a))))
        waiter = asyncio.ensure_future(done())
        await asyncio.wait([task, waiter], timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        for t in (task, waiter):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        assert waiter.done() and not waiter.cancelled(), "discovery ended or hung"

    asyncio.run(main())
    return changes


def fs(*a: str) -> frozenset[str]:
    return frozenset(a)


# --- KubernetesDiscovery ----------------------------------------------------------------------


def test_slices_appear_change_readiness_and_disappear() -> None:
    a1 = eslice("p-a", [endpoint("10.0.0.1", pod="p1")], version="11")
    a1_down = eslice("p-a", [endpoint("10.0.0.1", ready=False, pod="p1")], version="12")
    b = eslice(
        "p-b", [endpoint("10.0.0.2", pod="p2"), endpoint("10.0.0.3", pod="p3")], version="13"
    )
    a1_up = eslice("p-a", [endpoint("10.0.0.1", pod="p1")], version="14")
    source = ScriptedSource(
        {
            PREFILL: [
                List([], "10"),
                Watch(
                    "10",
                    [
                        ev("ADDED", a1),
                        ev("MODIFIED", a1_down),
                        ev("ADDED", b),
                        ev("MODIFIED", a1_up),
                        ev("DELETED", b | {"metadata": b["metadata"] | {"resourceVersion": "15"}}),
                    ],
                ),
                Watch("15"),
            ]
        }
    )
    changes = discover(source, {"prefill": PREFILL})
    assert changes == [
        ("prefill", fs()),  # the start: no slices yet
        ("prefill", fs("10.0.0.1:50061")),
        ("prefill", fs()),
        ("prefill", fs("10.0.0.2:50061", "10.0.0.3:50061")),
        ("prefill", fs("10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061")),
        ("prefill", fs("10.0.0.1:50061")),
    ]


def test_a_rollout_to_expert_parallel_replaces_a_pod_by_its_ranks() -> None:
    old = eslice("d-old", [endpoint("10.0.0.1", pod="old")], DECODE, port=50071, version="31")
    new = eslice(
        "d-new", [endpoint("10.0.0.2", pod="new")], DECODE, ports=ep_ports(50071, 3), version="32"
    )
    old_gone = old | {"metadata": old["metadata"] | {"resourceVersion": "33"}}
    source = ScriptedSource(
        {
            DECODE: [
                List([old], "30"),
                Watch("30", [ev("ADDED", new), ev("DELETED", old_gone)]),
                Watch("33"),
            ]
        }
    )
    changes = discover(source, {"decode": DECODE})
    assert changes == [
        ("decode", fs("10.0.0.1:50071")),
        ("decode", fs("10.0.0.1:50071", "10.0.0.2:50071", "10.0.0.2:50072", "10.0.0.2:50073")),
        ("decode", fs("10.0.0.2:50071", "10.0.0.2:50072", "10.0.0.2:50073")),
    ]


def test_each_role_has_its_own_selector_and_a_role_with_no_slices_is_empty() -> None:
    p = eslice("p", [endpoint("10.0.0.1")])
    source = ScriptedSource(
        {PREFILL: [List([p], "5"), Watch("5")], DECODE: [List([], "5"), Watch("5")]}
    )
    changes = discover(source, {"prefill": PREFILL, "decode": DECODE})
    assert sorted(changes) == [("decode", fs()), ("prefill", fs("10.0.0.1:50061"))]
    assert {(s, kind) for s, kind, _ in source.calls} == {
        (PREFILL, "list"),
        (PREFILL, "watch"),
        (DECODE, "list"),
        (DECODE, "watch"),
    }


def test_a_broken_watch_resumes_from_the_last_version_without_losing_or_repeating() -> None:
    a = eslice("p-a", [endpoint("10.0.0.1")], version="21")
    b = eslice("p-b", [endpoint("10.0.0.2")], version="22")
    b_down = eslice("p-b", [endpoint("10.0.0.2", ready=False)], version="23")
    source = ScriptedSource(
        {
            PREFILL: [
                List([], "20"),
                Watch("20", [ev("ADDED", a), ev("ADDED", b)], then=ConnectionResetError("reset")),
                # Resumed: a server replaying what the client has already seen changes nothing.
                Watch("22", [ev("ADDED", a), ev("MODIFIED", b)], then=TimeoutError("read")),
                Watch("22", [ev("MODIFIED", b_down)]),  # ended by the server
                Watch("23"),
            ]
        }
    )
    changes = discover(source, {"prefill": PREFILL})
    assert changes == [
        ("prefill", fs()),
        ("prefill", fs("10.0.0.1:50061")),
        ("prefill", fs("10.0.0.1:50061", "10.0.0.2:50061")),
        ("prefill", fs("10.0.0.1:50061")),
    ]
    # ... and the last call, past the script, resumes from the last version too.
    assert [call[1:] for call in source.calls] == [
        ("list", None),
        ("watch", "20"),
        ("watch", "22"),
        ("watch", "22"),
        ("watch", "23"),
        ("watch", "23"),
    ]


def test_410_gone_relists_and_reports_only_the_difference() -> None:
    a = eslice("p-a", [endpoint("10.0.0.1")], version="31")
    b = eslice("p-b", [endpoint("10.0.0.2")], version="32")
    c = eslice("p-c", [endpoint("10.0.0.3")], version="90")
    source = ScriptedSource(
        {
            PREFILL: [
                List([a], "30"),
                Watch("30", [ev("ADDED", b)], then=ResourceGone("an ERROR event in the stream")),
                # Meanwhile a went away and c came: the relist is the truth.
                List([b, c], "100"),
                Watch("100", then=ResourceGone("from the call itself")),
                List([b, c], "101"),
                Watch("101"),
            ]
        }
    )
    changes = discover(source, {"prefill": PREFILL})
    assert changes == [
        ("prefill", fs("10.0.0.1:50061")),
        ("prefill", fs("10.0.0.1:50061", "10.0.0.2:50061")),
        ("prefill", fs("10.0.0.2:50061", "10.0.0.3:50061")),
    ]
    assert [kind for _, kind, _ in source.calls] == ["list", "watch"] * 3 + ["watch"]


def test_the_selector_is_applied_here_even_if_the_server_ignores_it() -> None:
    mine = eslice("p", [endpoint("10.0.0.1")], version="2")
    foreign = eslice("other", [endpoint("10.9.9.9")], labels="kubernetes.io/service-name=x")
    relabelled = eslice("p", [endpoint("10.0.0.1")], labels="kubernetes.io/service-name=y")
    source = ScriptedSource(
        {
            PREFILL: [
                List([foreign], "1"),
                Watch(
                    "1", [ev("ADDED", mine), ev("MODIFIED", foreign), ev("MODIFIED", relabelled)]
                ),
                Watch("1"),
            ]
        }
    )
    changes = discover(source, {"prefill": PREFILL})
    assert changes == [("prefill", fs()), ("prefill", fs("10.0.0.1:50061")), ("prefill", fs())]


def test_bookmarks_move_the_version_only() -> None:
    bookmark = {"kind": "EndpointSlice", "metadata": {"resourceVersion": "77"}}
    source = ScriptedSource(
        {PREFILL: [List([], "1"), Watch("1", [ev("BOOKMARK", bookmark)]), Watch("77")]}
    )
    assert discover(source, {"prefill": PREFILL}) == [("prefill", fs())]


def test_a_pod_in_two_slices_counts_once() -> None:
    v4 = eslice("p-v4", [endpoint("10.0.0.1", pod="p1")])
    v6 = eslice(
        "p-v6", [endpoint("fd00::1", pod="p1"), endpoint("fd00::2", pod="p2")], family="IPv6"
    )
    source = ScriptedSource({PREFILL: [List([v6, v4], "1"), Watch("1")]})
    changes = discover(source, {"prefill": PREFILL})
    assert changes == [("prefill", fs("10.0.0.1:50061", "[fd00::2]:50061"))]


def test_failed_lists_are_retried() -> None:
    p = eslice("p", [endpoint("10.0.0.1")])
    source = ScriptedSource(
        {
            PREFILL: [
                List([], error=PermissionError("403 endpointslices is forbidden")),
                List([], error=ConnectionRefusedError("refused")),
                List([p], "3"),
                Watch("3"),
            ]
        }
    )
    assert discover(source, {"prefill": PREFILL}) == [("prefill", fs("10.0.0.1:50061"))]


def test_failures_in_a_row_back_off_and_an_event_starts_over() -> None:
    p = eslice("p", [endpoint("10.0.0.1")])
    q = eslice("q", [endpoint("10.0.0.2")], version="4")
    q5 = eslice("q", [endpoint("10.0.0.3")], version="5")
    source = ScriptedSource(
        {
            PREFILL: [
                List([], error=ConnectionRefusedError("refused")),  # waits 1 s
                List([], error=ConnectionRefusedError("refused")),  # 2 s
                List([p], "3"),
                Watch("3", [ev("ADDED", q)], then=ConnectionResetError("reset")),  # 1 s again
                Watch("4", then=TimeoutError("read")),  # 2 s
                # After an event, a first 410 relists at once; a second in a row waits.
                Watch("4", [ev("MODIFIED", q5)], then=ResourceGone("expired")),
                List([p, q5], "6"),
                Watch("6", then=ResourceGone("expired")),  # 2 s
                List([p, q5], "7"),
                Watch("7"),  # ended by the server at once, with no event: 4 s, not a spin
            ]
        }
    )
    waits: list[float] = []
    changes = discover(source, {"prefill": PREFILL}, waits=waits)
    assert waits == [1.0, 2.0, 1.0, 2.0, 2.0, 4.0]
    assert source.calls[-1][1:] == ("watch", "7")  # then it resumed, past the script
    assert changes == [
        ("prefill", fs("10.0.0.1:50061")),
        ("prefill", fs("10.0.0.1:50061", "10.0.0.2:50061")),
        ("prefill", fs("10.0.0.1:50061", "10.0.0.3:50061")),
    ]


def test_an_error_in_on_change_ends_run() -> None:
    source = ScriptedSource({PREFILL: [List([], "1"), Watch("1")]})
    discovery = KubernetesDiscovery({"prefill": LabelSelector.parse(PREFILL)}, source)

    def on_change(role: str, addrs: frozenset[str]) -> None:
        raise KeyError(role)

    async def main() -> None:
        await asyncio.wait_for(discovery.run(on_change), WAIT_S)

    with pytest.raises(KeyError):
        asyncio.run(main())
    assert [kind for _, kind, _ in source.calls] == ["list"]


# --- the official client as KubernetesSliceSource drives it -----------------------------------


class ApiResponse:
    """The API server's answer as the client hands it over with `_preload_content=False`:
    `data` whole, or `stream()` in chunks that split lines where they fall."""

    def __init__(self, body: bytes, chunk: int = 7) -> None:
        self.data, self.status, self._chunk = body, 200, chunk

    def stream(self, amt: int | None = None, decode_content: bool | None = None):
        for i in range(0, len(self.data), self._chunk):
            yield self.data[i : i + self._chunk]

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class DiscoveryApi:
    """`DiscoveryV1Api.list_namespaced_endpoint_slice`, answering from a script (a body, or
    an exception to raise) and recording each call's arguments."""

    def __init__(self, *answers: bytes | Exception) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def list_namespaced_endpoint_slice(self, namespace: str, **kwargs: Any) -> ApiResponse:
        self.calls.append((namespace, kwargs))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return ApiResponse(answer)


def real_source(api: DiscoveryApi) -> Any:
    pytest.importorskip("kubernetes")
    from kubernetes.client import ApiClient

    from pdserve.services.coordinator.discovery import KubernetesSliceSource

    source = KubernetesSliceSource(ApiClient(), "llm", watch_timeout_s=300)
    source._api = api  # the HTTP exchange is scripted; the client code above it is real
    return source


def lines(*events: dict) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in events)


def all_events(source: Any, version: str) -> list[dict]:
    async def main() -> list[dict]:
        return [e async for e in source.watch(PREFILL, version)]

    return asyncio.run(main())


def test_the_client_lists_and_watches_with_the_selector_sent_to_the_server() -> None:
    a = eslice("p-a", [endpoint("10.0.0.1")], version="8")
    bookmark = {"kind": "EndpointSlice", "metadata": {"resourceVersion": "9"}}
    api = DiscoveryApi(
        json.dumps({"items": [a], "metadata": {"resourceVersion": "7"}}).encode(),
        lines(ev("ADDED", a), ev("BOOKMARK", bookmark), ev("DELETED", a)),
    )
    source = real_source(api)
    assert asyncio.run(source.list(PREFILL)) == ([a], "7")
    assert all_events(source, "7") == [ev("ADDED", a), ev("BOOKMARK", bookmark), ev("DELETED", a)]
    (list_ns, list_args), (watch_ns, watch_args) = api.calls
    assert list_ns == watch_ns == "llm"
    assert list_args["label_selector"] == watch_args["label_selector"] == PREFILL
    assert "watch" not in list_args
    assert watch_args["watch"] is True and watch_args["resource_version"] == "7"
    assert watch_args["allow_watch_bookmarks"] is True and watch_args["timeout_seconds"] == 300


def test_the_clients_410_is_resource_gone_and_other_errors_stay_errors() -> None:
    from kubernetes.client.exceptions import ApiException

    gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    broken = {"kind": "Status", "code": 500, "reason": "InternalError", "message": "etcd"}
    a = eslice("p-a", [endpoint("10.0.0.1")], version="8")
    api = DiscoveryApi(
        lines(ev("ADDED", a), ev("ERROR", gone)),  # an ERROR event in the stream
        ApiException(status=410, reason="Gone"),  # the answer to the watch call
        ApiException(status=410, reason="Gone"),  # the answer to a list
        lines(ev("ERROR", broken)),
    )
    source = real_source(api)
    seen: list[dict] = []

    async def watch_into_seen() -> None:
        async for event in source.watch(PREFILL, "7"):
            seen.append(event)

    with pytest.raises(ResourceGone):
        asyncio.run(watch_into_seen())
    assert seen == [ev("ADDED", a)]  # what came before the error was delivered
    with pytest.raises(ResourceGone):
        all_events(source, "8")
    with pytest.raises(ResourceGone):
        asyncio.run(source.list(PREFILL))
    with pytest.raises(ApiException) as raised:
        all_events(source, "8")
    assert raised.value.status == 500 and not isinstance(raised.value, ResourceGone)


def test_static_discovery_reports_its_lists_once() -> None:
    discovery = StaticDiscovery(
        {"prefill": ["a:1", "b:2", "a:1"], "decode": ["c:3"], "colocated": []}
    )
    assert discovery.roles == {"prefill", "decode"}
    changes: list = []

    async def two_reports() -> None:
        while len(changes) < 2:
            await asyncio.sleep(0)

    async def main() -> None:
        task = asyncio.create_task(discovery.run(lambda r, a: changes.append((r, a))))
        await asyncio.wait_for(two_reports(), WAIT_S)
        for _ in range(10):  # let it run on: nothing more comes
            await asyncio.sleep(0)
        assert not task.done()
        task.cancel()

    asyncio.run(main())
    assert changes == [("prefill", fs("a:1", "b:2")), ("decode", fs("c:3"))]


# --- flags ------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_discovery_args(parser)
    return parser.parse_args(argv)


def test_static_is_the_default_and_needs_both_pools_or_colocated() -> None:
    args = parse([])
    assert args.discovery == "static" and args.k8s_port_name == "grpc"
    d = build_discovery(args, {"prefill": ["p:1"], "decode": ["d:1"], "colocated": []})
    assert isinstance(d, StaticDiscovery) and d.roles == {"prefill", "decode"}
    assert build_discovery(args, {"colocated": ["c:1"]}).roles == {"colocated"}
    with pytest.raises(ValueError, match="--prefill-workers and --decode-workers"):
        build_discovery(args, {"prefill": ["p:1"], "decode": [], "colocated": []})


def test_kubernetes_flags_are_checked_before_any_cluster_is_asked(monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_DISCOVERY", "kubernetes")
    monkeypatch.setenv("PDSERVE_PREFILL_SELECTOR", PREFILL)
    monkeypatch.setenv("PDSERVE_K8S_PORT_NAME", "rpc")
    args = parse([])
    assert (args.discovery, args.prefill_selector, args.k8s_port_name) == (
        "kubernetes",
        PREFILL,
        "rpc",
    )
    with pytest.raises(ValueError, match="--prefill-selector and --decode-selector"):
        build_discovery(args, {})
    with pytest.raises(
        ValueError, match=r"--decode-selector: unbalanced parentheses in 'a in \(b'"
    ):
        build_discovery(parse(["--decode-selector", "a in (b"]), {})


def test_kubernetes_without_any_cluster_config_says_so(monkeypatch, tmp_path: Path) -> None:
    pytest.importorskip("kubernetes")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    args = parse(["--discovery", "kubernetes", "--colocated-selector", "app=x"])
    with pytest.raises(ValueError, match=r"no in-cluster config .* no usable kubeconfig"):
        build_discovery(args, {})


def test_pod_namespace_comes_from_the_service_account(tmp_path: Path) -> None:
    path = tmp_path / "namespace"
    assert pod_namespace(path) is None
    path.write_text("llm\n")
    assert pod_namespace(path) == "llm"
