// pdserve CPU fused per-token ops. Rotary embedding: one in-place pass over q and k instead
// of the slice/negate/concatenate/multiply/add passes the torch formulation takes (measured
// ~45x faster for a 2048-token chunk). RMSNorm and SiLU-and-multiply stay on torch's own
// vectorised kernels, which measured faster than plain loops here (exp is not vectorised).
#include <ATen/Parallel.h>
#include <torch/extension.h>


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
  if (positions.numel() > 0) {
    const int64_t max_pos = positions.max().item<int64_t>();
    TORCH_CHECK(positions.min().item<int64_t>() >= 0 && max_pos < cos_sin.size(0),
                "positions outside the rotary table");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_", [&] {
    rotary_impl<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.size(1), positions.data_ptr<int64_t>(),
                          cos_sin.data_ptr<float>(), qkv.size(0), heads, head_dim);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_", &rotary_, py::call_guard<py::gil_scoped_release>());
}
