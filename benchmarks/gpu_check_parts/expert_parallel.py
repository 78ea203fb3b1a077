"""Part 'expert_parallel': one MoE layer's experts split over 2 rank processes
(`pdserve.common.models.expert_parallel`: dispatch, the local experts, combine, over
torch.distributed all-to-all; NCCL on a GPU, gloo on CPU), each rank with its own uneven
tokens, against the single-process fused experts on the full set (as
tests/integration/test_moe_expert_parallel.py does over gloo). On one GPU both ranks use
cuda:0, which NCCL may refuse ("Duplicate GPU detected"): the part then says so and is
skipped. (`pdserve --expert-parallel N` itself puts rank r on cuda:r, so it needs N GPUs.)"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from gpu_check_parts.common import Context

WORLD = 2
TOKENS = (9, 4)  # uneven on purpose
EXPERTS, HIDDEN, INTER, TOP_K = 8, 64, 48, 2


def _inputs(rank: int, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(100)  # the same experts on every rank
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    gen.manual_seed(200 + rank)  # each rank its own tokens
    x = torch.randn(TOKENS[rank], HIDDEN, generator=gen)
    scores = torch.randn(TOKENS[rank], EXPERTS, generator=gen)
    scores[:, 0] += 2.0 * (rank % 2)  # odd ranks lean on expert 0
    weights, ids = torch.topk(torch.softmax(scores, dim=-1), TOP_K, dim=-1)
    return tuple(t.to(device) for t in (x, w13, w2, weights, ids))


def _rank(rank: int, port: int, device: str, out: Path) -> None:
    result: dict[str, Any] = {}
    try:
        import torch.distributed as dist

        from pdserve.common.models.expert_parallel import (
            ExpertShard,
            TrafficCounter,
            ep_experts,
            init_group,
        )
        from pdserve.kernels.moe import fused_experts

        if device.startswith("cuda"):
            device = f"cuda:{rank % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
        init_group(rank, WORLD, f"127.0.0.1:{port}", device, 30.0)
        x, w13, w2, weights, ids = _inputs(rank, device)
        shard = ExpertShard(rank, WORLD, EXPERTS)
        traffic = TrafficCounter()
        got = ep_experts(x, weights, ids, shard.local(w13), shard.local(w2), shard, traffic)
        want = fused_experts(x, w13, w2, weights, ids)
        result = {
            "device": device,
            "max_abs_err": float((got - want).abs().max()),
            "rows_sent": traffic.rows_sent,
            "rows_kept": traffic.rows_kept,
            "bytes_sent": traffic.bytes_sent,
        }
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
    out.write_text(json.dumps(result))
    os._exit(0)


def run(ctx: Context) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fork = multiprocessing.get_context("fork")  # this process has not touched the device
    files = [ctx.workdir / f"ep_rank{r}.json" for r in range(WORLD)]
    procs = [fork.Process(target=_rank, args=(r, port, ctx.device, files[r])) for r in range(WORLD)]
    os.environ.setdefault("NCCL_DEBUG", "WARN")  # NCCL's own reason, in the part's log
    for p in procs:
        p.start()
    deadline = time.monotonic() + 40  # inside the part's own timeout, which would say less
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    ranks = [json.loads(f.read_text()) if f.is_file() else {"error": "no result"} for f in files]
    backend = "nccl" if ctx.cuda else "gloo"
    errors = [r["error"] for r in ranks if "error" in r]
    out: dict[str, Any] = {
        "backend": backend,
        "world": WORLD,
        "tokens": list(TOKENS),
        "ranks": ranks,
    }
    if errors:
        refused = any("duplicate gpu" in e.lower() or "invalid usage" in e.lower() for e in errors)
        if refused and ctx.cuda and torch.cuda.device_count() < WORLD:
            return {
                **out,
                "status": "skipped",
                "reason": f"NCCL refuses {WORLD} ranks on one GPU: {errors[0][:300]}",
            }
        return {**out, "status": "failed", "reason": errors[0][:500]}
    worst = max(r["max_abs_err"] for r in ranks)
    kept = sum(r["rows_kept"] + r["rows_sent"] for r in ranks) == sum(TOKENS) * TOP_K
    ok = worst <= 1e-5 and kept
    return {
        **out,
        "status": "ok" if ok else "failed",
        "max_abs_err": worst,
        "reason": f"{backend}, {WORLD} ranks: max |ep - fused| = {worst:.2g}"
        + ("" if kept else "; routed rows do not add up"),
    }
