"""Rank processes: `--expert-parallel N` or `--tensor-parallel N` makes one command N
processes in one `torch.distributed` group (gloo on CPU, NCCL on GPU: rank r uses `cuda:r`).

The command the user runs is rank 0. It opens the group's store on a free port, starts
ranks 1..N-1 as children (`pdserve generate` with the same engine flags, or a service's own
command line; told their rank and rank 0's address by environment), and every rank joins
the group before it loads the model. A rank that dies ends the group: rank 0 reports which
one and exits, the others' collectives fail on the closed connection or after
`PDSERVE_EP_TIMEOUT` seconds (default 300).

What the ranks do together differs: expert-parallel ranks are workers of their own that
step in lockstep (`expert_parallel.py`, `lockstep_loop.py`); tensor-parallel ranks 1..N-1
run rank 0's steps on their shard of every layer and serve nothing themselves
(`ModelRunner.follow`)."""

from __future__ import annotations

import argparse
import atexit
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Literal

from pdserve.common.models.expert_parallel import init_group, master_store

RANK_ENV = "PDSERVE_EP_RANK"
ADDRESS_ENV = "PDSERVE_EP_ADDRESS"
TIMEOUT_ENV = "PDSERVE_EP_TIMEOUT"

Kind = Literal["expert", "tensor"]


@dataclass
class RankGroup:
    """This process's place in its group. On rank 0, `children` are the other ranks'
    processes (started by it)."""

    rank: int
    world_size: int
    kind: Kind = "expert"
    children: list[subprocess.Popen] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def signal_children(self, sig: int) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(sig)

    def reap_children(self, timeout_s: float = 30.0) -> None:
        """Wait for the other ranks to end (they stop with this one), killing any that
        outstay `timeout_s`."""
        self.stopping.set()
        for child in self.children:
            try:
                child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


_group: RankGroup | None = None


def current_group() -> RankGroup | None:
    """The group this process joined (`join_rank_group`), if any."""
    return _group


def join_rank_group(
    args: argparse.Namespace, engine_flags: list[str], world: int, kind: Kind
) -> RankGroup:
    """Make this process a rank of a group of `world` (rank 0 also starts the others).
    `pdserve generate` ranks get its engine flags; a service's ranks run the same command
    line as rank 0."""
    global _group
    rank_env = os.environ.get(RANK_ENV)
    command = getattr(args, "command", "generate")
    timeout_s = float(os.environ.get(TIMEOUT_ENV, "300"))
    store = None
    if rank_env is None:
        store = master_store(world, timeout_s)
        address = f"127.0.0.1:{store.port}"
        if command == "generate":
            argv = ["generate", "--input", "-", "--output", "-", "--no-progress", *engine_flags]
        else:
            argv = sys.argv[1:]
        _group = RankGroup(0, world, kind)
        _group.children = _start_ranks(command, address, argv, _group)
    else:
        _group = RankGroup(int(rank_env), world, kind)
        address = os.environ[ADDRESS_ENV]
    if args.device == "cuda":
        args.device = f"cuda:{_group.rank}"
    if kind == "expert" and getattr(args, "kv_offload_dir", None):
        # each expert-parallel rank has its own pool, so its own tier
        args.kv_offload_dir = os.path.join(args.kv_offload_dir, f"ep{_group.rank}")
    init_group(_group.rank, world, address, args.device, timeout_s, store)
    return _group


def _start_ranks(
    command: str, address: str, argv: list[str], group: RankGroup
) -> list[subprocess.Popen]:
    children = [
        subprocess.Popen(
            [sys.executable, "-P", "-m", "pdserve.services.cli", *argv],  # -P: see launcher
            env=dict(os.environ, **{RANK_ENV: str(rank), ADDRESS_ENV: address}),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        for rank in range(1, group.world_size)
    ]

    def watch(rank: int, child: subprocess.Popen) -> None:
        code = child.wait()
        if code != 0 and not group.stopping.is_set():
            print(
                f"pdserve {command}: error: {group.kind}-parallel rank {rank} exited with "
                f"code {code}; the group cannot step without it",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)  # fail fast, never wait forever

    for rank, child in enumerate(children, start=1):
        threading.Thread(target=watch, args=(rank, child), daemon=True).start()
    atexit.register(group.reap_children)
    return children
