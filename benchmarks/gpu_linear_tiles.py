"""Tile configurations of the batch-invariant Triton dense layer (kernels/triton_invariant.py)
on a GPU: for each of an 8B Llama's layer shapes (q/k/v, o, gate/up, down, LM head) and each
(BLOCK_N, num_stages) candidate, the time at 1, 16, 64, 256 and 8192 rows beside cuBLAS
(`F.linear`), weight GB/s at decode's row counts, TFLOP/s at prefill's, and whether the
outputs are bit-identical to the default configuration's (BLOCK_M and BLOCK_K stay fixed: a
row's reduction order must not change). Prints one JSON object (and writes it to
$OUT/gpu_linear_tiles.json when $OUT is set).

It needs only torch and triton (the kernel is loaded from its file), so it runs on a GPU
machine straight from the working tree:

    python3 benchmarks/gpu_linear_tiles.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
ROWS = [1, 16, 64, 256, 8192]
CONFIGS = [(64, 3), (64, 5), (64, 8), (32, 3), (32, 5), (32, 8), (16, 6)]  # BLOCK_N, stages
DEFAULT = (64, 3)


# Prefill's row counts: (BLOCK_M, BLOCK_N, num_warps, stages), beside the narrow default
# (64, 64, 4 warps, the depth the kernel picks), the same BLOCK_K.
WIDE_ROWS = [512, 1024, 8192]
WIDE_CONFIGS = [(128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 3), (256, 128, 8, 3),
                (128, 64, 4, 4), (128, 128, 8, 4)]  # fmt: skip


def wide_tiles(run: Any, bench: Any) -> list[dict[str, Any]]:
    """For the layer shapes of prefill (not the LM head: only sampled rows reach it), each
    wide candidate's time and TFLOP/s beside the narrow tile's and cuBLAS's, and whether
    its float32 accumulators have the narrow tile's bits at every row count."""
    rows_out = []
    for n, k in SHAPES[:4]:
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        xs = {m: torch.randn(m, k, device="cuda").to(torch.bfloat16) for m in WIDE_ROWS}
        stages = 5 if n <= 8192 else 3
        narrow = {m: run(xs[m], w, 64, stages, dtype=torch.float32) for m in WIDE_ROWS}
        base: dict[str, Any] = {"n": n, "k": k, "tile": "narrow 64x64 w4"}
        for m in WIDE_ROWS:
            base[f"m{m}_cublas_tflops"] = round(
                2 * m * n * k / bench(partial(F.linear, xs[m], w)) / 1e12, 1
            )
            base[f"m{m}_tflops"] = round(
                2 * m * n * k / bench(partial(run, xs[m], w, 64, stages)) / 1e12, 1
            )
        rows_out.append(base)
        print(json.dumps(base), file=sys.stderr, flush=True)
        for block_m, block_n, warps, st in WIDE_CONFIGS:
            row: dict[str, Any] = {"n": n, "k": k, "tile": f"{block_m}x{block_n} w{warps} s{st}"}
            same = True
            for m in WIDE_ROWS:
                fn = partial(run, xs[m], w, block_n, st, block_m, warps)
                row[f"m{m}_tflops"] = round(2 * m * n * k / bench(fn) / 1e12, 1)
                wide = run(xs[m], w, block_n, st, block_m, warps, dtype=torch.float32)
                same = same and torch.equal(wide, narrow[m])
            row["same_bits_as_narrow"] = same
            rows_out.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows_out


def load_kernel_module() -> Any:
    path = Path(__file__).resolve().parents[1] / "kernels" / "triton_invariant.py"
    spec = importlib.util.spec_from_file_location("triton_invariant", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the default and two other configs")
    p.add_argument("--wide", action="store_true", help="tiles for prefill's row counts")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_linear_tiles: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    import triton.testing

    ti = load_kernel_module()
    configs = [DEFAULT, (64, 5), (32, 8)] if args.quick else CONFIGS

    def run(
        x: torch.Tensor, w: torch.Tensor, block_n: int, stages: int, block_m: int = 0,
        warps: int = 4, dtype: torch.dtype | None = None,
    ) -> torch.Tensor:  # fmt: skip
        m, k = x.shape
        n = w.shape[0]
        block_m = block_m or ti.BLOCK_M
        y = torch.empty((m, n), dtype=dtype or x.dtype, device=x.device)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        ti._linear_kernel[grid](
            x, w, w, y, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
            y.stride(0), y.stride(1), HAS_BIAS=False, IEEE=False,
            INTERPRETED=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=ti.BLOCK_K,
            num_stages=stages, num_warps=warps,
        )  # fmt: skip
        return y

    def bench(fn: Any) -> float:
        return triton.testing.do_bench(fn, warmup=5, rep=30) * 1e-3  # seconds

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rows": []}
    if args.wide:
        out["wide"] = wide_tiles(run, bench)
        text = json.dumps(out, indent=1)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_linear_tiles_wide.json").write_text(text + "\n")
        print(text)
        return 0
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        rows = [m for m in ROWS if not (n > 100_000 and m > 256)]  # the LM head: decode only
        xs = {m: torch.randn(m, k, device="cuda").to(torch.bfloat16) for m in rows}
        base = {m: run(xs[m], w, *DEFAULT) for m in (1, 64)}
        cublas = {m: bench(partial(F.linear, xs[m], w)) for m in rows}
        for block_n, stages in configs:
            row: dict[str, Any] = {"n": n, "k": k, "block_n": block_n, "stages": stages}
            for m in rows:
                s = bench(partial(run, xs[m], w, block_n, stages))
                row[f"m{m}_us"] = round(s * 1e6, 1)
                row[f"m{m}_cublas_us"] = round(cublas[m] * 1e6, 1)
                if m <= 64:
                    row[f"m{m}_weight_gb_per_s"] = round(n * k * 2 / s / 1e9)
                else:
                    row[f"m{m}_tflops"] = round(2 * m * n * k / s / 1e12, 1)
            row["same_bits_as_default"] = all(
                torch.equal(run(xs[m], w, block_n, stages), base[m]) for m in (1, 64)
            )
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    text = json.dumps(out, indent=1)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_linear_tiles.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
