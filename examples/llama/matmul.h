// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file matmul.h
/// \brief y = x W^T on the CPU through oneDNN's matmul primitive, or on the GPU through cuBLAS.

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "examples/llama/model.h"
#include "kvferry/status.h"

namespace kvferry::llama {

/// \brief Computes y[M, N] = x[M, K] * W[N, K]^T in f32 with oneDNN (caching one primitive per
/// shape), or with cuBLAS SGEMM after EnableCuda (weights uploaded once on first use, x and y
/// staged per call). Not thread-safe: one per engine.
class Matmul {
 public:
  Matmul();
  ~Matmul();
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;

  /// \p x: [m, w.cols] row-major; \p y: [m, w.rows] row-major (overwritten).
  Status Run(const float* x, int64_t m, const Matrix& w, float* y);

  /// After EnableCuda: y = x W^T with \p x and \p y in GPU memory, enqueued on cuda_stream()
  /// (no copy, no synchronisation); the weights are uploaded at first use as for Run.
  Status RunOnDevice(const float* x, int64_t m, const Matrix& w, float* y);
  /// The cudaStream_t every product is ordered on (null before EnableCuda).
  [[nodiscard]] void* cuda_stream() const;

  /// Routes every later Run through cuBLAS on \p device_id; kUnimplemented without CUDA.
  Status EnableCuda(int device_id);
  [[nodiscard]] bool on_gpu() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::llama
