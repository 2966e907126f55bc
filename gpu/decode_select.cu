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
#include "base/check.h"

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
                   reinterpret_cast<const unsigned long long*>(a.pages) + t * a.max_pages,
                   static_cast<uint32_t>(a.page_tokens), a.params.head_dim, pg, a.new_len,
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
                   reinterpret_cast<const unsigned long long*>(a.pages) + t * a.max_pages,
                   static_cast<uint32_t>(a.page_tokens), a.params.head_dim, (n - 1) / a.meta_page,
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

// A CTA per item: the oracle's list (top k of every position).
__global__ void __launch_bounds__(kTopKThreads) SelectTopKKernel(DecodeStepArgs a, int sort_cap) {
  extern __shared__ unsigned long long sort_smem[];
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  int64_t k = StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n);
  if (k > n) k = n;
  float* l = a.select_ws + static_cast<size_t>(item) * a.params.group * a.select_ld;
  unsigned long long* sel = sort_cap <= kTopKSmemItems
                                ? sort_smem
                                : a.topk_ws + static_cast<size_t>(item) * sort_cap;
  int sort_n = 0;
  GroupWeightsTopK(l, a.select_ld, a.params.group, n, 0, n, k, sel, sort_n);
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  for (int i = threadIdx.x; i < k; i += blockDim.x) out[i] = static_cast<int32_t>(sel[i]);
  if (threadIdx.x == 0) a.list_count[item] = static_cast<int32_t>(k);
}


// A CTA per item: group page scores over row g = 0, the best pages, the list (sinks, pages'
// positions ascending, window).
__global__ void __launch_bounds__(kTopKThreads) QuestTopKKernel(DecodeStepArgs a) {
  extern __shared__ unsigned long long sort_smem[];
  __shared__ float red[kTopKThreads / 32];
  __shared__ int64_t s_total;
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads;
  const int group = a.params.group;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const QuestSplit s = QuestSplitOf(a, n);
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  if (s.all) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = static_cast<int32_t>(i);
    if (threadIdx.x == 0) a.list_count[item] = static_cast<int32_t>(n);
    return;
  }
  for (int64_t i = threadIdx.x; i < s.sinks; i += blockDim.x) out[i] = static_cast<int32_t>(i);
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
    const int64_t want = min(s.np, s.k_off / a.meta_page + 3);
    int sort_n = 1;
    while (sort_n < want) sort_n <<= 1;
    unsigned long long* sel = sort_smem;
    TopKSelect(l, s.np, static_cast<int>(want), sort_n, sel);
    // Walk the pages by score until k_off positions are taken; key them by page for the sort.
    if (threadIdx.x == 0) {
      int64_t left = s.k_off;
      for (int i = 0; i < sort_n; ++i) {
        unsigned long long key = ~0ull;
        if (i < want && left > 0) {
          const int64_t pg = s.p_lo + static_cast<int64_t>(sel[i] & 0xffffffffu);
          const int64_t lo = max(pg * a.meta_page, s.off_lo);
          const int64_t take = min(min((pg + 1) * a.meta_page, s.off_hi) - lo, left);
          left -= take;
          key = (static_cast<unsigned long long>(pg) << 32) | static_cast<unsigned long long>(take);
        }
        sel[i] = key;
      }
      s_total = s.k_off - left;
    }
    __syncthreads();
    BitonicSortBlock(sel, sort_n);
    // Prefix offsets of the pages' positions (serial: at most k_off / page + 3 entries).
    int32_t* offs = reinterpret_cast<int32_t*>(sort_smem + sort_n);
    if (threadIdx.x == 0) {
      int32_t off = 0;
      for (int i = 0; i < sort_n && sel[i] != ~0ull; ++i) {
        offs[i] = off;
        off += static_cast<int32_t>(sel[i] & 0xffffffffu);
      }
    }
    __syncthreads();
    // One warp per page writes its positions.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = warp; i < sort_n; i += kTopKThreads / 32) {
      const unsigned long long key = sel[i];
      if (key == ~0ull) break;
      const int64_t pg = static_cast<int64_t>(key >> 32);
      const int64_t off = offs[i];
      const int64_t take = static_cast<int64_t>(key & 0xffffffffu);
      const int64_t lo = max(pg * a.meta_page, s.off_lo);
      for (int64_t j = lane; j < take; j += 32) out[s.sinks + off + j] = static_cast<int32_t>(lo + j);
    }
    taken = s_total;
  }
  const int64_t w0 = s.sinks + taken;
  for (int64_t i = s.off_hi + threadIdx.x; i < n; i += blockDim.x) out[w0 + (i - s.off_hi)] = static_cast<int32_t>(i);
  if (threadIdx.x == 0) a.list_count[item] = static_cast<int32_t>(w0 + (n - s.off_hi));
}


// ---- kSparcas -----------------------------------------------------------------------------------

__device__ __forceinline__ int64_t ItemT(const DecodeStepArgs& a, int32_t b, int32_t h) {
  return (static_cast<int64_t>(a.slots[b]) * a.num_layers + a.layer) * a.num_kv_heads + h;
}

template <typename T>
__device__ __forceinline__ T* CompactOf(const DecodeStepArgs& a, int32_t b, int32_t h) {
  return reinterpret_cast<T*>(a.meta) +
         SparcasCompactOffset(a.slots[b], a.layer, h, a.num_layers, a.num_kv_heads, a.meta_pages,
                              a.params.head_dim, a.sparcas_db, a.sparcas_dense_layers);
}

// Grid (items), 256 threads: whether the step ranks, the dimensions (every u ranked steps), and
// the compact rows to (re)gather, into the item's SparcasState.
__global__ void __launch_bounds__(256) SparcasPrepKernel(DecodeStepArgs a) {
  __shared__ float imp[256];
  __shared__ int32_t chosen[256];
  __shared__ int32_t picked[256];
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int hd = a.params.head_dim, group = a.params.group;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const QuestSplit sp = QuestSplitOf(a, n);
  const int64_t t = ItemT(a, b, h);
  SparcasState* st = a.sparcas_state + t;
  if (sp.all || sp.k_off <= 0) {
    if (threadIdx.x == 0) st->ranked = 0;
    return;
  }
  const int d_b = SparcasDimsOf(a.layer, a.sparcas_dense_layers, a.sparcas_db, hd);
  const int32_t cur_db = st->d_b;
  const int32_t since = st->since_refresh;
  int64_t seen = st->seen;
  if (seen > n) seen = 0;
  __syncthreads();  // every thread has read the state before thread 0 rewrites it
  int32_t* dims = a.sparcas_dims + t * hd;
  bool regather = false;
  const bool choose = cur_db != d_b || since >= a.sparcas_u;
  if (choose) {
    const int64_t q0 = static_cast<int64_t>(item) * group * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      float x = 0.0f;
      for (int g = 0; g < group; ++g) x += fabsf(LoadElem(a.q, a.q_dtype, q0 + static_cast<int64_t>(g) * hd + d));
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
  const SparcasState st = a.sparcas_state[t];
  if (st.ranked == 0) return;
  const int hd = a.params.head_dim;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int d_b = st.d_b;
  const int32_t* dims = a.sparcas_dims + t * hd;
  T* compact = CompactOf<T>(a, b, h);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t row_bytes = static_cast<size_t>(hd) * sizeof(T);
  const char* res_k =
      a.resident + static_cast<size_t>(t * 2 * (static_cast<int64_t>(a.sink) + a.window)) * row_bytes;
  const unsigned long long* pages = reinterpret_cast<const unsigned long long*>(a.pages) + t * a.max_pages;
  for (int64_t j = st.from + static_cast<int64_t>(blockIdx.y) * kScoreWarps + warp; j < n;
       j += static_cast<int64_t>(gridDim.y) * kScoreWarps) {
    T* dst = compact + j * d_b;
    if (j == n - 1) {
      const int64_t src = static_cast<int64_t>(item) * hd;
      for (int i = lane; i < d_b; i += 32) dst[i] = FromF32<T>(LoadElem(a.k, a.k_dtype, src + dims[i]));
    } else {
      const int64_t row = ResidentRowOf(j, n, a.sink, a.window);
      const T* kp = row >= 0 ? reinterpret_cast<const T*>(res_k + static_cast<size_t>(row) * row_bytes)
                             : reinterpret_cast<const T*>(StoreKRow(pages, j, static_cast<uint32_t>(a.page_tokens), row_bytes));
      for (int i = lane; i < d_b; i += 32) dst[i] = kp[dims[i]];
    }
  }
}

// Grid (items, y), a warp per position in [0, n): partial logits over the compact keys (log2
// domain) into select_ws[item][g][j].
template <typename T>
__global__ void __launch_bounds__(kScoreWarps * 32) SparcasScoreKernel(DecodeStepArgs a) {
  extern __shared__ float q_s[];  // [group][d_b], the chosen dimensions of q, scaled
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int64_t t = ItemT(a, b, h);
  const SparcasState st = a.sparcas_state[t];
  if (st.ranked == 0) return;
  const int hd = a.params.head_dim, group = a.params.group, d_b = st.d_b;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int32_t* dims = a.sparcas_dims + t * hd;
  const float qscale = a.params.scale * kLog2e;
  const int64_t q0 = static_cast<int64_t>(item) * group * hd;
  for (int i = threadIdx.x; i < group * d_b; i += blockDim.x) {
    q_s[i] = LoadElem(a.q, a.q_dtype, q0 + static_cast<int64_t>(i / d_b) * hd + dims[i % d_b]) * qscale;
  }
  __syncthreads();
  const T* compact = CompactOf<T>(a, b, h);
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

// A CTA per item: SparCas's list (sinks, top k_off of the offloaded range, window). Layers below
// dense_layers score with SelectScoreKernel (every dimension of the keys where they lie).
__global__ void __launch_bounds__(kTopKThreads) SparcasTopKKernel(DecodeStepArgs a, int sort_cap) {
  extern __shared__ unsigned long long sort_smem[];
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const QuestSplit sp = QuestSplitOf(a, n);
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  if (sp.all) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = static_cast<int32_t>(i);
    if (threadIdx.x == 0) a.list_count[item] = static_cast<int32_t>(n);
    return;
  }
  for (int64_t i = threadIdx.x; i < sp.sinks; i += blockDim.x) out[i] = static_cast<int32_t>(i);
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
  const int64_t w0 = sp.sinks + taken;
  for (int64_t i = sp.off_hi + threadIdx.x; i < n; i += blockDim.x) out[w0 + (i - sp.off_hi)] = static_cast<int32_t>(i);
  if (threadIdx.x == 0) a.list_count[item] = static_cast<int32_t>(w0 + (n - sp.off_hi));
}

}  // namespace

Status LaunchDecodeSelect(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream) {
  if (a.batch == 0 || a.scoring == SelectScoring::kNone) return Status::Ok();
  KVF_RETURN_IF_ERROR(CheckAttnShape(a.params));
  KVF_CHECK_ARG(a.scoring == SelectScoring::kExactTopK || a.scoring == SelectScoring::kQuestPages ||
                    a.scoring == SelectScoring::kSparcas,
                "DecodeSelect: unknown scoring ", static_cast<int>(a.scoring));
  KVF_CHECK_ARG(a.list != nullptr && a.list_count != nullptr && a.select_ws != nullptr &&
                    a.slots != nullptr && a.positions != nullptr && a.pages != nullptr,
                "DecodeSelect: null list, workspace, slots, positions or page table");
  KVF_CHECK_ARG(a.params.group <= 64, "DecodeSelect: group ", a.params.group, " > 64");
  KVF_CHECK_ARG(a.budget_cap >= 1 && a.list_cap >= a.budget_cap && a.budget_cap < (int64_t{1} << 30),
                "DecodeSelect: list_cap ", a.list_cap, " < budget_cap ", a.budget_cap);
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  const size_t q_smem = static_cast<size_t>(a.params.group) * a.params.head_dim * sizeof(float);
  const int64_t fill = std::max<int64_t>(1, int64_t{info.num_sms} * 8 / items);
  if (a.scoring == SelectScoring::kQuestPages) {
    KVF_CHECK_ARG(a.meta != nullptr && a.meta_page >= 1 && a.meta_pages >= 1,
                  "DecodeSelect: quest without page bounds");
    int64_t sort_cap = 1;
    while (sort_cap < a.budget_cap / a.meta_page + 3) sort_cap <<= 1;
    KVF_CHECK_ARG(sort_cap <= kTopKSmemItems, "DecodeSelect: quest budget ", a.budget_cap,
                  " over ", kTopKSmemItems, " pages of ", a.meta_page);
    const int64_t pages = (a.select_ld + a.meta_page - 1) / a.meta_page;
    const unsigned gy = static_cast<unsigned>(
        std::clamp<int64_t>(std::min((pages + kScoreWarps * 4 - 1) / (kScoreWarps * 4), fill), 1, 65535));
    KVF_RETURN_IF_ERROR(DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
      return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
        QuestAppendKernel<T><<<static_cast<unsigned>(items), 128, 0, stream>>>(a);
        KVF_CUDA_CHECK_LAUNCH(QuestAppendKernel);
        if (q_smem > 48 * 1024) {
          KVF_CUDA_CHECK(cudaFuncSetAttribute(QuestScoreKernel<HD, T>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(q_smem)));
        }
        QuestScoreKernel<HD, T><<<dim3(static_cast<unsigned>(items), gy), kScoreWarps * 32, q_smem,
                                  stream>>>(a);
        KVF_CUDA_CHECK_LAUNCH(QuestScoreKernel);
        return Status::Ok();
      });
    }));
    const size_t smem = static_cast<size_t>(sort_cap) * (sizeof(unsigned long long) + sizeof(int32_t));
    QuestTopKKernel<<<static_cast<unsigned>(items), kTopKThreads, smem, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(QuestTopKKernel);
    return Status::Ok();
  }
  int64_t sort_cap = 1;
  while (sort_cap < a.budget_cap) sort_cap <<= 1;
  KVF_CHECK_ARG(sort_cap <= kTopKSmemItems || a.topk_ws != nullptr,
                "DecodeSelect: budget_cap ", a.budget_cap, " needs a top-k workspace");
  const int64_t want = (a.select_ld + kScoreWarps * 8 - 1) / (kScoreWarps * 8);
  const unsigned gy = static_cast<unsigned>(std::clamp<int64_t>(std::min(want, fill), 1, 65535));
  const size_t topk_smem = sort_cap <= kTopKSmemItems ? sort_cap * sizeof(unsigned long long) : 0;
  if (a.scoring == SelectScoring::kSparcas) {
    KVF_CHECK_ARG(a.meta != nullptr && a.sparcas_state != nullptr && a.sparcas_dims != nullptr &&
                      a.params.head_dim <= 256,
                  "DecodeSelect: sparcas without its compact keys or state");
    SparcasPrepKernel<<<static_cast<unsigned>(items), 256, 0, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(SparcasPrepKernel);
    const bool dense_layer = a.layer < a.sparcas_dense_layers;
    KVF_RETURN_IF_ERROR(DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
      return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
        if (dense_layer) {  // every dimension: the keys where they lie, as the oracle
          SelectScoreKernel<HD, T><<<dim3(static_cast<unsigned>(items), gy), kScoreWarps * 32,
                                     q_smem, stream>>>(a);
          KVF_CUDA_CHECK_LAUNCH(SelectScoreKernel);
          return Status::Ok();
        }
        SparcasGatherKernel<T><<<dim3(static_cast<unsigned>(items), gy), kScoreWarps * 32, 0,
                                 stream>>>(a);
        KVF_CUDA_CHECK_LAUNCH(SparcasGatherKernel);
        const size_t qs = static_cast<size_t>(a.params.group) * HD * sizeof(float);
        SparcasScoreKernel<T><<<dim3(static_cast<unsigned>(items), gy), kScoreWarps * 32, qs,
                                stream>>>(a);
        KVF_CUDA_CHECK_LAUNCH(SparcasScoreKernel);
        return Status::Ok();
      });
    }));
    SparcasTopKKernel<<<static_cast<unsigned>(items), kTopKThreads, topk_smem, stream>>>(
        a, static_cast<int>(sort_cap));
    KVF_CUDA_CHECK_LAUNCH(SparcasTopKKernel);
    return Status::Ok();
  }
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
  const size_t smem = topk_smem;
  SelectTopKKernel<<<static_cast<unsigned>(items), kTopKThreads, smem, stream>>>(
      a, static_cast<int>(sort_cap));
  KVF_CUDA_CHECK_LAUNCH(SelectTopKKernel);
  return Status::Ok();
}

Status LaunchPageBounds(const PageBoundsArgs& a, cudaStream_t stream) {
  if (a.new_len <= a.pos0) return Status::Ok();
  KVF_CHECK_ARG(a.meta != nullptr && a.pages != nullptr && a.meta_page >= 1,
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
