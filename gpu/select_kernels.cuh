// Copyright kvferry authors. Apache-2.0.
#pragma once
// Device-side building blocks of the decode step's selection (docs/design.md, "Device
// selection"): what the top-k (gpu/decode_select.cu) and the policies' scoring kernels
// (policies/*/select.cu) share. An item is (sequence of the batch, KV head); its list is the
// sinks, the top of the offloaded range and the window (the split of base/offload_split.h).

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "base/attn_types.h"
#include "base/check.h"
#include "gpu/convert.cuh"
#include "gpu/cuda_kernels.h"
#include "gpu/topk.cuh"

namespace kvferry::cuda {
namespace {

constexpr int kScoreWarps = 8;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ int64_t ItemT(const DecodeStepArgs& a, int32_t b, int32_t h) {
  return (static_cast<int64_t>(a.slots[b]) * a.num_layers + a.layer) * a.num_kv_heads + h;
}

// Grid (items, y), kScoreWarps warps: warp w of CTA y scores positions y * warps + w, striding by
// gridDim.y * warps. Each lane holds HD / 32 consecutive elements of the key. kCompact (SparCas's
// dense layers): the keys other than the new token's come from the item's compact rows in device
// memory, which hold every dimension there (SparcasGatherKernel keeps them current), instead of
// the host store read over PCIe: Compact::Of<T>(a, b, h) is the item's first row (void: none).
template <int HD, typename T, typename Compact = void>
__global__ void __launch_bounds__(kScoreWarps * 32) SelectScoreKernel(DecodeStepArgs a) {
  constexpr int kE = HD / 32;
  constexpr bool kCompact = !std::is_void_v<Compact>;
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
  const unsigned long long* pages = reinterpret_cast<const unsigned long long*>(a.store.pages) + t * a.store.max_pages;
  const uint32_t pt = static_cast<uint32_t>(a.store.page_tokens);
  float* out = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  for (int64_t j = static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp; j < n;
       j += static_cast<int64_t>(gridDim.y) * kScoreWarps) {
    float kx[kE];
    if (j == n - 1) {  // the new token: from the input, as the append will store it
      const int64_t src = static_cast<int64_t>(item) * HD + lane * kE;
#pragma unroll
      for (int e = 0; e < kE; ++e) kx[e] = ToF32(FromF32<T>(LoadElem(a.k, a.k_dtype, src + e)));
    } else {
      const int64_t row = kCompact ? -1 : ResidentRowOf(j, n, a.sink, a.window);
      const T* kp;
      if constexpr (kCompact) {
        kp = Compact::template Of<T>(a, b, h) + j * HD;
      } else if (row >= 0) {
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


__device__ __forceinline__ const char* StoreKRow(const unsigned long long* pages, int64_t pos,
                                                 uint32_t page_tokens, size_t row_bytes) {
  const uint32_t p = static_cast<uint32_t>(pos);
  return reinterpret_cast<const char*>(__ldg(pages + p / page_tokens)) +
         static_cast<size_t>(p % page_tokens) * row_bytes;
}

// Bounds of page pg of one KV head over store rows [pg * page, min(.., n)); row n - 1 from
// new_k (k_dtype, rounded to T) when set. The CTA's threads split the dimensions.

// The offloaded range of an item (as policies/select_util's SplitPositions).
struct ItemSplit {
  int64_t sinks, off_lo, off_hi, k_off, p_lo, np;
  bool all;
};

__device__ __forceinline__ ItemSplit ItemSplitOf(const DecodeStepArgs& a, int64_t n) {
  ItemSplit s;
  s.sinks = min(max(static_cast<int64_t>(a.sink), int64_t{0}), n);
  s.off_lo = s.sinks;
  s.off_hi = max(s.sinks, n - max(a.window, 0));
  const int64_t budget = StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n);
  s.k_off = budget - (s.sinks + (n - s.off_hi));
  s.all = s.k_off >= s.off_hi - s.off_lo;
  s.p_lo = s.off_lo / a.meta_page;
  s.np = s.off_hi > s.off_lo ? (s.off_hi - 1) / a.meta_page + 1 - s.p_lo : 0;
  return s;
}

// An item's list written by the CTA around its ranked positions (Quest, SparCas, HiP): the head,
// every position when the split takes all (with the count: true, the list is done), else the
// sinks ...
__device__ __forceinline__ bool WriteListHead(const DecodeStepArgs& a, int32_t item,
                                              const ItemSplit& s, int64_t n, int32_t* out) {
  if (s.all) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = static_cast<int32_t>(i);
    if (threadIdx.x == 0) a.list_count[item] = static_cast<int32_t>(n);
    return true;
  }
  for (int64_t i = threadIdx.x; i < s.sinks; i += blockDim.x) out[i] = static_cast<int32_t>(i);
  return false;
}

// What a list kernel's CTA knows of its item first: the batch entry b, the positions n (its new
// token's + 1), the split of [0, n) and the item's list.
struct ListItem {
  int32_t b;
  int64_t n;
  ItemSplit s;
  int32_t* out;
};
__device__ __forceinline__ ListItem ListItemOf(const DecodeStepArgs& a, int32_t item) {
  ListItem li;
  li.b = item / a.num_kv_heads;
  li.n = a.positions[static_cast<int64_t>(li.b) * a.num_layers + a.layer] + 1;
  li.s = ItemSplitOf(a, li.n);
  li.out = a.list + static_cast<size_t>(item) * a.list_cap;
  return li;
}

// ... and, after the sinks and the `taken` ranked positions, the window [off_hi, n) and the count.
__device__ __forceinline__ void WriteListTail(const DecodeStepArgs& a, int32_t item, int64_t sinks,
                                              int64_t off_hi, int64_t n, int64_t taken,
                                              int32_t* out) {
  const int64_t w0 = sinks + taken;
  for (int64_t i = off_hi + threadIdx.x; i < n; i += blockDim.x) {
    out[w0 + (i - off_hi)] = static_cast<int32_t>(i);
  }
  if (threadIdx.x == 0) a.list_count[item] = static_cast<int32_t>(w0 + (n - off_hi));
}

// Pages a Quest item ranks (enough to fill k_off even when the first and last are cut).
__device__ __forceinline__ int64_t PagesWanted(const DecodeStepArgs& a, const ItemSplit& s) {
  return min(s.np, s.k_off / a.meta_page + 3);
}

// What an item's top-k stage ranks this step, and whether the multi-CTA path takes it (count >=
// mcta_min; the one-CTA kernels take every other item, trivial lists included).
struct TopKItem {
  int64_t n = 0;      // scores of the softmax (max) reduction: row positions [0, n)
  int64_t lo = 0;     // the top k of row positions [lo, lo + count)
  int64_t count = 0;
  int64_t k = 0;
  bool mcta = false;
};

__device__ __forceinline__ TopKItem TopKItemOf(const DecodeStepArgs& a, int32_t item,
                                               int64_t mcta_min) {
  const int32_t b = item / a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  TopKItem t;
  if (a.ranks == SelectRanks::kPositions) {
    t.n = n;
    t.count = n;
    t.k = min(StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n), n);
  } else {
    const ItemSplit s = ItemSplitOf(a, n);
    if (s.all || s.k_off <= 0) return t;  // no ranking: the one-CTA kernel writes the list
    if (a.ranks == SelectRanks::kPages) {
      t.n = s.np;
      t.count = s.np;
      t.k = PagesWanted(a, s);
    } else {
      t.n = n;
      t.lo = s.off_lo;
      t.count = s.off_hi - s.off_lo;
      t.k = s.k_off;
    }
  }
  t.mcta = t.k >= 1 && t.count >= mcta_min;
  return t;
}

// The fused multi-CTA top-k's barrier counter of an item (the second-to-last word of its scratch).
__device__ __forceinline__ unsigned* MctaBarrierOf(const DecodeStepArgs& a, int32_t item) {
  const int64_t words = SelectMctaItemWords(a.params.group);
  return reinterpret_cast<unsigned*>(a.select_mcta_ws + static_cast<size_t>(item) * words + words - 2);
}

// Whether the multi-CTA top-k takes the item (the one-CTA kernel then leaves it to it). Every
// one-CTA kernel runs before the multi-CTA launches on the stream and zeroes here the item's
// barrier counter, which the fused kernel counts up from.
__device__ __forceinline__ bool MctaTakes(const DecodeStepArgs& a, int32_t item, int64_t mcta_min) {
  if (a.select_mcta_ws != nullptr && threadIdx.x == 0) *MctaBarrierOf(a, item) = 0;
  return TopKItemOf(a, item, mcta_min).mcta;
}

// Grid (items, y), a warp per page of the offloaded range: ub[item][g][p - p_lo].

template <typename Elem>
__device__ __forceinline__ void PackQ8HeadWarp(const Elem& x, int len, int words, int lane,
                                               int2* pack, float* step, int32_t* sum8) {
  float amax = 0.0f;
  for (int i = lane; i < len; i += 32) amax = fmaxf(amax, fabsf(x(i)));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float inv = SparcasQ8Inv(amax);
  int32_t sum = 0;
  for (int w = lane; w < words; w += 32) {
    uint32_t even = 0, odd = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int32_t c = SparcasQ8Code(x(w * 8 + e), inv);
      sum += c;
      const uint32_t byte = static_cast<uint32_t>(c) & 0xFFu;
      if (e % 2 == 0) {
        even |= byte << (8 * (e / 2));
      } else {
        odd |= byte << (8 * (e / 2));
      }
    }
    pack[w] = make_int2(static_cast<int>(even), static_cast<int>(odd));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    *step = SparcasQ8Step(amax);
    *sum8 = 8 * sum;
  }
}


// The multi-CTA top-k's per-item scratch and the online softmax's folds, used by the SparCas
// 4-bit scoring (its partial statistics) and the top-k passes below.
struct MctaScratch {
  uint32_t* hist;  // [4][256]
  int32_t* counts;  // [kSelectMctaMaxCtas][2]: keys > T, keys == T
  float2* stats;   // [group][kSelectMctaStatsSlots]: (max, sum of exp2(l - max)) a CTA
  int32_t* picks;  // [kSelectMctaMaxPicks] Quest's winning pages, ascending
  uint32_t* hist12;  // [1 << kSelectMctaBucketBits]: the fused top-k's first digit
  uint32_t* cand_count;  // keys listed in cand
  uint2* cand;     // [kSelectMctaCandCap] (key, position) of the k-th key's bucket, any order
};

__device__ __forceinline__ MctaScratch MctaScratchOf(const DecodeStepArgs& a, int32_t item) {
  uint32_t* w = a.select_mcta_ws + static_cast<size_t>(item) * SelectMctaItemWords(a.params.group);
  MctaScratch s;
  s.hist = w;
  s.counts = reinterpret_cast<int32_t*>(w + 4 * 256);
  s.stats = reinterpret_cast<float2*>(w + 4 * 256 + 2 * kSelectMctaMaxCtas);
  s.picks = reinterpret_cast<int32_t*>(w + 4 * 256 + 2 * kSelectMctaMaxCtas +
                                       2 * a.params.group * kSelectMctaStatsSlots);
  s.hist12 = reinterpret_cast<uint32_t*>(s.picks + kSelectMctaMaxPicks);
  s.cand_count = s.hist12 + (1 << kSelectMctaBucketBits);
  s.cand = reinterpret_cast<uint2*>(s.cand_count + 2);
  return s;
}

// Zeroes an item's histograms and candidate count before a top-k fills them (the CTA calls it).
__device__ __forceinline__ void MctaZeroHistograms(const MctaScratch& ws) {
  for (int i = threadIdx.x; i < 4 * 256; i += blockDim.x) ws.hist[i] = 0;
  for (int i = threadIdx.x; i < (1 << kSelectMctaBucketBits); i += blockDim.x) ws.hist12[i] = 0;
  if (threadIdx.x == 0) *ws.cand_count = 0;
}

// fmaxf as a reduction operator.
struct FMaxOp {
  __device__ __forceinline__ float operator()(float x, float y) const { return fmaxf(x, y); }
};

// Folds (v, 1) into the running (max, sum of exp2(x - max)) pair (m, s).
__device__ __forceinline__ void SoftmaxAdd(float& m, float& s, float v) {
  const float nm = fmaxf(m, v);
  if (nm == -INFINITY) return;  // nothing but -inf so far
  s = s * exp2f(m - nm) + exp2f(v - nm);
  m = nm;
}
// Merges the pair (m2, s2) into (m, s).
__device__ __forceinline__ void SoftmaxMerge(float& m, float& s, float m2, float s2) {
  const float nm = fmaxf(m, m2);
  if (nm == -INFINITY) return;
  s = (m == -INFINITY ? 0.0f : s * exp2f(m - nm)) + (m2 == -INFINITY ? 0.0f : s2 * exp2f(m2 - nm));
  m = nm;
}


constexpr int kSparcasQ4Heads = 8;
constexpr int kQ4Chunk = 8;  // row words loaded before they are used

// Merges every thread's running (max, sum) of heads [g0, g0 + kHeads) of the group (kMaxOnly:
// the max alone, the sum written 0) over the CTA of kThreads and writes them to slot blockIdx.y of
// stats (a head's kSelectMctaStatsSlots slots); synchronises the CTA on return.
template <int kThreads, int kHeads, bool kMaxOnly = false>
__device__ void WriteSoftmaxPartials(float (&st_m)[kHeads], float (&st_s)[kHeads], int g0, int group,
                                     float2* stats) {
  __shared__ float red_m[kThreads / 32][kHeads], red_s[kThreads / 32][kHeads];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto merge = [](float& m, float& s, float m2, float s2) {
    if (kMaxOnly) {
      m = fmaxf(m, m2);
    } else {
      SoftmaxMerge(m, s, m2, s2);
    }
  };
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      merge(st_m[g], st_s[g], __shfl_xor_sync(0xffffffffu, st_m[g], off),
            __shfl_xor_sync(0xffffffffu, st_s[g], off));
    }
    if (lane == 0) {
      red_m[warp][g] = st_m[g];
      red_s[warp][g] = st_s[g];
    }
  }
  __syncthreads();
  const int g = static_cast<int>(threadIdx.x);
  if (g < kHeads && g0 + g < group) {
    float mm = -INFINITY, ss = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) merge(mm, ss, red_m[w][g], red_s[w][g]);
    stats[(g0 + g) * kSelectMctaStatsSlots + blockIdx.y] = make_float2(mm, kMaxOnly ? 0.0f : ss);
  }
  __syncthreads();  // red_* are rewritten by the next call
}


}  // namespace
}  // namespace kvferry::cuda
