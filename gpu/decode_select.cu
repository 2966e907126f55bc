// Copyright kvferry authors. Apache-2.0.
// The selection of a planned decode step on the GPU (DecodeStepArgs::scoring), ahead of the step's
// attention on the same stream. kExactTopK (the oracle) in two launches:
//   1. score: grid (items, y), a warp per key: scale * log2(e) * q_g . k_j for every query head g
//      of the item's GQA group, into select_ws[item][g][j]. Keys are read where they lie (resident
//      tier, or the host store zero-copy); the new token's key from the caller's input, rounded
//      to the KV dtype as the append will store it.
//   2. top-k: a CTA per item: per head the softmax max and sum, the group's summed weight per
//      position (written over row g = 0), the exact top-k (topk.cuh), then the winners re-sorted
//      by position into the item's list.
// Grid shapes come from capacities and every per-step value (slots, lengths, budgets) is read on
// the device, so the launches can be captured in a CUDA graph.

#include <algorithm>

#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "gpu/topk.cuh"
#include "runtime/check.h"

namespace kvferry::cuda {
namespace {

constexpr int kScoreWarps = 8;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
__device__ __forceinline__ float ToF32(T x);
template <>
__device__ __forceinline__ float ToF32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float ToF32(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T FromF32(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 FromF32(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half FromF32(float x) { return __float2half_rn(x); }

// Grid (items, y), kScoreWarps warps: warp w of CTA y scores positions y * warps + w, striding by
// gridDim.y * warps. Each lane holds HD / 32 consecutive elements of the key.
template <int HD, typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) SelectScoreKernel(DecodeStepArgs a) {
  constexpr int kE = HD / 32;
  extern __shared__ float q_s[];  // [group][HD] fp32
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int group = a.params.group;
  const int64_t slot = a.slots[b];
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int64_t t = (slot * a.num_layers + a.layer) * a.num_kv_heads + h;
  const int64_t q0 = static_cast<int64_t>(item) * group * HD;
  const float qscale = a.params.scale * kLog2e;
  for (int i = threadIdx.x; i < group * HD; i += blockDim.x) {
    q_s[i] = LoadElem(a.q, a.q_dtype, q0 + i) * qscale;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t row_bytes = HD * sizeof(T);
  const char* res_k =
      a.resident + static_cast<size_t>(t * 2 * (static_cast<int64_t>(a.sink) + a.window)) * row_bytes;
  const unsigned long long* pages = reinterpret_cast<const unsigned long long*>(a.pages) + t * a.max_pages;
  const uint32_t pt = static_cast<uint32_t>(a.page_tokens);
  float* out = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  for (int64_t j = static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp; j < n;
       j += static_cast<int64_t>(gridDim.y) * kScoreWarps) {
    float kx[kE];
    if (j == n - 1) {  // the new token: from the input, as the append will store it
      const int64_t src = static_cast<int64_t>(item) * HD + lane * kE;
#pragma unroll
      for (int e = 0; e < kE; ++e) kx[e] = ToF32(FromF32<T>(LoadElem(a.k, a.k_dtype, src + e)));
    } else {
      const int64_t row = ResidentRowOf(j, n, a.sink, a.window);
      const T* kp;
      if (row >= 0) {
        kp = reinterpret_cast<const T*>(res_k + static_cast<size_t>(row) * row_bytes);
      } else {
        const uint32_t p = static_cast<uint32_t>(j);
        const char* base = reinterpret_cast<const char*>(__ldg(pages + p / pt));
        kp = reinterpret_cast<const T*>(base + static_cast<size_t>(p % pt) * row_bytes);
      }
      if constexpr (kE == 4) {  // 8 bytes a lane
        const uint2 raw = *reinterpret_cast<const uint2*>(kp + lane * kE);
        const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int e = 0; e < kE; ++e) kx[e] = ToF32(x[e]);
      } else {
#pragma unroll
        for (int e = 0; e < kE; ++e) kx[e] = ToF32(kp[lane * kE + e]);
      }
    }
    for (int g = 0; g < group; ++g) {
      const float* qg = q_s + g * HD + lane * kE;
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < kE; ++e) s = fmaf(qg[e], kx[e], s);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (lane == 0) out[static_cast<size_t>(g) * a.select_ld + j] = s;
    }
  }
}

// Reduces x over the CTA (kTopKThreads threads) with op; every thread gets the result.
template <typename Op>
__device__ __forceinline__ float BlockReduce(float x, Op op, float* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, off));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  float r = red[0];
  for (int i = 1; i < kTopKThreads / 32; ++i) r = op(r, red[i]);
  return r;
}

// A CTA per item: group weights over row g = 0, top-k, list ascending.
__global__ void __launch_bounds__(kTopKThreads) SelectTopKKernel(DecodeStepArgs a, int sort_cap) {
  extern __shared__ unsigned long long sort_smem[];
  __shared__ float red[kTopKThreads / 32];
  __shared__ float m_s[64], inv_s[64];
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads;
  const int group = a.params.group;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  int64_t k = StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n);
  if (k > n) k = n;
  float* l = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  for (int g = 0; g < group; ++g) {
    const float* lg = l + static_cast<size_t>(g) * a.select_ld;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, lg[j]);
    m = BlockReduce(m, [](float x, float y) { return fmaxf(x, y); }, red);
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += exp2f(lg[j] - m);
    s = BlockReduce(s, [](float x, float y) { return x + y; }, red);
    if (threadIdx.x == 0) {
      m_s[g] = m;
      inv_s[g] = 1.0f / s;
    }
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    float w = 0.0f;
    for (int g = 0; g < group; ++g) w += exp2f(l[static_cast<size_t>(g) * a.select_ld + j] - m_s[g]) * inv_s[g];
    l[j] = w;  // only this thread reads position j
  }
  __syncthreads();
  int sort_n = 1;
  while (sort_n < k) sort_n <<= 1;
  unsigned long long* sel = sort_cap <= kTopKSmemItems
                                ? sort_smem
                                : a.topk_ws + static_cast<size_t>(item) * sort_cap;
  TopKSelect(l, n, static_cast<int>(k), sort_n, sel);
  // Re-sort the winners by position: the list is ascending, as the host policies return it.
  for (int i = threadIdx.x; i < sort_n; i += blockDim.x) {
    sel[i] = i < k ? (sel[i] & 0xffffffffull) : ~0ull;
  }
  BitonicSortBlock(sel, sort_n);
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  for (int i = threadIdx.x; i < k; i += blockDim.x) out[i] = static_cast<int32_t>(sel[i]);
  if (threadIdx.x == 0) a.list_count[item] = static_cast<int32_t>(k);
}

}  // namespace

Status LaunchDecodeSelect(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream) {
  if (a.batch == 0 || a.scoring == SelectScoring::kNone) return Status::Ok();
  KVF_RETURN_IF_ERROR(CheckAttnShape(a.params));
  KVF_CHECK_ARG(a.scoring == SelectScoring::kExactTopK, "DecodeSelect: unknown scoring ",
                static_cast<int>(a.scoring));
  KVF_CHECK_ARG(a.list != nullptr && a.list_count != nullptr && a.select_ws != nullptr &&
                    a.slots != nullptr && a.positions != nullptr && a.pages != nullptr,
                "DecodeSelect: null list, workspace, slots, positions or page table");
  KVF_CHECK_ARG(a.params.group <= 64, "DecodeSelect: group ", a.params.group, " > 64");
  KVF_CHECK_ARG(a.budget_cap >= 1 && a.list_cap >= a.budget_cap && a.budget_cap < (int64_t{1} << 30),
                "DecodeSelect: list_cap ", a.list_cap, " < budget_cap ", a.budget_cap);
  int64_t sort_cap = 1;
  while (sort_cap < a.budget_cap) sort_cap <<= 1;
  KVF_CHECK_ARG(sort_cap <= kTopKSmemItems || a.topk_ws != nullptr,
                "DecodeSelect: budget_cap ", a.budget_cap, " needs a top-k workspace");
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  const int64_t want = (a.select_ld + kScoreWarps * 8 - 1) / (kScoreWarps * 8);
  const int64_t fill = std::max<int64_t>(1, int64_t{info.num_sms} * 8 / items);
  const unsigned gy = static_cast<unsigned>(std::clamp<int64_t>(std::min(want, fill), 1, 65535));
  const size_t q_smem = static_cast<size_t>(a.params.group) * a.params.head_dim * sizeof(float);
  KVF_RETURN_IF_ERROR(DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
      if (q_smem > 48 * 1024) {
        KVF_CUDA_CHECK(cudaFuncSetAttribute(
            SelectScoreKernel<HD, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
            static_cast<int>(q_smem)));
      }
      SelectScoreKernel<HD, T><<<dim3(static_cast<unsigned>(items), gy), kScoreWarps * 32, q_smem,
                                 stream>>>(a);
      KVF_CUDA_CHECK_LAUNCH(SelectScoreKernel);
      return Status::Ok();
    });
  }));
  const size_t smem = sort_cap <= kTopKSmemItems ? sort_cap * sizeof(unsigned long long) : 0;
  SelectTopKKernel<<<static_cast<unsigned>(items), kTopKThreads, smem, stream>>>(
      a, static_cast<int>(sort_cap));
  KVF_CUDA_CHECK_LAUNCH(SelectTopKKernel);
  return Status::Ok();
}

}  // namespace kvferry::cuda
