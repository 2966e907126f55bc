// Copyright kvferry authors. Apache-2.0.
// knorm's kernels on the GPU (policies/knorm/device_selector.cpp): the norms of stored rows into
// the selector's buffer, and the selection: the new token's norm stored, every position's negated
// norm as its score in each query head's row of the selection scratch, then the shared top-k over
// the offloaded range (every head's row is the same, so the group's summed weight orders the
// positions as the norm does: the largest score is the smallest norm). The host twins are
// select_host.cpp.
#include "base/check.h"
#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "gpu/select_kernels.cuh"
#include "gpu/topk.cuh"
#include "policies/knorm/select.h"

namespace kvferry::cuda {
namespace {

constexpr int kStoreWarps = 8;

// A warp's L2 norm of a key row of HD elements (lane l sums elements l, l + 32, ...), on every lane.
template <int HD, typename Load>
__device__ __forceinline__ float WarpNorm(int lane, const Load& load) {
  float s = 0.0f;
#pragma unroll
  for (int e = lane; e < HD; e += 32) {
    const float x = load(e);
    s = fmaf(x, x, s);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  return sqrtf(s);
}

// Grid (num_kv_heads, ceil(rows / kStoreWarps)): a warp a stored row, read from the host store.
template <int HD, typename T>
__global__ void __launch_bounds__(kStoreWarps * 32) KnormStoreKernel(KnormStoreArgs a) {
  const int h = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t j = a.pos0 + static_cast<int64_t>(blockIdx.y) * kStoreWarps + warp;
  if (j >= a.new_len) return;
  const int64_t t = (static_cast<int64_t>(a.slot) * a.num_layers + a.layer) * a.num_kv_heads + h;
  const T* kp = reinterpret_cast<const T*>(
      StoreKRow(reinterpret_cast<const unsigned long long*>(a.store.pages) + t * a.store.max_pages, j,
                static_cast<uint32_t>(a.store.page_tokens), HD * sizeof(T)));
  const float norm = WarpNorm<HD>(lane, [&](int e) { return ToF32(kp[e]); });
  if (lane == 0) a.state.norms[t * a.state.cap + j] = norm;
}

// Grid (items, y), kScoreWarps warps: warp w of CTA y scores positions y * warps + w, striding by
// gridDim.y * warps; the new token's norm from the input as the append will store it.
template <int HD, typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) KnormScoreKernel(DecodeStepArgs a) {
  const KnormStepArgs st = SelectorArgsOf<KnormStepArgs>(a);
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  float* norms = st.norms + ItemT(a, b, h) * st.cap;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = a.params.group;
  float* out = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  for (int64_t j0 = (static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp) * 32; j0 < n;
       j0 += static_cast<int64_t>(gridDim.y) * kScoreWarps * 32) {
    float norm = 0.0f;
    if (j0 + 32 >= n) {  // the warp holding the new token n - 1 computes and stores its norm
      const int64_t src = static_cast<int64_t>(item) * HD;
      const float nn = WarpNorm<HD>(lane, [&](int e) { return ToF32(FromF32<T>(LoadElem(a.k, a.k_dtype, src + e))); });
      if (lane == 0) norms[n - 1] = nn;
      norm = nn;
    }
    const int64_t j = j0 + lane;  // a lane a position
    if (j < n - 1) norm = norms[j];
    if (j < n) {
      for (int g = 0; g < group; ++g) out[static_cast<size_t>(g) * a.select_ld + j] = -norm;
    }
  }
}

Status KnormSelect(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream, const SelectGrid& g) {
  const KnormStepArgs st = SelectorArgsOf<KnormStepArgs>(a);
  KVF_CHECK_ARG(st.norms != nullptr && st.cap >= 1, "DecodeSelect: knorm without its norms");
  KVF_CHECK_ARG(!a.select_skip_ranking, "DecodeSelect: knorm stores the new token's norm when it ranks: no select_skip_ranking");
  KVF_CHECK_ARG(SelectSortCap(a) <= kTopKSmemItems || a.topk_ws != nullptr,
                "DecodeSelect: budget_cap ", a.budget_cap, " needs a top-k workspace");
  // A warp scores 32 positions: the score kernels' grid over 32 times fewer positions.
  const int64_t want = (a.select_ld + kScoreWarps * 32 - 1) / (kScoreWarps * 32);
  const unsigned gy = static_cast<unsigned>(std::clamp<int64_t>(std::min(want, g.fill), 1, 65535));
  KVF_RETURN_IF_ERROR(DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
      KnormScoreKernel<HD, T><<<dim3(static_cast<unsigned>(g.items), gy), kScoreWarps * 32, 0, stream>>>(a);
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

Status KnormStoreCuda(const void* args, const LaunchInfo& info, void* stream) {
  (void)info;
  const KnormStoreArgs& a = *static_cast<const KnormStoreArgs*>(args);
  if (a.new_len <= a.pos0) return Status::Ok();
  KVF_CHECK_ARG(a.state.norms != nullptr && a.new_len <= a.state.cap && a.store.pages != nullptr,
                "knorm store: rows up to ", a.new_len, " for ", a.state.cap, " norms, or no page table");
  const int64_t rows = a.new_len - a.pos0;
  const dim3 grid(static_cast<unsigned>(a.num_kv_heads), static_cast<unsigned>((rows + kStoreWarps - 1) / kStoreWarps));
  return DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
      KnormStoreKernel<HD, T><<<grid, kStoreWarps * 32, 0, static_cast<cudaStream_t>(stream)>>>(a);
      KVF_CUDA_CHECK_LAUNCH(KnormStoreKernel);
      return Status::Ok();
    });
  });
}

}  // namespace kvferry::cuda
