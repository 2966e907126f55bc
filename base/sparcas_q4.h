// Copyright kvferry authors. Apache-2.0.
#pragma once
// SparCas's 4-bit compact rows on the host: policies/sparcas's reference and the host backend's
// device-selection twin (cpu/decode_step.cpp) share these; gpu/decode_select.cu is their CUDA
// port. The codes and the row layout are base/attn_types.h's (SparcasQ4*).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "base/attn_types.h"

namespace kvferry {

/// SparCas's channel smoothing ("smooth" 1): 4-bit rows with one scale a row lose every dimension
/// far below the row's largest, and keys have channels of very different size (QK-norm's learned
/// weights, RoPE's outlier pairs). Each kept key dimension d is divided by s[d] before the row is
/// quantized and each query dimension multiplied by it (the dot product is unchanged), and the
/// dimensions are chosen by sum_g |q[g][d]| * s[d], what a dimension adds to the logits.
/// s[d] = max |k[j][d]| over the rows j an item holds at its first ranked step (the prompt; NaN
/// skipped), floored at 1e-3 of the largest (1 when every row is zero); kept for the item's life.
/// load_row(j, row) writes key j as fp32 into row[0, head_dim) (scratch the caller owns).
template <typename LoadRow>
void SparcasChannelScales(int64_t n, int head_dim, const LoadRow& load_row, float* row, float* s) {
  for (int d = 0; d < head_dim; ++d) s[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    load_row(j, row);
    for (int d = 0; d < head_dim; ++d) s[d] = fmaxf(s[d], fabsf(row[d]));  // fmaxf skips NaN
  }
  float top = 0.0f;
  for (int d = 0; d < head_dim; ++d) top = fmaxf(top, s[d]);
  const float floor = top > 0.0f && std::isfinite(top) ? 1e-3f * top : 1.0f;
  for (int d = 0; d < head_dim; ++d) s[d] = std::isfinite(s[d]) ? fmaxf(s[d], floor) : floor;
}
/// The query as smoothing sees it: out[g * head_dim + d] = q[g * head_dim + d] * s[d].
inline void SparcasScaleQuery(const float* q, int group, int head_dim, const float* s, float* out) {
  for (int g = 0; g < group; ++g) {
    for (int d = 0; d < head_dim; ++d) out[g * head_dim + d] = q[g * head_dim + d] * s[d];
  }
}

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

/// Quantizes one head's chosen query dimensions qd[0, d_b) into codes[0, d_b) (base/attn_types.h's
/// SparcasQ8*); returns the step and sets *code_sum to the sum of the codes.
inline float SparcasQuantizeQuery(const float* qd, int d_b, int8_t* codes, int32_t* code_sum) {
  float amax = 0.0f;
  for (int i = 0; i < d_b; ++i) amax = fmaxf(amax, fabsf(qd[i]));  // fmaxf skips NaN
  const float inv = SparcasQ8Inv(amax);
  int32_t sum = 0;
  for (int i = 0; i < d_b; ++i) {
    codes[i] = static_cast<int8_t>(SparcasQ8Code(qd[i], inv));
    sum += codes[i];
  }
  *code_sum = sum;
  return SparcasQ8Step(amax);
}

/// A row's partial logit: (float(sum_i codes[i] * n_i) * q_step) * row_scale, the sum exact in
/// int32 (taken over the offset nibbles n_i + 8, less 8 * code_sum, as the GPU's __dp4a does).
inline float SparcasQ4Dot(const int8_t* codes, int32_t code_sum, float q_step, const uint32_t* words,
                          int d_b, float row_scale) {
  int32_t acc = 0;
  for (int w = 0; w < SparcasQ4Words(d_b); ++w) {
    for (int e = 0; e < 8; ++e) acc += codes[w * 8 + e] * SparcasQ4Nibble(words[w], e);
  }
  const float dot = static_cast<float>(acc - 8 * code_sum) * q_step;
  return dot * row_scale;
}

/// Every head of a group's query as SparcasQuantizeQuery takes one: head g's values q[g * q_stride
/// + dims[i]] (q[g * q_stride + i] when dims is null) for i < d, as codes[g * d, (g + 1) * d),
/// sums[g] and steps[g].
struct Q8Query {
  std::vector<int8_t> codes;
  std::vector<int32_t> sums;
  std::vector<float> steps;
  int d = 0;
};
inline void QuantizeQueryHeads(const float* q, int group, int q_stride, const int32_t* dims, int d,
                               Q8Query* out) {
  thread_local std::vector<float> qd;
  qd.resize(static_cast<size_t>(d));
  out->d = d;
  out->codes.resize(static_cast<size_t>(group) * d);
  out->sums.resize(static_cast<size_t>(group));
  out->steps.resize(static_cast<size_t>(group));
  for (int g = 0; g < group; ++g) {
    for (int i = 0; i < d; ++i) qd[i] = q[static_cast<int64_t>(g) * q_stride + (dims ? dims[i] : i)];
    out->steps[g] = SparcasQuantizeQuery(qd.data(), d, out->codes.data() + g * d, &out->sums[g]);
  }
}
/// Head g's logit of one 4-bit row: scale * SparcasQ4Dot.
inline float SparcasQ4Logit(const Q8Query& q, int g, const uint32_t* words, float row_scale, float scale) {
  return scale * SparcasQ4Dot(q.codes.data() + g * q.d, q.sums[g], q.steps[g], words, q.d, row_scale);
}
/// The max over heads g < group of SparcasQ4Logit (std::max from -inf: HiP's token score).
inline float SparcasQ4MaxLogit(const Q8Query& q, int group, const uint32_t* words, float row_scale,
                               float scale) {
  float best = -INFINITY;
  for (int g = 0; g < group; ++g) best = std::max(best, SparcasQ4Logit(q, g, words, row_scale, scale));
  return best;
}

}  // namespace kvferry
