"""Attention kernel timings at SmolLM2-135M shapes (prints JSON).

The model runner calls these kernels for every layer of every step, so the figure that
matters is one layer call: decode of a batch (per-call µs and effective GB/s of K/V read),
a batch of prefill chunks (without and with a cached prefix) and `write_kv`, for each
backend that serves cpu tensors (the reference is far too slow to matter). Decode is timed
both cycling through all 30 layers (what a real step does: K/V come from DRAM) and on one
layer again and again (cache-warm, closer to the kernels' compute cost).

Run: ``.venv/bin/python benchmarks/attention_kernels.py`` (``--quick``: fewer repetitions;
``--dtype float32``: the cache dtype of hosts without native bf16).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch

from pdserve.kernels import cpu_extension, torch_paged

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
POOL_BLOCKS = 4096
LAYER = 17


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median µs per call after warm-up."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def make_tables(lens: list[int], gen: torch.Generator) -> torch.Tensor:
    """Random distinct block ids from the pool, rows padded with -1."""
    width = max(-(-n // BLOCK) for n in lens)
    ids = torch.randperm(POOL_BLOCKS, generator=gen)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        blocks = -(-n // BLOCK)
        tables[s, :blocks] = ids[used : used + blocks].int()
        used += blocks
    return tables


def backends() -> dict[str, object]:
    found: dict[str, object] = {"torch": torch_paged}
    if cpu_extension.load() is not None:
        found["cpp"] = cpu_extension
    return found


def bench_decode(
    kv: torch.Tensor,
    gen: torch.Generator,
    repeat: int,
    batch: int,
    rotate: bool,
    context: tuple[int, int] = (256, 384),
    backend_names: tuple[str, ...] = ("torch", "cpp"),
) -> dict:
    """Per-call µs of one layer's decode, contexts drawn from `context` (inclusive).
    `rotate`: each call reads the next layer (as a real step does, so the K/V come from
    DRAM); otherwise the same layer again (cache-warm)."""
    lens = torch.randint(context[0], context[1] + 1, (batch,), generator=gen, dtype=torch.int32)
    tables = make_tables(lens.tolist(), gen)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(kv.dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * kv.element_size()
    result: dict = {
        "batch": batch,
        "mean_context": float(lens.float().mean()),
        "kv_read_mb": round(kv_bytes / 1e6, 2),
        "layers_rotated": rotate,
    }
    outs = {}
    for name, mod in backends().items():
        if name not in backend_names:
            continue

        def step(m=mod) -> None:
            for layer in range(LAYERS):
                m.decode_attention(query, kv, layer, tables, lens, scale)

        if rotate:
            us = timed(step, max(3, repeat // 10)) / LAYERS
        else:
            us = timed(
                lambda m=mod: m.decode_attention(query, kv, LAYER, tables, lens, scale), repeat
            )
        outs[name] = mod.decode_attention(query, kv, LAYER, tables, lens, scale).float()
        result[name] = {
            "us_per_call": round(us, 1),
            "gb_per_s": round(kv_bytes / us / 1e3, 2),
            "ms_per_step_30_layers": round(us * LAYERS / 1e3, 2),
        }
    if "cpp" in outs and "torch" in outs:
        result["max_abs_diff_cpp_vs_torch"] = float((outs["cpp"] - outs["torch"]).abs().max())
    return result


def bench_prefill(kv: torch.Tensor, gen: torch.Generator, repeat: int, prefix: int) -> dict:
    chunk, seqs = 256, 4
    lens = [prefix + chunk] * seqs
    tables = make_tables(lens, gen)
    starts = [s * chunk for s in range(seqs + 1)]
    total = chunk * seqs
    query = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(kv.dtype)
    key = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(kv.dtype)
    value = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(kv.dtype)
    slots = torch.cat(
        [
            tables[s, torch.arange(prefix, prefix + chunk) // BLOCK].long() * BLOCK
            + torch.arange(prefix, prefix + chunk) % BLOCK
            for s in range(seqs)
        ]
    )
    torch_paged.write_kv(kv, LAYER, key, value, slots)
    scale = 1 / math.sqrt(HEAD_DIM)
    result: dict = {"seqs": seqs, "chunk": chunk, "cached_prefix": prefix}
    outs = {}
    for name, mod in backends().items():

        def call(m=mod):
            return m.prefill_attention(query, key, value, kv, LAYER, starts, lens, tables, scale)

        result[name] = {"us_per_call": round(timed(call, repeat), 1)}
        outs[name] = call().float()
    if "cpp" in outs:
        result["max_abs_diff_cpp_vs_torch"] = float((outs["cpp"] - outs["torch"]).abs().max())
    return result


def bench_write(kv: torch.Tensor, gen: torch.Generator, repeat: int, tokens: int) -> dict:
    slots = torch.randperm(POOL_BLOCKS * BLOCK, generator=gen)[:tokens]
    key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(kv.dtype)
    value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(kv.dtype)
    result: dict = {"tokens": tokens}
    for name, mod in backends().items():
        us = timed(lambda m=mod: m.write_kv(kv, LAYER, key, value, slots), repeat)
        result[name] = {"us_per_call": round(us, 1)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the cache's dtype"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeat = 10 if args.quick else 50
    gen = torch.Generator().manual_seed(0)
    # The pool spans all layers (1.5 GB in bf16), every one filled (copies of one random layer).
    kv = torch.empty(
        POOL_BLOCKS, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=getattr(torch, args.dtype)
    )
    kv[:, :1].normal_(generator=gen)
    kv[:, 1:] = kv[:, :1]
    report = {
        "shapes": {
            "layers": LAYERS,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK,
            "pool_blocks": POOL_BLOCKS,
            "dtype": str(kv.dtype),
            "threads": torch.get_num_threads(),
        },
        "decode_b64_all_layers": bench_decode(kv, gen, repeat, 64, rotate=True),
        "decode_b64_same_layer": bench_decode(kv, gen, repeat, 64, rotate=False),
        "decode_b8_all_layers": bench_decode(kv, gen, repeat, 8, rotate=True),
        # Few long sequences: the C++ decode splits each one across the threads (split-K).
        "decode_b1_ctx4096_all_layers": bench_decode(
            kv, gen, repeat, 1, rotate=True, context=(4096, 4096), backend_names=("cpp",)
        ),
        "decode_b2_ctx4096_all_layers": bench_decode(
            kv, gen, repeat, 2, rotate=True, context=(4000, 4096), backend_names=("cpp",)
        ),
        "prefill_4x256": bench_prefill(kv, gen, max(3, repeat // 5), 0),
        "prefill_4x256_after_256_cached": bench_prefill(kv, gen, max(3, repeat // 5), 256),
        "write_kv_decode_64": bench_write(kv, gen, repeat, 64),
        "write_kv_prefill_1024": bench_write(kv, gen, repeat, 1024),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
