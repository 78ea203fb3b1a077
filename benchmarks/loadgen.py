"""The load generator behind `serve.py`: open-loop arrival schedules, fresh random prompts,
one streamed request timed token by token (over any OpenAI-compatible HTTP server's
`/v1/completions`), percentiles and goodput, and CPU accounting of the system under test (so
figures on a shared machine can be read with the load beside them).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

VOCAB_SIZE = 49152
FIRST_ID = 100  # ids below this are special tokens in SmolLM2's vocabulary; keep away
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Spec:
    index: int
    arrival_s: float  # offset from the start of the rate's arrival window
    prompt_len: int
    output_len: int


def make_schedule(
    rate: float,
    seed: int,
    duration_s: float | None,
    num_requests: int | None,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
) -> tuple[list[Spec], float]:
    """Poisson arrivals at `rate` and each request's lengths; the same for every system.
    Returns the specs and the arrival window in seconds.

    Every rate uses the same seeded sequence of unit-rate exponential gaps and lengths, the
    gaps scaled by 1/rate (common random numbers): a rate's requests are the first N of one
    sequence, so the count grows with the rate and the curves are not shaken by independent
    Poisson draws per rate (with ~10 requests per rate those move the count by +-30%)."""
    rng = random.Random(f"schedule:{seed}")
    specs: list[Spec] = []
    t = rng.expovariate(1.0) / rate
    while (num_requests is not None and len(specs) < num_requests) or (
        num_requests is None and duration_s is not None and t < duration_s
    ):
        specs.append(Spec(len(specs), t, rng.randint(*prompt_len), rng.randint(*output_len)))
        t += rng.expovariate(1.0) / rate
    # Window: the fixed duration, or (count mode) up to where the next arrival would be.
    window = duration_s if num_requests is None and duration_s is not None else t
    return specs, window


def fresh_prompt(seed: int, system: str, tag: str, index: int, length: int) -> list[int]:
    """Random token ids no other request shares (seeded by system, rate and index), so the
    prefix cache never serves any of it."""
    rng = random.Random(f"prompt:{seed}:{system}:{tag}:{index}")
    return [rng.randrange(FIRST_ID, VOCAB_SIZE) for _ in range(length)]


def completion_body(model: str, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed, greedy `/v1/completions` request that generates exactly `max_tokens`."""
    return {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class Record:
    spec: Spec
    scheduled: float = 0.0  # loop time the request was due
    sent: float = 0.0
    first: float | None = None
    second: float | None = None  # the second event carrying a choice
    last: float | None = None
    done: float | None = None
    tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    error: str | None = None
    error_detail: str = ""

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.done is not None
            and self.first is not None
            and self.tokens == self.spec.output_len
        )

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.sent

    @property
    def tpot(self) -> float:
        assert self.first is not None and self.last is not None
        return (self.last - self.first) / max(1, self.tokens - 1)

    @property
    def first_gap(self) -> float:
        """First token to the second: where a disaggregated request waits for a decode
        worker's admission and pulls its KV (its prefill worker sent the first token)."""
        assert self.first is not None and self.second is not None
        return self.second - self.first

    @property
    def steady_tpot(self) -> float:
        """TPOT without the first gap: the mean gap from the second token on."""
        assert self.second is not None and self.last is not None
        return (self.last - self.second) / max(1, self.tokens - 2)

    @property
    def e2e(self) -> float:
        assert self.done is not None
        return self.done - self.sent


async def run_request(
    session: aiohttp.ClientSession,
    base_url: str,
    body: dict[str, Any],
    record: Record,
    deadline: float,
) -> None:
    """POST one streamed completion and time it: `first` is the first event carrying a
    choice, `last` the last one; the token count is the server's own (`usage`)."""
    loop = asyncio.get_running_loop()
    record.sent = loop.time()
    timeout = aiohttp.ClientTimeout(total=max(0.1, deadline - record.sent))
    chunks = 0
    try:
        async with session.post(f"{base_url}/completions", json=body, timeout=timeout) as r:
            if r.status != 200:
                record.error = f"http_{r.status}"
                record.error_detail = (await r.text())[:300]
                return
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = "stream_error"
                    record.error_detail = str(event["error"])[:300]
                    return
                now = loop.time()
                for choice in event.get("choices") or ():
                    chunks += 1
                    if record.first is None:
                        record.first = now
                    elif record.second is None:
                        record.second = now
                    record.last = now
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                usage = event.get("usage")
                if usage:
                    record.tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens") or 0
        record.done = loop.time()
        if not record.tokens:  # a server that sends no usage: one token per event
            record.tokens = chunks
        if record.finish_reason != "length" or record.tokens != record.spec.output_len:
            record.error = f"short_output:{record.finish_reason or 'none'}"
    except TimeoutError:
        record.error = "deadline_exceeded"
    except aiohttp.ClientError as e:
        record.error = "connection"
        record.error_detail = str(e)[:300]


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "p50": round(float(p50), 4),
        "p90": round(float(p90), 4),
        "p99": round(float(p99), 4),
        "mean": round(float(a.mean()), 4),
    }


def tpot_breakdown(done: list[Record], slo_tpot: float) -> dict[str, Any]:
    """Where TPOT goes: the first gap (first token -> second) and the steady TPOT after it,
    over the completed requests with at least three events; and of the requests missing the
    TPOT SLO, how many would have met it had their first gap been a steady one (the wait
    before the second token is what missed, not the decode steps)."""
    split = [r for r in done if r.second is not None and r.tokens >= 3]
    misses = [r for r in split if r.tpot > slo_tpot]
    first_gap_only = [r for r in misses if r.steady_tpot <= slo_tpot]
    return {
        "first_gap_s": percentiles([r.first_gap for r in split]),
        "steady_tpot_s": percentiles([r.steady_tpot for r in split]),
        "tpot_misses": {"count": len(misses), "steady_tpot_within_slo": len(first_gap_only)},
    }


def summarize(
    rate: float, records: list[Record], window_s: float, slo_ttft: float, slo_tpot: float
) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in records:
        if not r.ok:
            key = r.error or "incomplete"
            errors[key] = errors.get(key, 0) + 1
            examples.setdefault(key, r.error_detail)
    ttft_ok = [r for r in done if r.ttft <= slo_ttft]
    tpot_ok = [r for r in done if r.tpot <= slo_tpot]
    good = [r for r in done if r.ttft <= slo_ttft and r.tpot <= slo_tpot]
    start = min((r.sent for r in records if r.sent), default=0.0)
    end = max((r.done for r in done if r.done is not None), default=start)
    span = max(end - start, 1e-9)
    sent = len(records)
    out_tokens = sum(r.tokens for r in done)
    return {
        "rate_rps": rate,
        "sent": sent,
        "completed": len(done),
        "failed": sent - len(done),
        "errors": errors,
        "error_examples": examples,
        "arrival_window_s": round(window_s, 2),
        "achieved_arrival_rps": round(sent / window_s, 4) if window_s > 0 else None,
        "span_s": round(span, 2),
        "ttft_s": percentiles([r.ttft for r in done]),
        "tpot_s": percentiles([r.tpot for r in done]),
        "e2e_s": percentiles([r.e2e for r in done]),
        "throughput": {
            "output_tokens_per_s": round(out_tokens / span, 2) if done else 0.0,
            "requests_per_s": round(len(done) / span, 4) if done else 0.0,
        },
        "goodput_rps": round(len(good) / window_s, 4) if window_s > 0 else 0.0,
        "slo_attainment": round(len(good) / sent, 4) if sent else None,
        "ttft_ok": round(len(ttft_ok) / sent, 4) if sent else None,
        "tpot_ok": round(len(tpot_ok) / sent, 4) if sent else None,
        **tpot_breakdown(done, slo_tpot),
        "prompt_tokens": sum(r.spec.prompt_len for r in records),
        "output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens for r in records),
        "max_send_lag_s": round(max((r.sent - r.scheduled for r in records), default=0.0), 4),
    }


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by `root` and every process under it."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(entry.name)
        parent[pid] = int(rest[1])
        ticks[pid] = int(rest[11]) + int(rest[12])
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += ticks.get(pid, 0)
        todo.extend(child for child, ppid in parent.items() if ppid == pid)
    return total / CLK_TCK


@dataclass
class CpuSample:
    wall: float
    machine_busy: int
    machine_total: int
    server_s: float
    client_s: float

    @classmethod
    def take(cls, server_pid: int | None) -> CpuSample:
        """`server_pid`: the root of the system under test (None: not ours to watch)."""
        busy, total = machine_jiffies()
        server = tree_cpu_s(server_pid) if server_pid is not None else 0.0
        return cls(time.monotonic(), busy, total, server, time.process_time())

    def since(self, before: CpuSample) -> dict[str, float]:
        """Cores in use on average between two samples: the whole machine, the system under
        test (all its processes), this client, and everything else."""
        wall = max(self.wall - before.wall, 1e-9)
        ncpu = os.cpu_count() or 1
        frac = (self.machine_busy - before.machine_busy) / max(
            1, self.machine_total - before.machine_total
        )
        machine = frac * ncpu
        server = (self.server_s - before.server_s) / wall
        client = (self.client_s - before.client_s) / wall
        return {
            "machine_busy_cores": round(machine, 2),
            "server_cores": round(server, 2),
            "client_cores": round(client, 2),
            "other_cores": round(max(0.0, machine - server - client), 2),
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
