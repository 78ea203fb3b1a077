"""The UCX KV transport between real processes on loopback.

Each side is an agent process (spawned) that owns a `UcxTransport` over a pool of random blocks
and runs commands sent over a pipe; the test process itself never loads UCX. Every wait is
bounded, so a hang shows up as a failure, and every agent is ended by pid."""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
import random
import signal
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

NUM_BLOCKS = 64
BLOCK_SHAPE = (4, 2, 16, 8, 32)  # layers, K/V, tokens, KV heads, head_dim: 64 KiB in bf16
BLOCK_BYTES = 4 * 2 * 16 * 8 * 32 * 2
SLACK = 3.0  # seconds past a transfer's timeout before its future counts as hung

_tag_prefix = random.getrandbits(24) << 40
_tag_counter = itertools.count(1)


def new_tag() -> int:
    """Tags shaped like `KvTransport.new_tag`'s: the low 20 bits number the blocks."""
    return _tag_prefix | (next(_tag_counter) << 20)


def _digest(pool: torch.Tensor, ids: list[int]) -> str:
    return hashlib.blake2b(pool[ids].view(torch.uint8).numpy().tobytes()).hexdigest()


def _agent(conn: Connection, seed: int, log_dir: Path | None, ptrace_scope: Path | None) -> None:
    """Runs in a spawned process: a transport over a pool of random blocks, driven by `conn`.
    With `log_dir`, its log and UCX's (with the protocols UCX used, written as its worker goes)
    land there as `pdserve.<pid>.log` and `ucx.<pid>.log`; `ptrace_scope` stands in for Yama's
    file."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.common.kv_transfer import KvTransferError, ucx

    if log_dir is not None:
        logging.basicConfig(filename=log_dir / f"pdserve.{os.getpid()}.log", level=logging.INFO)
        os.environ["UCX_PROTO_INFO"] = "used"  # printed on stdout, whatever UCX_LOG_FILE says
        ucx_log = os.open(log_dir / f"ucx.{os.getpid()}.log", os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(ucx_log, 1)
    if ptrace_scope is not None:
        ucx.YAMA_PTRACE_SCOPE = ptrace_scope
    transport = ucx.UcxTransport()
    try:
        pool = torch.empty((NUM_BLOCKS, *BLOCK_SHAPE), dtype=torch.bfloat16)
        pool.view(torch.uint8).random_(generator=torch.Generator().manual_seed(seed))
        transport.register_pool(pool)
        futures: dict[tuple[str, int], Any] = {}
        conn.send(transport.address)
        while (command := conn.recv())[0] != "close":
            op, *args = command
            reply: Any = None
            if op == "post":
                tag, ids, timeout = args
                futures["post", tag] = transport.post_receive(tag, ids, timeout)
            elif op == "send":
                peer, tag, ids, timeout = args
                futures["send", tag] = transport.send(peer, tag, ids, timeout)
            elif op == "send_from_threads":  # one send per thread, all at once
                peer, tags, ids, timeout = args
                n = len(tags)
                with ThreadPoolExecutor(n) as threads:
                    sent = threads.map(transport.send, [peer] * n, tags, ids, [timeout] * n)
                    futures.update({("send", t): f for t, f in zip(tags, sent, strict=True)})
            elif op == "wait":
                kind, tag, bound = args
                future = futures.pop((kind, tag))
                try:
                    result = future.result(timeout=bound)
                    reply = ("ok", result.num_blocks, result.num_bytes)
                except KvTransferError as e:
                    reply = ("failed", str(e))
                except TimeoutError:
                    reply = ("hung", f"no answer in {bound} s")
            elif op == "cancel":
                transport.cancel(args[0])
            elif op == "digest":
                reply = _digest(pool, args[0])
            elif op == "same_host":
                reply = transport.same_host
            conn.send(reply)
    finally:
        transport.close()
        os._exit(0)  # a process that used UCX may not exit on its own


class Agent:
    def __init__(
        self, seed: int, log_dir: Path | None = None, ptrace_scope: Path | None = None
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_agent, args=(child, seed, log_dir, ptrace_scope), daemon=True
        )
        self.process.start()
        child.close()
        try:
            self.address: bytes = self._answer("start", 60)
        except BaseException:
            self.stop()
            raise

    def _answer(self, what: str, bound: float) -> Any:
        if not self.conn.poll(bound):
            raise AssertionError(f"agent {self.process.pid}: no answer to {what} in {bound} s")
        return self.conn.recv()

    def call(self, *command: Any, bound: float = 20.0) -> Any:
        self.conn.send(command)
        return self._answer(command[0], bound)

    def post(self, tag: int, ids: list[int], timeout: float = 10.0) -> None:
        self.call("post", tag, ids, timeout)

    def send(self, peer: Agent, tag: int, ids: list[int], timeout: float = 10.0) -> None:
        self.call("send", peer.address, tag, ids, timeout)

    def wait(self, kind: str, tag: int, timeout: float = 10.0) -> tuple:
        return self.call("wait", kind, tag, timeout + SLACK, bound=timeout + SLACK + 10)

    def digest(self, ids: list[int]) -> str:
        return self.call("digest", ids)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        try:
            if self.process.is_alive():
                self.conn.send(("close",))
                self.process.join(15)
        except OSError:
            pass
        finally:
            if self.process.is_alive():
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.join(5)
            self.conn.close()


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[Agent, Agent]]:
    """(prefill, decode): two processes with pools of different random blocks."""
    started: list[Agent] = []
    try:
        started.append(Agent(seed=1))
        started.append(Agent(seed=2))
        yield started[0], started[1]
    finally:
        for agent in started:
            agent.stop()


def pull(prefill: Agent, decode: Agent, src: list[int], dst: list[int]) -> None:
    """One transfer the way decode does it: post the receive, then have prefill send."""
    tag = new_tag()
    decode.post(tag, dst)
    prefill.send(decode, tag, src)
    assert decode.wait("post", tag) == ("ok", len(dst), len(dst) * BLOCK_BYTES)
    assert prefill.wait("send", tag) == ("ok", len(src), len(src) * BLOCK_BYTES)


def test_scattered_blocks_land_in_place(agents: tuple[Agent, Agent]) -> None:
    prefill, decode = agents
    rng = random.Random(3)
    src, dst = rng.sample(range(NUM_BLOCKS), 24), rng.sample(range(NUM_BLOCKS), 24)
    others = sorted(set(range(NUM_BLOCKS)) - set(dst))
    others_before = decode.digest(others)
    assert prefill.digest(src) != decode.digest(dst)
    pull(prefill, decode, src, dst)
    assert prefill.digest(src) == decode.digest(dst)
    assert decode.digest(others) == others_before


def test_transfers_in_a_row_and_concurrently(agents: tuple[Agent, Agent]) -> None:
    prefill, decode = agents
    rng = random.Random(4)
    for n in (1, 5, NUM_BLOCKS):
        src, dst = rng.sample(range(NUM_BLOCKS), n), rng.sample(range(NUM_BLOCKS), n)
        pull(prefill, decode, src, dst)
        assert prefill.digest(src) == decode.digest(dst)
    # Four transfers in flight at once into disjoint blocks, the sends from four threads.
    tags = [new_tag() for _ in range(4)]
    srcs = [rng.sample(range(NUM_BLOCKS), 12) for _ in tags]
    dst_all = rng.sample(range(NUM_BLOCKS), 12 * len(tags))
    dsts = [dst_all[12 * k : 12 * k + 12] for k in range(len(tags))]
    for tag, dst in zip(tags, dsts, strict=True):
        decode.post(tag, dst)
    prefill.call("send_from_threads", decode.address, tags, srcs, 10.0)
    for tag, src, dst in zip(tags, srcs, dsts, strict=True):
        assert decode.wait("post", tag)[0] == "ok"
        assert prefill.wait("send", tag)[0] == "ok"
        assert prefill.digest(src) == decode.digest(dst)


def test_receive_without_a_sender_times_out(agents: tuple[Agent, Agent]) -> None:
    _, decode = agents
    tag = new_tag()
    decode.post(tag, [0, 1, 2], timeout=0.5)
    status, message = decode.wait("post", tag, timeout=0.5)
    assert status == "failed" and "timed out" in message


def test_cancelled_receive_fails_and_a_late_send_writes_nothing(
    agents: tuple[Agent, Agent],
) -> None:
    prefill, decode = agents
    dst = [10, 11, 12, 13]
    before = decode.digest(dst)
    tag = new_tag()
    decode.post(tag, dst)
    decode.call("cancel", tag)
    status, message = decode.wait("post", tag)
    assert status == "failed" and "cancelled" in message
    assert "gave up" not in message  # its receives were cancelled in UCX, not waited out
    prefill.send(decode, tag, [0, 1, 2, 3], timeout=1.0)  # nobody receives it any more
    status, message = prefill.wait("send", tag, timeout=1.0)
    assert status == "failed" and "timed out" in message
    assert decode.digest(dst) == before
    pull(prefill, decode, [5, 6], [10, 11])  # the endpoint closed by that abort is replaced


def test_cancelled_receive_spares_the_other_receives(agents: tuple[Agent, Agent]) -> None:
    prefill, decode = agents
    doomed, kept = new_tag(), new_tag()
    decode.post(doomed, [30, 31])
    decode.post(kept, [32, 33])
    decode.call("cancel", doomed)
    status, message = decode.wait("post", doomed)
    assert status == "failed" and "cancelled" in message
    prefill.send(decode, kept, [4, 5])
    assert decode.wait("post", kept)[0] == "ok"
    assert prefill.wait("send", kept)[0] == "ok"
    assert prefill.digest([4, 5]) == decode.digest([32, 33])


def test_cancelled_send_fails_and_spares_other_sends_to_the_peer(
    agents: tuple[Agent, Agent],
) -> None:
    prefill, decode = agents
    doomed, sibling = new_tag(), new_tag()
    prefill.send(decode, doomed, [0, 1])  # decode never posts this tag
    prefill.send(decode, sibling, [2, 3])  # posted only after the cancel below
    prefill.call("cancel", doomed)
    decode.post(sibling, [20, 21])
    assert decode.wait("post", sibling)[0] == "ok"
    assert prefill.wait("send", sibling)[0] == "ok"
    status, message = prefill.wait("send", doomed)
    assert status == "failed" and "cancelled" in message
    assert prefill.digest([2, 3]) == decode.digest([20, 21])


def test_send_to_a_killed_peer_fails(agents: tuple[Agent, Agent]) -> None:
    prefill, decode = agents
    victim = Agent(seed=5)
    try:
        pull(prefill, victim, [1, 2], [3, 4])  # prefill now holds an endpoint to it
        pending = new_tag()
        prefill.send(victim, pending, [5, 6, 7], timeout=4.0)  # never received
        victim.kill()
        status, message = prefill.wait("send", pending, timeout=4.0)
        assert status == "failed", message
        later = new_tag()
        prefill.send(victim, later, [8], timeout=2.0)
        status, message = prefill.wait("send", later, timeout=2.0)
        assert status == "failed", message
    finally:
        victim.stop()
    pull(prefill, decode, [9], [9])  # other peers are unaffected


def test_send_to_a_malformed_address_fails(agents: tuple[Agent, Agent]) -> None:
    prefill, decode = agents
    for peer in (b"", b"inproc:abc", os.urandom(160), decode.address[:-1]):
        tag = new_tag()
        prefill.call("send", peer, tag, [0], 2.0)
        status, message = prefill.wait("send", tag, timeout=2.0)
        assert status == "failed" and "not a UCX transport" in message
