"""Which prefill workers a decode worker may pull from, and its channels to them. A KV
handle names the prefill worker to call; taken on trust, it would make the decode worker
dial any address a caller chooses (request forgery) and keep a channel per address without
bound. So the worker calls only addresses it knows: its own `--prefill-workers` list and
the prefill pools its coordinators name (`SetPrefillWorkers`, each coordinator's list
replacing its previous one). Channels exist only to known addresses and close when an
address leaves every list."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Iterable

import grpc

from pdserve.services.tls import internal_channel
from pdserve.v1 import prefill_pb2_grpc

MAX_COORDINATORS = 16  # lists kept; the one named longest ago goes first
MAX_ADDRESSES = 4096  # per list
MAX_ADDRESS_CHARS = 256


class UnknownPrefillWorker(PermissionError):
    pass


class PrefillPeers:
    def __init__(self, static: Iterable[str] = ()) -> None:
        self.static = frozenset(static)
        self._named: OrderedDict[str, frozenset[str]] = OrderedDict()
        self._stubs: dict[str, tuple[grpc.aio.Channel, prefill_pb2_grpc.PrefillServiceStub]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def known(self) -> frozenset[str]:
        return self.static.union(*self._named.values())

    def set_named(self, coordinator_id: str, addresses: Iterable[str]) -> None:
        """`coordinator_id`'s prefill pool; raises ValueError naming a bad field."""
        if not coordinator_id or len(coordinator_id) > MAX_ADDRESS_CHARS:
            raise ValueError(f"coordinator_id: 1 to {MAX_ADDRESS_CHARS} characters")
        named = frozenset(addresses)
        if len(named) > MAX_ADDRESSES:
            raise ValueError(f"addresses: at most {MAX_ADDRESSES}, got {len(named)}")
        if any(not a or len(a) > MAX_ADDRESS_CHARS or ":" not in a for a in named):
            raise ValueError(f"addresses: each host:port, at most {MAX_ADDRESS_CHARS} characters")
        self._named[coordinator_id] = named
        self._named.move_to_end(coordinator_id)
        while len(self._named) > MAX_COORDINATORS:
            self._named.popitem(last=False)
        self._close_unknown()

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        """The stub for a known address; raises `UnknownPrefillWorker` (before any
        connection) for any other."""
        if address not in self.known:
            raise UnknownPrefillWorker(
                f"kv_handle.grpc_address: {address!r} is not a prefill worker this decode "
                "worker knows (its --prefill-workers list or its coordinators' prefill pools)"
            )
        entry = self._stubs.get(address)
        if entry is None:
            channel = internal_channel(address)
            entry = self._stubs[address] = (channel, prefill_pb2_grpc.PrefillServiceStub(channel))
        return entry[1]

    @property
    def num_channels(self) -> int:
        return len(self._stubs)

    def _close_unknown(self) -> None:
        known = self.known
        for address in [a for a in self._stubs if a not in known]:
            channel, _ = self._stubs.pop(address)
            task = asyncio.ensure_future(channel.close(grace=5.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            with contextlib.suppress(Exception):
                await channel.close()
        self._stubs.clear()
