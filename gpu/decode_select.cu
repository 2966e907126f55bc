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
// the device, so the launches can be captured in a CUDA graph. Items that rank many scores
// (kSelectMctaMinKeys) take the multi-CTA top-k below instead of step 2's one CTA (see "Multi-CTA
// top-k" and docs/cuda.md).

#include <cuda/atomic>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <limits>

#include "base/hip_mask.h"
#include "base/psaw.h"
#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "gpu/topk.cuh"
#include "base/check.h"

namespace kvferry::cuda {
namespace {

constexpr int kScoreWarps = 8;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ int64_t ItemT(const DecodeStepArgs& a, int32_t b, int32_t h) {
  return (static_cast<int64_t>(a.slots[b]) * a.num_layers + a.layer) * a.num_kv_heads + h;
}

template <typename T>
__device__ __forceinline__ T* CompactOf(const DecodeStepArgs& a, int32_t b, int32_t h) {
  return reinterpret_cast<T*>(a.meta) +
         SparcasCompactOffset(a.slots[b], a.layer, h, a.num_layers, a.num_kv_heads, a.meta_pages,
                              a.params.head_dim, a.sparcas.db, a.sparcas.dense_layers, a.sparcas.bits);
}

// Grid (items, y), kScoreWarps warps: warp w of CTA y scores positions y * warps + w, striding by
// gridDim.y * warps. Each lane holds HD / 32 consecutive elements of the key. kCompact (SparCas's
// dense layers): the keys other than the new token's come from the item's compact rows in device
// memory, which hold every dimension there (SparcasGatherKernel keeps them current), instead of
// the host store read over PCIe.
template <int HD, typename T, bool kCompact = false>
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
        kp = CompactOf<T>(a, b, h) + j * HD;
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

// ---- kQuestPages --------------------------------------------------------------------------------

__device__ __forceinline__ const char* StoreKRow(const unsigned long long* pages, int64_t pos,
                                                 uint32_t page_tokens, size_t row_bytes) {
  const uint32_t p = static_cast<uint32_t>(pos);
  return reinterpret_cast<const char*>(__ldg(pages + p / page_tokens)) +
         static_cast<size_t>(p % page_tokens) * row_bytes;
}

// Bounds of page pg of one KV head over store rows [pg * page, min(.., n)); row n - 1 from
// new_k (k_dtype, rounded to T) when set. The CTA's threads split the dimensions.
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

// The offloaded range of an item (as policies/select_util's SplitPositions).
struct QuestSplit {
  int64_t sinks, off_lo, off_hi, k_off, p_lo, np;
  bool all;
};

__device__ __forceinline__ QuestSplit QuestSplitOf(const DecodeStepArgs& a, int64_t n) {
  QuestSplit s;
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
                                              const QuestSplit& s, int64_t n, int32_t* out) {
  if (s.all) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = static_cast<int32_t>(i);
    if (threadIdx.x == 0) a.list_count[item] = static_cast<int32_t>(n);
    return true;
  }
  for (int64_t i = threadIdx.x; i < s.sinks; i += blockDim.x) out[i] = static_cast<int32_t>(i);
  return false;
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
__device__ __forceinline__ int64_t QuestWant(const DecodeStepArgs& a, const QuestSplit& s) {
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
  if (a.scoring == SelectScoring::kExactTopK) {
    t.n = n;
    t.count = n;
    t.k = min(StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n), n);
  } else {
    const QuestSplit s = QuestSplitOf(a, n);
    if (s.all || s.k_off <= 0) return t;  // no ranking: the one-CTA kernel writes the list
    if (a.scoring == SelectScoring::kQuestPages) {
      t.n = s.np;
      t.count = s.np;
      t.k = QuestWant(a, s);
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
template <int HD, typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) QuestScoreKernel(DecodeStepArgs a) {
  constexpr int kE = HD / 32;
  extern __shared__ float q_s[];  // [group][HD]
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int group = a.params.group;
  const int64_t slot = a.slots[b];
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const QuestSplit s = QuestSplitOf(a, n);
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

// Reduces x over the CTA (a multiple of 32 threads, at most kTopKThreads) with op; every thread
// gets the result.
template <typename Op>
__device__ __forceinline__ float BlockReduce(float x, Op op, float* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, off));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  float r = red[0];
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int i = 1; i < warps; ++i) r = op(r, red[i]);
  return r;
}

// The group's summed softmax weight of every position [0, n) of the logits l (row g at
// l + g * ld, log2 domain) over row 0, then the top k of positions [lo, lo + count) into sel, re-sorted
// by position (sel[i] = position - lo for i < k). Every thread of a kTopKThreads CTA calls it.
__device__ void GroupWeightsTopK(float* l, int64_t ld, int group, int64_t n, int64_t lo,
                                 int64_t count, int64_t k, unsigned long long* sel, int& sort_n) {
  __shared__ float red[kTopKThreads / 32];
  __shared__ float m_s[64], inv_s[64];
  for (int g = 0; g < group; ++g) {
    const float* lg = l + static_cast<size_t>(g) * ld;
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
    for (int g = 0; g < group; ++g) w += exp2f(l[static_cast<size_t>(g) * ld + j] - m_s[g]) * inv_s[g];
    l[j] = w;  // only this thread reads position j
  }
  __syncthreads();
  sort_n = 1;
  while (sort_n < k) sort_n <<= 1;
  TopKSelect(l + lo, count, static_cast<int>(k), sort_n, sel);
  // Re-sort the winners by position: lists are ascending, as the host policies return them.
  for (int i = threadIdx.x; i < sort_n; i += blockDim.x) {
    sel[i] = i < k ? (sel[i] & 0xffffffffull) : ~0ull;
  }
  BitonicSortBlock(sel, sort_n);
}


// The pages of sel[0, want) (ranked: (~key << 32 | page - p_lo), best first; sel has sort_n
// entries, sort_n a power of two >= want, at most kTopKSmemItems) walked by score until k_off
// positions are taken, their positions written to out[s.sinks, ...) ascending. Returns the count
// taken (every thread). sel and offs (sort_n ints) in shared memory; every thread of the CTA
// (kTopKThreads of them) calls. The walk and the offsets are block scans (four entries a thread):
// a serial walk by one thread took about half of the 38 us MctaQuestListKernel spent a layer at
// 8K pages.
__device__ int64_t QuestTakePages(const DecodeStepArgs& a, const QuestSplit& s,
                                  unsigned long long* sel, int32_t* offs, int sort_n, int64_t want,
                                  int32_t* out) {
  constexpr int kPer = kTopKSmemItems / kTopKThreads;
  using Scan = cub::BlockScan<int32_t, kTopKThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int base = static_cast<int>(threadIdx.x) * kPer;
  // Positions each ranked page holds in the offloaded range, and how many the pages ranked above
  // it hold: page i takes min(len, k_off - above) when that is positive.
  int32_t len[kPer], above[kPer];
  int64_t pg[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = base + u;
    len[u] = 0;
    pg[u] = 0;
    if (i < want && i < sort_n) {
      pg[u] = s.p_lo + static_cast<int64_t>(sel[i] & 0xffffffffu);
      const int64_t lo = max(pg[u] * a.meta_page, s.off_lo);
      len[u] = static_cast<int32_t>(min((pg[u] + 1) * a.meta_page, s.off_hi) - lo);
    }
  }
  int32_t ranked_total = 0;
  Scan(scan_tmp).ExclusiveSum(len, above, ranked_total);
  __syncthreads();  // every thread has read sel (and the scan's storage) before either is rewritten
  // Key the taken pages by page for the sort.
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = base + u;
    if (i >= sort_n) continue;
    unsigned long long key = ~0ull;
    if (len[u] > 0 && above[u] < s.k_off) {
      const int64_t take = min(static_cast<int64_t>(len[u]), s.k_off - above[u]);
      key = (static_cast<unsigned long long>(pg[u]) << 32) | static_cast<unsigned long long>(take);
    }
    sel[i] = key;
  }
  __syncthreads();
  BitonicSortBlock(sel, sort_n);
  __syncthreads();
  // Prefix offsets of the pages' positions, in page order.
  int32_t take[kPer], off[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = base + u;
    take[u] = i < sort_n && sel[i] != ~0ull ? static_cast<int32_t>(sel[i] & 0xffffffffu) : 0;
  }
  Scan(scan_tmp).ExclusiveSum(take, off);
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    if (base + u < sort_n) offs[base + u] = off[u];
  }
  __syncthreads();
  // One warp per page writes its positions.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = warp; i < sort_n; i += static_cast<int>(blockDim.x >> 5)) {
    const unsigned long long key = sel[i];
    if (key == ~0ull) break;
    const int64_t pg = static_cast<int64_t>(key >> 32);
    const int64_t off = offs[i];
    const int64_t take = static_cast<int64_t>(key & 0xffffffffu);
    const int64_t lo = max(pg * a.meta_page, s.off_lo);
    for (int64_t j = lane; j < take; j += 32) out[s.sinks + off + j] = static_cast<int32_t>(lo + j);
  }
  return min(s.k_off, static_cast<int64_t>(ranked_total));
}

// A CTA per item: group page scores over row g = 0, the best pages, the list (sinks, pages'
// positions ascending, window).
__global__ void __launch_bounds__(kTopKThreads) QuestTopKKernel(DecodeStepArgs a, int64_t mcta_min) {
  extern __shared__ unsigned long long sort_smem[];
  __shared__ float red[kTopKThreads / 32];
  const int32_t item = blockIdx.x;
  if (MctaTakes(a, item, mcta_min)) return;
  const int32_t b = item / a.num_kv_heads;
  const int group = a.params.group;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const QuestSplit s = QuestSplitOf(a, n);
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  if (WriteListHead(a, item, s, n, out)) return;
  int64_t taken = 0;
  if (s.k_off > 0) {
    float* l = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
    // score[p] = max_g (ub_g[p] - max ub_g), into row 0 (each thread owns its p).
    float mx[64];
    for (int g = 0; g < group; ++g) {
      const float* lg = l + static_cast<size_t>(g) * a.select_ld;
      float m = -INFINITY;
      for (int64_t p = threadIdx.x; p < s.np; p += blockDim.x) m = fmaxf(m, lg[p]);
      mx[g] = BlockReduce(m, [](float x, float y) { return fmaxf(x, y); }, red);
    }
    for (int64_t p = threadIdx.x; p < s.np; p += blockDim.x) {
      float sc = -INFINITY;
      for (int g = 0; g < group; ++g) sc = fmaxf(sc, l[static_cast<size_t>(g) * a.select_ld + p] - mx[g]);
      l[p] = sc;
    }
    __syncthreads();
    const int64_t want = QuestWant(a, s);
    int sort_n = 1;
    while (sort_n < want) sort_n <<= 1;
    unsigned long long* sel = sort_smem;
    TopKSelect(l, s.np, static_cast<int>(want), sort_n, sel);
    taken = QuestTakePages(a, s, sel, reinterpret_cast<int32_t*>(sort_smem + sort_n), sort_n, want,
                           out);
  }
  WriteListTail(a, item, s.sinks, s.off_hi, n, taken, out);
}


// ---- kSparcas -----------------------------------------------------------------------------------

// Item t's channel scales (smooth 1 at a 4-bit layer, base/sparcas_q4.h), or null.
__device__ __forceinline__ float* SparcasScalesOf(const DecodeStepArgs& a, int64_t t) {
  return a.sparcas.smooth != 0 && a.sparcas.scales != nullptr &&
                 SparcasBitsOf(a.layer, a.sparcas.dense_layers, a.sparcas.bits) == 4
             ? a.sparcas.scales + t * a.params.head_dim
             : nullptr;
}

// Where item (b, h)'s key j lies as the step starts: a row of the resident tier or of the host
// store, or null for the new token n - 1 (read from a.k, rounded to T as the store keeps it).
template <typename T>
struct SparcasKeySource {
  const char* res_k;
  const unsigned long long* pages;
  size_t row_bytes;
  int64_t n;
  int32_t sink, window, page_tokens;
  __device__ __forceinline__ const T* operator()(int64_t j) const {
    if (j == n - 1) return nullptr;
    const int64_t row = ResidentRowOf(j, n, sink, window);
    return row >= 0 ? reinterpret_cast<const T*>(res_k + static_cast<size_t>(row) * row_bytes)
                    : reinterpret_cast<const T*>(StoreKRow(pages, j, static_cast<uint32_t>(page_tokens), row_bytes));
  }
};
template <typename T>
__device__ __forceinline__ SparcasKeySource<T> SparcasKeySourceOf(const DecodeStepArgs& a, int64_t t, int64_t n) {
  SparcasKeySource<T> s;
  s.row_bytes = static_cast<size_t>(a.params.head_dim) * sizeof(T);
  s.res_k = a.resident + static_cast<size_t>(t * 2 * (static_cast<int64_t>(a.sink) + a.window)) * s.row_bytes;
  s.pages = reinterpret_cast<const unsigned long long*>(a.store.pages) + t * a.store.max_pages;
  s.n = n;
  s.sink = a.sink;
  s.window = a.window;
  s.page_tokens = static_cast<int32_t>(a.store.page_tokens);
  return s;
}

// Grid (items, y), a warp per position in [0, n) of an item at its first ranked step (state d_b
// 0; smooth at a 4-bit layer): the largest |k| of each channel into its scales, which Reset
// zeroed, by atomicMax on the float's bits (non-negative floats order as their bits; fmaxf skips
// NaN, as the host's SparcasChannelScales does). SparcasPrepKernel floors them next.
template <typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) SparcasScalesKernel(DecodeStepArgs a) {
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int64_t t = ItemT(a, b, h);
  float* sc = SparcasScalesOf(a, t);
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const QuestSplit sp = QuestSplitOf(a, n);
  if (sc == nullptr || sp.all || sp.k_off <= 0 || a.sparcas.state[t].d_b != 0) return;
  const int hd = a.params.head_dim;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const SparcasKeySource<T> source = SparcasKeySourceOf<T>(a, t, n);
  float m[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // lane + 32 c: head_dim <= 256
  for (int64_t j = static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp; j < n;
       j += static_cast<int64_t>(gridDim.y) * kScoreWarps) {
    const T* kp = source(j);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int d = c * 32 + lane;
      if (d < hd) {
        const float x = kp != nullptr
                            ? ToF32(kp[d])
                            : ToF32(FromF32<T>(LoadElem(a.k, a.k_dtype, static_cast<int64_t>(item) * hd + d)));
        m[c] = fmaxf(m[c], fabsf(x));
      }
    }
  }
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int d = c * 32 + lane;
    if (d < hd && m[c] > 0.0f) atomicMax(reinterpret_cast<int*>(sc + d), __float_as_int(m[c]));
  }
}

// Grid (items), 256 threads: whether the step ranks, the dimensions (every u ranked steps), and
// the compact rows to (re)gather, into the item's SparcasState. With smoothing, at the item's
// first ranked step, first the floor of its channel scales (SparcasChannelScales' last loop); the
// dimensions are then chosen by sum_g |q[g][d] * s[d]|.
__global__ void __launch_bounds__(256) SparcasPrepKernel(DecodeStepArgs a) {
  __shared__ float imp[256];
  __shared__ int32_t chosen[256];
  __shared__ int32_t picked[256];
  __shared__ float top_w[8];
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int hd = a.params.head_dim, group = a.params.group;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const QuestSplit sp = QuestSplitOf(a, n);
  const int64_t t = ItemT(a, b, h);
  SparcasState* st = a.sparcas.state + t;
  if (sp.all || sp.k_off <= 0) {
    if (threadIdx.x == 0) st->ranked = 0;
    return;
  }
  const int d_b = SparcasDimsOf(a.layer, a.sparcas.dense_layers, a.sparcas.db, hd);
  const int32_t cur_db = st->d_b;
  const int32_t since = st->since_refresh;
  int64_t seen = st->seen;
  if (seen > n) seen = 0;
  __syncthreads();  // every thread has read the state before thread 0 rewrites it
  int32_t* dims = a.sparcas.dims + t * hd;
  float* sc = SparcasScalesOf(a, t);
  if (sc != nullptr && cur_db == 0) {  // the item's first ranked step: SparcasScalesKernel ran
    float top = 0.0f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) top = fmaxf(top, sc[d]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    if ((threadIdx.x & 31) == 0) top_w[threadIdx.x >> 5] = top;
    __syncthreads();
    top = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) top = fmaxf(top, top_w[w]);
    const float floor = top > 0.0f && isfinite(top) ? 1e-3f * top : 1.0f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) sc[d] = isfinite(sc[d]) ? fmaxf(sc[d], floor) : floor;
    __syncthreads();
  }
  bool regather = false;
  const bool choose = cur_db != d_b || since >= a.sparcas.u;
  if (choose) {
    const int64_t q0 = static_cast<int64_t>(item) * group * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      float x = 0.0f;
      for (int g = 0; g < group; ++g) {
        const float qd = LoadElem(a.q, a.q_dtype, q0 + static_cast<int64_t>(g) * hd + d);
        x += fabsf(sc != nullptr ? qd * sc[d] : qd);
      }
      imp[d] = x == x ? x : -1.0f;  // NaN ranks last
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      int rank = 0;
      for (int e = 0; e < hd; ++e) rank += imp[e] > imp[d] || (imp[e] == imp[d] && e < d);
      picked[d] = rank < d_b;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      if (picked[d]) {
        int at = 0;
        for (int e = 0; e < d; ++e) at += picked[e];
        chosen[at] = d;
      }
    }
    __syncthreads();
    int changed = cur_db != d_b;
    for (int i = threadIdx.x; i < d_b; i += blockDim.x) changed |= dims[i] != chosen[i];
    regather = __syncthreads_or(changed) != 0;
    for (int i = threadIdx.x; i < d_b; i += blockDim.x) dims[i] = chosen[i];
  }
  if (threadIdx.x == 0) {
    if (choose) {
      st->d_b = d_b;
      st->since_refresh = 1;
    } else {
      st->since_refresh = since + 1;
    }
    st->from = regather ? 0 : seen;
    st->seen = n;
    st->ranked = 1;
  }
}

// Grid (items, y), a warp per position in [from, n): the chosen dimensions of its key.
template <typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) SparcasGatherKernel(DecodeStepArgs a) {
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int64_t t = ItemT(a, b, h);
  const SparcasState st = a.sparcas.state[t];
  if (st.ranked == 0) return;
  const int hd = a.params.head_dim;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int d_b = st.d_b;
  const int32_t* dims = a.sparcas.dims + t * hd;
  T* compact = CompactOf<T>(a, b, h);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const SparcasKeySource<T> source_row = SparcasKeySourceOf<T>(a, t, n);
  if (SparcasBitsOf(a.layer, a.sparcas.dense_layers, a.sparcas.bits) == 4) {
    // 4-bit rows (base/sparcas_q4.h): the warp's max |x|, then each group of 8 lanes ORs its
    // nibbles into one word; the row's scale after its words. With smoothing each kept
    // dimension is divided by its channel scale first.
    const float* sc = SparcasScalesOf(a, t);
    const int words = SparcasQ4Words(d_b);
    uint32_t* rows = reinterpret_cast<uint32_t*>(compact);
    for (int64_t j = st.from + static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp; j < n;
         j += static_cast<int64_t>(gridDim.y) * kScoreWarps) {
      const T* kp = source_row(j);
      // Each element read once (a row of the host store is read over PCIe): lane + 32 c for
      // c < 8 covers d_b <= 256 (head_dim <= 256). The new token as stored (rounded to the KV
      // dtype), as the host twin reads it.
      float x[8];
      float amax = 0.0f;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int i = c * 32 + lane;
        x[c] = 0.0f;
        if (i < d_b) {
          x[c] = kp != nullptr
                     ? ToF32(kp[dims[i]])
                     : ToF32(FromF32<T>(LoadElem(a.k, a.k_dtype, static_cast<int64_t>(item) * hd + dims[i])));
          if (sc != nullptr) x[c] = x[c] / sc[dims[i]];
          amax = fmaxf(amax, fabsf(x[c]));
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      const float inv = SparcasQ4Inv(amax);
      uint32_t* dst = rows + j * (words + 1);
#pragma unroll
      for (int c = 0; c < 8; ++c) {  // d_b % 8 == 0: a group of 8 lanes is all in or out
        const int i = c * 32 + lane;
        if (c * 32 >= d_b) break;  // warp-uniform
        uint32_t code = i < d_b ? SparcasQ4Code(x[c], inv) << (4 * (i & 7)) : 0u;
        code |= __shfl_xor_sync(0xffffffffu, code, 1);
        code |= __shfl_xor_sync(0xffffffffu, code, 2);
        code |= __shfl_xor_sync(0xffffffffu, code, 4);
        if (i < d_b && (lane & 7) == 0) dst[i >> 3] = code;
      }
      if (lane == 0) dst[words] = __float_as_uint(SparcasQ4Scale(amax));
    }
    return;
  }
  for (int64_t j = st.from + static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp; j < n;
       j += static_cast<int64_t>(gridDim.y) * kScoreWarps) {
    T* dst = compact + j * d_b;
    const T* kp = source_row(j);
    if (kp == nullptr) {
      const int64_t src = static_cast<int64_t>(item) * hd;
      for (int i = lane; i < d_b; i += 32) dst[i] = FromF32<T>(LoadElem(a.k, a.k_dtype, src + dims[i]));
    } else {
      for (int i = lane; i < d_b; i += 32) dst[i] = kp[dims[i]];
    }
  }
}

// ---- kHip ---------------------------------------------------------------------------------------

// HiP's mask (base/hip_mask.h) for one item, a CTA of kHipThreads: the nodes stay sorted by their
// first block, so each iteration's branches are too; the kn best branches are found by a radix
// select over their OrderedKey scores (4 passes of 8 bits), the ties at the threshold taken in
// branch order (= first block ascending, the host's tie rule) and compacted in that order with two
// block scans. Shared memory: br[2 kn_cap] branches (first, end block), keys[2 kn_cap] scores,
// whose bytes hold the nodes[kn_cap] between iterations, then the packed int8 query.
constexpr int kHipThreads = 1024;
// HipDeferredKernel's CTA (256, 512 or 1024 threads would do). A smaller CTA would leave
// room on its SM for the step's own kernels, but the rebuild then takes longer and the step waits
// on it at its last layer: stop 26 measured 128K b1 2.98 / 2.92 / 2.68 ms a step at 256 / 512 /
// 1024 threads, b4 5.45 / 5.38 / 5.18.
constexpr int kHipSideThreads = 1024;

template <int kThreads>
struct HipShared {
  typename cub::BlockScan<int32_t, kThreads>::TempStorage scan;
  uint32_t hist[256];
  uint32_t prefix;
  int32_t want;
};

// A token's score: the max over the group's heads of scale * SparcasQ4Dot (the host's operations).
// kWords > 0 (head_dim 128: 16): the row's words loaded once into registers, all in flight.
template <int kWords>
__device__ __forceinline__ float HipRowScore(const uint32_t* row, int words, const int2* q_pack,
                                             const float* q_step, const int32_t* q_sum8, int group,
                                             float scale) {
  constexpr int kRegs = kWords > 0 ? kWords : 1;
  uint32_t rw[kRegs];
  if constexpr (kWords > 0) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) rw[w] = row[w];
  }
  const float row_scale = __uint_as_float(row[words]);
  float best = -INFINITY;
  for (int g = 0; g < group; ++g) {
    int acc = 0;
#pragma unroll
    for (int w = 0; w < (kWords > 0 ? kWords : 1); ++w) {
      if constexpr (kWords == 0) {
        for (int v = 0; v < words; ++v) {
          const uint32_t x = row[v];
          const int2 qw = q_pack[g * words + v];
          acc = __dp4a(static_cast<int>(x & 0x0F0F0F0Fu), qw.x, acc);
          acc = __dp4a(static_cast<int>((x >> 4) & 0x0F0F0F0Fu), qw.y, acc);
        }
      } else {
        const int2 qw = q_pack[g * kWords + w];
        acc = __dp4a(static_cast<int>(rw[w] & 0x0F0F0F0Fu), qw.x, acc);
        acc = __dp4a(static_cast<int>((rw[w] >> 4) & 0x0F0F0F0Fu), qw.y, acc);
      }
    }
    const float dot = __fmul_rn(__int2float_rn(acc - q_sum8[g]), q_step[g]);
    best = fmaxf(best, __fmul_rn(scale, __fmul_rn(dot, row_scale)));
  }
  return best;
}

// The packed int8 query of HipBuildMask (SparcasQuantizeQuery of every dimension, packed for
// __dp4a as the SparCas 4-bit scoring packs them): group heads of `words` int2, then each head's
// step and 8 * its code sum. In shared memory after the branches and keys, or in global memory
// at hip.query + t * HipQueryWords (a requested rebuild's, for the side stream).
// One query head as SparcasQ4Dot takes it, by a warp: its len elements x(i) as int8 codes
// (SparcasQ8Code), packed 8 to a word pair (even bytes, odd bytes) into pack[0, len / 8), and the
// codes' step and 8 times their sum (written by lane 0).
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

struct HipQueryPtrs {
  int2* pack;
  float* step;
  int32_t* sum8;
};

__device__ __forceinline__ HipQueryPtrs HipQueryAt(uint32_t* base, int group, int words) {
  HipQueryPtrs p;
  p.pack = reinterpret_cast<int2*>(base);
  p.step = reinterpret_cast<float*>(p.pack + group * words);
  p.sum8 = reinterpret_cast<int32_t*>(p.step + group);
  return p;
}

__device__ __forceinline__ HipQueryPtrs HipSmemQuery(unsigned char* smem, int32_t kn_cap, int group,
                                                     int words) {
  return HipQueryAt(reinterpret_cast<uint32_t*>(smem) + 4 * static_cast<int64_t>(kn_cap) + 2 * static_cast<int64_t>(kn_cap),
                    group, words);
}

// The CTA packs item's query (a.q) into out: a warp a head.
__device__ void HipPackQuery(const DecodeStepArgs& a, int32_t item, const HipQueryPtrs& out) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = a.params.group, hd = a.params.head_dim, words = SparcasQ4Words(hd);
  const int64_t q0 = static_cast<int64_t>(item) * group * hd;
  for (int g = warp; g < group; g += static_cast<int>(blockDim.x) / 32) {
    const int64_t qg = q0 + static_cast<int64_t>(g) * hd;
    PackQ8HeadWarp([&](int i) { return LoadElem(a.q, a.q_dtype, qg + i); }, hd, words, lane,
                   out.pack + g * words, out.step + g, out.sum8 + g);
  }
}

// The want-th largest of keys[0, branches) (want in [1, branches]), its bits 8 at a time; on
// return want is the count of keys equal to it that the selection takes. Every thread calls.
template <int kThreads>
__device__ uint32_t HipKthKey(const uint32_t* keys, int32_t branches, HipShared<kThreads>& sh,
                              int32_t& want) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint32_t prefix = 0, mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += blockDim.x) sh.hist[i] = 0;
    __syncthreads();
    // Warp-aggregated: the scores of a step cluster in a few bins (the high bytes above all),
    // where one atomic a key serialized the CTA (about 50 us an iteration).
    for (int32_t w0 = warp * 32; w0 < branches; w0 += blockDim.x) {
      const int32_t i = w0 + lane;
      const uint32_t k = i < branches ? keys[i] : 0u;
      const bool in = i < branches && (k & mask) == prefix;
      const uint32_t bin = in ? (k >> shift) & 0xFFu : 256u + lane;
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (in && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[bin], static_cast<uint32_t>(__popc(peers)));
    }
    __syncthreads();
    if (warp == 0) {  // lane: bins [8 lane, 8 lane + 8); the bin where the count from the top reaches want
      uint32_t cb[8];
      int32_t s = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        cb[e] = sh.hist[lane * 8 + e];
        s += static_cast<int32_t>(cb[e]);
      }
      int32_t incl = s;  // bins of lanes >= lane
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int32_t v = __shfl_down_sync(0xffffffffu, incl, off);
        if (lane + off < 32) incl += v;
      }
      const int32_t above = incl - s;
      if (above < want && want <= incl) {
        int32_t r = want - above;
        int bin = lane * 8;
        for (int e = 7; e >= 0; --e) {
          if (r <= static_cast<int32_t>(cb[e])) {
            bin = lane * 8 + e;
            break;
          }
          r -= static_cast<int32_t>(cb[e]);
        }
        sh.prefix = prefix | (static_cast<uint32_t>(bin) << shift);
        sh.want = r;
      }
    }
    __syncthreads();
    prefix = sh.prefix;
    want = sh.want;
    mask |= 0xFFu << shift;
  }
  return prefix;
}

// The mask over the offloaded range [off_lo, off_hi) for k_off picks at length n, into blocks;
// returns its count. The query is packed in shared memory (HipSmemQuery) and visible to the CTA.
template <int kThreads>
__device__ int32_t HipBuildMask(const DecodeStepArgs& a, int64_t off_lo, int64_t off_hi,
                                int64_t k_off, int64_t n, int32_t item, int32_t kn_cap,
                                unsigned char* smem, HipShared<kThreads>& sh, int32_t* blocks) {
  using HipScan = cub::BlockScan<int32_t, kThreads>;
  const int64_t bk = max(a.hip.bk, 1);
  const int64_t len = off_hi - off_lo;
  const int64_t nb = (len + bk - 1) / bk;
  const int32_t kn = static_cast<int32_t>(min(k_off / bk, static_cast<int64_t>(kn_cap)));
  if (k_off < bk || len <= 0) return 0;
  if (nb <= kn) {
    for (int32_t j = threadIdx.x; j < nb; j += blockDim.x) blocks[j] = j;
    return static_cast<int32_t>(nb);
  }
  const int tid = threadIdx.x;
  const int group = a.params.group, hd = a.params.head_dim, words = SparcasQ4Words(hd);
  int2* br = reinterpret_cast<int2*>(smem);
  uint32_t* keys = reinterpret_cast<uint32_t*>(br + 2 * static_cast<int64_t>(kn_cap));
  int2* nodes = reinterpret_cast<int2*>(keys);
  const HipQueryPtrs qp = HipSmemQuery(smem, kn_cap, group, words);
  const int2* q_pack = qp.pack;
  const float* q_step = qp.step;
  const int32_t* q_sum8 = qp.sum8;
  const bool align = a.hip.align != 0;
  int32_t cnt = static_cast<int32_t>(HipFirstNodes(nb, kn, align));
  for (int32_t j = tid; j < cnt; j += blockDim.x) {
    int64_t f = 0, l = 0;
    HipFirstNode(j, nb, kn, align, &f, &l);
    nodes[j] = make_int2(static_cast<int>(f), static_cast<int>(l));
  }
  __syncthreads();
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const uint32_t* rows = reinterpret_cast<const uint32_t*>(CompactOf<__half>(a, b, h));
  const uint64_t seed = HipSeed(n, a.layer, h);
  const float scale = a.params.scale;
  for (;;) {
    // Split: a node of more than one block into its halves, in order.
    const int32_t per = (cnt + kThreads - 1) / kThreads;
    const int32_t n0 = min(tid * per, cnt), n1 = min(n0 + per, cnt);
    int32_t c = 0;
    bool any = false;
    for (int32_t i = n0; i < n1; ++i) {
      const bool s = nodes[i].y - nodes[i].x > 1;
      c += s ? 2 : 1;
      any |= s;
    }
    int32_t base = 0, total = 0;
    HipScan(sh.scan).ExclusiveSum(c, base, total);
    if (__syncthreads_or(any) == 0) break;  // every node one block: the mask
    for (int32_t i = n0; i < n1; ++i) {
      const int2 nd = nodes[i];
      if (nd.y - nd.x > 1) {
        const int m = static_cast<int>((static_cast<int64_t>(nd.x) + nd.y) / 2);
        br[base++] = make_int2(nd.x, m);
        br[base++] = make_int2(m, nd.y);
      } else {
        br[base++] = nd;
      }
    }
    const int32_t branches = total;
    __syncthreads();  // the nodes (the keys' bytes) are read
    for (int32_t i = tid; i < branches; i += blockDim.x) keys[i] = OrderedKey(-INFINITY);
    __syncthreads();
    // Score: a thread per (branch, token of its representative block); the block's max by atomicMax
    // on the order-preserving keys.
    for (int64_t x = tid; x < static_cast<int64_t>(branches) * bk; x += blockDim.x) {
      const int32_t i = static_cast<int32_t>(x / bk);
      const int2 r = br[i];
      const int64_t pos = off_lo + HipRepBlock(r.x, r.y, a.hip.rep, seed) * bk + x % bk;
      if (pos >= off_hi) continue;
      const uint32_t* row = rows + pos * (words + 1);
      atomicMax(&keys[i], OrderedKey(words == 16 ? HipRowScore<16>(row, 16, q_pack, q_step, q_sum8, group, scale)
                                                 : HipRowScore<0>(row, words, q_pack, q_step, q_sum8, group, scale)));
    }
    __syncthreads();
    // The kn-th largest key and the count still wanted among its ties.
    const int32_t keep = min(kn, branches);
    int32_t want = keep;
    const uint32_t prefix = HipKthKey<kThreads>(keys, branches, sh, want);
    // Keep every branch above the threshold and the first `want` at it, in order.
    const int32_t per2 = (branches + kThreads - 1) / kThreads;  // <= 64: 2 kn_cap branches
    const int32_t i0 = min(tid * per2, branches), i1 = min(i0 + per2, branches);
    int32_t ties = 0;
    for (int32_t i = i0; i < i1; ++i) ties += keys[i] == prefix;
    int32_t tie_base = 0;
    HipScan(sh.scan).ExclusiveSum(ties, tie_base);
    __syncthreads();  // the scan's storage is used again
    uint64_t flags = 0;
    int32_t kept = 0;
    for (int32_t i = i0; i < i1; ++i) {
      const uint32_t k = keys[i];
      const bool keep = k > prefix || (k == prefix && tie_base < want);
      tie_base += k == prefix;
      if (keep) {
        flags |= uint64_t{1} << (i - i0);
        ++kept;
      }
    }
    int32_t at = 0;
    HipScan(sh.scan).ExclusiveSum(kept, at);
    __syncthreads();  // every key is read before the nodes overwrite them
    for (int32_t i = i0; i < i1; ++i) {
      if ((flags >> (i - i0)) & 1u) nodes[at++] = br[i];
    }
    __syncthreads();
    cnt = keep;
  }
  for (int32_t j = tid; j < cnt; j += blockDim.x) blocks[j] = nodes[j].x;
  return cnt;
}

// Grid (items), kHipThreads: a kHip layer past the dense ones. A mask requested at the item's last
// ranked step takes over (HipPromote); the mask is then kept, rebuilt here, or (hip.lag 1, due)
// requested from this step's query for HipDeferredKernel (HipStepAction); then the list is
// written: sinks, the mask's positions below the offloaded end it was built at, window. The
// compact rows are current (SparcasGatherKernel).
__global__ void __launch_bounds__(kHipThreads) HipMaskKernel(DecodeStepArgs a, int32_t kn_cap) {
  extern __shared__ __align__(16) unsigned char hip_smem[];
  __shared__ HipShared<kHipThreads> sh;
  __shared__ __align__(8) unsigned char s_raw[sizeof(HipState)];
  __shared__ int s_action, s_drifted;
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const QuestSplit sp = QuestSplitOf(a, n);
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  if (WriteListHead(a, item, sp, n, out)) return;
  int64_t taken = 0;
  if (sp.k_off > 0) {
    const int64_t t = ItemT(a, b, h);
    const int64_t bk = max(a.hip.bk, 1);
    const int group = a.params.group, words = SparcasQ4Words(a.params.head_dim);
    const bool drift = a.hip.drift > 0.0f;
    const int64_t qw = HipQueryWords(group, a.params.head_dim);
    const HipQueryPtrs qs = HipSmemQuery(hip_smem, kn_cap, group, words);
    uint32_t* item_q = a.hip.query != nullptr ? a.hip.query + t * qw : nullptr;  // the build query
    HipState& s_st = *reinterpret_cast<HipState*>(s_raw);
    if (threadIdx.x == 0) {
      HipState st = a.hip.state[t];
      HipPromote(st);
      s_st = st;
      s_drifted = 0;
    }
    // HiP's drift: every ranked step packs its query and compares each head's codes with those
    // the mask was built from (a warp a head; base/hip_mask.h's HipDriftedHead).
    if (drift) HipPackQuery(a, item, qs);
    __syncthreads();
    if (drift && s_st.count > 0) {
      const int lane = threadIdx.x & 31;
      for (int g = threadIdx.x >> 5; g < group; g += static_cast<int>(blockDim.x) / 32) {
        int dot = 0, b2 = 0, n2 = 0;  // |sums| <= 256 * 127^2: int32
        for (int w = lane; w < words; w += 32) {
          const int2 x = reinterpret_cast<const int2*>(item_q)[g * words + w], y = qs.pack[g * words + w];
          dot = __dp4a(x.y, y.y, __dp4a(x.x, y.x, dot));
          b2 = __dp4a(x.y, x.y, __dp4a(x.x, x.x, b2));
          n2 = __dp4a(y.y, y.y, __dp4a(y.x, y.x, n2));
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          dot += __shfl_xor_sync(0xffffffffu, dot, off);
          b2 += __shfl_xor_sync(0xffffffffu, b2, off);
          n2 += __shfl_xor_sync(0xffffffffu, n2, off);
        }
        if (lane == 0 && HipDriftedHead(dot, b2, n2, a.hip.drift)) atomicOr(&s_drifted, 1);
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      const HipState& st = s_st;
      s_action = static_cast<int>(HipStepAction(st.count, st.k_off, st.n, st.since_refresh, sp.k_off, n,
                                                a.hip.r_m, a.hip.lag, s_drifted != 0));
    }
    __syncthreads();
    const HipAction action = static_cast<HipAction>(s_action);
    const bool drifted = s_drifted != 0;
    const int32_t cur = s_st.cur;
    int32_t* blocks = a.hip.blocks + (2 * t + cur) * a.hip.max_nodes;
    int32_t count = s_st.count;
    int64_t hi = s_st.hi;
    // The query a new mask is built from: with drift packed above, kept as the item's (the next
    // steps compare with it; a request's side rebuild reads it); else packed where it is needed.
    if (drift && action != HipAction::kKeep) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(qs.pack);
      for (int64_t i = threadIdx.x; i < qw; i += blockDim.x) item_q[i] = src[i];
    }
    if (action == HipAction::kBuild) {
      if (!drift) HipPackQuery(a, item, qs);
      __syncthreads();
      hi = sp.off_hi;
      count = HipBuildMask<kHipThreads>(a, sp.off_lo, sp.off_hi, sp.k_off, n, item, kn_cap, hip_smem, sh,
                                        blocks);
    } else if (action == HipAction::kRequest && !drift) {
      HipPackQuery(a, item, HipQueryAt(item_q, group, words));
    }
    __syncthreads();  // the mask's blocks (global memory) are written
    for (int32_t j = threadIdx.x; j < count; j += blockDim.x) {
      const int64_t p0 = sp.off_lo + static_cast<int64_t>(blocks[j]) * bk, p1 = min(p0 + bk, hi);
      for (int64_t p = p0; p < p1; ++p) out[sp.sinks + static_cast<int64_t>(j) * bk + (p - p0)] = static_cast<int32_t>(p);
    }
    if (count > 0) {
      const int64_t last = sp.off_lo + static_cast<int64_t>(blocks[count - 1]) * bk;
      taken = static_cast<int64_t>(count - 1) * bk + (min(last + bk, hi) - last);
    }
    if (threadIdx.x == 0) {
      HipState s = s_st;
      const int32_t since = HipSinceAfterBuild(s.count, s.k_off, s.n, s.since_refresh, sp.k_off, n,
                                               a.hip.r_m, a.layer, drifted);
      if (action == HipAction::kBuild) {
        s.count = count;
        s.k_off = sp.k_off;
        s.hi = hi;
        s.since_refresh = since;
      } else if (action == HipAction::kRequest) {
        s.pending = 1;
        s.p_n = n;
        s.p_lo = sp.off_lo;
        s.p_hi = sp.off_hi;
        s.p_k_off = sp.k_off;
        s.p_count = 0;
        s.p_since = since + 1;  // its age counts from this step
      }
      ++s.since_refresh;
      s.n = n;
      a.hip.state[t] = s;
    }
  }
  WriteListTail(a, item, sp.sinks, sp.off_hi, n, taken, out);
}

// Grid (items), kThreads, on the runtime's side stream after HipMaskKernel (hip.lag 1): an
// item whose rebuild was requested builds it from the packed query into its other blocks buffer
// (pending 2); HipMaskKernel's next ranked step of the item promotes it. Nothing else reads or
// writes those bytes until the runtime joins the side stream back.
template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1024 / kThreads) HipDeferredKernel(DecodeStepArgs a, int32_t kn_cap) {
  extern __shared__ __align__(16) unsigned char hip_smem[];
  __shared__ HipShared<kThreads> sh;
  __shared__ __align__(8) unsigned char s_raw[sizeof(HipState)];
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int64_t t = ItemT(a, b, h);
  HipState& s_st = *reinterpret_cast<HipState*>(s_raw);
  if (threadIdx.x == 0) s_st = a.hip.state[t];
  __syncthreads();
  if (s_st.pending != 1) return;
  const int group = a.params.group, words = SparcasQ4Words(a.params.head_dim);
  const int64_t qw = HipQueryWords(group, a.params.head_dim);
  const uint32_t* src = a.hip.query + t * qw;
  uint32_t* dst = reinterpret_cast<uint32_t*>(HipSmemQuery(hip_smem, kn_cap, group, words).pack);
  for (int64_t i = threadIdx.x; i < qw; i += blockDim.x) dst[i] = src[i];
  __syncthreads();
  int32_t* blocks = a.hip.blocks + (2 * t + (s_st.cur ^ 1)) * a.hip.max_nodes;
  const int32_t count =
      HipBuildMask<kThreads>(a, s_st.p_lo, s_st.p_hi, s_st.p_k_off, s_st.p_n, item, kn_cap, hip_smem, sh,
                             blocks);
  __syncthreads();  // every thread is done with the state's copy and the blocks
  if (threadIdx.x == 0) {
    HipState s = s_st;
    s.p_count = count;
    s.pending = 2;
    a.hip.state[t] = s;
  }
}

// Dynamic shared memory of HipMaskKernel.
size_t HipMaskSmem(int32_t kn_cap, int group, int head_dim) {
  return static_cast<size_t>(kn_cap) * 2 * (sizeof(int2) + sizeof(uint32_t)) +
         static_cast<size_t>(group) * (SparcasQ4Words(head_dim) * sizeof(int2) + 8);
}

// The multi-CTA top-k's per-item scratch and the online softmax's folds, used by the SparCas
// 4-bit scoring (its partial statistics) and the top-k passes below.
struct MctaScratch {
  uint32_t* hist;  // [4][256]
  int32_t* counts;  // [kSelectMctaMaxCtas][2]: keys > T, keys == T
  float2* stats;   // [group][kSelectMctaStatsSlots]: (max, sum of exp2(l - max)) a CTA
  int32_t* picks;  // [kSelectMctaMaxPicks] Quest's winning pages, ascending
};

__device__ __forceinline__ MctaScratch MctaScratchOf(const DecodeStepArgs& a, int32_t item) {
  uint32_t* w = a.select_mcta_ws + static_cast<size_t>(item) * SelectMctaItemWords(a.params.group);
  MctaScratch s;
  s.hist = w;
  s.counts = reinterpret_cast<int32_t*>(w + 4 * 256);
  s.stats = reinterpret_cast<float2*>(w + 4 * 256 + 2 * kSelectMctaMaxCtas);
  s.picks = reinterpret_cast<int32_t*>(w + 4 * 256 + 2 * kSelectMctaMaxCtas +
                                       2 * a.params.group * kSelectMctaStatsSlots);
  return s;
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

// The SparCas scoring kernels' common start (a CTA per item in blockIdx.x): the item's state and
// length, and q's chosen dimensions scaled to the log2 domain in q_s[g * d_b + i] (synced; as
// given when scaled is false, times the channel scales where the item has them: the 4-bit rows
// of smoothing). d_b is the state's, at most max_db; nothing is loaded when the item does not
// rank (ranked false, the same for the whole CTA).
struct SparcasScoreItem {
  int64_t t = 0, n = 0;
  int d_b = 0;
  bool ranked = false;
};
__device__ __forceinline__ SparcasScoreItem LoadSparcasQuery(const DecodeStepArgs& a, float* q_s,
                                                             int max_db, bool scaled = true) {
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  SparcasScoreItem it;
  it.t = ItemT(a, b, h);
  const SparcasState st = a.sparcas.state[it.t];
  it.ranked = st.ranked != 0;
  if (!it.ranked) return it;
  const int hd = a.params.head_dim, group = a.params.group;
  it.d_b = min(st.d_b, max_db);
  it.n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int32_t* dims = a.sparcas.dims + it.t * hd;
  const float qscale = scaled ? a.params.scale * kLog2e : 1.0f;
  const float* sc = scaled ? nullptr : SparcasScalesOf(a, it.t);
  const int64_t q0 = static_cast<int64_t>(item) * group * hd;
  for (int i = threadIdx.x; i < group * it.d_b; i += blockDim.x) {
    const int d = dims[i % it.d_b];
    const float x = LoadElem(a.q, a.q_dtype, q0 + static_cast<int64_t>(i / it.d_b) * hd + d);
    q_s[i] = sc != nullptr ? x * sc[d] : x * qscale;
  }
  __syncthreads();
  return it;
}

// Grid (items, y), a warp per position in [0, n): partial logits over the compact keys (log2
// domain) into select_ws[item][g][j].
template <typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) SparcasScoreKernel(DecodeStepArgs a) {
  extern __shared__ float q_s[];  // [group][d_b], the chosen dimensions of q, scaled
  const SparcasScoreItem it = LoadSparcasQuery(a, q_s, a.params.head_dim);
  if (!it.ranked) return;
  const int32_t item = blockIdx.x;
  const int group = a.params.group, d_b = it.d_b;
  const int64_t n = it.n;
  const T* compact = CompactOf<T>(a, item / a.num_kv_heads, item % a.num_kv_heads);
  float* out = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t j = static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp; j < n;
       j += static_cast<int64_t>(gridDim.y) * kScoreWarps) {
    const T* c = compact + j * d_b;
    for (int g = 0; g < group; ++g) {
      float acc = 0.0f;
      for (int i = lane; i < d_b; i += 32) acc = fmaf(q_s[g * d_b + i], ToF32(c[i]), acc);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      if (lane == 0) out[static_cast<size_t>(g) * a.select_ld + j] = acc;
    }
  }
}

// Grid (items, y), a thread per position in [0, n): SparcasScoreKernel's logits for d_b <=
// kSparcasThreadMaxDb (the default 16 of 128). A warp per position leaves half its lanes idle at
// d_b = 16 and spends five shuffles per query head on a 16-term sum; here a thread reads its whole
// compact row (16-byte loads when rows are 16-byte aligned: a warp reads 32 consecutive rows), sums
// each head's terms in registers against q in shared memory (broadcast reads) and the writes of a
// warp are consecutive.
constexpr int kSparcasThreadMaxDb = 32;
constexpr int kSparcasThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kSparcasThreads) SparcasScoreThreadKernel(DecodeStepArgs a) {
  extern __shared__ float q_s[];  // [group][d_b], the chosen dimensions of q, scaled
  constexpr int kVec = 16 / sizeof(T);  // elements of a 16-byte load
  // d_b == the state's: the launcher checked SparcasDimsOf <= kSparcasThreadMaxDb
  const SparcasScoreItem it = LoadSparcasQuery(a, q_s, kSparcasThreadMaxDb);
  if (!it.ranked) return;
  const int32_t item = blockIdx.x;
  const int group = a.params.group, d_b = it.d_b;
  const int64_t n = it.n;
  const T* compact = CompactOf<T>(a, item / a.num_kv_heads, item % a.num_kv_heads);
  const bool vec = (d_b % kVec) == 0 && (reinterpret_cast<uintptr_t>(compact) & 15u) == 0;
  float* out = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  for (int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    const T* row = compact + j * d_b;
    float c[kSparcasThreadMaxDb];
    if (vec) {
#pragma unroll
      for (int v = 0; v < kSparcasThreadMaxDb / kVec; ++v) {
        if (v * kVec < d_b) {
          const uint4 raw = reinterpret_cast<const uint4*>(row)[v];
          const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int e = 0; e < kVec; ++e) c[v * kVec + e] = ToF32(x[e]);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kSparcasThreadMaxDb; ++i) {
        if (i < d_b) c[i] = ToF32(row[i]);
      }
    }
    for (int g = 0; g < group; ++g) {
      const float* qg = q_s + g * d_b;
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < kSparcasThreadMaxDb; ++i) {
        if (i < d_b) acc = fmaf(qg[i], c[i], acc);
      }
      out[static_cast<size_t>(g) * a.select_ld + j] = acc;
    }
  }
}

// Grid (items, y), a thread per position in [0, n): partial logits over 4-bit rows
// (base/sparcas_q4.h; the sparse layers at sparcas_bits 4) in integer arithmetic. The CTA first
// quantizes each query head's chosen dimensions to int8 (SparcasQuantizeQuery's codes, a warp a
// head) and packs word w of head g as two ints for __dp4a: the codes of dimensions 8w, 8w+2, 8w+4,
// 8w+6 and of 8w+1, 8w+3, 8w+5, 8w+7, which line up with a row word's nibbles masked (word &
// 0x0F0F0F0F) and shifted ((word >> 4) & 0x0F0F0F0F). A thread then reads its row's words (a
// warp: 32 consecutive rows, 4 (d_b / 8 + 1) bytes each, kQ4Chunk words in flight) and takes two
// __dp4a a word a head: the exact integer sum over the offset nibbles n + 8, less 8 times the code
// sum, times the step, times the row's scale (SparcasQ4Dot's products, in its order), times the
// softmax scale in the log2 domain. Three integer ops and eight __dp4a per word for four heads,
// where decoding nibbles to floats took 32 ops and 32 FMAs (stop 24: 5.07 -> 4.04 ms a token step
// at 128K b1 on the H200).
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

template <int kHeads>  // query heads a pass over the row (kSparcasQ4Heads, or 4 for groups of 4 or fewer)
__global__ void __launch_bounds__(kSparcasThreads, kHeads <= 4 ? 5 : 1) SparcasScoreQ4Kernel(DecodeStepArgs a, int write_stats) {
  extern __shared__ float q_raw[];  // [group][d_b] q as given, then int2 [group][words], steps, sums
  const SparcasScoreItem it = LoadSparcasQuery(a, q_raw, a.params.head_dim, /*scaled=*/false);
  if (!it.ranked) return;
  const int32_t item = blockIdx.x;
  const int group = a.params.group, d_b = it.d_b;
  const int words = SparcasQ4Words(d_b);
  int2* q_pack = reinterpret_cast<int2*>(q_raw + group * d_b);  // d_b % 8 == 0: 8-byte aligned
  float* q_step = reinterpret_cast<float*>(q_pack + group * words);
  int32_t* q_sum8 = reinterpret_cast<int32_t*>(q_step + group);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int g = warp; g < group; g += kSparcasThreads / 32) {
    const float* qg = q_raw + g * d_b;
    PackQ8HeadWarp([&](int i) { return qg[i]; }, d_b, words, lane, q_pack + g * words, q_step + g,
                   q_sum8 + g);
  }
  __syncthreads();
  const float log2_scale = a.params.scale * kLog2e;
  const int64_t n = it.n;
  const uint32_t* rows = reinterpret_cast<const uint32_t*>(
      CompactOf<__half>(a, item / a.num_kv_heads, item % a.num_kv_heads));
  float* out = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  float st_m[kHeads], st_s[kHeads];  // write_stats: this thread's running softmax
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    st_m[g] = -INFINITY;
    st_s[g] = 0.0f;
  }
  for (int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    const uint32_t* row = rows + j * (words + 1);
    const float row_scale = __uint_as_float(row[words]);
    for (int g0 = 0; g0 < group; g0 += kHeads) {
      int acc[kHeads];
#pragma unroll
      for (int g = 0; g < kHeads; ++g) acc[g] = 0;
      for (int w0 = 0; w0 < words; w0 += kQ4Chunk) {
        uint32_t rw[kQ4Chunk];
#pragma unroll
        for (int c = 0; c < kQ4Chunk; ++c) rw[c] = w0 + c < words ? row[w0 + c] : 0u;
#pragma unroll
        for (int c = 0; c < kQ4Chunk; ++c) {
          if (w0 + c < words) {
            const int lo = static_cast<int>(rw[c] & 0x0F0F0F0Fu);
            const int hi = static_cast<int>((rw[c] >> 4) & 0x0F0F0F0Fu);
#pragma unroll
            for (int g = 0; g < kHeads; ++g) {
              if (g0 + g < group) {
                const int2 qw = q_pack[(g0 + g) * words + w0 + c];  // broadcast
                acc[g] = __dp4a(lo, qw.x, acc[g]);
                acc[g] = __dp4a(hi, qw.y, acc[g]);
              }
            }
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        if (g0 + g < group) {
          const float dot = __fmul_rn(__int2float_rn(acc[g] - q_sum8[g0 + g]), q_step[g0 + g]);
          const float logit = __fmul_rn(__fmul_rn(dot, row_scale), log2_scale);
          out[static_cast<size_t>(g0 + g) * a.select_ld + j] = logit;
          if (write_stats) SoftmaxAdd(st_m[g], st_s[g], logit);  // group <= kHeads: g0 is 0
        }
      }
    }
  }
  if (!write_stats) return;
  // The CTA's (max, sum) a head into slot blockIdx.y of the item's multi-CTA scratch, where the
  // top-k's weights pass merges them (its statistics pass skipped); CTA 0 zeroes the histograms.
  const MctaScratch ws = MctaScratchOf(a, item);
  if (blockIdx.y == 0) {
    for (int i = threadIdx.x; i < 4 * 256; i += blockDim.x) ws.hist[i] = 0;
  }
  WriteSoftmaxPartials<kSparcasThreads, kHeads>(st_m, st_s, 0, group, ws.stats);
}

// Grid (items, y), a thread per position in [0, n): SparCas's dense layers (every dimension, from
// the compact rows, which hold whole keys there) for GQA groups of at most kDenseThreadMaxGroup.
// SelectScoreKernel's warp per key spends 20 shuffles a key on four heads' sums (299 us a layer at
// 128K, 0.86 TB/s); here a thread reads its row with 16-byte loads (a warp: 32 consecutive rows)
// and keeps every head's sum in registers against q in shared memory (broadcast reads).
constexpr int kDenseThreadMaxGroup = 8;

template <int HD, typename T>
__global__ void __launch_bounds__(kSparcasThreads) DenseCompactScoreKernel(DecodeStepArgs a) {
  extern __shared__ float q_s[];  // [group][HD], scaled
  constexpr int kVec = 16 / sizeof(T);
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int64_t t = ItemT(a, b, h);
  if (a.sparcas.state[t].ranked == 0) return;
  const int group = a.params.group;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const float qscale = a.params.scale * kLog2e;
  const int64_t q0 = static_cast<int64_t>(item) * group * HD;
  for (int i = threadIdx.x; i < group * HD; i += blockDim.x) q_s[i] = LoadElem(a.q, a.q_dtype, q0 + i) * qscale;
  __syncthreads();
  const T* compact = CompactOf<T>(a, b, h);
  float* out = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  for (int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    const uint4* row = reinterpret_cast<const uint4*>(compact + j * HD);
    float acc[kDenseThreadMaxGroup];
#pragma unroll
    for (int g = 0; g < kDenseThreadMaxGroup; ++g) acc[g] = 0.0f;
#pragma unroll 4
    for (int v = 0; v < HD / kVec; ++v) {
      const uint4 raw = row[v];
      const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float c = ToF32(x[e]);
#pragma unroll
        for (int g = 0; g < kDenseThreadMaxGroup; ++g) {
          if (g < group) acc[g] = fmaf(q_s[g * HD + v * kVec + e], c, acc[g]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kDenseThreadMaxGroup; ++g) {
      if (g < group) out[static_cast<size_t>(g) * a.select_ld + j] = acc[g];
    }
  }
}

// A CTA per item: the top k of the group-summed softmax weights over the item's logits rows.
// kSplit (SparCas): the list is the sinks, the top k_off of the offloaded range, the window;
// layers below dense_layers score every dimension from the compact rows (DenseCompactScoreKernel;
// GQA groups over kDenseThreadMaxGroup: SelectScoreKernel<.., kCompact>). Otherwise (the oracle)
// the top k of every position.
template <bool kSplit>
__global__ void __launch_bounds__(kTopKThreads) WeightsTopKKernel(DecodeStepArgs a, int sort_cap,
                                                                  int64_t mcta_min) {
  extern __shared__ unsigned long long sort_smem[];
  const int32_t item = blockIdx.x;
  if (MctaTakes(a, item, mcta_min)) return;
  const int32_t b = item / a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  QuestSplit sp{};
  if constexpr (kSplit) {
    sp = QuestSplitOf(a, n);
    if (WriteListHead(a, item, sp, n, out)) return;
  } else {  // the whole range is ranked
    sp.off_hi = n;
    sp.k_off = min(StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n), n);
  }
  int64_t taken = 0;
  if (sp.k_off > 0) {
    float* l = a.select_ws + static_cast<size_t>(item) * a.params.group * a.select_ld;
    unsigned long long* sel = sort_cap <= kTopKSmemItems
                                  ? sort_smem
                                  : a.topk_ws + static_cast<size_t>(item) * sort_cap;
    int sort_n = 0;
    GroupWeightsTopK(l, a.select_ld, a.params.group, n, sp.off_lo, sp.off_hi - sp.off_lo, sp.k_off,
                     sel, sort_n);
    for (int64_t i = threadIdx.x; i < sp.k_off; i += blockDim.x) {
      out[sp.sinks + i] = static_cast<int32_t>(sp.off_lo + static_cast<int64_t>(sel[i]));
    }
    taken = sp.k_off;
  }
  if constexpr (kSplit) {
    WriteListTail(a, item, sp.sinks, sp.off_hi, n, taken, out);
  } else if (threadIdx.x == 0) {
    a.list_count[item] = static_cast<int32_t>(taken);
  }
}

// ---- Multi-CTA top-k ----------------------------------------------------------------------------
// The one-CTA kernels above rank an item's n scores with one CTA: 8 CTAs for a batch-1 step of
// 8 KV heads, the rest of the GPU idle (755 us at 128K keys on an H100). These split each item's
// scores over gridDim.y CTAs. Written here rather than with CUB: cub::DeviceTopK gives no tie
// order and a segmented radix sort would sort all n keys (and size its temporary storage per
// call); a radix select needs only histograms. Block-level CUB (scan, reduce) does the in-CTA work.
// Launches, each grid (items, ctas), every per-step value read on the device (capture-safe):
//   1. MctaStats: per CTA and query head the max and sum of exp2(l - max) of its chunk of [0, n)
//      (Quest: the max); CTA 0 zeroes the item's histograms.
//   2. MctaWeights: combines the partials (online softmax), writes the group's summed weight
//      (Quest: max_g (ub_g - max ub_g)) over row 0 for the ranked range, and adds the top byte of
//      each weight's OrderedKey to histogram 0 (global atomics, once per bin per CTA).
//   3. MctaRadix x 3: each CTA re-derives the prefix from the histograms so far (a 256-bin scan)
//      and adds the next byte of the keys under it to the next histogram.
//   4. MctaCount: the k-th largest key T is known; per CTA the keys > T and == T of its chunk.
//   5. MctaWrite: per CTA its offset from the counts of the chunks before it; an ordered pass writes
//      every key > T and the first (by position) keys == T, so the list comes out ascending with
//      the ties of TopKSelect (value descending, lower position first, NaN as -inf). Quest writes
//      its winning pages to the scratch and MctaQuestList (a CTA per item, at most
//      kSelectMctaMaxPicks pages) sorts them by score and walks them as QuestTopKKernel does.
// The softmax sum is added in another order than the one-CTA kernel's, so the weights can differ
// from it in the last bit: lists differ only where two weights are within that of each other at
// the k-th place (as the host backend's lists already may).

constexpr int kMctaThreads = 512;
// Dynamic shared memory above which a Quest list kernel opts in to more (static + dynamic must
// stay under 48 KiB otherwise).
constexpr size_t kQuestSmemOptIn = 40 * 1024;

// An item's multi-CTA scratch (SelectMctaItemWords words).
// This CTA's chunk [begin, end) of [0, count): whole tiles of positions, so that every warp of a
// tile loop runs the same iterations (the warp-aggregated histograms need full warps). A tile is
// kMctaVec consecutive positions a thread, kMctaVec * blockDim.x in all: a thread issues its
// kMctaVec loads together (the passes are latency-bound, each CTA reads a few KiB) and the ordered
// write needs one pair of block scans a tile, not one a key.
constexpr int kMctaVec = 4;
struct Chunk {
  int64_t begin, end, tiles_end;  // tiles_end: begin + whole tiles covering [begin, end)
};

__device__ __forceinline__ Chunk ChunkOf(int64_t count) {
  const int64_t per = (count + gridDim.y - 1) / gridDim.y;
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kMctaVec;
  const int64_t chunk = (per + tile - 1) / tile * tile;
  Chunk c;
  c.begin = min(static_cast<int64_t>(blockIdx.y) * chunk, count);
  c.end = min(c.begin + chunk, count);
  c.tiles_end = c.begin + (c.end - c.begin + tile - 1) / tile * tile;
  return c;
}

// Thread t's positions of the tile at j0: j0 + kMctaVec t + u, u < kMctaVec (consecutive threads
// hold consecutive positions, so position order is thread order).
__device__ __forceinline__ int64_t TileFirst(int64_t j0) {
  return j0 + static_cast<int64_t>(threadIdx.x) * kMctaVec;
}

// Thread's kMctaVec values of the tile at jt = TileFirst(j0): row[jt + u], or `fill` past `end`
// (the loads issued together). Row: a pointer or a WeightRow.
template <typename Row>
__device__ __forceinline__ void LoadTile(const Row& row, int64_t jt, int64_t end, float fill,
                                         float (&x)[kMctaVec]) {
#pragma unroll
  for (int u = 0; u < kMctaVec; ++u) x[u] = jt + u < end ? row[jt + u] : fill;
}

// The radix state after `passes` histograms of an item ranking its k largest keys: the key bits
// found so far (prefix, under mask) and how many keys equal to the prefix there remain to take.
// Every thread of a kMctaThreads CTA calls it; as TopKSelect's digit search, in parallel.
struct RadixState {
  uint32_t prefix = 0, mask = 0, remaining = 0;
};

__device__ RadixState MctaPrefix(const uint32_t* hist, int passes, int64_t k) {
  using Scan = cub::BlockScan<uint32_t, kMctaThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ uint32_t s_prefix, s_remaining;
  RadixState r;
  r.remaining = static_cast<uint32_t>(k);
  const int t = threadIdx.x;
  for (int p = 0; p < passes; ++p) {
    const int shift = 24 - 8 * p;
    // Thread t holds digit 255 - t: its inclusive sum counts the keys of digits >= 255 - t.
    const uint32_t h = t < 256 ? hist[p * 256 + 255 - t] : 0u;
    uint32_t incl = 0;
    Scan(scan_tmp).InclusiveSum(h, incl);
    const uint32_t above = incl - h;
    // The digit where the count from the top first reaches `remaining` (digit 0 when none does
    // before it, as TopKSelect's loop ends).
    if (t < 256 && above < r.remaining && (incl >= r.remaining || t == 255)) {
      s_prefix = r.prefix | (static_cast<uint32_t>(255 - t) << shift);
      s_remaining = r.remaining - above;
    }
    __syncthreads();
    r.prefix = s_prefix;
    r.remaining = s_remaining;
    r.mask |= 0xffu << shift;
    __syncthreads();  // s_prefix and scan_tmp are rewritten by the next pass
  }
  return r;
}

// Adds bins[0, 256) of the CTA to the item's histogram (the bins this CTA saw only).
__device__ __forceinline__ void FlushHistogram(const unsigned int* bins, uint32_t* global) {
  __syncthreads();
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    if (bins[i] != 0) atomicAdd(global + i, bins[i]);
  }
}

// Counts key's bin (key >> shift & 0xff) into bins when `in`, one atomic per bin per warp (keys
// of one row share their high bits). Every lane of the warp calls.
__device__ __forceinline__ void CountBin(unsigned int* bins, uint32_t key, int shift, bool in) {
  const uint32_t bin = in ? (key >> shift) & 0xffu : 0x100u;
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  if (in && static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1) {
    atomicAdd(&bins[bin], static_cast<unsigned>(__popc(peers)));
  }
}

// One read of the chunk for up to kStatsHeads query heads at a time: each thread keeps a running
// (max, sum) per head (Quest: the max), then one reduction for those heads (warp shuffles, a row
// of shared memory per warp). The sum is the online softmax's, so it may differ from a two-pass
// sum in its last bits (as the one-CTA kernel's order already does).
constexpr int kStatsHeads = 4;

// An item's row of weights as a pass reads it: position j (of the ranked range, 0 at it.lo) at
// p[j - base]. The per-pass kernels read row 0 of the item's workspace (base 0); the fused kernel
// reads its chunk from shared memory (base = the chunk's first position).
struct WeightRow {
  float* p;
  int64_t base;
  __device__ __forceinline__ float& operator[](int64_t j) const { return p[j - base]; }
};

// The passes' bodies: every thread of a kMctaThreads CTA of an item with it.mcta calls them, the
// per-pass kernels below once each, the fused kernel all of them between grid barriers.

// 1. Per query head the (max, sum of exp2(l - max)) of this CTA's chunk of [0, it.n) (Quest: the
// max) into ws.stats; CTA 0 zeroes the item's histograms.
template <bool kQuest>
__device__ void MctaStatsPass(const DecodeStepArgs& a, const TopKItem& it, const MctaScratch& ws) {
  const int32_t item = blockIdx.x;
  if (blockIdx.y == 0) {
    for (int i = threadIdx.x; i < 4 * 256; i += blockDim.x) ws.hist[i] = 0;
  }
  const Chunk c = ChunkOf(it.n);
  const int group = a.params.group;
  const float* l = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kMctaVec;
  for (int g0 = 0; g0 < group; g0 += kStatsHeads) {
    float m[kStatsHeads], s[kStatsHeads];
#pragma unroll
    for (int gg = 0; gg < kStatsHeads; ++gg) {
      m[gg] = -INFINITY;
      s[gg] = 0.0f;
    }
    for (int64_t j0 = c.begin; j0 < c.end; j0 += tile) {
      const int64_t jt = TileFirst(j0);
      float v[kStatsHeads][kMctaVec];
#pragma unroll
      for (int gg = 0; gg < kStatsHeads; ++gg) {
        // Heads past the group read nothing (an end of 0).
        LoadTile(l + static_cast<size_t>(g0 + gg) * a.select_ld, jt, g0 + gg < group ? c.end : 0,
                 -INFINITY, v[gg]);
      }
#pragma unroll
      for (int gg = 0; gg < kStatsHeads; ++gg) {
#pragma unroll
        for (int u = 0; u < kMctaVec; ++u) {
          if (kQuest) {
            m[gg] = fmaxf(m[gg], v[gg][u]);
          } else {
            SoftmaxAdd(m[gg], s[gg], v[gg][u]);
          }
        }
      }
    }
    WriteSoftmaxPartials<kMctaThreads, kStatsHeads, kQuest>(m, s, g0, group, ws.stats);
  }
}

// 2. Combines the `parts` partials of each head (the statistics pass's, one a CTA, or the scoring
// kernel's), writes the group's summed weight (Quest: max_g (ub_g - max ub_g)) of this CTA's
// chunk of the ranked range into w (and into `also` when not null), and adds the top byte of each
// weight's OrderedKey to histogram 0.
template <bool kQuest>
__device__ void MctaWeightsPass(const DecodeStepArgs& a, const TopKItem& it, const MctaScratch& ws,
                                WeightRow w, float* also, int parts) {
  using Reduce = cub::BlockReduce<float, kMctaThreads>;
  __shared__ typename Reduce::TempStorage red_tmp;
  __shared__ float m_s[64], inv_s[64];
  __shared__ unsigned int bins[256];
  const int32_t item = blockIdx.x;
  const int group = a.params.group;
  for (int i = threadIdx.x; i < 256; i += blockDim.x) bins[i] = 0;
  // Per head, the max of the partial maxima, then the sum of the partial sums rescaled to it: a
  // thread a partial (up to kSelectMctaStatsSlots of them), two block reductions.
  for (int g = 0; g < group; ++g) {
    const float2* st = ws.stats + g * kSelectMctaStatsSlots;
    float m = -INFINITY;
    for (int y = threadIdx.x; y < parts; y += blockDim.x) m = fmaxf(m, st[y].x);
    m = Reduce(red_tmp).Reduce(m, FMaxOp{});
    if (threadIdx.x == 0) m_s[g] = m;
    __syncthreads();  // m_s[g] visible; red_tmp free again
    float s = 0.0f;
    if (!kQuest) {
      m = m_s[g];
      for (int y = threadIdx.x; y < parts; y += blockDim.x) {
        if (st[y].x != -INFINITY) s += st[y].y * exp2f(st[y].x - m);
      }
      s = Reduce(red_tmp).Sum(s);
    }
    if (threadIdx.x == 0) inv_s[g] = 1.0f / s;  // Quest: unused
    __syncthreads();
  }
  const Chunk c = ChunkOf(it.count);
  const float* l = a.select_ws + static_cast<size_t>(item) * group * a.select_ld + it.lo;
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kMctaVec;
  for (int64_t j0 = c.begin; j0 < c.tiles_end; j0 += tile) {
    const int64_t jt = TileFirst(j0);
    float wt[kMctaVec];
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) wt[u] = kQuest ? -INFINITY : 0.0f;
#pragma unroll 4
    for (int g = 0; g < group; ++g) {
      const float* lg = l + static_cast<size_t>(g) * a.select_ld;
      float x[kMctaVec];
      LoadTile(lg, jt, c.end, 0.0f, x);
#pragma unroll
      for (int u = 0; u < kMctaVec; ++u) {
        if (kQuest) {
          wt[u] = fmaxf(wt[u], x[u] - m_s[g]);
        } else {
          wt[u] += exp2f(x[u] - m_s[g]) * inv_s[g];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) {
      const bool in = jt + u < c.end;
      // Row 0 of the workspace: only this thread reads position j of any row in this pass.
      if (in) {
        w[jt + u] = wt[u];
        if (also != nullptr) also[jt + u] = wt[u];
      }
      CountBin(bins, in ? OrderedKey(wt[u]) : 0u, 24, in);
    }
  }
  FlushHistogram(bins, ws.hist);
}

// f(j, in, key) for each position j of the chunk's whole tiles in tile order, key the OrderedKey
// of w[j] (in: j < c.end); every lane of every warp calls f.
template <typename F>
__device__ __forceinline__ void ForEachTileKey(const WeightRow& w, const Chunk& c, F&& f) {
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kMctaVec;
  for (int64_t j0 = c.begin; j0 < c.tiles_end; j0 += tile) {
    const int64_t jt = TileFirst(j0);
    float x[kMctaVec];
    LoadTile(w, jt, c.end, 0.0f, x);
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) f(jt + u, jt + u < c.end, OrderedKey(x[u]));
  }
}

// 3. Re-derives the prefix from histograms [0, pass) (a 256-bin scan) and adds the next byte of
// the keys under it to histogram `pass`.
__device__ void MctaRadixPass(const DecodeStepArgs& a, const TopKItem& it, const MctaScratch& ws,
                              WeightRow w, int pass) {
  __shared__ unsigned int bins[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) bins[i] = 0;
  const RadixState r = MctaPrefix(ws.hist, pass, it.k);  // synchronises: bins are zero
  const int shift = 24 - 8 * pass;
  ForEachTileKey(w, ChunkOf(it.count), [&](int64_t, bool in, uint32_t key) {
    CountBin(bins, key, shift, in && (key & r.mask) == r.prefix);
  });
  FlushHistogram(bins, ws.hist + pass * 256);
}

// 4. The k-th largest key T is known: this CTA's keys > T and == T into ws.counts.
__device__ void MctaCountPass(const DecodeStepArgs& a, const TopKItem& it, const MctaScratch& ws,
                              WeightRow w) {
  using Reduce = cub::BlockReduce<int, kMctaThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const RadixState r = MctaPrefix(ws.hist, 4, it.k);
  int gt = 0, eq = 0;
  ForEachTileKey(w, ChunkOf(it.count), [&](int64_t, bool in, uint32_t key) {
    gt += in && key > r.prefix;
    eq += in && key == r.prefix;
  });
  gt = Reduce(tmp).Sum(gt);
  __syncthreads();
  eq = Reduce(tmp).Sum(eq);
  if (threadIdx.x == 0) {
    ws.counts[2 * blockIdx.y] = gt;
    ws.counts[2 * blockIdx.y + 1] = eq;
  }
}

// 5. This CTA's offset from the counts of the chunks before it, then an ordered pass that writes
// every key > T and the first (by position) keys == T.
template <bool kQuest>
__device__ void MctaWritePass(const DecodeStepArgs& a, const TopKItem& it, const MctaScratch& ws,
                              WeightRow w) {
  using Scan = cub::BlockScan<int, kMctaThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int64_t s_out, s_eq;
  const int32_t item = blockIdx.x;
  const RadixState r = MctaPrefix(ws.hist, 4, it.k);
  const int64_t remaining = r.remaining;
  // Selected before this chunk: every key > T of the chunks before it, and of their keys == T
  // the first `remaining` in position order.
  if (threadIdx.x == 0) {
    int64_t out = 0, eq = 0;
    for (unsigned y = 0; y < blockIdx.y; ++y) {
      const int64_t e = ws.counts[2 * y + 1];
      out += ws.counts[2 * y] + max(int64_t{0}, min(e, remaining - eq));
      eq += e;
    }
    s_out = out;
    s_eq = eq;
  }
  __syncthreads();
  int64_t out_base = s_out, eq_base = s_eq;
  const int32_t b = item / a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  int64_t sinks = 0, off_hi = n;
  if (!kQuest && a.scoring == SelectScoring::kSparcas) {
    const QuestSplit sp = QuestSplitOf(a, n);
    sinks = sp.sinks;
    off_hi = sp.off_hi;
  }
  int32_t* list = a.list + static_cast<size_t>(item) * a.list_cap;
  const Chunk c = ChunkOf(it.count);
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kMctaVec;
  for (int64_t j0 = c.begin; j0 < c.end; j0 += tile) {
    const int64_t jt = TileFirst(j0);
    float x[kMctaVec];
    LoadTile(w, jt, c.end, 0.0f, x);
    uint32_t key[kMctaVec];
    int eq = 0;
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) {
      key[u] = jt + u < c.end ? OrderedKey(x[u]) : 0u;
      eq += jt + u < c.end && key[u] == r.prefix;
    }
    int eq_rank = 0, eq_total = 0;
    Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_total);
    // Position order is (thread, u) order: this thread's keys == T come after eq_rank others.
    unsigned sel_mask = 0;
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) {
      const bool in = jt + u < c.end;
      if (in && key[u] > r.prefix) {
        sel_mask |= 1u << u;
      } else if (in && key[u] == r.prefix) {
        if (eq_base + eq_rank < remaining) sel_mask |= 1u << u;
        ++eq_rank;
      }
    }
    int rank = 0, sel_total = 0;
    __syncthreads();
    Scan(scan_tmp).ExclusiveSum(__popc(sel_mask), rank, sel_total);
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) {
      if (sel_mask & (1u << u)) {
        const int64_t j = jt + u;
        if (kQuest) {
          ws.picks[out_base + rank] = static_cast<int32_t>(j);
        } else {
          list[sinks + out_base + rank] = static_cast<int32_t>(it.lo + j);
        }
        ++rank;
      }
    }
    out_base += sel_total;
    eq_base += eq_total;
    __syncthreads();
  }
  if constexpr (!kQuest) {
    if (blockIdx.y != 0) return;
    // CTA 0 writes the rest of the list: SparCas's sinks and window, and the count.
    for (int64_t i = threadIdx.x; i < sinks; i += blockDim.x) list[i] = static_cast<int32_t>(i);
    WriteListTail(a, item, sinks, off_hi, n, it.k, list);
  }
}

__device__ __forceinline__ WeightRow Row0Of(const DecodeStepArgs& a, const TopKItem& it) {
  return WeightRow{a.select_ws + static_cast<size_t>(blockIdx.x) * a.params.group * a.select_ld + it.lo, 0};
}

// The per-pass kernels: one launch a pass, the weights in row 0 of the workspace.
template <bool kQuest>
__global__ void __launch_bounds__(kMctaThreads) MctaStatsKernel(DecodeStepArgs a, int64_t mcta_min) {
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (it.mcta) MctaStatsPass<kQuest>(a, it, MctaScratchOf(a, blockIdx.x));
}

template <bool kQuest>
__global__ void __launch_bounds__(kMctaThreads) MctaWeightsKernel(DecodeStepArgs a, int64_t mcta_min,
                                                                  int parts) {
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (it.mcta) MctaWeightsPass<kQuest>(a, it, MctaScratchOf(a, blockIdx.x), Row0Of(a, it), nullptr, parts);
}

__global__ void __launch_bounds__(kMctaThreads) MctaRadixKernel(DecodeStepArgs a, int64_t mcta_min,
                                                                int pass) {
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (it.mcta) MctaRadixPass(a, it, MctaScratchOf(a, blockIdx.x), Row0Of(a, it), pass);
}

__global__ void __launch_bounds__(kMctaThreads) MctaCountKernel(DecodeStepArgs a, int64_t mcta_min) {
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (it.mcta) MctaCountPass(a, it, MctaScratchOf(a, blockIdx.x), Row0Of(a, it));
}

template <bool kQuest>
__global__ void __launch_bounds__(kMctaThreads) MctaWriteKernel(DecodeStepArgs a, int64_t mcta_min) {
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (it.mcta) MctaWritePass<kQuest>(a, it, MctaScratchOf(a, blockIdx.x), Row0Of(a, it));
}

// The fused kernel's barrier among an item's CTAs: barrier i (from 1) of a launch waits until
// the counter, zeroed by the one-CTA kernel before this launch, reaches i * gridDim.y. Thread 0
// of each CTA arrives (release, after the CTA's writes) and spins (acquire); the CTA's other
// threads wait at __syncthreads. Spinning is safe because the launch is cooperative: every CTA of
// the grid is resident.
__device__ __forceinline__ void ItemBarrier(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_device> c(*counter);
    c.fetch_add(1u, ::cuda::memory_order_release);
    while (c.load(::cuda::memory_order_acquire) < target) {
    }
  }
  __syncthreads();
}

// The fused top-k: the five passes in one cooperative launch, a barrier among the item's CTAs
// between them (items do not wait for each other), each CTA's chunk of weights kept in shared
// memory from the weights pass on (the later passes read no global memory but the histograms and
// counts). CTAs of items the one-CTA kernel takes return at once. Quest also writes its weights to
// row 0, where MctaQuestList reads its winners' scores. stats_parts > 0: the scoring kernel left
// that many partial statistics a head and zeroed the histograms, so the statistics pass and its
// barrier are skipped.
template <bool kQuest>
__global__ void __launch_bounds__(kMctaThreads, 2) MctaFusedKernel(DecodeStepArgs a, int64_t mcta_min,
                                                                   int stats_parts) {
  extern __shared__ float fused_w[];
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (!it.mcta) return;
  const MctaScratch ws = MctaScratchOf(a, blockIdx.x);
  unsigned* bar = MctaBarrierOf(a, blockIdx.x);
  unsigned arrivals = 0;
  const WeightRow w{fused_w, ChunkOf(it.count).begin};
  if (kQuest) stats_parts = 0;  // Quest's bounds have no statistics from their scoring
  if (stats_parts == 0) {
    MctaStatsPass<kQuest>(a, it, ws);
    ItemBarrier(bar, arrivals += gridDim.y);
  }
  MctaWeightsPass<kQuest>(a, it, ws, w, kQuest ? Row0Of(a, it).p : nullptr,
                          stats_parts == 0 ? static_cast<int>(gridDim.y) : stats_parts);
  ItemBarrier(bar, arrivals += gridDim.y);
  for (int pass = 1; pass < 4; ++pass) {
    MctaRadixPass(a, it, ws, w, pass);
    ItemBarrier(bar, arrivals += gridDim.y);
  }
  MctaCountPass(a, it, ws, w);
  ItemBarrier(bar, arrivals += gridDim.y);
  MctaWritePass<kQuest>(a, it, ws, w);
}

// A CTA per item: the multi-CTA Quest winners (ascending pages in the scratch) ranked by score,
// then walked into the list as QuestTopKKernel does.
__global__ void __launch_bounds__(kTopKThreads) MctaQuestListKernel(DecodeStepArgs a, int64_t mcta_min) {
  extern __shared__ unsigned long long sort_smem[];
  const int32_t item = blockIdx.x;
  const TopKItem it = TopKItemOf(a, item, mcta_min);
  if (!it.mcta) return;
  const MctaScratch ws = MctaScratchOf(a, item);
  const int32_t b = item / a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const QuestSplit s = QuestSplitOf(a, n);
  const float* l = a.select_ws + static_cast<size_t>(item) * a.params.group * a.select_ld;
  int sort_n = 1;
  while (sort_n < it.k) sort_n <<= 1;
  unsigned long long* sel = sort_smem;
  for (int i = threadIdx.x; i < sort_n; i += blockDim.x) {
    unsigned long long key = ~0ull;
    if (i < it.k) {
      const int32_t p = ws.picks[i];
      key = (static_cast<unsigned long long>(~OrderedKey(l[p])) << 32) | static_cast<uint32_t>(p);
    }
    sel[i] = key;
  }
  BitonicSortBlock(sel, sort_n);
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  for (int64_t i = threadIdx.x; i < s.sinks; i += blockDim.x) out[i] = static_cast<int32_t>(i);
  const int64_t taken = QuestTakePages(a, s, sel, reinterpret_cast<int32_t*>(sort_smem + sort_n),
                                       sort_n, it.k, out);
  WriteListTail(a, item, s.sinks, s.off_hi, n, taken, out);
}

// Most dynamic shared memory a fused CTA takes for its chunk of weights (two CTAs an SM).
constexpr size_t kMctaFusedMaxSmem = 96 * 1024;

// Bytes of the fused kernel's chunk for items of up to keys_cap scores over ctas CTAs each (the
// largest chunk ChunkOf can give).
size_t MctaFusedSmem(int64_t keys_cap, unsigned ctas) {
  const int64_t tile = int64_t{kMctaThreads} * kMctaVec;
  const int64_t per = (keys_cap + ctas - 1) / ctas;
  return static_cast<size_t>((per + tile - 1) / tile * tile) * sizeof(float);
}

// Launches the fused top-k when its grid can be co-resident on this device (cooperative launch,
// capturable in a CUDA graph); *launched says whether it did (when not, the per-pass launches run).
template <bool kQuest>
Status LaunchMctaFused(const DecodeStepArgs& a, int64_t mcta_min, dim3 grid, int64_t keys_cap,
                       int stats_parts, cudaStream_t stream, bool* launched) {
  *launched = false;
  const size_t smem = MctaFusedSmem(keys_cap, grid.y);
  if (smem > kMctaFusedMaxSmem) return Status::Ok();
  // Co-residency of this grid on the current device, cached for the last (device, smem) asked.
  struct Fit {
    int device = -1;
    size_t smem = 0;
    int64_t blocks = 0;  // CTAs the device holds at once, 0 without cooperative launch
  };
  thread_local Fit fit[2];
  Fit& f = fit[kQuest ? 1 : 0];
  int device = 0;
  KVF_CUDA_CHECK(cudaGetDevice(&device));
  if (f.device != device || f.smem != smem) {
    int coop = 0, sms = 0, per_sm = 0;
    KVF_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device));
    KVF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    KVF_CUDA_CHECK(cudaFuncSetAttribute(MctaFusedKernel<kQuest>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kMctaFusedMaxSmem)));
    KVF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, MctaFusedKernel<kQuest>,
                                                                 kMctaThreads, smem));
    f.device = device;
    f.smem = smem;
    f.blocks = coop != 0 ? int64_t{per_sm} * sms : 0;
  }
  if (int64_t{grid.x} * grid.y > f.blocks) return Status::Ok();
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kMctaThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  KVF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, MctaFusedKernel<kQuest>, a, mcta_min, stats_parts));
  *launched = true;
  return Status::Ok();
}

// The multi-CTA launches of an item set (see above); ctas CTAs per item of up to keys_cap scores:
// the fused kernel when it fits, else one launch a pass. stats_parts > 0 (not Quest): the scoring
// kernel wrote the statistics and zeroed the histograms (no statistics pass).
Status LaunchMctaTopK(const DecodeStepArgs& a, int64_t mcta_min, unsigned ctas, int64_t keys_cap,
                      size_t quest_smem, bool allow_fused, int stats_parts, cudaStream_t stream) {
  const unsigned items = static_cast<unsigned>(int64_t{a.batch} * a.num_kv_heads);
  const dim3 grid(items, ctas);
  const bool quest = a.scoring == SelectScoring::kQuestPages;
  bool fused = false;
  if (allow_fused && quest) {
    KVF_RETURN_IF_ERROR(LaunchMctaFused<true>(a, mcta_min, grid, keys_cap, 0, stream, &fused));
  } else if (allow_fused) {
    KVF_RETURN_IF_ERROR(LaunchMctaFused<false>(a, mcta_min, grid, keys_cap, stats_parts, stream, &fused));
  }
  if (!fused) {
    if (quest) {
      MctaStatsKernel<true><<<grid, kMctaThreads, 0, stream>>>(a, mcta_min);
      KVF_CUDA_CHECK_LAUNCH(MctaStatsKernel);
      MctaWeightsKernel<true><<<grid, kMctaThreads, 0, stream>>>(a, mcta_min, static_cast<int>(ctas));
      KVF_CUDA_CHECK_LAUNCH(MctaWeightsKernel);
    } else {
      if (stats_parts == 0) {
        MctaStatsKernel<false><<<grid, kMctaThreads, 0, stream>>>(a, mcta_min);
        KVF_CUDA_CHECK_LAUNCH(MctaStatsKernel);
      }
      MctaWeightsKernel<false><<<grid, kMctaThreads, 0, stream>>>(
          a, mcta_min, stats_parts == 0 ? static_cast<int>(ctas) : stats_parts);
      KVF_CUDA_CHECK_LAUNCH(MctaWeightsKernel);
    }
    for (int pass = 1; pass < 4; ++pass) {
      MctaRadixKernel<<<grid, kMctaThreads, 0, stream>>>(a, mcta_min, pass);
      KVF_CUDA_CHECK_LAUNCH(MctaRadixKernel);
    }
    MctaCountKernel<<<grid, kMctaThreads, 0, stream>>>(a, mcta_min);
    KVF_CUDA_CHECK_LAUNCH(MctaCountKernel);
    if (quest) {
      MctaWriteKernel<true><<<grid, kMctaThreads, 0, stream>>>(a, mcta_min);
      KVF_CUDA_CHECK_LAUNCH(MctaWriteKernel);
    } else {
      MctaWriteKernel<false><<<grid, kMctaThreads, 0, stream>>>(a, mcta_min);
      KVF_CUDA_CHECK_LAUNCH(MctaWriteKernel);
    }
  }
  if (!quest) return Status::Ok();
  if (quest_smem > kQuestSmemOptIn) {
    KVF_CUDA_CHECK(cudaFuncSetAttribute(MctaQuestListKernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(quest_smem)));
  }
  MctaQuestListKernel<<<items, kTopKThreads, quest_smem, stream>>>(a, mcta_min);
  KVF_CUDA_CHECK_LAUNCH(MctaQuestListKernel);
  return Status::Ok();
}

}  // namespace

namespace {

Status CheckSelectArgs(const DecodeStepArgs& a) {
  KVF_RETURN_IF_ERROR(CheckAttnShape(a.params));
  KVF_CHECK_ARG(a.scoring == SelectScoring::kExactTopK || a.scoring == SelectScoring::kQuestPages ||
                    a.scoring == SelectScoring::kSparcas || a.scoring == SelectScoring::kHip ||
                    a.scoring == SelectScoring::kKvpop,
                "DecodeSelect: unknown scoring ", static_cast<int>(a.scoring));
  KVF_CHECK_ARG(a.list != nullptr && a.list_count != nullptr && a.select_ws != nullptr &&
                    a.slots != nullptr && a.positions != nullptr,
                "DecodeSelect: null list, workspace, slots or positions");
  KVF_CHECK_ARG(a.params.group >= 1 && a.params.group <= 64, "DecodeSelect: group ",
                a.params.group, " not in [1, 64]");
  KVF_CHECK_ARG(a.budget_cap >= 1 && a.list_cap >= a.budget_cap && a.budget_cap < (int64_t{1} << 30),
                "DecodeSelect: list_cap ", a.list_cap, " < budget_cap ", a.budget_cap);
  KVF_CHECK_ARG(a.scoring != SelectScoring::kQuestPages || a.meta_page >= 1,
                "DecodeSelect: quest page of ", a.meta_page, " tokens");
  return Status::Ok();
}

// Power-of-two sort capacity of the one-CTA top-k (Quest: pages).
int64_t SortCapOf(const DecodeStepArgs& a) {
  const int64_t want = a.scoring == SelectScoring::kQuestPages ? a.budget_cap / a.meta_page + 3
                                                               : a.budget_cap;
  int64_t sort_cap = 1;
  while (sort_cap < want) sort_cap <<= 1;
  return sort_cap;
}


// PrHS's depth window on the finished lists (DecodeStepArgs::hide_fraction): the parallel form of
// base/psaw.h's PsawFilterList, one CTA per item. The list is ascending, so each binary search of
// the host version is a count of a monotone predicate here (__syncthreads_count over the list);
// the refill's cut p* = n - take - s + c, c = #{i : u_i >= take}, u_i = (n - 1 - S[i]) - (s - 1 -
// i) the unselected positions above the i-th kept entry S[i] >= hide_end (u_i is non-increasing).
constexpr int kPsawThreads = 256;

__global__ void __launch_bounds__(kPsawThreads) PsawFilterKernel(DecodeStepArgs a) {
  const int64_t item = blockIdx.x;
  const int b = static_cast<int>(item / a.num_kv_heads);
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int64_t sink = min(max(static_cast<int64_t>(a.sink), int64_t{0}), n);
  const int64_t hide_end = static_cast<int64_t>(floor(a.hide_fraction * static_cast<double>(n)));
  if (hide_end <= sink) return;
  int32_t* list = a.list + item * a.list_cap;
  const int64_t count = a.list_count[item];
  const int tid = threadIdx.x;
  // i0 = #{list < sink}, i1 = #{list < hide_end}.
  int64_t i0 = 0, i1 = 0;
  for (int64_t base = 0; base < count; base += kPsawThreads) {
    const int64_t j = base + tid;
    const int32_t v = j < count ? list[j] : INT32_MAX;
    i0 += __syncthreads_count(v < sink);
    i1 += __syncthreads_count(v < hide_end);
  }
  // Compact the suffix [i1, count) down to i0 (chunks: every read before any write of a chunk).
  for (int64_t base = 0; base < count - i1; base += kPsawThreads) {
    const int64_t j = base + tid;
    const int32_t v = j < count - i1 ? list[i1 + j] : 0;
    __syncthreads();
    if (j < count - i1) list[i0 + j] = v;
    __syncthreads();
  }
  const int64_t kept = i0 + (count - i1);
  const int64_t budget = min(StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n), n);
  const int64_t target = min(budget, sink + (n - hide_end));
  int64_t out = kept;
  if (kept < target) {
    const int64_t s = kept - i0;
    const int64_t take = min(target - kept, (n - hide_end) - s);
    if (take > 0) {
      int64_t c = 0;
      for (int64_t base = 0; base < s; base += kPsawThreads) {
        const int64_t i = base + tid;
        const bool pred = i < s && (n - 1 - list[i0 + i]) - (s - 1 - i) >= take;
        c += __syncthreads_count(pred);
      }
      const int64_t p_star = n - take - s + c;
      const int64_t j0 = i0 + c;
      for (int64_t t = tid; t < n - p_star; t += kPsawThreads) {
        list[j0 + t] = static_cast<int32_t>(p_star + t);
      }
      out = j0 + (n - p_star);
      __syncthreads();
    }
    // The sinks not selected, ascending: the host version's step, on one thread.
    if (out < target && tid == 0) out = PsawAddSinks(list, i0, out, sink, target);
  }
  if (tid == 0) a.list_count[item] = static_cast<int32_t>(out);
}

Status LaunchPsawFilter(const DecodeStepArgs& a, cudaStream_t stream) {
  if (a.hide_fraction <= 0.0) return Status::Ok();
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  PsawFilterKernel<<<static_cast<unsigned>(items), kPsawThreads, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(PsawFilterKernel);
  return Status::Ok();
}

}  // namespace

Status LaunchSelectTopK(const DecodeStepArgs& a, const LaunchInfo& info, SelectTopKPath path,
                        cudaStream_t stream, int32_t stats_parts) {
  if (a.batch == 0 || a.scoring == SelectScoring::kNone) return Status::Ok();
  KVF_RETURN_IF_ERROR(CheckSelectArgs(a));
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  const bool quest = a.scoring == SelectScoring::kQuestPages;
  const int64_t sort_cap = SortCapOf(a);
  if (quest) {
    KVF_CHECK_ARG(sort_cap <= kTopKSmemItems, "DecodeSelect: quest budget ", a.budget_cap,
                  " over ", kTopKSmemItems, " pages of ", a.meta_page);
  } else {
    KVF_CHECK_ARG(sort_cap <= kTopKSmemItems || a.topk_ws != nullptr,
                  "DecodeSelect: budget_cap ", a.budget_cap, " needs a top-k workspace");
  }
  // Scores an item ranks at most: positions, or Quest's pages.
  const int64_t keys_cap = quest ? (a.select_ld + a.meta_page - 1) / a.meta_page + 1 : a.select_ld;
  const int64_t min_keys = quest ? SelectMctaMinPages() : kSelectMctaMinKeys;
  int64_t mcta_min = std::numeric_limits<int64_t>::max();  // no item takes the multi-CTA path
  if (path == SelectTopKPath::kMultiCta || path == SelectTopKPath::kMultiCtaPerPass) {
    KVF_CHECK_ARG(a.select_mcta_ws != nullptr, "DecodeSelect: multi-CTA top-k without its scratch");
    mcta_min = 1;
  } else if (path == SelectTopKPath::kAuto && a.select_mcta_ws != nullptr &&
             keys_cap >= min_keys) {
    mcta_min = min_keys;
    // Called eagerly with every item short: the multi-CTA launches would all return at once, so
    // leave them out (their launch cost is the one-CTA path's at these lengths). Inside a capture
    // they stay: the graph is replayed at later lengths.
    const int64_t hint = a.max_len_hint;
    const int64_t hint_keys = quest ? (hint + a.meta_page - 1) / a.meta_page + 1 : hint;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    KVF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (hint > 0 && hint_keys < min_keys && capture == cudaStreamCaptureStatusNone) {
      mcta_min = std::numeric_limits<int64_t>::max();
    }
  }
  // The one-CTA kernel always runs: it takes the items below the threshold (chosen on the device
  // from this step's lengths, so one launch sequence serves every step of a captured graph) and
  // the items with nothing to rank; it returns at once for the others.
  const size_t smem = quest ? static_cast<size_t>(sort_cap) * (sizeof(unsigned long long) + sizeof(int32_t))
                     : sort_cap <= kTopKSmemItems ? sort_cap * sizeof(unsigned long long)
                                                  : 0;
  if (a.scoring == SelectScoring::kQuestPages) {
    if (smem > kQuestSmemOptIn) {  // 4096 pages: 48 KiB besides the kernel's static shared memory
      KVF_CUDA_CHECK(cudaFuncSetAttribute(QuestTopKKernel,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    QuestTopKKernel<<<static_cast<unsigned>(items), kTopKThreads, smem, stream>>>(a, mcta_min);
    KVF_CUDA_CHECK_LAUNCH(QuestTopKKernel);
  } else if (a.scoring == SelectScoring::kSparcas) {
    WeightsTopKKernel<true><<<static_cast<unsigned>(items), kTopKThreads, smem, stream>>>(
        a, static_cast<int>(sort_cap), mcta_min);
    KVF_CUDA_CHECK_LAUNCH(WeightsTopKKernel<true>);
  } else {
    WeightsTopKKernel<false><<<static_cast<unsigned>(items), kTopKThreads, smem, stream>>>(
        a, static_cast<int>(sort_cap), mcta_min);
    KVF_CUDA_CHECK_LAUNCH(WeightsTopKKernel<false>);
  }
  if (mcta_min == std::numeric_limits<int64_t>::max()) return Status::Ok();
  // The multi-CTA top-k's CTAs per SM in all.
  constexpr int per_sm = 2;
  const int32_t ctas = SelectMctaCtas(items, keys_cap, info.num_sms, per_sm);
  return LaunchMctaTopK(a, mcta_min, static_cast<unsigned>(ctas), keys_cap, smem,
                        path != SelectTopKPath::kMultiCtaPerPass, quest ? 0 : stats_parts, stream);
}

namespace {

// What every scoring's launch sizes its grids by: the items, q's bytes in shared memory, the CTAs
// an item may take (8 an SM over all items), and the score kernels' gridDim.y (a warp per 8 keys).
struct SelectGrid {
  int64_t items = 0;
  size_t q_smem = 0;
  int64_t fill = 1;
  unsigned gy = 1;
};

SelectGrid SelectGridOf(const DecodeStepArgs& a, const LaunchInfo& info) {
  SelectGrid g;
  g.items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  g.q_smem = static_cast<size_t>(a.params.group) * a.params.head_dim * sizeof(float);
  g.fill = std::max<int64_t>(1, int64_t{info.num_sms} * 8 / g.items);
  const int64_t want = (a.select_ld + kScoreWarps * 8 - 1) / (kScoreWarps * 8);
  g.gy = static_cast<unsigned>(std::clamp<int64_t>(std::min(want, g.fill), 1, 65535));
  return g;
}

// gridDim.y of the kernels with a thread a position over kSparcasThreads-thread CTAs, at most
// per_sm CTAs an SM over all items (and at most cap).
unsigned ThreadGridY(const DecodeStepArgs& a, const LaunchInfo& info, const SelectGrid& g, int64_t per_sm,
                     int64_t cap = 65535) {
  const int64_t per_item = std::max<int64_t>(1, int64_t{info.num_sms} * per_sm / g.items);
  return static_cast<unsigned>(std::clamp<int64_t>(
      std::min((a.select_ld + kSparcasThreads - 1) / kSparcasThreads, per_item), 1, cap));
}

// kQuestPages: the page bounds of the stored pages, the pages' scores, the top-k of the pages.
Status LaunchQuestSelect(const DecodeStepArgs& a, const LaunchInfo& info, const SelectGrid& g,
                         cudaStream_t stream) {
  KVF_CHECK_ARG(a.meta != nullptr && a.meta_pages >= 1, "DecodeSelect: quest without page bounds");
  KVF_CHECK_ARG(SortCapOf(a) <= kTopKSmemItems, "DecodeSelect: quest budget ", a.budget_cap,
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

// kHip past its dense layers: SparCas's prep and gather keep the 4-bit rows of every dimension
// current, and the mask kernel writes the list.
Status LaunchHipSelect(const DecodeStepArgs& a, const SelectGrid& g, cudaStream_t stream) {
  DecodeStepArgs s = a;
  s.scoring = SelectScoring::kSparcas;
  const int32_t kn_cap = static_cast<int32_t>(std::min<int64_t>(a.budget_cap / std::max(a.hip.bk, 1), kHipMaxNodes));
  KVF_CHECK_ARG(a.meta != nullptr && a.sparcas.state != nullptr && a.sparcas.dims != nullptr &&
                    a.hip.state != nullptr && a.hip.blocks != nullptr && a.hip.bk >= 1 &&
                    a.hip.r_m >= 1 && a.sparcas.db == a.params.head_dim &&
                    a.params.head_dim % 8 == 0 && a.params.head_dim <= 256 &&
                    SparcasBitsOf(a.layer, a.sparcas.dense_layers, a.sparcas.bits) == 4 &&
                    a.budget_cap / a.hip.bk <= std::min<int64_t>(kHipMaxNodes, a.hip.max_nodes) &&
                    ((a.hip.lag == 0 && !(a.hip.drift > 0.0f)) || a.hip.query != nullptr),
                "DecodeSelect: hip without its 4-bit rows and mask state (or hip.lag or hip.drift without "
                "hip.query), or a budget_cap of ",
                a.budget_cap, " at bk ", a.hip.bk, " over ", std::min<int64_t>(kHipMaxNodes, a.hip.max_nodes),
                " nodes");
  SparcasPrepKernel<<<static_cast<unsigned>(g.items), 256, 0, stream>>>(s);
  KVF_CUDA_CHECK_LAUNCH(SparcasPrepKernel);
  KVF_RETURN_IF_ERROR(DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
    SparcasGatherKernel<T><<<dim3(static_cast<unsigned>(g.items), g.gy), kScoreWarps * 32, 0, stream>>>(s);
    KVF_CUDA_CHECK_LAUNCH(SparcasGatherKernel);
    return Status::Ok();
  }));
  const size_t smem = HipMaskSmem(std::max(kn_cap, 1), a.params.group, a.params.head_dim);
  if (smem > 48 * 1024) {
    KVF_CUDA_CHECK(cudaFuncSetAttribute(HipMaskKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  HipMaskKernel<<<static_cast<unsigned>(g.items), kHipThreads, smem, stream>>>(a, std::max(kn_cap, 1));
  KVF_CUDA_CHECK_LAUNCH(HipMaskKernel);
  return LaunchPsawFilter(a, stream);
}

// SparCas's scores of one layer into select_ws, from its compact rows: every dimension at its
// dense layers, else its chosen d_b (4-bit rows, or the KV dtype: a thread a position for small
// d_b, a warp a position above). Sets *stats_parts > 0 when the scoring wrote the top-k's
// statistics.
template <int HD, typename T>
Status LaunchSparcasScores(const DecodeStepArgs& a, const LaunchInfo& info, const SelectGrid& g,
                           cudaStream_t stream, int32_t* stats_parts) {
  const unsigned items = static_cast<unsigned>(g.items);
  if (a.layer < a.sparcas.dense_layers) {
    // Every dimension, as the oracle, but from the compact rows on the device (they hold every
    // dimension at these layers): at 128K the host store's keys took 5.4 ms a layer over PCIe,
    // the compact rows are HBM reads.
    if (a.params.group <= kDenseThreadMaxGroup) {  // the compact rows are 16-byte aligned
      DenseCompactScoreKernel<HD, T><<<dim3(items, ThreadGridY(a, info, g, 16)), kSparcasThreads, g.q_smem,
                                       stream>>>(a);
      KVF_CUDA_CHECK_LAUNCH(DenseCompactScoreKernel);
      return Status::Ok();
    }
    if (g.q_smem > 48 * 1024) {
      KVF_CUDA_CHECK(cudaFuncSetAttribute(SelectScoreKernel<HD, T, true>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(g.q_smem)));
    }
    SelectScoreKernel<HD, T, true><<<dim3(items, g.gy), kScoreWarps * 32, g.q_smem, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(SelectScoreKernel);
    return Status::Ok();
  }
  const int d_b = SparcasDimsOf(a.layer, a.sparcas.dense_layers, a.sparcas.db, HD);
  if (SparcasBitsOf(a.layer, a.sparcas.dense_layers, a.sparcas.bits) == 4) {
    KVF_CHECK_ARG(d_b % 8 == 0, "DecodeSelect: sparcas 4-bit rows need d_b % 8 == 0, not ", d_b);
    // 16 CTAs an SM over all items: each CTA first quantizes and packs the query, so fewer CTAs
    // with more rows a thread amortize that.
    const unsigned ty = ThreadGridY(a, info, g, 16, kSelectMctaStatsSlots);
    // Each CTA's softmax statistics into the multi-CTA scratch, so that the top-k skips its
    // statistics pass (a read of every logit): off. Measured through the Runtime (H200,
    // sparcas_bank 128K) it cost 3.6% at batch 1 (4.14 vs 3.99 ms a token step: the exp2 work in
    // the scoring, 264 partials a head to merge) and gained 0.9% at batch 4 (9.47 vs 9.56).
    constexpr bool fold = false;
    if (fold && a.select_mcta_ws != nullptr && a.params.group <= kSparcasQ4Heads) {
      *stats_parts = static_cast<int32_t>(ty);
    }
    // q as given, its packed codes (an int2 a word), each head's step and 8 x code sum
    const size_t qs_db = static_cast<size_t>(a.params.group) *
                         (d_b * sizeof(float) + SparcasQ4Words(d_b) * sizeof(int2) + 8);
    const auto kernel = a.params.group <= 4 ? SparcasScoreQ4Kernel<4> : SparcasScoreQ4Kernel<kSparcasQ4Heads>;
    if (qs_db > 48 * 1024) {
      KVF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(qs_db)));
    }
    kernel<<<dim3(items, ty), kSparcasThreads, qs_db, stream>>>(a, *stats_parts > 0 ? 1 : 0);
    KVF_CUDA_CHECK_LAUNCH(SparcasScoreQ4Kernel);
    return Status::Ok();
  }
  if (d_b <= kSparcasThreadMaxDb) {  // what the prep kernel sets for every ranked item
    const size_t qs_db = static_cast<size_t>(a.params.group) * d_b * sizeof(float);
    SparcasScoreThreadKernel<T><<<dim3(items, ThreadGridY(a, info, g, 16)), kSparcasThreads, qs_db,
                                  stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(SparcasScoreThreadKernel);
    return Status::Ok();
  }
  const size_t qs = static_cast<size_t>(a.params.group) * HD * sizeof(float);
  SparcasScoreKernel<T><<<dim3(items, g.gy), kScoreWarps * 32, qs, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(SparcasScoreKernel);
  return Status::Ok();
}

// kSparcas: with smoothing the channel scales at an item's first ranked step, then the prep
// (dimensions, what to gather), the gather of the compact rows, the scores and the top-k.
Status LaunchSparcasSelect(const DecodeStepArgs& a, const LaunchInfo& info, const SelectGrid& g,
                           cudaStream_t stream) {
  KVF_CHECK_ARG(a.meta != nullptr && a.sparcas.state != nullptr && a.sparcas.dims != nullptr &&
                    a.params.head_dim <= 256,
                "DecodeSelect: sparcas without its compact keys or state");
  const unsigned items = static_cast<unsigned>(g.items);
  if (a.sparcas.smooth != 0 && SparcasBitsOf(a.layer, a.sparcas.dense_layers, a.sparcas.bits) == 4) {
    KVF_CHECK_ARG(a.sparcas.scales != nullptr, "DecodeSelect: sparcas smooth without its channel scales");
    KVF_RETURN_IF_ERROR(DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
      SparcasScalesKernel<T><<<dim3(items, g.gy), kScoreWarps * 32, 0, stream>>>(a);
      KVF_CUDA_CHECK_LAUNCH(SparcasScalesKernel);
      return Status::Ok();
    }));
  }
  SparcasPrepKernel<<<items, 256, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(SparcasPrepKernel);
  int32_t stats_parts = 0;  // > 0: the scoring wrote the top-k's statistics
  KVF_RETURN_IF_ERROR(DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
      SparcasGatherKernel<T><<<dim3(items, g.gy), kScoreWarps * 32, 0, stream>>>(a);
      KVF_CUDA_CHECK_LAUNCH(SparcasGatherKernel);
      if (a.select_skip_ranking) return Status::Ok();  // the dimensions and rows are current
      return LaunchSparcasScores<HD, T>(a, info, g, stream, &stats_parts);
    });
  }));
  if (a.select_skip_ranking) return Status::Ok();
  KVF_RETURN_IF_ERROR(LaunchSelectTopK(a, info, SelectTopKPath::kAuto, stream, stats_parts));
  return LaunchPsawFilter(a, stream);
}

// kExactTopK: every key's score from the host store and the resident tier, then the top-k.
Status LaunchExactSelect(const DecodeStepArgs& a, const LaunchInfo& info, const SelectGrid& g,
                         cudaStream_t stream) {
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

Status LaunchDecodeSelect(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream) {
  if (a.batch == 0 || a.scoring == SelectScoring::kNone) return Status::Ok();
  KVF_RETURN_IF_ERROR(CheckSelectArgs(a));
  KVF_CHECK_ARG(a.store.pages != nullptr, "DecodeSelect: null page table");
  if (a.scoring == SelectScoring::kKvpop) {  // gpu/kvpop_select.cu
    KVF_RETURN_IF_ERROR(LaunchKvpopSelect(a, info, stream));
    return LaunchPsawFilter(a, stream);
  }
  KVF_CHECK_ARG(!a.select_skip_ranking || a.scoring == SelectScoring::kExactTopK ||
                    a.scoring == SelectScoring::kQuestPages || a.scoring == SelectScoring::kSparcas,
                "DecodeSelect: select_skip_ranking with scoring ", static_cast<int>(a.scoring));
  if (a.select_skip_ranking && a.scoring == SelectScoring::kExactTopK) return Status::Ok();  // no metadata
  const SelectGrid g = SelectGridOf(a, info);
  if (a.scoring == SelectScoring::kQuestPages) return LaunchQuestSelect(a, info, g, stream);
  KVF_CHECK_ARG(SortCapOf(a) <= kTopKSmemItems || a.topk_ws != nullptr,
                "DecodeSelect: budget_cap ", a.budget_cap, " needs a top-k workspace");
  if (a.scoring == SelectScoring::kHip) {
    // SparCas's machinery with every dimension: its exact path at the dense layers.
    if (a.layer < HipDenseOf(a)) {
      DecodeStepArgs s = a;
      s.scoring = SelectScoring::kSparcas;
      return LaunchDecodeSelect(s, info, stream);
    }
    return LaunchHipSelect(a, g, stream);
  }
  if (a.scoring == SelectScoring::kSparcas) return LaunchSparcasSelect(a, info, g, stream);
  return LaunchExactSelect(a, info, g, stream);
}

Status LaunchDecodeSelectDeferred(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream) {
  (void)info;
  if (a.scoring != SelectScoring::kHip || a.hip.lag == 0 || a.layer < HipDenseOf(a)) {
    return Status::Ok();
  }
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  if (items == 0) return Status::Ok();
  KVF_CHECK_ARG(a.hip.state != nullptr && a.hip.blocks != nullptr && a.hip.query != nullptr &&
                    a.hip.bk >= 1 && a.params.head_dim % 8 == 0 && a.params.head_dim <= 256 &&
                    a.budget_cap / a.hip.bk <= std::min<int64_t>(kHipMaxNodes, a.hip.max_nodes),
                "DecodeSelectDeferred: hip without its mask state, blocks or packed queries");
  const int32_t kn_cap = static_cast<int32_t>(std::min<int64_t>(a.budget_cap / a.hip.bk, kHipMaxNodes));
  const size_t smem = HipMaskSmem(std::max(kn_cap, 1), a.params.group, a.params.head_dim);
  const auto launch = [&](auto kernel, int block) -> Status {
    if (smem > 48 * 1024) {
      KVF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    kernel<<<static_cast<unsigned>(items), block, smem, stream>>>(a, std::max(kn_cap, 1));
    KVF_CUDA_CHECK_LAUNCH(HipDeferredKernel);
    return Status::Ok();
  };
  return launch(HipDeferredKernel<kHipSideThreads>, kHipSideThreads);
}

Status LaunchPageBounds(const PageBoundsArgs& a, cudaStream_t stream) {
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
