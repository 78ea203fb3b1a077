"""KV block pulls over UCX between two processes, beside two references on the same bytes.

The UCX figure is measured the way the decode worker pulls a request's KV cache: this process
(decode) posts receives into randomly chosen free blocks of its full-size pool, then asks the
sender process (prefill) over a pipe to send randomly chosen blocks of its own full-size pool;
the clock runs from the ask (pipe round trip included) to every block in place. References:

- memcpy: as many random blocks copied one by one, on one thread, between two pools in one
  process (`dst[j].copy_(src[i])`): what moving scattered blocks through main memory costs
  here. Its repetitions alternate with the UCX ones, so both see the same load;
- perftest: `ucx_perftest -t tag_bw` (UCX's own tool, from the libucx wheel) with the same
  UCX settings and one message of the same total size, server and client on loopback. It
  re-sends one buffer that stays in cache, so it flatters itself; it also busy-polls without
  yielding, so on a loaded machine it collapses (the transport yields while it polls).

Prints one JSON object on stdout (progress, UCX's log and a summary on stderr). Medians over
`--reps`. On a shared machine the figures move with the load: `load_average` is reported beside
them. The JSON names what UCX moved the blocks with: `same_host` (the transport's own account,
e.g. `cma` or why not) and `ucx_protocols`, the protocol lines UCX prints for what each process
used (`UCX_PROTO_INFO=used`), with how many messages took each."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pdserve.common.kv_transfer.ucx import ucx_env_defaults

for _name, _value in ucx_env_defaults().items():  # ucx_perftest gets the same settings
    os.environ.setdefault(_name, _value)
os.environ.setdefault("UCX_PROTO_INFO", "used")  # each process prints what it used, at exit

GB = 1e9


def say(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def make_pool(args: argparse.Namespace, seed: int) -> torch.Tensor:
    """A cache pool as the workers allocate it (huge-page mapping, committed), random bytes."""
    from pdserve.common.model_runner import allocate_kv_cache

    shape = (args.pool_blocks, args.layers, 2, args.block_size, args.kv_heads, args.head_dim)
    pool = allocate_kv_cache(shape, torch.bfloat16, torch.device("cpu"))
    pool.view(torch.uint8).random_(generator=torch.Generator().manual_seed(seed))
    return pool


def digest(pool: torch.Tensor, ids: list[int]) -> str:
    return hashlib.blake2b(pool[ids].view(torch.uint8).numpy().tobytes()).hexdigest()


def sender_main(conn: Connection, args: argparse.Namespace) -> None:
    """The prefill side: sends the blocks it is asked for, from its own pool."""
    from pdserve.common.kv_transfer.ucx import UcxTransport

    transport = UcxTransport()
    try:
        pool = make_pool(args, seed=2)
        transport.register_pool(pool)
        conn.send((transport.address, os.getpid()))
        while (msg := conn.recv()) is not None:
            if msg == "ping":
                conn.send("pong")
                continue
            peer, tag, ids, check = msg
            result = transport.send(peer, tag, ids, args.timeout).result()
            conn.send((result.seconds, digest(pool, ids) if check else None))
    finally:
        transport.close()
        os._exit(0)  # a process that used UCX may not exit on its own


def memcpy_once(src: torch.Tensor, dst: torch.Tensor, n: int, rng: random.Random) -> float:
    """Seconds to copy n random blocks of src into n random blocks of dst, block by block."""
    src_ids = rng.sample(range(src.shape[0]), n)
    dst_ids = rng.sample(range(dst.shape[0]), n)
    t0 = time.perf_counter()
    for i, j in zip(src_ids, dst_ids, strict=True):
        dst[j].copy_(src[i])
    return time.perf_counter() - t0


class UcxPull:
    """This process as decode (a transport over `pool`), a spawned process as prefill."""

    def __init__(self, args: argparse.Namespace, pool: torch.Tensor) -> None:
        from pdserve.common.kv_transfer.ucx import UcxTransport

        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.sender = ctx.Process(target=sender_main, args=(child_conn, args), daemon=True)
        self.sender.start()
        self.transport = UcxTransport()
        self.transport.register_pool(pool)
        self.pool, self.timeout = pool, args.timeout
        if not self.conn.poll(120):
            raise RuntimeError("the sender process did not start")
        _, self.sender_pid = self.conn.recv()  # its address is unused: it is the one sending
        rtts = []
        for _ in range(20):
            t0 = time.perf_counter()
            self.conn.send("ping")
            self.conn.recv()
            rtts.append(time.perf_counter() - t0)
        self.round_trip = statistics.median(rtts)

    def pull(self, n: int, rng: random.Random, check: bool) -> dict:
        """Post receives into n random blocks, ask for n random blocks, wait for all."""
        dst_ids = rng.sample(range(self.pool.shape[0]), n)
        src_ids = rng.sample(range(self.pool.shape[0]), n)
        tag = self.transport.new_tag()
        t0 = time.perf_counter()
        future = self.transport.post_receive(tag, dst_ids, self.timeout)
        t1 = time.perf_counter()
        self.conn.send((self.transport.address, tag, src_ids, check))
        future.result()
        t2 = time.perf_counter()
        sender_seconds, sent_digest = self.conn.recv()
        return {
            "from_ask": t2 - t1,
            "from_post": t2 - t0,
            "sender": sender_seconds,
            "checksum_ok": sent_digest == digest(self.pool, dst_ids) if check else None,
        }

    def close(self) -> None:
        try:
            self.transport.close()
            self.conn.send(None)
            self.sender.join(30)
        finally:
            if self.sender.is_alive():
                self.sender.kill()


# UCX's log lines ("[time] [host:pid:thread] text") and, in them, the protocol tables that
# UCX_PROTO_INFO=used prints: a title row per operation, then one row per message size range
# ("| 128  1728..inf | zero-copy read from remote | cma/memory |": messages, sizes, protocol,
# transport; "(?)" marks a protocol whose cost depends on the peer).
_LOG_LINE = re.compile(r"^\[[\d.]+\] \[[^:\]]*:(\d+)\s*:\d+\]\s*(.*?)\s*$")
_TITLE = re.compile(r"^\|\s*\S+ (intra|inter)-node cfg#\d+\s*\|\s*(.*?)\s*\|$")
_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|\s*(?:\(\?\)\s*)?(.*?)\s*\|\s*(.*?)\s*\|$")


def used_protocols(log: str) -> dict[int, list[dict]]:
    """The protocol rows that carried messages, by process id, from UCX's log."""
    tables: dict[int, list[dict]] = {}
    titles: dict[int, tuple[str, str]] = {}
    for line in log.splitlines():
        if (logged := _LOG_LINE.match(line)) is None:
            continue
        pid, text = int(logged[1]), logged[2]
        if title := _TITLE.match(text):
            titles[pid] = (title[1], title[2])
        elif (row := _ROW.match(text)) and pid in titles and int(row[1]) > 0:
            node, operation = titles[pid]
            tables.setdefault(pid, []).append({
                "operation": operation,
                "node": node,
                "sizes": row[2],
                "protocol": row[3],
                "transport": row[4],
                "messages": int(row[1]),
            })  # fmt: skip
    return tables


def cpu() -> dict:
    """The host's processor and its ISA class, as /proc/cpuinfo names them."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in info.splitlines())
    )
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return {"model": fields.get("model name", "unknown"), "isa": isa}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_perftest(nbytes: int, iters: int) -> dict:
    """`ucx_perftest -t tag_bw` on loopback, one message of nbytes; GB/s or the reason why not."""
    libucx = Path(sysconfig.get_paths()["purelib"]) / "libucx"
    exe = libucx / "bin" / "ucx_perftest"
    if not exe.exists():
        found = shutil.which("ucx_perftest")
        if found is None:
            return {"error": f"ucx_perftest not found (looked in {exe.parent} and PATH)"}
        exe = Path(found)
    # UCX_PROTO_INFO off: its tables would follow the result row that is read below.
    env = dict(os.environ, LD_LIBRARY_PATH=str(libucx / "lib"), UCX_PROTO_INFO="n")
    port = free_port()
    common = ["-p", str(port)]
    client_args = ["-t", "tag_bw", "-s", str(nbytes), "-n", str(iters), "-w", "2", "-f"]
    server = subprocess.Popen(
        [str(exe), *common], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        for _ in range(50):  # the server needs a moment to listen
            time.sleep(0.1)
            run = subprocess.run(
                [str(exe), "127.0.0.1", *common, *client_args],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if "Connection refused" not in run.stderr + run.stdout:
                break
        if run.returncode != 0:
            tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
            return {"error": f"ucx_perftest exited {run.returncode}: {' | '.join(tail)}"}
        # -f prints the final row: iterations, 3 overheads (us), 2 bandwidths (MB/s = 2^20 B/s)
        row = [line.split() for line in run.stdout.splitlines() if line.strip()][-1]
        return {"gb_per_s": float(row[5]) * 2**20 / GB}
    except (subprocess.TimeoutExpired, OSError, IndexError, ValueError) as e:
        return {"error": f"ucx_perftest failed: {e!r}"}
    finally:
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Defaults: SmolLM2-135M blocks (30 layers x K/V x 16 tokens x 3 KV heads x 64 "
        "x bf16 = 368,640 bytes), pools of 2048 blocks per process. Takes about a minute.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--tokens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[128, 512, 1024, 2048, 4096],
        help="prompt lengths to transfer the KV cache of, comma-separated",
    )
    p.add_argument("--reps", type=int, default=9, help="timed repetitions per size (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per size first")
    p.add_argument("--pool-blocks", type=int, default=2048, help="blocks in each pool")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--timeout", type=float, default=60.0, help="per-transfer timeout, seconds")
    p.add_argument("--perftest-iters", type=int, default=20, help="ucx_perftest -n")
    p.add_argument("--no-perftest", action="store_true", help="skip the ucx_perftest reference")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    # UCX logs to stdout (here and in the sender, which inherits it): keep stdout for the JSON
    # and collect UCX's lines in a file, read (and echoed to stderr) once both processes end.
    json_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    ucx_log = os.memfd_create("ucx-log")
    os.dup2(ucx_log, sys.stdout.fileno())
    block_bytes = args.layers * 2 * args.block_size * args.kv_heads * args.head_dim * 2
    counts = [math.ceil(t / args.block_size) for t in args.tokens]
    if max(counts) > args.pool_blocks:
        sys.exit(f"--pool-blocks {args.pool_blocks} is too small for {max(args.tokens)} tokens")
    load_start = os.getloadavg()

    say("allocating pools ...")
    src, dst = make_pool(args, seed=1), make_pool(args, seed=3)
    ucx = UcxPull(args, dst)  # the memcpy reference writes into the receiver's pool too
    # The memcpy reference runs on one thread (as each side of UCX does): torch's 2-thread
    # copy of a 368 KB block collapses whenever another process holds a core.
    torch.set_num_threads(1)
    rng = random.Random(7)
    sizes = []
    try:
        for tokens, n in zip(args.tokens, counts, strict=True):
            # Alternate the two so both see the same load on a shared machine.
            memcpy, pulls = [], []
            for rep in range(args.warmup + args.reps):
                time.sleep(0.01)  # both transports stop polling 2 ms after their last pull
                copy_seconds = memcpy_once(src, dst, n, rng)
                pull = ucx.pull(n, rng, check=rep == args.warmup)
                if rep >= args.warmup:
                    memcpy.append(copy_seconds)
                    pulls.append(pull)
            nbytes = n * block_bytes
            seconds = statistics.median(p["from_ask"] for p in pulls)
            row: dict = {
                "tokens": tokens,
                "blocks": n,
                "bytes": nbytes,
                "ucx_gb_per_s": round(nbytes / seconds / GB, 3),
                "ucx_ms": round(seconds * 1e3, 3),
                "ucx_from_post_gb_per_s": round(
                    nbytes / statistics.median(p["from_post"] for p in pulls) / GB, 3
                ),
                "ucx_sender_ms": round(statistics.median(p["sender"] for p in pulls) * 1e3, 3),
                "checksum_ok": next(
                    p["checksum_ok"] for p in pulls if p["checksum_ok"] is not None
                ),
                "memcpy_gb_per_s": round(nbytes / statistics.median(memcpy) / GB, 3),
            }
            row["ucx_over_memcpy"] = round(row["ucx_gb_per_s"] / row["memcpy_gb_per_s"], 3)
            if not args.no_perftest:
                perftest = bench_perftest(nbytes, args.perftest_iters)
                if "gb_per_s" in perftest:
                    row["perftest_gb_per_s"] = round(perftest["gb_per_s"], 3)
                    row["ucx_over_perftest"] = round(
                        row["ucx_gb_per_s"] / row["perftest_gb_per_s"], 3
                    )
                else:
                    row["perftest_error"] = perftest["error"]
            say(f"{tokens} tokens: ucx {row['ucx_gb_per_s']} GB/s, memcpy {row['memcpy_gb_per_s']}")
            sizes.append(row)
    finally:
        ucx.close()
    with os.fdopen(ucx_log, "rb") as f:  # both workers are gone: their tables are in
        f.seek(0)
        log = f.read().decode(errors="replace")
    sys.stderr.write(log)
    protocols = used_protocols(log)

    big = [r["ucx_over_memcpy"] for r in sizes if r["tokens"] >= 1000]
    result = {
        "benchmark": "kv_transfer",
        "block_bytes": block_bytes,
        "pool_blocks": args.pool_blocks,
        "reps": args.reps,
        "ucx_env": {name: os.environ[name] for name in ucx_env_defaults()},
        "memcpy_threads": 1,
        "cpus": os.cpu_count(),
        "cpu": cpu(),
        "load_average": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "control_round_trip_ms": round(ucx.round_trip * 1e3, 3),
        "same_host": ucx.transport.same_host,
        "ucx_protocols": {
            "decode": protocols.get(os.getpid(), []),
            "prefill": protocols.get(ucx.sender_pid, []),
        },
        "sizes": sizes,
        "target": {
            "ucx_over_memcpy_at_1000_plus_tokens": 0.8,
            "met": bool(big) and min(big) >= 0.8,
        },
        "notes": "GB = 1e9 bytes. ucx_gb_per_s: from asking the sender (pipe round trip "
        "included) to every block in place; ucx_from_post_gb_per_s also counts posting the "
        "receives. Medians over reps; random block ids over the whole pools.",
    }
    say("\nprompt tokens   pull GB/s   memcpy GB/s   pull/memcpy")
    for r in sizes:
        say(f"{r['tokens']:>13} {r['ucx_gb_per_s']:>11.2f} {r['memcpy_gb_per_s']:>13.2f} "
            f"{r['ucx_over_memcpy']:>12.2f}x")  # fmt: skip
    say(f"between processes on this host: {ucx.transport.same_host}")
    for row in result["ucx_protocols"]["decode"] + result["ucx_protocols"]["prefill"]:
        say(f"UCX used: {row['operation']}, {row['sizes']} bytes: {row['protocol']} over "
            f"{row['transport']} ({row['messages']} messages)")  # fmt: skip
    print(json.dumps(result, indent=2), file=json_out, flush=True)
    os._exit(0)  # a process that used UCX may not exit on its own


if __name__ == "__main__":
    main()
