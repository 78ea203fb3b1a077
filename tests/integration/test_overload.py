"""Overload on real processes: a prefill, a decode and a coordinator (HTTP on) offered ten
times the load they sustain, open-loop, for `PDSERVE_OVERLOAD_SECONDS` (default 60). What
must hold: every answer is a 200 that completes or a 429 with `Retry-After` (nothing else,
no dropped connection), no process grows its resident memory by more than `RSS_GROWTH_MIB`,
and afterwards every KV block is free and a good request is served."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter

import httpx2 as httpx  # openai's HTTP client (the httpx2 distribution)
import pytest

from services import running, wait_idle

pytestmark = pytest.mark.slow

SECONDS = float(os.environ.get("PDSERVE_OVERLOAD_SECONDS", "60"))
RSS_GROWTH_MIB = 256  # the stated bound, per process, over the whole run
WORKER_ARGS = ["--kv-cache-tokens", "8192", "--threads", "1", "--max-pending", "4"]
BODY = {"prompt": "Write one sentence about the sea.", "max_tokens": 12, "stream": True}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def one(client: httpx.AsyncClient, url: str) -> tuple[int, str | None, bool | str]:
    """(status, Retry-After, whether a 200 stream ended with a finish reason and [DONE]: True,
    or the stream's last event where it did not)."""
    async with client.stream("POST", url, json=BODY) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, response.headers.get("retry-after"), False
        finished = done = False
        last = ""
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                last = str(event["error"].get("message")) if "error" in event else line[6:]
                finished |= any(c.get("finish_reason") for c in event.get("choices", []))
        return 200, None, (finished and done) or last


async def closed_loop_rate(url: str, seconds: float = 8.0, concurrency: int = 4) -> float:
    """Requests per second the system completes with `concurrency` clients: sustainable."""
    done = 0
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=120) as client:

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < end:
                status, _, ok = await one(client, url)
                assert status == 200 and ok is True, ok
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / seconds


async def open_loop(url: str, rate: float, seconds: float, sample) -> list:
    """Poisson arrivals at `rate` for `seconds`; `sample()` runs every second."""
    rng = random.Random(0)
    results: list = []
    tasks: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def record() -> None:
            try:
                results.append(await one(client, url))
            except httpx.HTTPError as e:  # a dropped connection: never allowed
                results.append((0, None, f"{type(e).__name__}: {e}"))

        start = next_sample = time.monotonic()
        t = start
        while t - start < seconds:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.ensure_future(record()))
            if time.monotonic() >= next_sample:
                sample()
                next_sample += 1.0
        await asyncio.gather(*tasks)
    return results


def test_ten_times_the_sustainable_load(tmp_path):
    with (
        running("prefill", *WORKER_ARGS) as prefill,
        running("decode", *WORKER_ARGS) as decode,
        running(
            "coordinator",
            f"--prefill-workers={prefill.grpc}",
            f"--decode-workers={decode.grpc}",
            "--http-port=0",
            "--max-inflight-requests=64",
            "--no-log-requests",
        ) as coordinator,
    ):
        url = f"http://{coordinator.info['http']}/v1/completions"
        workers = {"prefill": prefill, "decode": decode}
        free = {role: w.free_blocks() for role, w in workers.items()}
        sustainable = asyncio.run(closed_loop_rate(url))
        assert sustainable > 0
        procs = {"prefill": prefill, "decode": decode, "coordinator": coordinator}
        start_rss = {name: rss_mib(p.proc.pid) for name, p in procs.items()}
        peak = dict(start_rss)

        def sample() -> None:
            for name, p in procs.items():
                peak[name] = max(peak[name], rss_mib(p.proc.pid))

        results = asyncio.run(open_loop(url, 10 * sustainable, SECONDS, sample))
        sample()
        statuses = Counter(status for status, _, _ in results)
        summary = {"sustainable_rps": round(sustainable, 2), "offered": len(results),
                   "statuses": dict(statuses),
                   "dropped": dict(Counter(ok for status, _, ok in results if status == 0)),
                   "rss_growth_mib": {n: round(peak[n] - start_rss[n]) for n in procs}}  # fmt: skip
        print(json.dumps(summary))
        assert set(statuses) <= {200, 429}, summary
        assert statuses[200] > 0 and statuses[429] > 0, summary  # it was overloaded
        incomplete = Counter(ok for status, _, ok in results if status == 200 and ok is not True)
        assert not incomplete, f"200s that did not complete, by last event: {dict(incomplete)}"
        assert all(int(retry) >= 1 for status, retry, _ in results if status == 429)
        for name in procs:
            assert peak[name] - start_rss[name] <= RSS_GROWTH_MIB, summary
        assert wait_idle(workers, free) == free
        for service in procs.values():
            assert service.proc.poll() is None
        with httpx.Client(timeout=60) as client:
            reply = client.post(url, json={**BODY, "stream": False})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
