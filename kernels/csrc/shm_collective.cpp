// The synchronisation of pdserve's shared-memory all-gather between the tensor-parallel
// ranks of one host (kernels/shm_collective.py): a rank publishes a sequence number once
// its slot holds its part, and waits until every rank has published the same number.
// Release/acquire atomics order the slot's bytes (written by torch's copy) with the flag.
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#define PDSERVE_PAUSE() _mm_pause()
#else
#define PDSERVE_PAUSE() std::this_thread::yield()
#endif

namespace {

std::atomic<int64_t>* flag_at(const torch::Tensor& flags, int64_t index) {
  return reinterpret_cast<std::atomic<int64_t>*>(flags.data_ptr<int64_t>() + index);
}

}  // namespace

// flags[index] = value, after every store this thread made before (a full fence also
// orders the non-temporal stores a large memcpy may use).
void publish(const torch::Tensor& flags, int64_t index, int64_t value) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  flag_at(flags, index)->store(value, std::memory_order_release);
}

// Wait until flags[i * stride] >= value for i in [0, world); false after timeout_s.
// Spins with pause, yielding the CPU after a while (the GIL is released meanwhile).
bool wait_all(const torch::Tensor& flags, int64_t world, int64_t stride, int64_t value,
              double timeout_s) {
  pybind11::gil_scoped_release no_gil;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  for (int64_t i = 0; i < world; ++i) {
    auto* flag = flag_at(flags, i * stride);
    int64_t spins = 0;
    while (flag->load(std::memory_order_acquire) < value) {
      if (++spins < 4096) {
        PDSERVE_PAUSE();
        continue;
      }
      std::this_thread::yield();
      if ((spins & 255) == 0 && std::chrono::steady_clock::now() > deadline) return false;
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("publish", &publish, "store a sequence number with release semantics");
  m.def("wait_all", &wait_all, "wait until every rank published a sequence number");
}
