"""Abort storm: thousands of streams cancelled at random phases within seconds, on real
processes (1 prefill + 1 decode worker behind a coordinator, the default model).

Each storm stream is a greedy gRPC `Generate` that the client cancels at a phase drawn at
random: `queued` (a few milliseconds after sending, before any token: waiting, tokenizing or
prefilling), `first_token` (right after the prefill worker's token arrives: the lease is held
and the decode worker is pulling or about to) or `decoding` (after 2 to 64 tokens). The
streams start evenly over `--storm-seconds`. Before the storm and after it, the same
closed-loop load measures output tokens/s; after the storm the workers are polled until every
KV block is free, no lease is held and nothing runs, and the time that took is set beside the
prefill worker's lease (`--kv-lease`). It prints one JSON object (progress on stderr):

- `storm`: streams sent, per phase how many were cancelled there (`reached`) and how many ended
  before reaching it (`ended_early`: refused under overload, or finished), and the refusals
  (RESOURCE_EXHAUSTED: admission control shedding the storm);
- `recovery_s`: last cancel -> both workers idle, and `within_lease`;
- `throughput`: output tokens/s before and after, and `after_over_before`;
- `workers`: each worker's blocks, leases and running requests at the end.

Run: `.venv/bin/python benchmarks/abort_storm.py > storm.json` (about two minutes here)."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from typing import Any

import grpc
from processes import Service

from pdserve.v1 import generate_pb2, generate_pb2_grpc

PHASES = ("queued", "first_token", "decoding")
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "List three prime numbers.",
    "Why do we have seasons on Earth?",
    "Give me a recipe for pancakes.",
    "What does a compiler do?",
    "Suggest a name for a bakery.",
]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def idle(worker: Service) -> bool:
    """Every block free, no lease held, nothing running or waiting."""
    return (
        worker.metric("pdserve_kv_cache_blocks_free")
        == worker.metric("pdserve_kv_cache_num_blocks")
        and worker.metric("pdserve_kv_leases_held") == 0
        and worker.metric("pdserve_num_requests_running") == 0
        and worker.metric("pdserve_num_requests_waiting") == 0
    )


def state(worker: Service) -> dict[str, float]:
    names = {
        "blocks_free": "pdserve_kv_cache_blocks_free",
        "blocks": "pdserve_kv_cache_num_blocks",
        "leases_held": "pdserve_kv_leases_held",
        "running": "pdserve_num_requests_running",
    }
    return {key: worker.metric(name) for key, name in names.items()}


def request(i: int, max_tokens: int) -> generate_pb2.GenerateRequest:
    question = QUESTIONS[i % len(QUESTIONS)] + f" ({i})"
    return generate_pb2.GenerateRequest(
        messages=[generate_pb2.ChatMessage(role="user", content=question)],
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


async def closed_loop(
    address: str, concurrency: int, total: int, max_tokens: int, first: int
) -> float:
    """Output tokens/s of `total` streams (prompts `first`, `first` + 1, ...: none cached
    yet), `concurrency` at a time."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        queue = list(range(total))
        tokens = 0

        async def worker() -> None:
            nonlocal tokens
            while queue:
                i = queue.pop()
                async for response in stub.Generate(request(first + i, max_tokens)):
                    tokens += len(response.token_ids)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens / (time.perf_counter() - start)


async def one_cancelled(
    stub: Any, i: int, phase: str, rng: random.Random, counts: dict[str, Any]
) -> None:
    call = stub.Generate(request(i, 128))
    try:
        if phase == "queued":
            await asyncio.sleep(rng.uniform(0.0, 0.02))
            call.cancel()
            counts[phase]["reached"] += 1
            return
        want = 1 if phase == "first_token" else rng.randint(2, 64)
        seen = 0
        async for response in call:
            seen += len(response.token_ids)
            if seen >= want:
                call.cancel()
                counts[phase]["reached"] += 1
                return
        counts[phase]["ended_early"] += 1  # finished before its point
    except grpc.aio.AioRpcError as e:
        counts[phase]["ended_early"] += 1
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            counts["refused"] += 1
        elif e.code() != grpc.StatusCode.CANCELLED:
            counts["errors"][e.code().name] = counts["errors"].get(e.code().name, 0) + 1
    except asyncio.CancelledError:
        counts[phase]["reached"] += 1


async def storm(address: str, streams: int, seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    counts: dict[str, Any] = {p: {"reached": 0, "ended_early": 0} for p in PHASES}
    counts.update(refused=0, errors={})
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        tasks = []
        start = time.perf_counter()
        for i in range(streams):
            delay = start + seconds * i / streams - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            phase = rng.choice(PHASES)
            tasks.append(asyncio.create_task(one_cancelled(stub, i, phase, rng, counts)))
        await asyncio.gather(*tasks)
        counts["sent"] = streams
        counts["seconds"] = round(time.perf_counter() - start, 3)
    return counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    worker_args = ["--kv-cache-tokens", str(args.kv_cache_tokens), "--threads", "1"]
    prefill = Service("prefill", *worker_args, "--kv-lease", str(args.kv_lease))
    decode = Service("decode", *worker_args)
    workers = {"prefill": prefill, "decode": decode}
    coordinator = Service(
        "coordinator",
        f"--prefill-workers={prefill.info['grpc']}",
        f"--decode-workers={decode.info['grpc']}",
    )
    address = coordinator.info["grpc"]
    out: dict[str, Any] = {"host": {"cpu": platform.processor() or platform.machine()}}
    try:
        loop = (args.concurrency, args.requests, args.max_tokens)
        if args.requests:  # warm-up: the first steps of each shape are slow
            asyncio.run(closed_loop(address, args.concurrency, args.concurrency, 8, 10_000))
        before = asyncio.run(closed_loop(address, *loop, 20_000)) if args.requests else None
        log(f"before the storm: {before} output tokens/s")
        log(f"storm: {args.streams} streams over {args.storm_seconds} s")
        counts = asyncio.run(storm(address, args.streams, args.storm_seconds, args.seed))
        ended = time.monotonic()
        bound = time.monotonic() + args.kv_lease + 60
        while not all(idle(w) for w in workers.values()):
            if time.monotonic() > bound:
                break
            time.sleep(0.05)
        recovery = time.monotonic() - ended
        log(f"workers idle {recovery:.2f} s after the storm")
        after = asyncio.run(closed_loop(address, *loop, 30_000)) if args.requests else None
        out.update(
            storm=counts,
            recovery_s=round(recovery, 3),
            kv_lease_s=args.kv_lease,
            within_lease=all(idle(w) for w in workers.values()) and recovery <= args.kv_lease,
            throughput={
                "output_tokens_per_s_before": before,
                "output_tokens_per_s_after": after,
                "after_over_before": after / before if before and after else None,
                "concurrency": args.concurrency,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
            },
            workers={name: state(w) for name, w in workers.items()},
            coordinator_failures_total=coordinator.metric("pdserve_request_failure_total"),
            command=" ".join(["benchmarks/abort_storm.py", *sys.argv[1:]]),
        )
    finally:
        for service in (coordinator, decode, prefill):
            service.stop()
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=2000, help="storm streams (default 2000)")
    p.add_argument("--storm-seconds", type=float, default=5.0, help="spread over (default 5)")
    p.add_argument("--kv-lease", type=float, default=30.0, help="prefill lease, s (default 30)")
    p.add_argument("--requests", type=int, default=32,
                   help="closed-loop streams before and after (0: no throughput runs)")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    return p


def main() -> int:
    print(json.dumps(run(build_parser().parse_args()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
