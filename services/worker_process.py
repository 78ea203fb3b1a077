"""One worker process (prefill, decode or colocated): the engine in its thread, the KV
transport bound to the engine's cache, the metrics, and the gRPC server around the role's
servicer. `pdserve prefill|decode|colocated` all start here."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
from typing import Any

import torch.distributed as dist

from pdserve.common.handoff.slices import FollowerKv, gather_addresses
from pdserve.common.kv_transfer import create_transport
from pdserve.common.tracing import setup_tracing, shutdown_tracing
from pdserve.services.colocated import ColocatedServicer
from pdserve.services.decode.migration import MigrationSource, Migrator
from pdserve.services.decode.servicer import DecodeServicer
from pdserve.services.engine_args import load_engine
from pdserve.services.engine_loop import EngineLoop
from pdserve.services.engine_thread import EngineThread
from pdserve.services.frontend import longest_token_chars
from pdserve.services.grpc_server import ServiceProcess, message_limit, worker_message_limit
from pdserve.services.lockstep_loop import LockstepEngineLoop
from pdserve.services.metrics import WorkerMetrics
from pdserve.services.prefill.servicer import PrefillServicer
from pdserve.services.rank_group import current_group
from pdserve.services.status import StatusHub
from pdserve.services.tls import TlsFiles, use_internal_tls
from pdserve.services.worker import Worker
from pdserve.v1 import decode_pb2_grpc, generate_pb2_grpc, prefill_pb2_grpc, worker_pb2_grpc


def run_worker(args: argparse.Namespace, role: str) -> int:
    """Load the engine, serve until SIGINT / SIGTERM, then end the process (a process that
    used UCX may not end by itself)."""
    code = asyncio.run(_serve(args, role))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve(args: argparse.Namespace, role: str) -> int:
    tls = TlsFiles.from_args(args)  # raises ValueError naming a missing or unreadable file
    use_internal_tls(tls)
    setup_tracing(f"pdserve-{role}")
    # Loaded, stepped (and, on a tensor-parallel follower, run) in one thread: see
    # `EngineThread` for why every parallel kernel must start from the same thread.
    engine_thread = EngineThread()
    engine = await asyncio.wrap_future(engine_thread.submit(lambda: load_engine(args)))
    runner = engine.runner
    transport = None
    tp_addresses: list[bytes] = []
    if role != "colocated":
        transport = create_transport(args.kv_transport)
        transport.register_pool(runner.kv_cache)
        if runner.tp is not None:  # every rank moves its own heads (`common/handoff/slices.py`)
            tp_addresses = gather_addresses(transport)
    if runner.tp is not None and runner.tp.rank != 0:
        # A tensor-parallel rank serves nothing: it runs rank 0's steps and KV commands
        # until rank 0 stops (Ctrl-C reaches the whole process group; rank 0 decides).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        on_command = None
        if transport is not None:
            on_command = FollowerKv(runner.tp.rank, transport, runner.kv_cache,
                                    args.transfer_timeout)  # fmt: skip
        await asyncio.wrap_future(engine_thread.submit(lambda: runner.follow(on_command)))
        if transport is not None:
            transport.close()
        return 0
    group = current_group()
    tp_group = group if group is not None and group.kind == "tensor" else None
    if tp_group is not None:  # rank 0 is the group's one endpoint
        group = None
    rank = group.rank if group else 0
    if role == "colocated":  # its GenerateService also takes prompts as text
        limit = message_limit(engine.max_model_len * longest_token_chars(engine.tokenizer))
    else:
        limit = worker_message_limit(engine.max_model_len)
    process = ServiceProcess(
        args.host,
        args.port + rank if args.port else args.port,
        args.metrics_port + rank if args.metrics_port else args.metrics_port,
        max_message_bytes=limit,
        credentials=tls.server_credentials() if tls else None,
        # Rank r of an expert-parallel group listens at port + r, its health port too.
        health_port=args.health_port + rank if args.health_port > 0 else args.health_port,
        keepalive_s=args.grpc_keepalive,
    )
    worker_id = args.worker_id or f"{role}-{socket.gethostname()}-{process.port}"
    address = advertised_address(args.advertise_address, args.host, process.port)
    ranks: list[dict[str, Any]] = []
    if group is not None:
        ranks = gather_ranks(worker_id, address, process.metrics_port)
        worker_id = ranks[rank]["worker_id"]
    loop_type = EngineLoop if group is None else LockstepEngineLoop
    loop = loop_type(engine, asyncio.get_running_loop(), engine_thread)
    loop.max_pending = args.max_pending
    loop.fault_point = "decode.before_step" if role == "decode" else None
    if args.ttft_target_ms < 0:
        raise ValueError(f"ttft_target_ms: must be >= 0, got {args.ttft_target_ms}")
    if args.handoff_wait_ms < 0:
        raise ValueError(f"handoff_wait_ms: must be >= 0, got {args.handoff_wait_ms}")
    loop.ttft_target_s = args.ttft_target_ms / 1000
    model = os.path.basename(str(engine.model_dir))
    worker = Worker(
        role=role,
        worker_id=worker_id,
        address=address,
        loop=loop,
        transport=transport,
        metrics=WorkerMetrics(engine, role, worker_id, model),
        transfer_timeout_s=args.transfer_timeout,
        group=ranks[0]["group"] if ranks else "",
        group_rank=rank,
        group_size=group.world_size if group else 1,
        tp_addresses=tp_addresses,
    )
    names, migrator = _add_servicer(worker, process, args)
    status = StatusHub(worker, args.status_interval)
    worker_pb2_grpc.add_WorkerStatusServiceServicer_to_server(status, process.server)
    names.append("pdserve.v1.WorkerStatusService")
    loop.housekeeping.append(worker.metrics.sync_prefix_cache)
    if runner.step_sender is not None:
        loop.housekeeping.append(runner.step_sender.keepalive)
    loop.start()
    status.start()
    process.on_drain(status.drain)
    if group is not None and group.children:

        async def drain_group(_grace_s: float) -> None:
            group.signal_children(signal.SIGTERM)  # the group drains and stops together

        process.on_drain(drain_group)

    async def shutdown() -> None:
        await status.stop()
        loop.stop()
        loop.engine.close()
        runner.stop_followers()
        for ranks_started in (group, tp_group):
            if ranks_started is not None:
                ranks_started.reap_children()
        if transport is not None:
            transport.close()
        shutdown_tracing()

    process.on_stop(shutdown)
    ready = {
        "event": "listening",
        "role": role,
        "worker_id": worker_id,
        "grpc": process.address,
        "metrics": f"http://{args.host}:{process.metrics_port}/metrics",
        **({"health": f"{args.host}:{process.health_port}"} if process.health_port else {}),
        **({"group": worker.group, "ranks": ranks} if ranks else {}),
        # A tensor-parallel group's other ranks, which serve nothing themselves.
        **({"rank_pids": [c.pid for c in tp_group.children]} if tp_group else {}),
    }

    def on_ready() -> None:
        print(json.dumps(ready), flush=True)

    if migrator is not None:  # SIGTERM moves the streams out first, then drains
        process.before_drain(lambda grace: asyncio.gather(status.drain(0), migrator.drain(grace)))

    await process.run(names, on_ready=on_ready, grace_s=args.drain_timeout)
    return 0


def gather_ranks(worker_id: str, address: str, metrics_port: int | None) -> list[dict[str, Any]]:
    """Every rank's endpoint, in rank order (a collective: before the engine thread starts).
    The group is named after rank 0's worker id; rank r's id is `<group>-ep<r>`."""
    mine = {"worker_id": worker_id, "grpc": address, "metrics_port": str(metrics_port),
            "pid": os.getpid()}  # fmt: skip
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    group = ranks[0]["worker_id"]
    return [
        {
            "worker_id": f"{group}-ep{r}",
            "group": group,
            "grpc": info["grpc"],
            "metrics": f"http://{info['grpc'].rsplit(':', 1)[0]}:{info['metrics_port']}/metrics",
            "pid": info["pid"],
        }
        for r, info in enumerate(ranks)
    ]


def advertised_address(flag: str | None, host: str, port: int) -> str:
    """Where peers reach this worker: a wildcard listen address is no address to call, and
    an IPv6 one is written `[ip]:port` (as gRPC and discovery write it)."""
    if flag:
        return flag
    host = host.strip("[]")
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _add_servicer(
    worker: Worker, process: ServiceProcess, args: argparse.Namespace
) -> tuple[list[str], Migrator | None]:
    """The role's servicers on the server: the service names to advertise, and the decode
    worker's live migration (one process, not a group of ranks) that its SIGTERM drives."""
    if worker.role == "prefill":
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(
            PrefillServicer(worker, args.kv_lease), process.server
        )
        return ["pdserve.v1.PrefillService"], None
    if worker.role == "decode":
        decode = DecodeServicer(
            worker,
            args.max_pending,
            [a.strip() for a in args.prefill_workers.split(",") if a.strip()],
            args.handoff_wait_ms / 1000,
            keepalive_s=args.grpc_keepalive,
        )
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, process.server)
        if worker.group_size == 1 and worker.tensor_parallel == 1:
            # Served, not advertised: the pulls of the streams its drain moves (leased for
            # the drain's length).
            source = MigrationSource(worker, args.drain_timeout)
            prefill_pb2_grpc.add_PrefillServiceServicer_to_server(source, process.server)
            decode.migrator = Migrator(worker, source.sender)
        return ["pdserve.v1.DecodeService"], decode.migrator
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(
        ColocatedServicer(worker), process.server
    )
    return ["pdserve.v1.GenerateService"], None
