"""Routed-expert computation of one MoE layer call: the fused path (grouped by expert, one
pair of matmuls per active expert) against a per-token loop and against a per-expert loop
with one-hot masks (the shape of a straightforward eager implementation). Prints JSON.

The model calls `pdserve.kernels.moe.experts` once per MoE layer per step, so the figure is
µs per layer call at decode-sized (1, 16, 64 tokens) and prefill-sized (256 tokens)
batches, with random routing over the experts (softmax top-k of Gaussian scores).

Run: ``.venv/bin/python benchmarks/moe_experts.py`` (``--quick``: fewer repetitions;
``--hidden``, ``--inter``, ``--experts``, ``--top-k``, ``--dtype`` to change the shape).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.kernels import moe as moe_kernels


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median µs per call after warm-up."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def per_token_loop(x, w13, w2, weights, ids):
    """One token and one chosen expert at a time, in the activation dtype."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = F.linear(x[t : t + 1], w13[e]).chunk(2, dim=-1)
            out[t] += (F.linear(F.silu(gate) * up, w2[e])[0] * weights[t, k]).to(x.dtype)
    return out


def one_hot_expert_loop(x, w13, w2, weights, ids):
    """A loop over experts that finds each one's tokens with a one-hot mask."""
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)
    for e in torch.nonzero(mask.sum(dim=(1, 2))).flatten().tolist():
        slot, token = torch.where(mask[e])
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,16,64,256")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    h, i, e = args.hidden, args.inter, args.experts
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    repeat = 5 if args.quick else 20
    results = []
    for n in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(n, h, generator=gen).to(dtype)
        probs = torch.softmax(torch.randn(n, e, generator=gen), dim=-1)
        weights, ids = torch.topk(probs, args.top_k, dim=-1)
        call = (x, w13, w2, weights, ids)
        row: dict[str, float] = {"tokens": n, "active_experts": int(ids.unique().numel())}
        with torch.inference_mode():
            for name, fn, reps in (
                ("fused_us", moe_kernels.fused_experts, repeat),
                ("one_hot_expert_loop_us", one_hot_expert_loop, repeat),
                ("per_token_loop_us", per_token_loop, max(2, repeat // 4)),
            ):
                row[name] = round(timed(functools.partial(fn, *call), reps), 1)
        expert_bytes = 3 * h * i * x.element_size() * row["active_experts"]
        row["weight_gb_per_s_fused"] = round(expert_bytes / row["fused_us"] / 1e3, 2)
        row["speedup_vs_per_token"] = round(row["per_token_loop_us"] / row["fused_us"], 2)
        row["speedup_vs_one_hot"] = round(row["one_hot_expert_loop_us"] / row["fused_us"], 2)
        results.append(row)
        print(f"tokens={n}: {row}", file=sys.stderr)
    shape = {"hidden": h, "inter": i, "experts": e, "top_k": args.top_k, "dtype": args.dtype}
    # On a shared machine, others' load moves the figures: report it beside them.
    load = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps({"shape": shape, "threads": args.threads, "load_average_end": load,
                      "results": results}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
