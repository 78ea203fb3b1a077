"""How much a prompt arriving beside running streams stalls them, with the TPOT-targeted
prefill chunk (`--tpot-target-ms`) and without it (the token budget alone), side by side in
one run on the offline engine (the same scheduler a worker runs).

`--streams` requests decode; every `--every` steps a `--prompt-tokens` prompt arrives. The
figures: the time of each step that carries decodes (what a stream sees as its time per
output token: p50, p99, max), and the prompts' time to first token. Prints one JSON object.

    .venv/bin/python benchmarks/prefill_stall.py [--target-ms 50] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from loadgen import percentiles
from machine import cpu_name

from pdserve.common.config import EngineConfig
from pdserve.common.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams


def run(target_ms: float, args: argparse.Namespace) -> dict[str, Any]:
    engine = LLMEngine(
        EngineConfig(threads=args.threads, tpot_target_ms=target_ms, kv_cache_tokens=65536)
    )
    rng = random.Random(0)
    vocab = engine.runner.hf_config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    for i in range(args.streams):
        engine.add_request(tokens(64), SamplingParams(max_tokens=10_000, ignore_eos=True), f"s{i}")
    arrived: dict[str, float] = {}
    ttft: list[float] = []
    step_s: list[float] = []
    for step in range(args.steps):
        if step % args.every == args.every // 2:
            rid = f"p{step}"
            engine.add_request(tokens(args.prompt_tokens), SamplingParams(max_tokens=1), rid)
            arrived[rid] = time.perf_counter()
        decodes = sum(
            1 for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1
        )
        start = time.perf_counter()
        outputs = engine.step()
        if decodes:
            step_s.append(time.perf_counter() - start)
        for out in outputs:
            if out.request_id in arrived:
                ttft.append(time.perf_counter() - arrived.pop(out.request_id))
    ms = [s * 1000 for s in step_s[args.every :]]  # after the cost model's warm-up
    return {
        "tpot_target_ms": target_ms,
        "decode_step_ms": {**percentiles(ms), "max": round(max(ms), 1)},
        "prompt_ttft_s": {**percentiles(ttft), "count": len(ttft)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-ms", type=float, default=50.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--every", type=int, default=40, help="steps between prompts")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    with_target = run(args.target_ms, args)
    budget_only = run(0.0, args)
    p99 = budget_only["decode_step_ms"]["p99"] / with_target["decode_step_ms"]["p99"]
    print(json.dumps({
        "cpu": cpu_name(), "threads": args.threads, "streams": args.streams,
        "prompt_tokens": args.prompt_tokens, "tpot_target": with_target,
        "token_budget_only": budget_only, "p99_step_ratio": round(p99, 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
