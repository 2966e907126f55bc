// Copyright kvferry authors. Apache-2.0.
#pragma once
// SparCas's device state and the arguments its selection kernels take (DecodeStepArgs::selector).
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
/// smooth 1 (4-bit layers): item t's channel scales at scales + t * head_dim (base/sparcas_q4.h,
/// SparcasChannelScales), taken at its first ranked step (on CUDA: zeroed by Reset, maxima by
/// SparcasScalesKernel, floored by SparcasPrepKernel).
struct SparcasStepArgs {
  SparcasState* state = nullptr;
  int32_t* dims = nullptr;
  float* scales = nullptr;
  int32_t db = 16, u = 256, dense_layers = 2, bits = 16;
  int32_t smooth = 0;
};

/// SparCas's arguments of step \p a (also the first part of HiP's, whose dense layers take
/// SparCas's path).
KVF_HOST_DEVICE inline SparcasStepArgs SparcasArgsOf(const DecodeStepArgs& a) {
  return SelectorArgsOf<SparcasStepArgs>(a);
}

}  // namespace kvferry
