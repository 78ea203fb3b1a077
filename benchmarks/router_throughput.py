"""How many routing decisions the coordinator's prefix-aware router makes per second on one
core, with many workers and a large prefix index: the real `Router` and `PrefixIndex`, no
processes, no network.

Setup: `--workers` workers (512) share `--indexed-blocks` (1,000,000) block hashes, laid out
as conversations of `--prefix-blocks` blocks (32: 512-token prompts at 16 tokens a block),
each held by `--replicas` workers (2). Each decision routes a prompt whose first
`--shared-fraction` of blocks belongs to a random indexed conversation and whose tail is new,
so the overlap walk does real work; workers carry random queue lengths. Printed as one JSON
object: decisions per second for the decision alone, and with the prompt's block hashing
(SHA-256 per block), which the coordinator also does once per request.

    .venv/bin/python benchmarks/router_throughput.py
    .venv/bin/python benchmarks/router_throughput.py --workers 64 --indexed-blocks 100000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from machine import cpu_name

from pdserve.common.block_hashing import block_hashes
from pdserve.services.coordinator.prefix_index import PrefixIndex
from pdserve.services.coordinator.router import Router, WorkerState


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=512)
    p.add_argument("--indexed-blocks", type=int, default=1_000_000)
    p.add_argument("--prefix-blocks", type=int, default=32)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--shared-fraction", type=float, default=0.75)
    p.add_argument("--decisions", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    rng = random.Random(args.seed)

    workers = [WorkerState(f"10.0.{i // 256}.{i % 256}:50061") for i in range(args.workers)]
    index = PrefixIndex()
    conversations: list[list[int]] = []
    built = time.perf_counter()
    next_hash = 1
    while len(index) < args.indexed_blocks:
        chain = list(range(next_hash, next_hash + args.prefix_blocks))
        next_hash += args.prefix_blocks
        for w in rng.sample(workers, args.replicas):
            index.apply(w.address, chain)
        conversations.append(chain)
    built = time.perf_counter() - built
    router = Router("prefill", "prefix_aware", index=index)
    shared = int(args.prefix_blocks * args.shared_fraction)
    prompts = []
    for _ in range(args.decisions):
        head = rng.choice(conversations)[:shared]
        prompts.append(head + [rng.getrandbits(63) for _ in range(args.prefix_blocks - shared)])
    for w in workers:
        w.num_running, w.num_waiting = rng.randrange(8), rng.randrange(4)
        w.update_queue()

    start = time.perf_counter()
    for hashes in prompts:
        router.pick(workers, hashes)
    decide = time.perf_counter() - start

    tokens = [[rng.randrange(49152) for _ in range(args.prefix_blocks * 16)] for _ in range(1000)]
    start = time.perf_counter()
    for t in tokens:
        block_hashes(t, 16)
    hashing = (time.perf_counter() - start) / len(tokens)

    per_decision = decide / len(prompts)
    print(
        json.dumps(
            {
                "benchmark": "router_throughput",
                "processor": cpu_name(),
                "workers": args.workers,
                "indexed_blocks": len(index),
                "index_build_s": round(built, 2),
                "prompt_blocks": args.prefix_blocks,
                "shared_blocks": shared,
                "decisions": len(prompts),
                "decision_us": round(per_decision * 1e6, 1),
                "decisions_per_s": round(1 / per_decision),
                "prompt_hashing_us": round(hashing * 1e6, 1),
                "decisions_per_s_with_hashing": round(1 / (per_decision + hashing)),
                "target_decisions_per_s": 5000,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
