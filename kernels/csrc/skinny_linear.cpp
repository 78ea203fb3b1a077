// y = x W^T + b for decode-sized batches (a few rows) in float32 on CPU.
//
// A decode step multiplies a handful of token rows by every weight matrix: the work is
// reading the weights, not the arithmetic. A general GEMM library tunes for big M and reads
// here at a fraction of the memory bandwidth. This kernel reads each weight row once (into
// L1), takes its dot products with the input rows there four at a time, and splits the
// weight rows over the OpenMP threads. Each output element is one dot product in a fixed order, so a row's result
// does not depend on how many other rows are in the batch.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// Dot products of one weight row with four input rows. Every row is accumulated the same
// way (one 8-lane accumulator over k, a fixed horizontal sum, then the scalar tail), so a
// row's result does not depend on which slot of which group it was computed in.
inline void dot4(const float* const* x, const float* w, int64_t k, float* out) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    const __m256 wv = _mm256_loadu_ps(w + i);
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x[0] + i), wv, s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x[1] + i), wv, s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(x[2] + i), wv, s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(x[3] + i), wv, s3);
  }
  const __m256 sums[4] = {s0, s1, s2, s3};
  for (int r = 0; r < 4; ++r) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(sums[r]), _mm256_extractf128_ps(sums[r], 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    out[r] = _mm_cvtss_f32(h);
  }
#else
  for (int r = 0; r < 4; ++r) out[r] = 0.f;
#endif
  for (int r = 0; r < 4; ++r) {
    float t = out[r];
    for (int64_t q = i; q < k; ++q) t += x[r][q] * w[q];
    out[r] = t;
  }
}

}  // namespace

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& w,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "skinny_linear: x and w must be 2-D");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat,
              "skinny_linear: float32 only");
  TORCH_CHECK(x.size(1) == w.size(1), "skinny_linear: x has ", x.size(1),
              " columns, w has ", w.size(1));
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = wc.size(0);
  auto y = torch::empty({m, n}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == torch::kFloat && bc.numel() == n,
                "skinny_linear: bias must be float32 of size ", n);
    bp = bc.data_ptr<float>();
  }
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    const float* wr = wp + j * k;
    const float b = bp ? bp[j] : 0.f;
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
      const float* rows[4];
      for (int q = 0; q < 4; ++q) rows[q] = xp + std::min(r0 + q, m - 1) * k;  // pad: repeat
      float out[4];
      dot4(rows, wr, k, out);
      for (int64_t q = 0; q < 4 && r0 + q < m; ++q) yp[(r0 + q) * n + j] = out[q] + b;
    }
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("skinny_linear", &skinny_linear, py::call_guard<py::gil_scoped_release>());
}
