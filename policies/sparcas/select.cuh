// Copyright kvferry authors. Apache-2.0.
#pragma once
// SparCas's launches that HiP's selection shares (policies/hip/select.cu): CUDA code only.

#include <cuda_runtime.h>

#include "base/attn_types.h"
#include "policies/sparcas/args.h"
#include "gpu/cuda_kernels.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

/// Item (b, h)'s compact rows (SparCas's, and HiP's every-dimension rows) in DecodeStepArgs::meta.
template <typename T>
__device__ __forceinline__ T* CompactOf(const DecodeStepArgs& a, int32_t b, int32_t h) {
  const SparcasStepArgs s = SparcasArgsOf(a);
  return reinterpret_cast<T*>(a.meta) +
         SparcasCompactOffset(a.slots[b], a.layer, h, a.num_layers, a.num_kv_heads, a.meta_pages,
                              a.params.head_dim, s.db, s.dense_layers, s.bits);
}
/// The compact rows as SelectScoreKernel's key source (SparCas's dense layers).
struct CompactKeys {
  template <typename T>
  __device__ static const T* Of(const DecodeStepArgs& a, int32_t b, int32_t h) {
    return CompactOf<T>(a, b, h);
  }
};

/// SparCas's prep (the dimensions, what to gather) and the gather of the compact rows for every
/// item of \p a: its rows current, nothing ranked.
Status LaunchSparcasRows(const DecodeStepArgs& a, const SelectGrid& g, cudaStream_t stream);

}  // namespace kvferry::cuda
