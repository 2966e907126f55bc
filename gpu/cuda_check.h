// Copyright kvferry authors. Apache-2.0.
#pragma once
// Error checking for CUDA runtime calls and kernel launches. Every CUDA call in kvferry goes
// through KVF_CUDA_CHECK (returns a kDeviceError Status naming the call and file:line) or, where a
// Status cannot be returned (destructors, Free*), KVF_CUDA_WARN (logs to stderr once per site).
// Only include from code compiled with KVFERRY_WITH_CUDA.

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "kvferry/status.h"

namespace kvferry::cuda {

/// "cudaMalloc(&p, bytes) failed: out of memory (cudaErrorMemoryAllocation) at gpu/x.cu:42".
inline Status CudaStatus(cudaError_t err, const char* call, const char* file, int line) {
  std::string msg = std::string(call) + " failed: " + cudaGetErrorString(err) + " (" +
                    cudaGetErrorName(err) + ") at " + file + ":" + std::to_string(line);
  return DeviceError(std::move(msg));
}

}  // namespace kvferry::cuda

/// Returns a kDeviceError Status from the enclosing function if \p call is not cudaSuccess.
#define KVF_CUDA_CHECK(call)                                                    \
  do {                                                                          \
    const cudaError_t kvf_cuda_err_ = (call);                                   \
    if (kvf_cuda_err_ != cudaSuccess)                                           \
      return ::kvferry::cuda::CudaStatus(kvf_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)

/// Checks the launch that precedes it (configuration errors, not asynchronous faults).
#define KVF_CUDA_CHECK_LAUNCH(kernel_name) KVF_CUDA_CHECK(cudaPeekAtLastError())

/// For paths that cannot return a Status (destructors, void Free*): report and continue.
#define KVF_CUDA_WARN(call)                                                              \
  do {                                                                                   \
    const cudaError_t kvf_cuda_err_ = (call);                                            \
    if (kvf_cuda_err_ != cudaSuccess)                                                    \
      std::fprintf(stderr, "kvferry: %s failed: %s at %s:%d\n", #call,                   \
                   cudaGetErrorString(kvf_cuda_err_), __FILE__, __LINE__);               \
  } while (0)
