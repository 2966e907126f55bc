// Copyright kvferry authors. Apache-2.0.
#pragma once
// Programmatic dependent launch (PDL, sm_90+) for the short kernels of a planned decode step. A
// kernel launched with LaunchPdl may be scheduled while the kernel ahead of it on the stream is
// still running; it must call PdlWait() before it reads or writes anything (griddepcontrol.wait
// returns once every kernel ahead has completed and its writes are visible, so a kernel that waits
// first behaves as a plain launch). PdlTrigger() lets the next kernel be scheduled at once; kernels
// of one wave call it first, kernels of several waves leave it out (their successors' waiting
// CTAs would take the slots of their later waves). Graph capture keeps the attribute as a
// programmatic edge. Each boundary between the step's dozen kernels a layer then costs less than
// a full drain and launch. KVFERRY_SELECT_PDL=0 launches plainly.

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace kvferry::cuda {

__device__ __forceinline__ void PdlWait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void PdlTrigger() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Whether LaunchPdl sets the attribute: a device of compute capability 9 or more, and
/// KVFERRY_SELECT_PDL is not "0".
inline bool SelectPdlEnabled() {
  static const bool on = [] {
    const char* e = std::getenv("KVFERRY_SELECT_PDL");
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    return major >= 9 && (e == nullptr || std::strcmp(e, "0") != 0);
  }();
  return on;
}

/// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization allowed.
template <typename... KArgs, typename... Args>
cudaError_t LaunchPdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = SelectPdlEnabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace kvferry::cuda
