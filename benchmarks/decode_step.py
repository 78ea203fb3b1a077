"""What a decode step costs, and what its matmuls cost: the engine's step time at several
batch sizes (with and without `kernels/skinny_linear`, side by side in one run), and the 120
linear layers of SmolLM2 (30 layers x qkv, o, gate/up, down) at decode-sized row counts by
`F.linear` and by the skinny kernel, with the weight bandwidth each reaches. Prints one JSON
object.

    .venv/bin/python benchmarks/decode_step.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from machine import cpu_name

from pdserve.kernels import skinny_linear as skinny

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M, fused qkv/gate-up


def time_linears(rows: int, fn: Any, repeat: int = 5) -> float:
    layers = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(30)]
    xs = {k: torch.randn(rows, k) for _, k in SHAPES}

    def step() -> None:
        for layer in layers:
            for w in layer:
                fn(xs[w.shape[1]], w)

    step()
    start = time.perf_counter()
    for _ in range(repeat):
        step()
    return (time.perf_counter() - start) / repeat


def engine_steps(batches: list[int], threads: int) -> dict[str, float]:
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine import LLMEngine
    from pdserve.common.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(kv_cache_tokens=16384, threads=threads))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    out = {}
    for batch in batches:
        for _ in range(batch):
            engine.add_request([rng.randrange(100, 49000) for _ in range(200)], params)
        while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            engine.step()
        times = []
        for _ in range(15):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        out[str(batch)] = round(statistics.median(times) * 1e3, 1)
        while engine.has_unfinished_requests():
            engine.step()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--batches", default="1,4,16")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    weight_bytes = sum(n * k * 4 for n, k in SHAPES) * 30
    linears = []
    for rows in [int(r) for r in args.rows.split(",")]:
        row: dict[str, Any] = {"rows": rows}
        for name, fn in (("f_linear", F.linear), ("skinny", skinny.skinny_linear)):
            s = time_linears(rows, fn)
            row[f"{name}_ms"] = round(s * 1e3, 1)
            row[f"{name}_gb_per_s"] = round(weight_bytes / s / 1e9, 1)
        linears.append(row)
    batches = [int(b) for b in args.batches.split(",")]
    steps = {"skinny": engine_steps(batches, args.threads)}
    os.environ["PDSERVE_SKINNY_LINEAR"] = "0"
    steps["f_linear"] = engine_steps(batches, args.threads)
    print(
        json.dumps(
            {
                "benchmark": "decode_step",
                "processor": cpu_name(),
                "threads": args.threads,
                "dtype": "float32",
                "linears_120": linears,
                "engine_decode_step_ms_by_batch": steps,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
