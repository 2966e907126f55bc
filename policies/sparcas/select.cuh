// Copyright kvferry authors. Apache-2.0.
#pragma once
// SparCas's launches that HiP's selection shares (policies/hip/select.cu): CUDA code only.

#include <cuda_runtime.h>

#include "base/attn_types.h"
#include "policies/sparcas/args.h"
#include "gpu/cuda_kernels.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

/// Query heads SparCas's 4-bit score kernel takes at a time (its larger instance).
constexpr int kSparcasQ4Heads = 8;

/// A warp's int8 codes of one query head's \p len values x(i) (SparcasQ8Code, packed 8 a word:
/// even and odd bytes), its step and 8 x its code sum (the 4-bit scores' offset), for SparCas's
/// and HiP's 4-bit scoring.
template <typename Elem>
__device__ __forceinline__ void PackQ8HeadWarp(const Elem& x, int len, int words, int lane,
                                               int2* pack, float* step, int32_t* sum8) {
  float amax = 0.0f;
  for (int i = lane; i < len; i += 32) amax = fmaxf(amax, fabsf(x(i)));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float inv = SparcasQ8Inv(amax);
  int32_t sum = 0;
  for (int w = lane; w < words; w += 32) {
    uint32_t even = 0, odd = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int32_t c = SparcasQ8Code(x(w * 8 + e), inv);
      sum += c;
      const uint32_t byte = static_cast<uint32_t>(c) & 0xFFu;
      if (e % 2 == 0) {
        even |= byte << (8 * (e / 2));
      } else {
        odd |= byte << (8 * (e / 2));
      }
    }
    pack[w] = make_int2(static_cast<int>(even), static_cast<int>(odd));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    *step = SparcasQ8Step(amax);
    *sum8 = 8 * sum;
  }
}

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
