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


# --- spellings: one endpoint, many ways to write it -----------------------------------------


@pytest.mark.parametrize(
    ("spellings", "key"),
    [
        (["127.0.0.1:50061", "127.0.0.1:050061"], "127.0.0.1:50061"),
        (["[fd00::1]:50061", "fd00::1:50061", "[FD00:0:0::1]:50061", "fd00:0::0:1:50061"],
         "[fd00::1]:50061"),
        (["[::ffff:10.1.2.3]:50061", "::ffff:10.1.2.3:50061", "10.1.2.3:50061"], "10.1.2.3:50061"),
        (["Prefill-0.Pdserve-Prefill.llm.svc.cluster.local.:50061",
          "prefill-0.pdserve-prefill.llm.svc.cluster.local:50061"],
         "prefill-0.pdserve-prefill.llm.svc.cluster.local:50061"),
    ],
)  # fmt: skip
def test_every_spelling_of_an_endpoint_has_one_key(spellings: list[str], key: str) -> None:
    assert {prefill_peers.address_key(s) for s in spellings} == {key}


@pytest.mark.parametrize(
    "bad", ["no-port", "host:", "host:0", "host:65536", "host:８０", "[::1]50061", "[::1", ":80",
            "a b:80", "unix:/tmp/socket", "dns:///prefill:50061"],
)  # fmt: skip
def test_what_is_not_host_port_has_no_key(bad: str) -> None:
    with pytest.raises(ValueError):
        prefill_peers.address_key(bad)


def test_a_handle_in_another_spelling_of_a_named_ip_is_taken_and_dialled_once() -> None:
    async def main() -> None:
        peers = PrefillPeers(["fd00::1:50061"])  # unbracketed, as a bare IPv6 host:port
        stub = await peers.admit("[fd00::1]:50061")
        assert await peers.admit("[FD00::0:1]:50061") is stub
        assert peers.num_channels == 1  # one channel per endpoint, not per spelling
        assert set(peers._stubs) == {"[fd00::1]:50061"}  # it dials the one spelling
        with pytest.raises(UnknownPrefillWorker):
            await peers.admit("[fd00::1]:50062")  # another port is another endpoint
        await peers.close()

    asyncio.run(main())


def test_a_named_host_name_stands_for_what_it_resolves_to() -> None:
    """The issue's case: the coordinator dialled `localhost:PORT`, the worker advertises
    `127.0.0.1:PORT` in its handles. Real resolution (localhost is in every /etc/hosts)."""

    async def main() -> None:
        peers = PrefillPeers()
        peers.set_named("c1", ["localhost:50061"])
        await peers.resolve_new()
        assert "127.0.0.1:50061" in peers.keys
        await peers.admit("127.0.0.1:50061")
        await peers.admit("LOCALHOST.:50061")  # the name itself, in another case
        with pytest.raises(UnknownPrefillWorker):
            await peers.admit("127.0.0.1:50062")
        await peers.close()

    asyncio.run(main())


class Resolver:
    """A stand-in DNS: what each name resolves to now, and every look-up made."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if host not in self.table:
            raise OSError(f"{host}: no such name")
        return self.table[host]


def test_a_handles_own_host_name_is_never_looked_up() -> None:
    async def main() -> None:
        dns = Resolver({"prefill.headless": ["10.0.0.5"], "evil.example": ["10.0.0.5"]})
        peers = PrefillPeers(["prefill.headless:50061"], resolver=dns)
        for forged in ("evil.example:50061", "169.254.169.254:80", "metadata.google.internal:80"):
            with pytest.raises(UnknownPrefillWorker, match=r"kv_handle\.grpc_address"):
                await peers.admit(forged)
        assert set(dns.asked) == {"prefill.headless"}  # only the named name, ever
        assert peers.num_channels == 0
        await peers.admit("10.0.0.5:50061")  # the named name's address is
        await peers.close()

    asyncio.run(main())


def test_a_miss_re_resolves_at_most_every_few_seconds(monkeypatch) -> None:
    """A headless Service name whose pod came back with a new IP: the first handle from it
    re-resolves the names and is taken; a flood of unknown handles re-resolves once."""

    async def main() -> None:
        clock = [1000.0]
        monkeypatch.setattr(prefill_peers.time, "monotonic", lambda: clock[0])
        dns = Resolver({"prefill.headless": ["10.0.0.5"]})
        peers = PrefillPeers(["prefill.headless:50061"], resolver=dns)
        await peers.admit("10.0.0.5:50061")  # first miss: resolved then
        dns.table["prefill.headless"] = ["10.0.0.9"]  # the pod was replaced
        clock[0] += prefill_peers.RESOLVE_EVERY_S
        stub = await peers.admit("10.0.0.9:50061")
        assert peers.num_channels == 1  # the old address's channel closed
        asked = len(dns.asked)
        for i in range(50):
            with pytest.raises(UnknownPrefillWorker):
                await peers.admit(f"10.9.9.{i}:50061")
        assert len(dns.asked) == asked  # within RESOLVE_EVERY_S: no look-up at all
        assert await peers.admit("10.0.0.9:50061") is stub
        await asyncio.sleep(0)
        await peers.close()

    asyncio.run(main())


def test_an_older_list_from_the_same_coordinator_is_ignored() -> None:
    async def main() -> None:
        peers = PrefillPeers()
        assert peers.set_named("c1", ["a:1", "b:2"], generation=2)
        assert not peers.set_named("c1", ["a:1"], generation=1)  # arrived late
        assert peers.known == {"a:1", "b:2"}
        assert peers.set_named("c1", ["c:3"], generation=0)  # no generation: always taken
        assert peers.known == {"c:3"}
        await peers.close()

    asyncio.run(main())
