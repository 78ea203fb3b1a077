"""A decode worker's pull list: it calls only prefill workers it knows (its own list and
the pools its coordinators name); an unknown address is refused before any channel exists,
lists are bounded, and a channel closes when its address leaves every list."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.services.decode import prefill_peers
from pdserve.services.decode.prefill_peers import PrefillPeers, UnknownPrefillWorker


def test_unknown_addresses_are_refused_without_a_channel() -> None:
    async def main() -> None:
        peers = PrefillPeers(["10.0.0.1:50061"])
        with pytest.raises(UnknownPrefillWorker, match=r"kv_handle\.grpc_address"):
            peers.stub("169.254.169.254:80")
        assert peers.num_channels == 0
        assert peers.stub("10.0.0.1:50061") is peers.stub("10.0.0.1:50061")
        assert peers.num_channels == 1
        await peers.close()

    asyncio.run(main())


def test_each_coordinator_replaces_its_own_list_and_departed_channels_close() -> None:
    async def main() -> None:
        peers = PrefillPeers()
        peers.set_named("c1", ["a:1", "b:2"])
        peers.set_named("c2", ["b:2"])
        peers.stub("a:1")
        peers.stub("b:2")
        peers.set_named("c1", ["c:3"])  # a:1 left c1's pool; b:2 is still c2's
        assert peers.known == {"b:2", "c:3"}
        assert peers.num_channels == 1
        with pytest.raises(UnknownPrefillWorker):
            peers.stub("a:1")
        await asyncio.sleep(0)  # the departed channel's close runs
        await peers.close()

    asyncio.run(main())


def test_lists_are_bounded(monkeypatch) -> None:
    async def main() -> None:
        monkeypatch.setattr(prefill_peers, "MAX_COORDINATORS", 2)
        peers = PrefillPeers()
        for name in ("c1", "c2", "c3"):
            peers.set_named(name, [f"{name}:1"])
        assert peers.known == {"c2:1", "c3:1"}  # the one named longest ago went
        with pytest.raises(ValueError, match="addresses"):
            peers.set_named("c4", [f"h:{i}" for i in range(prefill_peers.MAX_ADDRESSES + 1)])
        with pytest.raises(ValueError, match="host:port"):
            peers.set_named("c4", ["no-port"])
        with pytest.raises(ValueError, match="coordinator_id"):
            peers.set_named("", ["a:1"])

    asyncio.run(main())
