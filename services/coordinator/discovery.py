"""Before step 2 of a request's path: which workers the coordinator may route to at all. A
`Discovery` reports, per role (`prefill`, `decode`, `colocated`), the full current set of
"host:port" addresses whenever it changes; the coordinator's routing table follows it.

- `StaticDiscovery`: the `--prefill-workers` / `--decode-workers` / `--colocated-workers`
  lists, reported once.
- `KubernetesDiscovery`: per role, a list + watch of the namespace's `discovery.k8s.io/v1`
  EndpointSlices matching the role's label selector. An endpoint counts while it is ready
  (`conditions.ready` true or unset, as the API defines) and not terminating; its address is
  the first of its `addresses` (the only one Kubernetes gives meaning to) with the slice's
  port named `--k8s-port-name`. An expert-parallel worker (`--expert-parallel N`) is N gRPC
  endpoints in one pod: rank r listens on the port named `<port-name>-ep<r>` (rank 0 on
  `<port-name>`), and each (pod, rank) is an address of its own; the coordinator learns the
  group from the ranks' status streams. A role's set is the union over its slices; a pod
  listed in two slices (dual-stack, or while the controller moves it) counts once. The API
  server applies the selector (`label_selector`); it is parsed here too, so that a bad one
  names its flag before any cluster is asked and a server that ignores it cannot add
  foreign workers. A watch that breaks resumes from the last resourceVersion with backoff
  (`common/retry.py`); 410 Gone relists.

The Kubernetes API sits behind `SliceSource` (list + watch of raw EndpointSlice dicts):
`KubernetesSliceSource` is the official `kubernetes` client (its list call and
`watch.Watch().stream`), run in daemon threads so the event loop never blocks on it; tests
script their own source."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pdserve.common.config import Option
from pdserve.common.retry import Backoff
from pdserve.services.engine_args import FROM_ENV, add_options

OnChange = Callable[[str, frozenset[str]], None]  # (role, the full current set of "host:port")
ROLES = ("prefill", "decode", "colocated")
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
log = logging.getLogger("pdserve.discovery")
T = TypeVar("T")
QUICK_WATCH_END_S = 1.0  # a watch the server ends this soon, with no event, counts as failed
RETRY_S = (0.5, 30.0)  # a failed list or watch is retried after 0.5 s, doubling up to 30 s


class Discovery(ABC):
    """Tells the coordinator its workers: `run` calls `on_change(role, addresses)` once per
    role in `roles` when it first knows the set, then whenever that set changes."""

    @property
    @abstractmethod
    def roles(self) -> frozenset[str]:
        """The roles this discovery reports (the others stay empty)."""

    @abstractmethod
    async def run(self, on_change: OnChange) -> None:
        """Runs until cancelled; an exception raised by `on_change` ends it."""


class StaticDiscovery(Discovery):
    def __init__(self, workers: Mapping[str, list[str]]) -> None:
        self._workers = {r: frozenset(a) for r, a in workers.items() if a}

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(self._workers)

    async def run(self, on_change: OnChange) -> None:
        for role, addresses in self._workers.items():
            on_change(role, addresses)
        await asyncio.Event().wait()


# --- label selectors --------------------------------------------------------------------------

_KEY = r"(?:[A-Za-z0-9][-A-Za-z0-9.]*/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_EXISTS = re.compile(rf"(!?)\s*({_KEY})")
_EQUALS = re.compile(rf"({_KEY})\s*(==|=|!=)\s*({_VALUE})")
_SET = re.compile(rf"({_KEY})\s+(in|notin)\s*\((.*)\)")


@dataclass(frozen=True)
class Requirement:
    """One term of a label selector: `key`, `!key`, `key=v`, `key!=v`, `key in (..)`,
    `key notin (..)`."""

    key: str
    op: str  # "exists", "!exists", "in", "notin" (= is "in" one value, != "notin")
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!exists":
            return self.key not in labels
        if self.op == "in":
            return self.key in labels and labels[self.key] in self.values
        return self.key not in labels or labels[self.key] not in self.values


@dataclass(frozen=True)
class LabelSelector:
    """A Kubernetes label selector in its string form, parsed to match labels here too."""

    text: str
    requirements: tuple[Requirement, ...]

    @classmethod
    def parse(cls, text: str) -> LabelSelector:
        reqs = tuple(_parse_requirement(t.strip()) for t in _split_terms(text))
        if not reqs:
            raise ValueError("an empty selector would match every EndpointSlice")
        return cls(text.strip(), reqs)

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


def _split_terms(text: str) -> Iterator[str]:
    """Commas separate terms, except inside the parentheses of `in (...)`."""
    depth, start = 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"unbalanced parentheses in {text!r}")
        if ch == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced parentheses in {text!r}")
    if text.strip():
        yield text[start:]


def _parse_requirement(term: str) -> Requirement:
    if m := _SET.fullmatch(term):
        values = [v.strip() for v in m.group(3).split(",")]
        if not all(values) or not all(re.fullmatch(_VALUE, v) for v in values):
            raise ValueError(f"{term!r}: the set needs one or more valid label values")
        return Requirement(m.group(1), m.group(2), frozenset(values))
    if m := _EQUALS.fullmatch(term):
        return Requirement(m.group(1), "notin" if m.group(2) == "!=" else "in", frozenset([m[3]]))
    if m := _EXISTS.fullmatch(term):
        return Requirement(m.group(2), "!exists" if m.group(1) else "exists")
    raise ValueError(
        f"{term!r} is no label selector term (key, !key, key=value, key!=value, "
        "key in (a,b), key notin (a,b))"
    )


# --- EndpointSlices -> addresses --------------------------------------------------------------

_FAMILY_RANK = {"IPv4": 0, "IPv6": 1, "FQDN": 2}
Candidate = tuple[int, str]  # (address family rank, "host:port"): the lowest wins for a pod
EndpointKey = tuple[str, int]  # (the pod, or its address when it names none; its EP rank)
SliceMap = dict[str, dict[EndpointKey, Candidate]]  # a role's slices by name: their endpoints


def rank_ports(endpoint_slice: Mapping[str, Any], port_name: str) -> dict[int, int]:
    """{EP rank: port} of a slice: rank 0 at the port named `port_name`, rank r >= 1 at the
    port named `<port_name>-ep<r>`."""
    rank_of = re.compile(rf"{re.escape(port_name)}-ep([1-9][0-9]*)") if port_name else None
    out: dict[int, int] = {}
    for p in endpoint_slice.get("ports") or []:
        name = p.get("name") or ""
        if p.get("port") is None:
            continue
        if name == port_name:
            out[0] = int(p["port"])
        elif rank_of and (m := rank_of.fullmatch(name)):
            out[int(m.group(1))] = int(p["port"])
    return out


def slice_endpoints(
    endpoint_slice: Mapping[str, Any], port_name: str
) -> dict[EndpointKey, Candidate]:
    """The ready, non-terminating endpoints of one EndpointSlice (API JSON form), one per
    (pod, EP rank): keyed by the pod they belong to (or their address when they name none)
    and the rank whose port (see `rank_ports`) the address carries."""
    family = endpoint_slice.get("addressType", "IPv4")
    ports = rank_ports(endpoint_slice, port_name)
    if family not in _FAMILY_RANK or not ports:
        return {}
    out: dict[EndpointKey, Candidate] = {}
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        addresses = endpoint.get("addresses") or []
        host = _host(addresses[0], family) if addresses else None
        if host is None:
            continue
        ref = endpoint.get("targetRef") or {}
        key = ref.get("uid") or (f"{ref.get('kind')}/{ref['name']}" if ref.get("name") else host)
        for rank, port in ports.items():
            out[key, rank] = (_FAMILY_RANK[family], f"{host}:{port}")
    return out


def _host(address: str, family: str) -> str | None:
    if family == "FQDN":
        return address.rstrip(".") or None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        log.warning("EndpointSlice address %r is no %s address; skipped", address, family)
        return None
    return f"[{ip.compressed}]" if ip.version == 6 else ip.compressed


def union_addresses(
    slices: Mapping[str, Mapping[EndpointKey, Candidate]],
) -> frozenset[str]:
    best: dict[EndpointKey, Candidate] = {}
    for endpoints in slices.values():
        for key, candidate in endpoints.items():
            if key not in best or candidate < best[key]:
                best[key] = candidate
    return frozenset(address for _, address in best.values())


# --- Kubernetes -------------------------------------------------------------------------------


class _CallbackFailed(Exception):
    """`on_change` raised (its error is the cause): not an API failure to retry."""


class ResourceGone(Exception):
    """410 Gone: the resourceVersion is too old to resume from; list again."""


class SliceSource(Protocol):
    """The Kubernetes API as discovery uses it, for one namespace."""

    async def list(self, selector: str) -> tuple[list[dict[str, Any]], str]:
        """The EndpointSlices (API JSON dicts) and the list's resourceVersion."""
        ...

    def watch(self, selector: str, resource_version: str) -> AsyncGenerator[dict[str, Any], None]:
        """Watch events ({"type", "object"}: ADDED, MODIFIED, DELETED, BOOKMARK) after
        `resource_version`, until the stream ends; raises ResourceGone or any error on
        failure."""
        ...


class KubernetesDiscovery(Discovery):
    def __init__(
        self,
        selectors: Mapping[str, LabelSelector],
        source: SliceSource,
        port_name: str = "grpc",
        backoff: Callable[[], Backoff] | None = None,
    ) -> None:
        """`backoff` makes each role's waits between failed tries (default: `RETRY_S`,
        jittered)."""
        self._selectors = dict(selectors)
        self._source = source
        self._port_name = port_name
        self._backoff = backoff or (lambda: Backoff(*RETRY_S, jitter=0.5))

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(self._selectors)

    async def run(self, on_change: OnChange) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                for role, selector in self._selectors.items():
                    tasks.create_task(self._follow(role, selector, on_change), name=role)
        except ExceptionGroup as group:  # only on_change's errors end a role's task
            raise group.exceptions[0] from None

    async def _follow(self, role: str, selector: LabelSelector, on_change: OnChange) -> None:
        slices: SliceMap = {}
        reported: frozenset[str] | None = None
        version: str | None = None
        backoff = self._backoff()  # failures in a row set the wait; an event resets it
        loop = asyncio.get_running_loop()

        def report() -> None:
            nonlocal reported
            current = union_addresses(slices)
            if current != reported:
                log.info("%s workers: %s", role, ", ".join(sorted(current)) or "none")
                reported = current
                try:
                    on_change(role, current)
                except Exception as exc:
                    raise _CallbackFailed from exc

        while True:
            try:
                if version is None:
                    items, version = await self._source.list(selector.text)
                    slices.clear()
                    for item in items:
                        self._apply(slices, selector, "ADDED", item)
                    report()
                started, events = loop.time(), 0
                async with contextlib.aclosing(self._source.watch(selector.text, version)) as watch:
                    async for event in watch:
                        version = self._apply_event(slices, selector, event) or version
                        report()
                        events += 1
                        backoff.reset()
                # The server ended the watch (its timeout): resume at once, unless it ends
                # watches as soon as they start, which must not make us spin.
                if events or loop.time() - started >= QUICK_WATCH_END_S:
                    backoff.reset()
                    continue
            except _CallbackFailed as exc:
                raise exc.__cause__ from None  # type: ignore[misc]
            except ResourceGone:
                log.info("%s: resourceVersion %s is gone; listing again", role, version)
                version = None
                if not backoff.failures:
                    backoff.next_delay()  # counted, but the first relist goes at once
                    continue
            except Exception as exc:  # any API or network failure: retry
                log.warning(
                    "%s: EndpointSlice %s failed (%s: %s); retrying",
                    role,
                    "watch" if version else "list",
                    type(exc).__name__,
                    exc,
                )
            await backoff.wait()

    def _apply_event(self, slices: SliceMap, selector: LabelSelector, event: dict) -> str | None:
        """Applies one watch event; returns its resourceVersion."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._apply(slices, selector, kind, obj)
        return (obj.get("metadata") or {}).get("resourceVersion")

    def _apply(self, slices: SliceMap, selector: LabelSelector, kind: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        name = meta.get("name") or meta.get("uid")
        if not name:
            return
        if kind != "DELETED" and selector.matches(meta.get("labels") or {}):
            slices[name] = slice_endpoints(obj, self._port_name)
        else:  # deleted, or its labels no longer match
            slices.pop(name, None)


class KubernetesSliceSource:
    """`SliceSource` over the official `kubernetes` client: `list_namespaced_endpoint_slice`
    and `watch.Watch().stream` of it, the selector applied by the API server
    (`label_selector`). The client blocks, so each call runs in a daemon thread; leaving a
    watch stops it, which shuts its connection down and so ends the thread's read (a watch
    left while still connecting ends at the server's timeout or the read timeout)."""

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        watch_timeout_s: int = 300,
        read_timeout_s: float | None = None,
    ) -> None:
        from kubernetes.client import DiscoveryV1Api

        self._api = DiscoveryV1Api(api_client)
        self.namespace = namespace
        self._watch_timeout_s = watch_timeout_s
        # The server ends a watch after watch_timeout_s; a silent connection past that is dead.
        self._read_timeout_s = read_timeout_s or watch_timeout_s + 30.0

    async def list(self, selector: str) -> tuple[list[dict[str, Any]], str]:
        def call() -> Iterator[dict[str, Any]]:
            with _gone_raised():
                resp = self._api.list_namespaced_endpoint_slice(
                    self.namespace,
                    label_selector=selector,
                    _preload_content=False,
                    _request_timeout=(10, 60),
                )
            yield json.loads(resp.data)

        async with contextlib.aclosing(_in_thread(call)) as bodies:
            body = await anext(bodies)
        return body.get("items") or [], (body.get("metadata") or {}).get("resourceVersion", "")

    def watch(self, selector: str, resource_version: str) -> AsyncGenerator[dict[str, Any], None]:
        from kubernetes.watch import Watch

        stream = Watch()

        def events() -> Iterator[dict[str, Any]]:
            with _gone_raised():  # a 410 answer to the call, or an ERROR event in the stream
                for event in stream.stream(
                    self._api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    resource_version=resource_version,
                    allow_watch_bookmarks=True,
                    # One request, ended by the server; discovery resumes it (and relists).
                    timeout_seconds=self._watch_timeout_s,
                    _request_timeout=(10, self._read_timeout_s),
                ):  # (deserialize=False would skip the models, but fails on ERROR events)
                    if event:  # None: a blank or garbled line
                        yield {"type": event["type"], "object": event["raw_object"]}

        return _in_thread(events, stop=stream.stop)


@contextlib.contextmanager
def _gone_raised() -> Iterator[None]:
    """The client's 410 Gone, raised as ResourceGone."""
    from kubernetes.client.exceptions import ApiException

    try:
        yield
    except ApiException as exc:
        if exc.status == 410:
            raise ResourceGone(str(exc.reason)) from exc
        raise


async def _in_thread(
    produce: Callable[[], Iterator[T]], stop: Callable[[], None] = lambda: None
) -> AsyncGenerator[T, None]:
    """What `produce()` yields, read in a daemon thread (unlike asyncio.to_thread's, never
    waited for at exit: a read blocked on the network must not hold the process); `stop`
    is called on leaving, to end that read early."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def put(kind: str, item: Any = None) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            loop.call_soon_threadsafe(queue.put_nowait, (kind, item))

    def pump() -> None:
        try:
            for item in produce():
                put("item", item)
        except Exception as exc:  # handed to the event loop
            put("error", exc)
        else:
            put("end")

    threading.Thread(target=pump, name="k8s-call", daemon=True).start()
    try:
        while (got := await queue.get())[0] == "item":
            yield got[1]
        if got[0] == "error":
            raise got[1]
    finally:
        stop()


def kubernetes_client() -> tuple[Any, str | None]:
    """An ApiClient from the in-cluster config, else from the kubeconfig ($KUBECONFIG or
    ~/.kube/config), and the kubeconfig context's namespace if it names one."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise ValueError("--discovery kubernetes needs the `kubernetes` package") from exc
    try:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration), None
    except config.ConfigException as in_cluster:
        try:
            path = os.environ.get("KUBECONFIG")  # the client reads it only at its import
            _, context = config.list_kube_config_contexts(config_file=path)
            namespace = (context or {}).get("context", {}).get("namespace")
            return config.new_client_from_config(config_file=path), namespace
        except (config.ConfigException, OSError) as kubeconfig:
            raise ValueError(
                f"--discovery kubernetes: no in-cluster config ({in_cluster}) "
                f"and no usable kubeconfig ({kubeconfig})"
            ) from kubeconfig


def pod_namespace(path: Path = SA_NAMESPACE_FILE) -> str | None:
    """The namespace of the pod this runs in (its service account's), if in a pod."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


# --- flags ------------------------------------------------------------------------------------


# Where the coordinator finds its workers (`add_discovery_args`).
DISCOVERY_OPTIONS = (
    Option(
        "discovery",
        str,
        "static",
        "static: the --*-workers lists; kubernetes: watch the EndpointSlices the "
        "--*-selector flags select (default: %(default)s)",
        choices=("static", "kubernetes"),
    ),
    *(
        Option(
            f"{role}_selector",
            str,
            "",
            f"label selector of the {role} workers' EndpointSlices, e.g. "
            f"kubernetes.io/service-name=llm-pdserve-{role}-headless",
        )
        for role in ROLES
    ),
    Option(
        "k8s_namespace",
        str,
        None,
        "namespace to watch (default: the pod's own, else the kubeconfig context's)",
    ),
    Option(
        "k8s_port_name",
        str,
        "grpc",
        "the EndpointSlice port workers take gRPC calls on; an expert-parallel "
        "worker's rank r takes them on the port named NAME-ep<r> (default: %(default)s)",
    ),
)


def add_discovery_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(f"worker discovery ({FROM_ENV})")
    add_options(g, DISCOVERY_OPTIONS)


def build_discovery(args: argparse.Namespace, static: dict[str, list[str]]) -> Discovery:
    """The discovery `args` ask for. Raises ValueError naming the flag when the roles given
    are neither colocated nor both prefill and decode, or a selector does not parse."""
    if args.discovery == "static":
        _check_roles({r for r, a in static.items() if a}, "--{}-workers")
        return StaticDiscovery(static)
    selectors: dict[str, LabelSelector] = {}
    for role in ROLES:
        text = getattr(args, f"{role}_selector")
        if text.strip():
            try:
                selectors[role] = LabelSelector.parse(text)
            except ValueError as exc:
                raise ValueError(f"--{role}-selector: {exc}") from exc
    _check_roles(set(selectors), "--{}-selector")
    if any(static.values()):
        log.warning("--discovery kubernetes: the static --*-workers lists are ignored")
    api_client, kube_namespace = kubernetes_client()
    namespace = args.k8s_namespace or pod_namespace() or kube_namespace or "default"
    log.info(
        "watching EndpointSlices in namespace %s: %s",
        namespace,
        "; ".join(f"{r}: {s.text}" for r, s in selectors.items()),
    )
    source = KubernetesSliceSource(api_client, namespace)
    return KubernetesDiscovery(selectors, source, port_name=args.k8s_port_name)


def _check_roles(roles: set[str], flag: str) -> None:
    if "colocated" not in roles and not {"prefill", "decode"} <= roles:
        raise ValueError(
            f"workers: give {flag.format('prefill')} and {flag.format('decode')}, "
            f"or {flag.format('colocated')}"
        )
