// Copyright kvferry authors. Apache-2.0.
// SparCas's selection on the GPU (policies/sparcas/device_selector.cpp): with smoothing the
// channel scales at an item's first ranked step, the prep (the dimensions, what to gather), the
// gather of the compact rows, the scores over them, then the top-k (gpu/decode_select.cu). HiP's
// selection keeps the same compact rows (policies/hip/select.cu). The host twin is
// policies/sparcas/select_host.cpp.

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
#include "base/sparcas_q4.h"
#include "policies/sparcas/select.cuh"
#include "policies/sparcas/select.h"

namespace kvferry::cuda {
namespace {

// Item t's channel scales (smooth 1 at a 4-bit layer, base/sparcas_q4.h), or null.
__device__ __forceinline__ float* SparcasScalesOf(const DecodeStepArgs& a, int64_t t) {
  return SparcasArgsOf(a).smooth != 0 && SparcasArgsOf(a).scales != nullptr &&
                 SparcasBitsOf(a.layer, SparcasArgsOf(a).dense_layers, SparcasArgsOf(a).bits) == 4
             ? SparcasArgsOf(a).scales + t * a.params.head_dim
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
  const ItemSplit sp = ItemSplitOf(a, n);
  if (sc == nullptr || sp.all || sp.k_off <= 0 || SparcasArgsOf(a).state[t].d_b != 0) return;
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
  const ItemSplit sp = ItemSplitOf(a, n);
  const int64_t t = ItemT(a, b, h);
  SparcasState* st = SparcasArgsOf(a).state + t;
  if (sp.all || sp.k_off <= 0) {
    if (threadIdx.x == 0) st->ranked = 0;
    return;
  }
  const int d_b = SparcasDimsOf(a.layer, SparcasArgsOf(a).dense_layers, SparcasArgsOf(a).db, hd);
  const int32_t cur_db = st->d_b;
  const int32_t since = st->since_refresh;
  int64_t seen = st->seen;
  if (seen > n) seen = 0;
  __syncthreads();  // every thread has read the state before thread 0 rewrites it
  int32_t* dims = SparcasArgsOf(a).dims + t * hd;
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
  const bool choose = cur_db != d_b || since >= SparcasArgsOf(a).u;
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
  const SparcasState st = SparcasArgsOf(a).state[t];
  if (st.ranked == 0) return;
  const int hd = a.params.head_dim;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int d_b = st.d_b;
  const int32_t* dims = SparcasArgsOf(a).dims + t * hd;
  T* compact = CompactOf<T>(a, b, h);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const SparcasKeySource<T> source_row = SparcasKeySourceOf<T>(a, t, n);
  if (SparcasBitsOf(a.layer, SparcasArgsOf(a).dense_layers, SparcasArgsOf(a).bits) == 4) {
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
  const SparcasState st = SparcasArgsOf(a).state[it.t];
  it.ranked = st.ranked != 0;
  if (!it.ranked) return it;
  const int hd = a.params.head_dim, group = a.params.group;
  it.d_b = min(st.d_b, max_db);
  it.n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int32_t* dims = SparcasArgsOf(a).dims + it.t * hd;
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
  // A warp's 32 consecutive rows are staged in shared memory with 16-byte loads (a 36-byte row
  // read a word at a time by its thread makes each warp-wide load span 9 cache lines), then each
  // thread reads its row there (an odd row stride: no bank conflicts).
  const int row_words = words + 1;
  const size_t q_bytes = static_cast<size_t>(group) * (d_b * sizeof(float) + words * sizeof(int2) + 8);
  uint32_t* stage = reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(q_raw) + (q_bytes + 15) / 16 * 16) +
                    warp * 32 * row_words;
  for (int64_t jb = static_cast<int64_t>(blockIdx.y) * blockDim.x + warp * 32; jb < n;
       jb += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    const int valid = static_cast<int>(min(int64_t{32}, n - jb));
    const uint32_t* src = rows + jb * row_words;
    const int total = valid * row_words;
    __syncwarp();  // the warp's reads of the previous rows are done
    int i0 = 0;
    if ((reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
      for (int i = lane; i < total / 4; i += 32) {
        reinterpret_cast<uint4*>(stage)[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
      }
      i0 = total / 4 * 4;
    }
    for (int i = i0 + lane; i < total; i += 32) stage[i] = __ldg(src + i);
    __syncwarp();
    if (lane >= valid) continue;  // the warp's last rows (past n: the loop ends for every lane)
    const int64_t j = jb + lane;
    const uint32_t* row = stage + lane * row_words;
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
  if (blockIdx.y == 0) MctaZeroHistograms(ws);
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
  if (SparcasArgsOf(a).state[t].ranked == 0) return;
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

// gridDim.y of the kernels with a thread a position over kSparcasThreads-thread CTAs, at most
// per_sm CTAs an SM over all items (and at most cap).
unsigned ThreadGridY(const DecodeStepArgs& a, const LaunchInfo& info, const SelectGrid& g, int64_t per_sm,
                     int64_t cap = 65535) {
  const int64_t per_item = std::max<int64_t>(1, int64_t{info.num_sms} * per_sm / g.items);
  return static_cast<unsigned>(std::clamp<int64_t>(
      std::min((a.select_ld + kSparcasThreads - 1) / kSparcasThreads, per_item), 1, cap));
}


// SparCas's scores of one layer into select_ws, from its compact rows: every dimension at its
// dense layers, else its chosen d_b (4-bit rows, or the KV dtype: a thread a position for small
// d_b, a warp a position above). Sets *stats_parts > 0 when the scoring wrote the top-k's
// statistics.
template <int HD, typename T>
Status LaunchSparcasScores(const DecodeStepArgs& a, const LaunchInfo& info, const SelectGrid& g,
                           cudaStream_t stream, int32_t* stats_parts) {
  const unsigned items = static_cast<unsigned>(g.items);
  if (a.layer < SparcasArgsOf(a).dense_layers) {
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
      KVF_CUDA_CHECK(cudaFuncSetAttribute(SelectScoreKernel<HD, T, CompactKeys>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(g.q_smem)));
    }
    SelectScoreKernel<HD, T, CompactKeys><<<dim3(items, g.gy), kScoreWarps * 32, g.q_smem, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(SelectScoreKernel);
    return Status::Ok();
  }
  const int d_b = SparcasDimsOf(a.layer, SparcasArgsOf(a).dense_layers, SparcasArgsOf(a).db, HD);
  if (SparcasBitsOf(a.layer, SparcasArgsOf(a).dense_layers, SparcasArgsOf(a).bits) == 4) {
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
    // and, 16-byte aligned, each warp's staged rows
    const size_t smem = (qs_db + 15) / 16 * 16 + size_t{kSparcasThreads} * (SparcasQ4Words(d_b) + 1) * 4;
    const auto kernel = a.params.group <= 4 ? SparcasScoreQ4Kernel<4> : SparcasScoreQ4Kernel<kSparcasQ4Heads>;
    if (smem > 48 * 1024) {
      KVF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    kernel<<<dim3(items, ty), kSparcasThreads, smem, stream>>>(a, *stats_parts > 0 ? 1 : 0);
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


// With smoothing the channel scales at an item's first ranked step, then the prep
// (dimensions, what to gather), the gather of the compact rows, the scores and the top-k.
Status SparcasSelect(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream,
                     const SelectGrid& g) {
  KVF_CHECK_ARG(SelectSortCap(a) <= kTopKSmemItems || a.topk_ws != nullptr,
                "DecodeSelect: budget_cap ", a.budget_cap, " needs a top-k workspace");
  const SparcasStepArgs sp = SparcasArgsOf(a);
  KVF_CHECK_ARG(a.meta != nullptr && sp.state != nullptr && sp.dims != nullptr && a.params.head_dim <= 256,
                "DecodeSelect: sparcas without its compact keys or state");
  const unsigned items = static_cast<unsigned>(g.items);
  if (sp.smooth != 0 && SparcasBitsOf(a.layer, sp.dense_layers, sp.bits) == 4) {
    KVF_CHECK_ARG(sp.scales != nullptr, "DecodeSelect: sparcas smooth without its channel scales");
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
}  // namespace

Status SparcasSelectCuda(const void* args, const LaunchInfo& info, void* stream) {
  return SelectLauncher<SparcasSelect>(args, info, stream);
}

Status LaunchSparcasRows(const DecodeStepArgs& a, const SelectGrid& g, cudaStream_t stream) {
  SparcasPrepKernel<<<static_cast<unsigned>(g.items), 256, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(SparcasPrepKernel);
  return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
    SparcasGatherKernel<T><<<dim3(static_cast<unsigned>(g.items), g.gy), kScoreWarps * 32, 0, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(SparcasGatherKernel);
    return Status::Ok();
  });
}

}  // namespace kvferry::cuda
