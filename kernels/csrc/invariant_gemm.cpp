// y = x W^T + b on CPU, batch- and chunk-invariant: every dense layer of the model runner
// (q/k/v, o_proj, the MLPs, the experts, lm_head) on every step.
//
// The contract: each output element is one reduction over K in a fixed order that depends
// only on K and the instruction-set path, never on M (the rows in the batch), on which row
// of which tile the element was computed in, on the other rows, or on the thread count. So
// a token's numbers are the same in a decode step of 1 or 256 sequences and inside a
// prefill chunk of any size. How:
//   * rows are tiled (4 rows per register block, 16 per AMX tile); a short tile is padded
//     with zero rows, and rows never interact;
//   * K is never split: one accumulator per output element walks K from 0 to the end;
//   * threads split the output columns (N), never K.
//
// Paths (chosen in Python by the CPU's flags and ONEDNN_MAX_CPU_ISA, passed as `isa`):
//   0 avx2        float32 accumulation with FMA, 8 lanes; bf16/fp16 weights widened exactly
//   1 avx512      the same arithmetic, 16 lanes (bit-identical to avx2 for a given dtype)
//   2 avx512_bf16 bf16 pairs with VDPBF16PS
//   3 amx         bf16 with AMX tiles (TDPBF16PS), 16x16 fp32 accumulators
// Each path is compiled with a target attribute, so one build serves every host class.
//
// Weight layouts (packed once at load time by pdserve.kernels.invariant_gemm):
//   bf16:      [N/16][Kp/2][16][2], Kp = K rounded up to 32 (VNNI pairs: one AMX B tile is
//              16 consecutive 64-byte rows)
//   fp32/fp16: [N/16][K][16]
// N is padded to a multiple of 16 with zero rows; padded columns are never stored.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "entry_points.h"
#include "spread_prefetch.h"

namespace {

enum Isa : int64_t { kAvx2 = 0, kAvx512 = 1, kAvx512Bf16 = 2, kAmx = 3 };

constexpr int kBlock = 16;     // output columns per packed block
constexpr int kMChunk = 256;   // rows whose activations stay in L2 while the columns turn
// Column blocks side by side in fma_few_rows_avx2's tiles, by its row count (1-4).
constexpr int kFewRowsBlocks[5] = {0, 4, 3, 2, 2};

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")))
#define AMX_TARGET                                                                     \
  __attribute__((target(                                                               \
      "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,f16c,fma")))

// Round-to-nearest-even float -> bfloat16 (torch's rule, NaN kept quiet).
inline uint16_t to_bf16_scalar(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7fffu)) >> 16);
}

// ------------------------------------------------------------------ AVX-512 epilogue
// 16 fp32 sums (+ bias) rounded to T, the first `n` of them stored.
template <typename T>
AVX512_TARGET inline void store16_avx512(T* dst, __m512 v, const float* bias, int n) {
  const __mmask16 mask = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(dst, mask, v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(r));
  } else {
    const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(dst, mask, h);
  }
}

// The same with the CPU's own float32 -> bf16 conversion (VCVTNEPS2BF16: round to nearest
// even, denormals flushed), one instruction instead of eight; the bf16 paths (AVX512-BF16,
// AMX) store through this, every column of every row the same way.
template <typename T>
BF16_TARGET inline void store16_bf16(T* dst, __m512 v, const float* bias, int n) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __mmask16 mask = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
    _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
  } else {
    store16_avx512(dst, v, bias, n);
  }
}

// ------------------------------------------------------------------ AVX2 epilogue
template <typename T>
AVX2_TARGET inline void store8_avx2(T* dst, __m256 v, const float* bias, int n) {
  alignas(32) float tmp[8];
  if (bias) {
    if (n >= 8) {
      v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    } else {
      float b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::memcpy(b, bias, sizeof(float) * n);
      v = _mm256_add_ps(v, _mm256_loadu_ps(b));
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    if (n >= 8) {
      _mm256_storeu_ps(dst, v);
      return;
    }
    _mm256_store_ps(tmp, v);
    std::memcpy(dst, tmp, sizeof(float) * n);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    alignas(16) uint16_t h[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(h),
                    _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    std::memcpy(dst, h, 2 * std::min(n, 8));
  } else {
    _mm256_store_ps(tmp, v);
    uint16_t h[8];
    for (int i = 0; i < 8; ++i) h[i] = to_bf16_scalar(tmp[i]);
    std::memcpy(dst, h, 2 * std::min(n, 8));
  }
}

using pdserve_prefetch::Spread;

// Weight lines a register block prefetches into L2 while it works, spread over its K loop
// (see the row drivers).
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;
};

// `lines` cache lines from `p` on, handed out to a unit's row tiles in equal shares.
class AheadShares {
 public:
  AheadShares(const void* p, int64_t lines, int64_t tiles)
      : p_(static_cast<const char*>(p)), lines_(lines), per_tile_((lines + tiles - 1) / tiles) {}

  Ahead take() {
    const Ahead a{p_ + done_ * 64, std::min(per_tile_, lines_ - done_)};
    done_ += a.lines;
    return a;
  }

 private:
  const char* p_;
  int64_t lines_, per_tile_, done_ = 0;
};

// ------------------------------------------------------------------ FMA paths
// The register blocks below accumulate into a local array and copy it out once at the end.
// Accumulating straight into the caller's array made the compiler store every accumulator
// on every K step: vector types may alias anything, so each store might have changed the
// next weight or activation load. Those stores cut the bf16 blocks' rate up to 4x (GCC
// kept the float32 ones in registers already); the arithmetic, and so every bit of the
// result, is the same either way.

// R rows x NB column blocks; x rows are float32 (ldx apart). acc = fma(x[k], w[k], acc)
// for k = 0, 1, ..., K-1: the same sequence on AVX2 and AVX-512, so the same bits.
// W: float / c10::Half in [K][16] blocks, or bf16 pairs ([K/2][16][2]) flagged by kPairs.
template <typename W, int R, int NB>
AVX512_TARGET void fma_block_avx512(const float* x, int64_t ldx, const W* b, int64_t bstride,
                                    int64_t k, __m512 (&out)[R][NB]) {
  __m512 acc[R][NB];  // local, so it stays in registers (above)
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t p = 0; p < k / 2; ++p) {
      __m512 even[NB], odd[NB];
      for (int j = 0; j < NB; ++j) {
        const __m512i raw = _mm512_loadu_si512(b + j * bstride + p * 32);
        even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        odd[j] = _mm512_castsi512_ps(_mm512_and_si512(raw, hi));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 x0 = _mm512_set1_ps(x[r * ldx + 2 * p]);
        const __m512 x1 = _mm512_set1_ps(x[r * ldx + 2 * p + 1]);
        for (int j = 0; j < NB; ++j) {
          acc[r][j] = _mm512_fmadd_ps(x0, even[j], acc[r][j]);
          acc[r][j] = _mm512_fmadd_ps(x1, odd[j], acc[r][j]);
        }
      }
    }
  } else {
    for (int64_t q = 0; q < k; ++q) {
      __m512 w[NB];
      for (int j = 0; j < NB; ++j) {
        if constexpr (std::is_same_v<W, float>)
          w[j] = _mm512_loadu_ps(b + j * bstride + q * 16);
        else
          w[j] = _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + j * bstride + q * 16)));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + q]);
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
      }
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

// Lead > 0 (float / fp16 weights): each block's own stream is also prefetched into L1,
// Lead k steps ahead of its loads (see fma_few_rows_avx2).
template <typename W, int R, int NB, int Lead = 0>
AVX2_TARGET void fma_block_avx2(const float* x, int64_t ldx, const W* b, int64_t bstride,
                                int64_t k, __m256 (&out)[R][2 * NB], Ahead ahead) {
  __m256 acc[R][2 * NB];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2 * NB; ++v) acc[r][v] = _mm256_setzero_ps();
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    Spread spread(ahead.p, ahead.lines, k / 2);
    for (int64_t p = 0; p < k / 2; ++p) {
      __m256 even[2 * NB], odd[2 * NB];
      for (int v = 0; v < 2 * NB; ++v) {
        const __m256i raw = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(b + (v / 2) * bstride + p * 32 + (v % 2) * 16));
        even[v] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        odd[v] = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 x0 = _mm256_set1_ps(x[r * ldx + 2 * p]);
        const __m256 x1 = _mm256_set1_ps(x[r * ldx + 2 * p + 1]);
        for (int v = 0; v < 2 * NB; ++v) {
          acc[r][v] = _mm256_fmadd_ps(x0, even[v], acc[r][v]);
          acc[r][v] = _mm256_fmadd_ps(x1, odd[v], acc[r][v]);
        }
      }
      spread.step();
    }
  } else {
    Spread spread(ahead.p, ahead.lines, k);
    for (int64_t q = 0; q < k; ++q) {
      __m256 w[2 * NB];
      for (int v = 0; v < 2 * NB; ++v) {
        const W* src = b + (v / 2) * bstride + q * 16 + (v % 2) * 8;
        if constexpr (std::is_same_v<W, float>)
          w[v] = _mm256_loadu_ps(src);
        else
          w[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(x[r * ldx + q]);
        for (int v = 0; v < 2 * NB; ++v) acc[r][v] = _mm256_fmadd_ps(xv, w[v], acc[r][v]);
      }
      if constexpr (Lead > 0)
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(b + j * bstride + (q + Lead) * 16),
                       _MM_HINT_T0);
      spread.step();
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

// ------------------------------------------------------------------ AVX512-BF16 path
// acc += pair(x[2p], x[2p+1]) . pair(w[2p], w[2p+1]) for p = 0, 1, ...: VDPBF16PS.
// `ahead`: weight lines to prefetch into L2 meanwhile, spread evenly over the K loop.

template <int R, int NB>
BF16_TARGET void dp_block(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* b,
                          int64_t bstride, int64_t kpairs, __m512 (&out)[R][NB], Ahead ahead) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  Spread spread(ahead.p, ahead.lines, kpairs);
  for (int64_t p = 0; p < kpairs; ++p) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(b + j * bstride + p * 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, w[j]);
    }
    spread.step();
  }
  std::memcpy(out, acc, sizeof(acc));
}

// ------------------------------------------------------------------ AMX path
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

AMX_TARGET void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// C tiles 0..3 = (row tile i, column block j) at 2i + j; A tiles 4, 5; B tiles 6, 7.
// a: row tile 0 (row tile 1 lda_bytes * 16 further); b: column block 0 (block 1 bstride
// elements further); ksteps steps of 32 k. c: [16 MT][16 NT] fp32, ldc floats.
template <int MT, int NT>
AMX_TARGET void amx_block(const c10::BFloat16* a, int64_t lda_bytes, const c10::BFloat16* b,
                          int64_t bstride, int64_t ksteps, float* c, int64_t ldc) {
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  const char* a1 = reinterpret_cast<const char*>(a) + 16 * lda_bytes;
  for (int64_t s = 0; s < ksteps; ++s) {
    _tile_loadd(4, a + 32 * s, lda_bytes);
    _tile_loadd(6, b + 512 * s, 64);
    if constexpr (NT == 2) _tile_loadd(7, b + bstride + 512 * s, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) {
      _tile_loadd(5, a1 + 64 * s, lda_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t ldc_bytes = ldc * 4;
  _tile_stored(0, c, ldc_bytes);
  if constexpr (NT == 2) _tile_stored(1, c + 16, ldc_bytes);
  if constexpr (MT == 2) _tile_stored(2, c + 16 * ldc, ldc_bytes);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, c + 16 * ldc + 16, ldc_bytes);
}

// ------------------------------------------------------------------ drivers
struct Problem {
  int64_t m, n, k, nblocks;
  const float* bias;  // fp32 or null
};

// [0, total) in runs of `run` (the last may be short): each thread owns an equal share of
// the runs and walks it upward; one that finishes its own steals from the others' shares
// from the top down, until every run is taken (per share, one counter of runs taken decides
// who gets one, so no run is taken twice). f(begin, end, up) per run: up for the owner, not
// for a thief. On a host where another tenant's work slows one core more than the other (a
// busy sibling hardware thread), a static half each made the faster thread wait at the
// join; here it takes over the slower one's last runs. Until then each thread walks its
// columns in order, touching only its own share's counter, as with the static split, and
// the block whose weights it prefetches is the one it multiplies next. Which thread computes
// a column changes none of its bits (threads split columns, never K).
template <typename F>
void for_stealing(int64_t total, int64_t run, F&& f) {
  const int64_t runs = (total + run - 1) / run;
  const int64_t threads = std::clamp<int64_t>(at::get_num_threads(), 1, std::max<int64_t>(runs, 1));
  struct alignas(64) Share {
    std::atomic<int64_t> taken{0}, from_top{0};
  };
  std::vector<Share> shares(threads);
  auto first = [&](int64_t t) { return runs * t / threads; };
  auto go = [&](int64_t r, bool up) { f(r * run, std::min(total, (r + 1) * run), up); };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t size = first(t + 1) - first(t);
      for (int64_t i = 0; shares[t].taken.fetch_add(1) < size; ++i) go(first(t) + i, true);
      for (int64_t v = (t + 1) % threads; v != t; v = (v + 1) % threads)
        while (shares[v].taken.fetch_add(1) < first(v + 1) - first(v))
          go(first(v + 1) - 1 - shares[v].from_top.fetch_add(1), false);
    }
  });
}

// Runs of about 1/64 of a thread's share: short enough that a thief takes over within a few
// microseconds of the end, long enough that the counters are touched rarely.
constexpr int64_t kRunsPerThread = 64;

inline int64_t run_length(int64_t total, int64_t align) {
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t run = std::max<int64_t>(1, total / (threads * kRunsPerThread));
  return (run + align - 1) / align * align;
}

// Column units of `nb` blocks each, in runs over the threads (for_stealing); inside a run, row
// chunks of kMChunk rows turn over its units (the chunk's activations stay in cache).
// body(m0, m1, b0, nb, next): `next` is the first block of the unit this thread takes next
// in its direction (-1 at the ends), whose weights it may prefetch.
template <typename F>
void for_units(const Problem& pr, int nb, F&& body) {
  const int64_t units = (pr.nblocks + nb - 1) / nb;
  for_stealing(units, run_length(units, 1), [&](int64_t u0, int64_t u1, bool up) {
    for (int64_t m0 = 0; m0 < pr.m; m0 += kMChunk) {
      const int64_t m1 = std::min(pr.m, m0 + kMChunk);
      for (int64_t i = 0; i < u1 - u0; ++i) {
        const int64_t u = up ? u0 + i : u1 - 1 - i, next = up ? u + 1 : u - 1;
        const int64_t b0 = u * nb;
        body(m0, m1, b0, std::min<int64_t>(nb, pr.nblocks - b0),
             next >= 0 && next < units ? next * nb : -1);
      }
    }
  });
}

template <typename T, typename W, int R, int NB>
AVX512_TARGET void fma_tile_avx512(const Problem& pr, const float* x, const W* w, int64_t bstride,
                                   T* y, int64_t r0, int64_t b0) {
  __m512 acc[R][NB];
  fma_block_avx512<W, R, NB>(x + r0 * pr.k, pr.k, w + b0 * bstride, bstride, pr.k, acc);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      const int64_t col = (b0 + j) * kBlock;
      store16_avx512(y + (r0 + r) * pr.n + col, acc[r][j], pr.bias ? pr.bias + col : nullptr,
                     static_cast<int>(std::min<int64_t>(kBlock, pr.n - col)));
    }
}

template <typename T, typename W, int NB>
AVX512_TARGET void fma_rows_avx512(const Problem& pr, const float* x, const W* w, int64_t bstride,
                                   T* y, int64_t m0, int64_t m1, int64_t b0) {
  int64_t r = m0;
  for (; r + 4 <= m1; r += 4) fma_tile_avx512<T, W, 4, NB>(pr, x, w, bstride, y, r, b0);
  switch (m1 - r) {  // the last 1-3 rows as one tile (see gemm_fma_avx2)
    case 3: fma_tile_avx512<T, W, 3, NB>(pr, x, w, bstride, y, r, b0); break;
    case 2: fma_tile_avx512<T, W, 2, NB>(pr, x, w, bstride, y, r, b0); break;
    case 1: fma_tile_avx512<T, W, 1, NB>(pr, x, w, bstride, y, r, b0); break;
    default: break;
  }
}

template <typename T, typename W>
AVX512_TARGET void gemm_fma_avx512(const Problem& pr, const float* x, const W* w, T* y) {
  const int64_t bstride = std::is_same_v<W, c10::BFloat16> ? ((pr.k + 31) / 32) * 32 * kBlock
                                                           : pr.k * kBlock;
  for_units(pr, 4, [&](int64_t m0, int64_t m1, int64_t b0, int64_t nb, int64_t) {
    switch (nb) {
      case 4: fma_rows_avx512<T, W, 4>(pr, x, w, bstride, y, m0, m1, b0); break;
      case 3: fma_rows_avx512<T, W, 3>(pr, x, w, bstride, y, m0, m1, b0); break;
      case 2: fma_rows_avx512<T, W, 2>(pr, x, w, bstride, y, m0, m1, b0); break;
      default: fma_rows_avx512<T, W, 1>(pr, x, w, bstride, y, m0, m1, b0); break;
    }
  });
}

template <typename T, typename W, int R, int NB = 1, int Lead = 0>
AVX2_TARGET void fma_tile_avx2(const Problem& pr, const float* x, const W* w, int64_t bstride,
                               T* y, int64_t r0, int64_t b0, Ahead ahead) {
  __m256 acc[R][2 * NB];
  fma_block_avx2<W, R, NB, Lead>(x + r0 * pr.k, pr.k, w + b0 * bstride, bstride, pr.k, acc,
                                 ahead);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2 * NB; ++v) {
      const int64_t c = b0 * kBlock + 8 * v;
      if (c >= pr.n) continue;
      store8_avx2(y + (r0 + r) * pr.n + c, acc[r][v], pr.bias ? pr.bias + c : nullptr,
                  static_cast<int>(std::min<int64_t>(8, pr.n - c)));
    }
}

// Rows [m0, m1) of column block b in ceil(rows / 6) tiles of as even a height as they can
// be (16 rows: 6 + 5 + 5, where 6 + 6 + 4 left the last tile 8 FMA chains: 0.94x the time
// of the 120 float32 linears at 16 rows on Zen 3, two alternating runs); each tile is one
// pass over the block's weights with independent FMA chains per row (row by row, each pass
// would wait on one chain's latency). A tile's height never changes an element's sum. The
// tiles prefetch the weights of block `next` (the one this thread takes next, -1: none) into
// L2, spread over their K loops, so DRAM streams it while this one is multiplied.
// Measured on the AVX2 host, SmolLM2's 120 float32 linears against no software prefetch:
// 4 rows 1.2x, 16 rows 1.3x, 64 rows 1.1x faster, 1 row the same (the hardware prefetcher
// keeps up there). Only where the data goes changes, never the arithmetic.
template <typename T, typename W>
AVX2_TARGET void fma_rows_avx2(const Problem& pr, const float* x, const W* w, int64_t bstride,
                               T* y, int64_t m0, int64_t m1, int64_t b, int64_t next) {
  const int64_t lines = next >= 0 ? bstride * static_cast<int64_t>(sizeof(W)) / 64 : 0;
  const int64_t rows = m1 - m0, tiles = (rows + 5) / 6, base = rows / tiles;
  AheadShares ahead(w + std::max<int64_t>(next, 0) * bstride, lines, tiles);
  int64_t r = m0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n = base + (t < rows % tiles ? 1 : 0);
    switch (n) {
      case 6: fma_tile_avx2<T, W, 6>(pr, x, w, bstride, y, r, b, ahead.take()); break;
      case 5: fma_tile_avx2<T, W, 5>(pr, x, w, bstride, y, r, b, ahead.take()); break;
      case 4: fma_tile_avx2<T, W, 4>(pr, x, w, bstride, y, r, b, ahead.take()); break;
      case 3: fma_tile_avx2<T, W, 3>(pr, x, w, bstride, y, r, b, ahead.take()); break;
      case 2: fma_tile_avx2<T, W, 2>(pr, x, w, bstride, y, r, b, ahead.take()); break;
      default: fma_tile_avx2<T, W, 1>(pr, x, w, bstride, y, r, b, ahead.take()); break;
    }
    r += n;
  }
}

// Every row of a 1- to 4-row product over blocks [b0, b1), NB blocks to a tile: 8 to 16
// accumulators, where one row over one block keeps only two FMA chains, so each k waited on
// an FMA's latency. These tiles stream their weights once, several blocks side by side,
// which the hardware prefetcher follows; a software prefetch of the next tile's weights
// slowed them. Measured on the Zen 1 AVX2 host (2 GHz, 128-bit FMA units), SmolLM2's 120
// float32 linears against one-block row tiles with the prefetch, alternating in one process,
// three runs: 1 row 0.78-0.86x the time (13.0 -> 16.6 GB/s; a float32 `sum` streams ~20
// there), 2 rows 0.69-0.92x. At 3 rows the row tiles with the prefetch stay faster (a 3 x
// 2-block tile measured 1.05x their time, 3 x 1 without the prefetch 1.13x), so 3 rows and
// more keep them, and so do bf16 weights at 2 rows (widened into even and odd halves, three
// blocks' weights beside 12 accumulators spill: 1.1x their time). The arithmetic, k by k
// into each element, is theirs: the same bits.
// On Zen 3 (256-bit FMA units) 3 and 4 float32 rows take 2-block tiles, each block's stream
// prefetched into L1 16 lines ahead of its loads: there the one-block row tiles streamed
// 13-17 GB/s at 3 and 4 rows where 1 and 2 rows stream 23-25 (a 3-row decode step took
// longer than a 4-row one), and the 3 x 2 tiles alone took 0.86x their time. With the
// prefetch, alternating runs: 3 rows 0.78-0.82x on 1 thread, 0.77-0.87x on 2 (8, 16 and 24
// lines ahead measured alike; into L2 instead, 0.82 / 0.87x); 4 rows (16 accumulators)
// 0.85-0.89x on 1 thread, 0.83-0.88x on 2. At 1 and 2 rows the same prefetch cost
// 1.03-1.07x: the hardware prefetcher keeps up with their lighter arithmetic.
// fp16 weights at 3 rows keep the row tiles (1.33x their time here: their widening beside
// 12 accumulators), as bf16 ones do, and so do 5 rows and more (tried: 2-block tiles of up
// to 4 rows, 1.04-1.07x the time at 5-8 rows and 1.5-2x at 12-16; the lead prefetch in a
// block's first 5- or 6-row tile, 1.00-1.25x).
template <typename T, typename W, int R>
AVX2_TARGET void fma_few_rows_avx2(const Problem& pr, const float* x, const W* w,
                                   int64_t bstride, T* y, int64_t b0, int64_t b1) {
  constexpr int NB = kFewRowsBlocks[R];
  constexpr int Lead = R >= 3 ? 16 : 0;
  int64_t b = b0;
  for (; b + NB <= b1; b += NB)
    fma_tile_avx2<T, W, R, NB, Lead>(pr, x, w, bstride, y, 0, b, Ahead{});
  switch (b1 - b) {
    case 3:
      if constexpr (NB > 3) fma_tile_avx2<T, W, R, 3, Lead>(pr, x, w, bstride, y, 0, b, Ahead{});
      break;
    case 2:
      if constexpr (NB > 2) fma_tile_avx2<T, W, R, 2, Lead>(pr, x, w, bstride, y, 0, b, Ahead{});
      break;
    case 1: fma_tile_avx2<T, W, R, 1, Lead>(pr, x, w, bstride, y, 0, b, Ahead{}); break;
    default: break;
  }
}

template <typename T, typename W>
AVX2_TARGET void gemm_fma_avx2(const Problem& pr, const float* x, const W* w, T* y) {
  const int64_t bstride = std::is_same_v<W, c10::BFloat16> ? ((pr.k + 31) / 32) * 32 * kBlock
                                                           : pr.k * kBlock;
  constexpr bool kBf16 = std::is_same_v<W, c10::BFloat16>, kF32 = std::is_same_v<W, float>;
  if (pr.m == 1 || (pr.m == 2 && !kBf16) || (pr.m <= 4 && kF32)) {
    const int64_t tile = kFewRowsBlocks[pr.m];
    for_stealing(pr.nblocks, run_length(pr.nblocks, tile), [&](int64_t b0, int64_t b1, bool) {
      switch (pr.m) {
        case 1: fma_few_rows_avx2<T, W, 1>(pr, x, w, bstride, y, b0, b1); break;
        case 2: fma_few_rows_avx2<T, W, 2>(pr, x, w, bstride, y, b0, b1); break;
        case 3: fma_few_rows_avx2<T, W, 3>(pr, x, w, bstride, y, b0, b1); break;
        default: fma_few_rows_avx2<T, W, 4>(pr, x, w, bstride, y, b0, b1); break;
      }
    });
    return;
  }
  for_units(pr, 1, [&](int64_t m0, int64_t m1, int64_t b0, int64_t, int64_t next) {
    fma_rows_avx2<T, W>(pr, x, w, bstride, y, m0, m1, b0, next);
  });
}

template <typename T, int R, int NB>
BF16_TARGET void dp_tile(const Problem& pr, const c10::BFloat16* x, int64_t ldx,
                         const c10::BFloat16* w, int64_t bstride, T* y, int64_t r0,
                         int64_t b0, Ahead ahead) {
  __m512 acc[R][NB];
  dp_block<R, NB>(x + r0 * ldx, ldx, w + b0 * bstride, bstride, (pr.k + 1) / 2, acc, ahead);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      const int64_t col = (b0 + j) * kBlock;
      store16_bf16(y + (r0 + r) * pr.n + col, acc[r][j], pr.bias ? pr.bias + col : nullptr,
                     static_cast<int>(std::min<int64_t>(kBlock, pr.n - col)));
    }
}

// Rows [m0, m1) of one column unit (NB blocks from b0): tiles of 8 rows, then 4, then 1.
// With two tiles or more, `next_lines` cache lines of weights from block `next` (the unit
// this thread takes next) are prefetched into L2 over them: DRAM streams that unit while
// these tiles work on this one from cache, instead of every unit's first tile waiting on
// DRAM. Only where the data goes changes, never the arithmetic.
template <typename T, int NB>
BF16_TARGET void dp_rows(const Problem& pr, const c10::BFloat16* x, int64_t ldx,
                         const c10::BFloat16* w, int64_t bstride, T* y, int64_t m0,
                         int64_t m1, int64_t b0, int64_t next, int64_t next_lines) {
  const int64_t rows = m1 - m0;
  const int64_t tiles = rows / 8 + (rows % 8) / 4 + rows % 4;
  AheadShares ahead(w + std::max<int64_t>(next, 0) * bstride, tiles > 1 ? next_lines : 0, tiles);
  int64_t r = m0;
  for (; r + 8 <= m1; r += 8) dp_tile<T, 8, NB>(pr, x, ldx, w, bstride, y, r, b0, ahead.take());
  for (; r + 4 <= m1; r += 4) dp_tile<T, 4, NB>(pr, x, ldx, w, bstride, y, r, b0, ahead.take());
  for (; r < m1; ++r) dp_tile<T, 1, NB>(pr, x, ldx, w, bstride, y, r, b0, ahead.take());
}

// Units of 3 column blocks: an 8 x 3 tile's 24 accumulators, 3 weight vectors and the
// broadcast fit the 32 vector registers.
template <typename T>
BF16_TARGET void gemm_dp(const Problem& pr, const c10::BFloat16* x, int64_t ldx,
                         const c10::BFloat16* w, T* y) {
  const int64_t bstride = ((pr.k + 31) / 32) * 32 * kBlock;
  constexpr int kUnit = 3;
  for_units(pr, kUnit, [&](int64_t m0, int64_t m1, int64_t b0, int64_t nb, int64_t next) {
    const int64_t next_blocks = next >= 0 ? std::min<int64_t>(kUnit, pr.nblocks - next) : 0;
    const int64_t lines = next_blocks * bstride * 2 / 64;  // bf16 weights, 64-byte lines
    switch (nb) {
      case 3: dp_rows<T, 3>(pr, x, ldx, w, bstride, y, m0, m1, b0, next, lines); break;
      case 2: dp_rows<T, 2>(pr, x, ldx, w, bstride, y, m0, m1, b0, next, lines); break;
      default: dp_rows<T, 1>(pr, x, ldx, w, bstride, y, m0, m1, b0, next, lines); break;
    }
  });
}

// Rows [r0, r0 + rows) of the fp32 tile buffer c (32 floats per row) into y.
template <typename T>
BF16_TARGET void amx_epilogue(const Problem& pr, const float* c, T* y, int64_t r0,
                              int rows, int64_t b0, int64_t nb) {
  for (int r = 0; r < rows; ++r)
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t col = (b0 + j) * kBlock;
      store16_bf16(y + (r0 + r) * pr.n + col, _mm512_load_ps(c + r * 32 + j * 16),
                     pr.bias ? pr.bias + col : nullptr,
                     static_cast<int>(std::min<int64_t>(kBlock, pr.n - col)));
    }
}

// One column unit (nb <= 2 blocks) over rows [m0, m1) on AMX. x: [m][kp] bf16 with
// kp % 32 == 0 (ldx = kp). Row tiles of 16, two at a time; the last, if short, is copied
// into a zero-padded tile first. The tile configuration is loaded on every call: another
// library (oneDNN) may have changed it on this thread in between.
template <typename T>
AMX_TARGET void amx_unit(const Problem& pr, const c10::BFloat16* x, int64_t ldx,
                         const c10::BFloat16* w, T* y, int64_t m0, int64_t m1,
                         int64_t b0, int64_t nb) {
  const int64_t kp = ldx, ksteps = kp / 32, bstride = kp * kBlock, lda = ldx * 2;
  const int64_t full_tiles = pr.m / 16;
  thread_local std::vector<c10::BFloat16> tail;
  alignas(64) float c[32 * 32];
  amx_configure();
  auto epilogue = [&](int64_t r0, int rows) { amx_epilogue(pr, c, y, r0, rows, b0, nb); };
  const c10::BFloat16* wb = w + b0 * bstride;
  const int64_t t1 = (m1 + 15) / 16;
  for (int64_t t = m0 / 16; t < t1;) {
    const int64_t r0 = t * 16;
    if (t + 1 < t1 && t + 1 < full_tiles) {
      if (nb == 2)
        amx_block<2, 2>(x + r0 * ldx, lda, wb, bstride, ksteps, c, 32);
      else
        amx_block<2, 1>(x + r0 * ldx, lda, wb, bstride, ksteps, c, 32);
      epilogue(r0, 32);
      t += 2;
      continue;
    }
    const int rows = static_cast<int>(std::min<int64_t>(16, pr.m - r0));
    const c10::BFloat16* a = x + r0 * ldx;
    if (rows < 16) {
      tail.assign(16 * kp, c10::BFloat16(0.f));
      std::memcpy(tail.data(), a, sizeof(c10::BFloat16) * rows * kp);
      a = tail.data();
    }
    if (nb == 2)
      amx_block<1, 2>(a, lda, wb, bstride, ksteps, c, 32);
    else
      amx_block<1, 1>(a, lda, wb, bstride, ksteps, c, 32);
    epilogue(r0, rows);
    t += 1;
  }
}

template <typename T>
void gemm_amx(const Problem& pr, const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w,
              T* y) {
  for_units(pr, 2, [&](int64_t m0, int64_t m1, int64_t b0, int64_t nb, int64_t) {
    amx_unit(pr, x, ldx, w, y, m0, m1, b0, nb);
  });
}

bool request_amx_permission() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  static const bool granted =
      syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

template <typename T, typename W>
void run_fma(const Problem& pr, int64_t isa, const torch::Tensor& x32, const W* w, T* y) {
  if (isa == kAvx2)
    gemm_fma_avx2<T, W>(pr, x32.data_ptr<float>(), w, y);
  else
    gemm_fma_avx512<T, W>(pr, x32.data_ptr<float>(), w, y);
}

}  // namespace

bool amx_supported() { return request_amx_permission(); }

// x [M, K] (float32 / bfloat16 / float16, the weight's dtype); packed: see the layouts
// above; n: output features; bias: float32 [n] or None. Returns [M, n] in x's dtype, or in
// float32 with out_float32 (the LM head: logits not rounded to 16 bits, so no false ties).
torch::Tensor invariant_gemm(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t n,
                             const c10::optional<torch::Tensor>& bias_in, int64_t isa,
                             bool out_float32) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2, "invariant_gemm: x must be a 2-D cpu tensor");
  TORCH_CHECK(x_in.scalar_type() == packed.scalar_type(),
              "invariant_gemm: x is ", x_in.scalar_type(), ", the weight ", packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(2) >= kBlock,
              "invariant_gemm: the weight is not packed");
  TORCH_CHECK(isa >= kAvx2 && isa <= kAmx, "invariant_gemm: unknown isa ", isa);
  const auto dtype = x_in.scalar_type();
  const bool bf16 = dtype == torch::kBFloat16;
  TORCH_CHECK(bf16 || isa <= kAvx512, "invariant_gemm: isa ", isa, " serves bfloat16 only");
  TORCH_CHECK(isa != kAmx || request_amx_permission(), "invariant_gemm: AMX not permitted");
  Problem pr;
  pr.m = x_in.size(0);
  pr.k = x_in.size(1);
  pr.n = n;
  pr.nblocks = packed.size(0);
  TORCH_CHECK(pr.nblocks * kBlock >= n && pr.nblocks * kBlock < n + kBlock,
              "invariant_gemm: packed for ", pr.nblocks * kBlock, " outputs, asked for ", n);
  const int64_t kp = bf16 ? ((pr.k + 31) / 32) * 32 : pr.k;
  TORCH_CHECK(packed.size(1) * packed.size(2) / kBlock == kp,
              "invariant_gemm: packed for another K than ", pr.k);
  torch::Tensor bias;
  pr.bias = nullptr;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->to(torch::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == n, "invariant_gemm: bias has ", bias.numel(), " values, not ", n);
    pr.bias = bias.data_ptr<float>();
  }
  auto y = torch::empty({pr.m, n}, x_in.options().dtype(out_float32 ? torch::kFloat : dtype));
  if (pr.m == 0) return y;
  torch::Tensor x = x_in.contiguous();
  if (isa == kAmx || isa == kAvx512Bf16) {
    // AMX walks K in steps of 32, VDPBF16PS in pairs: pad K with zeros when needed.
    const int64_t want = isa == kAmx ? kp : ((pr.k + 1) / 2) * 2;
    if (want != pr.k) x = torch::constant_pad_nd(x, {0, want - pr.k});
    const auto* xp = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
    const auto* wp = reinterpret_cast<const c10::BFloat16*>(packed.data_ptr());
    auto run = [&](auto* yp) {
      if (isa == kAmx)
        gemm_amx(pr, xp, want, wp, yp);
      else
        gemm_dp(pr, xp, want, wp, yp);
    };
    if (out_float32)
      run(y.data_ptr<float>());
    else
      run(reinterpret_cast<c10::BFloat16*>(y.data_ptr()));
    return y;
  }
  // FMA paths: activations widened to float32 once (exact), the weight widened on the fly.
  // bf16 weights come in pairs: an odd K is padded with one zero column.
  if (bf16 && pr.k % 2) x = torch::constant_pad_nd(x, {0, 1});
  const torch::Tensor x32 = x.to(torch::kFloat).contiguous();
  if (bf16 && pr.k % 2) pr.k += 1;
  // Output in the weight's dtype, or float32 (out_float32, or float32 weights).
  auto fma = [&](const auto* w) {
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(w)>>;
    if (out_float32)
      run_fma<float, W>(pr, isa, x32, w, y.data_ptr<float>());
    else
      run_fma<W, W>(pr, isa, x32, w, reinterpret_cast<W*>(y.data_ptr()));
  };
  switch (dtype) {
    case torch::kFloat: fma(packed.data_ptr<float>()); break;
    case torch::kBFloat16: fma(reinterpret_cast<const c10::BFloat16*>(packed.data_ptr())); break;
    case torch::kHalf: fma(reinterpret_cast<const c10::Half*>(packed.data_ptr())); break;
    default: TORCH_CHECK(false, "invariant_gemm: unsupported dtype ", dtype);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "pdserve batch-invariant dense layers";
  mod.def("invariant_gemm", &invariant_gemm, "y = x W^T + b, the same bits for a row in any batch",
          py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"), py::arg("isa"),
          py::arg("out_float32"),
          py::call_guard<py::gil_scoped_release>());
  mod.def("amx_supported", &amx_supported, "Whether this process may use AMX tiles");
  static_assert(std::is_same_v<decltype(&invariant_gemm), pdserve_entry::GemmFn>);
  mod.attr("invariant_gemm_entry") =
      pdserve_entry::capsule(&invariant_gemm, pdserve_entry::kGemm);
}
