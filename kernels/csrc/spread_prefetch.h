// Software prefetch spread over a loop, shared by the kernels that stream from DRAM while
// they compute: decode attention (the next tile's keys and values) and the dense layers'
// GEMM (the next column block's weights).
//
// `lines` cache lines from `p` are prefetched into L2 over `steps` calls of step(), a line or
// two per call (a carry, like Bresenham's). Issued in one burst, the prefetches stall the
// core until its miss buffers drain; spread, DRAM streams under the arithmetic
// (benchmarks/kv_read_pattern.py, the decode pattern with ~16 FMAs per line on 2 threads:
// burst ~17 GB/s, none ~19, spread ~23, i.e. the arithmetic's own time). Only where data
// goes changes, never the arithmetic.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pdserve_prefetch {

class Spread {
 public:
  Spread(const void* p, int64_t lines, int64_t steps)
      : p_(static_cast<const char*>(p)), lines_(p ? lines : 0), steps_(steps > 0 ? steps : 1) {}

  void step() {
    for (carry_ += lines_; carry_ >= steps_; carry_ -= steps_, p_ += 64)
      _mm_prefetch(p_, _MM_HINT_T1);
  }

 private:
  const char* p_;
  int64_t lines_, steps_, carry_ = 0;
};

}  // namespace pdserve_prefetch
