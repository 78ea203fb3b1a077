"""Routing past one machine: a discrete-event simulation of the coordinator's real routing
code (`Router`, `PrefixIndex` fed by the workers' cache events) over 8-512 simulated prefill
and decode workers, to compare policies and pick the default weights.

Each simulated prefill worker serves prompts one at a time, first come first served, in
`prefill_s = base + per_token x uncached tokens`; its prefix cache is an LRU of block hashes
(`--cache-blocks`), whose stores and evictions go to the router's index as a real worker's
reports do. Each decode worker runs a continuous batch: one step every `base + per_seq x
batch` seconds gives every running sequence a token. The default costs are this machine's
(2-core AVX2 host, SmolLM2-135M in float32, one thread per worker): a prompt token ~6.5 ms
of prefill, a decode step 140 ms + 8.5 ms per sequence; set them for other hardware.

Workloads (`--workload`, fixed seed):
- `multi_turn`: conversations arrive as a Poisson stream, each with its own 256-token system
  prompt and 4 turns; a turn's prompt is the conversation so far plus a 32-token question
  and the answer is 64 tokens; 5 s (exponential) of thinking between turns.
- `shared_system`: 8 system prompts of 512 tokens (Zipf-popular), each request adding its own
  64-token question; answers of 64 tokens.

Offered load is `--load` x the prefill pool's capacity for that workload without caching.
Printed: one JSON object with, per workload, worker count and policy: prefix-cache hit rate
(cached / prompt tokens), TTFT and TPOT p50/p90/p99, and prefill load imbalance (busiest
worker's busy time over the mean); with `--plot`, a PNG of hit rate and TTFT p90 against the
worker count per policy.

    .venv/bin/python benchmarks/route_sim.py --plot /tmp/route_sim.png
    .venv/bin/python benchmarks/route_sim.py --workers 8,32 --sweep-load-weight 1,4,8,16,32
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.services.coordinator.prefix_index import PrefixIndex
from pdserve.services.coordinator.router import Router, RouterWeights, WorkerState

BLOCK = 16


@dataclass(frozen=True)
class Costs:
    prefill_base_s: float = 0.05
    prefill_per_token_s: float = 0.0065
    decode_base_s: float = 0.14
    decode_per_seq_s: float = 0.0085


@dataclass
class Request:
    arrival: float
    blocks: list[int]  # the prompt's block hashes
    tokens: int
    output: int
    on_done: Callable[[float], None] | None = None  # e.g. the next turn of its conversation
    first: float = 0.0
    done: float = 0.0
    cached: int = 0


@dataclass(eq=False)
class PrefillSim:
    state: WorkerState
    capacity: int
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    queue: list[Request] = field(default_factory=list)
    busy_until: float = 0.0
    busy_s: float = 0.0

    def cached_blocks(self, blocks: list[int]) -> int:
        n = 0
        for h in blocks:
            if h not in self.cache:
                break
            n += 1
        return n

    def store(self, blocks: list[int], index: PrefixIndex) -> None:
        stored, evicted = [], []
        for h in blocks:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                stored.append(h)
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        index.apply(self.state.address, stored, evicted)


@dataclass(eq=False)
class DecodeSim:
    state: WorkerState
    running: list[list[Any]] = field(default_factory=list)  # [request, tokens left]
    stepping: bool = False


class Simulation:
    def __init__(
        self, workers: int, policy: str, weights: RouterWeights, costs: Costs, cache_blocks: int
    ) -> None:
        self.costs = costs
        self.index = PrefixIndex()
        self.prefill = [PrefillSim(WorkerState(f"p{i}"), cache_blocks) for i in range(workers)]
        self.decode = [DecodeSim(WorkerState(f"d{i}")) for i in range(workers)]
        self.prefill_router = Router("prefill", policy, weights, self.index)
        self.decode_router = Router("decode", "least_loaded")
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self.finished: list[Request] = []

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn))

    def run(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            t, _, fn = heapq.heappop(self.events)
            fn(t)

    def submit(self, t: float, request: Request) -> None:
        states = [p.state for p in self.prefill]
        chosen = self.prefill_router.pick(states, request.blocks)
        worker = next(p for p in self.prefill if p.state is chosen)
        worker.queue.append(request)
        worker.state.num_waiting += 1
        worker.state.update_queue()
        if worker.busy_until <= t:
            self._next_prefill(worker, t)

    def _next_prefill(self, worker: PrefillSim, t: float) -> None:
        if not worker.queue:
            return
        request = worker.queue.pop(0)
        worker.state.num_waiting -= 1
        worker.state.num_running = 1
        worker.state.update_queue()
        hit = worker.cached_blocks(request.blocks)
        request.cached = min(hit * BLOCK, request.tokens - 1)
        cost = self.costs.prefill_base_s + self.costs.prefill_per_token_s * (
            request.tokens - request.cached
        )
        worker.busy_until = t + cost
        worker.busy_s += cost

        def done(now: float) -> None:
            worker.state.num_running = 0
            worker.state.update_queue()
            worker.store(request.blocks, self.index)
            request.first = now
            self._to_decode(request, now)
            self._next_prefill(worker, now)

        self.at(t + cost, done)

    def _to_decode(self, request: Request, t: float) -> None:
        chosen = self.decode_router.pick([d.state for d in self.decode])
        worker = next(d for d in self.decode if d.state is chosen)
        worker.running.append([request, request.output - 1])
        worker.state.num_running += 1
        worker.state.update_queue()
        if not worker.stepping:
            worker.stepping = True
            self._step(worker, t)

    def _step(self, worker: DecodeSim, t: float) -> None:
        if not worker.running:
            worker.stepping = False
            return
        cost = self.costs.decode_base_s + self.costs.decode_per_seq_s * len(worker.running)

        def done(now: float) -> None:
            still = []
            for entry in worker.running:
                entry[1] -= 1
                if entry[1] <= 0:
                    request = entry[0]
                    request.done = now
                    worker.state.num_running -= 1
                    worker.state.update_queue()
                    self.finished.append(request)
                    if request.on_done is not None:
                        request.on_done(now)
                else:
                    still.append(entry)
            worker.running = still
            self._step(worker, now)

        self.at(t + cost, done)


def _chain(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(63) for _ in range(n)]


class Conversation:
    """One chat: its own system prompt, then `turns` questions, each after the last answer
    and a think time; the answers join the history the next prompt carries."""

    def __init__(self, sim: Simulation, rng: random.Random, turns: int = 4) -> None:
        self.sim, self.rng, self.left = sim, rng, turns
        self.history = _chain(rng, 256 // BLOCK)

    def turn(self, now: float) -> None:
        self.history.extend(_chain(self.rng, 32 // BLOCK))
        self.left -= 1
        request = Request(now, list(self.history), len(self.history) * BLOCK, 64)
        if self.left > 0:
            request.on_done = self.answered
        self.sim.submit(now, request)

    def answered(self, now: float) -> None:
        self.history.extend(_chain(self.rng, 64 // BLOCK))
        self.sim.at(now + self.rng.expovariate(1 / 5.0), self.turn)


def multi_turn(sim: Simulation, rng: random.Random, rate: float, duration: float) -> None:
    """Conversations at `rate` per second (their turns follow their own answers)."""
    t = 0.0
    while t < duration:
        t += rng.expovariate(rate)
        sim.at(t, Conversation(sim, rng).turn)


def shared_system(sim: Simulation, rng: random.Random, rate: float, duration: float) -> None:
    systems = [_chain(rng, 512 // BLOCK) for _ in range(8)]
    weights = [1 / (k + 1) for k in range(len(systems))]
    t = 0.0
    while t < duration:
        t += rng.expovariate(rate)
        blocks = rng.choices(systems, weights)[0] + _chain(rng, 64 // BLOCK)
        request = Request(t, blocks, len(blocks) * BLOCK, 64)
        sim.at(t, lambda now, r=request: sim.submit(now, r))


WORKLOADS = {
    # name: (generator, mean uncached prefill tokens per request at no caching, requests per
    # arrival) -- to offer a load relative to the prefill pool's capacity
    "multi_turn": (multi_turn, 256 + 32 * 2.5 + 64 * 1.5, 4),
    "shared_system": (shared_system, 512 + 64, 1),
}


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3)}


def simulate(
    workload: str, workers: int, policy: str, weights: RouterWeights, args: argparse.Namespace
) -> dict[str, Any]:
    costs = Costs()
    generate, tokens, per_arrival = WORKLOADS[workload]
    capacity = workers / (costs.prefill_base_s + costs.prefill_per_token_s * tokens)
    rate = args.load * capacity / per_arrival
    sim = Simulation(workers, policy, weights, costs, args.cache_blocks)
    generate(sim, random.Random(f"{args.seed}:{workload}"), rate, args.duration)
    sim.run(args.duration * 3)
    done = [r for r in sim.finished if r.arrival >= args.warmup]
    prompt = sum(r.tokens for r in done)
    busy = [p.busy_s for p in sim.prefill]
    return {
        "workload": workload,
        "workers": workers,
        "policy": policy,
        "load_weight": weights.load_weight,
        "requests": len(done),
        "hit_rate": round(sum(r.cached for r in done) / prompt, 4) if prompt else None,
        "ttft_s": percentiles([r.first - r.arrival for r in done]),
        "tpot_s": percentiles([(r.done - r.first) / max(1, r.output - 1) for r in done]),
        "prefill_imbalance": round(max(busy) / (sum(busy) / len(busy)), 3) if any(busy) else None,
    }


def runs(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    for workload in args.workload:
        for workers in args.workers:
            for policy in ("round_robin", "least_loaded", "prefix_aware"):
                lws = args.sweep_load_weight if policy == "prefix_aware" else [8.0]
                for lw in lws:
                    yield simulate(workload, workers, policy, RouterWeights(1.0, lw), args)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 8), squeeze=False)
    for col, workload in enumerate(workloads):
        mine = [r for r in rows if r["workload"] == workload]
        for key in sorted({(r["policy"], r["load_weight"]) for r in mine}):
            line = sorted((r for r in mine if (r["policy"], r["load_weight"]) == key),
                          key=lambda r: r["workers"])  # fmt: skip
            label = key[0] if key[0] != "prefix_aware" else f"prefix_aware (load {key[1]:g})"
            xs = [r["workers"] for r in line]
            axes[0][col].plot(xs, [r["hit_rate"] for r in line], marker="o", label=label)
            axes[1][col].plot(xs, [r["ttft_s"]["p90"] for r in line], marker="o", label=label)
        axes[0][col].set_title(f"{workload}: prefix-cache hit rate")
        axes[1][col].set_title(f"{workload}: TTFT p90 (s)")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prefill workers (and as many decode)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def number_list(cast: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [cast(x) for x in text.split(",") if x.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", type=number_list(str), default=list(WORKLOADS))
    p.add_argument("--workers", type=number_list(int), default=[8, 32, 128, 512])
    p.add_argument("--load", type=float, default=0.7, help="offered / uncached prefill capacity")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    p.add_argument("--warmup", type=float, default=20.0, help="arrivals before this not counted")
    p.add_argument("--cache-blocks", type=int, default=2048, help="prefix cache per worker")
    p.add_argument("--sweep-load-weight", type=number_list(float), default=[2.0, 8.0, 32.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    rows = list(runs(args))
    if args.plot:
        plot(rows, args.plot)
    print(json.dumps({"benchmark": "route_sim", "costs": Costs().__dict__, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
