// Copyright kvferry authors. Apache-2.0.
// Quest's selection on the GPU (policies/quest/device_selector.cpp): per page of meta_page keys
// the element-wise min and max (the page bounds, extended by QuestAppendKernel for the new token
// and recomputed by PageBoundsKernel at each store of rows), each page's bound on q.k, then the
// pages' top-k (gpu/decode_select.cu). The host twin is policies/quest/select_host.cpp.

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
#include "policies/quest/select.h"

namespace kvferry::cuda {
namespace {

template <typename T>
__device__ void RecomputePage(char* meta_t, const unsigned long long* pages, uint32_t page_tokens,
                              int head_dim, int64_t pg, int64_t n, int page, const void* new_k,
                              DType k_dtype, int64_t new_k_off) {
  const size_t row_bytes = static_cast<size_t>(head_dim) * sizeof(T);
  T* lo_out = reinterpret_cast<T*>(meta_t + static_cast<size_t>(pg) * 2 * row_bytes);
  T* hi_out = lo_out + head_dim;
  const int64_t end = min((pg + 1) * page, n);
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t pos = pg * page; pos < end; ++pos) {
      float x;
      if (new_k != nullptr && pos == n - 1) {
        x = ToF32(FromF32<T>(LoadElem(new_k, k_dtype, new_k_off + i)));
      } else {
        x = ToF32(reinterpret_cast<const T*>(StoreKRow(pages, pos, page_tokens, row_bytes))[i]);
      }
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    lo_out[i] = FromF32<T>(lo);
    hi_out[i] = FromF32<T>(hi);
  }
}

// Grid (num_kv_heads, pages of the chunk): a prefill chunk's pages.
template <typename T>
__global__ void PageBoundsKernel(PageBoundsArgs a) {
  const int h = blockIdx.x;
  const int64_t pg = a.pos0 / a.meta_page + blockIdx.y;
  const int64_t t = (static_cast<int64_t>(a.slot) * a.num_layers + a.layer) * a.num_kv_heads + h;
  const size_t meta_bytes = static_cast<size_t>(a.meta_pages) * 2 * a.params.head_dim * sizeof(T);
  RecomputePage<T>(a.meta + t * meta_bytes,
                   reinterpret_cast<const unsigned long long*>(a.store.pages) + t * a.store.max_pages,
                   static_cast<uint32_t>(a.store.page_tokens), a.params.head_dim, pg, a.new_len,
                   a.meta_page, nullptr, DType::kF32, 0);
}

// Grid (items): the new token's page of every item, before the step scores pages.
template <typename T>
__global__ void QuestAppendKernel(DecodeStepArgs a) {
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int64_t slot = a.slots[b];
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int64_t t = (slot * a.num_layers + a.layer) * a.num_kv_heads + h;
  const size_t meta_bytes = static_cast<size_t>(a.meta_pages) * 2 * a.params.head_dim * sizeof(T);
  RecomputePage<T>(a.meta + t * meta_bytes,
                   reinterpret_cast<const unsigned long long*>(a.store.pages) + t * a.store.max_pages,
                   static_cast<uint32_t>(a.store.page_tokens), a.params.head_dim, (n - 1) / a.meta_page,
                   n, a.meta_page, a.k, a.k_dtype, static_cast<int64_t>(item) * a.params.head_dim);
}


template <int HD, typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) QuestScoreKernel(DecodeStepArgs a) {
  constexpr int kE = HD / 32;
  extern __shared__ float q_s[];  // [group][HD]
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int group = a.params.group;
  const int64_t slot = a.slots[b];
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const ItemSplit s = ItemSplitOf(a, n);
  if (s.all || s.k_off <= 0) return;
  const int64_t t = (slot * a.num_layers + a.layer) * a.num_kv_heads + h;
  const int64_t q0 = static_cast<int64_t>(item) * group * HD;
  for (int i = threadIdx.x; i < group * HD; i += blockDim.x) q_s[i] = LoadElem(a.q, a.q_dtype, q0 + i);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* meta = reinterpret_cast<const T*>(a.meta) + static_cast<size_t>(t) * a.meta_pages * 2 * HD;
  float* out = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp; i < s.np;
       i += static_cast<int64_t>(gridDim.y) * kScoreWarps) {
    const T* lo = meta + static_cast<size_t>(s.p_lo + i) * 2 * HD + lane * kE;
    const T* hi = lo + HD;
    float lx[kE], hx[kE];
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      lx[e] = ToF32(lo[e]);
      hx[e] = ToF32(hi[e]);
    }
    for (int g = 0; g < group; ++g) {
      const float* qg = q_s + g * HD + lane * kE;
      float acc = 0.0f;
#pragma unroll
      for (int e = 0; e < kE; ++e) acc += fmaxf(qg[e] * lx[e], qg[e] * hx[e]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      if (lane == 0) out[static_cast<size_t>(g) * a.select_ld + i] = a.params.scale * acc;
    }
  }
}


Status QuestSelect(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream,
                   const SelectGrid& g) {
  KVF_CHECK_ARG(a.meta != nullptr && a.meta_pages >= 1, "DecodeSelect: quest without page bounds");
  KVF_CHECK_ARG(SelectSortCap(a) <= kTopKSmemItems, "DecodeSelect: quest budget ", a.budget_cap,
                " over ", kTopKSmemItems, " pages of ", a.meta_page);
  const int64_t pages = (a.select_ld + a.meta_page - 1) / a.meta_page;
  const unsigned gy = static_cast<unsigned>(
      std::clamp<int64_t>(std::min((pages + kScoreWarps * 4 - 1) / (kScoreWarps * 4), g.fill), 1, 65535));
  KVF_RETURN_IF_ERROR(DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
      QuestAppendKernel<T><<<static_cast<unsigned>(g.items), 128, 0, stream>>>(a);
      KVF_CUDA_CHECK_LAUNCH(QuestAppendKernel);
      if (a.select_skip_ranking) return Status::Ok();  // the page bounds are current
      if (g.q_smem > 48 * 1024) {
        KVF_CUDA_CHECK(cudaFuncSetAttribute(QuestScoreKernel<HD, T>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(g.q_smem)));
      }
      QuestScoreKernel<HD, T><<<dim3(static_cast<unsigned>(g.items), gy), kScoreWarps * 32, g.q_smem,
                                stream>>>(a);
      KVF_CUDA_CHECK_LAUNCH(QuestScoreKernel);
      return Status::Ok();
    });
  }));
  if (a.select_skip_ranking) return Status::Ok();
  KVF_RETURN_IF_ERROR(LaunchSelectTopK(a, info, SelectTopKPath::kAuto, stream));
  return LaunchPsawFilter(a, stream);
}
}  // namespace

Status QuestSelectCuda(const void* args, const LaunchInfo& info, void* stream) {
  return SelectLauncher<QuestSelect>(args, info, stream);
}

Status QuestPageBoundsCuda(const void* args, const LaunchInfo& info, void* stream_ptr) {
  (void)info;
  const PageBoundsArgs& a = *static_cast<const PageBoundsArgs*>(args);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (a.new_len <= a.pos0) return Status::Ok();
  KVF_CHECK_ARG(a.meta != nullptr && a.store.pages != nullptr && a.meta_page >= 1,
                "PageBounds: null page bounds or page table");
  const int64_t pages = (a.new_len - 1) / a.meta_page - a.pos0 / a.meta_page + 1;
  KVF_CHECK_ARG(pages <= 65535, "PageBounds: ", pages, " pages in one chunk");
  return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
    PageBoundsKernel<T><<<dim3(static_cast<unsigned>(a.num_kv_heads), static_cast<unsigned>(pages)),
                          128, 0, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(PageBoundsKernel);
    return Status::Ok();
  });
}

}  // namespace kvferry::cuda
