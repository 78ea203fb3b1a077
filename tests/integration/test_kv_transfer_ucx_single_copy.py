"""How the UCX KV transport moves blocks between processes on one host: in one copy over `cma`
(the receiver reads the sender's blocks) where the kernel allows one process to read
another's memory, and in two copies through shared memory, with the reason logged, where it
does not. Real agent processes (test_kv_transfer_ucx.py's); the evidence for what UCX did is
its own account, the protocol table each process writes to its log as its worker goes
(`UCX_PROTO_INFO=used`)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from test_kv_transfer_ucx import BLOCK_BYTES, NUM_BLOCKS, Agent, pull

from pdserve.common.kv_transfer import ucx
from pdserve.common.kv_transfer.ucx import single_copy_refusal

# A protocol row of UCX's table: "| 24   1728..inf | zero-copy read from remote | cma/memory |"
# (messages, sizes, protocol, transport; "(?)" marks a cost that depends on the peer).
_ROW = re.compile(r"\|\s*(\d+)\s+\S+\s*\|\s*(?:\(\?\)\s*)?(.*?)\s*\|\s*(\S*)\s*\|\s*$")


def used(log_dir: Path, agent: Agent) -> list[tuple[int, str, str]]:
    """(messages, protocol, transport) of every row of `agent`'s UCX table that carried any."""
    text = (log_dir / f"ucx.{agent.process.pid}.log").read_text()
    rows = [_ROW.search(line) for line in text.splitlines()]
    return [(int(m[1]), m[2], m[3]) for m in rows if m and int(m[1]) > 0]


def pull_and_stop(log_dir: Path, ptrace_scope: Path | None) -> tuple[Agent, Agent, list[str]]:
    """Two agents logging to `log_dir` pull 24 scattered blocks, then stop (so UCX writes its
    tables); returns them and what each transport said of the same-host path."""
    agents = [Agent(seed, log_dir, ptrace_scope) for seed in (11, 12)]
    prefill, decode = agents
    try:
        rng = random.Random(5)
        src, dst = rng.sample(range(NUM_BLOCKS), 24), rng.sample(range(NUM_BLOCKS), 24)
        pull(prefill, decode, src, dst)
        assert prefill.digest(src) == decode.digest(dst)
        paths = [agent.call("same_host") for agent in agents]
    finally:
        for agent in agents:
            agent.stop()
    return prefill, decode, paths


@pytest.mark.skipif(
    single_copy_refusal() is not None, reason=f"this host refuses cma: {single_copy_refusal()}"
)
def test_blocks_move_in_one_copy_where_the_host_allows(tmp_path: Path) -> None:
    prefill, decode, paths = pull_and_stop(tmp_path, None)
    assert all(path.startswith("cma: one copy") for path in paths), paths
    assert BLOCK_BYTES > 8192  # above UCX's rendezvous threshold: blocks are read, not pushed
    received = used(tmp_path, decode)
    assert (24, "zero-copy read from remote", "cma/memory") in received, received
    sent = used(tmp_path, prefill)
    assert (24, "rendezvous zero-copy read from remote", "cma/memory") in sent, sent


def test_without_cma_blocks_still_move_and_the_reason_is_logged(tmp_path: Path) -> None:
    scope = tmp_path / "ptrace_scope"
    scope.write_text("3\n")  # Yama: no process may read another's memory
    prefill, decode, paths = pull_and_stop(tmp_path, scope)
    for agent, path in zip((prefill, decode), paths, strict=True):
        assert path.startswith("posix shared memory: two copies") and "ptrace_scope is 3" in path
        log = (tmp_path / f"pdserve.{agent.process.pid}.log").read_text()
        assert f"WARNING:{ucx.__name__}:KV blocks between processes on this host: {path}" in log
        rows = used(tmp_path, agent)
        assert rows and all(transport != "cma/memory" for _, _, transport in rows), rows
        assert sum(n for n, _, transport in rows if transport == "posix/memory") >= 24, rows
