"""Which prefill workers a decode worker may pull from, and its channels to them. A KV
handle names the prefill worker to call; taken on trust, it would make the decode worker
dial any address a caller chooses (request forgery) and keep a channel per address without
bound. So the worker calls only addresses it knows: its own `--prefill-workers` list and
the prefill pools its coordinators name (`SetPrefillWorkers`, each coordinator's list
replacing its previous one; a coordinator names both the address it dialled and the one the
worker advertises in its status stream). Channels exist only to known addresses and close
when an address leaves every list.

One endpoint has many spellings, and the handle carries the prefill worker's own (its
advertised address) while the lists carry whatever an operator or discovery wrote. So both
sides are compared by `address_key`: IPv6 brackets dropped and put back the one way
(`fd00::1:50061` and `[fd00::1]:50061` are one key), IPv4-mapped IPv6 as IPv4, host names in
lower case without a trailing dot. A host name on a list also stands for the addresses it
resolves to (looked up when it is named, again at most every `RESOLVE_EVERY_S` when a handle
misses, so a restarted pod's new IP behind a headless Service name is found): a list naming
`localhost:50061` admits a handle naming `127.0.0.1:50061`. A host name in a handle is never
looked up: it is taken only when that very name is on a list, so a caller can make this
worker neither dial nor resolve a name nobody vouched for. The channel goes to the key (the
one spelling), never to the caller's text."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

import grpc

from pdserve.common.config import GRPC_KEEPALIVE
from pdserve.services.grpc_server import keepalive_channel_options
from pdserve.services.tls import internal_channel
from pdserve.v1 import prefill_pb2_grpc

logger = logging.getLogger(__name__)

MAX_COORDINATORS = 16  # lists kept; the one named longest ago goes first
MAX_ADDRESSES = 4096  # per list
MAX_ADDRESS_CHARS = 256
RESOLVE_EVERY_S = 5.0  # a handle that misses re-resolves the named host names this often
RESOLVE_TIMEOUT_S = 2.0  # one round of look-ups; names not answered by then keep what they had
_HOSTNAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]{0,251}[a-z0-9_])?")

# (host, port) -> the IP addresses it resolves to.
Resolver = Callable[[str, int], Awaitable[Iterable[str]]]


class UnknownPrefillWorker(PermissionError):
    pass


def valid_address(address: str) -> bool:
    """What `SetPrefillWorkers` takes: a non-empty `host:port` of at most
    `MAX_ADDRESS_CHARS` characters."""
    return bool(address) and len(address) <= MAX_ADDRESS_CHARS and ":" in address


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of `host:port`, `[v6]:port` or an unbracketed `v6:port` (the port is
    what follows the last colon): the host in lower case, without brackets or a trailing
    dot. Raises ValueError."""
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{address!r}: not [host]:port")
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise ValueError(f"{address!r}: not host:port")
    if not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ValueError(f"{address!r}: the port must be 1 to 65535")
    host = host.rstrip(".").lower()
    if not host:
        raise ValueError(f"{address!r}: no host")
    return host, int(port_text)


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address `host` spells (IPv4-mapped IPv6 as IPv4); None for a host name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def ip_key(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    return f"[{ip.compressed}]:{port}" if ip.version == 6 else f"{ip.compressed}:{port}"


def address_key(address: str) -> str:
    """The one spelling of `address` (also the target its channel dials). Raises
    ValueError for anything that is not host:port with a plausible host."""
    host, port = split_address(address)
    ip = ip_of(host)
    if ip is not None:
        return ip_key(ip, port)
    if not _HOSTNAME.fullmatch(host):
        raise ValueError(f"{address!r}: not a host name or IP address")
    return f"{host}:{port}"


async def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class PrefillPeers:
    def __init__(
        self,
        static: Iterable[str] = (),
        resolver: Resolver = _getaddrinfo,
        keepalive_s: float = GRPC_KEEPALIVE.default,
    ) -> None:
        self.static = frozenset(static)
        # A prefill worker that hangs fails the calls to it (TransferKv: the pull ends).
        self._channel_options = keepalive_channel_options(keepalive_s)
        self._named: OrderedDict[str, tuple[int, frozenset[str]]] = OrderedDict()
        self._resolver = resolver
        # (host name, port) named on some list -> the keys of the addresses it resolved to.
        self._resolved: dict[tuple[str, int], frozenset[str]] = {}
        self._resolved_at = -float("inf")  # monotonic time of the last full round
        self._resolving: asyncio.Task[None] | None = None
        self._keys: frozenset[str] = frozenset()
        self._stubs: dict[str, tuple[grpc.aio.Channel, prefill_pb2_grpc.PrefillServiceStub]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._recompute()

    @property
    def known(self) -> frozenset[str]:
        """Every address on a list, as written there."""
        return self.static.union(*(named for _, named in self._named.values()))

    @property
    def keys(self) -> frozenset[str]:
        """What a handle's address may be (by `address_key`): the lists' addresses and the
        addresses their host names resolved to."""
        return self._keys

    def set_named(self, coordinator_id: str, addresses: Iterable[str], generation: int = 0) -> bool:
        """`coordinator_id`'s prefill pool; raises ValueError naming a bad field. A list
        with a `generation` older than the one in force is ignored (False): calls from one
        coordinator may arrive out of order. 0 is always taken."""
        if not coordinator_id or len(coordinator_id) > MAX_ADDRESS_CHARS:
            raise ValueError(f"coordinator_id: 1 to {MAX_ADDRESS_CHARS} characters")
        named = frozenset(addresses)
        if len(named) > MAX_ADDRESSES:
            raise ValueError(f"addresses: at most {MAX_ADDRESSES}, got {len(named)}")
        if not all(valid_address(a) for a in named):
            raise ValueError(f"addresses: each host:port, at most {MAX_ADDRESS_CHARS} characters")
        held = self._named.get(coordinator_id)
        if held is not None and generation and generation < held[0]:
            return False
        self._named[coordinator_id] = (generation, named)
        self._named.move_to_end(coordinator_id)
        while len(self._named) > MAX_COORDINATORS:
            self._named.popitem(last=False)
        self._recompute()
        return True

    async def resolve_new(self) -> None:
        """Look up the host names on the lists that were never looked up (a new list's)."""
        names = [n for n in self._hostnames() if n not in self._resolved]
        if names:
            await self._resolve(names)

    async def admit(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        """The stub for a handle's address. An address that misses re-resolves the lists'
        host names first (at most every `RESOLVE_EVERY_S`); then an unknown one raises
        `UnknownPrefillWorker`, before any connection to it."""
        key = _key_or_literal(address)
        if key not in self._keys and self._hostnames():
            if self._resolving is None and time.monotonic() - self._resolved_at >= RESOLVE_EVERY_S:
                self._resolving = asyncio.ensure_future(self._resolve_all())
            if self._resolving is not None:
                await asyncio.shield(self._resolving)
        return self.stub(address)

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        """The stub for a known address; raises `UnknownPrefillWorker` (before any
        connection) for any other. No look-up: see `admit`."""
        key = _key_or_literal(address)
        if key not in self._keys:
            shown = address[:MAX_ADDRESS_CHARS] + (
                "..." if len(address) > MAX_ADDRESS_CHARS else ""
            )
            raise UnknownPrefillWorker(
                f"kv_handle.grpc_address: {shown!r} is not a prefill worker this decode "
                "worker knows (its --prefill-workers list or its coordinators' prefill pools)"
            )
        entry = self._stubs.get(key)
        if entry is None:
            channel = internal_channel(key, self._channel_options)
            entry = self._stubs[key] = (channel, prefill_pb2_grpc.PrefillServiceStub(channel))
        return entry[1]

    @property
    def num_channels(self) -> int:
        return len(self._stubs)

    def _hostnames(self) -> set[tuple[str, int]]:
        names = set()
        for address in self.known:
            with contextlib.suppress(ValueError):
                host, port = split_address(address)
                if ip_of(host) is None and _HOSTNAME.fullmatch(host):
                    names.add((host, port))
        return names

    async def _resolve_all(self) -> None:
        try:
            await self._resolve(list(self._hostnames()))
            self._resolved_at = time.monotonic()
        finally:
            self._resolving = None

    async def _resolve(self, names: list[tuple[str, int]]) -> None:
        tasks = {asyncio.ensure_future(self._resolver(h, p)): (h, p) for h, p in names}
        done, pending = await asyncio.wait(tasks, timeout=RESOLVE_TIMEOUT_S)
        for task in pending:
            task.cancel()
        for task in done:
            host, port = tasks[task]
            if task.exception() is not None:
                logger.warning("cannot resolve prefill worker %s: %s", host, task.exception())
                continue
            keys = set()
            for text in task.result():
                ip = ip_of(text)
                if ip is not None:
                    keys.add(ip_key(ip, port))
            self._resolved[host, port] = frozenset(keys)
        self._recompute()

    def _recompute(self) -> None:
        keys: set[str] = set()
        names = set()
        for address in self.known:
            keys.add(_key_or_literal(address))
            with contextlib.suppress(ValueError):
                host, port = split_address(address)
                if (host, port) in self._resolved:
                    names.add((host, port))
                    keys.update(self._resolved[host, port])
        for name in [n for n in self._resolved if n not in names]:
            del self._resolved[name]  # no list names it any more
        self._keys = frozenset(keys)
        self._close_unknown()

    def _close_unknown(self) -> None:
        for key in [k for k in self._stubs if k not in self._keys]:
            channel, _ = self._stubs.pop(key)
            task = asyncio.ensure_future(channel.close(grace=5.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        if self._resolving is not None:
            self._resolving.cancel()
        for channel, _ in self._stubs.values():
            with contextlib.suppress(Exception):
                await channel.close()
        self._stubs.clear()


def _key_or_literal(address: str) -> str:
    """`address_key`, or for what it cannot read (a target such as `unix:/path` on a list)
    the text itself, matched only exactly."""
    try:
        return address_key(address)
    except ValueError:
        return address
