// Copyright kvferry authors. Apache-2.0.
#pragma once
// SparCas's 4-bit compact rows on the host: policies/sparcas's reference and the host backend's
// device-selection twin (cpu/decode_step.cpp) share these; gpu/decode_select.cu is their CUDA
// port. The codes and the row layout are base/attn_types.h's (SparcasQ4*).

#include <cmath>
#include <cstdint>

#include "base/attn_types.h"

namespace kvferry {

/// Quantizes one compact row x[0, d_b) (the chosen dimensions, fp32; d_b a multiple of 8) into
/// words[0, d_b / 8); returns the row's scale.
inline float SparcasQuantizeRow(const float* x, int d_b, uint32_t* words) {
  float amax = 0.0f;
  for (int i = 0; i < d_b; ++i) amax = fmaxf(amax, fabsf(x[i]));  // fmaxf skips NaN
  const float inv = SparcasQ4Inv(amax);
  for (int w = 0; w < SparcasQ4Words(d_b); ++w) {
    uint32_t word = 0;
    for (int e = 0; e < 8; ++e) word |= SparcasQ4Code(x[w * 8 + e], inv) << (4 * e);
    words[w] = word;
  }
  return SparcasQ4Scale(amax);
}

/// The row's scale times sum_i qd[i] * n_i (qd: the query's chosen dimensions), summed in
/// ascending i in fp32.
inline float SparcasQ4Dot(const float* qd, const uint32_t* words, int d_b, float row_scale) {
  float acc = 0.0f;
  for (int w = 0; w < SparcasQ4Words(d_b); ++w) {
    for (int e = 0; e < 8; ++e) {
      acc += qd[w * 8 + e] * static_cast<float>(SparcasQ4Value(words[w], e));
    }
  }
  return acc * row_scale;
}

}  // namespace kvferry
