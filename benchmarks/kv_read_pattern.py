"""How fast this machine reads decode attention's memory pattern, and what prefetching does
to it (prints JSON).

A decode step's attention reads, for each sequence and layer, one 12 KB float32 K tile and one
V tile per cache block (SmolLM2: 16 tokens x 3 kv heads x 64 x 4 bytes), the blocks scattered
over a pool of several GB. This probe reads exactly that pattern (64 sequences of 13 random
blocks, every layer of a 30-layer pool on transparent huge pages, 2 threads) with a fixed
amount of arithmetic per 64-byte line (`work`: 4 independent FMA chains, `work` rounds each),
and three ways of prefetching into L2: none (the hardware prefetchers alone), `burst` (each
tile two ahead issued at once when a tile starts, as decode attention did) and `spread` (the
tile two ahead issued one line per line consumed, as `Spread` in
kernels/csrc/paged_attention_avx2.h does); `spread_head_order` is `spread` with each tile's
lines read as the kernels read them, one kv head's 256 bytes of every 768-byte row, head by
head. With no arithmetic it gives the pattern's read rate; with some, whether reads overlap
the arithmetic (spread) or add to it (burst).

Run: ``.venv/bin/python benchmarks/kv_read_pattern.py`` (about a minute: it builds a small
C++ probe with torch's extension loader, then allocates and fills a 2.9 GB pool).
"""

from __future__ import annotations

import argparse
import json

from machine import cpu_name  # benchmarks/machine.py, beside this script
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <chrono>
#include <cstring>
#include <random>
#include <algorithm>
#include <vector>

constexpr long kLayers = 30, kTile = 12288, kLines = kTile / 64, kBlocks = 4096;
// A tile's rows (tokens) and kv heads: a row is kRowLines lines, a head's part of it kHeadLines.
constexpr long kRows = 16, kHeads = 3, kRowLines = kLines / kRows, kHeadLines = kRowLines / kHeads;
constexpr long kBlockBytes = kLayers * 2 * kTile;
constexpr int kSeqs = 64, kPerSeq = 13, kAhead = 2;

static char* pool = nullptr;
static std::vector<int> table;

void setup() {
  if (pool) return;
  size_t bytes = kBlocks * kBlockBytes;
  pool = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  TORCH_CHECK(pool != MAP_FAILED, "mmap failed");
  madvise(pool, bytes, MADV_HUGEPAGE);
  memset(pool, 1, bytes);
  std::vector<int> ids(kBlocks);
  for (int i = 0; i < kBlocks; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), std::mt19937(0));
  table.assign(ids.begin(), ids.begin() + kSeqs * kPerSeq);
}

// Seconds for the 30 layers' reads (best of `repeats`); mode 0 none, 1 burst, 2 spread,
// 3 spread with the lines read head by head.
double run(int mode, int work, int repeats, int threads) {
  setup();
  omp_set_num_threads(threads);
  double best = 1e9;
  float sink = 0;
  for (int rep = 0; rep < repeats; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int layer = 0; layer < kLayers; ++layer) {
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : sink)
      for (int s = 0; s < kSeqs; ++s) {
        auto tile = [&](int i) {
          return pool + table[s * kPerSeq + i % kPerSeq] * kBlockBytes + layer * 2 * kTile +
                 (i < kPerSeq ? 0 : kTile);
        };
        __m256 acc = _mm256_setzero_ps(), c0 = acc, c1 = acc, c2 = acc, c3 = acc;
        for (int i = 0; i < 2 * kPerSeq; ++i) {
          const char* p = tile(i);
          const char* ahead = i + kAhead < 2 * kPerSeq ? tile(i + kAhead) : nullptr;
          if (ahead && mode == 1)
            for (long l = 0; l < kLines; ++l) _mm_prefetch(ahead + l * 64, _MM_HINT_T1);
          for (long i = 0; i < kLines; ++i) {
            // Mode 3 reads the tile as the kernels do: one kv head's lines of every row, head by
            // head; the others read it straight.
            const long head = i / (kRows * kHeadLines), row = i / kHeadLines % kRows;
            const long l = mode == 3 ? row * kRowLines + head * kHeadLines + i % kHeadLines : i;
            if (ahead && mode >= 2) _mm_prefetch(ahead + i * 64, _MM_HINT_T1);
            const __m256 a = _mm256_loadu_ps(reinterpret_cast<const float*>(p + l * 64));
            const __m256 b = _mm256_loadu_ps(reinterpret_cast<const float*>(p + l * 64 + 32));
            for (int w = 0; w < work; ++w) {
              c0 = _mm256_fmadd_ps(a, b, c0);
              c1 = _mm256_fmadd_ps(b, a, c1);
              c2 = _mm256_fmadd_ps(a, a, c2);
              c3 = _mm256_fmadd_ps(b, b, c3);
            }
            acc = _mm256_add_ps(acc, _mm256_add_ps(a, b));
          }
        }
        alignas(32) float out[8];
        _mm256_store_ps(out, _mm256_add_ps(acc, _mm256_add_ps(_mm256_add_ps(c0, c1),
                                                               _mm256_add_ps(c2, c3))));
        sink += out[0];
      }
    }
    best = std::min(best, std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - t0).count());
  }
  return sink == 12345.f ? -best : best;  // keeps the reads
}

double bytes_read() { return double(kLayers) * kSeqs * 2 * kPerSeq * kTile; }
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default="0,2,4,8", help="FMA rounds per line, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    probe = load_inline(
        name="pdserve_kv_read_pattern",
        cpp_sources=[SOURCE],
        functions=["run", "bytes_read"],
        extra_cflags=["-O2", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    gb = probe.bytes_read() / 1e9
    rows = []
    for work in (int(w) for w in args.work.split(",")):
        row: dict[str, float | int] = {"work": work}
        for mode, name in enumerate(("none", "burst", "spread", "spread_head_order")):
            seconds = abs(probe.run(mode, work, args.repeats, args.threads))
            row[f"{name}_ms"] = round(seconds * 1e3, 2)
            row[f"{name}_gb_per_s"] = round(gb / seconds, 1)
        rows.append(row)
    print(
        json.dumps(
            {
                "benchmark": "kv_read_pattern",
                "processor": cpu_name(),
                "threads": args.threads,
                "gb_read_per_pass": round(gb, 3),
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
