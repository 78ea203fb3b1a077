// pdserve CPU fused per-token ops, called for every layer of every step.
// - Rotary embedding: one in-place pass over q and k instead of the slice/negate/concatenate/
//   multiply/add passes of the torch formulation (measured ~45x faster for 2048 tokens). In
//   float32 its bits are torch's: both products are rounded before the add (this extension
//   is built with -ffp-contract=off, so the compiler never fuses them).
// - Residual add + RMSNorm: one pass instead of five torch ops, with the reference model's
//   rounding. float32 (AVX2 + FMA, every host class): the sum of squares is one FMA chain
//   per lane of 8, the lanes added in a fixed order, so a row's bits are the same on every
//   host, where torch's own reduction changes with the vector width ATen dispatches to.
//   bfloat16 (AVX-512 BF16 builds): the sum rounded to bf16, the normalised value rounded
//   before the weight.
// - SiLU-and-multiply: one pass over [gate | up] instead of torch's silu over a strided half
//   into a new tensor and an in-place multiply, with torch's two roundings (silu rounded, then
//   the product). Its exp is the attention kernels' polynomial, not torch's, so an element
//   can differ from torch's by an ulp or so; it is elementwise, so no bit depends on the batch.
// - GELU(tanh)-and-multiply (Gemma's MLP), with torch's two roundings (the GELU, then the
//   product). torch's own kernel takes a vector tanh for most elements and the scalar one
//   for a call's tail and near its thread splits, whose places depend on the batch; here
//   every element takes the same lane-wise code (tanh from the exp8 polynomial, a row's
//   tail padded to a full vector), so no bit depends on the batch. Without AVX2 + FMA: libm's
//   tanh for every element.
// - Greedy argmax over float32 logits rows (the sampler's common case): torch's argmax walks a
//   row one element at a time (~30 us for SmolLM2's 49152-token vocabulary, ~0.5 ms a step at
//   batch 16); this one compares 32 at a time and gives torch's answer (first index on ties,
//   the first NaN where there is one).
// float32 ops are compiled for AVX2 + FMA by target attribute (called only where the CPU has
// both); the bf16 ops are built only where AVX-512 BF16 exists; elsewhere the torch path serves.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>

#include "entry_points.h"
#include "exp_avx2.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "paged_attention_simd.h"  // exp16
#define PDSERVE_FAST_BF16 1
#else
#define PDSERVE_FAST_BF16 0
#endif


namespace {

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

// Rotate-half RoPE in place on the first `heads` heads of each row of qkv [T, row_stride]:
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over the two halves of each head.
template <typename T>
void rotary_impl(T* qkv, int64_t row_stride, const int64_t* positions, const float* cos_sin,
                 int64_t rows, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* cs = cos_sin + positions[r] * 2 * head_dim;
      const float* c = cs;
      const float* s = cs + head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + r * row_stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]);
          const float x2 = static_cast<float>(x[i + half]);
          x[i] = round_to<T>(x1 * c[i] - x2 * s[i]);
          x[i + half] = round_to<T>(x2 * c[i + half] + x1 * s[i + half]);
        }
      }
    }
  });
}

// ------------------------------------------------------------------ float32 (AVX2 + FMA)
#define F32_TARGET __attribute__((target("avx2,fma")))

// The 8 lanes summed in a fixed order: (0+4) + (2+6), (1+5) + (3+7), then those two.
F32_TARGET inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One row: res <- x + res (if x); out <- (res * 1/sqrt(sum(res^2) / hidden + eps)) * w.
// hidden is a multiple of 8.
F32_TARGET void add_rms_norm_row_f32(const float* x, float* res, const float* w, float* out,
                                     int64_t hidden, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 8) {
    __m256 v = _mm256_loadu_ps(res + i);
    if (x) {
      v = _mm256_add_ps(_mm256_loadu_ps(x + i), v);
      _mm256_storeu_ps(res + i, v);
    }
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float inv = 1.f / std::sqrt(sum8(acc) / static_cast<float>(hidden) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < hidden; i += 8) {
    const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(res + i), vinv);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(normed, _mm256_loadu_ps(w + i)));
  }
}

// One row: out <- silu(gate) * up over `inter` values (a multiple of 8); silu as the bf16
// kernel computes it (below).
F32_TARGET void silu_and_mul_row_f32(const float* gate, const float* up, float* out,
                                     int64_t inter) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t i = 0; i < inter; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = pdserve_simd::exp8(_mm256_sub_ps(zero, _mm256_and_ps(g, abs_mask)));
    const __m256 neg = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
    const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg);
    const __m256 silu = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
}

// The index of the row's largest value: the first on ties, and the first NaN's where the row
// has one (torch.argmax's answer on CPU). Four independent compare-and-blend chains of 8
// lanes, each keeping its first maximum, then the largest value's smallest index among them.
F32_TARGET int64_t argmax_row_f32(const float* x, int64_t n) {
  constexpr int kChains = 4;
  int64_t i = 0, best_at = 0;
  float best_v = x[0];
  bool nan = false;
  if (n >= 8 * kChains) {
    __m256 best[kChains], seen_nan = _mm256_setzero_ps();
    __m256i at[kChains], idx[kChains];
    const __m256i step = _mm256_set1_epi32(8 * kChains);
    for (int c = 0; c < kChains; ++c) {
      idx[c] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                _mm256_set1_epi32(8 * c));
      at[c] = idx[c];
      best[c] = _mm256_loadu_ps(x + 8 * c);
      seen_nan = _mm256_or_ps(seen_nan, _mm256_cmp_ps(best[c], best[c], _CMP_UNORD_Q));
    }
    for (i = 8 * kChains; i + 8 * kChains <= n; i += 8 * kChains) {
      for (int c = 0; c < kChains; ++c) {
        idx[c] = _mm256_add_epi32(idx[c], step);
        const __m256 v = _mm256_loadu_ps(x + i + 8 * c);
        const __m256 gt = _mm256_cmp_ps(v, best[c], _CMP_GT_OQ);
        best[c] = _mm256_blendv_ps(best[c], v, gt);
        at[c] = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(at[c]), _mm256_castsi256_ps(idx[c]), gt));
        seen_nan = _mm256_or_ps(seen_nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
    }
    nan = !_mm256_testz_ps(seen_nan, seen_nan);
    alignas(32) float vals[8 * kChains];
    alignas(32) int32_t ats[8 * kChains];
    for (int c = 0; c < kChains; ++c) {
      _mm256_store_ps(vals + 8 * c, best[c]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(ats + 8 * c), at[c]);
    }
    best_v = vals[0];
    best_at = ats[0];
    for (int l = 1; l < 8 * kChains; ++l)
      if (vals[l] > best_v || (vals[l] == best_v && ats[l] < best_at)) {
        best_v = vals[l];
        best_at = ats[l];
      }
  }
  for (; i < n; ++i) {  // the tail (or a short row): later indices win only when larger
    nan = nan || std::isnan(x[i]);
    if (x[i] > best_v) {
      best_v = x[i];
      best_at = i;
    }
  }
  if (nan)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  return best_at;
}

bool cpu_has_avx2_fma() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#if PDSERVE_FAST_BF16
inline __m512 load_bf16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m256i to_bf16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
inline __m512 from_bf16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// residual <- bf16(x + residual) (if x); out <- bf16(w * bf16(residual * rsqrt(mean(r^2) + eps))).
void add_rms_norm_bf16(const c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* w,
                       c10::BFloat16* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      c10::BFloat16* res = residual + r * hidden;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < hidden; i += 16) {
        __m512 v = load_bf16(res + i);
        if (x) {
          const __m256i sum = to_bf16(_mm512_add_ps(v, load_bf16(x + r * hidden + i)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(res + i), sum);
          v = from_bf16(sum);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / hidden + eps);
      const __m512 vinv = _mm512_set1_ps(inv);
      c10::BFloat16* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; i += 16) {
        const __m512 normed = from_bf16(to_bf16(_mm512_mul_ps(load_bf16(res + i), vinv)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                            to_bf16(_mm512_mul_ps(normed, load_bf16(w + i))));
      }
    }
  });
}

// out[r] <- bf16(bf16(silu(gate)) * up) for x[r] = [gate | up], `inter` values each (a
// multiple of 16). silu(g) = g / (1 + e^-g), computed from e = e^-|g| <= 1 (no overflow):
// g / (1 + e) for g >= 0, g e / (1 + e) below.
void silu_and_mul_bf16(const c10::BFloat16* x, c10::BFloat16* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* gate = x + r * 2 * inter;
      const c10::BFloat16* up = gate + inter;
      c10::BFloat16* o = out + r * inter;
      for (int64_t i = 0; i < inter; i += 16) {
        const __m512 g = load_bf16(gate + i);
        const __m512 e = pdserve_attention::exp16(_mm512_sub_ps(_mm512_setzero_ps(),
                                                                _mm512_abs_ps(g)));
        const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
        const __m512 silu = from_bf16(to_bf16(_mm512_div_ps(num, _mm512_add_ps(one, e))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                            to_bf16(_mm512_mul_ps(silu, load_bf16(up + i))));
      }
    }
  });
}
#endif

void check_cpu_contiguous(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// qkv [T, row] contiguous; rotates heads [0, heads) of head_dim each; cos_sin [P, 2, head_dim]
// float32; positions [T] int64 < P.
void rotary_(torch::Tensor qkv, const torch::Tensor& positions, const torch::Tensor& cos_sin,
             int64_t heads, int64_t head_dim) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(positions, "positions");
  check_cpu_contiguous(cos_sin, "cos_sin");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.size(2) == head_dim, "cos_sin");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == qkv.size(0), "positions");
  TORCH_CHECK(heads * head_dim <= qkv.size(1) && head_dim % 2 == 0, "heads");
  // A plain loop: two torch reductions here cost more than the rotation itself at decode.
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "position ", pos[t],
                " outside the rotary table of ", cos_sin.size(0));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_", [&] {
    rotary_impl<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.size(1), positions.data_ptr<int64_t>(),
                          cos_sin.data_ptr<float>(), qkv.size(0), heads, head_dim);
  });
}

// residual [T, H] float32 or bf16 is updated in place (+= x unless x is None); returns the
// normed [T, H]. H must be a multiple of 8 (float32) or 16 (bf16).
torch::Tensor add_rms_norm(const c10::optional<torch::Tensor>& x, torch::Tensor residual,
                           const torch::Tensor& weight, double eps) {
  check_cpu_contiguous(residual, "residual");
  check_cpu_contiguous(weight, "weight");
  const auto dtype = residual.scalar_type();
  TORCH_CHECK(weight.scalar_type() == dtype && residual.dim() == 2 &&
                  weight.numel() == residual.size(1), "add_rms_norm: shapes and dtypes");
  if (x) {
    check_cpu_contiguous(*x, "x");
    TORCH_CHECK(x->sizes() == residual.sizes() && x->scalar_type() == dtype, "x");
  }
  auto out = torch::empty_like(residual);
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  const float feps = static_cast<float>(eps);
  if (dtype == at::kFloat) {
    TORCH_CHECK(cpu_has_avx2_fma() && hidden % 8 == 0,
                "add_rms_norm: float32 needs AVX2+FMA, H % 8 == 0");
    const float* xp = x ? x->data_ptr<float>() : nullptr;
    float* res = residual.data_ptr<float>();
    const float* w = weight.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        add_rms_norm_row_f32(xp ? xp + r * hidden : nullptr, res + r * hidden, w,
                             o + r * hidden, hidden, feps);
    });
    return out;
  }
#if PDSERVE_FAST_BF16
  TORCH_CHECK(dtype == at::kBFloat16 && hidden % 16 == 0, "add_rms_norm: bfloat16, H % 16 == 0");
  add_rms_norm_bf16(x ? x->data_ptr<c10::BFloat16>() : nullptr,
                    residual.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                    out.data_ptr<c10::BFloat16>(), rows, hidden, feps);
  return out;
#else
  TORCH_CHECK(false, "add_rms_norm: float32 only (built without AVX-512 BF16)");
#endif
}

// x [T, 2I] float32 or bf16 ([gate | up] per row; I a multiple of 8 for float32, 16 for
// bf16); returns [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: [T, 2I]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({rows, inter}, x.options());
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(cpu_has_avx2_fma() && inter % 8 == 0,
                "silu_and_mul: float32 needs AVX2+FMA, I % 8 == 0");
    const float* in = x.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_and_mul_row_f32(in + r * 2 * inter, in + r * 2 * inter + inter, o + r * inter, inter);
    });
    return out;
  }
#if PDSERVE_FAST_BF16
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && inter % 16 == 0,
              "silu_and_mul: bfloat16, I % 16 == 0");
  silu_and_mul_bf16(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, inter);
  return out;
#else
  TORCH_CHECK(false, "silu_and_mul: float32 only (built without AVX-512 BF16)");
#endif
}

constexpr float kGeluBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
constexpr float kGeluKappa = 0.044715f;

// 8 lanes of 0.5 g (1 + tanh(b (g + k g^3))), tanh(z) = sign(z) (1 - e) / (1 + e) with
// e = exp(-2 |z|) <= 1 (no overflow; for small z the cancellation is harmless next to 1).
F32_TARGET inline __m256 gelu_tanh8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 inner = _mm256_mul_ps(
      _mm256_set1_ps(kGeluBeta), _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(kGeluKappa), cube)));
  const __m256 e = pdserve_simd::exp8(_mm256_mul_ps(_mm256_set1_ps(-2.f), _mm256_andnot_ps(sign, inner)));
  const __m256 t = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)),
                                _mm256_and_ps(sign, inner));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
}

// One row of `inter` values, 8 at a time through float buffers (the tail zero-padded).
template <typename T>
F32_TARGET void gelu_tanh_and_mul_row(const T* gate, const T* up, T* o, int64_t inter) {
  alignas(32) float g[8], u[8], y[8];
  for (int64_t i = 0; i < inter; i += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, inter - i));
    for (int j = 0; j < 8; ++j) {
      g[j] = j < n ? static_cast<float>(gate[i + j]) : 0.f;
      u[j] = j < n ? static_cast<float>(up[i + j]) : 0.f;
    }
    _mm256_store_ps(y, gelu_tanh8(_mm256_load_ps(g)));
    for (int j = 0; j < n; ++j) {
      const float act = static_cast<float>(round_to<T>(y[j]));
      o[i + j] = round_to<T>(act * u[j]);
    }
  }
}

// out[r] <- round(round(gelu_tanh(gate)) * up) for x[r] = [gate | up], in x's dtype.
template <typename T>
void gelu_tanh_and_mul_impl(const T* x, T* out, int64_t rows, int64_t inter) {
  const bool vec = cpu_has_avx2_fma();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * inter;
      const T* up = gate + inter;
      T* o = out + r * inter;
      if (vec) {
        gelu_tanh_and_mul_row(gate, up, o, inter);
        continue;
      }
      for (int64_t i = 0; i < inter; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float cube = g * g * g;
        const float inner = kGeluBeta * (g + kGeluKappa * cube);
        const T act = round_to<T>(0.5f * g * (1.f + std::tanh(inner)));
        o[i] = round_to<T>(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

// x [T, 2I] (gate then up) -> [T, I].
torch::Tensor gelu_tanh_and_mul(const torch::Tensor& x) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "gelu_tanh_and_mul: [T, 2I]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({rows, inter}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat:
      gelu_tanh_and_mul_impl(x.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
      break;
    case at::kBFloat16:
      gelu_tanh_and_mul_impl(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows,
                             inter);
      break;
    case at::kHalf:
      gelu_tanh_and_mul_impl(x.data_ptr<c10::Half>(), out.data_ptr<c10::Half>(), rows, inter);
      break;
    default:
      TORCH_CHECK(false, "gelu_tanh_and_mul: float32, bfloat16 or float16");
  }
  return out;
}

// logits [N, V] float32 -> int64 [N]: each row's argmax (argmax_row_f32), a row per thread.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  check_cpu_contiguous(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t{1} << 31),
              "argmax_rows: float32 [N, V] with 0 < V < 2^31");
  TORCH_CHECK(cpu_has_avx2_fma(), "argmax_rows: needs AVX2+FMA");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row_f32(x + r * vocab, vocab);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("fast_bf16") = py::bool_(PDSERVE_FAST_BF16);  // add_rms_norm, silu_and_mul in bf16
  m.attr("fast_f32") = py::bool_(cpu_has_avx2_fma());   // ... and in float32
  m.def("silu_and_mul", &silu_and_mul, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &rotary_, py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, py::call_guard<py::gil_scoped_release>());
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, py::call_guard<py::gil_scoped_release>());
  static_assert(std::is_same_v<decltype(&add_rms_norm), pdserve_entry::AddRmsNormFn>);
  static_assert(std::is_same_v<decltype(&rotary_), pdserve_entry::RotaryFn>);
  static_assert(std::is_same_v<decltype(&silu_and_mul), pdserve_entry::SiluAndMulFn>);
  m.attr("add_rms_norm_entry") =
      pdserve_entry::capsule(&add_rms_norm, pdserve_entry::kAddRmsNorm);
  m.attr("rotary_entry") = pdserve_entry::capsule(&rotary_, pdserve_entry::kRotary);
  m.attr("silu_and_mul_entry") =
      pdserve_entry::capsule(&silu_and_mul, pdserve_entry::kSiluAndMul);
}
