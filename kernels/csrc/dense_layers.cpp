// The decoder layers of a decode-only step on CPU in one call: for every layer, the residual
// add + RMSNorm, the qkv projection, rotary, the K/V store, paged attention, o_proj, the
// second add + RMSNorm, gate/up, SiLU-and-multiply and down, then the final norm.
//
// The model runner takes this path for decode-only batches of a dense model (see
// pdserve.kernels.dense_layers for when). It calls the same kernel functions in the same order
// with the same arguments as the per-op Python path (common/models/llama.py), through the
// entry points the kernel extensions export (entry_points.h), so every bit of the result is
// the Python path's. What it removes is the Python between the kernels: about 300 calls a
// step, each through a wrapper or two, an environment lookup and pybind11's argument
// conversion (profiled at ~5 ms of a 25 ms float32 step at batch 1).

#include <torch/extension.h>

#include <vector>

#include "entry_points.h"

namespace {

using namespace pdserve_entry;

struct Kernels {
  GemmFn gemm = nullptr;
  AttentionFn attention = nullptr;
  WriteKvFn write_kv = nullptr;
  AddRmsNormFn add_rms_norm = nullptr;
  RotaryFn rotary = nullptr;
  SiluAndMulFn silu_and_mul = nullptr;
};

Kernels& kernels() {
  static Kernels k;
  return k;
}

template <typename Fn>
Fn entry(const py::capsule& c, const char* name) {
  TORCH_CHECK(c.name() != nullptr && std::string(c.name()) == name,
              "dense_layers.bind: expected the capsule ", name);
  return reinterpret_cast<Fn>(c.get_pointer());
}

void bind(const py::capsule& gemm, const py::capsule& attention, const py::capsule& write_kv,
          const py::capsule& add_rms_norm, const py::capsule& rotary,
          const py::capsule& silu_and_mul) {
  Kernels& k = kernels();
  k.gemm = entry<GemmFn>(gemm, kGemm);
  k.attention = entry<AttentionFn>(attention, kAttention);
  k.write_kv = entry<WriteKvFn>(write_kv, kWriteKv);
  k.add_rms_norm = entry<AddRmsNormFn>(add_rms_norm, kAddRmsNorm);
  k.rotary = entry<RotaryFn>(rotary, kRotary);
  k.silu_and_mul = entry<SiluAndMulFn>(silu_and_mul, kSiluAndMul);
}

bool bound() { return kernels().gemm != nullptr; }

using Tensors = std::vector<torch::Tensor>;
using OptTensors = std::vector<c10::optional<torch::Tensor>>;

// One kind of dense layer of every decoder layer: packed weights, their float32 biases (or
// None) and the output width.
struct Dense {
  Tensors weights;
  OptTensors biases;
  int64_t n;

  torch::Tensor operator()(const Kernels& k, int64_t layer, const torch::Tensor& x,
                           int64_t isa) const {
    return k.gemm(x, weights[layer], n, biases[layer], isa, false);
  }
};

// residual: the embeddings [T, H]; positions [T] int64; slot_mapping [T] int64; block_tables
// [T, M] and seq_lens [T] int32 (one decode token per sequence). Returns the final norm's
// output [T, H].
torch::Tensor forward(torch::Tensor residual, const Tensors& input_norms, const Dense& qkv,
                      const Dense& o_proj, const Tensors& post_norms, const Dense& gate_up,
                      const Dense& down, const torch::Tensor& final_norm, int64_t isa,
                      const torch::Tensor& positions, const torch::Tensor& cos_sin,
                      const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                      const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                      double eps) {
  const Kernels& k = kernels();
  TORCH_CHECK(bound(), "dense_layers: bind() the kernels first");
  const auto layers = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(layers > 0, "dense_layers: no layers");
  for (const Dense* d : {&qkv, &o_proj, &gate_up, &down})
    TORCH_CHECK(static_cast<int64_t>(d->weights.size()) == layers &&
                    static_cast<int64_t>(d->biases.size()) == layers,
                "dense_layers: one weight and bias of each kind per layer");
  TORCH_CHECK(static_cast<int64_t>(post_norms.size()) == layers, "dense_layers: post norms");
  const int64_t tokens = residual.size(0);
  const int64_t rotated = num_heads + num_kv_heads;
  const c10::optional<torch::Tensor> none;
  residual = residual.contiguous();
  torch::Tensor hidden;
  for (int64_t l = 0; l < layers; ++l) {
    const auto x = k.add_rms_norm(l == 0 ? none : c10::optional<torch::Tensor>(hidden), residual,
                                  input_norms[l], eps);
    const auto proj = qkv(k, l, x, isa);
    k.rotary(proj, positions, cos_sin, rotated, head_dim);
    const auto heads = proj.view({tokens, -1, head_dim});
    const auto q = heads.slice(1, 0, num_heads);
    k.write_kv(kv_cache, l, heads.slice(1, num_heads, rotated),
               heads.slice(1, rotated, rotated + num_kv_heads), slot_mapping);
    const auto attn = k.attention(q, kv_cache, l, block_tables, seq_lens, none, scale);
    hidden = o_proj(k, l, attn.reshape({tokens, num_heads * head_dim}), isa);
    const auto y = k.add_rms_norm(hidden, residual, post_norms[l], eps);
    hidden = down(k, l, k.silu_and_mul(gate_up(k, l, y, isa)), isa);
  }
  return k.add_rms_norm(hidden, residual, final_norm, eps);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pdserve: a decode step's dense decoder layers in one call";
  m.def("bind", &bind, "Take the kernels' entry points (capsules) from their extensions");
  m.def("bound", &bound);
  py::class_<Dense>(m, "Dense")
      .def(py::init<Tensors, OptTensors, int64_t>(), py::arg("weights"), py::arg("biases"),
           py::arg("n"));
  m.def("forward", &forward, py::call_guard<py::gil_scoped_release>());
}
