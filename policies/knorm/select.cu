// Copyright kvferry authors. Apache-2.0.
// knorm's selection on the GPU (policies/knorm/device_selector.cpp): every key's L2 norm,
// negated, as its score in each query head's row of the selection scratch, then the shared top-k
// over the offloaded range (the largest score is the smallest norm; every head's row is the same,
// so the group's summed weight orders the positions as the norm does). The host twin is in
// device_selector.cpp.
#include "base/check.h"
#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "gpu/select_kernels.cuh"
#include "gpu/topk.cuh"

namespace kvferry::cuda {
namespace {

// Grid (items, y), kScoreWarps warps: warp w of CTA y takes positions y * warps + w, striding by
// gridDim.y * warps; each lane sums the squares of HD / 32 of the key's elements. Keys come from
// the resident tier or the host store (zero-copy), the new token's from the input as the append
// will store it.
template <int HD, typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) KnormScoreKernel(DecodeStepArgs a) {
  constexpr int kE = HD / 32;
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int64_t t = ItemT(a, b, h);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t row_bytes = HD * sizeof(T);
  const char* res_k =
      a.resident + static_cast<size_t>(t * 2 * (static_cast<int64_t>(a.sink) + a.window)) * row_bytes;
  const unsigned long long* pages =
      reinterpret_cast<const unsigned long long*>(a.store.pages) + t * a.store.max_pages;
  float* out = a.select_ws + static_cast<size_t>(item) * a.params.group * a.select_ld;
  for (int64_t j = static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp; j < n;
       j += static_cast<int64_t>(gridDim.y) * kScoreWarps) {
    float s = 0.0f;
    if (j == n - 1) {
      const int64_t src = static_cast<int64_t>(item) * HD + lane * kE;
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        const float x = ToF32(FromF32<T>(LoadElem(a.k, a.k_dtype, src + e)));
        s = fmaf(x, x, s);
      }
    } else {
      const int64_t row = ResidentRowOf(j, n, a.sink, a.window);
      const T* kp = row >= 0 ? reinterpret_cast<const T*>(res_k + static_cast<size_t>(row) * row_bytes)
                             : reinterpret_cast<const T*>(StoreKRow(pages, j, a.store.page_tokens, row_bytes));
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        const float x = ToF32(kp[lane * kE + e]);
        s = fmaf(x, x, s);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) {
      const float score = -sqrtf(s);
      for (int g = 0; g < a.params.group; ++g) out[static_cast<size_t>(g) * a.select_ld + j] = score;
    }
  }
}

Status KnormSelect(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream,
                     const SelectGrid& g) {
  if (a.select_skip_ranking) return Status::Ok();  // no state to keep current
  KVF_CHECK_ARG(SelectSortCap(a) <= kTopKSmemItems || a.topk_ws != nullptr,
                "DecodeSelect: budget_cap ", a.budget_cap, " needs a top-k workspace");
  KVF_RETURN_IF_ERROR(DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
      KnormScoreKernel<HD, T><<<dim3(static_cast<unsigned>(g.items), g.gy), kScoreWarps * 32, 0, stream>>>(a);
      KVF_CUDA_CHECK_LAUNCH(KnormScoreKernel);
      return Status::Ok();
    });
  }));
  KVF_RETURN_IF_ERROR(LaunchSelectTopK(a, info, SelectTopKPath::kAuto, stream));
  return LaunchPsawFilter(a, stream);
}

}  // namespace

Status KnormSelectCuda(const void* args, const LaunchInfo& info, void* stream) {
  return SelectLauncher<KnormSelect>(args, info, stream);
}

}  // namespace kvferry::cuda
