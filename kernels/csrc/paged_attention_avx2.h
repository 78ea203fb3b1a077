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

// The scores of NQ query vectors (float, D apart; D a multiple of 8) against 4 keys kstride
// apart, as the 4 lanes of out[q]. Each key is loaded once for all NQ queries (an earlier
// kernel scored one query against 8 keys and loaded every key once per query: 0.96x the
// float32 decode time at batch 16 and 64, 0.88x in bf16, same bits). A key's score is one
// FMA chain per lane over the head's 8-float chunks from zero, then a fixed tree over its 8
// lanes, ((0+1)+(2+3)) + ((4+5)+(6+7)), so the bits do not depend on how many keys or
// queries one call carries. With rem < 4 keys the absent lanes re-read the last present key
// and are never stored.
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

// How qk_avx2 groups nq queries: 3 at a time (12 accumulators, 3 queries and a key: AVX2's
// 16 registers), else 2, then 1; 4 as 2 + 2.
inline int query_group(int left) { return left == 3 ? 3 : left >= 2 ? 2 : 1; }

// s[q * ld + t] = q_q . k_t for nq query vectors (float, D apart) and n keys kstride apart;
// `pf_lines` lines from `pf` are prefetched meanwhile (Spread).
template <typename T>
inline void qk_avx2(const float* qf, int nq, int D, const T* k, int64_t kstride, int n, float* s,
                    int64_t ld, const void* pf, int64_t pf_lines) {
  int groups = 0;
  for (int q0 = 0; q0 < nq; q0 += query_group(nq - q0)) ++groups;
  Spread spread(pf, pf_lines, static_cast<int64_t>((n + 3) / 4) * groups * (D / 8));
  for (int q0 = 0; q0 < nq;) {
    const int g = query_group(nq - q0);
    const float* q = qf + q0 * D;
    for (int t = 0; t < n; t += 4) {
      const int rem = n - t < 4 ? n - t : 4;
      const T* kt = k + t * kstride;
      __m128 out[3];
      if (g == 3)
        scores4<T, 3>(q, D, kt, kstride, rem, spread, out);
      else if (g == 2)
        scores4<T, 2>(q, D, kt, kstride, rem, spread, out);
      else
        scores4<T, 1>(q, D, kt, kstride, rem, spread, out);
      for (int j = 0; j < g; ++j) {
        float* dst = s + (q0 + j) * ld + t;
        if (rem == 4) {
          _mm_storeu_ps(dst, out[j]);
        } else {
          alignas(16) float tmp[4];
          _mm_store_ps(tmp, out[j]);
          for (int u = 0; u < rem; ++u) dst[u] = tmp[u];
        }
      }
    }
    q0 += g;
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
