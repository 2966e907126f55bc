// Copyright kvferry authors. Apache-2.0.
#pragma once
// knorm's device selection (DeviceKernel) on the GPU (select.cu, CUDA builds only) and on the
// host (select_host.cpp).

#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry::cuda {
/// The selection of a step (args: DecodeStepArgs): each key's norm, then the shared top-k.
Status KnormSelectCuda(const void* args, const LaunchInfo& info, void* stream);
}  // namespace kvferry::cuda

namespace kvferry::detail {
/// The host twin of KnormSelectCuda (KnormPicks over each item's offloaded range).
Status KnormSelectHost(const void* args);
}  // namespace kvferry::detail
