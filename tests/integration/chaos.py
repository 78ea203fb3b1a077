"""The fault matrix's cells and the cluster they run on (`test_chaos_matrix.py`, `make chaos`).

The cluster: a coordinator, two prefill workers (p0, p1) and two decode workers (d0, d1),
real processes on fixed ports, the default model. A cell names a fault, the request phase it
hits and the role it hits; its victim (p1, d1 or the coordinator) is started again for the
cell with `PDSERVE_FAULTS` arming the fault at a named point (`common/faults.py`), its log
kept, while the other processes serve on. Eight greedy streams then run through the
coordinator, each bounded by a client deadline, and the cell's row says:

- `fired`: the victim logged its fault at the named point (the fault hit that phase);
- `streams`: how each stream ended: `exact` (every token equal to the fault-free run),
  `unavailable` / `deadline` / another status (a clear error), or `wrong` (different tokens);
- `recovered_s`: how long after the streams ended every surviving worker had every KV block
  free, no lease held and nothing running (bounded by the lease);
- `ok`: the cell's contract held (`expect`).

Contracts: with a spare worker of the failed role, every stream completes exactly
(`complete`); when the coordinator itself fails, every stream either completed exactly
before the fault or ends with a clear error (`error`); in every cell the workers free
everything within the lease."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from chat_prompts import QUESTIONS

from pdserve.v1 import generate_pb2, generate_pb2_grpc
from services import RunningService, start

WORKER_ARGS = ["--kv-cache-tokens", "8192", "--threads", "1"]
LEASE_S = 15.0
STREAMS = 8
MAX_TOKENS = 40
DEADLINE_S = 120.0  # a stream past this is a hang: never the contract of any cell


@dataclass(frozen=True)
class Cell:
    fault: str  # kill, stop, delay, fail, deadline
    phase: str  # queued, prefilling, lease held, pull in flight, decoding, streaming out
    role: str  # the victim's role: coordinator, prefill or decode
    spec: str  # the victim's PDSERVE_FAULTS ("" for a client-side fault)
    expect: str = "complete"  # or "error"
    deadline_s: float = DEADLINE_S  # the client's

    @property
    def name(self) -> str:
        return f"{self.role}-{self.fault}-{self.phase.replace(' ', '-')}"


CELLS = [
    Cell("kill", "prefilling", "prefill", "prefill.before_prefill=kill@1"),
    Cell("kill", "lease held", "prefill", "prefill.lease_granted=kill@1"),
    Cell("kill", "pull in flight", "prefill", "prefill.before_send=kill@1"),
    Cell("stop", "pull in flight", "prefill", "prefill.before_send=stop@1"),
    Cell("fail", "lease held", "prefill", "prefill.lease_granted=fail@1"),
    Cell("delay", "prefilling", "prefill", "prefill.before_prefill=delay:2"),
    Cell("delay", "pull in flight", "prefill", "prefill.before_send=delay:2"),
    Cell("kill", "pull in flight", "decode", "decode.before_pull=kill@1"),
    Cell("fail", "pull in flight", "decode", "decode.before_landing=fail@1"),
    Cell("corrupt", "pull in flight", "decode", "decode.before_landing=corrupt@1"),
    Cell("kill", "decoding", "decode", "decode.before_step=kill@30"),
    Cell("stop", "decoding", "decode", "decode.before_step=stop@30"),
    Cell("fail", "decoding", "decode", "decode.before_step=fail@30"),
    Cell("stop", "streaming out", "decode", "decode.before_stream_write=stop@20"),
    Cell("delay", "streaming out", "decode", "decode.before_stream_write=delay:0.5@5"),
    Cell("delay", "lease held", "coordinator", "coordinator.before_decode=delay:2", "complete"),
    Cell(
        "kill", "streaming out", "coordinator", "coordinator.before_stream_write=kill@60", "error"
    ),
    Cell(
        "stop",
        "streaming out",
        "coordinator",
        "coordinator.before_stream_write=stop@60",
        "error",
        deadline_s=20.0,
    ),
    Cell("deadline", "decoding", "coordinator", "", "error", deadline_s=3.0),
]
# What `make test` runs: one cell per role and kind of loss (`make chaos` runs them all).
SUBSET = ("prefill-kill-lease-held", "decode-kill-pull-in-flight", "prefill-stop-pull-in-flight")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """The five processes on fixed ports; a victim is started again in their place."""

    def __init__(self) -> None:
        self.ports = {name: free_port() for name in ("coordinator", "p0", "p1", "d0", "d1")}
        self.services: dict[str, RunningService] = {}
        self.logs = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
        try:
            for name in ("p0", "p1", "d0", "d1", "coordinator"):
                self.start(name)
        except BaseException:  # those already started must not outlive the test
            self.close()
            raise

    def _args(self, name: str) -> list[str]:
        port = ["--port", str(self.ports[name])]
        if name == "coordinator":
            address = lambda n: f"127.0.0.1:{self.ports[n]}"  # noqa: E731
            return [f"--prefill-workers={address('p0')},{address('p1')}",
                    f"--decode-workers={address('d0')},{address('d1')}", *port]  # fmt: skip
        role_args = ["--kv-lease", str(LEASE_S)] if name[0] == "p" else []
        return [*WORKER_ARGS, *role_args, *port]

    def start(self, name: str, faults: str = "") -> Path:
        role = {"p": "prefill", "d": "decode", "c": "coordinator"}[name[0]]
        log = self.logs / f"{name}-{time.monotonic_ns()}.log"
        with open(log, "w") as f:
            env = {"PDSERVE_FAULTS": faults} if faults else None
            self.services[name] = start(role, *self._args(name), env=env, stderr=f)
        if "coordinator" in self.services:
            self.wait_routed()
        return log

    def wait_routed(self) -> None:
        """Every worker is watched by the coordinator (it routes to all of them)."""
        deadline = time.monotonic() + 60
        workers = [s for n, s in self.services.items() if n != "coordinator"]
        while not all(w.metric("pdserve_status_watchers") >= 1 for w in workers):
            assert time.monotonic() < deadline, "the coordinator never watched every worker"
            time.sleep(0.05)

    def stop(self, name: str) -> None:
        service = self.services[name]
        if service.proc.poll() is None:
            service.proc.send_signal(signal.SIGCONT)  # a stopped victim cannot stop itself
            service.stop()

    def close(self) -> None:
        for name in list(self.services):
            self.stop(name)

    def idle(self) -> bool:
        for name, service in self.services.items():
            if name == "coordinator" or service.proc.poll() is not None:
                continue
            total = service.metric("pdserve_kv_cache_num_blocks")
            if (
                service.free_blocks() != total
                or service.metric("pdserve_kv_leases_held") != 0
                or service.metric("pdserve_num_requests_running") != 0
            ):
                return False
        return True


def request(i: int, max_tokens: int = MAX_TOKENS) -> generate_pb2.GenerateRequest:
    question = QUESTIONS[i % len(QUESTIONS)] + f" ({i})"
    return generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(role="user", content=question)],
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


def generate(address: str, i: int, deadline_s: float, max_tokens: int = MAX_TOKENS) -> Any:
    """Stream `i`'s token ids, or the status it ended with."""
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        try:
            responses = list(stub.Generate(request(i, max_tokens), timeout=deadline_s))
        except grpc.RpcError as e:
            return e.code().name.lower()
        return [t for r in responses for t in r.token_ids]


def reference(cluster: Cluster) -> list[list[int]]:
    address = cluster.services["coordinator"].grpc
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda i: generate(address, i, DEADLINE_S), range(STREAMS)))


def run_cell(cluster: Cluster, cell: Cell, expected: list[list[int]]) -> dict[str, Any]:
    victim = {"prefill": "p1", "decode": "d1", "coordinator": "coordinator"}[cell.role]
    log = None
    if cell.spec:  # the victim, started again with its fault armed
        cluster.stop(victim)
        log = cluster.start(victim, cell.spec)
    address = cluster.services["coordinator"].grpc
    tokens = 400 if cell.fault == "deadline" else MAX_TOKENS
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(generate, address, i, cell.deadline_s, tokens)
                   for i in range(STREAMS)]  # fmt: skip
        outcomes = [f.result() for f in futures]
    ended = time.monotonic()
    if cell.fault == "stop":  # a hung process is restarted, as an operator would
        cluster.services[victim].kill()
    while not cluster.idle() and time.monotonic() < ended + LEASE_S + 30:
        time.sleep(0.05)
    recovered = time.monotonic() - ended
    streams = [
        ("exact" if out == expected[i] else "wrong") if isinstance(out, list) else out
        for i, out in enumerate(outcomes)
    ]
    point = cell.spec.split("=", 1)[0] if cell.spec else None
    fired = log is None or f'"point": "{point}"' in log.read_text()
    if cell.expect == "complete":
        held = all(s == "exact" for s in streams)
    else:  # a clear error, never a hang or a wrong token
        hang = "deadline_exceeded" if cell.deadline_s == DEADLINE_S else None
        held = all(s != "wrong" and s != hang for s in streams)
        held &= any(s != "exact" for s in streams)  # the fault reached someone's stream
    idle = cluster.idle()
    row = {
        "cell": cell.name, "fault": cell.fault, "phase": cell.phase, "role": cell.role,
        "spec": cell.spec or f"client deadline {cell.deadline_s:g} s", "expect": cell.expect,
        "fired": fired, "streams": {s: streams.count(s) for s in sorted(set(streams))},
        "recovered_s": round(recovered, 2) if idle else None,
        "ok": bool(fired and held and idle and recovered <= LEASE_S),
    }  # fmt: skip
    # The victim goes back to a clean process for the next cell.
    cluster.stop(victim)
    cluster.start(victim)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The matrix's outcome table, as markdown."""
    lines = [
        "| role | fault | phase | armed as | expected | fault hit | streams | freed in | ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        streams = ", ".join(f"{n} {s}" for s, n in r["streams"].items())
        freed = "never" if r["recovered_s"] is None else f"{r['recovered_s']:.1f} s"
        lines.append(
            f"| {r['role']} | {r['fault']} | {r['phase']} | `{r['spec']}` | {r['expect']} | "
            f"{'yes' if r['fired'] else 'NO'} | {streams} | {freed} | "
            f"{'yes' if r['ok'] else '**NO**'} |"
        )
    return "\n".join(lines) + "\n"


def chosen_cells() -> list[Cell]:
    """All cells under `PDSERVE_CHAOS=all` (`make chaos`), else the subset."""
    if os.environ.get("PDSERVE_CHAOS") == "all":
        return CELLS
    return [c for c in CELLS if c.name in SUBSET]
