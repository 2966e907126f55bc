// Copyright kvferry authors. Apache-2.0.
#pragma once
// HiP's device kernels (DeviceKernel): the selection, and the mask rebuilds it requested, run
// beside the step (hip.lag 1), on the GPU (select.cu, CUDA builds only) and on the host
// (select_host.cpp: the host builds a due mask inside the selection).

#include <cstdint>

#include "base/attn_types.h"
#include "policies/hip/args.h"
#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry::cuda {
/// The selection of a step (args: DecodeStepArgs).
Status HipSelectCuda(const void* args, const LaunchInfo& info, void* stream);
/// The rebuilds the selection requested (args: the same DecodeStepArgs), on a stream that waits
/// for the selection's; joined back before the same items' next selection.
Status HipDeferredCuda(const void* args, const LaunchInfo& info, void* stream);
}  // namespace kvferry::cuda

namespace kvferry::detail {
/// The host twin of HipSelectCuda.
Status HipSelectHost(const void* args);
}  // namespace kvferry::detail
