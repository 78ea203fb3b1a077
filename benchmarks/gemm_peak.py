"""Where the GEMM stands against the FMA units' peak: the float32 rate the cores can issue at
all, torch's 2048³ `mm`, and the invariant GEMM over SmolLM2's 120 linears at decode's row
counts, on 1 thread and on `--threads`, in one run. Prints one JSON object.

`decode_step.py` scores a step against floors from measured rates (`mm`'s and a `sum`'s);
this says how far those rates and ours sit from the arithmetic the hardware offers. The
peak is a compiled loop of 12 independent FMA chains per thread (enough to cover the FMA
latency on the x86 cores we target), 256-bit on AVX2 hosts and 512-bit where the CPU has
AVX-512F, run on every thread at once: FMA units x lanes x 2 x the clock the cores hold
under that load. It needs a C compiler (`cc`), as the kernels' own build does.

The linears read all 30 layers' weights once a pass, as a decode step does, so at 1-4 rows
they are bound by memory, not the FMA units; at 16 rows and more their fraction of the peak
is the GEMM's efficiency. float32 only: bf16 hosts reach their matmul rate through AMX or
AVX512-BF16 dot products, which this loop does not measure.

    .venv/bin/python benchmarks/gemm_peak.py [--threads 2] [--rows 1,4,16,64]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from decode_step import SHAPES, time_linears
from machine import cpu_name
from offline import best_seconds

from pdserve.kernels import invariant_gemm
from pdserve.kernels.cpp_build import cpu_flags

CHAINS = 12
FMA_LOOP = r"""
#define LOOP(name, lanes, isa)                                                             \
  typedef float name##_v __attribute__((vector_size(4 * lanes)));                          \
  __attribute__((target(isa))) float name(long n) {                                        \
    name##_v a[CHAINS], b, c;                                                               \
    for (int i = 0; i < lanes; ++i) { b[i] = 0.9999f; c[i] = 1e-4f; }                      \
    for (int j = 0; j < CHAINS; ++j)                                                        \
      for (int i = 0; i < lanes; ++i) a[j][i] = j * 1e-3f;                                 \
    for (long k = 0; k < n; ++k)                                                            \
      for (int j = 0; j < CHAINS; ++j) a[j] = a[j] * b + c;                                 \
    float s = 0;                                                                            \
    for (int j = 0; j < CHAINS; ++j) s += a[j][0];                                          \
    return s;                                                                               \
  }
LOOP(fma_loop_256, 8, "avx2,fma")
LOOP(fma_loop_512, 16, "avx512f")
"""


def fma_library(folder: Path) -> ctypes.CDLL:
    source, library = folder / "fma_loop.c", folder / "fma_loop.so"
    source.write_text(f"#define CHAINS {CHAINS}\n{FMA_LOOP}")
    # -ffp-contract=fast: a * b + c is one FMA; -funroll-loops keeps the chains in registers.
    flags = ["-O3", "-funroll-loops", "-ffp-contract=fast", "-shared", "-fPIC"]
    try:
        subprocess.run(["cc", *flags, str(source), "-o", str(library)], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"gemm_peak: the FMA loop needs an x86-64 C compiler, `cc`: {e}") from e
    lib = ctypes.CDLL(str(library))
    for name in ("fma_loop_256", "fma_loop_512"):
        getattr(lib, name).argtypes = [ctypes.c_long]
        getattr(lib, name).restype = ctypes.c_float
    return lib


def fma_peak_gflops(
    lib: ctypes.CDLL, threads: int, lanes: int, iterations: int = 50_000_000
) -> float:
    """float32 GFLOP/s of the `lanes`-wide FMA loop on `threads` threads at once (ctypes drops
    the GIL during each call), best of 3."""
    loop = lib.fma_loop_512 if lanes == 16 else lib.fma_loop_256

    def on_every_thread() -> None:
        workers = [threading.Thread(target=loop, args=(iterations,)) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    return threads * iterations * CHAINS * lanes * 2 / best_seconds(on_every_thread, 3) / 1e9


def measure(lib: ctypes.CDLL, threads: int, lanes: int, rows: list[int]) -> dict[str, Any]:
    torch.set_num_threads(threads)
    peak = fma_peak_gflops(lib, threads, lanes)
    a = torch.randn(2048, 2048)
    mm = 2 * 2048**3 / best_seconds(lambda: a @ a, 5) / 1e9
    flop_per_row = 2 * 30 * sum(n * k for n, k in SHAPES)
    linears = {}
    for r in rows:
        rate = flop_per_row * r / time_linears(r, torch.float32) / 1e9
        linears[str(r)] = {
            "gflops": round(rate, 1),
            "of_fma_peak": round(rate / peak, 3),
            "over_mm": round(rate / mm, 3),
        }
    return {
        "fma_peak_gflops": round(peak, 1),
        "mm_2048_gflops": round(mm, 1),
        "mm_of_fma_peak": round(mm / peak, 3),
        "linears_120_by_rows": linears,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,4,16,64")
    args = p.parse_args()
    os.environ[invariant_gemm.INVARIANT_ENV] = "1"
    rows = [int(r) for r in args.rows.split(",")]
    lanes = 16 if "avx512f" in cpu_flags() else 8
    with tempfile.TemporaryDirectory() as folder:
        lib = fma_library(Path(folder))
        by_threads = {str(t): measure(lib, t, lanes, rows) for t in sorted({1, args.threads})}
    print(
        json.dumps(
            {
                "benchmark": "gemm_peak",
                "processor": cpu_name(),
                "host": invariant_gemm.describe(),
                "fma_width_bits": 32 * lanes,
                "by_threads": by_threads,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
