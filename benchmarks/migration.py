"""Live migration against recompute: what moving a running stream off a decode worker costs
the client, on real processes (1 prefill + 2 decode workers behind a coordinator, KV over
UCX, the default model).

Each trial sends one greedy stream of `--max-tokens` after a prompt of a given length of
context (random token ids, a fresh prompt per trial) and, once `--signal-after` tokens have
arrived, ends the decode worker running it:

- `migration`: SIGTERM. The worker drains: it leases the stream's KV and the coordinator has
  the other decode worker pull it and go on (nothing is prefilled again);
- `recompute`: SIGKILL, a crash. The coordinator starts a new leg: the prefill worker
  computes the prompt and every token already sent again, and the other decode worker pulls
  that and goes on (today's failover). The prefill worker runs without prefix caching
  (`--no-prefix-caching`) unless `--prefill-prefix-caching`: a long-running stream's prompt
  is not assumed still cached.

The figure per trial is the stall the client sees: the longest gap between two tokens from
the signal on (`stall_s`), beside the stream's median gap before it (`itl_s`); `extra_s` is
their difference, the switch's own cost. `kv_bytes_pulled`: the KV the other decode worker
received for the stream after the signal (from the draining worker, or from the new
prefill). The worker is started again (same port) before the next trial, and each trial
checks from the coordinator's counters that it went the way it names
(`pdserve_kv_migrations_total`, prefill decisions; a trial that did not says `unexpected`).
It prints one JSON object (progress on stderr).

Run: `.venv/bin/python benchmarks/migration.py > migration.json` (about eight minutes on 2
cores)."""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import signal
import statistics
import sys
import threading
import time
from typing import Any

import grpc
from processes import Service

from pdserve.v1 import generate_pb2, generate_pb2_grpc

VOCAB_RANGE = (1000, 40000)  # ordinary tokens of the default model's vocabulary


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Stream:
    """One stream read in a thread: when each token arrived."""

    def __init__(self, address: str, prompt: list[int], max_tokens: int) -> None:
        self.arrivals: list[float] = []
        self.error: str | None = None
        request = generate_pb2.GenerateRequest(
            token_ids=prompt,
            sampling=generate_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True
            ),
        )
        self.thread = threading.Thread(target=self._run, args=(address, request))
        self.thread.start()

    def _run(self, address: str, request: generate_pb2.GenerateRequest) -> None:
        try:
            with grpc.insecure_channel(address) as channel:
                stub = generate_pb2_grpc.GenerateServiceStub(channel)
                for response in stub.Generate(request, timeout=600):
                    now = time.monotonic()
                    self.arrivals += [now] * len(response.token_ids)
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"


def wait_watched(worker: Service, coordinator: Service) -> None:
    """Until the coordinator routes to a (re)started worker again: its status stream is
    watched (`pdserve_status_watchers`), or, where a worker has no such gauge, after a while."""
    end = time.monotonic() + 10
    while worker.metric("pdserve_status_watchers") < 1 and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(0.5)  # the first report reaches the coordinator's pool


def trial(
    cluster: dict[str, Service], mode: str, context: int, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    coordinator = cluster["coordinator"]
    rng = random.Random(seed)
    prompt = [rng.randrange(*VOCAB_RANGE) for _ in range(context)]
    migrated = coordinator.metric("pdserve_kv_migrations_total", outcome="migrated")
    picks = coordinator.metric("pdserve_router_decisions_total", pool="prefill")
    stream = Stream(coordinator.info["grpc"], prompt, args.max_tokens)
    while len(stream.arrivals) < args.signal_after:
        if not stream.thread.is_alive():
            raise RuntimeError(f"the stream ended early: {stream.error}")
        time.sleep(0.005)
    victim = max(("d0", "d1"), key=lambda n: cluster[n].metric("pdserve_num_requests_running"))
    survivor = cluster["d1" if victim == "d0" else "d0"]
    received = survivor.metric("pdserve_kv_transfer_bytes_total", direction="receive")
    signalled = time.monotonic()
    cluster[victim].child.proc.send_signal(
        signal.SIGTERM if mode == "migration" else signal.SIGKILL
    )
    stream.thread.join()
    if stream.error is not None:
        raise RuntimeError(f"{mode} at {context} tokens: the stream failed: {stream.error}")
    cluster[victim].child.proc.wait(120)
    times = stream.arrivals
    before = [b - a for a, b in itertools.pairwise(times) if b <= signalled]
    after = [b - a for a, b in itertools.pairwise(times) if b > signalled]
    itl = statistics.median(before)
    stall = max(after)
    # What the survivor pulled: from the draining worker, or from prefill's new leg.
    moved = survivor.metric("pdserve_kv_transfer_bytes_total", direction="receive") - received
    went = {
        "migrated": coordinator.metric("pdserve_kv_migrations_total", outcome="migrated")
        - migrated,
        "prefills": coordinator.metric("pdserve_router_decisions_total", pool="prefill") - picks,
    }
    # Migration: no prefill but the stream's own; recompute: one more, no migration.
    expected = {"migrated": int(mode == "migration"), "prefills": 1 + (mode == "recompute")}
    cluster[victim] = cluster[victim].restarted()
    wait_watched(cluster[victim], coordinator)
    result = {"stall_s": round(stall, 4), "itl_s": round(itl, 4),
              "extra_s": round(stall - itl, 4), "tokens": len(times),
              "kv_bytes_pulled": int(moved)}  # fmt: skip
    if went != expected:
        result["unexpected"] = went
    log(f"{mode} at {context} tokens: {result}")
    return result


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "median_stall_s": round(statistics.median(t["stall_s"] for t in trials), 4),
        "median_extra_s": round(statistics.median(t["extra_s"] for t in trials), 4),
        "trials": trials,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    worker_args = ["--kv-cache-tokens", str(args.kv_cache_tokens), "--threads", "1",
                   "--tpot-target-ms", "0"]  # fmt: skip
    prefill_args = [] if args.prefill_prefix_caching else ["--no-prefix-caching"]
    cluster = {"p": Service("prefill", *worker_args, *prefill_args)}
    try:
        cluster["d0"] = Service("decode", *worker_args)
        cluster["d1"] = Service("decode", *worker_args)
        cluster["coordinator"] = Service(
            "coordinator",
            f"--prefill-workers={cluster['p'].info['grpc']}",
            f"--decode-workers={cluster['d0'].info['grpc']},{cluster['d1'].info['grpc']}",
        )
        contexts: dict[str, Any] = {}
        seed = args.seed
        # Warm-up: each worker's first steps of each shape are slow.
        for _ in range(2):
            warm = Stream(cluster["coordinator"].info["grpc"], [7] * 64, 4)
            warm.thread.join()
        for context in args.contexts:
            runs: dict[str, list[dict[str, Any]]] = {"migration": [], "recompute": []}
            for _ in range(args.trials):
                for mode in ("migration", "recompute"):
                    seed += 1
                    runs[mode].append(trial(cluster, mode, context, seed, args))
            contexts[str(context)] = {mode: summary(t) for mode, t in runs.items()}
            m, r = (contexts[str(context)][k]["median_extra_s"] for k in runs)
            contexts[str(context)]["recompute_over_migration"] = round(r / m, 2) if m > 0 else None
        return {
            "host": {"cpu": platform.processor() or platform.machine()},
            "model": "default (SmolLM2-135M-Instruct)",
            "prefill_prefix_caching": args.prefill_prefix_caching,
            "max_tokens": args.max_tokens,
            "signal_after_tokens": args.signal_after,
            "contexts": contexts,
            "coordinator_failures_total": cluster["coordinator"].metric(
                "pdserve_request_failure_total"
            ),
            "command": " ".join(["benchmarks/migration.py", *sys.argv[1:]]),
        }
    finally:
        for name in ("coordinator", "d0", "d1", "p"):
            if name in cluster:
                cluster[name].stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096],
                   help="prompt lengths in tokens (default 1024 4096)")  # fmt: skip
    p.add_argument("--trials", type=int, default=3, help="per context and mode (default 3)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--signal-after", type=int, default=12,
                   help="tokens the client has when the worker is ended (default 12)")  # fmt: skip
    p.add_argument("--kv-cache-tokens", type=int, default=20480)
    p.add_argument("--prefill-prefix-caching", action="store_true",
                   help="keep the prefill worker's prefix cache (recompute then finds the "
                   "prompt there)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    return p


def main() -> int:
    print(json.dumps(run(build_parser().parse_args()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
