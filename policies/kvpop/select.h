// Copyright kvferry authors. Apache-2.0.
#pragma once
// KVpop's device selection (DeviceKernel) on the GPU (select.cu, CUDA builds only) and on the
// host (select_host.cpp).

#include <cstdint>

#include "base/attn_types.h"
#include "policies/kvpop/score.h"
#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry::cuda {
/// The selection of a step (args: DecodeStepArgs).
Status KvpopSelectCuda(const void* args, const LaunchInfo& info, void* stream);
}  // namespace kvferry::cuda

namespace kvferry::detail {
/// The host twin of KvpopSelectCuda.
Status KvpopSelectHost(const void* args);
}  // namespace kvferry::detail
