// Copyright kvferry authors. Apache-2.0.
#pragma once
// The oracle's device selection (DeviceKernel): the exact top-k on the GPU (select.cu, CUDA
// builds only) and on the host (select_host.cpp).

#include <cstdint>
#include <memory>

#include "base/attn_types.h"
#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry::cuda {
/// The selection of a step (args: DecodeStepArgs).
Status ExactSelectCuda(const void* args, const LaunchInfo& info, void* stream);
}  // namespace kvferry::cuda

namespace kvferry::detail {
class DeviceSelector;
struct SelectorShape;
/// The oracle's selector (device_selector.cpp): no state between steps.
std::unique_ptr<DeviceSelector> MakeExactTopKSelector(const SelectorShape& shape);
/// The host twin of ExactSelectCuda.
Status ExactSelectHost(const void* args);
}  // namespace kvferry::detail
