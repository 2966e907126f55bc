// Copyright kvferry authors. Apache-2.0.
// The oracle's selection on the GPU (policies/oracle/device_selector.cpp): every key's score from
// the host store and the resident tier (SelectScoreKernel, gpu/select_kernels.cuh), then the exact
// top-k (gpu/decode_select.cu). The host twin is policies/oracle/select_host.cpp.

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <limits>

#include "base/check.h"
#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "gpu/select_kernels.cuh"
#include "gpu/topk.cuh"
#include "policies/oracle/select.h"

namespace kvferry::cuda {

namespace {
Status ExactSelect(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream,
                   const SelectGrid& g) {
  if (a.select_skip_ranking) return Status::Ok();  // no metadata
  KVF_CHECK_ARG(SelectSortCap(a) <= kTopKSmemItems || a.topk_ws != nullptr,
                "DecodeSelect: budget_cap ", a.budget_cap, " needs a top-k workspace");
  KVF_RETURN_IF_ERROR(DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
      if (g.q_smem > 48 * 1024) {
        KVF_CUDA_CHECK(cudaFuncSetAttribute(
            SelectScoreKernel<HD, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
            static_cast<int>(g.q_smem)));
      }
      SelectScoreKernel<HD, T><<<dim3(static_cast<unsigned>(g.items), g.gy), kScoreWarps * 32, g.q_smem,
                                 stream>>>(a);
      KVF_CUDA_CHECK_LAUNCH(SelectScoreKernel);
      return Status::Ok();
    });
  }));
  KVF_RETURN_IF_ERROR(LaunchSelectTopK(a, info, SelectTopKPath::kAuto, stream));
  return LaunchPsawFilter(a, stream);
}
}  // namespace

Status ExactSelectCuda(const void* args, const LaunchInfo& info, void* stream) {
  return SelectLauncher<ExactSelect>(args, info, stream);
}

}  // namespace kvferry::cuda
