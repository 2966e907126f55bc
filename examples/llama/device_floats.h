// Copyright kvferry authors. Apache-2.0.
#pragma once
/// A device buffer of floats grown on demand (CUDA builds only): the engine's activations and the
/// matrix products' staging (examples/llama/engine_gpu.cu, matmul.cpp).

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "kvferry/status.h"
#include "kvferry/status_macros.h"

namespace kvferry::llama {

struct DeviceFloats {
  float* p = nullptr;
  size_t cap = 0;

  DeviceFloats() = default;
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  DeviceFloats(DeviceFloats&& o) noexcept : p(std::exchange(o.p, nullptr)), cap(std::exchange(o.cap, 0)) {}
  DeviceFloats& operator=(DeviceFloats&&) = delete;
  ~DeviceFloats() {
    if (p != nullptr) cudaFree(p);
  }

  /// At least \p n floats (contents not kept when it grows).
  Status Reserve(size_t n) {
    if (n <= cap) return Status::Ok();
    if (p != nullptr) cudaFree(p);
    p = nullptr;
    cap = 0;
    const cudaError_t e = cudaMalloc(&p, n * sizeof(float));
    if (e != cudaSuccess) {
      p = nullptr;
      return DeviceError(detail::StrCat("cudaMalloc of ", n, " floats: ", cudaGetErrorString(e)));
    }
    cap = n;
    return Status::Ok();
  }
  /// \p v copied in, ordered on \p stream.
  Status Upload(const std::vector<float>& v, cudaStream_t stream) {
    KVF_RETURN_IF_ERROR(Reserve(v.size()));
    const cudaError_t e =
        cudaMemcpyAsync(p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) return DeviceError(detail::StrCat("upload of ", v.size(), " floats: ", cudaGetErrorString(e)));
    return Status::Ok();
  }
};

}  // namespace kvferry::llama
