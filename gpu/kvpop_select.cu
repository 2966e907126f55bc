// Copyright kvferry authors. Apache-2.0.
// KVpop's selection inside a planned decode step (SelectScoring::kKvpop, base/kvpop_score.h):
// one CTA per item keeps its long-range slots in device memory and writes the step's list. A step
// normally brings one newcomer (the token that left the window): it is scored by a warp, the
// worst slot is found by one block reduction, and if the newcomer beats it the slots shift left
// by one and it goes last (positions stay ascending: every newcomer lies past every slot). The
// first step after a prompt brings many: they are scored by every warp into the selection
// scratch, the k best of slots and newcomers found by a radix select over their priorities'
// order-preserving keys (ties taken in position order), and compacted in order. A kernel of our
// own: no library keeps a top-k set online. Nothing the host computes per step is read, so the
// launch can be captured in a CUDA graph. The host twin is cpu/decode_step.cpp's KvpopSelect.

#include <cub/block/block_reduce.cuh>
#include <cuda/functional>
#include <cub/block/block_scan.cuh>

#include "base/check.h"
#include "base/kvpop_score.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "gpu/topk.cuh"

namespace kvferry::cuda {
namespace {

constexpr int kKvpopThreads = 512;
constexpr int kKvpopWarps = kKvpopThreads / 32;
constexpr int kKvpopMaxHeadDim = 256;

template <typename T>
__device__ __forceinline__ float KvToF32(T x);
template <>
__device__ __forceinline__ float KvToF32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float KvToF32(__half x) { return __half2float(x); }

struct KvpopShared {
  union {
    cub::BlockScan<int32_t, kKvpopThreads>::TempStorage scan;
    cub::BlockReduce<unsigned long long, kKvpopThreads>::TempStorage reduce;
  } tmp;
  uint32_t hist[256];
  uint32_t prefix;
  int32_t want;
  int32_t worst;    // index of the worst slot
  float new_prio;   // the one newcomer's priority
  int64_t next_u, count;
  float x[kKvpopWarps][2 * kKvpopMaxHeadDim];  // a warp's token [k; v]
};

// The priority of token u of item t (the calling warp; every lane returns it). Its rows come from
// the resident window while u was in the window of the last step (the step's append, which
// overwrites that ring row, runs after the selection), else from the host store (zero-copy).
template <typename T>
__device__ float KvpopWarpPriority(const DecodeStepArgs& a, const float* block, int64_t t, int64_t u,
                                   int64_t n, float* x) {
  const int lane = threadIdx.x & 31;
  const int d = a.params.head_dim, in_dim = 2 * d;
  const size_t row_bytes = static_cast<size_t>(d) * sizeof(T);
  const int64_t rows_per_slot = static_cast<int64_t>(a.sink) + a.window;
  const int64_t row = ResidentRowOf(u, n - 1, a.sink, a.window);
  const T* kp;
  const T* vp;
  if (row >= 0) {
    const char* res = a.resident + static_cast<size_t>(t * 2 * rows_per_slot) * row_bytes;
    kp = reinterpret_cast<const T*>(res + static_cast<size_t>(row) * row_bytes);
    vp = reinterpret_cast<const T*>(res + static_cast<size_t>(rows_per_slot + row) * row_bytes);
  } else {
    const unsigned long long* pages = reinterpret_cast<const unsigned long long*>(a.pages) + t * a.max_pages;
    const uint32_t pt = static_cast<uint32_t>(a.page_tokens), p = static_cast<uint32_t>(u);
    const char* base = reinterpret_cast<const char*>(__ldg(pages + p / pt));
    kp = reinterpret_cast<const T*>(base + static_cast<size_t>(p % pt) * row_bytes);
    vp = reinterpret_cast<const T*>(base + static_cast<size_t>(pt + p % pt) * row_bytes);
  }
  for (int j = lane; j < d; j += 32) {
    x[j] = KvToF32(kp[j]);
    x[d + j] = KvToF32(vp[j]);
  }
  __syncwarp();
  float r = 0.0f;
  const int hidden = a.kvpop_hidden;
  if (hidden > 0) {  // KvpopScore's operations, a lane per j of the dot products
    const float* w1 = block + 2;
    const float* b1 = w1 + static_cast<int64_t>(hidden) * in_dim;
    const float* w2 = b1 + hidden;
    r = block[1];
    for (int i = 0; i < hidden; ++i) {
      const float* w = w1 + static_cast<int64_t>(i) * in_dim;
      float s = 0.0f;
      for (int j = lane; j < in_dim; j += 32) s = fmaf(w[j], x[j], s);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s = s + __shfl_xor_sync(0xffffffffu, s, off);
      r = fmaf(w2[i], KvpopSilu(s + b1[i]), r);
    }
    if (r != r) r = -INFINITY;
  }
  __syncwarp();  // x is the next token's
  return KvpopPriorityOf(r, u, block[0]);
}

// Grid (items), kKvpopThreads. See the file's comment and SelectScoring::kKvpop.
template <typename T>
__global__ void __launch_bounds__(kKvpopThreads) KvpopSelectKernel(DecodeStepArgs a) {
  __shared__ KvpopShared sh;
  using Scan = cub::BlockScan<int32_t, kKvpopThreads>;
  using Reduce = cub::BlockReduce<unsigned long long, kKvpopThreads>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int64_t t = (static_cast<int64_t>(a.slots[b]) * a.num_layers + a.layer) * a.num_kv_heads + h;
  const int64_t sinks = min(max(static_cast<int64_t>(a.sink), int64_t{0}), n);
  const int64_t off_hi = max(sinks, n - max(a.window, 0));
  const int64_t budget = StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n);
  const int64_t k = max(budget - (sinks + (n - off_hi)), int64_t{0});
  int32_t* pos = a.kvpop_pos + t * a.kvpop_cap;
  float* prio = a.kvpop_prio + t * a.kvpop_cap;
  const float* block =
      a.kvpop_scorer + (static_cast<int64_t>(a.layer) * a.num_kv_heads + h) *
                           KvpopScorerFloats(a.kvpop_hidden, 2 * a.params.head_dim);
  if (tid == 0) {
    KvpopState st = a.kvpop_state[t];
    if (n < st.next_u) st = KvpopState{};  // a new sequence in this slot
    sh.next_u = st.next_u;
    sh.count = st.count;
  }
  __syncthreads();
  const int64_t count = sh.count;
  const int64_t lo = max(sh.next_u, sinks);
  const int64_t m = max(off_hi - lo, int64_t{0});
  int64_t kept = 0;
  if (count + m <= k) {  // room for every newcomer
    for (int64_t j = warp; j < m; j += kKvpopWarps) {
      const float p = KvpopWarpPriority<T>(a, block, t, lo + j, n, sh.x[warp]);
      if (lane == 0) {
        pos[count + j] = static_cast<int32_t>(lo + j);
        prio[count + j] = p;
      }
    }
    kept = count + m;
  } else if (m == 1 && count == k && k > 0) {  // a step: the newcomer against the worst slot
    if (warp == 0) {
      const float p = KvpopWarpPriority<T>(a, block, t, lo, n, sh.x[0]);
      if (lane == 0) sh.new_prio = p;
    }
    // The worst: lowest priority, then highest position.
    unsigned long long mine = ~0ull;
    for (int64_t i = tid; i < count; i += kKvpopThreads) {
      const unsigned long long key = (static_cast<unsigned long long>(OrderedKey(prio[i])) << 32) |
                                     (0xFFFFFFFFu - static_cast<uint32_t>(pos[i]));
      mine = key < mine ? key : mine;
    }
    const unsigned long long worst = Reduce(sh.tmp.reduce).Reduce(mine, ::cuda::minimum<>{});
    if (tid == 0) sh.worst = -1;
    __syncthreads();
    if (tid == 0) {
      const int32_t wpos = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(worst & 0xFFFFFFFFu));
      // Slots ascend: the worst's index by binary search.
      int64_t l = 0, r = count - 1;
      while (l < r) {
        const int64_t mid = (l + r) / 2;
        if (pos[mid] < wpos) l = mid + 1; else r = mid;
      }
      if (KvpopRanksAbove(sh.new_prio, lo, prio[l], pos[l])) sh.worst = static_cast<int32_t>(l);
    }
    __syncthreads();
    const int32_t w = sh.worst;
    if (w >= 0) {  // evict it: the slots after it move left by one, the newcomer goes last
      for (int64_t c0 = w; c0 < count - 1; c0 += kKvpopThreads) {
        const int64_t i = c0 + tid;
        int32_t ps = 0;
        float pr = 0.0f;
        if (i < count - 1) {
          ps = pos[i + 1];
          pr = prio[i + 1];
        }
        __syncthreads();
        if (i < count - 1) {
          pos[i] = ps;
          prio[i] = pr;
        }
        __syncthreads();
      }
      if (tid == 0) {
        pos[count - 1] = static_cast<int32_t>(lo);
        prio[count - 1] = sh.new_prio;
      }
    }
    kept = count;
  } else {  // many newcomers (or a smaller budget): the k best of slots and newcomers
    float* ws = a.select_ws + static_cast<size_t>(item) * a.params.group * a.select_ld;
    for (int64_t j = warp; j < m; j += kKvpopWarps) {
      const float p = KvpopWarpPriority<T>(a, block, t, lo + j, n, sh.x[warp]);
      if (lane == 0) ws[j] = p;
    }
    __syncthreads();
    const int64_t total = count + m;
    const auto prio_of = [&](int64_t i) { return i < count ? prio[i] : ws[i - count]; };
    // The k-th largest key, 8 bits at a time, and how many of its ties are taken.
    uint32_t prefix = 0, mask = 0;
    int32_t want = static_cast<int32_t>(k);
    for (int shift = 24; shift >= 0 && k > 0; shift -= 8) {
      for (int i = tid; i < 256; i += kKvpopThreads) sh.hist[i] = 0;
      __syncthreads();
      for (int64_t i = tid; i < total; i += kKvpopThreads) {
        const uint32_t key = OrderedKey(prio_of(i));
        if ((key & mask) == prefix) atomicAdd(&sh.hist[(key >> shift) & 0xFFu], 1u);
      }
      __syncthreads();
      if (tid == 0) {
        int32_t above = 0;
        int bin = 255;
        for (; bin > 0; --bin) {
          const int32_t c = static_cast<int32_t>(sh.hist[bin]);
          if (above + c >= want) break;
          above += c;
        }
        sh.prefix = prefix | (static_cast<uint32_t>(bin) << shift);
        sh.want = want - above;
      }
      __syncthreads();
      prefix = sh.prefix;
      want = sh.want;
      mask |= 0xFFu << shift;
    }
    // Every candidate above the threshold and its first `want` ties, compacted in order (the
    // outputs of a chunk land at or below its inputs, which are read first).
    int32_t out_base = 0, tie_base = 0;
    for (int64_t c0 = 0; c0 < total && k > 0; c0 += kKvpopThreads) {
      const int64_t i = c0 + tid;
      const bool valid = i < total;
      const float pr = valid ? prio_of(i) : 0.0f;
      const int32_t ps = valid ? (i < count ? pos[i] : static_cast<int32_t>(lo + (i - count))) : 0;
      const uint32_t key = valid ? OrderedKey(pr) : 0u;
      const int32_t tie = valid && key == prefix ? 1 : 0;
      int32_t tie_rank = 0, ties = 0;
      Scan(sh.tmp.scan).ExclusiveSum(tie, tie_rank, ties);
      __syncthreads();
      const int32_t keep = valid && (key > prefix || (tie && tie_base + tie_rank < want)) ? 1 : 0;
      int32_t at = 0, keeps = 0;
      Scan(sh.tmp.scan).ExclusiveSum(keep, at, keeps);
      __syncthreads();
      if (keep) {
        pos[out_base + at] = ps;
        prio[out_base + at] = pr;
      }
      out_base += keeps;
      tie_base += ties;
      __syncthreads();
    }
    kept = out_base;
  }
  __syncthreads();  // the slots are written
  if (tid == 0) {
    KvpopState st;
    st.next_u = max(sh.next_u, off_hi);
    st.count = kept;
    a.kvpop_state[t] = st;
  }
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  for (int64_t i = tid; i < sinks; i += kKvpopThreads) out[i] = static_cast<int32_t>(i);
  for (int64_t i = tid; i < kept; i += kKvpopThreads) out[sinks + i] = pos[i];
  for (int64_t i = off_hi + tid; i < n; i += kKvpopThreads) {
    out[sinks + kept + (i - off_hi)] = static_cast<int32_t>(i);
  }
  if (tid == 0) a.list_count[item] = static_cast<int32_t>(sinks + kept + (n - off_hi));
}

}  // namespace

Status LaunchKvpopSelect(const DecodeStepArgs& a, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  if (items == 0) return Status::Ok();
  KVF_CHECK_ARG(a.kvpop_state != nullptr && a.kvpop_pos != nullptr && a.kvpop_prio != nullptr &&
                    a.kvpop_scorer != nullptr && a.kvpop_hidden >= 0 && a.kvpop_cap >= a.budget_cap &&
                    a.params.head_dim <= kKvpopMaxHeadDim && a.pages != nullptr && a.resident != nullptr,
                "DecodeSelect: kvpop without its slots, state or scorers, slots for ", a.kvpop_cap,
                " tokens under a budget of ", a.budget_cap, ", or head_dim ", a.params.head_dim,
                " over ", kKvpopMaxHeadDim);
  return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
    KvpopSelectKernel<T><<<static_cast<unsigned>(items), kKvpopThreads, 0, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(KvpopSelectKernel);
    return Status::Ok();
  });
}

}  // namespace kvferry::cuda
