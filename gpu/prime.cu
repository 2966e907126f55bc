// Copyright kvferry authors. Apache-2.0.
// The prefill priming statistics of a history-table policy (PrimeArgs, LFPS's tables) on the GPU,
// beside the prefill pass and from the same staged rows, so that no host loop scores the prompt.
// Three launches on the caller's stream, after the tables and stats are zeroed:
//   1. stats: grid (splits, KV heads), a CTA per contiguous key split of [sink, n). Per query
//      vector (row, head of the group) the running softmax max and sum over the split's visible
//      scored keys, one (max, sum) pair per split into the scratch; the column sums of K and V
//      and, for the last row, the sum of its logits (the spread's mean).
//   2. combine: a thread per query vector folds its splits into (max, 1 / sum) and writes |q|^2
//      of the last row.
//   3. weights: the same grid recomputes the logits, turns them into weights, sums them per key
//      (ver, the split's own keys: plain stores) and per distance (sla, through a shared tile and
//      one global atomic per distance and tile), and sums the last row's squared deviations.
// Why a kernel of its own and not the prefill kernel's softmax: the prefill kernel never forms a
// row's normalised weights (online softmax over tiles) and its grid is over queries; priming
// needs the final weights of the last `rows` rows summed per key, so it pays a second QK pass
// over those rows only (rows x group vectors, 32 x 4 for LFPS's default), on CUDA cores: the
// vectors are few and the pass is memory- and atomic-bound, not FLOP-bound.
//
// Layout: query vector v = r * group + g of head h at q + h * q_head_stride + v * head_dim (fp32);
// K and V rows through the page table (KvPages layout). A warp owns kPrimeQv / 4 query vectors of
// a chunk, its lanes 32 consecutive keys; the key tile is held in shared memory as fp32 with a
// padded stride so that lane j's reads of row j are conflict-free.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "base/check.h"
#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"

namespace kvferry::cuda {
namespace {

constexpr int kPrimeThreads = 128;  // 4 warps
constexpr int kPrimeWarps = kPrimeThreads / 32;
constexpr int kPrimeTile = 32;           // keys per tile: one per lane
constexpr int kPrimeMinSplitKeys = 256;  // fewest keys a split handles

// Query vectors per chunk: 8 KiB of fp32 queries in shared memory at every head_dim.
template <int HD>
constexpr int PrimeChunk() {
  return 2048 / HD;
}

template <typename T>
__device__ __forceinline__ const T* PagedRow(void* const* pages, int32_t page_tokens, int64_t pos,
                                             int head_dim, bool value) {
  const T* page = static_cast<const T*>(pages[pos / page_tokens]);
  return page + ((value ? page_tokens : 0) + pos % page_tokens) * static_cast<int64_t>(head_dim);
}

// Shared state of one CTA: the query chunk and the key tile in fp32.
template <int HD>
struct PrimeSmem {
  float q[PrimeChunk<HD>()][HD];
  float k[kPrimeTile][HD + 1];
  float m[PrimeChunk<HD>()];    // weights pass: the chunk's softmax max
  float inv[PrimeChunk<HD>()];  // and 1 / sum
  float ver[kPrimeTile];
  float sla[kPrimeTile + PrimeChunk<HD>()];
};

// The split of [sink, n) this CTA handles; empty past the end.
struct PrimeSplit {
  int64_t begin, end;
};
__device__ __forceinline__ PrimeSplit SplitOf(const PrimeArgs& a, int64_t span) {
  const int64_t begin = a.sink + static_cast<int64_t>(blockIdx.x) * span;
  return {begin, begin + span < a.n ? begin + span : a.n};
}

// Loads query vectors [v0, v0 + chunk) of head h (zeros past the last).
template <int HD>
__device__ __forceinline__ void LoadQueries(const PrimeArgs& a, int h, int v0, int num_v,
                                            PrimeSmem<HD>& sm) {
  constexpr int kQv = PrimeChunk<HD>();
  const float* q = a.q + h * a.q_head_stride;
  for (int e = threadIdx.x; e < kQv * HD; e += kPrimeThreads) {
    const int v = v0 + e / HD;
    sm.q[e / HD][e % HD] = v < num_v ? q[static_cast<int64_t>(v) * HD + e % HD] : 0.0f;
  }
}

// Loads the K rows of [p0, p0 + kPrimeTile) (zeros at and past end).
template <int HD, typename T>
__device__ __forceinline__ void LoadKeys(const PrimeArgs& a, void* const* pages, int64_t p0,
                                         int64_t end, PrimeSmem<HD>& sm) {
  for (int e = threadIdx.x; e < kPrimeTile * HD; e += kPrimeThreads) {
    const int j = e / HD, c = e % HD;
    const int64_t pos = p0 + j;
    sm.k[j][c] = pos < end ? ToF32(PagedRow<T>(pages, a.store.page_tokens, pos, HD, false)[c]) : 0.0f;
  }
}

// acc[i] = scale * q_{warp + kPrimeWarps i} . k_lane over the tile in shared memory.
template <int HD>
__device__ __forceinline__ void Logits(const PrimeSmem<HD>& sm, float scale, float* acc) {
  constexpr int kPerWarp = PrimeChunk<HD>() / kPrimeWarps;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kPerWarp; ++i) acc[i] = 0.0f;
#pragma unroll 8
  for (int c = 0; c < HD; ++c) {
    const float k = sm.k[lane][c];
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) acc[i] = fmaf(sm.q[warp + kPrimeWarps * i][c], k, acc[i]);
  }
#pragma unroll
  for (int i = 0; i < kPerWarp; ++i) acc[i] *= scale;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// One (max, sum) pair folded into another; -inf maxima carry no mass.
__device__ __forceinline__ void FoldSoftmax(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  const float mx = fmaxf(m, m2);
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

__device__ __forceinline__ double* StatsOf(const PrimeArgs& a, int h) {
  return a.stats + h * PrimeStatsCount(a.params.head_dim, a.params.group);
}

// Pass 1: per query vector and split the softmax (max, sum) over the visible scored keys; K and V
// column sums; the last row's logit sum.
template <int HD, typename T>
__global__ void __launch_bounds__(kPrimeThreads)
    PrimeStatsKernel(PrimeArgs a, int64_t span, int splits) {
  constexpr int kQv = PrimeChunk<HD>();
  constexpr int kPerWarp = kQv / kPrimeWarps;
  constexpr int kCols = (HD + kPrimeThreads - 1) / kPrimeThreads;
  __shared__ PrimeSmem<HD> sm;
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = a.params.group;
  const int num_v = a.rows * group;
  const int last_v0 = (a.rows - 1) * group;  // first vector of the last row
  void* const* pages = a.store.pages + h * a.store.max_pages;
  const PrimeSplit split = SplitOf(a, span);
  float2* partial =
      static_cast<float2*>(a.scratch) + (static_cast<int64_t>(h) * splits + blockIdx.x) * num_v;
  double* stats = StatsOf(a, h);
  float k_sum[kCols] = {}, v_sum[kCols] = {};
  for (int v0 = 0; v0 < num_v; v0 += kQv) {
    __syncthreads();
    LoadQueries<HD>(a, h, v0, num_v, sm);
    float m[kPerWarp], s[kPerWarp], l_sum[kPerWarp];
    int64_t t_end[kPerWarp];  // keys visible to the vector: [sink, t_end)
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      m[i] = -INFINITY;
      s[i] = 0.0f;
      l_sum[i] = 0.0f;
      const int64_t t = a.t_first + (v0 + warp + kPrimeWarps * i) / group;
      t_end[i] = t + 1 < a.off_hi ? t + 1 : a.off_hi;
    }
    for (int64_t p0 = split.begin; p0 < split.end; p0 += kPrimeTile) {
      __syncthreads();
      LoadKeys<HD, T>(a, pages, p0, split.end, sm);
      __syncthreads();
      if (v0 == 0) {  // column sums, once per key
#pragma unroll
        for (int u = 0; u < kCols; ++u) {
          const int c = threadIdx.x + u * kPrimeThreads;
          if (c >= HD) continue;
          for (int j = 0; j < kPrimeTile && p0 + j < split.end; ++j) {
            k_sum[u] += sm.k[j][c];
            v_sum[u] += ToF32(PagedRow<T>(pages, a.store.page_tokens, p0 + j, HD, true)[c]);
          }
        }
      }
      float l[kPerWarp];
      Logits<HD>(sm, a.params.scale, l);
      const int64_t pos = p0 + lane;
#pragma unroll
      for (int i = 0; i < kPerWarp; ++i) {
        const int v = v0 + warp + kPrimeWarps * i;
        if (v >= num_v) continue;
        if (pos < t_end[i] && pos < split.end) FoldSoftmax(m[i], s[i], l[i], 1.0f);
        if (v >= last_v0 && pos < split.end) l_sum[i] += l[i];
      }
    }
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int v = v0 + warp + kPrimeWarps * i;  // uniform over the warp
      float mi = m[i], si = s[i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        FoldSoftmax(mi, si, __shfl_xor_sync(0xffffffffu, mi, o),
                    __shfl_xor_sync(0xffffffffu, si, o));
      }
      const float ls = WarpSum(l_sum[i]);
      if (lane == 0 && v < num_v) {
        partial[v] = make_float2(mi, si);
        if (v >= last_v0) atomicAdd(stats + 2 * HD + (v - last_v0), static_cast<double>(ls));
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kCols; ++u) {
    const int c = threadIdx.x + u * kPrimeThreads;
    if (c < HD && split.begin < split.end) {
      atomicAdd(stats + c, static_cast<double>(k_sum[u]));
      atomicAdd(stats + HD + c, static_cast<double>(v_sum[u]));
    }
  }
}

// Pass 2: a thread per (head, vector): the splits' pairs folded into (max, 1 / sum) after the
// partials; |q|^2 of the last row's vectors.
__global__ void PrimeCombineKernel(PrimeArgs a, int splits) {
  const int num_v = a.rows * a.params.group;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(a.num_kv_heads) * num_v) return;
  const int h = static_cast<int>(idx / num_v), v = static_cast<int>(idx % num_v);
  const float2* partial =
      static_cast<const float2*>(a.scratch) + static_cast<int64_t>(h) * splits * num_v;
  float m = -INFINITY, s = 0.0f;
  for (int sp = 0; sp < splits; ++sp) {
    const float2 p = partial[static_cast<int64_t>(sp) * num_v + v];
    FoldSoftmax(m, s, p.x, p.y);
  }
  float2* final_pairs =
      static_cast<float2*>(a.scratch) + static_cast<int64_t>(a.num_kv_heads) * splits * num_v;
  final_pairs[idx] = make_float2(m, s > 0.0f ? 1.0f / s : 0.0f);
  const int group = a.params.group, hd = a.params.head_dim;
  const int last_v0 = (a.rows - 1) * group;
  if (v >= last_v0) {
    const float* q = a.q + h * a.q_head_stride + static_cast<int64_t>(v) * hd;
    double qq = 0.0;
    for (int c = 0; c < hd; ++c) qq += static_cast<double>(q[c]) * q[c];
    StatsOf(a, h)[2 * hd + 2 * group + (v - last_v0)] = qq;
  }
}

// Pass 3: the weights, summed per key (ver) and per distance (sla); the last row's squared
// deviations from its mean logit.
template <int HD, typename T>
__global__ void __launch_bounds__(kPrimeThreads)
    PrimeWeightsKernel(PrimeArgs a, int64_t span, int splits) {
  constexpr int kQv = PrimeChunk<HD>();
  constexpr int kPerWarp = kQv / kPrimeWarps;
  constexpr int kSla = kPrimeTile + kQv;
  __shared__ PrimeSmem<HD> sm;
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = a.params.group;
  const int num_v = a.rows * group;
  const int last_v0 = (a.rows - 1) * group;
  void* const* pages = a.store.pages + h * a.store.max_pages;
  const PrimeSplit split = SplitOf(a, span);
  const float2* final_pairs = static_cast<const float2*>(a.scratch) +
                              (static_cast<int64_t>(a.num_kv_heads) * splits + h) * num_v;
  float* ver = a.tables + h * a.table_stride;
  float* sla = ver + a.n;
  double* stats = StatsOf(a, h);
  const double len = static_cast<double>(a.n - a.sink);
  for (int v0 = 0; v0 < num_v; v0 += kQv) {
    __syncthreads();
    LoadQueries<HD>(a, h, v0, num_v, sm);
    for (int e = threadIdx.x; e < kQv; e += kPrimeThreads) {
      const float2 f = v0 + e < num_v ? final_pairs[v0 + e] : make_float2(-INFINITY, 0.0f);
      sm.m[e] = f.x;
      sm.inv[e] = f.y;
    }
    double mean[kPerWarp];
    float l_sq[kPerWarp];
    int64_t t_end[kPerWarp];
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int v = v0 + warp + kPrimeWarps * i;
      const int64_t t = a.t_first + v / group;
      t_end[i] = t + 1 < a.off_hi ? t + 1 : a.off_hi;
      mean[i] = v >= last_v0 && v < num_v ? stats[2 * HD + (v - last_v0)] / len : 0.0;
      l_sq[i] = 0.0f;
    }
    // Distances of the chunk's rows to the tile's keys start at d_lo (the first row to the
    // tile's last key); index e = d - d_lo < kSla.
    const int64_t row_lo = a.t_first + v0 / group;
    for (int64_t p0 = split.begin; p0 < split.end; p0 += kPrimeTile) {
      __syncthreads();
      LoadKeys<HD, T>(a, pages, p0, split.end, sm);
      for (int e = threadIdx.x; e < kSla; e += kPrimeThreads) sm.sla[e] = 0.0f;
      if (threadIdx.x < kPrimeTile) sm.ver[threadIdx.x] = 0.0f;
      __syncthreads();
      float l[kPerWarp];
      Logits<HD>(sm, a.params.scale, l);
      const int64_t pos = p0 + lane;
      const int64_t d_lo = row_lo - (p0 + kPrimeTile - 1);
      float col = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerWarp; ++i) {
        const int local = warp + kPrimeWarps * i, v = v0 + local;
        if (v >= num_v) continue;
        if (pos < t_end[i] && pos < split.end) {
          const float w = expf(l[i] - sm.m[local]) * sm.inv[local];
          col += w;
          const int64_t t = a.t_first + v / group;
          atomicAdd(&sm.sla[t - pos - d_lo], w);
        }
        if (v >= last_v0 && pos < split.end) {
          const float dev = static_cast<float>(l[i] - mean[i]);
          l_sq[i] = fmaf(dev, dev, l_sq[i]);
        }
      }
      atomicAdd(&sm.ver[lane], col);
      __syncthreads();
      // Only this CTA writes its keys' ver entries, always from the same thread: plain adds.
      if (threadIdx.x < kPrimeTile && p0 + threadIdx.x < split.end) {
        ver[p0 + threadIdx.x] += sm.ver[threadIdx.x];
      }
      for (int e = threadIdx.x; e < kSla; e += kPrimeThreads) {
        if (sm.sla[e] != 0.0f) atomicAdd(sla + d_lo + e, sm.sla[e]);  // d >= 0 where weighted
      }
    }
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int v = v0 + warp + kPrimeWarps * i;
      const float sq = WarpSum(l_sq[i]);
      if (lane == 0 && v < num_v && v >= last_v0) {
        atomicAdd(stats + 2 * HD + group + (v - last_v0), static_cast<double>(sq));
      }
    }
  }
}

// Key splits per head: enough CTAs to fill the GPU, none shorter than kPrimeMinSplitKeys keys,
// as many as the scratch holds; 0 when it holds none.
int PrimeSplits(const PrimeArgs& a, int num_sms) {
  const int64_t len = a.n - a.sink;
  const int64_t per_split =
      static_cast<int64_t>(a.num_kv_heads) * a.rows * a.params.group * 2 * sizeof(float);
  const int64_t fit = per_split > 0 ? static_cast<int64_t>(a.scratch_bytes) / per_split - 1 : 0;
  const int64_t want =
      std::min<int64_t>((len + kPrimeMinSplitKeys - 1) / kPrimeMinSplitKeys,
                        std::max<int64_t>(1, 4 * int64_t{num_sms} / a.num_kv_heads));
  return static_cast<int>(std::clamp<int64_t>(std::min(want, fit), fit >= 1 ? 1 : 0, 65535));
}

}  // namespace

Status LaunchPrimeAttention(const PrimeArgs& a, int num_sms, cudaStream_t stream) {
  KVF_CUDA_CHECK(cudaMemsetAsync(
      a.tables, 0, static_cast<size_t>(a.num_kv_heads) * a.table_stride * sizeof(float), stream));
  KVF_CUDA_CHECK(cudaMemsetAsync(
      a.stats, 0,
      static_cast<size_t>(a.num_kv_heads * PrimeStatsCount(a.params.head_dim, a.params.group)) *
          sizeof(double),
      stream));
  const int64_t len = a.n - a.sink;
  const int splits = PrimeSplits(a, num_sms);
  KVF_CHECK_ARG(a.scratch != nullptr && splits >= 1, "PrimeAttention: scratch of ", a.scratch_bytes,
                " bytes holds no split for ", a.num_kv_heads, " heads x ", a.rows * a.params.group,
                " query vectors");
  KVF_CHECK_ARG(a.num_kv_heads <= 65535, "PrimeAttention: ", a.num_kv_heads, " KV heads");
  const int num_v = a.rows * a.params.group;
  const int64_t combine = static_cast<int64_t>(a.num_kv_heads) * num_v;
  const int64_t span =
      len <= 0 ? 0 : ((len + splits - 1) / splits + kPrimeTile - 1) / kPrimeTile * kPrimeTile;
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(a.num_kv_heads));
  return DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
      PrimeStatsKernel<HD, T><<<grid, kPrimeThreads, 0, stream>>>(a, span, splits);
      KVF_CUDA_CHECK_LAUNCH(PrimeStatsKernel);
      PrimeCombineKernel<<<static_cast<unsigned>((combine + 127) / 128), 128, 0, stream>>>(a,
                                                                                           splits);
      KVF_CUDA_CHECK_LAUNCH(PrimeCombineKernel);
      PrimeWeightsKernel<HD, T><<<grid, kPrimeThreads, 0, stream>>>(a, span, splits);
      KVF_CUDA_CHECK_LAUNCH(PrimeWeightsKernel);
      return Status::Ok();
    });
  });
}

}  // namespace kvferry::cuda
