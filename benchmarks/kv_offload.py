"""The disk KV tier on a multi-turn chat workload whose working set is several times the KV
pool: every session has its own long system prompt and comes back for several turns, round
robin, so by its next turn its blocks have left the pool. Three engines side by side in one
run on the same requests: no tier (the small pool alone), the disk tier (`--kv-offload-dir`,
same small pool), and a pool large enough for everything. For each: prefix hit rate and
TTFT p50/p90 (arrival to first token; one request at a time, as a session's turn follows its
last), and the tier's store and load GB/s beside the disk's own write and read rates measured
in the same folder in the same run, as ratios: `load_over_page_cache_read` (loads during the
workload: read, and copy into the pool where the block was read ahead, against a streaming
read from the page cache, where freshly written blocks are),
`isolated_load_over_page_cache_read` (the read path alone over every block, straight into
pool blocks, engine idle), and `isolated_load_from_device_over_device_read` (the same with
the files dropped from the page cache first, against a streaming read from the device);
with where a load's time goes (`load_path_us_per_block`). Prints one JSON object.

    .venv/bin/python benchmarks/kv_offload.py [--sessions 12] [--turns 3] [--system-tokens 448]
        [--pool-fraction 0.25] [--dir /tmp/pdserve-kv-bench]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from machine import cpu_name

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.kv_offload import DiskTier, checksum
from pdserve.common.sampling_params import SamplingParams


def workload(sessions: int, turns: int, system_tokens: int, vocab: int) -> list[list[int]]:
    """Prompts in arrival order: turn t of every session, then turn t+1 of every session;
    a turn's prompt is the session's system prompt and all its earlier user turns."""
    rng = random.Random(0)
    systems = [[rng.randrange(100, vocab) for _ in range(system_tokens)] for _ in range(sessions)]
    asks = [[[rng.randrange(100, vocab) for _ in range(24)] for _ in range(turns)] for _ in systems]
    return [
        systems[s] + [t for ask in asks[s][: turn + 1] for t in ask]
        for turn in range(turns)
        for s in range(sessions)
    ]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ttfts, outputs = [], []
    for prompt in prompts:
        engine.add_request(prompt, params)
        start = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None:
                    first = time.perf_counter() - start
                if out.finished:
                    outputs.append(out.token_ids)
        ttfts.append(first)
    stats = engine.scheduler.stats
    ttfts.sort()
    return {
        "prefix_hit_rate": round(stats.prefix_cache_hits / stats.prefix_cache_queries, 4),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4),
        "outputs": outputs,
    }


def drop_from_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to forget the files' cached pages (written back first), so the next
    read of them comes from the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def isolated_load(tier: DiskTier, pool: torch.Tensor) -> dict[str, Any]:
    """The tier's own read path over every block it holds, with the engine idle, in GB/s:
    straight into pool blocks (what a waiting engine does) from the page cache and from the
    device (the files dropped from the page cache first); and, in µs a block, where a load's
    time goes: one read into the pool on this thread, its checksum (right after the read),
    the payload alone read into one reused buffer (the floor of one file per block: open,
    seek, read), and the read-ahead path (read into a tensor of its own, then copied into a
    pool block when the request is admitted)."""
    hashes = list(tier._index)
    paths = [tier._path(h) for h in hashes]
    n = max(len(hashes), 1)

    def through_the_tier() -> float:
        """Every block read by the tier's I/O thread straight into a pool block, the next
        ones' files hinted to the kernel, as when an idle engine waits for them."""
        start = time.perf_counter()
        with tier._lock:  # name the pool blocks before the thread starts reading
            assert tier.lookup(hashes)[0] == len(hashes)
            tier.read_into({h: pool[i % len(pool)] for i, h in enumerate(hashes)})
        tier.wait_ready(hashes, 300.0)
        elapsed = time.perf_counter() - start
        tier.release(hashes)
        return elapsed

    drop_from_page_cache(paths)
    cold = through_the_tier()
    warm = through_the_tier()
    start = time.perf_counter()
    for i, h in enumerate(hashes):
        assert tier._read_file(paths[i], h, pool[i % len(pool)]) is not None
    one = time.perf_counter() - start
    buffer = memoryview(torch.empty(tier.block_bytes, dtype=torch.uint8).numpy())
    sums = 0.0
    for path in paths:  # each payload checksummed right after its read, as in the tier
        with open(path, "rb", buffering=0) as f:
            f.seek(-tier.block_bytes, os.SEEK_END)
            f.readinto(buffer)
        start = time.perf_counter()
        checksum(buffer)
        sums += time.perf_counter() - start
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            f.seek(-tier.block_bytes, os.SEEK_END)
            f.readinto(buffer)
    bare = time.perf_counter() - start
    start = time.perf_counter()
    for i, h in enumerate(hashes):
        block = tier._read_file(paths[i], h)
        assert block is not None
        pool[i % len(pool)].copy_(block[1])
    ahead = time.perf_counter() - start
    nbytes = len(hashes) * tier.block_bytes
    return {
        "load_gb_s_isolated": round(nbytes / max(warm, 1e-9) / 1e9, 3),
        "load_gb_s_isolated_from_device": round(nbytes / max(cold, 1e-9) / 1e9, 3),
        "load_path_us_per_block": {
            "block_bytes": tier.block_bytes,
            "read_into_pool": round(one / n * 1e6, 1),
            "checksum_after_read": round(sums / n * 1e6, 1),
            "payload_read_only": round(bare / n * 1e6, 1),
            "read_ahead_then_copy": round(ahead / n * 1e6, 1),
        },
    }


def disk_rates(folder: Path, nbytes: int = 256 * 2**20) -> dict[str, float]:
    """Write (with fsync) and read back one file of `nbytes` in 1 MiB pieces: from the
    device (its pages dropped from the page cache first), then from the page cache."""
    path = folder / "disk-rate.bin"
    chunk = os.urandom(2**20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - start) / 1e9
    reads = []
    drop_from_page_cache([path])
    for _ in range(2):
        start = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(2**20):
                pass
        reads.append(nbytes / (time.perf_counter() - start) / 1e9)
    path.unlink()
    return {
        "write_gb_s": round(write, 3),
        "device_read_gb_s": round(reads[0], 3),
        "page_cache_read_gb_s": round(reads[1], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=448)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument(
        "--pool-fraction",
        type=float,
        default=0.25,
        help="the small pool's size over the working set (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dir", default=None, help="the tier's folder (default: a temporary one)")
    args = p.parse_args()

    folder = Path(args.dir or tempfile.mkdtemp(prefix="pdserve-kv-bench-"))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    base = dict(threads=args.threads, max_num_seqs=1)
    probe = LLMEngine(EngineConfig(**base, kv_cache_tokens=256))
    vocab, block = probe.runner.hf_config.vocab_size, probe.config.block_size
    del probe
    prompts = workload(args.sessions, args.turns, args.system_tokens, vocab)
    working_set = args.sessions * (args.system_tokens + 24 * args.turns + args.max_tokens)
    small = max(block * 2, int(working_set * args.pool_fraction) // block * block)
    configs = {
        "no_tier": dict(kv_cache_tokens=small),
        "disk_tier": dict(kv_cache_tokens=small, kv_offload_dir=str(folder / "tier")),
        "unbounded_pool": dict(kv_cache_tokens=working_set * 2),
    }
    results: dict[str, Any] = {}
    for name, extra in configs.items():
        engine = LLMEngine(EngineConfig(**base, **extra))
        results[name] = run(engine, prompts, args.max_tokens)
        tier = engine.kv_cache.tiers.disk
        if tier is not None:
            tier.flush()
            s = dataclasses.replace(tier.stats)  # the workload's, before the isolated reads
            isolated = isolated_load(tier, engine.runner.kv_cache)
            results[name]["tier"] = {
                "stores": s.stores,
                "loads": s.loads,
                "loads_into_pool": s.loads_into_pool,
                "hit_blocks": s.hits,
                "dropped": s.dropped,
                "store_gb_s": round(s.store_bytes / max(s.store_seconds, 1e-9) / 1e9, 3),
                "load_gb_s": round(s.load_bytes / max(s.load_seconds, 1e-9) / 1e9, 3),
                **isolated,
            }
        engine.close()
    outputs = {name: r.pop("outputs") for name, r in results.items()}
    same = all(o == outputs["unbounded_pool"] for o in outputs.values())
    tiered, none, full = results["disk_tier"], results["no_tier"], results["unbounded_pool"]
    disk = disk_rates(folder)
    print(json.dumps({
        "cpu": cpu_name(),
        "load_average": os.getloadavg(),
        "workload": {"sessions": args.sessions, "turns": args.turns,
                     "system_tokens": args.system_tokens, "requests": len(prompts),
                     "working_set_tokens": working_set, "small_pool_tokens": small},
        "disk": disk,
        "results": results,
        "load_over_page_cache_read": round(
            tiered["tier"]["load_gb_s"] / disk["page_cache_read_gb_s"], 3),
        "isolated_load_over_page_cache_read": round(
            tiered["tier"]["load_gb_s_isolated"] / disk["page_cache_read_gb_s"], 3),
        "isolated_load_from_device_over_device_read": round(
            tiered["tier"]["load_gb_s_isolated_from_device"] / disk["device_read_gb_s"], 3),
        "greedy_ids_equal": same,
        "disk_tier_hit_rate_vs_unbounded": round(
            tiered["prefix_hit_rate"] / max(full["prefix_hit_rate"], 1e-9), 3),
        "ttft_p50_no_tier_over_disk_tier": round(
            none["ttft_p50_s"] / max(tiered["ttft_p50_s"], 1e-9), 2),
    }, indent=1))  # fmt: skip
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
