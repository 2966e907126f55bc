// Copyright kvferry authors. Apache-2.0.
#pragma once
// Element loads and stores with a run-time dtype (f32, bf16, f16), converting through fp32: for
// the small row kernels whose dtype is data, not a template parameter.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kvferry/tensor.h"

namespace kvferry::cuda {

__device__ __forceinline__ float LoadElem(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return __half2float(static_cast<const __half*>(p)[i]);
  }
}

/// A KV-dtype element (bf16 or f16, a template parameter) to fp32 and back (round to nearest).
template <typename T>
__device__ __forceinline__ float ToF32(T x) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "a KV dtype");
  if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T FromF32(float x) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "a KV dtype");
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
  else return __float2bfloat16_rn(x);
}

__device__ __forceinline__ void StoreElem(void* p, DType t, int64_t i, float x) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = x; break;
    case DType::kBF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x); break;
    default: static_cast<__half*>(p)[i] = __float2half_rn(x); break;
  }
}

}  // namespace kvferry::cuda
