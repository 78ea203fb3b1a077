"""Tensor parallelism on this machine: the default model (SmolLM2-135M, bfloat16) run by the
engine at TP 1 (one process, 2 threads) and TP 2 (two rank processes, 1 thread each, so
both use the same 2 cores), side by side in one run. Prints JSON.

Per run:
- per rank `rss_after_load_mib` (after load, freed heap returned to the OS) and its
  anonymous part `rss_anon_after_load_mib` (the rest is clean pages of the memory-mapped
  checkpoint the kernel can drop), and `weights_mib`: the tensors the rank's model holds;
- **offline**: `--prompts` random-token prompts of `--prompt-len`, `--new-tokens` each,
  greedy, EOS ignored: output tokens per second of wall time;
- **decode step** at batch 1 and 16: ms per step once every request decodes (the time
  from the last prefill to the end over the steps in it);
- the runs are interleaved, TP 1 then TP 2, `--repeat` rounds (each its own processes), and
  the median is shown with every run's figures (`every_run`): a noisy neighbour on a shared
  host then slows both alike;
- `collective_bytes_per_token`: bytes rank 0 put into the group's collectives per token
  run through the model (prompt and output), beside the formula for the row-parallel
  reductions alone: 2 · layers · hidden · 4 B · (N-1) (one float32 all-gather after o_proj
  and one after down_proj);
- `kv_pull_bytes_per_rank_1024`: the KV bytes each decode rank pulls for a 1024-token
  prompt in each pairing of prefill / decode TP, from the head-slice plan that the
  transfers execute (tests/unit/test_head_slices.py checks the bytes moved equal it): no
  rank pulls a head it does not keep.

Run: ``.venv/bin/python benchmarks/tensor_parallel.py > tp.json`` (about 5 minutes on 2
cores; ``--quick`` for a smaller workload). Each run is its own process group."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _weights_mib(model: Any) -> float:
    seen: set[int] = set()
    total = 0
    for value in _tensors(model.__dict__):
        if value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            total += value.numel() * value.element_size()
    return round(total / 2**20, 1)


def _tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 8:
        return []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v, depth + 1)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v, depth + 1)]
    if hasattr(obj, "__dict__"):
        return _tensors(vars(obj), depth + 1)
    return []


def rank_main(spec: dict[str, Any]) -> None:
    """One rank: load; rank 0 runs the workloads, the others follow its steps."""
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine import LLMEngine
    from pdserve.common.models.expert_parallel import init_group
    from pdserve.common.models.tensor_parallel import COLLECTIVE_BYTES
    from pdserve.common.sampling_params import SamplingParams

    rank, world = spec["rank"], spec["world"]
    if world > 1:
        init_group(rank, world, spec["address"], "cpu", 600)
    engine = LLMEngine(EngineConfig(
        threads=spec["threads"], kv_cache_tokens=spec["kv_tokens"], tensor_parallel=world,
        enable_prefix_caching=False,
    ))  # fmt: skip
    runner = engine.runner
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    report: dict[str, Any] = {
        "rank": rank,
        "rss_after_load_mib": _rss_mib("VmRSS"),
        "rss_anon_after_load_mib": _rss_mib("RssAnon"),
        "weights_mib": _weights_mib(runner.model),
        "kv_cache_mib": round(runner.kv_cache.numel() * runner.kv_cache.element_size() / 2**20),
    }
    if rank != 0:
        runner.follow()
        print(json.dumps(report), flush=True)
        return

    gen = torch.Generator().manual_seed(7)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [torch.randint(3, 49152, (length,), generator=gen).tolist() for _ in range(n)]

    def run(batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """(wall seconds, ms per step once all decode)."""
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        for p in batch:
            engine.add_request(p, params)
        start = time.perf_counter()
        decode_start, decode_steps = None, 0
        while engine.has_unfinished_requests():
            engine.step()
            if (
                decode_start is None
                and not engine.scheduler.waiting
                and all(
                    r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running
                )
            ):
                decode_start = time.perf_counter()
            elif decode_start is not None:
                decode_steps += 1
        end = time.perf_counter()
        per_step = (end - decode_start) / decode_steps * 1000 if decode_steps else float("nan")
        return end - start, per_step

    run(prompts(2, 32), 4)  # warm-up
    walls = []
    sent_before = COLLECTIVE_BYTES.sent
    for _ in range(spec["repeat"]):
        walls.append(run(prompts(spec["prompts"], spec["prompt_len"]), spec["new_tokens"])[0])
    tokens = spec["repeat"] * spec["prompts"] * (spec["prompt_len"] + spec["new_tokens"])
    report["collective_bytes_per_token"] = round((COLLECTIVE_BYTES.sent - sent_before) / tokens)
    wall = statistics.median(walls)
    report["offline_output_tokens_per_s"] = round(spec["prompts"] * spec["new_tokens"] / wall, 1)
    report["offline_runs_s"] = [round(w, 2) for w in walls]
    for batch in (1, 16):
        steps = [run(prompts(batch, 128), 48)[1] for _ in range(spec["repeat"])]
        report[f"decode_step_ms_batch_{batch}"] = round(statistics.median(steps), 2)
    runner.stop_followers()
    print(json.dumps(report), flush=True)


def one_run(world: int, work: dict[str, int]) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    threads = max(1, 2 // world)
    spec = work | dict(world=world, address=address, threads=threads,
                       kv_tokens=work["prompts"] * (work["prompt_len"] + work["new_tokens"])
                       + 4096)  # fmt: skip
    print(f"TP {world}: {threads} thread(s) per rank", file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE), "--rank", json.dumps(spec | {"rank": r})],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    ranks = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"TP {world}: a rank exited with {p.returncode}")
        ranks.append(json.loads(out.strip().splitlines()[-1]))
    return {"tensor_parallel": world, "threads_per_rank": threads, "ranks": ranks}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose rank-0 offline rate is the median, with every run's figures beside."""
    ordered = sorted(runs, key=lambda r: r["ranks"][0]["offline_output_tokens_per_s"])
    median = dict(ordered[len(ordered) // 2])
    keys = ("offline_output_tokens_per_s", "decode_step_ms_batch_1", "decode_step_ms_batch_16")
    median["every_run"] = [{k: r["ranks"][0][k] for k in keys} for r in runs]
    for key in keys[1:]:
        median["ranks"][0][key] = statistics.median(r["ranks"][0][key] for r in runs)
    return median


def kv_pull_bytes(prompt_tokens: int = 1024) -> dict[str, list[int]]:
    from transformers import AutoConfig

    from pdserve.common.kv_transfer.head_slices import plan
    from pdserve.common.model_files import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(None))
    head_dim = config.hidden_size // config.num_attention_heads
    blocks = -(-prompt_tokens // 16)
    per_head = blocks * config.num_hidden_layers * 2 * 16 * head_dim * 2  # bfloat16
    out = {}
    for p, d in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (1, 3), (2, 3), (3, 3)]:
        pulled = [0] * d
        for s in plan(config.num_key_value_heads, p, d):
            pulled[s.dst_rank] += len(s.heads) * per_head
        out[f"P{p}->D{d}"] = pulled
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8 prompts, 1 repeat")
    args = ap.parse_args()
    if args.rank:
        rank_main(json.loads(args.rank))
        return 0
    if args.quick:
        args.prompts, args.repeat = 8, 1
    work = dict(prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                repeat=args.repeat)  # fmt: skip
    from transformers import AutoConfig

    from pdserve.common.model_files import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(None))
    # Interleaved (TP 1, TP 2, TP 1, ...): a noisy neighbour slows both alike.
    rounds = [[one_run(world, work | {"repeat": 1}) for world in (1, 2)]
              for _ in range(args.repeat)]  # fmt: skip
    runs = [_median_run([r[i] for r in rounds]) for i in range(2)]
    result = {
        "workload": work,
        "runs": runs,
        "row_parallel_bytes_per_token_formula_tp2": 2 * config.num_hidden_layers
        * config.hidden_size * 4 * 1,
        "tp2_over_tp1_offline": round(
            runs[1]["ranks"][0]["offline_output_tokens_per_s"]
            / runs[0]["ranks"][0]["offline_output_tokens_per_s"], 3
        ),
        "kv_pull_bytes_per_rank_1024": kv_pull_bytes(),
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
