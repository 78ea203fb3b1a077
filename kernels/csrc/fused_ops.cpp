// pdserve CPU fused element-wise ops: the per-token work between the matmuls of every layer
// (residual add + RMSNorm, rotary embedding, SiLU-and-multiply), one pass over memory each
// instead of the 3-7 passes the equivalent torch ops take. Arithmetic in float32, rounding
// to the tensor's dtype where the reference model rounds.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>

namespace {

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

// residual <- x + residual (rounded to T); out <- weight * T(residual * rsqrt(mean(residual^2) + eps)).
// With add == false, residual is only read (the first layer's input norm).
template <typename T>
void add_rms_norm_impl(const T* x, T* residual, const T* weight, T* out, int64_t rows,
                       int64_t hidden, double eps, bool add) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(hidden);
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * hidden;
      float sumsq = 0.f;
      if (add) {
        const T* xr = x + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          const T v = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(res[i]));
          res[i] = v;
          buf[i] = static_cast<float>(v);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) buf[i] = static_cast<float>(res[i]);
      }
      for (int64_t i = 0; i < hidden; ++i) sumsq += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(hidden) + static_cast<float>(eps));
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        o[i] = round_to<T>(static_cast<float>(weight[i]) *
                           static_cast<float>(round_to<T>(buf[i] * inv)));
    }
  });
}

// out[t, i] = silu(x[t, i]) * x[t, inter + i], x = [T, 2 * inter].
template <typename T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = static_cast<float>(g[i]);
        o[i] = round_to<T>(gv / (1.f + std::exp(-gv)) * static_cast<float>(u[i]));
      }
    }
  });
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

// residual [T, H] is updated in place (+= x unless x is None); returns the normed [T, H].
torch::Tensor add_rms_norm(const c10::optional<torch::Tensor>& x, torch::Tensor residual,
                           const torch::Tensor& weight, double eps) {
  check_cpu_contiguous(residual, "residual");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(residual.dim() == 2 && weight.numel() == residual.size(1), "shape mismatch");
  if (x) {
    check_cpu_contiguous(*x, "x");
    TORCH_CHECK(x->sizes() == residual.sizes() && x->dtype() == residual.dtype(), "x/residual");
  }
  auto out = torch::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(x ? x->data_ptr<scalar_t>() : nullptr, residual.data_ptr<scalar_t>(),
                                weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                residual.size(0), residual.size(1), eps, x.has_value());
  });
  return out;
}

torch::Tensor silu_and_mul(const torch::Tensor& x) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 * intermediate]");
  const int64_t inter = x.size(1) / 2;
  auto out = torch::empty({x.size(0), inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), inter);
  });
  return out;
}

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
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &rotary_, py::call_guard<py::gil_scoped_release>());
}
