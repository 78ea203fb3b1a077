"""`--expert-parallel N`: one command becomes N rank processes (`pdserve generate`, and
the serving roles `prefill`, `decode`, `colocated`, which `pdserve serve` starts).

The command the user runs is rank 0. Before loading anything it checks that the model is a
mixture of experts whose expert count N divides, then starts ranks 1..N-1 as children
(`pdserve generate` with the same engine flags, or a service's own command line; told their
rank and rank 0's address by environment) and every rank joins one `torch.distributed`
group (gloo on CPU, NCCL on GPU: rank r uses `cuda:r`). Each rank loads the whole model,
keeps only its share of every MoE layer's experts, and has its own KV cache (data-parallel
attention). A rank that dies ends the group: rank 0 reports which one and exits, the others'
collectives fail on the closed connection or after `PDSERVE_EP_TIMEOUT` seconds (default
300). A serving rank is a worker endpoint of its own (`worker.py`, `lockstep_loop.py`).

`pdserve generate`'s path: rank 0 reads and checks the JSONL lines and hands every rank the
list of good ones; rank r runs lines r, r+N, r+2N, … Every step all ranks agree whether any
has work left, and each runs one model step (an idle rank an empty one), so the MoE layers'
all-to-all exchanges line up. At the end rank 0 gathers every rank's results and writes
them in input order."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch.distributed as dist

from pdserve.common.engine import LLMEngine, RequestOutput
from pdserve.common.errors import InvalidRequestError, PdserveError
from pdserve.common.models.expert_parallel import init_group, lockstep_busy
from pdserve.services.offline import Defaults, parse_line, result_row

RANK_ENV = "PDSERVE_EP_RANK"
ADDRESS_ENV = "PDSERVE_EP_ADDRESS"
TIMEOUT_ENV = "PDSERVE_EP_TIMEOUT"


def check_model(model: str | None, world_size: int, redundant_experts: int = 0) -> None:
    """Clear errors before any process starts: a dense model, N not dividing the experts,
    more redundant slots than experts."""
    from transformers import AutoConfig

    from pdserve.common.model_files import resolve_model
    from pdserve.common.models.families import family_for

    config = AutoConfig.from_pretrained(resolve_model(model))
    family = family_for(config)
    if family.moe is None:
        raise PdserveError(
            f"--expert-parallel: {family.name} is not a mixture-of-experts model; "
            "use --expert-parallel 1"
        )
    experts = getattr(config, family.moe.num_experts_attr)
    if world_size < 1 or experts % world_size:
        raise PdserveError(
            f"--expert-parallel: must divide the model's {experts} experts, got {world_size}"
        )
    if redundant_experts > experts:
        raise PdserveError(
            f"--redundant-experts: at most the model's {experts} experts, got {redundant_experts}"
        )


@dataclass
class RankGroup:
    """This process's place in its expert-parallel group. On rank 0, `children` are the
    other ranks' processes (started by it)."""

    rank: int
    world_size: int
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
    """The group this process joined (`join_expert_parallel_group`), if any."""
    return _group


def join_expert_parallel_group(args: argparse.Namespace, engine_flags: list[str]) -> RankGroup:
    """Make this process a rank of the group (rank 0 also starts the others). `pdserve
    generate` ranks get its engine flags; a service's ranks run the same command line as
    rank 0 (each then listens on its own ports, see `worker.py`)."""
    global _group
    world = args.expert_parallel
    rank_env = os.environ.get(RANK_ENV)
    command = getattr(args, "command", "generate")
    if rank_env is None:
        check_model(args.model, world, args.redundant_experts)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        if command == "generate":
            argv = ["generate", "--input", "-", "--output", "-", "--no-progress", *engine_flags]
        else:
            argv = sys.argv[1:]
        _group = RankGroup(0, world)
        _group.children = _start_ranks(command, address, argv, _group)
    else:
        _group = RankGroup(int(rank_env), world)
        address = os.environ[ADDRESS_ENV]
    if args.device == "cuda":
        args.device = f"cuda:{_group.rank}"
    if getattr(args, "kv_offload_dir", None):  # each rank has its own pool, so its own tier
        args.kv_offload_dir = os.path.join(args.kv_offload_dir, f"ep{_group.rank}")
    init_group(_group.rank, world, address, args.device, float(os.environ.get(TIMEOUT_ENV, "300")))
    return _group


def _start_ranks(
    command: str, address: str, argv: list[str], group: RankGroup
) -> list[subprocess.Popen]:
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "pdserve.services.cli", *argv],
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
                f"pdserve {command}: error: expert-parallel rank {rank} exited with code "
                f"{code}; the group cannot step without it",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)  # fail fast, never wait forever

    for rank, child in enumerate(children, start=1):
        threading.Thread(target=watch, args=(rank, child), daemon=True).start()
    atexit.register(group.reap_children)
    return children


def run_generate_ranks(
    engine: LLMEngine, infile: TextIO, outfile: TextIO, defaults: Defaults
) -> int:
    """This rank's part of `pdserve generate`; on rank 0 returns the number of bad lines."""
    try:
        return _generate_on_rank(engine, infile, outfile, defaults)
    except RuntimeError as exc:  # a peer died or hung: a collective failed or timed out
        text = str(exc).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        raise PdserveError(
            f"expert-parallel rank {dist.get_rank()}: the group failed: {reason}"
        ) from None


def _generate_on_rank(
    engine: LLMEngine, infile: TextIO, outfile: TextIO, defaults: Defaults
) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[int, dict[str, Any]] = {}
    good: list[tuple[int, int, Any, Any]] = []  # (index, line number, prompt, params)
    if rank == 0:
        index = 0
        for lineno, line in enumerate(infile, start=1):
            if not line.strip():
                continue
            try:
                prompt, params = parse_line(line, defaults)
                good.append((index, lineno, prompt, params))
            except InvalidRequestError as exc:
                results[index] = {"index": index, "error": str(exc), "line": lineno}
            index += 1
    shared: list[Any] = [good]
    dist.broadcast_object_list(shared, src=0)
    request_to_index: dict[str, int] = {}
    for index, lineno, prompt, params in shared[0][rank::world]:
        try:
            request = engine.add_request(prompt, params, request_id=f"line-{lineno}")
            request_to_index[request.request_id] = index
        except InvalidRequestError as exc:
            results[index] = {"index": index, "error": str(exc), "line": lineno}

    for request_id, out in _run_in_lockstep(engine).items():
        index = request_to_index[request_id]
        results[index] = result_row(index, out)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if rank != 0:
        return 0
    assert gathered is not None
    merged = {i: row for part in gathered for i, row in part.items()}
    errors = 0
    for i in sorted(merged):
        row = merged[i]
        if "error" in row:
            errors += 1
            print(f"pdserve generate: line {row.pop('line')}: {row['error']}", file=sys.stderr)
    for i in sorted(merged):
        outfile.write(json.dumps(merged[i], ensure_ascii=False) + "\n")
    return errors


def _run_in_lockstep(engine: LLMEngine) -> dict[str, RequestOutput]:
    runner = engine.runner
    final: dict[str, RequestOutput] = {}
    while lockstep_busy(engine.has_unfinished_requests(), runner.device):
        before = runner.num_forwards
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        if runner.num_forwards == before:  # nothing ran here: join the others' exchanges
            runner.idle_step()
        runner.rebalance_experts_if_due()
    return final
