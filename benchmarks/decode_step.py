"""What a decode step costs on the batch-invariant path (the default) and on the GEMM
library's fastest path (`PDSERVE_BATCH_INVARIANT=0`: oneDNN's packed bf16, MKL/skinny fp32),
side by side in one run: the engine's step time at several batch sizes, and SmolLM2's 120
dense layers (30 layers x qkv, o, gate/up, down) at those row counts with the weight
bandwidth each reaches, beside the machine's memory-read rate measured in the same run (a
float32 `sum` over 1 GiB, best of 5) and the weight-read floor it gives a step. Prints one
JSON object.

`floors` puts each engine step beside what the hardware allows for it, measured in the same
run: the memory floor (the whole model's weights read once per step, lm_head included, plus
the batch's KV cache, at the memory-read rate) and the compute floor (the step's FLOPs at the
best bf16/fp32 matmul rate measured: a 2048³ `mm`, and the 120 linears at 512 rows on the
fast path). The step's FLOPs are its dense layers' (2 per weight per row) and its
attention's (QK and PV: 4 per query element per context token per layer, the attention term
of the usual 2N + 2·layers·context·d_attn per token); `step_over_floor` is the step's time
over the larger of the two floors (issue target: within 1.5x at batch 1, 16 and 64), and
`step_over_dense_floor` the same with the dense FLOPs alone, as the scorecards up to the
first Zen 3 run of 2026-12-07 computed it. `floors_beside_each_step`
does the same for the invariant path with rates probed right after each timed step (Probe),
the median of the per-step ratios: on a shared host the rates drift by a third within
minutes, and the whole run's rates come from other minutes than the steps (`make
bench-targets` scores this).

`layer_loop` times the invariant engine's steps again, alternating step by step between
the decode layers in one C++ call (the default, `kernels/dense_layers.py`) and the per-op
Python path (`PDSERVE_LAYER_LOOP=0`) in the same engine and batch, so their ratio is free of
the machine's drift between runs; `per_token_ops` alternates, on the per-op path, between
the C++ per-token ops (the default) and torch's kernels for them (`PDSERVE_FUSED_OPS=0`).

    .venv/bin/python benchmarks/decode_step.py [--threads 2] [--dtype bfloat16]
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
from machine import cpu_name

from pdserve.common.models.linear import Linear
from pdserve.kernels import dense_layers, fused_ops, invariant_gemm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M, fused qkv/gate-up
PATHS = {"invariant": "1", "fast": "0"}


def read_gb_per_s(big: torch.Tensor | None = None, repeat: int = 5) -> float:
    big = torch.ones(256 * 1024 * 1024) if big is None else big  # 1 GiB of float32
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best / 1e9


class Probe:
    """The machine's rates right now, by the whole run's probes (a float32 `sum` over 1 GiB,
    best of 2; one 2048³ `mm` in the step's dtype): taken after each timed step, so
    that step's floors come from the same moment. On a shared host the rates drift by a
    third within minutes (another tenant on the cores' sibling hardware threads), so floors
    measured minutes apart from a step are not that step's."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.big = torch.ones(256 * 1024 * 1024)
        self.a = torch.randn(2048, 2048).to(dtype)

    def __call__(self) -> tuple[float, float]:
        """(read GB/s, matmul GFLOP/s)"""
        read = read_gb_per_s(self.big, repeat=2)
        start = time.perf_counter()
        self.a @ self.a
        return read, 2 * 2048**3 / (time.perf_counter() - start) / 1e9


def time_linears(rows: int, dtype: torch.dtype, repeat: int = 5) -> float:
    layers = [[Linear(torch.randn(n, k).to(dtype) * 0.05) for n, k in SHAPES] for _ in range(30)]
    xs = {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}

    def step() -> None:
        for layer in layers:
            for lin in layer:
                lin(xs[lin.in_features])

    step()
    start = time.perf_counter()
    for _ in range(repeat):
        step()
    return (time.perf_counter() - start) / repeat


def matmul_gflops(dtype: torch.dtype, pairs: int = 3) -> dict[str, float]:
    """The machine's matmul rate: a 2048³ `mm`, and the 120 linears at 512 rows (fast path),
    timed in turn `pairs` times (medians), with the median of each pair's linears-over-`mm`
    ratio: taken minutes apart, one slow `mm` would stand for a margin the host lacks."""
    a = torch.randn(2048, 2048).to(dtype)
    a @ a
    os.environ[invariant_gemm.INVARIANT_ENV] = "0"
    rows = 512
    flop = 2 * rows * sum(n * k for n, k in SHAPES) * 30
    mms, linears = [], []
    for _ in range(pairs):
        start = time.perf_counter()
        a @ a
        mms.append(2 * 2048**3 / (time.perf_counter() - start) / 1e9)
        linears.append(flop / time_linears(rows, dtype, 2) / 1e9)
    os.environ.pop(invariant_gemm.INVARIANT_ENV)
    return {
        "mm_2048": round(statistics.median(mms), 1),
        "linears_512_rows": round(statistics.median(linears), 1),
        "linears_over_mm": round(
            statistics.median(lin / mm for mm, lin in zip(mms, linears, strict=True)), 3
        ),
    }


def model_shape(model_dir: str) -> dict[str, int]:
    """Per decode token: the weights a step reads (every layer's dense weights and lm_head),
    the KV elements and the attention FLOPs per context token, from the model's config."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    h, i, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return {
        "dense_weights": layers * per_layer + c.vocab_size * h,
        "kv_elements_per_token": layers * 2 * kv,
        "attention_flops_per_context_token": layers * 4 * q,
    }


def step_floors(
    batch: int, shape: dict[str, int], context: int, itemsize: int, read_gb_s: float, gflops: float
) -> dict[str, float]:
    weight_ms = shape["dense_weights"] * itemsize / read_gb_s / 1e6
    kv_ms = batch * context * shape["kv_elements_per_token"] * itemsize / read_gb_s / 1e6
    dense_ms = 2 * batch * shape["dense_weights"] / gflops / 1e6
    attention_ms = batch * context * shape["attention_flops_per_context_token"] / gflops / 1e6
    return {
        "weight_read_floor_ms": weight_ms,
        "memory_floor_ms": weight_ms + kv_ms,
        "compute_floor_ms": dense_ms + attention_ms,
        "dense_compute_floor_ms": dense_ms,
    }


def over_floors(ms: float, f: dict[str, float]) -> tuple[float, float]:
    """A step's time over its floor, and over the floor with the dense FLOPs alone."""
    memory = f["memory_floor_ms"]
    return ms / max(memory, f["compute_floor_ms"]), ms / max(memory, f["dense_compute_floor_ms"])


def floors(
    steps_ms: dict[str, float],
    shape: dict[str, int],
    context: int,
    itemsize: int,
    read_gb_s: float,
    gflops: float,
) -> dict[str, Any]:
    out = {}
    for batch, ms in steps_ms.items():
        f = step_floors(int(batch), shape, context, itemsize, read_gb_s, gflops)
        ratio, dense_ratio = over_floors(ms, f)
        out[batch] = {"step_ms": ms, **{k: round(v, 2) for k, v in f.items()}}
        out[batch]["step_over_floor"] = round(ratio, 2)
        out[batch]["step_over_dense_floor"] = round(dense_ratio, 2)
    return out


def floors_beside(
    probed: dict[str, list[tuple[float, float, float]]],
    shape: dict[str, int],
    context: int,
    itemsize: int,
    margin: float,
) -> dict[str, Any]:
    """Each timed step of the invariant path over the floors from the probe taken right
    after it (Probe; its matmul rate times `margin`: the fast path's linears over `mm`, timed
    in turn, at least 1): the median of those ratios by batch, with the probes' median rates."""
    out = {}
    for batch, samples in probed.items():
        ratios, dense_ratios = [], []
        for ms, read, gflops in samples:
            f = step_floors(int(batch), shape, context, itemsize, read, gflops * margin)
            ratio, dense_ratio = over_floors(ms, f)
            ratios.append(ratio)
            dense_ratios.append(dense_ratio)
        out[batch] = {
            "step_ms": round(statistics.median(s[0] for s in samples), 2),
            "read_gb_per_s": round(statistics.median(s[1] for s in samples), 1),
            "matmul_gflops": round(statistics.median(s[2] for s in samples), 1),
            "step_over_floor": round(statistics.median(ratios), 2),
            "step_over_dense_floor": round(statistics.median(dense_ratios), 2),
        }
    return out


CONTEXT = 200  # prompt tokens of every sequence in the engine steps
STEPS = 15  # decode steps timed per batch size (their median is reported)


def engine_steps(
    batches: list[int],
    threads: int,
    dtype: str,
    alternate: str | None = None,
    probe: Probe | None = None,
) -> dict[str, dict[str, Any]]:
    """Median step ms by batch: {"steps": ...}, and with `alternate` (an environment switch)
    also {"off_steps": ...} from steps taken in turn with that switch at "0"; with `probe`,
    {"probed": ...}: each step's (ms, read GB/s, GFLOP/s) with the probe taken after it."""
    from pdserve.common.config import EngineConfig
    from pdserve.common.engine import LLMEngine
    from pdserve.common.sampling_params import SamplingParams

    # No TPOT target: the prompts are prefilled in whole chunks before any step is timed (a
    # serving target would cap them at 16 tokens a step once decodes pass it, and a slow
    # host would spend most of the run there); the timed steps are decodes only either way.
    engine = LLMEngine(
        EngineConfig(kv_cache_tokens=32768, threads=threads, dtype=dtype, tpot_target_ms=0)
    )
    rng = random.Random(0)
    # Long enough that no sequence finishes while the others are still in prefill (with 60
    # tokens, "batch 64" measured steps of about 20 sequences), and aborted once timed.
    params = SamplingParams(max_tokens=4 * CONTEXT, temperature=0, ignore_eos=True)
    out: dict[str, dict[str, Any]] = {"steps": {}, "off_steps": {}, "probed": {}}
    for batch in batches:
        prompts = [[rng.randrange(100, 49000) for _ in range(CONTEXT)] for _ in range(batch)]
        ids = [engine.add_request(prompt, params).request_id for prompt in prompts]
        while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            engine.step()
        times: dict[str, list[float]] = {"steps": [], "off_steps": []}
        for i in range(STEPS * (2 if alternate else 1)):
            running = len(engine.scheduler.running)
            assert running == batch, f"a batch-{batch} step ran {running} sequences"
            kind = "off_steps" if i % 2 and alternate else "steps"
            if alternate:
                os.environ[alternate] = "0" if kind == "off_steps" else "1"
            start = time.perf_counter()
            engine.step()
            times[kind].append(time.perf_counter() - start)
            if probe is not None:
                rates = probe()
                out["probed"].setdefault(str(batch), []).append((times[kind][-1] * 1e3, *rates))
        if alternate:
            os.environ.pop(alternate)
        for kind, samples in times.items():
            if samples:
                out[kind][str(batch)] = round(statistics.median(samples) * 1e3, 2)
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--batches", default="1,4,16,64")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    read = read_gb_per_s()
    weight_bytes = sum(n * k for n, k in SHAPES) * 30 * dtype.itemsize
    linears = []
    for rows in [int(r) for r in args.rows.split(",")]:
        row: dict[str, Any] = {"rows": rows}
        for name, flag in PATHS.items():
            os.environ[invariant_gemm.INVARIANT_ENV] = flag
            s = time_linears(rows, dtype)
            row[f"{name}_ms"] = round(s * 1e3, 2)
            row[f"{name}_gb_per_s"] = round(weight_bytes / s / 1e9, 1)
        row["invariant_over_fast_time"] = round(row["invariant_ms"] / row["fast_ms"], 3)
        linears.append(row)
    batches = [int(b) for b in args.batches.split(",")]
    steps = {}
    probed = {}
    for name, flag in PATHS.items():
        os.environ[invariant_gemm.INVARIANT_ENV] = flag
        scored = name == "invariant"  # the path the targets judge; the probes time its steps
        probe = Probe(dtype) if scored else None
        timed = engine_steps(batches, args.threads, args.dtype, probe=probe)
        steps[name] = timed["steps"]
        if scored:
            probed = timed["probed"]
    os.environ.pop(invariant_gemm.INVARIANT_ENV)
    looped = engine_steps(batches, args.threads, args.dtype, alternate=dense_layers.LOOP_ENV)
    loop, per_op = looped["steps"], looped["off_steps"]
    layer_loop = {
        "loop_step_ms": loop,
        "per_op_step_ms": per_op,
        "loop_over_per_op_step_time": {b: round(loop[b] / per_op[b], 3) for b in loop},
    }
    os.environ[dense_layers.LOOP_ENV] = "0"  # torch's ops exist on the per-op path only
    alternating = engine_steps(batches, args.threads, args.dtype, alternate=fused_ops.FUSED_ENV)
    os.environ.pop(dense_layers.LOOP_ENV)
    cpp, torch_ops = alternating["steps"], alternating["off_steps"]
    per_token_ops = {
        "cpp_ops_step_ms": cpp,
        "torch_ops_step_ms": torch_ops,
        "cpp_over_torch_step_time": {b: round(cpp[b] / torch_ops[b], 3) for b in cpp},
    }
    ratios = {b: round(steps["invariant"][b] / steps["fast"][b], 3) for b in steps["fast"]}
    from pdserve.common.model_files import resolve_model

    shape = model_shape(str(resolve_model(None)))
    rates = matmul_gflops(dtype)
    best_rate = max(rates["mm_2048"], rates["linears_512_rows"])
    # The 15 timed steps run 1-16 tokens past the prompt: their middle.
    ctx = CONTEXT + 8
    path_floors = {
        name: floors(times, shape, ctx, dtype.itemsize, read, best_rate)
        for name, times in steps.items()
    }
    # The probes time `mm`; where the fast path's linears beat it (oneDNN's packed bf16 at
    # the model's shapes), carry that margin over, as measured in the same moments.
    margin = max(1.0, rates["linears_over_mm"])
    print(
        json.dumps(
            {
                "benchmark": "decode_step",
                "processor": cpu_name(),
                "host": invariant_gemm.describe(),
                "threads": args.threads,
                "dtype": args.dtype,
                "memory_read_gb_per_s": round(read, 1),
                "weight_read_floor_ms_120_linears": round(weight_bytes / read / 1e6, 2),
                "linears_120": linears,
                "engine_decode_step_ms_by_batch": steps,
                "invariant_over_fast_step_time": ratios,
                "layer_loop": layer_loop,
                "per_token_ops": per_token_ops,
                "matmul_gflops": rates,
                "model_weights_read_per_step_mb": round(
                    shape["dense_weights"] * dtype.itemsize / 1e6, 1
                ),
                "floors": path_floors,
                "floors_beside_each_step": floors_beside(
                    probed, shape, ctx, dtype.itemsize, margin
                ),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
