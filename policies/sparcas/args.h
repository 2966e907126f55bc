// Copyright kvferry authors. Apache-2.0.
#pragma once
// SparCas's device state and the arguments its selection kernels take (DecodeStepArgs::selector).
#include <cmath>
#include <cstdint>

#include "base/attn_types.h"

namespace kvferry {

/// Per-item SparCas state in device memory (SparcasStepArgs::state, one per
/// t = (slot * num_layers + layer) * num_kv_heads + h; all zero for a new sequence).
struct SparcasState {
  int64_t seen = 0;           ///< compact rows [0, seen) hold the current dimensions
  int32_t d_b = 0;            ///< dimensions in use (0: none chosen yet)
  int32_t since_refresh = 0;  ///< ranked steps since the dimensions were chosen
  int64_t from = 0;           ///< this step: first compact row to (re)gather
  int32_t ranked = 0;         ///< this step ranks positions (else all, or sinks + window only)
  int32_t pad = 0;
};

/// SparCas's arguments of a step (DecodeStepArgs::selector): item t's state at state + t, its chosen dimensions at
/// dims + t * head_dim; db dimensions, refreshed every u ranked steps; layers below dense_layers
/// exact; bits 16: compact keys in the KV dtype, 4: SparcasQuantizeRow's rows (sparse layers).
/// smooth 1 (4-bit layers): item t's channel scales at scales + t * head_dim (policies/sparcas/q4.h,
/// SparcasChannelScales), taken at its first ranked step (on CUDA: zeroed by Reset, maxima by
/// SparcasScalesKernel, floored by SparcasPrepKernel).
struct SparcasStepArgs {
  SparcasState* state = nullptr;
  int32_t* dims = nullptr;
  float* scales = nullptr;
  int32_t db = 16, u = 64, dense_layers = 2, bits = 16;
  int32_t smooth = 0;
};

/// SparCas's arguments of step \p a (also the first part of HiP's, whose dense layers take
/// SparCas's path).
KVF_HOST_DEVICE inline SparcasStepArgs SparcasArgsOf(const DecodeStepArgs& a) {
  return SelectorArgsOf<SparcasStepArgs>(a);
}

/// SparCas: dimensions kept by layer \p layer, and the element offset of item (slot, layer, h)'s
/// compact keys in DecodeStepArgs::meta: per slot, the dense layers' rows (head_dim elements)
/// then the others' (SparcasRowElems elements), meta_pages positions per item. Elements are the KV
/// dtype's (2 bytes).
KVF_HOST_DEVICE inline int32_t SparcasDimsOf(int32_t layer, int32_t dense_layers, int32_t d_b,
                                             int32_t head_dim) {
  const int32_t k = d_b < 1 ? 1 : (d_b > head_dim ? head_dim : d_b);
  return layer < dense_layers ? head_dim : k;
}
/// Bits a dimension of layer \p layer's compact rows: the dense layers keep the KV dtype (16),
/// the others \p bits.
KVF_HOST_DEVICE inline int32_t SparcasBitsOf(int32_t layer, int32_t dense_layers, int32_t bits) {
  return layer < dense_layers ? 16 : bits;
}
/// SparCas 4-bit rows: d_b / 8 32-bit words (dimension i in bits [4 (i % 8), 4 (i % 8) + 4) of
/// word i / 8 as n + 8, n in [-7, 7]: offset binary, so the GPU turns a nibble into a float with
/// an OR and a subtraction instead of an integer conversion) then the row's scale as an f32.
constexpr int32_t kSparcasQ4Levels = 7;
KVF_HOST_DEVICE inline int32_t SparcasQ4Words(int32_t d_b) { return d_b / 8; }
/// A sparse layer's compact row in 2-byte elements: d_b at 16 bits, (d_b / 8 + 1) words at 4.
KVF_HOST_DEVICE inline int32_t SparcasRowElems(int32_t d_b, int32_t bits) {
  return bits == 4 ? 2 * (SparcasQ4Words(d_b) + 1) : d_b;
}
/// Symmetric quantization to integers in [-levels, levels] given the max |x| of the values
/// (SparCas's 4-bit rows: 7; its int8 query: 127): inv = levels / amax and step = amax / levels,
/// both 0 when amax is 0 or not finite; a value's code rint(clamp(x * inv, -levels, levels)).
KVF_HOST_DEVICE inline float SymQuantInv(float amax, int32_t levels) {
  return amax > 0.0f && amax <= 3.0e38f ? static_cast<float>(levels) / amax : 0.0f;
}
KVF_HOST_DEVICE inline float SymQuantStep(float amax, int32_t levels) {
  return amax > 0.0f && amax <= 3.0e38f ? amax / static_cast<float>(levels) : 0.0f;
}
KVF_HOST_DEVICE inline int32_t SymQuantCode(float x, float inv, int32_t levels) {
  const float lv = static_cast<float>(levels);
  return static_cast<int32_t>(rintf(fminf(fmaxf(x * inv, -lv), lv)));
}
/// The 4-bit code of x given the row's max |x| (fmaxf over the row, which skips NaN): inv =
/// 7 / amax (0 when amax is 0 or not finite: every n 0), n = rint(clamp(x * inv, -7, 7))
/// (NaN: -7), as the nibble n + 8. The row's scale is amax / 7 (0 likewise). Host and device
/// quantize with these.
KVF_HOST_DEVICE inline float SparcasQ4Inv(float amax) { return SymQuantInv(amax, kSparcasQ4Levels); }
KVF_HOST_DEVICE inline float SparcasQ4Scale(float amax) { return SymQuantStep(amax, kSparcasQ4Levels); }
KVF_HOST_DEVICE inline uint32_t SparcasQ4Code(float x, float inv) {
  if (inv == 0.0f) return 8u;  // a zero or non-finite row: every n 0
  return static_cast<uint32_t>(SymQuantCode(x, inv, kSparcasQ4Levels) + 8);
}
/// Dimension e (0..7) of a word as stored: the nibble n + 8 (what the integer dot sums).
KVF_HOST_DEVICE inline int32_t SparcasQ4Nibble(uint32_t word, int e) {
  return static_cast<int32_t>((word >> (4 * e)) & 0xFu);
}
/// Dimension e (0..7) of a word: n.
KVF_HOST_DEVICE inline int32_t SparcasQ4Value(uint32_t word, int e) { return SparcasQ4Nibble(word, e) - 8; }
/// The query side of the 4-bit scores: one head's chosen dimensions of q as int8 codes c_i =
/// rint(clamp(x_i * inv, -127, 127)), inv = 127 / amax over the head's d_b values (NaN: -127),
/// with step amax / 127 (inv and step 0 when amax is 0 or not finite: the head scores 0). A row's
/// partial logit is then (float(sum_i c_i n_i) * step) * row scale: the sum is an exact integer
/// (__dp4a on the GPU, on the offset nibbles n_i + 8 less 8 sum_i c_i), so host and device agree
/// to the bit. Quantized from q as given, before the softmax scale.
constexpr int32_t kSparcasQ8Levels = 127;
KVF_HOST_DEVICE inline float SparcasQ8Inv(float amax) { return SymQuantInv(amax, kSparcasQ8Levels); }
KVF_HOST_DEVICE inline float SparcasQ8Step(float amax) { return SymQuantStep(amax, kSparcasQ8Levels); }
KVF_HOST_DEVICE inline int32_t SparcasQ8Code(float x, float inv) {
  return inv == 0.0f ? 0 : SymQuantCode(x, inv, kSparcasQ8Levels);
}
KVF_HOST_DEVICE inline int64_t SparcasCompactOffset(int64_t slot, int32_t layer, int32_t h,
                                                    int32_t num_layers, int32_t num_kv_heads,
                                                    int64_t positions, int32_t head_dim,
                                                    int32_t d_b, int32_t dense_layers,
                                                    int32_t bits) {
  const int32_t dl = dense_layers < 0 ? 0 : (dense_layers > num_layers ? num_layers : dense_layers);
  // the sparse layers' row elements
  const int32_t k = SparcasRowElems(SparcasDimsOf(num_layers, dl, d_b, head_dim), bits);
  const int64_t item = positions;
  const int64_t per_slot = (static_cast<int64_t>(dl) * head_dim + static_cast<int64_t>(num_layers - dl) * k) *
                           num_kv_heads * item;
  int64_t off = slot * per_slot;
  if (layer < dl) return off + (static_cast<int64_t>(layer) * num_kv_heads + h) * item * head_dim;
  off += static_cast<int64_t>(dl) * num_kv_heads * item * head_dim;
  return off + (static_cast<int64_t>(layer - dl) * num_kv_heads + h) * item * k;
}

}  // namespace kvferry
