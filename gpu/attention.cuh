// Copyright kvferry authors. Apache-2.0.
#pragma once
// Decode attention kernels: one query token (per GQA group) against a list of KV rows, split over
// the rows FlashDecoding-style and merged exactly by log-sum-exp. Written here rather than taken
// from a library because the rows come from anywhere (paged resident tier, token bank, or pinned
// host memory read zero-copy over PCIe) and the output must carry the lse for the CPU-route merge.
//
// Work layout. A CTA of kWarps warps takes one item (blockIdx.x), one chunk of its rows
// (blockIdx.y of num_splits) and up to G query heads of its group (blockIdx.z). A KV row is
// head_dim contiguous elements; LPR = head_dim / 8 lanes read it with one 16-byte load each, so a
// warp step covers 32 / LPR rows and every lane keeps q, the running max, sum and output for its 8
// dimensions of each query head in registers (no shared memory in the main loop). kSteps row steps
// are loaded before the first is used so that enough bytes are in flight to saturate HBM (or
// PCIe for zero-copy rows). Logits are kept in the log2 domain (q is pre-scaled by scale*log2e).
//
// Paged items with num_q > 1 (prefill) do not split the rows: the CTA at blockIdx.y takes query
// tokens t = y, y + num_splits, ... over their full causal range and writes the final result.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "base/attn_types.h"
#include "gpu/mma.cuh"
#include "kvferry/status.h"
#include "base/check.h"

namespace kvferry::cuda {

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/// Kernel arguments (a POD view). ws_o: [num_items, num_splits, group, head_dim] fp32 partial
/// outputs (normalised); ws_lse: [num_items, num_splits, group] natural-log lse. Unused (null) when
/// num_splits == 1.
struct DecodeAttnArgs {
  const void* items = nullptr;  // const RowAttnItem* or const PagedAttnItem*
  int32_t num_items = 0;
  int32_t group = 1;
  int32_t num_splits = 1;
  int32_t min_chunk = 256;
  float scale_log2 = 0.0f;
  float* ws_o = nullptr;
  float* ws_lse = nullptr;
};

// 8 elements of a 16-byte vector as fp32.
template <typename T>
__device__ __forceinline__ void Unpack8(const uint4& raw, float (&f)[8]);

template <>
__device__ __forceinline__ void Unpack8<__nv_bfloat16>(const uint4& raw, float (&f)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void Unpack8<__half>(const uint4& raw, float (&f)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h;
    static_assert(sizeof(h) == 4);
    memcpy(&h, &w[i], 4);
    const float2 v = __half22float2(h);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

__device__ __forceinline__ uint4 Load16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Row addresses of a paged KV head (see KvPages).
struct PagedRows {
  const void* const* pages;
  uint32_t page_tokens;
  uint32_t row_bytes;
  __device__ __forceinline__ void Rows(int64_t pos, const char*& k, const char*& v) const {
    const uint32_t p = static_cast<uint32_t>(pos);
    const uint32_t page = p / page_tokens;
    const uint32_t off = p - page * page_tokens;
    const char* base = reinterpret_cast<const char*>(
        __ldg(reinterpret_cast<const unsigned long long*>(pages) + page));
    k = base + static_cast<size_t>(off) * row_bytes;
    v = base + static_cast<size_t>(off + page_tokens) * row_bytes;
  }
};

// Row addresses from explicit lists (RowAttnItem).
struct ListRows {
  const void* const* k_rows;
  const void* const* v_rows;
  __device__ __forceinline__ void Rows(int64_t j, const char*& k, const char*& v) const {
    k = static_cast<const char*>(k_rows[j]);
    v = static_cast<const char*>(v_rows[j]);
  }
};

// A row source may also act on each row it served once the row's bytes are loaded (the planned
// step's token bank: reference bits of hits, staging of misses): AfterLoad(j, valid, kraw, vraw,
// dl) is then called by every lane of the warp for its row j of each step (valid false past the
// range), dl being the lane's 16-byte chunk of the row.
template <typename S, typename = void>
struct HasAfterLoad : std::false_type {};
template <typename S>
struct HasAfterLoad<S, std::void_t<decltype(&S::AfterLoad)>> : std::true_type {};

// Online-softmax state of one lane: G query heads x 8 dimensions.
template <int G>
struct LaneState {
  float m[G];    // running max (log2 domain), -inf when empty
  float l[G];    // running sum of 2^(logit - m)
  float acc[G][8];
};

// A lane's start: its 8 dimensions of each of the CTA's G query heads (pre-scaled; heads from
// gcount on zero) and an empty online-softmax state.
template <int HD, int G>
__device__ __forceinline__ void StartLane(const float* __restrict__ q, int gcount, float scale_log2,
                                          int dl, float (&qr)[G][8], LaneState<G>& st) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int i = 0; i < 8; ++i) qr[g][i] = g < gcount ? q[g * HD + dl * 8 + i] * scale_log2 : 0.0f;
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    st.m[g] = -INFINITY;
    st.l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) st.acc[g][i] = 0.0f;
  }
}

template <int G>
__device__ __forceinline__ void Combine(LaneState<G>& s, const float m_o[G], const float l_o[G],
                                        const float (&acc_o)[G][8]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float m_new = fmaxf(s.m[g], m_o[g]);
    const float a = s.m[g] == -INFINITY ? 0.0f : exp2f(s.m[g] - m_new);
    const float b = m_o[g] == -INFINITY ? 0.0f : exp2f(m_o[g] - m_new);
    s.m[g] = m_new;
    s.l[g] = s.l[g] * a + l_o[g] * b;
#pragma unroll
    for (int i = 0; i < 8; ++i) s.acc[g][i] = s.acc[g][i] * a + acc_o[g][i] * b;
  }
}

// One batch of kSteps row steps already loaded (kraw/vraw, invalid rows masked by valid): logits,
// online-softmax rescale, and the P.V accumulation into the lane state.
template <int HD, typename T, int G, int kSteps>
__device__ __forceinline__ void ConsumeSteps(LaneState<G>& st, const float (&qr)[G][8],
                                             const uint4 (&kraw)[kSteps],
                                             const uint4 (&vraw)[kSteps],
                                             const bool (&valid)[kSteps]) {
  constexpr int kLpr = HD / 8;
  constexpr int kAttnSteps = kSteps;
  float logit[kAttnSteps][G];
#pragma unroll
  for (int s = 0; s < kAttnSteps; ++s) {
    float kf[8];
    Unpack8<T>(kraw[s], kf);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float d = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) d = fmaf(qr[g][i], kf[i], d);
#pragma unroll
      for (int off = kLpr / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
      logit[s][g] = valid[s] ? d : -INFINITY;
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float mx = logit[0][g];
#pragma unroll
    for (int s = 1; s < kAttnSteps; ++s) mx = fmaxf(mx, logit[s][g]);
    const float m_new = fmaxf(st.m[g], mx);
    if (m_new == -INFINITY) continue;
    const float alpha = exp2f(st.m[g] - m_new);  // 0 when st.m == -inf
    st.m[g] = m_new;
    st.l[g] *= alpha;
#pragma unroll
    for (int i = 0; i < 8; ++i) st.acc[g][i] *= alpha;
#pragma unroll
    for (int s = 0; s < kAttnSteps; ++s) logit[s][g] = exp2f(logit[s][g] - m_new);
  }
#pragma unroll
  for (int s = 0; s < kAttnSteps; ++s) {
    float vf[8];
    Unpack8<T>(vraw[s], vf);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float p = valid[s] ? logit[s][g] : 0.0f;
      st.l[g] += p;
#pragma unroll
      for (int i = 0; i < 8; ++i) st.acc[g][i] = fmaf(p, vf[i], st.acc[g][i]);
    }
  }
}

// Merges the lane states of the CTA (lanes of a warp, then warps through shared memory) and leaves
// red_m/red_l [G], red_o [G][HD] (un-normalised) in shared memory.
template <int HD, int G>
__device__ __forceinline__ void ReduceCta(LaneState<G>& st, float* red_m, float* red_l,
                                          float* red_o, float* warp_buf) {
  constexpr int kLpr = HD / 8;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane / kLpr;
  const int dl = lane % kLpr;
  // Merge the kRpw row groups of the warp (lanes with the same dl).
#pragma unroll
  for (int off = kLpr; off < 32; off <<= 1) {
    float m_o[G], l_o[G], acc_o[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m_o[g] = __shfl_xor_sync(0xffffffffu, st.m[g], off);
      l_o[g] = __shfl_xor_sync(0xffffffffu, st.l[g], off);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc_o[g][i] = __shfl_xor_sync(0xffffffffu, st.acc[g][i], off);
    }
    Combine<G>(st, m_o, l_o, acc_o);
  }
  // Merge the warps through shared memory: warp_buf [kAttnWarps][G][HD + 2].
  if (sub == 0) {
    float* wb = warp_buf + static_cast<size_t>(warp) * G * (HD + 2);
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int i = 0; i < 8; ++i) wb[g * (HD + 2) + dl * 8 + i] = st.acc[g][i];
      if (dl == 0) {
        wb[g * (HD + 2) + HD] = st.m[g];
        wb[g * (HD + 2) + HD + 1] = st.l[g];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * HD; idx += kAttnThreads) {
    const int g = idx / HD;
    const int d = idx % HD;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) m = fmaxf(m, warp_buf[(w * G + g) * (HD + 2) + HD]);
    float l = 0.0f, o = 0.0f;
    if (m != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) {
        const float* wb = warp_buf + (w * G + g) * (HD + 2);
        const float mw = wb[HD];
        const float a = mw == -INFINITY ? 0.0f : exp2f(mw - m);
        l += wb[HD + 1] * a;
        o += wb[d] * a;
      }
    }
    red_o[g * HD + d] = o;
    if (d == 0) {
      red_m[g] = m;
      red_l[g] = l;
    }
  }
  __syncthreads();
}

// Attends rows [begin, end) of \p src for the CTA's query heads and leaves the merged state of the
// whole CTA in shared memory: red_m/red_l [G], red_o [G][HD] (un-normalised).
template <int HD, typename T, int G, typename Src>
__device__ void AttendRange(const Src& src, const float* __restrict__ q, int gcount, float scale_log2,
                            int64_t begin, int64_t end, float* red_m, float* red_l, float* red_o,
                            float* warp_buf) {
  constexpr int kLpr = HD / 8;
  constexpr int kRpw = 32 / kLpr;
  // Row steps loaded before first use: 8 when registers allow (G <= 4), else 4.
  constexpr int kAttnSteps = G <= 4 ? 8 : 4;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane / kLpr;
  const int dl = lane % kLpr;

  float qr[G][8];
  LaneState<G> st;
  StartLane<HD, G>(q, gcount, scale_log2, dl, qr, st);

  constexpr int64_t kRowsPerBlock = static_cast<int64_t>(kRpw) * kAttnSteps;
  for (int64_t blk = begin + warp * kRowsPerBlock; blk < end;
       blk += kRowsPerBlock * kAttnWarps) {
    uint4 kraw[kAttnSteps], vraw[kAttnSteps];
    bool valid[kAttnSteps];
#pragma unroll
    for (int s = 0; s < kAttnSteps; ++s) {
      const int64_t r = blk + s * kRpw + sub;
      valid[s] = r < end;
      kraw[s] = make_uint4(0, 0, 0, 0);
      vraw[s] = make_uint4(0, 0, 0, 0);
      if (valid[s]) {
        const char* kp;
        const char* vp;
        src.Rows(r, kp, vp);
        kraw[s] = Load16(kp + dl * 16);
        vraw[s] = Load16(vp + dl * 16);
      }
    }
    if constexpr (HasAfterLoad<Src>::value) {
#pragma unroll
      for (int s = 0; s < kAttnSteps; ++s) src.AfterLoad(blk + s * kRpw + sub, valid[s], kraw[s], vraw[s], dl);
    }
    ConsumeSteps<HD, T, G, kAttnSteps>(st, qr, kraw, vraw, valid);
  }

  ReduceCta<HD, G>(st, red_m, red_l, red_o, warp_buf);
}

// cp.async (LDGSTS) helpers: 16-byte global -> shared copies that occupy no registers while in
// flight, so a CTA keeps several tiles of K/V streaming from HBM while it computes on another.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Pipelined decode (num_q == 1 over device-memory rows): tiles of kPipeTileRows<HD> rows (16 KiB of
// K + V for 2-byte KV) stream through kPipeStages shared-memory stages with cp.async; each warp
// computes 4 row steps per tile from shared memory (a warp step reads 512 contiguous bytes).
constexpr int kPipeStages = 4;
template <int HD>
constexpr int kPipeTileRows = 4096 / HD;
template <int HD, typename T>
constexpr size_t kPipeStageBytes = static_cast<size_t>(2) * kPipeTileRows<HD> * HD * sizeof(T);
template <int HD, typename T>
constexpr size_t kPipeSmemBytes = kPipeStages * kPipeStageBytes<HD, T>;

// Issues tile t (kPipeTileRows<HD> rows from begin, those before end) into its stage of pipe:
// this thread's 16-byte chunks, chunk `piece` of the tile's row rr, K to stage + koff(rr, piece)
// and V kPipeTileRows<HD> rows after it. Rows past the range are skipped, or zeroed (kZeroTail).
template <int HD, typename T, bool kZeroTail, typename Src, typename KOff>
__device__ __forceinline__ void IssueTile(const Src& src, char* pipe, int64_t begin, int64_t end,
                                          int64_t t, const KOff& koff) {
  constexpr int kLpr = HD / 8;
  constexpr int kTile = kPipeTileRows<HD>;
  constexpr size_t kRowB = HD * sizeof(T);
  constexpr int kRowChunks = kTile * kLpr / kAttnThreads;  // 16-byte K chunks per thread per tile
  static_assert(kRowChunks * kAttnThreads == kTile * kLpr);
  char* stage = pipe + (t % kPipeStages) * kPipeStageBytes<HD, T>;
  const int64_t r0 = begin + t * kTile;
#pragma unroll
  for (int i = 0; i < kRowChunks; ++i) {
    const int c = threadIdx.x + i * kAttnThreads;
    const int rr = c / kLpr;
    const int piece = c % kLpr;
    char* ks = stage + koff(rr, piece);
    char* vs = ks + kTile * kRowB;
    if (r0 + rr < end) {
      const char* kp;
      const char* vp;
      src.Rows(r0 + rr, kp, vp);
      CpAsync16(ks, kp + piece * 16);
      CpAsync16(vs, vp + piece * 16);
    } else if constexpr (kZeroTail) {
      *reinterpret_cast<uint4*>(ks) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(vs) = make_uint4(0, 0, 0, 0);
    }
  }
}

// The pipeline's first kPipeStages - 1 tiles, a commit group each (empty past ntiles).
template <typename Issue>
__device__ __forceinline__ void PipeStart(const Issue& issue, int64_t ntiles) {
#pragma unroll
  for (int t = 0; t < kPipeStages - 1; ++t) {
    if (t < ntiles) issue(t);
    CpAsyncCommit();
  }
}

// Before tile t is read: waits for it, then issues tile t + kPipeStages - 1 as the next group.
template <typename Issue>
__device__ __forceinline__ void PipeAdvance(const Issue& issue, int64_t t, int64_t ntiles) {
  CpAsyncWait<kPipeStages - 2>();
  __syncthreads();  // tile t visible to all; every warp is done with tile t - 1's stage
  if (t + kPipeStages - 1 < ntiles) issue(t + kPipeStages - 1);
  CpAsyncCommit();
}

template <int HD, typename T, int G, typename Src>
__device__ void AttendRangePipelined(const Src& src, const float* __restrict__ q, int gcount,
                                     float scale_log2, int64_t begin, int64_t end, char* pipe,
                                     float* red_m, float* red_l, float* red_o, float* warp_buf) {
  static_assert(sizeof(T) == 2, "pipelined decode assumes 2-byte KV elements");
  constexpr int kLpr = HD / 8;
  constexpr int kRpw = 32 / kLpr;
  constexpr int kTile = kPipeTileRows<HD>;
  constexpr int kSteps = kTile / (kRpw * kAttnWarps);  // 4
  static_assert(kSteps * kRpw * kAttnWarps == kTile);
  constexpr size_t kRowB = HD * sizeof(T);
  constexpr size_t kStageB = kPipeStageBytes<HD, T>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane / kLpr;
  const int dl = lane % kLpr;

  const int64_t ntiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;
  auto issue = [&](int64_t t) {
    IssueTile<HD, T, false>(src, pipe, begin, end, t,
                            [](int rr, int piece) { return rr * kRowB + piece * 16; });
  };
  PipeStart(issue, ntiles);

  float qr[G][8];
  LaneState<G> st;
  StartLane<HD, G>(q, gcount, scale_log2, dl, qr, st);

  for (int64_t t = 0; t < ntiles; ++t) {
    PipeAdvance(issue, t, ntiles);
    const char* stage = pipe + (t % kPipeStages) * kStageB;
    const int64_t r0 = begin + t * kTile;
    uint4 kraw[kSteps], vraw[kSteps];
    bool valid[kSteps];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int rr = (s * kAttnWarps + warp) * kRpw + sub;
      valid[s] = r0 + rr < end;
      kraw[s] = make_uint4(0, 0, 0, 0);
      vraw[s] = make_uint4(0, 0, 0, 0);
      if (valid[s]) {
        kraw[s] = *reinterpret_cast<const uint4*>(stage + rr * kRowB + dl * 16);
        vraw[s] = *reinterpret_cast<const uint4*>(stage + (kTile + rr) * kRowB + dl * 16);
      }
    }
    ConsumeSteps<HD, T, G, kSteps>(st, qr, kraw, vraw, valid);
  }
  CpAsyncWait<0>();
  __syncthreads();  // the stages are reused as warp_buf / red_* below
  ReduceCta<HD, G>(st, red_m, red_l, red_o, warp_buf);
}

// ---- Tensor-core decode (mma.sync m16n8k16) -------------------------------------------------------
// The CUDA-core loops above spend ~90 warp instructions per row (a 16-lane dot product, its
// shuffles, the online softmax) and leave the SM issue-bound below HBM speed for single-query
// decode. Here both products run on tensor cores with the KV rows as the MMA's M dimension and
// the GQA group's query heads (<= 8) as its N dimension, so no MMA row is padding:
//   S^T = K Q^T      A = K rows (ldmatrix), B = Q^T (registers, loaded once)
//   O^T += V^T P^T   A = V^T (ldmatrix.trans), B = P^T (S^T's accumulators, transposed in
//                    registers by movmatrix)
// Precision: Q and P are split into hi + lo halves of the MMA type (x = hi + lo to ~2^-17; Q's lo
// half is skipped when Q is exact in the type), so scores and weights carry fp32-like precision
// against K and V, which are exact in their type; accumulation is fp32. Every warp computes S^T
// for the whole tile and owns a quarter of the head dimension of O, so warps exchange nothing.

template <typename T>
__device__ __forceinline__ float RoundTo(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(__float2bfloat16_rn(x));
  } else {
    return __half2float(__float2half_rn(x));
  }
}
// hi and lo halves of a pair: hi = T(x), lo = T(x - hi).
template <typename T>
__device__ __forceinline__ void SplitPair(float a, float b, uint32_t& hi, uint32_t& lo) {
  const float ha = RoundTo<T>(a), hb = RoundTo<T>(b);
  hi = mma::PackPair<T>(ha, hb);
  lo = mma::PackPair<T>(a - ha, b - hb);
}

// Whether AttendRangeMma serves (HD, G): each warp's quarter of the head dimension must be whole
// 16-row MMA tiles of O^T, and the group's heads fit the MMA's 8 columns.
template <int HD, int G>
constexpr bool kMmaDecode = (HD == 64 || HD == 128) && G <= 8;

// Resident CTAs per SM the Runtime's decode step kernel is compiled for (its register budget):
// three of the pipelined ones (~145 registers on tensor cores; the CUDA-core loops fit only for
// G <= 4). DecodeAttnKernel keeps G <= 4: its multi-query items run the CUDA-core loops.
template <int HD, int G, bool kPipe>
constexpr int kPipeMinBlocks = kPipe && (G <= 4 || kMmaDecode<HD, G>) ? 3 : 1;

// Q^T as the B fragments of AttendRangeMma: k-step ks, b0 = dims ks*16 + fc, +1 and b1 = dims +8,
// of head fr, split into hi and lo halves of T. Returns whether any lo half is nonzero in the warp
// (warp-uniform: the lo products are skipped when Q is exact in T).
template <int HD, typename T>
__device__ __forceinline__ bool MmaQueryFragments(const float* __restrict__ q, int gcount, int fr, int fc,
                                                  uint32_t (&qb_hi)[HD / 16][2], uint32_t (&qb_lo)[HD / 16][2]) {
  bool q_lo = false;
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = ks * 16 + h * 8 + fc;
      const float x0 = fr < gcount ? q[fr * HD + col] : 0.0f;
      const float x1 = fr < gcount ? q[fr * HD + col + 1] : 0.0f;
      SplitPair<T>(x0, x1, qb_hi[ks][h], qb_lo[ks][h]);
      q_lo |= qb_lo[ks][h] != 0u;
    }
  }
  return __any_sync(0xffffffffu, q_lo);
}

// AttendRangeMma's state into red_m / red_l / red_o (heads fc, fc + 1 of this lane; O^T rows of
// the warp's dims), then a barrier.
template <int HD, int kDT>
__device__ __forceinline__ void MmaWriteResult(const float (&m)[2], const float (&l)[2], const float (&o)[kDT][4],
                                               int gcount, int warp, int fr, int fc, float* red_m,
                                               float* red_l, float* red_o) {
  constexpr int kDW = HD / kAttnWarps;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int g = fc + h;
    if (g >= gcount) continue;
    if (warp == 0 && fr == 0) {
      red_m[g] = m[h];
      red_l[g] = l[h];
    }
#pragma unroll
    for (int j = 0; j < kDT; ++j) {
      const int d = warp * kDW + j * 16 + fr;
      red_o[g * HD + d] = o[j][h];
      red_o[g * HD + d + 8] = o[j][2 + h];
    }
  }
  __syncthreads();
}

// Same contract as AttendRangePipelined (rows in device memory, range [begin, end), q fp32
// unscaled, result in red_m / red_l / red_o, the stages aliasing them).
template <int HD, typename T, int G, typename Src>
__device__ void AttendRangeMma(const Src& src, const float* __restrict__ q, int gcount,
                               float scale_log2, int64_t begin, int64_t end, char* pipe,
                               float* red_m, float* red_l, float* red_o) {
  static_assert(sizeof(T) == 2 && kMmaDecode<HD, G>);
  constexpr int kTile = kPipeTileRows<HD>;
  constexpr size_t kRowB = HD * sizeof(T);
  constexpr size_t kStageB = kPipeStageBytes<HD, T>;
  constexpr int kMT = kTile / 16;        // 16-row m-tiles of S^T per tile
  constexpr int kKS = HD / 16;           // k-steps of K Q^T
  constexpr int kDW = HD / kAttnWarps;   // head dimensions of O per warp
  constexpr int kDT = kDW / 16;          // 16-row m-tiles of O^T per warp
  static_assert(kDT >= 1 && kKS % 2 == 0);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int fr = lane >> 2;        // fragment row within an 8-row block
  const int fc = (lane & 3) * 2;   // fragment column pair: heads fc, fc + 1 in S^T and O^T

  const int64_t ntiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;
  // Rows past the range are zeroed, so that P = 0 never meets a stale NaN.
  auto issue = [&](int64_t t) {
    IssueTile<HD, T, true>(src, pipe, begin, end, t,
                           [](int rr, int piece) { return mma::TileOffset<HD>(rr, piece); });
  };
  PipeStart(issue, ntiles);

  uint32_t qb_hi[kKS][2], qb_lo[kKS][2];
  const bool q_lo = MmaQueryFragments<HD, T>(q, gcount, fr, fc, qb_hi, qb_lo);
  float m[2] = {-INFINITY, -INFINITY};  // running max (log2 domain) of heads fc, fc + 1
  float l[2] = {0.0f, 0.0f};            // this lane's share of their running sums
  float o[kDT][4];                      // O^T: dims (warp's dt-th 16) + fr (+8), heads fc, fc+1
#pragma unroll
  for (int j = 0; j < kDT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

  for (int64_t t = 0; t < ntiles; ++t) {
    PipeAdvance(issue, t, ntiles);
    const char* stage = pipe + (t % kPipeStages) * kStageB;
    const char* vstage = stage + kTile * kRowB;
    const int64_t r0 = begin + t * kTile;

    // S^T = K Q^T: m-tile mt holds rows mt*16 + fr (c0, c1) and + 8 (c2, c3), heads fc, fc+1.
    float s[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      float acc_lo[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      s[mt][0] = s[mt][1] = s[mt][2] = s[mt][3] = 0.0f;
      const int row = mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int ks = 0; ks < kKS; ++ks) {
        // Matrices: rows +0 / +8 at chunk 2ks, then rows +0 / +8 at chunk 2ks+1.
        uint32_t a[4];
        mma::LdMatrixX4(a, mma::SmemAddr(stage) + mma::TileOffset<HD>(row, ks * 2 + (lane >> 4)));
        mma::Mma16816<T>(s[mt], a, qb_hi[ks][0], qb_hi[ks][1]);
        if (q_lo) mma::Mma16816<T>(acc_lo, a, qb_lo[ks][0], qb_lo[ks][1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][e] += acc_lo[e];
    }
    // Online softmax per head over the tile: a head's values lie in the 8 lanes of equal fc.
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool ok = r0 + mt * 16 + fr + (e >> 1) * 8 < end;
        s[mt][e] = ok ? s[mt][e] * scale_log2 : -INFINITY;
        tmax[e & 1] = fmaxf(tmax[e & 1], s[mt][e]);
      }
    }
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], off));
      }
      const float m_new = fmaxf(m[h], tmax[h]);  // finite: every tile has a row in range
      corr[h] = exp2f(m[h] - m_new);
      m[h] = m_new;
      l[h] *= corr[h];
    }
#pragma unroll
    for (int j = 0; j < kDT; ++j) {
      o[j][0] *= corr[0];
      o[j][1] *= corr[1];
      o[j][2] *= corr[0];
      o[j][3] *= corr[1];
    }
    // P^T as B fragments of k-step mt (rows mt*16 ..): S^T's (rows fr, heads fc..) blocks
    // transposed to (rows fc.., head fr); b0 from c0/c1 (rows +0), b1 from c2/c3 (rows +8).
    uint32_t pb_hi[kMT][2], pb_lo[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float p0 = exp2f(s[mt][2 * h] - m[0]);
        const float p1 = exp2f(s[mt][2 * h + 1] - m[1]);
        l[0] += p0;
        l[1] += p1;
        uint32_t hi, lo;
        SplitPair<T>(p0, p1, hi, lo);
        pb_hi[mt][h] = mma::MovMatrixTrans(hi);
        pb_lo[mt][h] = mma::MovMatrixTrans(lo);
      }
    }
    // O^T[warp's dims] += V^T P^T: A = V^T (16 dims x 16 rows) by ldmatrix.trans; matrices:
    // (rows +0, dims +0), (rows +0, dims +8), (rows +8, dims +0), (rows +8, dims +8).
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int vrow = mt * 16 + (lane & 7) + (lane >> 4) * 8;
#pragma unroll
      for (int j = 0; j < kDT; ++j) {
        const int chunk = (warp * kDW + j * 16) / 8 + ((lane >> 3) & 1);
        uint32_t a[4];
        mma::LdMatrixX4Trans(a, mma::SmemAddr(vstage) + mma::TileOffset<HD>(vrow, chunk));
        mma::Mma16816<T>(o[j], a, pb_hi[mt][0], pb_hi[mt][1]);
        mma::Mma16816<T>(o[j], a, pb_lo[mt][0], pb_lo[mt][1]);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l[h] += __shfl_xor_sync(0xffffffffu, l[h], off);
  }
  CpAsyncWait<0>();
  __syncthreads();  // the stages are reused as red_* below
  MmaWriteResult<HD, kDT>(m, l, o, gcount, warp, fr, fc, red_m, red_l, red_o);
}

// The pipelined single-query decode over device-memory rows: tensor cores where kMmaDecode holds,
// else the CUDA-core loops.
template <int HD, typename T, int G, typename Src>
__device__ __forceinline__ void AttendRangeStaged(const Src& src, const float* __restrict__ q,
                                                  int gcount, float scale_log2, int64_t begin,
                                                  int64_t end, char* pipe, float* red_m,
                                                  float* red_l, float* red_o, float* warp_buf) {
  if constexpr (kMmaDecode<HD, G>) {
    AttendRangeMma<HD, T, G>(src, q, gcount, scale_log2, begin, end, pipe, red_m, red_l, red_o);
  } else {
    AttendRangePipelined<HD, T, G>(src, q, gcount, scale_log2, begin, end, pipe, red_m, red_l,
                                   red_o, warp_buf);
  }
}

// Writes the CTA's merged state as a normalised output plus natural-log lse.
template <int HD, int G>
__device__ void WriteResult(const float* red_m, const float* red_l, const float* red_o, int gcount,
                            float* o, float* lse) {
  for (int idx = threadIdx.x; idx < gcount * HD; idx += kAttnThreads) {
    const int g = idx / HD;
    const float l = red_l[g];
    o[idx] = l > 0.0f ? red_o[idx] / l : 0.0f;
    if (idx % HD == 0) lse[g] = l > 0.0f ? (red_m[g] + log2f(l)) * kLn2 : -INFINITY;
  }
}

template <int HD, int G>
__device__ __forceinline__ size_t AttnSmemFloats() {
  return static_cast<size_t>(kAttnWarps) * G * (HD + 2) + G * HD + 2 * G;
}

// kPipe: single-query items stream their rows through the cp.async pipeline (rows must be in device
// memory; the dynamic shared memory is then max(kPipeSmemBytes, AttnSmemFloats) and the reduction
// buffers alias the drained stages). Without it rows are loaded into registers (any memory,
// including mapped host memory read zero-copy).
template <int HD, typename T, int G, typename Item, bool kPipe>
__global__ void __launch_bounds__(kAttnThreads, kPipe && G <= 4 ? 3 : 1)
    DecodeAttnKernel(DecodeAttnArgs args) {
  extern __shared__ __align__(16) float smem[];
  float* warp_buf = smem;
  float* red_o = warp_buf + kAttnWarps * G * (HD + 2);
  float* red_m = red_o + G * HD;
  float* red_l = red_m + G;
  // Items may live in mapped host memory: one thread reads the descriptor once.
  __shared__ alignas(Item) unsigned char item_raw[sizeof(Item)];
  if (threadIdx.x == 0) {
    memcpy(item_raw, static_cast<const Item*>(args.items) + blockIdx.x, sizeof(Item));
  }
  __syncthreads();
  const Item& item = *reinterpret_cast<const Item*>(item_raw);

  const int g0 = blockIdx.z * G;
  const int gcount = min(G, args.group - g0);
  const int split = blockIdx.y;
  constexpr size_t kElem = sizeof(T);

  int64_t len;
  int32_t num_q = 1;
  if constexpr (std::is_same_v<Item, RowAttnItem>) {
    len = item.count;
  } else {
    num_q = item.num_q;
    len = item.q_pos0 + 1;
  }

  if (num_q == 1) {
    // Split the rows into num_splits chunks of at least min_chunk rows (whole tiles when
    // pipelined).
    int64_t chunk = (len + args.num_splits - 1) / args.num_splits;
    if (chunk < args.min_chunk) chunk = args.min_chunk;
    if constexpr (kPipe) {
      chunk = (chunk + kPipeTileRows<HD> - 1) / kPipeTileRows<HD> * kPipeTileRows<HD>;
    }
    const int64_t begin = chunk * split < len ? chunk * split : len;
    const int64_t end = begin + chunk < len ? begin + chunk : len;
    if (begin >= end && args.num_splits > 1) {
      // An empty split (short row lists get more splits than rows): contribute nothing to the
      // combine and leave at once instead of running the block reductions. Uniform per CTA.
      const size_t part = static_cast<size_t>(blockIdx.x) * args.num_splits + split;
      float* ws_o = args.ws_o + (part * args.group + g0) * HD;
      for (int i = threadIdx.x; i < gcount * HD; i += blockDim.x) ws_o[i] = 0.0f;
      if (threadIdx.x < gcount) args.ws_lse[part * args.group + g0 + threadIdx.x] = -INFINITY;
      return;
    }
    const float* q = item.q + static_cast<size_t>(g0) * HD;
    auto attend = [&](const auto& src) {
      if constexpr (kPipe) {
        AttendRangeStaged<HD, T, G>(src, q, gcount, args.scale_log2, begin, end,
                                    reinterpret_cast<char*>(smem), red_m, red_l, red_o, warp_buf);
      } else {
        AttendRange<HD, T, G>(src, q, gcount, args.scale_log2, begin, end, red_m, red_l, red_o,
                              warp_buf);
      }
    };
    if constexpr (std::is_same_v<Item, RowAttnItem>) {
      attend(ListRows{item.k_rows, item.v_rows});
    } else {
      attend(PagedRows{item.kv.pages, static_cast<uint32_t>(item.kv.page_tokens),
                       static_cast<uint32_t>(HD * kElem)});
    }
    if (args.num_splits == 1) {
      WriteResult<HD, G>(red_m, red_l, red_o, gcount, item.o + static_cast<size_t>(g0) * HD,
                         item.lse + g0);
    } else {
      const size_t part = static_cast<size_t>(blockIdx.x) * args.num_splits + split;
      WriteResult<HD, G>(red_m, red_l, red_o, gcount,
                         args.ws_o + (part * args.group + g0) * HD,
                         args.ws_lse + part * args.group + g0);
    }
    return;
  }
  if constexpr (!std::is_same_v<Item, RowAttnItem>) {
    PagedRows src{item.kv.pages, static_cast<uint32_t>(item.kv.page_tokens),
                  static_cast<uint32_t>(HD * kElem)};
    for (int32_t t = split; t < num_q; t += args.num_splits) {
      const size_t row = static_cast<size_t>(t) * args.group + g0;
      AttendRange<HD, T, G>(src, item.q + row * HD, gcount, args.scale_log2, 0,
                            item.q_pos0 + t + 1, red_m, red_l, red_o, warp_buf);
      WriteResult<HD, G>(red_m, red_l, red_o, gcount, item.o + row * HD, item.lse + row);
      __syncthreads();  // red_* are reused by the next token
    }
  }
}

// Merges the num_splits (<= kAttnThreads) partial results of one query head (blockIdx.y) of each
// single-query item (blockIdx.x) into its output; items with num_q > 1 were written directly.
// Thread y loads split y's lse; the weights go through shared memory and every thread then sums its
// output dimensions over the splits with independent loads.
template <typename Item>
__global__ void __launch_bounds__(kAttnThreads) CombineSplitsKernel(DecodeAttnArgs args,
                                                                    int head_dim) {
  __shared__ float w[kAttnThreads];
  __shared__ float red[kAttnWarps];
  __shared__ float m_sh, sum_sh;
  const Item& item = static_cast<const Item*>(args.items)[blockIdx.x];
  if constexpr (std::is_same_v<Item, PagedAttnItem>) {
    if (item.num_q != 1) return;
  }
  const int splits = args.num_splits;
  const int g = blockIdx.y;
  const size_t base = static_cast<size_t>(blockIdx.x) * splits;
  const int tid = threadIdx.x;
  const float l = tid < splits ? args.ws_lse[(base + tid) * args.group + g] : -INFINITY;
  float m = l;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((tid & 31) == 0) red[tid >> 5] = m;
  __syncthreads();
  if (tid == 0) {
    float mm = red[0];
    for (int i = 1; i < kAttnWarps; ++i) mm = fmaxf(mm, red[i]);
    m_sh = mm;
  }
  __syncthreads();
  m = m_sh;
  const float wt = (l == -INFINITY || m == -INFINITY) ? 0.0f : expf(l - m);
  w[tid] = wt;
  float sum = wt;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  __syncthreads();  // red[] is reused
  if ((tid & 31) == 0) red[tid >> 5] = sum;
  __syncthreads();
  if (tid == 0) {
    float ss = 0.0f;
    for (int i = 0; i < kAttnWarps; ++i) ss += red[i];
    sum_sh = ss;
  }
  __syncthreads();
  sum = sum_sh;
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const float* ws_o = args.ws_o + (base * args.group + g) * head_dim;
  const size_t ystride = static_cast<size_t>(args.group) * head_dim;
  for (int d = tid; d < head_dim; d += kAttnThreads) {
    float o0 = 0.0f, o1 = 0.0f, o2 = 0.0f, o3 = 0.0f;
    int y = 0;
    for (; y + 4 <= splits; y += 4) {
      o0 = fmaf(w[y], ws_o[y * ystride + d], o0);
      o1 = fmaf(w[y + 1], ws_o[(y + 1) * ystride + d], o1);
      o2 = fmaf(w[y + 2], ws_o[(y + 2) * ystride + d], o2);
      o3 = fmaf(w[y + 3], ws_o[(y + 3) * ystride + d], o3);
    }
    for (; y < splits; ++y) o0 = fmaf(w[y], ws_o[y * ystride + d], o0);
    item.o[static_cast<size_t>(g) * head_dim + d] = ((o0 + o1) + (o2 + o3)) * inv;
  }
  if (tid == 0) item.lse[g] = m == -INFINITY ? -INFINITY : m + logf(sum);
}

// Opts \p Kernel into \p smem bytes of dynamic shared memory (above 48 KiB needs it) and returns
// its resident CTAs per SM at kAttnThreads threads; computed once per kernel instance. \p name
// goes into the error.
template <auto Kernel>
Result<int> PrepareAttnKernel(size_t smem, const char* name) {
  static const std::pair<cudaError_t, int> cached = [smem] {
    cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    int blocks = 0;
    if (e == cudaSuccess) {
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Kernel, kAttnThreads, smem);
    }
    return std::make_pair(e, blocks);
  }();
  if (cached.first != cudaSuccess) {
    return Status(StatusCode::kDeviceError, detail::StrCat("CUDA: configuring ", name, ": ",
                                                           cudaGetErrorName(cached.first)));
  }
  return std::max(cached.second, 1);
}

}  // namespace kvferry::cuda
