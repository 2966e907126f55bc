// Copyright kvferry authors. Apache-2.0.
#pragma once
// Scalar bf16/fp16 <-> fp32 conversions (round to nearest even), usable from host code and from
// CUDA host code. Device code uses cuda_bf16.h / cuda_fp16.h instead.

#include <bit>
#include <cstdint>
#include <cstring>

#include "kvferry/tensor.h"

namespace kvferry::cpu {

inline float Bf16ToF32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

inline uint16_t F32ToBf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

inline float F16ToF32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

inline uint16_t F32ToF16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // subnormal or zero in fp16
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t exp = abs >> 23;
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // 14 + (113 - exp)
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

/// Element \p i of a buffer of \p dtype as fp32.
inline float LoadAsF32(const void* src, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(src)[i];
    case DType::kBF16: return Bf16ToF32(static_cast<const uint16_t*>(src)[i]);
    case DType::kF16: return F16ToF32(static_cast<const uint16_t*>(src)[i]);
  }
  return 0.0f;
}

/// Stores fp32 \p x as element \p i of a buffer of \p dtype.
inline void StoreFromF32(void* dst, DType dtype, int64_t i, float x) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(dst)[i] = x; break;
    case DType::kBF16: static_cast<uint16_t*>(dst)[i] = F32ToBf16(x); break;
    case DType::kF16: static_cast<uint16_t*>(dst)[i] = F32ToF16(x); break;
  }
}

/// Converts \p n elements between any two dtypes.
inline void ConvertSpan(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n) {
  if (dst_dtype == src_dtype) {
    std::memcpy(dst, src, static_cast<size_t>(n) * DTypeSize(dst_dtype));
    return;
  }
  for (int64_t i = 0; i < n; ++i) StoreFromF32(dst, dst_dtype, i, LoadAsF32(src, src_dtype, i));
}

}  // namespace kvferry::cpu
