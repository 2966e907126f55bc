// Copyright kvferry authors. Apache-2.0.
// LFPS's approximate scan (policies/lfps.cpp, step 3a) on the GPU, over the device's copy of the
// policy's int8 channel-major shadow of K (LfpsScanArgs has the definition; cpu::LfpsScanRef is
// the specification). Four launches per batch of (sequence, KV head) items:
//   1. ScanPrepKernel, a CTA per item: the new token's shadow row, the channel choice and the
//      integer weights, the head maxima reset;
//   2. ScanMaxKernel: the exact int32 logits of 4 keys a thread over the chosen channels, each
//      head's max by warp reduction and one atomicMax per warp;
//   3. ScanScoreKernel: the logits again (16 bytes a key: cheaper to re-read than to store), the
//      score max_g (acc_g - max_g) as a float;
//   4. ScanPickKernel, a CTA per item: the picks-th largest key by radix select (TopKThreshold),
//      then the winners in ascending position, each thread over a contiguous chunk of keys.
// Every value is computed with the host's operations in the host's order (IEEE products and
// quotients, round-to-nearest-even conversions, exact integer sums), so the picks are the host's.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

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

__device__ __forceinline__ int32_t* ItemInts(const LfpsScanArgs& a, int64_t item) {
  return a.ints + item * (a.group + a.channels + int64_t{a.group} * a.channels);
}

__global__ void __launch_bounds__(kPrepThreads) ScanPrepKernel(LfpsScanArgs a) {
  const int64_t it = blockIdx.x;
  const LfpsScanItem item = a.item[it];
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
  __shared__ float q[kLfpsScanMaxGroup * kMaxDim];
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
__device__ __forceinline__ void Logits(const LfpsScanArgs& a, const LfpsScanItem& item,
                                       const int32_t* ch, const int32_t* w, int r, int64_t j0,
                                       int32_t (&acc)[kLfpsScanMaxGroup][kKeysPerThread]) {
  for (int g = 0; g < kLfpsScanMaxGroup; ++g) {
    for (int u = 0; u < kKeysPerThread; ++u) acc[g][u] = 0;
  }
  for (int c = 0; c < r; ++c) {
    const int8_t* row = a.shadow + item.shadow + ch[c] * a.cap + item.off_lo;
    int32_t x[kKeysPerThread];
    for (int u = 0; u < kKeysPerThread; ++u) x[u] = j0 + u < item.len ? row[j0 + u] : 0;
#pragma unroll
    for (int g = 0; g < kLfpsScanMaxGroup; ++g) {
      if (g < a.group) {
        const int32_t wg = w[g * r + c];
        for (int u = 0; u < kKeysPerThread; ++u) acc[g][u] += wg * x[u];
      }
    }
  }
}

// Channels and weights of the item into shared memory; false if the item ranks nothing.
__device__ __forceinline__ bool LoadWeights(const LfpsScanArgs& a, int64_t it, const LfpsScanItem& item,
                                            int32_t* ch, int32_t* w) {
  if (item.len <= 0 || item.picks <= 0) return false;
  const int r = min(a.channels, a.head_dim);
  const int32_t* ints = ItemInts(a, it);
  for (int c = threadIdx.x; c < r; c += blockDim.x) ch[c] = ints[a.group + c];
  for (int i = threadIdx.x; i < a.group * r; i += blockDim.x) w[i] = ints[a.group + r + i];
  __syncthreads();
  return true;
}

__global__ void __launch_bounds__(kScanThreads) ScanMaxKernel(LfpsScanArgs a) {
  const int64_t it = blockIdx.y;
  const LfpsScanItem item = a.item[it];
  __shared__ int32_t ch[kMaxDim];
  __shared__ int32_t w[kLfpsScanMaxGroup * kMaxDim];
  const int64_t j0 = (static_cast<int64_t>(blockIdx.x) * kScanThreads + threadIdx.x) * kKeysPerThread;
  if (static_cast<int64_t>(blockIdx.x) * kScanThreads * kKeysPerThread >= item.len) return;
  if (!LoadWeights(a, it, item, ch, w)) return;
  int32_t acc[kLfpsScanMaxGroup][kKeysPerThread];
  Logits(a, item, ch, w, min(a.channels, a.head_dim), j0, acc);
  int32_t* mx = ItemInts(a, it);
  for (int g = 0; g < a.group; ++g) {
    int32_t m = INT_MIN;
    for (int u = 0; u < kKeysPerThread; ++u) m = j0 + u < item.len ? max(m, acc[g][u]) : m;
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0 && m != INT_MIN) atomicMax(mx + g, m);
  }
}

__global__ void __launch_bounds__(kScanThreads) ScanScoreKernel(LfpsScanArgs a) {
  const int64_t it = blockIdx.y;
  const LfpsScanItem item = a.item[it];
  __shared__ int32_t ch[kMaxDim];
  __shared__ int32_t w[kLfpsScanMaxGroup * kMaxDim];
  __shared__ int32_t mx[kLfpsScanMaxGroup];
  const int64_t j0 = (static_cast<int64_t>(blockIdx.x) * kScanThreads + threadIdx.x) * kKeysPerThread;
  if (static_cast<int64_t>(blockIdx.x) * kScanThreads * kKeysPerThread >= item.len) return;
  if (threadIdx.x < a.group) mx[threadIdx.x] = ItemInts(a, it)[threadIdx.x];
  if (!LoadWeights(a, it, item, ch, w)) return;
  int32_t acc[kLfpsScanMaxGroup][kKeysPerThread];
  Logits(a, item, ch, w, min(a.channels, a.head_dim), j0, acc);
  float* score = a.scores + it * a.max_len;
  for (int u = 0; u < kKeysPerThread; ++u) {
    if (j0 + u >= item.len) break;
    int32_t s = acc[0][u] - mx[0];
    for (int g = 1; g < a.group; ++g) s = max(s, acc[g][u] - mx[g]);
    score[j0 + u] = static_cast<float>(s);
  }
}

__global__ void __launch_bounds__(kTopKThreads) ScanPickKernel(LfpsScanArgs a) {
  const int64_t it = blockIdx.x;
  const LfpsScanItem item = a.item[it];
  if (item.len <= 0 || item.picks <= 0) return;
  const int64_t len = item.len;
  const int picks = static_cast<int>(min(item.picks, len));
  const float* score = a.scores + it * a.max_len;
  uint32_t kth = 0, take_eq = 0;
  TopKThreshold(score, len, picks, &kth, &take_eq);
  // Each thread owns the contiguous keys [lo, hi): count, two scans, then write in order.
  const int64_t chunk = (len + blockDim.x - 1) / blockDim.x;
  const int64_t lo = min(len, chunk * threadIdx.x), hi = min(len, lo + chunk);
  int gt = 0, eq = 0;
  for (int64_t j = lo; j < hi; ++j) {
    const uint32_t key = OrderedKey(score[j]);
    gt += key > kth;
    eq += key == kth;
  }
  using Scan = cub::BlockScan<int, kTopKThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int eq_before = 0, cnt_before = 0;
  Scan(tmp).ExclusiveSum(eq, eq_before);
  const int take = max(0, min(eq, static_cast<int>(take_eq) - eq_before));
  __syncthreads();
  Scan(tmp).ExclusiveSum(gt + take, cnt_before);
  uint64_t* out = a.out + it * a.max_picks + cnt_before;
  int taken = 0;
  for (int64_t j = lo; j < hi; ++j) {
    const uint32_t key = OrderedKey(score[j]);
    const bool tie = key == kth && taken < take;
    if (key > kth || tie) *out++ = (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(j);
    taken += tie;
  }
}

}  // namespace

Status LaunchLfpsScan(const LfpsScanArgs& a, cudaStream_t stream) {
  KVF_CHECK_ARG(a.group >= 1 && a.group <= kLfpsScanMaxGroup, "LfpsScan: group ", a.group,
                " not in [1, ", kLfpsScanMaxGroup, "]");
  KVF_CHECK_ARG(a.head_dim >= 1 && a.head_dim <= kMaxDim, "LfpsScan: head_dim ", a.head_dim,
                " not in [1, ", kMaxDim, "]");
  KVF_CHECK_ARG(a.channels >= 1, "LfpsScan: ", a.channels, " channels");
  KVF_CHECK_ARG(a.max_len >= 0 && a.max_len < (int64_t{1} << 31), "LfpsScan: max_len ", a.max_len);
  KVF_CHECK_ARG(a.items >= 0 && a.items <= 65535, "LfpsScan: ", a.items, " items");
  if (a.items == 0) return Status::Ok();
  KVF_CHECK_ARG(a.item != nullptr && a.shadow != nullptr && a.scale != nullptr && a.q != nullptr &&
                    a.k != nullptr && a.ints != nullptr && (a.max_len == 0 || a.scores != nullptr) &&
                    (a.max_picks == 0 || a.out != nullptr),
                "LfpsScan: null pointer");
  const auto items = static_cast<unsigned>(a.items);
  ScanPrepKernel<<<items, kPrepThreads, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(ScanPrepKernel);
  if (a.max_len == 0 || a.max_picks == 0) return Status::Ok();
  const int64_t per_block = int64_t{kScanThreads} * kKeysPerThread;
  const dim3 grid(static_cast<unsigned>((a.max_len + per_block - 1) / per_block), items);
  ScanMaxKernel<<<grid, kScanThreads, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(ScanMaxKernel);
  ScanScoreKernel<<<grid, kScanThreads, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(ScanScoreKernel);
  ScanPickKernel<<<items, kTopKThreads, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(ScanPickKernel);
  return Status::Ok();
}

}  // namespace kvferry::cuda
