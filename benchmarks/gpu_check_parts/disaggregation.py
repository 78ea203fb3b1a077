"""Part 'disaggregation': prefill and decode as separate processes on one device.

- transfer: KV blocks pulled over UCX from another process's pool into scattered free blocks
  of this one's, the way the decode worker pulls them (benchmarks/kv_transfer.py's
  measurement), both pools on the device (UCX's cuda_ipc / cuda_copy on a GPU, shared memory
  on CPU); GB/s from the ask to every block in place, beside copying the same blocks one by
  one inside one process (`dst[j].copy_(src[i])`, as many copies as UCX sends messages) and
  in one gather (`index_select` + `index_copy_`); the bytes checked by digest. Block shape:
  an 8B Llama's (32 layers x K/V x 16 tokens x 8 KV heads x 128 x bf16 = 2 MiB); `--tiny`,
  a small one. UCX's protocol lines naming cuda transports (UCX_PROTO_INFO) are reported.
- served: `pdserve prefill`, `pdserve decode` and a coordinator, and a `pdserve colocated`
  worker, all on the device with a tiny random-weight Llama; greedy ids of concurrent
  token-id requests through the coordinator equal the colocated worker's, and the decode
  worker's metrics show the KV moving. On the CPU dry run (`--tiny` on cpu) the colocated
  side is the same engine in this process (what `pdserve colocated` runs), which spares the
  small machine a fourth service start."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import time
import urllib.request
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

from gpu_check_parts.common import (
    Context,
    build_tiny,
    make_engine,
    random_prompts,
    rounded,
    sync,
)

BLOCK_8B = (32, 2, 16, 8, 128)  # layers, K/V, tokens, KV heads, head dim
BLOCK_TINY = (4, 2, 16, 2, 32)
START_TIMEOUT_S = 120.0


def _pool(blocks: int, shape: tuple[int, ...], device: str, seed: int) -> torch.Tensor:
    from pdserve.common.model_runner import allocate_kv_cache

    pool = allocate_kv_cache((blocks, *shape), torch.bfloat16, torch.device(device))
    gen = torch.Generator(device=device).manual_seed(seed)
    pool.view(torch.uint8).random_(0, 256, generator=gen)
    return pool


def _digest(pool: torch.Tensor, ids: list[int]) -> str:
    return hashlib.blake2b(pool[ids].view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _sender(conn: Connection, blocks: int, shape: tuple[int, ...], device: str) -> None:
    """The prefill side (a forked process): sends the blocks it is asked for."""
    from pdserve.common.kv_transfer.ucx import UcxTransport

    transport = UcxTransport()
    try:
        pool = _pool(blocks, shape, device, seed=2)
        sync(device)
        transport.register_pool(pool)
        conn.send(transport.address)
        while (msg := conn.recv()) is not None:
            peer, tag, ids, check = msg
            transport.send(peer, tag, ids, 60.0).result()
            conn.send(_digest(pool, ids) if check else None)
    finally:
        transport.close()
        os._exit(0)  # a process that used UCX may not exit on its own


def transfer(ctx: Context) -> dict[str, Any]:
    shape = BLOCK_TINY if ctx.tiny else BLOCK_8B
    pool_blocks, token_counts = (256, [256, 1024]) if ctx.tiny else (1024, [512, 2048, 8192])
    block_bytes = 2 * int(torch.Size(shape).numel())
    # Forked before this process touches the device: the sender initialises its own.
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(
        target=_sender, args=(child, pool_blocks, shape, ctx.device), daemon=True
    )
    proc.start()
    from pdserve.common.kv_transfer.ucx import UcxTransport, ucx_env_defaults

    transport = UcxTransport()
    rows = []
    try:
        dst = _pool(pool_blocks, shape, ctx.device, seed=3)
        src = _pool(pool_blocks, shape, ctx.device, seed=1)
        transport.register_pool(dst)
        if not parent.poll(START_TIMEOUT_S):
            raise RuntimeError("the sender process did not start")
        parent.recv()
        rng = random.Random(7)
        for tokens in token_counts:
            n = tokens // shape[2]
            pulls, copies, gathers, ok = [], [], [], None
            for rep in range(6):
                dst_ids = rng.sample(range(pool_blocks), n)
                src_ids = rng.sample(range(pool_blocks), n)
                tag = transport.new_tag()
                future = transport.post_receive(tag, dst_ids, 60.0)
                start = time.perf_counter()
                parent.send((transport.address, tag, src_ids, rep == 1))
                future.result()
                pulls.append(time.perf_counter() - start)
                sent = parent.recv()
                if sent is not None:
                    ok = sent == _digest(dst, dst_ids)
                sync(ctx.device)
                start = time.perf_counter()
                for i, j in zip(src_ids, dst_ids, strict=True):
                    dst[j].copy_(src[i])
                sync(ctx.device)
                copies.append(time.perf_counter() - start)
                index_src = torch.tensor(src_ids, device=ctx.device)
                index_dst = torch.tensor(dst_ids, device=ctx.device)
                sync(ctx.device)
                start = time.perf_counter()
                dst.index_copy_(0, index_dst, src.index_select(0, index_src))
                sync(ctx.device)
                gathers.append(time.perf_counter() - start)
            nbytes = n * block_bytes
            ucx = nbytes / statistics.median(pulls[1:]) / 1e9
            copy = nbytes / statistics.median(copies[1:]) / 1e9
            gather = nbytes / statistics.median(gathers[1:]) / 1e9
            rows.append(
                {
                    "tokens": tokens,
                    "blocks": n,
                    "bytes": nbytes,
                    "checksum_ok": ok,
                    "ucx_gb_per_s": rounded(ucx),
                    "device_copy_gb_per_s": rounded(copy),
                    "ucx_over_copy": rounded(ucx / copy),
                    "device_gather_copy_gb_per_s": rounded(gather),
                    "ucx_over_gather_copy": rounded(ucx / gather),
                }
            )
    finally:
        transport.close()
        parent.send(None)
        proc.join(20)
        if proc.is_alive():
            proc.kill()
    env = {k: os.environ.get(k) for k in ucx_env_defaults()}
    return {
        "block_bytes": block_bytes,
        "pool_blocks": pool_blocks,
        "ucx_env": env,
        "sizes": rows,
        "ok": all(r["checksum_ok"] for r in rows),
    }


def _metric(url: str, name: str) -> float:
    """The sum of the samples named `name` on a service's /metrics."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    families = text_string_to_metric_families(text)
    return sum((s.value for f in families for s in f.samples if s.name == name), 0.0)


def served(ctx: Context) -> dict[str, Any]:
    import grpc

    from pdserve.services.grpc_server import wait_healthy
    from pdserve.services.launcher import ServiceChild
    from pdserve.v1 import generate_pb2, generate_pb2_grpc

    folder = build_tiny(ctx.workdir / "served-llama", "llama", ctx.tokenizer_dir)
    threads = "1" if not ctx.cuda else "4"
    worker = [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--model",
        str(folder),
        "--device",
        ctx.device,
        "--dtype",
        "bfloat16",
        "--kv-cache-tokens",
        "8192",
        "--threads",
        threads,
    ]
    children: list[ServiceChild] = []

    def healthy(child: ServiceChild) -> dict[str, Any]:
        info = child.wait_listening(START_TIMEOUT_S)
        asyncio.run(wait_healthy(info.get("health", info["grpc"]), START_TIMEOUT_S))
        return info

    in_process = ctx.tiny and not ctx.cuda
    roles = ("prefill", "decode") if in_process else ("prefill", "decode", "colocated")
    try:
        start = time.perf_counter()
        for role in roles:  # they load at once
            children.append(ServiceChild(role, worker))
        prompts = random_prompts((5, 17, 40, 96, 1, 200), seed=31)
        if in_process:
            coloc = _in_process(folder, ctx.device, prompts, int(threads))
        infos = [healthy(c) for c in children]
        prefill, decode = infos[:2]
        children.append(
            ServiceChild(
                "coordinator",
                [
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--metrics-port",
                    "0",
                    "--http-port",
                    "-1",
                    "--model",
                    str(folder),
                    "--prefill-workers",
                    prefill["grpc"],
                    "--decode-workers",
                    decode["grpc"],
                ],
            )
        )
        coordinator = healthy(children[-1])
        started_s = time.perf_counter() - start
        sampling = generate_pb2.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

        def ask(address: str, ids: list[int]) -> list[int]:
            with grpc.insecure_channel(address) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                request = generate_pb2.GenerateRequest(token_ids=ids, sampling=sampling)
                return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            disagg = list(pool.map(lambda p: ask(coordinator["grpc"], p), prompts))
            if not in_process:
                coloc = list(pool.map(lambda p: ask(infos[2]["grpc"], p), prompts))
        moved = _metric(decode["metrics"], "pdserve_kv_transfer_bytes_total")
        seconds = _metric(decode["metrics"], "pdserve_kv_transfer_seconds_sum")
    finally:
        for child in children:
            child.stop()
        for child in children:
            try:
                child.proc.wait(15)
            except subprocess.TimeoutExpired:
                child.proc.kill()
    same = [d == c for d, c in zip(disagg, coloc, strict=True)]
    return {
        "ok": all(same) and moved > 0 and all(len(d) == 16 for d in disagg),
        "colocated": "in-process engine" if in_process else "pdserve colocated worker",
        "requests": len(prompts),
        "equal_to_colocated": sum(same),
        "start_s": round(started_s, 1),
        "kv_bytes_moved": int(moved),
        "kv_gb_per_s_in_service": rounded(moved / seconds / 1e9) if seconds else None,
    }


def _in_process(folder: Path, device: str, prompts: list[list[int]], threads: int) -> list:
    from pdserve.common.sampling_params import SamplingParams

    engine = make_engine(folder, device, "bfloat16", kv_cache_tokens=8192, threads=threads)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def ucx_protocols(ctx: Context) -> list[str]:
    """UCX_PROTO_INFO's lines that name a cuda transport, from this part's own log."""
    try:
        text = (ctx.workdir / "disaggregation.log").read_text(errors="replace")
    except OSError:
        return []
    lines = [line.strip() for line in text.splitlines() if re.search(r"cuda_(ipc|copy)", line)]
    return list(dict.fromkeys(lines))[:8]


def run(ctx: Context) -> dict[str, Any]:
    if ctx.cuda:  # UCX prints the protocols it picks: the cuda ones are reported
        os.environ.setdefault("UCX_PROTO_INFO", "y")
    out: dict[str, Any] = {}
    for name, fn in (("transfer", transfer), ("served", served)):
        try:
            out[name] = fn(ctx)
        except Exception as exc:
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000]}
    if ctx.cuda:
        out["ucx_cuda_protocol_lines"] = ucx_protocols(ctx)
    failed = [k for k in ("transfer", "served") if not out[k]["ok"]]
    sizes = out["transfer"].get("sizes") or [{}]
    biggest = sizes[-1]
    reason = (
        f"failed: {', '.join(failed)}"
        if failed
        else f"UCX {biggest.get('ucx_gb_per_s')} GB/s ({biggest.get('ucx_over_copy')}x a device "
        f"copy) at {biggest.get('tokens')} tokens; served ids == colocated"
    )
    return {"status": "failed" if failed else "ok", "reason": reason, **out}
