// pdserve CPU paged attention, the AVX2 building blocks (included by paged_attention_simd.h
// when the build targets AVX2 + FMA + F16C without AVX-512, i.e. the `avx2` host class).
//
// The same arithmetic as the AVX-512 kernels at 8 float lanes: a key's score is one FMA chain
// per lane over the head's 8-float chunks, then a fixed transpose-and-add tree over the 8
// lanes; a value row is added into each output element with one FMA in token order. So a
// key's score never depends on how many keys one call scores (in a short group the absent
// lanes are computed from a present key and never stored), and an output element's sum never
// depends on how many query rows or columns one call carries: decode and prefill chunks agree
// bit for bit. bf16/fp16 caches are widened exactly to float32. The softmax exp (exp8) is the
// AVX-512 kernel's exp16 at half the width, the same coefficients.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

#include "exp_avx2.h"
#include "spread_prefetch.h"

namespace pdserve_attention {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

using pdserve_simd::exp8;

// A decode kernel call prefetches its head's share of the tile two ahead, spread over its
// inner steps (spread_prefetch.h).
using pdserve_prefetch::Spread;

// Lane i of the result = sum of the 8 lanes of v[i] (pairwise hadds, then the two halves).
inline __m256 sum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = [v0..v3 low-half sums | v0..v3 high-half sums], u1 the same for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The scores of one query (float, D a multiple of 8) against up to 8 keys kstride apart, as
// the lanes of the result. With rem < 8 keys, the absent lanes re-read the last key and are
// never stored: a lane's sum involves only its own key, so the present lanes' bits are those
// of a full group.
template <typename T>
inline __m256 scores8(const float* q, int D, const T* k, int64_t kstride, int rem,
                      Spread& spread) {
  int64_t off[8];
  for (int u = 0; u < 8; ++u) off[u] = (u < rem ? u : rem - 1) * kstride;
  __m256 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, load8(k + off[u] + c), acc[u]);
    spread.step();
  }
  return sum8x8(acc);
}

// The scores of NQ query vectors (float, D apart; D a multiple of 8) against 4 keys kstride
// apart, as the 4 lanes of out[q]. Each key is loaded once for all NQ queries (scores8 loads
// it once per query: against it, decode at 3 queries a group took 0.96x the float32 time at
// batch 16 and 64, 0.88x with a bf16 cache). A key's score is scores8's: one FMA chain per
// lane over the head's 8-float chunks from zero, then the same tree over its 8 lanes,
// ((0+1)+(2+3)) + ((4+5)+(6+7)), so the two kernels give the same bits. With rem < 4 keys
// the absent lanes re-read the last present key and are never stored.
template <typename T, int NQ>
inline void scores4(const float* q, int D, const T* k, int64_t kstride, int rem, Spread& spread,
                    __m128* out) {
  const T* key[4];
  for (int u = 0; u < 4; ++u) key[u] = k + (u < rem ? u : rem - 1) * kstride;
  __m256 acc[NQ][4];
  for (int j = 0; j < NQ; ++j)
    for (int u = 0; u < 4; ++u) acc[j][u] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 8) {
    __m256 qv[NQ];
    for (int j = 0; j < NQ; ++j) qv[j] = _mm256_loadu_ps(q + j * D + c);
    for (int u = 0; u < 4; ++u) {
      const __m256 kv = load8(key[u] + c);
      for (int j = 0; j < NQ; ++j) acc[j][u] = _mm256_fmadd_ps(qv[j], kv, acc[j][u]);
    }
    spread.step();
  }
  for (int j = 0; j < NQ; ++j) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(acc[j][0], acc[j][1]),
                                        _mm256_hadd_ps(acc[j][2], acc[j][3]));
    out[j] = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
  }
}

// qk_avx2 for three queries by scores4 (kept out of line: inlined, it slowed prefill's
// four-query calls 3-5%).
template <typename T>
__attribute__((noinline)) void qk3_avx2(const float* qf, int D, const T* k, int64_t kstride,
                                        int n, float* s, int64_t ld, const void* pf,
                                        int64_t pf_lines) {
  Spread spread(pf, pf_lines, static_cast<int64_t>((n + 3) / 4) * (D / 8));
  for (int t = 0; t < n; t += 4) {
    const int rem = n - t < 4 ? n - t : 4;
    __m128 out[3];
    scores4<T, 3>(qf, D, k + t * kstride, kstride, rem, spread, out);
    for (int j = 0; j < 3; ++j) {
      float* dst = s + j * ld + t;
      if (rem == 4) {
        _mm_storeu_ps(dst, out[j]);
      } else {
        alignas(16) float tmp[4];
        _mm_store_ps(tmp, out[j]);
        for (int u = 0; u < rem; ++u) dst[u] = tmp[u];
      }
    }
  }
}

// s[q * ld + t] = q_q . k_t for nq query vectors (float, D apart) and n keys kstride apart;
// `pf_lines` lines from `pf` are prefetched meanwhile (Spread). Three queries (decode's
// group at SmolLM2's 9 / 3 heads) take scores4, each key loaded once for the three; other
// counts take scores8 query by query (at prefill's groups of 4, scores4 two by two measured
// 1.05-1.15x the time). Both give a key's score the same bits.
template <typename T>
inline void qk_avx2(const float* qf, int nq, int D, const T* k, int64_t kstride, int n, float* s,
                    int64_t ld, const void* pf, int64_t pf_lines) {
  if (nq == 3) return qk3_avx2<T>(qf, D, k, kstride, n, s, ld, pf, pf_lines);
  Spread spread(pf, pf_lines, static_cast<int64_t>((n + 7) / 8) * nq * (D / 8));
  for (int t = 0; t < n; t += 8, k += 8 * kstride) {
    const int rem = n - t < 8 ? n - t : 8;
    for (int q = 0; q < nq; ++q) {
      const __m256 sums = scores8(qf + q * D, D, k, kstride, rem, spread);
      if (rem == 8) {
        _mm256_storeu_ps(s + q * ld + t, sums);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, sums);
        for (int u = 0; u < rem; ++u) s[q * ld + t + u] = tmp[u];
      }
    }
  }
}

// acc[q * D + c0 ...] += sum_t p[q][t] * v_t[c0 ...] over NC 8-float chunks from column c0,
// for NQ queries (accumulators in registers across the n tokens).
template <typename T, int NQ, int NC>
inline void pv_avx2_cols(const float* p, int64_t ld, const T* v, int64_t vstride, int n,
                         float* acc, int D, int c0, Spread& spread) {
  __m256 a[NQ][NC];
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) a[q][c] = _mm256_loadu_ps(acc + q * D + c0 + 8 * c);
  for (int t = 0; t < n; ++t, v += vstride) {
    __m256 w[NQ];
    for (int q = 0; q < NQ; ++q) w[q] = _mm256_set1_ps(p[q * ld + t]);
    for (int c = 0; c < NC; ++c) {
      const __m256 vf = load8(v + c0 + 8 * c);
      for (int q = 0; q < NQ; ++q) a[q][c] = _mm256_fmadd_ps(w[q], vf, a[q][c]);
    }
    spread.step();
  }
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + q * D + c0 + 8 * c, a[q][c]);
}

// acc[q] += sum_t p[q][t] * v_t for nq queries, D a multiple of 8: two queries by four chunks
// at a time (8 accumulators + 2 weights + 1 value: within AVX2's 16 registers); `pf_lines`
// lines from `pf` are prefetched meanwhile (Spread).
template <typename T>
inline void pv_avx2(const float* p, int64_t ld, int nq, int D, const T* v, int64_t vstride, int n,
                    float* acc, const void* pf, int64_t pf_lines) {
  const int64_t col_calls = D / 32 + (D % 32) / 8;
  Spread spread(pf, pf_lines, (nq + 1) / 2 * col_calls * n);
  for (int q0 = 0; q0 < nq; q0 += 2) {
    const float* pq = p + q0 * ld;
    float* aq = acc + q0 * D;
    int c0 = 0;
    if (nq - q0 >= 2) {
      for (; c0 + 32 <= D; c0 += 32)
        pv_avx2_cols<T, 2, 4>(pq, ld, v, vstride, n, aq, D, c0, spread);
      for (; c0 < D; c0 += 8) pv_avx2_cols<T, 2, 1>(pq, ld, v, vstride, n, aq, D, c0, spread);
    } else {
      for (; c0 + 32 <= D; c0 += 32)
        pv_avx2_cols<T, 1, 4>(pq, ld, v, vstride, n, aq, D, c0, spread);
      for (; c0 < D; c0 += 8) pv_avx2_cols<T, 1, 1>(pq, ld, v, vstride, n, aq, D, c0, spread);
    }
  }
}

}  // namespace pdserve_attention
