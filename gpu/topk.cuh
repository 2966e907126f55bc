// Copyright kvferry authors. Apache-2.0.
#pragma once
// Exact top-k with deterministic ties (score descending, then lower index; NaN ranks as -inf),
// one CTA per score row. Written here because CUB's device top-k gives no tie order and its
// segmented sorts would need per-call temporary storage:
//   1. radix select on order-preserving uint32 keys, 8 bits per pass (4 passes over the row), finds
//      the k-th largest key T and how many keys equal to T to take;
//   2. one ordered pass collects every key > T and the first (in index order) keys == T;
//   3. a bitonic sort of the k winners by (key desc, index asc), in shared memory for k <= 4096,
//      otherwise in the caller's workspace (rows x pow2(k) x 8 bytes).

#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace kvferry::cuda {

constexpr int kTopKThreads = 1024;
constexpr int kTopKSmemItems = 4096;

__device__ __forceinline__ uint32_t OrderedKey(float x) {
  if (x != x) x = -INFINITY;  // NaN ranks lowest, tied with -inf
  if (x == 0.0f) x = 0.0f;     // -0 ties with +0 (they compare equal)
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Sorts v[0, n) ascending (n a power of two) with the whole CTA.
__device__ inline void BitonicSortBlock(unsigned long long* v, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
        const int lo = 2 * i - (i & (stride - 1));
        const int hi = lo + stride;
        const bool ascending = (lo & size) == 0;
        const unsigned long long a = v[lo], b = v[hi];
        if ((a > b) == ascending) {
          v[lo] = b;
          v[hi] = a;
        }
      }
    }
  }
  __syncthreads();
}

/// The k largest of row[0, n) (OrderedKey order, ties to the lower index) into sel[0, k) as
/// (~key << 32 | index), sorted by (score desc, index asc); sel[k, sort_n) = ~0. sort_n = pow2 >= k,
/// 1 <= k <= n. Called by every thread of a kTopKThreads-thread CTA (a multiple of 32); sel in
/// shared or global memory.
__device__ inline void TopKSelect(const float* __restrict__ row, int64_t n, int k, int sort_n,
                           unsigned long long* sel) {
  using Scan = cub::BlockScan<int, kTopKThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ unsigned int hist[256];
  __shared__ uint32_t s_prefix, s_remaining;
  __shared__ int s_gt, s_eq_base;
  __shared__ bool s_done;

  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(k);
  const int64_t n_round = (n + blockDim.x - 1) / blockDim.x * blockDim.x;  // whole warps loop
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    // Warp-aggregated: the lanes of a warp that fall in one bin add once (scores of one row often
    // share their high bits, and one shared counter hit by every lane serialises the pass).
    for (int64_t i = threadIdx.x; i < n_round; i += blockDim.x) {
      const uint32_t key = i < n ? OrderedKey(row[i]) : 0u;
      const bool in = i < n && (key & mask) == prefix;
      const uint32_t bin = in ? (key >> shift) & 0xffu : 0x100u;
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (in && static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1) {
        atomicAdd(&hist[bin], static_cast<unsigned>(__popc(peers)));
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t above = 0;
      int digit = 255;
      for (; digit > 0; --digit) {
        if (above + hist[digit] >= remaining) break;
        above += hist[digit];
      }
      s_prefix = prefix | (static_cast<uint32_t>(digit) << shift);
      s_remaining = remaining - above;
    }
    __syncthreads();
    prefix = s_prefix;
    remaining = s_remaining;
    mask |= 0xffu << shift;
  }
  // prefix is the k-th largest key; take every key > prefix and the first `remaining` equal ones.
  if (threadIdx.x == 0) {
    s_gt = 0;
    s_eq_base = 0;
  }
  __syncthreads();
  const int num_gt = k - static_cast<int>(remaining);
  for (int64_t base = 0; base < n; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    uint32_t key = 0;
    int eq = 0;
    if (i < n) {
      key = OrderedKey(row[i]);
      if (key > prefix) {
        const int slot = atomicAdd(&s_gt, 1);
        sel[slot] = (static_cast<unsigned long long>(~key) << 32) | static_cast<uint32_t>(i);
      }
      eq = key == prefix;
    }
    int rank = 0, total = 0;
    Scan(scan_tmp).ExclusiveSum(eq, rank, total);
    const int taken = s_eq_base;
    if (eq && taken + rank < static_cast<int>(remaining)) {
      sel[num_gt + taken + rank] =
          (static_cast<unsigned long long>(~key) << 32) | static_cast<uint32_t>(i);
    }
    __syncthreads();
    // One thread decides, between barriers: a thread that read s_gt while others of the next
    // iteration already added to it could leave the loop alone (a divergent barrier).
    if (threadIdx.x == 0) {
      s_eq_base = taken + total;
      s_done = s_eq_base >= static_cast<int>(remaining) && s_gt >= num_gt;
    }
    __syncthreads();
    if (s_done) break;
  }
  for (int i = k + threadIdx.x; i < sort_n; i += blockDim.x) sel[i] = ~0ull;
  BitonicSortBlock(sel, sort_n);
}

}  // namespace kvferry::cuda
