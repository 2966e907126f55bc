// Copyright kvferry authors. Apache-2.0.
// LFPS's approximate scan (policies/lfps/lfps.cpp, step 3a) on the GPU, over the device's copy of the
// policy's int8 channel-major shadow of K (ShadowScanArgs has the definition; cpu::ShadowScanRef is
// the specification). Per batch of (sequence, KV head) items:
//   1. ScanPrepKernel, a CTA per item: the new token's shadow row, the channel choice and the
//      integer weights, the head maxima reset;
//   2. ScanMaxKernel: the exact int32 logits of 4 keys a thread over the chosen channels, each
//      head's max by warp reduction and one atomicMax per warp;
//   3. ScanScoreKernel: the logits again (16 bytes a key: cheaper to re-read than to store), the
//      key of max_g (acc_g - max_g), histograms of the keys' top 16 and top 8 bits;
//   4. ScanThresholdKernel, a warp per item: the 16-bit bin that holds the picks-th largest key
//      (the threshold), from the coarse histogram down to the fine one;
//   5. ScanCountKernel / ScanWriteKernel: the keys at or above it per block of 1024, then written
//      in ascending position after the blocks before them; the histograms zeroed again.
// The item table may come from mapped host memory (the first pass copies it) and the list and its
// counts may go straight to mapped host memory: the launch then needs no copies of its own.
// Every pass is spread over the GPU (no CTA per item over all its keys) and nothing is sorted:
// the host takes its best picks from the list (it holds every key >= the threshold, a prefix of
// the order). Every value is computed with the host's operations in the host's order (IEEE
// products and quotients, round-to-nearest-even conversions, exact integer sums).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "base/check.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/topk.cuh"

namespace kvferry::cuda {
namespace {

constexpr int kPrepThreads = 256;  // >= head_dim
constexpr int kScanThreads = 256;
constexpr int kKeysPerThread = 4;
constexpr int kMaxDim = 256;

__device__ __forceinline__ float LoadF32(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// x rounded to dtype t and back (round to nearest even, as cpu::ConvertSpan).
__device__ __forceinline__ float RoundTo(float x, DType t) {
  if (t == DType::kBF16) return __bfloat162float(__float2bfloat16_rn(x));
  if (t == DType::kF16) return __half2float(__float2half_rn(x));
  return x;
}

__device__ __forceinline__ int32_t* ItemInts(const ShadowScanArgs& a, int64_t item) {
  return a.ints + item * (a.group + a.channels + int64_t{a.group} * a.channels);
}

__global__ void __launch_bounds__(kPrepThreads) ScanPrepKernel(ShadowScanArgs a) {
  const int64_t it = blockIdx.x;
  // The table from mapped host memory, once, into the device copy the later passes read.
  const ShadowScanItem item = a.item_host != nullptr ? a.item_host[it] : a.item[it];
  if (a.item_host != nullptr && threadIdx.x == 0) a.item[it] = item;
  const int hd = a.head_dim, group = a.group, tid = threadIdx.x;
  const float* scale = a.scale + item.scale;
  if (item.new_pos >= 0 && item.new_pos < a.cap && tid < hd) {
    const float x = RoundTo(LoadF32(a.k, a.k_dtype, it * hd + tid), a.kv_dtype);
    float v = __fmul_rn(x, __fdiv_rn(127.0f, scale[tid]));
    v = v == v ? v : 0.0f;
    v = fminf(fmaxf(v, -127.0f), 127.0f);
    a.shadow[item.shadow + tid * a.cap + item.new_pos] = static_cast<int8_t>(__float2int_rn(v));
  }
  if (item.len <= 0 || item.picks <= 0) return;
  __shared__ float q[kShadowScanMaxGroup * kMaxDim];
  __shared__ float imp[kMaxDim];
  __shared__ int32_t ch[kMaxDim];
  __shared__ float s_wscale;
  const int r = min(a.channels, hd);
  for (int i = tid; i < group * hd; i += blockDim.x) q[i] = LoadF32(a.q, a.q_dtype, it * group * hd + i);
  __syncthreads();
  if (tid < hd) {
    float s = 0.0f;
    for (int g = 0; g < group; ++g) s = __fadd_rn(s, fabsf(q[g * hd + tid]));
    imp[tid] = __fmul_rn(s, scale[tid]);
  }
  __syncthreads();
  if (tid < hd) {  // rank among the channels by (importance desc, channel asc)
    const float x = imp[tid];
    int rank = 0;
    for (int c = 0; c < hd; ++c) rank += imp[c] > x || (imp[c] == x && c < tid);
    if (rank < r) ch[rank] = tid;
  }
  __syncthreads();
  if (tid == 0) {
    float wmax = 0.0f;
    for (int c = 0; c < r; ++c) {
      for (int g = 0; g < group; ++g) wmax = fmaxf(wmax, fabsf(__fmul_rn(q[g * hd + ch[c]], scale[ch[c]])));
    }
    s_wscale = wmax > 0.0f && isfinite(wmax) ? __fdiv_rn(16384.0f, wmax) : 0.0f;
  }
  __syncthreads();
  int32_t* ints = ItemInts(a, it);
  int32_t* w = ints + group + r;
  for (int i = tid; i < group; i += blockDim.x) ints[i] = INT_MIN;
  for (int c = tid; c < r; c += blockDim.x) ints[group + c] = ch[c];
  for (int i = tid; i < group * r; i += blockDim.x) {
    const int g = i / r, c = i % r;
    const float v = __fmul_rn(__fmul_rn(q[g * hd + ch[c]], scale[ch[c]]), s_wscale);
    w[i] = __float2int_rn(v == v ? v : 0.0f);
  }
}

// The logits of this thread's keys j0 .. j0 + 3 (zero past len) into acc.
__device__ __forceinline__ void Logits(const ShadowScanArgs& a, const ShadowScanItem& item,
                                       const int32_t* ch, const int32_t* w, int r, int64_t j0,
                                       int32_t (&acc)[kShadowScanMaxGroup][kKeysPerThread]) {
  for (int g = 0; g < kShadowScanMaxGroup; ++g) {
    for (int u = 0; u < kKeysPerThread; ++u) acc[g][u] = 0;
  }
  for (int c = 0; c < r; ++c) {
    const int8_t* row = a.shadow + item.shadow + ch[c] * a.cap + item.off_lo;
    int32_t x[kKeysPerThread];
    for (int u = 0; u < kKeysPerThread; ++u) x[u] = j0 + u < item.len ? row[j0 + u] : 0;
#pragma unroll
    for (int g = 0; g < kShadowScanMaxGroup; ++g) {
      if (g < a.group) {
        const int32_t wg = w[g * r + c];
        for (int u = 0; u < kKeysPerThread; ++u) acc[g][u] += wg * x[u];
      }
    }
  }
}

// Channels and weights of the item into shared memory; false if the item ranks nothing.
__device__ __forceinline__ bool LoadWeights(const ShadowScanArgs& a, int64_t it, const ShadowScanItem& item,
                                            int32_t* ch, int32_t* w) {
  if (item.len <= 0 || item.picks <= 0) return false;
  const int r = min(a.channels, a.head_dim);
  const int32_t* ints = ItemInts(a, it);
  for (int c = threadIdx.x; c < r; c += blockDim.x) ch[c] = ints[a.group + c];
  for (int i = threadIdx.x; i < a.group * r; i += blockDim.x) w[i] = ints[a.group + r + i];
  __syncthreads();
  return true;
}

__global__ void __launch_bounds__(kScanThreads) ScanMaxKernel(ShadowScanArgs a) {
  const int64_t it = blockIdx.y;
  const ShadowScanItem item = a.item[it];
  __shared__ int32_t ch[kMaxDim];
  __shared__ int32_t w[kShadowScanMaxGroup * kMaxDim];
  const int64_t j0 = (static_cast<int64_t>(blockIdx.x) * kScanThreads + threadIdx.x) * kKeysPerThread;
  if (static_cast<int64_t>(blockIdx.x) * kScanThreads * kKeysPerThread >= item.len) return;
  if (!LoadWeights(a, it, item, ch, w)) return;
  int32_t acc[kShadowScanMaxGroup][kKeysPerThread];
  Logits(a, item, ch, w, min(a.channels, a.head_dim), j0, acc);
  int32_t* mx = ItemInts(a, it);
  for (int g = 0; g < a.group; ++g) {
    int32_t m = INT_MIN;
    for (int u = 0; u < kKeysPerThread; ++u) m = j0 + u < item.len ? max(m, acc[g][u]) : m;
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0 && m != INT_MIN) atomicMax(mx + g, m);
  }
}

// Adds 1 to bins[bin] for every lane of the warp (the lanes with the same bin add once).
__device__ __forceinline__ void WarpCount(uint32_t* bins, uint32_t bin, bool in) {
  const unsigned peers = __match_any_sync(0xffffffffu, in ? bin : 0xffffffffu);
  if (in && static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(bins + bin, __popc(peers));
}

// Keys, and the histograms of their top 16 bits (global) and top 8 bits (per block, then global).
__global__ void __launch_bounds__(kScanThreads) ScanScoreKernel(ShadowScanArgs a) {
  const int64_t it = blockIdx.y;
  const ShadowScanItem item = a.item[it];
  __shared__ int32_t ch[kMaxDim];
  __shared__ int32_t w[kShadowScanMaxGroup * kMaxDim];
  __shared__ int32_t mx[kShadowScanMaxGroup];
  __shared__ uint32_t coarse[256];
  const int64_t j0 = (static_cast<int64_t>(blockIdx.x) * kScanThreads + threadIdx.x) * kKeysPerThread;
  if (static_cast<int64_t>(blockIdx.x) * kShadowScanBlockKeys >= item.len) return;
  if (threadIdx.x < a.group) mx[threadIdx.x] = ItemInts(a, it)[threadIdx.x];
  coarse[threadIdx.x] = 0;  // kScanThreads == 256
  if (!LoadWeights(a, it, item, ch, w)) return;
  int32_t acc[kShadowScanMaxGroup][kKeysPerThread];
  Logits(a, item, ch, w, min(a.channels, a.head_dim), j0, acc);
  uint32_t* keys = a.keys + it * a.max_len;
  uint32_t* fine = a.hist + it * kShadowScanHistStride;
  for (int u = 0; u < kKeysPerThread; ++u) {
    const bool in = j0 + u < item.len;
    uint32_t key = 0;
    if (in) {
      int32_t s = acc[0][u] - mx[0];
      for (int g = 1; g < a.group; ++g) s = max(s, acc[g][u] - mx[g]);
      key = OrderedKey(static_cast<float>(s));  // cpu::ScanKey: (float) s is finite, never -0
      keys[j0 + u] = key;
    }
    WarpCount(fine, key >> 16, in);
    WarpCount(coarse, key >> 24, in);
  }
  __syncthreads();
  if (coarse[threadIdx.x] != 0) atomicAdd(fine + 65536 + threadIdx.x, coarse[threadIdx.x]);
}

// In a warp: the highest bin b of bins[0, 32 * 8) (8 per lane) with above + #{bins >= b} >= need
// (need <= above + the sum of all of them); returns b, and the count in the bins above b in *at.
__device__ __forceinline__ int WarpCrossing(const uint32_t* bins, uint32_t above, uint32_t need,
                                            uint32_t* at) {
  const int lane = threadIdx.x & 31;
  uint32_t v[8], total = 0;
  for (int i = 0; i < 8; ++i) total += v[i] = bins[lane * 8 + i];
  uint32_t incl = total;  // the bins of this lane and the lanes above it
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t t = __shfl_down_sync(0xffffffffu, incl, o);
    if (lane + o < 32) incl += t;
  }
  const unsigned ok = __ballot_sync(0xffffffffu, above + incl >= need);
  const int top = ok == 0 ? 0 : 31 - __clz(ok);
  int bin = top * 8;
  uint32_t acc = above + (incl - total);
  if (lane == top) {
    for (int i = 7; i > 0; --i) {
      if (acc + v[i] >= need) {
        bin = top * 8 + i;
        break;
      }
      acc += v[i];
    }
  }
  bin = __shfl_sync(0xffffffffu, bin, top);
  *at = __shfl_sync(0xffffffffu, acc, top);
  return bin;
}

// Per item: the 16-bit bin of the picks-th largest key, from the top-8-bit bins down to the
// 16-bit ones inside the bin that holds it; counts[item] = the keys at or above it (before the
// capacity check of ScanWriteKernel). One warp per item.
__global__ void ScanThresholdKernel(ShadowScanArgs a, uint32_t* thr) {
  const int64_t it = blockIdx.x;
  const ShadowScanItem item = a.item[it];
  if (item.len <= 0 || item.picks <= 0) {
    if (threadIdx.x == 0) a.counts[it] = 0;
    return;
  }
  const uint32_t* fine = a.hist + it * kShadowScanHistStride;
  const uint32_t picks = static_cast<uint32_t>(min(item.picks, item.len));
  uint32_t above = 0;
  const int c = WarpCrossing(fine + 65536, 0, picks, &above);
  const int f = WarpCrossing(fine + (c << 8), above, picks, &above);
  if (threadIdx.x == 0) {
    thr[it] = static_cast<uint32_t>((c << 8) + f) << 16;
    a.counts[it] = static_cast<int32_t>(above + fine[(c << 8) + f]);
  }
}

// Keys at or above the threshold in each block of kShadowScanBlockKeys.
__global__ void __launch_bounds__(kScanThreads) ScanCountKernel(ShadowScanArgs a, const uint32_t* thr) {
  const int64_t it = blockIdx.y;
  const ShadowScanItem item = a.item[it];
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * kShadowScanBlockKeys;
  if (b0 >= item.len || item.picks <= 0) return;
  const uint32_t t = thr[it];
  const uint32_t* keys = a.keys + it * a.max_len;
  int n = 0;
  for (int u = 0; u < kKeysPerThread; ++u) {
    const int64_t j = b0 + threadIdx.x * kKeysPerThread + u;
    n += j < item.len && keys[j] >= t;
  }
  using Reduce = cub::BlockReduce<int, kScanThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int total = Reduce(tmp).Sum(n);
  const int64_t blocks = (a.max_len + kShadowScanBlockKeys - 1) / kShadowScanBlockKeys;
  if (threadIdx.x == 0) a.block_counts[it * blocks + blockIdx.x] = total;
}

// The keys at or above the threshold in ascending j (each block after the blocks before it), or
// counts[item] = -1 when they exceed max_picks; then the block's share of the histograms zeroed
// for the next launch.
__global__ void __launch_bounds__(kScanThreads) ScanWriteKernel(ShadowScanArgs a, const uint32_t* thr) {
  const int64_t it = blockIdx.y;
  const ShadowScanItem item = a.item[it];
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * kShadowScanBlockKeys;
  const int64_t blocks = (a.max_len + kShadowScanBlockKeys - 1) / kShadowScanBlockKeys;
  const int64_t item_blocks = (item.len + kShadowScanBlockKeys - 1) / kShadowScanBlockKeys;
  if (b0 < item.len && item.picks > 0) {
    __shared__ int s_before, s_total;
    if (threadIdx.x < 32) {
      const int32_t* bc = a.block_counts + it * blocks;
      int before = 0, total = 0;
      for (int64_t b = threadIdx.x; b < item_blocks; b += 32) {
        total += bc[b];
        before += b < blockIdx.x ? bc[b] : 0;
      }
      for (int o = 16; o > 0; o >>= 1) {
        total += __shfl_xor_sync(0xffffffffu, total, o);
        before += __shfl_xor_sync(0xffffffffu, before, o);
      }
      if (threadIdx.x == 0) s_before = before, s_total = total;
    }
    __syncthreads();
    const bool fits = s_total <= a.max_picks;
    if (!fits && blockIdx.x == 0 && threadIdx.x == 0) a.counts[it] = -1;
    if (fits) {
      const uint32_t t = thr[it];
      const uint32_t* keys = a.keys + it * a.max_len;
      uint32_t k[kKeysPerThread];
      int n = 0;
      for (int u = 0; u < kKeysPerThread; ++u) {
        const int64_t j = b0 + threadIdx.x * kKeysPerThread + u;
        k[u] = j < item.len ? keys[j] : 0u;
        n += j < item.len && k[u] >= t;
      }
      using Scan = cub::BlockScan<int, kScanThreads>;
      __shared__ typename Scan::TempStorage tmp;
      // The block's entries in order in shared memory, then stored by consecutive threads: whole
      // lines, also when out is mapped host memory (each store a PCIe write).
      __shared__ uint64_t stage[kShadowScanBlockKeys];
      int at = 0, block_n = 0;
      Scan(tmp).ExclusiveSum(n, at, block_n);
      for (int u = 0; u < kKeysPerThread; ++u) {
        const int64_t j = b0 + threadIdx.x * kKeysPerThread + u;
        if (j < item.len && k[u] >= t) stage[at++] = (static_cast<uint64_t>(k[u]) << 32) | static_cast<uint32_t>(j);
      }
      __syncthreads();
      uint64_t* out = a.out + it * a.max_picks + s_before;
      for (int i = threadIdx.x; i < block_n; i += kScanThreads) out[i] = stage[i];
    }
  }
  // Zero the item's histograms: its blocks split the 65536 + 256 words.
  if (item.len > 0 && item.picks > 0 && blockIdx.x < item_blocks) {
    uint32_t* h = a.hist + it * kShadowScanHistStride;
    const int64_t per = (kShadowScanHistStride + item_blocks - 1) / item_blocks;
    const int64_t lo = blockIdx.x * per;
    const int64_t hi = lo + per < kShadowScanHistStride ? lo + per : kShadowScanHistStride;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) h[i] = 0;
  }
}

}  // namespace

Status LaunchShadowScan(const ShadowScanArgs& a, cudaStream_t stream) {
  KVF_CHECK_ARG(a.group >= 1 && a.group <= kShadowScanMaxGroup, "ShadowScan: group ", a.group,
                " not in [1, ", kShadowScanMaxGroup, "]");
  KVF_CHECK_ARG(a.head_dim >= 1 && a.head_dim <= kMaxDim, "ShadowScan: head_dim ", a.head_dim,
                " not in [1, ", kMaxDim, "]");
  KVF_CHECK_ARG(a.channels >= 1, "ShadowScan: ", a.channels, " channels");
  KVF_CHECK_ARG(a.max_len >= 0 && a.max_len < (int64_t{1} << 31), "ShadowScan: max_len ", a.max_len);
  KVF_CHECK_ARG(a.items >= 0 && a.items <= 65535, "ShadowScan: ", a.items, " items");
  if (a.items == 0) return Status::Ok();
  KVF_CHECK_ARG(a.item != nullptr && a.shadow != nullptr && a.scale != nullptr && a.q != nullptr &&
                    a.k != nullptr && a.ints != nullptr && (a.max_picks == 0 || a.out != nullptr),
                "ShadowScan: null pointer");
  const auto items = static_cast<unsigned>(a.items);
  ScanPrepKernel<<<items, kPrepThreads, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(ScanPrepKernel);
  if (a.max_len == 0 || a.max_picks == 0) return Status::Ok();
  static_assert(int64_t{kScanThreads} * kKeysPerThread == kShadowScanBlockKeys);
  KVF_CHECK_ARG(a.keys != nullptr && a.hist != nullptr && a.block_counts != nullptr &&
                    a.counts != nullptr,
                "ShadowScan: null workspace");
  const int64_t blocks = (a.max_len + kShadowScanBlockKeys - 1) / kShadowScanBlockKeys;
  const dim3 grid(static_cast<unsigned>(blocks), items);
  ScanMaxKernel<<<grid, kScanThreads, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(ScanMaxKernel);
  ScanScoreKernel<<<grid, kScanThreads, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(ScanScoreKernel);
  // The thresholds live in the block counts' spare room: [items] words after them.
  uint32_t* thr = reinterpret_cast<uint32_t*>(a.block_counts + a.items * blocks);
  ScanThresholdKernel<<<items, 32, 0, stream>>>(a, thr);
  KVF_CUDA_CHECK_LAUNCH(ScanThresholdKernel);
  ScanCountKernel<<<grid, kScanThreads, 0, stream>>>(a, thr);
  KVF_CUDA_CHECK_LAUNCH(ScanCountKernel);
  ScanWriteKernel<<<grid, kScanThreads, 0, stream>>>(a, thr);
  KVF_CUDA_CHECK_LAUNCH(ScanWriteKernel);
  return Status::Ok();
}

}  // namespace kvferry::cuda
