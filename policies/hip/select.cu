// Copyright kvferry authors. Apache-2.0.
// HiP's selection on the GPU (policies/hip/device_selector.cpp, policies/hip/mask.h): below its
// dense layers SparCas's path (policies/sparcas/select.cu); past them SparCas's prep and gather
// keep the 4-bit rows of every dimension current and the mask kernel writes the list, with a due
// rebuild beside the step on the selector's own stream (hip.lag 1). The host twin is
// policies/hip/select_host.cpp.

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <limits>

#include "base/check.h"
#include "policies/hip/mask.h"
#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "gpu/select_kernels.cuh"
#include "gpu/topk.cuh"
#include "base/sparcas_q4.h"
#include "policies/hip/select.h"
#include "policies/sparcas/select.cuh"
#include "policies/sparcas/select.h"

namespace kvferry::cuda {
namespace {

// ---- kHip ---------------------------------------------------------------------------------------

// HiP's mask (policies/hip/mask.h) for one item, a CTA of kHipThreads: the nodes stay sorted by their
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
  const int64_t bk = max(HipArgsOf(a).bk, 1);
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
  const bool align = HipArgsOf(a).align != 0;
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
      const int64_t pos = off_lo + HipRepBlock(r.x, r.y, HipArgsOf(a).rep, seed) * bk + x % bk;
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
  const ListItem li = ListItemOf(a, item);
  if (WriteListHead(a, item, li.s, li.n, li.out)) return;
  const auto& [b, n, sp, out] = li;
  const int32_t h = item % a.num_kv_heads;
  int64_t taken = 0;
  if (sp.k_off > 0) {
    const int64_t t = ItemT(a, b, h);
    const int64_t bk = max(HipArgsOf(a).bk, 1);
    const int group = a.params.group, words = SparcasQ4Words(a.params.head_dim);
    const bool drift = HipArgsOf(a).drift > 0.0f;
    const int64_t qw = HipQueryWords(group, a.params.head_dim);
    const HipQueryPtrs qs = HipSmemQuery(hip_smem, kn_cap, group, words);
    uint32_t* item_q = HipArgsOf(a).query != nullptr ? HipArgsOf(a).query + t * qw : nullptr;  // the build query
    HipState& s_st = *reinterpret_cast<HipState*>(s_raw);
    if (threadIdx.x == 0) {
      HipState st = HipArgsOf(a).state[t];
      HipPromote(st);
      s_st = st;
      s_drifted = 0;
    }
    // HiP's drift: every ranked step packs its query and compares each head's codes with those
    // the mask was built from (a warp a head; policies/hip/mask.h's HipDriftedHead).
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
        if (lane == 0 && HipDriftedHead(dot, b2, n2, HipArgsOf(a).drift)) atomicOr(&s_drifted, 1);
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      const HipState& st = s_st;
      s_action = static_cast<int>(HipStepAction(st.count, st.k_off, st.n, st.since_refresh, sp.k_off, n,
                                                HipArgsOf(a).r_m, HipArgsOf(a).lag, s_drifted != 0));
    }
    __syncthreads();
    const HipAction action = static_cast<HipAction>(s_action);
    const bool drifted = s_drifted != 0;
    const int32_t cur = s_st.cur;
    int32_t* blocks = HipArgsOf(a).blocks + (2 * t + cur) * HipArgsOf(a).max_nodes;
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
                                               HipArgsOf(a).r_m, a.layer, drifted);
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
      HipArgsOf(a).state[t] = s;
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
  if (threadIdx.x == 0) s_st = HipArgsOf(a).state[t];
  __syncthreads();
  if (s_st.pending != 1) return;
  const int group = a.params.group, words = SparcasQ4Words(a.params.head_dim);
  const int64_t qw = HipQueryWords(group, a.params.head_dim);
  const uint32_t* src = HipArgsOf(a).query + t * qw;
  uint32_t* dst = reinterpret_cast<uint32_t*>(HipSmemQuery(hip_smem, kn_cap, group, words).pack);
  for (int64_t i = threadIdx.x; i < qw; i += blockDim.x) dst[i] = src[i];
  __syncthreads();
  int32_t* blocks = HipArgsOf(a).blocks + (2 * t + (s_st.cur ^ 1)) * HipArgsOf(a).max_nodes;
  const int32_t count =
      HipBuildMask<kThreads>(a, s_st.p_lo, s_st.p_hi, s_st.p_k_off, s_st.p_n, item, kn_cap, hip_smem, sh,
                             blocks);
  __syncthreads();  // every thread is done with the state's copy and the blocks
  if (threadIdx.x == 0) {
    HipState s = s_st;
    s.p_count = count;
    s.pending = 2;
    HipArgsOf(a).state[t] = s;
  }
}

// Dynamic shared memory of HipMaskKernel.
size_t HipMaskSmem(int32_t kn_cap, int group, int head_dim) {
  return static_cast<size_t>(kn_cap) * 2 * (sizeof(int2) + sizeof(uint32_t)) +
         static_cast<size_t>(group) * (SparcasQ4Words(head_dim) * sizeof(int2) + 8);
}

}  // namespace

Status HipSelectCuda(const void* args, const LaunchInfo& info, void* stream_ptr) {
  const DecodeStepArgs& a = *static_cast<const DecodeStepArgs*>(args);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (a.batch == 0) return Status::Ok();
  KVF_CHECK_ARG(!a.select_skip_ranking, "DecodeSelect: hip's masks advance when they rank: no select_skip_ranking");
  // SparCas's machinery with every dimension: its exact path at the dense layers.
  if (a.layer < HipDenseOf(a)) {
    return SparcasSelectCuda(&a, info, stream);
  }
  KVF_ASSIGN_OR_RETURN(const SelectLaunch l, OpenSelectLaunch(args, info, stream_ptr));
  const SelectGrid& g = l.grid;
  KVF_CHECK_ARG(SelectSortCap(a) <= kTopKSmemItems || a.topk_ws != nullptr,
                "DecodeSelect: budget_cap ", a.budget_cap, " needs a top-k workspace");
  const SparcasStepArgs sp = SparcasArgsOf(a);
  const HipStepArgs hp = HipArgsOf(a);
  const int32_t kn_cap = static_cast<int32_t>(std::min<int64_t>(a.budget_cap / std::max(hp.bk, 1), kHipMaxNodes));
  const int64_t nodes = std::min<int64_t>(kHipMaxNodes, hp.max_nodes);
  KVF_CHECK_ARG(a.meta != nullptr && sp.state != nullptr && sp.dims != nullptr && hp.state != nullptr &&
                    hp.blocks != nullptr && hp.bk >= 1 && hp.r_m >= 1 && sp.db == a.params.head_dim &&
                    a.params.head_dim % 8 == 0 && a.params.head_dim <= 256 &&
                    SparcasBitsOf(a.layer, sp.dense_layers, sp.bits) == 4 && a.budget_cap / hp.bk <= nodes &&
                    ((hp.lag == 0 && !(hp.drift > 0.0f)) || hp.query != nullptr),
                "DecodeSelect: hip without its 4-bit rows and mask state (or hip.lag or hip.drift without "
                "hip.query), or a budget_cap of ",
                a.budget_cap, " at bk ", hp.bk, " over ", nodes, " nodes");
  KVF_RETURN_IF_ERROR(LaunchSparcasRows(a, g, stream));
  const size_t smem = HipMaskSmem(std::max(kn_cap, 1), a.params.group, a.params.head_dim);
  if (smem > 48 * 1024) {
    KVF_CUDA_CHECK(cudaFuncSetAttribute(HipMaskKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  HipMaskKernel<<<static_cast<unsigned>(g.items), kHipThreads, smem, stream>>>(a, std::max(kn_cap, 1));
  KVF_CUDA_CHECK_LAUNCH(HipMaskKernel);
  return LaunchPsawFilter(a, stream);
}

Status HipDeferredCuda(const void* args, const LaunchInfo& info, void* stream_ptr) {
  (void)info;
  const DecodeStepArgs& a = *static_cast<const DecodeStepArgs*>(args);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (HipArgsOf(a).lag == 0 || a.layer < HipDenseOf(a)) {
    return Status::Ok();
  }
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  if (items == 0) return Status::Ok();
  KVF_CHECK_ARG(HipArgsOf(a).state != nullptr && HipArgsOf(a).blocks != nullptr && HipArgsOf(a).query != nullptr &&
                    HipArgsOf(a).bk >= 1 && a.params.head_dim % 8 == 0 && a.params.head_dim <= 256 &&
                    a.budget_cap / HipArgsOf(a).bk <= std::min<int64_t>(kHipMaxNodes, HipArgsOf(a).max_nodes),
                "DecodeSelectDeferred: hip without its mask state, blocks or packed queries");
  const int32_t kn_cap = static_cast<int32_t>(std::min<int64_t>(a.budget_cap / HipArgsOf(a).bk, kHipMaxNodes));
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

}  // namespace kvferry::cuda
