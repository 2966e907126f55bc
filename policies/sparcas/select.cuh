// Copyright kvferry authors. Apache-2.0.
#pragma once
// SparCas's launches that HiP's selection shares (policies/hip/select.cu): CUDA code only.

#include <cuda_runtime.h>

#include "base/attn_types.h"
#include "gpu/cuda_kernels.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

/// SparCas's prep (the dimensions, what to gather) and the gather of the compact rows for every
/// item of \p a: its rows current, nothing ranked.
Status LaunchSparcasRows(const DecodeStepArgs& a, const SelectGrid& g, cudaStream_t stream);

}  // namespace kvferry::cuda
