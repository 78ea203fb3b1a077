// The kernels' C++ entry points, as one extension hands them to another (a PyCapsule per
// function, named below). The dense-layer loop (dense_layers.cpp) calls the very functions
// the Python path calls, compiled once with their own flags: so the loop's bits are the
// Python path's bits by construction. Each kernel source static_asserts its function against
// the type here, so a changed signature fails to compile instead of being called wrongly.
#pragma once

#include <torch/extension.h>

namespace pdserve_entry {

// invariant_gemm.cpp: y = x W^T + b (x, packed, n, bias, isa, out_float32).
using GemmFn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t,
                                 const c10::optional<torch::Tensor>&, int64_t, bool);
// paged_attention.cpp (query, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale).
using AttentionFn = torch::Tensor (*)(torch::Tensor, const torch::Tensor&, int64_t, torch::Tensor,
                                      torch::Tensor, c10::optional<torch::Tensor>, double);
// paged_attention.cpp (kv_cache, layer, key, value, slot_mapping).
using WriteKvFn = void (*)(torch::Tensor, int64_t, torch::Tensor, torch::Tensor, torch::Tensor);
// fused_ops.cpp (x or None, residual updated in place, weight, eps) -> normed.
using AddRmsNormFn = torch::Tensor (*)(const c10::optional<torch::Tensor>&, torch::Tensor,
                                       const torch::Tensor&, double);
// fused_ops.cpp (qkv rotated in place, positions, cos_sin, heads, head_dim).
using RotaryFn = void (*)(torch::Tensor, const torch::Tensor&, const torch::Tensor&, int64_t,
                          int64_t);
// fused_ops.cpp [T, 2I] -> [T, I].
using SiluAndMulFn = torch::Tensor (*)(const torch::Tensor&);

inline constexpr const char* kGemm = "pdserve.invariant_gemm";
inline constexpr const char* kAttention = "pdserve.paged_attention";
inline constexpr const char* kWriteKv = "pdserve.write_kv";
inline constexpr const char* kAddRmsNorm = "pdserve.add_rms_norm";
inline constexpr const char* kRotary = "pdserve.rotary_";
inline constexpr const char* kSiluAndMul = "pdserve.silu_and_mul";

// The capsule a module exports for `fn` (attribute "<name>_entry").
template <typename Fn>
py::capsule capsule(Fn fn, const char* name) {
  return py::capsule(reinterpret_cast<void*>(fn), name);
}

}  // namespace pdserve_entry
