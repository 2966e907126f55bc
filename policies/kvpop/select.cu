// Copyright kvferry authors. Apache-2.0.
// KVpop's selection inside a planned decode step (policies/kvpop/device_selector.cpp, policies/kvpop/score.h):
// one CTA per item keeps its long-range slots in device memory and writes the step's list. A step
// normally brings one newcomer (the token that left the window): it is scored by a warp, the
// worst slot is found by one block reduction, and if the newcomer beats it the slots shift left
// by one and it goes last (positions stay ascending: every newcomer lies past every slot). The
// first step after a prompt brings many: they are scored by every warp into the selection
// scratch, the k best of slots and newcomers found by a radix select over their priorities'
// order-preserving keys (ties taken in position order), and compacted in order. A kernel of our
// own: no library keeps a top-k set online. Nothing the host computes per step is read, so the
// launch can be captured in a CUDA graph. The host twin is policies/kvpop/select_host.cpp.

#include <algorithm>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/functional>

#include "base/check.h"
#include "policies/kvpop/score.h"
#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "gpu/topk.cuh"
#include "policies/kvpop/select.h"

namespace kvferry::cuda {
namespace {

constexpr int kKvpopThreads = 512;
constexpr int kKvpopWarps = kKvpopThreads / 32;
// Slots a thread holds in registers on the step path (kKvpopThreads * kKvpopRegs an item, 8192:
// 2% of 400K tokens); more take the general path.
constexpr int kKvpopRegs = 16;

struct KvpopShared {
  union {
    cub::BlockScan<int32_t, kKvpopThreads>::TempStorage scan;
    cub::BlockReduce<unsigned long long, kKvpopThreads>::TempStorage reduce;
  } tmp;
  uint32_t hist[256];
  uint32_t prefix;
  int32_t want;
  int64_t worst;             // index of the slot the newcomer evicts, -1: none
  float new_prio;            // the one newcomer's priority
  float h[kKvpopMaxHidden];  // its SiLU(z_i)
  float w2[kKvpopMaxHidden];
  // The step path's shift: lane 0's slot of each warp, per register.
  int32_t bnd_pos[kKvpopRegs][kKvpopWarps];
  float bnd_prio[kKvpopRegs][kKvpopWarps];
  float x[kKvpopWarps][2 * kKvpopMaxHeadDim];  // a token's [k; v], a warp's own
};

// Token u of item t as fp32 [k; v] into x, by `stride` threads from `first`. Its rows come from
// the resident window while u was in the window of the last step (the step's append, which
// overwrites that ring row, runs after the selection), else from the host store (zero-copy).
template <typename T>
__device__ void KvpopLoadRow(const DecodeStepArgs& a, int64_t t, int64_t u, int64_t n, int first,
                             int stride, float* x) {
  const int d = a.params.head_dim;
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
    const unsigned long long* pages =
        reinterpret_cast<const unsigned long long*>(a.store.pages) + t * a.store.max_pages;
    const uint32_t pt = static_cast<uint32_t>(a.store.page_tokens), p = static_cast<uint32_t>(u);
    const char* base = reinterpret_cast<const char*>(__ldg(pages + p / pt));
    kp = reinterpret_cast<const T*>(base + static_cast<size_t>(p % pt) * row_bytes);
    vp = reinterpret_cast<const T*>(base + static_cast<size_t>(pt + p % pt) * row_bytes);
  }
  for (int j = first; j < 2 * d; j += stride) x[j] = ToF32(j < d ? kp[j] : vp[j - d]);
}

// z_i's dot product w1[i] . x in KvpopDot's order: lane l takes j = l, l + 32, ..., then the
// butterfly. Every lane returns it.
__device__ __forceinline__ float KvpopWarpDot(const float* w, const float* x, int in_dim,
                                              int lane) {
  float s = 0.0f;
  for (int j = lane; j < in_dim; j += 32) s = fmaf(w[j], x[j], s);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s = s + __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// The priority of token u of item t by the calling warp alone (the catch-up: a warp a token);
// every lane returns it.
template <typename T>
__device__ float KvpopWarpPriority(const DecodeStepArgs& a, const float* block, int64_t t,
                                   int64_t u, int64_t n, float* x) {
  const int lane = threadIdx.x & 31;
  const int in_dim = 2 * a.params.head_dim, hidden = KvpopArgsOf(a).hidden;
  KvpopLoadRow<T>(a, t, u, n, lane, 32, x);
  __syncwarp();
  float r = 0.0f;
  if (hidden > 0) {  // KvpopScore's operations
    const float* w1 = block + 2;
    const float* b1 = w1 + static_cast<int64_t>(hidden) * in_dim;
    const float* w2 = b1 + hidden;
    r = block[1];
    for (int i = 0; i < hidden; ++i) {
      const float s = KvpopWarpDot(w1 + static_cast<int64_t>(i) * in_dim, x, in_dim, lane);
      r = fmaf(w2[i], KvpopSilu(s + b1[i]), r);
    }
    if (r != r) r = -INFINITY;
  }
  __syncwarp();  // x is the next token's
  return KvpopPriorityOf(r, u, block[0]);
}

// The priority of the step's one newcomer u by the whole CTA (a warp per hidden unit, then
// thread 0 sums them in KvpopScore's order); every thread returns it.
template <typename T>
__device__ float KvpopBlockPriority(const DecodeStepArgs& a, const float* block, int64_t t,
                                    int64_t u, int64_t n, KvpopShared& sh) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int in_dim = 2 * a.params.head_dim, hidden = KvpopArgsOf(a).hidden;
  if (hidden > 0) {
    KvpopLoadRow<T>(a, t, u, n, tid, kKvpopThreads, sh.x[0]);
    __syncthreads();
    const float* w1 = block + 2;
    const float* b1 = w1 + static_cast<int64_t>(hidden) * in_dim;
    const float* w2 = b1 + hidden;
    for (int i = warp; i < hidden; i += kKvpopWarps) {
      const float s = KvpopWarpDot(w1 + static_cast<int64_t>(i) * in_dim, sh.x[0], in_dim, lane);
      if (lane == 0) {
        sh.h[i] = KvpopSilu(s + b1[i]);
        sh.w2[i] = w2[i];
      }
    }
    __syncthreads();
  }
  if (tid == 0) {
    float r = 0.0f;
    if (hidden > 0) {
      r = block[1];
      for (int i = 0; i < hidden; ++i) r = fmaf(sh.w2[i], sh.h[i], r);
      if (r != r) r = -INFINITY;
    }
    sh.new_prio = KvpopPriorityOf(r, u, block[0]);
  }
  __syncthreads();
  return sh.new_prio;
}

// An item of the step as both kernels take it: its positions n, state index t, sinks, the
// offloaded range's end off_hi (the window's start), its (layer, KV head)'s scorer block, its state
// as the step finds it (zeroed for a new sequence in the slot) and its m newcomers from lo.
struct KvpopItem {
  int64_t n, t, sinks, off_hi;
  const float* block;
  KvpopState st;
  int64_t lo, m;
};

__device__ __forceinline__ KvpopItem KvpopItemOf(const DecodeStepArgs& a, int32_t item) {
  KvpopItem it;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  it.n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  it.t = (static_cast<int64_t>(a.slots[b]) * a.num_layers + a.layer) * a.num_kv_heads + h;
  it.sinks = min(max(static_cast<int64_t>(a.sink), int64_t{0}), it.n);
  it.off_hi = max(it.sinks, it.n - max(a.window, 0));
  it.block = KvpopArgsOf(a).scorer + (static_cast<int64_t>(a.layer) * a.num_kv_heads + h) *
                                  KvpopScorerFloats(KvpopArgsOf(a).hidden, 2 * a.params.head_dim);
  it.st = KvpopArgsOf(a).state[it.t];
  if (it.n < it.st.next_u) it.st = KvpopState{};  // a new sequence in this slot
  it.lo = max(it.st.next_u, it.sinks);
  it.m = max(it.off_hi - it.lo, int64_t{0});
  return it;
}

// Grid (items, y), kKvpopScoreThreads (DecodeStepArgs::kvpop.catchup): the newcomers of an item
// with more than one, a warp a token over the whole GPU, into its select_ws row (where
// KvpopSelectKernel, next on the stream, reads them). The zero-copy reads of a prompt's rows are
// latency-bound; one CTA an item (the selection kernel's own scoring) took 4.2 s for the first step
// after a 128K prompt (32 layers x 8 KV heads), this grid 0.47 s (on the H200). The
// runtime sets kvpop.catchup on CUDA.
constexpr int kKvpopScoreThreads = 256;
template <typename T>
__global__ void __launch_bounds__(kKvpopScoreThreads) KvpopScoreKernel(DecodeStepArgs a) {
  __shared__ float x[kKvpopScoreThreads / 32][2 * kKvpopMaxHeadDim];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t item = blockIdx.x;
  const KvpopItem it = KvpopItemOf(a, item);
  const int64_t lo = it.lo, m = it.m;
  if (m <= 1) return;  // the selection kernel scores a lone newcomer itself
  float* ws = a.select_ws + static_cast<size_t>(item) * a.params.group * a.select_ld;
  const int64_t warps = static_cast<int64_t>(gridDim.y) * (kKvpopScoreThreads / 32);
  for (int64_t j = static_cast<int64_t>(blockIdx.y) * (kKvpopScoreThreads / 32) + warp; j < m;
       j += warps) {
    const float p = KvpopWarpPriority<T>(a, it.block, it.t, lo + j, it.n, x[warp]);
    if (lane == 0) ws[j] = p;
  }
}

// The k best of an item's slots [0, count) and its m newcomers [lo, lo + m) (their priorities
// into select_ws first, unless KvpopScoreKernel wrote them): the k-th largest priority by a radix
// select, 8 bits at a time, then every candidate above it and its first ties, compacted in order
// into the slots. Returns how many it kept (every thread).
template <typename T>
__device__ int64_t KvpopKeepBest(const DecodeStepArgs& a, const KvpopItem& it, int32_t item, int64_t k,
                                 int32_t* pos, float* prio, KvpopShared& sh) {
  using Scan = cub::BlockScan<int32_t, kKvpopThreads>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n = it.n, t = it.t, lo = it.lo, m = it.m, count = it.st.count;
  const float* block = it.block;
  float* ws = a.select_ws + static_cast<size_t>(item) * a.params.group * a.select_ld;
  if (KvpopArgsOf(a).catchup == 0 || m <= 1) {  // else KvpopScoreKernel wrote them
    for (int64_t j = warp; j < m; j += kKvpopWarps) {
      const float p = KvpopWarpPriority<T>(a, block, t, lo + j, n, sh.x[warp]);
      if (lane == 0) ws[j] = p;
    }
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
  return out_base;
}

// Grid (items), kKvpopThreads. See the file's comment and kvpop.h.
template <typename T>
__global__ void __launch_bounds__(kKvpopThreads, 1) KvpopSelectKernel(DecodeStepArgs a) {
  __shared__ KvpopShared sh;
  using Reduce = cub::BlockReduce<unsigned long long, kKvpopThreads>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t item = blockIdx.x;
  // Every thread reads the item's state; thread 0 writes it at the end.
  const KvpopItem it = KvpopItemOf(a, item);
  const int64_t n = it.n, t = it.t, sinks = it.sinks, off_hi = it.off_hi, lo = it.lo, m = it.m;
  const float* block = it.block;
  const int64_t budget = StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n);
  const int64_t k = max(budget - (sinks + (n - off_hi)), int64_t{0});
  int32_t* pos = KvpopArgsOf(a).pos + t * KvpopArgsOf(a).cap;
  float* prio = KvpopArgsOf(a).prio + t * KvpopArgsOf(a).cap;
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  const int64_t count = it.st.count;
  int64_t kept = 0;
  bool listed = false;  // the slots are in the list already
  if (m == 1 && count == k && k > 0 && k <= int64_t{kKvpopThreads} * kKvpopRegs) {
    // A step: the newcomer against the worst slot (lowest priority, then highest position, which
    // is the highest index). Slot i = r * kKvpopThreads + tid in register r of thread tid.
    const int64_t regs = (count + kKvpopThreads - 1) / kKvpopThreads;
    int32_t vp[kKvpopRegs];
    float vr[kKvpopRegs];
    unsigned long long mine = ~0ull;
#pragma unroll
    for (int r = 0; r < kKvpopRegs; ++r) {
      const int64_t i = static_cast<int64_t>(r) * kKvpopThreads + tid;
      vp[r] = 0;
      vr[r] = 0.0f;
      if (r < regs && i < count) {
        vp[r] = pos[i];
        vr[r] = prio[i];
        const unsigned long long key = (static_cast<unsigned long long>(OrderedKey(vr[r])) << 32) |
                                       (0xFFFFFFFFu - static_cast<uint32_t>(i));
        mine = key < mine ? key : mine;
      }
    }
    const float np = KvpopBlockPriority<T>(a, block, t, lo, n, sh);
    const unsigned long long worst = Reduce(sh.tmp.reduce).Reduce(mine, ::cuda::minimum<>{});
    if (tid == 0) {
      // It beats the worst by priority alone: its position is past every slot's.
      sh.worst =
          OrderedKey(np) > static_cast<uint32_t>(worst >> 32)
              ? static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(worst & 0xFFFFFFFFu))
              : -1;
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kKvpopRegs; ++r) {
        sh.bnd_pos[r][warp] = vp[r];
        sh.bnd_prio[r][warp] = vr[r];
      }
    }
    __syncthreads();
    const int64_t w = sh.worst;
#pragma unroll
    for (int r = 0; r < kKvpopRegs; ++r) {
      const int64_t i = static_cast<int64_t>(r) * kKvpopThreads + tid;
      int32_t np_pos = __shfl_down_sync(0xffffffffu, vp[r], 1);  // slot i + 1
      float np_prio = __shfl_down_sync(0xffffffffu, vr[r], 1);
      if (w >= 0 && r < regs && i >= w && i < count) {
        if (i == count - 1) {
          np_pos = static_cast<int32_t>(lo);
          np_prio = np;
        } else if (lane == 31) {
          const int wn = warp + 1 < kKvpopWarps ? warp + 1 : 0;
          const int rn = warp + 1 < kKvpopWarps ? r : r + 1;  // < regs: i + 1 < count
          np_pos = sh.bnd_pos[rn][wn];
          np_prio = sh.bnd_prio[rn][wn];
        }
        vp[r] = np_pos;
        vr[r] = np_prio;
        pos[i] = np_pos;
        prio[i] = np_prio;
      }
      if (r < regs && i < count) out[sinks + i] = vp[r];
    }
    kept = count;
    listed = true;
  } else if (count + m <= k) {  // room for every newcomer
    if (m == 1) {
      const float p = KvpopBlockPriority<T>(a, block, t, lo, n, sh);
      if (tid == 0) {
        pos[count] = static_cast<int32_t>(lo);
        prio[count] = p;
      }
    } else if (KvpopArgsOf(a).catchup != 0) {  // scored by KvpopScoreKernel
      const float* ws = a.select_ws + static_cast<size_t>(item) * a.params.group * a.select_ld;
      for (int64_t j = tid; j < m; j += kKvpopThreads) {
        pos[count + j] = static_cast<int32_t>(lo + j);
        prio[count + j] = ws[j];
      }
    } else {
      for (int64_t j = warp; j < m; j += kKvpopWarps) {
        const float p = KvpopWarpPriority<T>(a, block, t, lo + j, n, sh.x[warp]);
        if (lane == 0) {
          pos[count + j] = static_cast<int32_t>(lo + j);
          prio[count + j] = p;
        }
      }
    }
    kept = count + m;
  } else {  // many newcomers (or a smaller budget): the k best of slots and newcomers
    kept = KvpopKeepBest<T>(a, it, item, k, pos, prio, sh);
  }
  __syncthreads();  // the slots are written
  if (tid == 0) {
    KvpopState s;
    s.next_u = max(it.st.next_u, off_hi);
    s.count = kept;
    KvpopArgsOf(a).state[t] = s;
  }
  for (int64_t i = tid; i < sinks; i += kKvpopThreads) out[i] = static_cast<int32_t>(i);
  if (!listed) {
    for (int64_t i = tid; i < kept; i += kKvpopThreads) out[sinks + i] = pos[i];
  }
  for (int64_t i = off_hi + tid; i < n; i += kKvpopThreads) {
    out[sinks + kept + (i - off_hi)] = static_cast<int32_t>(i);
  }
  if (tid == 0) a.list_count[item] = static_cast<int32_t>(sinks + kept + (n - off_hi));
}

}  // namespace

Status KvpopSelectCuda(const void* args, const LaunchInfo& info, void* stream_ptr) {
  const DecodeStepArgs& a = *static_cast<const DecodeStepArgs*>(args);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  if (items == 0) return Status::Ok();
  KVF_RETURN_IF_ERROR(CheckSelectArgs(a));
  KVF_CHECK_ARG(!a.select_skip_ranking, "DecodeSelect: kvpop's slots advance when they rank: no select_skip_ranking");
  KVF_CHECK_ARG(KvpopArgsOf(a).state != nullptr && KvpopArgsOf(a).pos != nullptr && KvpopArgsOf(a).prio != nullptr &&
                    KvpopArgsOf(a).scorer != nullptr && KvpopArgsOf(a).hidden >= 0 &&
                    KvpopArgsOf(a).hidden <= kKvpopMaxHidden && KvpopArgsOf(a).cap >= a.budget_cap &&
                    a.params.head_dim <= kKvpopMaxHeadDim && a.store.pages != nullptr &&
                    a.resident != nullptr,
                "DecodeSelect: kvpop without its slots, state or scorers, slots for ", KvpopArgsOf(a).cap,
                " tokens under a budget of ", a.budget_cap, ", a scorer of width ", KvpopArgsOf(a).hidden,
                ", or head_dim ", a.params.head_dim, " over ", kKvpopMaxHeadDim);
  KVF_CHECK_ARG(KvpopArgsOf(a).catchup == 0 || (a.select_ws != nullptr && a.select_ld >= 1),
                "DecodeSelect: kvpop's catch-up without its scratch");
  const unsigned gy =
      static_cast<unsigned>(std::clamp<int64_t>(int64_t{info.num_sms} * 8 / items, 1, 65535));
  KVF_RETURN_IF_ERROR(DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
    if (KvpopArgsOf(a).catchup != 0) {
      KvpopScoreKernel<T>
          <<<dim3(static_cast<unsigned>(items), gy), kKvpopScoreThreads, 0, stream>>>(a);
      KVF_CUDA_CHECK_LAUNCH(KvpopScoreKernel);
    }
    KvpopSelectKernel<T><<<static_cast<unsigned>(items), kKvpopThreads, 0, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(KvpopSelectKernel);
    return Status::Ok();
  }));
  return LaunchPsawFilter(a, stream);
}

}  // namespace kvferry::cuda
