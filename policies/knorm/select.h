// Copyright kvferry authors. Apache-2.0.
#pragma once
// knorm's device state and kernels (DeviceKernel): every stored key's L2 norm, kept in device
// memory, and the selection that ranks them, on the GPU (select.cu, CUDA builds only) and on the
// host (select_host.cpp).

#include <cstdint>

#include "base/attn_types.h"
#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry {

/// knorm's own arguments of a step (DecodeStepArgs::selector): item t's key norms at
/// norms + t * cap, position j at [j] (t = (slot * num_layers + layer) * num_kv_heads + h).
struct KnormStepArgs {
  float* norms = nullptr;
  int64_t cap = 0;
};

/// The norms of the rows [pos0, new_len) of (slot, layer)'s KV heads just stored in the host
/// store (prefill, or an append outside the planned step).
struct KnormStoreArgs {
  AttnParams params;
  int32_t num_kv_heads = 0, num_layers = 0, layer = 0, slot = 0;
  int64_t pos0 = 0, new_len = 0;
  StoreTable store;  ///< the whole store's
  KnormStepArgs state;
};

/// The L2 norm of a key row in fp32, its \p d elements summed in order (the host's reference).
float KnormOf(const float* row, int d);

}  // namespace kvferry

namespace kvferry::cuda {
/// The selection of a step (args: DecodeStepArgs): the new token's norm stored, every position's
/// negated norm as its score, then the shared top-k.
Status KnormSelectCuda(const void* args, const LaunchInfo& info, void* stream);
/// The norms of stored rows (args: KnormStoreArgs).
Status KnormStoreCuda(const void* args, const LaunchInfo& info, void* stream);
}  // namespace kvferry::cuda

namespace kvferry::detail {
/// The host twins of KnormSelectCuda and KnormStoreCuda.
Status KnormSelectHost(const void* args);
Status KnormStoreHost(const void* args);
}  // namespace kvferry::detail
