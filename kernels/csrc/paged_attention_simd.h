// pdserve CPU paged attention, the SIMD building blocks (included by paged_attention.cpp).
//
// Scores of a few query vectors against consecutive cache rows (pass 1), the softmax, and
// the weighted sum of value rows (pass 2), for float32/bfloat16/float16 rows of head_dim =
// 16 * NC. AVX-512 widens bf16/fp16 to fp32; with AVX512-BF16 the bf16 cache is multiplied
// as bf16 pairs with fp32 accumulation (the pass-2 weights are then rounded to bf16). A build
// for AVX2 without AVX-512 takes the 8-lane kernels of paged_attention_avx2.h (head_dim a
// multiple of 8). A scalar path covers other CPUs and head sizes.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_ATTENTION_AVX2 1
#include "paged_attention_avx2.h"
#endif

namespace pdserve_attention {

// ------------------------------------------------------------------------ vector helpers
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp(x) for x <= 0 (softmax arguments), relative error ~1e-7.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// Lane i of the result = sum of the 16 lanes of v[i] (a transpose-and-add tree: ~3 ops per
// vector instead of ~8 for one _mm512_reduce_add_ps each).
inline __m512 sum16x16(const __m512* v) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k)
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    __m512d x = _mm512_castps_pd(t[2 * k]), y = _mm512_castps_pd(t[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of NQ query vectors (float, D = 16 * NC apart) against n keys kstride apart.
template <typename T, int NC, int NQ>
inline void qk_vec(const float* qf, const T* k, int64_t kstride, int n, float* s, int64_t ld) {
  constexpr int D = 16 * NC;
  int t = 0;
  for (; t + 16 <= n; t += 16, k += 16 * kstride)
    for (int q = 0; q < NQ; ++q) {
      __m512 acc[16];
      for (int u = 0; u < 16; ++u) {
        acc[u] = _mm512_mul_ps(_mm512_loadu_ps(qf + q * D), load16(k + u * kstride));
        for (int c = 1; c < NC; ++c)
          acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + q * D + 16 * c),
                                   load16(k + u * kstride + 16 * c), acc[u]);
      }
      _mm512_storeu_ps(s + q * ld + t, sum16x16(acc));
    }
  // The last < 16 keys go through the same transpose-and-add tree (absent keys as zero
  // vectors): a key's score is then the same whether it falls in a full group of 16 or in
  // the tail, i.e. whatever the number of keys this call scores (decode vs prefill chunk).
  if (t < n) {
    const int rem = n - t;
    const __mmask16 mask = static_cast<__mmask16>((1u << rem) - 1);
    for (int q = 0; q < NQ; ++q) {
      __m512 acc[16];
      for (int u = 0; u < 16; ++u) {
        if (u >= rem) {
          acc[u] = _mm512_setzero_ps();
          continue;
        }
        acc[u] = _mm512_mul_ps(_mm512_loadu_ps(qf + q * D), load16(k + u * kstride));
        for (int c = 1; c < NC; ++c)
          acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + q * D + 16 * c),
                                   load16(k + u * kstride + 16 * c), acc[u]);
      }
      _mm512_mask_storeu_ps(s + q * ld + t, mask, sum16x16(acc));
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 x bf16 products are exact in fp32; dpbf16 skips the widening of K entirely.
template <int NC, int NQ>
inline void qk_bf16(const c10::BFloat16* qr, const c10::BFloat16* k, int64_t kstride, int n,
                    float* s, int64_t ld) {
  constexpr int D = 16 * NC;
  constexpr int NP = NC / 2;
  int t = 0;
  for (; t + 16 <= n; t += 16, k += 16 * kstride)
    for (int q = 0; q < NQ; ++q) {
      __m512bh qv[NP];
      for (int c = 0; c < NP; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + q * D + 32 * c);
      __m512 acc[16];
      for (int u = 0; u < 16; ++u) {
        acc[u] = _mm512_setzero_ps();
        for (int c = 0; c < NP; ++c)
          acc[u] = _mm512_dpbf16_ps(acc[u], qv[c],
                                    (__m512bh)_mm512_loadu_si512(k + u * kstride + 32 * c));
      }
      _mm512_storeu_ps(s + q * ld + t, sum16x16(acc));
    }
  if (t < n) {  // the tail through the same tree (see qk_vec)
    const int rem = n - t;
    const __mmask16 mask = static_cast<__mmask16>((1u << rem) - 1);
    for (int q = 0; q < NQ; ++q) {
      __m512bh qv[NP];
      for (int c = 0; c < NP; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + q * D + 32 * c);
      __m512 acc[16];
      for (int u = 0; u < 16; ++u) {
        acc[u] = _mm512_setzero_ps();
        if (u >= rem) continue;
        for (int c = 0; c < NP; ++c)
          acc[u] = _mm512_dpbf16_ps(acc[u], qv[c],
                                    (__m512bh)_mm512_loadu_si512(k + u * kstride + 32 * c));
      }
      _mm512_mask_storeu_ps(s + q * ld + t, mask, sum16x16(acc));
    }
  }
}

// acc[q] += sum_t p[q][t] * v[t] with bf16 weights pb (as dpbf16 pairs of tokens). Each
// 32-dim chunk c of acc holds [unpacklo | unpackhi] order; `unpermute_bf16` restores it.
template <int NC, int NQ>
inline void pv_bf16(const c10::BFloat16* pb, int64_t ld, const c10::BFloat16* v,
                    int64_t vstride, int n, float* acc) {
  constexpr int D = 16 * NC;
  constexpr int NP = NC / 2;
  __m512 a[NQ][NC];
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) a[q][c] = _mm512_loadu_ps(acc + q * D + 16 * c);
  for (int t = 0; t < n; t += 2, v += 2 * vstride) {
    const bool pair = t + 1 < n;
    __m512i lo[NP], hi[NP];
    for (int c = 0; c < NP; ++c) {
      __m512i r0 = _mm512_loadu_si512(v + 32 * c);
      __m512i r1 = pair ? _mm512_loadu_si512(v + vstride + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(r0, r1);
      hi[c] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int q = 0; q < NQ; ++q) {
      uint32_t w;
      std::memcpy(&w, pb + q * ld + t, sizeof(w));
      if (!pair) w &= 0xffffu;
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
      for (int c = 0; c < NP; ++c) {
        a[q][2 * c] = _mm512_dpbf16_ps(a[q][2 * c], (__m512bh)lo[c], wb);
        a[q][2 * c + 1] = _mm512_dpbf16_ps(a[q][2 * c + 1], (__m512bh)hi[c], wb);
      }
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + q * D + 16 * c, a[q][c]);
}

inline void unpermute_bf16(float* acc, int n) {  // n: multiple of 32 floats
  const __m512i i0 =
      _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int e = 0; e < n; e += 32) {
    __m512 lo = _mm512_loadu_ps(acc + e), hi = _mm512_loadu_ps(acc + e + 16);
    _mm512_storeu_ps(acc + e, _mm512_permutex2var_ps(lo, i0, hi));
    _mm512_storeu_ps(acc + e + 16, _mm512_permutex2var_ps(lo, i1, hi));
  }
}

// Round-to-nearest-even float -> bf16 of 32 values.
inline void to_bf16_32(const float* src, c10::BFloat16* dst) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16),
                                                         _mm512_loadu_ps(src)));
}
#endif

// acc[q] += sum_t p[q][t] * v[t] for NQ queries (float accumulators, D = 16 * NC apart).
template <typename T, int NC, int NQ>
inline void pv_vec(const float* p, int64_t ld, const T* v, int64_t vstride, int n, float* acc) {
  constexpr int D = 16 * NC;
  __m512 a[NQ][NC];
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) a[q][c] = _mm512_loadu_ps(acc + q * D + 16 * c);
  for (int t = 0; t < n; ++t, v += vstride) {
    __m512 vf[NC];
    for (int c = 0; c < NC; ++c) vf[c] = load16(v + 16 * c);
    for (int q = 0; q < NQ; ++q) {
      __m512 w = _mm512_set1_ps(p[q * ld + t]);
      for (int c = 0; c < NC; ++c) a[q][c] = _mm512_fmadd_ps(w, vf[c], a[q][c]);
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + q * D + 16 * c, a[q][c]);
}

inline void store16(float* d, __m512 x) { _mm512_storeu_ps(d, x); }
inline void store16(c10::Half* d, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
inline void store16(c10::BFloat16* d, __m512 x) {  // round to nearest even
  __m512i b = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(d),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
}
#endif  // __AVX512F__

// ------------------------------------------------------------------------ scalar fallback
template <typename T>
void qk_scalar(const float* qf, int nq, int D, const T* k, int64_t kstride, int n, float* s,
               int64_t ld) {
  for (int t = 0; t < n; ++t, k += kstride)
    for (int q = 0; q < nq; ++q) {
      float acc = 0.f;
      for (int d = 0; d < D; ++d) acc += qf[q * D + d] * static_cast<float>(k[d]);
      s[q * ld + t] = acc;
    }
}

template <typename T>
void pv_scalar(const float* p, int64_t ld, int nq, int D, const T* v, int64_t vstride, int n,
               float* acc) {
  for (int t = 0; t < n; ++t, v += vstride)
    for (int q = 0; q < nq; ++q) {
      const float w = p[q * ld + t];
      for (int d = 0; d < D; ++d) acc[q * D + d] += w * static_cast<float>(v[d]);
    }
}

// Turns s[0, len) into exp(scale * (s - max)) and zeroes s[len, end); returns 1 / sum (and
// the max in *max_out if given).
inline float softmax_row(float* s, int len, int end, float scale, float* max_out = nullptr) {
  int j = 0;
  float m = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; j + 16 <= len; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + j));
  m = _mm512_reduce_max_ps(vm);
#endif
#if defined(PDSERVE_ATTENTION_AVX2)
  alignas(32) float lanes[8];
  if (len >= 8) {
    __m256 vm = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= len; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
    _mm256_store_ps(lanes, vm);
    for (float x : lanes) m = std::max(m, x);
  }
#endif
  for (; j < len; ++j) m = std::max(m, s[j]);
  j = 0;
#if defined(__AVX512F__)
  const __m512 vsc = _mm512_set1_ps(scale), vmax = _mm512_set1_ps(m);
  __m512 vs = _mm512_setzero_ps();
  for (; j + 16 <= len; j += 16) {
    __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmax), vsc));
    _mm512_storeu_ps(s + j, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#elif defined(PDSERVE_ATTENTION_AVX2)
  const __m256 vsc = _mm256_set1_ps(scale), vmax = _mm256_set1_ps(m);
  __m256 vs = _mm256_setzero_ps();
  for (; j + 8 <= len; j += 8) {
    const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmax), vsc));
    _mm256_storeu_ps(s + j, e);
    vs = _mm256_add_ps(vs, e);
  }
  _mm256_store_ps(lanes, vs);
  for (float x : lanes) sum += x;  // in lane order: the same bits for the same row
#endif
  for (; j < len; ++j) {
    s[j] = std::exp((s[j] - m) * scale);
    sum += s[j];
  }
  std::fill(s + len, s + end, 0.f);
  if (max_out) *max_out = m;
  return 1.f / sum;
}

template <int N>
using Int = std::integral_constant<int, N>;

// Calls f(Int<nq>{}) for nq in 1..4 (compile-time query counts keep accumulators in registers).
template <typename F>
inline void with_nq(int nq, F&& f) {
  switch (nq) {
    case 4: f(Int<4>{}); break;
    case 3: f(Int<3>{}); break;
    case 2: f(Int<2>{}); break;
    default: f(Int<1>{});
  }
}

// Calls f(Int<nc>{}) for the head sizes with a vector kernel (nc = head_dim / 16).
template <typename F>
inline void with_nc(int nc, F&& f) {
  switch (nc) {
    case 2: f(Int<2>{}); break;
    case 4: f(Int<4>{}); break;
    case 6: f(Int<6>{}); break;
    case 8: f(Int<8>{}); break;
    default: f(Int<16>{});
  }
}

// The kernels for one dtype and head size, chosen once per call.
template <typename T>
struct Kernels {
  int nc = 0;             // head_dim / 16 on the AVX-512 path, 0 for the scalar path
  bool bf16_dot = false;  // bf16 with AVX512-BF16: dot products on raw bf16 in both passes
  bool avx2 = false;      // the 8-lane kernels (an AVX2 build, head_dim a multiple of 8)

#if defined(__AVX512BF16__)
  static constexpr bool kDot = std::is_same_v<T, c10::BFloat16>;
#else
  static constexpr bool kDot = false;
#endif

  explicit Kernels(int64_t head_dim) {
#if defined(__AVX512F__)
    const int64_t c = head_dim / 16;
    if (head_dim % 16 == 0 && (c == 2 || c == 4 || c == 6 || c == 8 || c == 16))
      nc = static_cast<int>(c);
    bf16_dot = kDot && nc > 0;
#elif defined(PDSERVE_ATTENTION_AVX2)
    avx2 = head_dim % 8 == 0;
#else
    (void)head_dim;
#endif
  }

  // s[q * ld + t] = q_q . k_t for nq <= 4 queries and n keys ks elements apart. The AVX2
  // kernels also prefetch `pf_lines` lines from `pf` into L2, spread over their work (the
  // others ignore them: their callers prefetch).
  void qk(const float* qf, const T* qraw, int nq, int D, const T* k, int64_t ks, int n, float* s,
          int64_t ld, const void* pf = nullptr, int64_t pf_lines = 0) const {
#if defined(__AVX512F__)
    if (nc > 0) {
      with_nc(nc, [&](auto nc_) {
        with_nq(nq, [&](auto nq_) {
          constexpr int NC = decltype(nc_)::value, NQ = decltype(nq_)::value;
#if defined(__AVX512BF16__)
          if constexpr (kDot && NC % 2 == 0)
            if (bf16_dot) return qk_bf16<NC, NQ>(qraw, k, ks, n, s, ld);
#endif
          qk_vec<T, NC, NQ>(qf, k, ks, n, s, ld);
        });
      });
      return;
    }
#elif defined(PDSERVE_ATTENTION_AVX2)
    if (avx2) return qk_avx2<T>(qf, nq, D, k, ks, n, s, ld, pf, pf_lines);
#endif
    (void)qraw, (void)pf, (void)pf_lines;
    qk_scalar<T>(qf, nq, D, k, ks, n, s, ld);
  }

  // acc[q] += sum_t p[q][t] * v_t (pb: the same weights in bf16, used when bf16_dot);
  // `pf`, `pf_lines` as for qk.
  void pv(const float* p, const T* pb, int64_t ld, int nq, int D, const T* v, int64_t vs, int n,
          float* acc, const void* pf = nullptr, int64_t pf_lines = 0) const {
#if defined(__AVX512F__)
    if (nc > 0) {
      with_nc(nc, [&](auto nc_) {
        constexpr int NC = decltype(nc_)::value;
        constexpr int QG = NC <= 4 ? 4 : NC <= 6 ? 3 : NC <= 8 ? 2 : 1;  // fit 32 registers
        for (int q0 = 0; q0 < nq; q0 += QG) {
          with_nq(std::min(QG, nq - q0), [&](auto nq_) {
            constexpr int NQ = decltype(nq_)::value;
            if constexpr (NQ <= QG) {
#if defined(__AVX512BF16__)
              if constexpr (kDot && NC % 2 == 0)
                if (bf16_dot) return pv_bf16<NC, NQ>(pb + q0 * ld, ld, v, vs, n, acc + q0 * D);
#endif
              pv_vec<T, NC, NQ>(p + q0 * ld, ld, v, vs, n, acc + q0 * D);
            }
          });
        }
      });
      return;
    }
#elif defined(PDSERVE_ATTENTION_AVX2)
    if (avx2) return pv_avx2<T>(p, ld, nq, D, v, vs, n, acc, pf, pf_lines);
#endif
    (void)pb, (void)pf, (void)pf_lines;
    pv_scalar<T>(p, ld, nq, D, v, vs, n, acc);
  }
};

}  // namespace pdserve_attention
