// Copyright kvferry authors. Apache-2.0.
#pragma once
// Quest's device kernels (DeviceKernel): the selection and the page bounds, on the GPU
// (select.cu, CUDA builds only) and on the host (select_host.cpp).

#include <cstdint>

#include "base/attn_types.h"
#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry::cuda {
/// The selection of a step (args: DecodeStepArgs).
Status QuestSelectCuda(const void* args, const LaunchInfo& info, void* stream);
/// The page bounds of a stored chunk's pages (args: PageBoundsArgs), after its writes.
Status QuestPageBoundsCuda(const void* args, const LaunchInfo& info, void* stream);
}  // namespace kvferry::cuda

namespace kvferry::detail {
/// The host twin of QuestSelectCuda.
Status QuestSelectHost(const void* args);
/// The host twin of QuestPageBoundsCuda.
Status QuestPageBoundsHost(const void* args);
}  // namespace kvferry::detail
