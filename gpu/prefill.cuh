// Copyright kvferry authors. Apache-2.0.
#pragma once
// Causal prefill attention on tensor cores, FlashAttention-2 style: a CTA owns a tile of query rows
// and streams the K/V tiles of its causal range through shared memory, keeping S = Q K^T, the
// online-softmax state and O in registers. Written here (not taken from a library) because its
// inputs are kvferry's own: K/V rows at an arbitrary stride (a staged copy of the paged store or
// the caller's tensors), q/o inside the engine's [T, Hq, D] tensors, and an lse output so that the
// result merges exactly with the offloaded part of the context (LaunchMergeLse).
//
// A chunk's attention may also be split over key ranges, one launch each, merged exactly in the
// epilogue of the next launch (o_in / lse_in): the CUDA runtime attends the chunk's own causal
// block while the copy engines bring the earlier positions into the staging, then each segment
// of them (kv_limit: every query sees the segment whole) as soon as its copy landed. The staging
// has the host store's page layout (kv_page_shift), so that whole pages are copied as they are.
//
// Work layout. Query rows are (token, g) pairs, row r = t * group + g of one item, so the group
// query heads of a token sit in the same tile and share every K/V load (GQA). CTA (x, y) takes
// item x and rows [m0, m0 + kBlockM) with m0 = (num_m_blocks - 1 - y) * kBlockM: the longest
// causal ranges are handed out first, the short ones fill the tail of the grid. kWarps warps take
// kMRep m16 row blocks (16 kMRep rows) each. K/V tiles of kBlockN positions are walked from the
// diagonal down to position 0; only tiles that reach past the first row's last position are
// masked element-wise, tiles past the last row's last position are not visited.
//
// Tensor-core fragments (mma.sync.m16n8k16.row.col, 16-bit inputs, fp32 accumulators; lane l,
// gid = l / 4, tig = l % 4):
//   A (16 x 16, row-major): a0 = (gid, 2 tig..+1), a1 = (gid + 8, 2 tig..),
//     a2 = (gid, 2 tig + 8..), a3 = (gid + 8, 2 tig + 8..); loaded from Q with one ldmatrix.x4
//     (lanes 0-15 address rows 0-15 at column k0, lanes 16-31 rows 0-15 at k0 + 8).
//   B (16 x 8, k x n): b0 = (k = 2 tig..+1, n = gid), b1 = (k = 2 tig + 8.., n = gid).
//     For S = Q K^T, B[k][n] = K[key n][dim k] is a K row read as is (ldmatrix); for O += P V,
//     B[k][n] = V[key k][dim n] runs across V rows (ldmatrix.trans).
//   C/D (16 x 8): c0, c1 = (gid, 2 tig..+1), c2, c3 = (gid + 8, 2 tig..). The S accumulators of key
//     columns [16 kk, 16 kk + 16) are exactly the A fragment of P for k-step kk (packed to 16 bit).
// So every thread owns two query rows (gid and gid + 8) of each of its warp's row blocks; row max
// and sum need only the 4 lanes of a quad.
//
// Shared memory: Q tile [kBlockM][HD] and kStages stages of K and V tiles [kBlockN][HD], 16-bit.
// Rows are HD * 2 bytes; 16-byte chunk c of row r is stored at chunk c ^ (r % 8), so that the 8 row
// addresses of an ldmatrix phase (8 rows, same logical chunk) hit 8 different bank groups. Tiles
// are filled with cp.async (16-byte LDGSTS, zero-fill past the end: rows past the causal range are
// zeros, never stale data, so a masked P = 0 never meets a NaN in V). One __syncthreads per K/V
// tile: after it, tile it is visible to every warp and every warp is done with tile it - 1, whose
// stage the next copy then overwrites. Logits are kept in the log2 domain (scaled by scale *
// log2 e); the lse is converted to natural log on output.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gpu/cuda_kernels.h"
#include "gpu/mma.cuh"

namespace kvferry::cuda {

/// Tile shape of one head_dim: kWarps warps of kMRep m16 row blocks each, kBlockN keys per K/V
/// tile, kStages tiles in flight, kMinBlocks CTAs per SM. head_dim <= 128: 4 warps x 32 rows (every
/// K/V fragment read from shared memory feeds two MMAs, which halves the shared-memory traffic per
/// MMA of 16-row warps) by 32 keys, 2 CTAs per SM (<= 255 registers, no spills); head_dim 256: 4
/// warps x 16 rows, 1 CTA per SM. Measured alternatives are in docs/cuda.md. Q fragments stay in
/// registers when they fit (head_dim x rows per warp <= 128 x 16), else they are re-read from
/// shared memory for every K/V tile.
template <int HD>
struct PrefillTile {
  static constexpr int kWarps = 4;
  static constexpr int kMRep = HD <= 128 ? 2 : 1;
  static constexpr int kBlockN = 32;
  static constexpr int kStages = 2;
  static constexpr int kMinBlocks = HD <= 128 ? 2 : 1;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = kWarps * 16 * kMRep;
  static constexpr bool kQInRegs = HD * kMRep <= 128;
  static constexpr size_t kQBytes = static_cast<size_t>(kBlockM) * HD * 2;
  static constexpr size_t kKvTileBytes = static_cast<size_t>(kBlockN) * HD * 2;
  static constexpr size_t kSmemBytes = kQBytes + kStages * 2 * kKvTileBytes;
};

/// Kernel arguments (a POD view).
struct PrefillArgs {
  const PrefillAttnItem* items = nullptr;
  int32_t group = 1;
  int32_t num_m_blocks = 0;
  float scale_log2 = 0.0f;
};

namespace prefill {

constexpr float kLn2 = 0.6931471805599453f;

using mma::LdMatrixX4;
using mma::LdMatrixX4Trans;
using mma::Mma16816;
using mma::PackPair;
using mma::SmemAddr;
using mma::TileOffset;

// 16-byte global -> shared copy; src_bytes = 0 writes 16 zero bytes (gmem is not read).
__device__ __forceinline__ void CpAsync16Zfill(uint32_t smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

template <typename OutT>
__device__ __forceinline__ void StorePair(OutT* dst, float a, float b) {
  if constexpr (std::is_same_v<OutT, float>) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else if constexpr (std::is_same_v<OutT, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
  } else {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
  }
}

// 2^x; -inf -> +0 (the masked logits).
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The ldmatrix address of one lane for 16-byte chunk 2 m + c0 (c0 in {0, 1}) of row r (or of row
// r + 8 i) of a tile at a 128-byte aligned shared address. Rows start at multiples of 128 bytes
// and the swizzle only flips the low 3 bits of the chunk, i.e. address bits 4-6, so with
// lane = tile + LaneOffset(r, c0) the chunk for k-step m is (lane ^ (m % 4) * 32) + (m / 4) * 128:
// one register per operand and a XOR with an immediate per ldmatrix.
template <int HD>
__device__ __forceinline__ uint32_t LaneOffset(int r, int c0) {
  return static_cast<uint32_t>(r * (HD * 2) + ((c0 ^ (r & 7)) << 4));
}
__device__ __forceinline__ uint32_t ChunkAddr(uint32_t lane, int m) {
  return (lane ^ static_cast<uint32_t>((m & 3) << 5)) + static_cast<uint32_t>((m >> 2) * 128);
}

// The Q tile of rows [m0, m0 + kBlockM) (row r: token r / group, head r % group), rows past the
// item zero-filled; the caller commits the copies.
template <int HD, typename T, int kThreads>
__device__ __forceinline__ void LoadQTile(uint32_t s_q, const T* q, int64_t m0, int64_t rows, int group,
                                          int64_t q_stride) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  constexpr int kPer = PrefillTile<HD>::kBlockM * kChunks / kThreads;
  static_assert(kPer * kThreads == PrefillTile<HD>::kBlockM * kChunks);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int r = idx / kChunks;
    const int c = idx % kChunks;
    const int64_t row = m0 + r;
    const bool valid = row < rows;
    const T* src = q;
    if (valid) {
      const int64_t t = row / group;
      src = q + t * q_stride + (row - t * group) * HD + c * 8;
    }
    CpAsync16Zfill(s_q + TileOffset<HD>(r, c), src, valid);
  }
}

// Zeroes a warp's accumulator fragments (row blocks x n8 tiles x 4).
template <int kRows, int kTiles>
__device__ __forceinline__ void ZeroFragments(float (&x)[kRows][kTiles][4]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) x[r][i][e] = 0.0f;
    }
  }
}

// S = Q K^T of one K tile at s_k_lane (this lane's K fragment address), scaled by scale_log2. Q from
// registers (kQInRegs: qf) or shared memory (q_lane). S's n8 tiles: rows gid, gid + 8 of each of
// the warp's kMRep row blocks, columns 2 tig, 2 tig + 1.
template <int HD, typename T, int kMRep, int kNTiles, bool kQInRegs, typename QF>
__device__ __forceinline__ void TileScores(const QF& qf, uint32_t q_lane, uint32_t s_k_lane, float scale_log2,
                                           float (&s)[kMRep][kNTiles][4]) {
  ZeroFragments(s);
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    uint32_t a[kMRep][4];
#pragma unroll
    for (int mr = 0; mr < kMRep; ++mr) {
      if constexpr (kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[mr][e] = qf[mr][kk][e];
      } else {
        LdMatrixX4(a[mr], ChunkAddr(q_lane, kk) + mr * 16 * HD * 2);
      }
    }
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      LdMatrixX4(b, ChunkAddr(s_k_lane, kk) + np * 16 * HD * 2);
#pragma unroll
      for (int mr = 0; mr < kMRep; ++mr) {
        Mma16816<T>(s[mr][2 * np], a[mr], b[0], b[1]);
        Mma16816<T>(s[mr][2 * np + 1], a[mr], b[2], b[3]);
      }
    }
  }
#pragma unroll
  for (int mr = 0; mr < kMRep; ++mr) {
#pragma unroll
    for (int i = 0; i < kNTiles; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mr][i][e] *= scale_log2;
    }
  }
}

// The causal mask of a tile that starts `shift` keys below the last tile: key col is visible to a
// row iff col <= limit_rel + shift.
template <int kMRep, int kNTiles>
__device__ __forceinline__ void MaskTile(const int (&limit_rel)[kMRep][2], int shift, int tig,
                                         float (&s)[kMRep][kNTiles][4]) {
#pragma unroll
  for (int mr = 0; mr < kMRep; ++mr) {
    const int rel[2] = {limit_rel[mr][0] + shift, limit_rel[mr][1] + shift};
#pragma unroll
    for (int i = 0; i < kNTiles; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = i * 8 + 2 * tig + (e & 1);
        if (col > rel[e >> 1]) s[mr][i][e] = -INFINITY;
      }
    }
  }
}

// K/V tile j into pipeline stage s (K, then V one tile later, at 2 s tiles): positions past kv_end
// are zero-filled. A thread copies chunk c = tid % kChunks of rows r0 + i * kRowStep (r0 = tid /
// kChunks); s_lane is its chunk's place in stage 0's K tile.
template <int HD, typename T, int kThreads>
struct KvTileLoader {
  static constexpr int kBN = PrefillTile<HD>::kBlockN;
  static constexpr int kChunks = HD / 8;
  static constexpr int kRowStep = kThreads / kChunks;
  static constexpr int kPer = kBN * kChunks / kThreads;
  static_assert(kRowStep * kChunks == kThreads && kPer * kThreads == kBN * kChunks);
  const T* k;
  const T* v;
  int64_t kv_stride;
  int64_t kv_end;
  int32_t tile_hi;  // paged rows: K/V tile j starts at row j + (j & tile_hi) tiles
  uint32_t s_lane;

  __device__ __forceinline__ void operator()(int j, int s) const {
    const int kv_r0 = threadIdx.x / kChunks;
    const int kv_c = threadIdx.x % kChunks;
    const uint32_t s_k = s_lane + static_cast<uint32_t>(2 * s * PrefillTile<HD>::kKvTileBytes);
    const uint32_t s_v = s_k + static_cast<uint32_t>(PrefillTile<HD>::kKvTileBytes);
    const int64_t pos0 = static_cast<int64_t>(j) * kBN + kv_r0;
    const int64_t left = kv_end - pos0;  // rows i * kRowStep < left are inside the range
    const int64_t off0 = (static_cast<int64_t>(j + (j & tile_hi)) * kBN + kv_r0) * kv_stride + kv_c * 8;
    const int64_t kv_step = static_cast<int64_t>(kRowStep) * kv_stride;
    const T* ks = k + off0;
    const T* vs = v + off0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const bool valid = i * kRowStep < left;
      // Same swizzle phase on every pass when kRowStep is a multiple of 8 (an immediate offset).
      const uint32_t so = kRowStep % 8 == 0
                              ? static_cast<uint32_t>(i * kRowStep * HD * 2)
                              : TileOffset<HD>(kv_r0 + i * kRowStep, kv_c) - TileOffset<HD>(kv_r0, kv_c);
      CpAsync16Zfill(s_k + so, valid ? ks : k, valid);
      CpAsync16Zfill(s_v + so, valid ? vs : v, valid);
      ks += kv_step;
      vs += kv_step;
    }
  }
};

// The rows of this thread: row block mr of the warp, rows r_base + 16 mr (+ 8 for h = 1). For
// each, the last key position it may see, relative to the first key of the last tile (within
// [-kBM, kBN): every row of the tile sees up to min(q_pos0 + t_lo, kv_last)). Padding rows (past
// the item) take the last row's range; their Q is zero and they are not written.
template <int kBN, int kMRep>
__device__ __forceinline__ void LastVisibleKeys(int64_t r_base, int64_t rows, int group, int64_t q_pos0,
                                                int64_t kv_last, int n_tiles, int (&limit_rel)[kMRep][2]) {
#pragma unroll
  for (int mr = 0; mr < kMRep; ++mr) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r0 = r_base + mr * 16 + 8 * h;
      const int64_t r = r0 < rows ? r0 : rows - 1;
      const int64_t last = q_pos0 + r / group < kv_last ? q_pos0 + r / group : kv_last;
      limit_rel[mr][h] = static_cast<int>(last - static_cast<int64_t>(n_tiles - 1) * kBN);
    }
  }
}

// A thread's rows of the CTA's query tile: O (kMRep row blocks, rows gid and gid + 8 (h), n8 tiles
// of the head dimension), the running max (log2 domain) and this thread's share of the running sum.
template <int HD, int kMRep>
struct RowState {
  static constexpr int kDTiles = HD / 8;  // n8 tiles of O
  float acc[kMRep][kDTiles][4];
  float m_run[kMRep][2];
  float l_run[kMRep][2];

  __device__ __forceinline__ void Init() {
    ZeroFragments(acc);
#pragma unroll
    for (int mr = 0; mr < kMRep; ++mr) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        m_run[mr][h] = -INFINITY;
        l_run[mr][h] = 0.0f;
      }
    }
  }

  // Online softmax per row over a tile's scores (the quad's 4 lanes hold the row's columns). P is
  // packed to 16 bits as soon as it exists (half the registers of S): pp[mr][i][h] = row h's pair
  // of n8 tile i. O is rescaled by the change of the max.
  template <typename T, int kNTiles>
  __device__ __forceinline__ void Softmax(const float (&s)[kMRep][kNTiles][4], uint32_t (&pp)[kMRep][kNTiles][2]) {
#pragma unroll
    for (int mr = 0; mr < kMRep; ++mr) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < kNTiles; ++i) {
          mx = fmaxf(mx, fmaxf(s[mr][i][2 * h], s[mr][i][2 * h + 1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[mr][h], mx);
        // A row with nothing visible yet keeps m = -inf; subtract 0 so its p stay 0, not NaN.
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = Exp2(m_run[mr][h] - m_use);
        m_run[mr][h] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < kNTiles; ++i) {
          const float p0 = Exp2(s[mr][i][2 * h] - m_use);
          const float p1 = Exp2(s[mr][i][2 * h + 1] - m_use);
          sum += p0 + p1;
          pp[mr][i][h] = PackPair<T>(p0, p1);
        }
        l_run[mr][h] = l_run[mr][h] * alpha + sum;
#pragma unroll
        for (int i = 0; i < kDTiles; ++i) {
          acc[mr][i][2 * h] *= alpha;
          acc[mr][i][2 * h + 1] *= alpha;
        }
      }
    }
  }

  // O += P V with V's tile at s_v_lane (this lane's V fragment address): P of keys [16 kk, 16 kk +
  // 16) (n8 tiles 2 kk, 2 kk + 1) is the A fragment of k-step kk: a0 = (gid, tile 2kk), a1 = (gid +
  // 8, tile 2kk), a2 / a3 the same of tile 2kk + 1.
  template <typename T, int kNTiles>
  __device__ __forceinline__ void AddPV(const uint32_t (&pp)[kMRep][kNTiles][2], uint32_t s_v_lane) {
#pragma unroll
    for (int kk = 0; kk < kNTiles / 2; ++kk) {
      uint32_t a[kMRep][4];
#pragma unroll
      for (int mr = 0; mr < kMRep; ++mr) {
        a[mr][0] = pp[mr][2 * kk][0];
        a[mr][1] = pp[mr][2 * kk][1];
        a[mr][2] = pp[mr][2 * kk + 1][0];
        a[mr][3] = pp[mr][2 * kk + 1][1];
      }
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t b[4];
        LdMatrixX4Trans(b, ChunkAddr(s_v_lane, dp) + kk * 16 * HD * 2);
#pragma unroll
        for (int mr = 0; mr < kMRep; ++mr) {
          Mma16816<T>(acc[mr][2 * dp], a[mr], b[0], b[1]);
          Mma16816<T>(acc[mr][2 * dp + 1], a[mr], b[2], b[3]);
        }
      }
    }
  }

  // Epilogue: the row sums over the quad, normalise, merge with (o_in, lse_in) when given, write
  // o and lse. Merging in place (o_in == o): every element is read and written by one thread; the
  // row's lse_in is read by lane tig 0 only and handed to its quad by a shuffle, so no lane reads
  // it after tig 0 wrote the merged value. r_base: this thread's first row.
  template <typename OutT>
  __device__ __forceinline__ void WriteOut(const PrefillAttnItem* item, int64_t r_base, int64_t rows,
                                           int group, int lane) const {
    const int tig = lane & 3;
    OutT* o = static_cast<OutT*>(item->o);
    float* lse = item->lse;
    const float* o_in = item->o_in;
    const float* lse_in = item->lse_in;
    const int64_t o_stride = item->q_stride_tok;
#pragma unroll
    for (int mr = 0; mr < kMRep; ++mr) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float l = l_run[mr][h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int64_t r = r_base + mr * 16 + 8 * h;
        const bool valid = r < rows;
        float lse_out = m_run[mr][h] == -INFINITY ? -INFINITY : m_run[mr][h] * kLn2 + logf(l);
        float w_own = 1.0f, w_in = 0.0f;  // weights of this launch's o and of o_in
        if (o_in != nullptr) {  // the same for the whole CTA: the shuffle below is not divergent
          float lse_b = valid && tig == 0 ? lse_in[r] : -INFINITY;
          lse_b = __shfl_sync(0xffffffffu, lse_b, lane & ~3);
          const float mx = fmaxf(lse_out, lse_b);
          if (mx == -INFINITY) {
            w_own = 0.0f;
          } else {
            w_own = expf(lse_out - mx);
            w_in = expf(lse_b - mx);
            const float sum = w_own + w_in;
            w_own /= sum;
            w_in /= sum;
            lse_out = mx + logf(sum);
          }
        }
        if (!valid) continue;
        const float inv = l > 0.0f ? w_own / l : 0.0f;
        const int64_t t = r / group;
        const int64_t off = t * o_stride + (r - t * group) * HD + 2 * tig;
        OutT* dst = o + off;
#pragma unroll
        for (int i = 0; i < kDTiles; ++i) {
          float a0 = acc[mr][i][2 * h] * inv;
          float a1 = acc[mr][i][2 * h + 1] * inv;
          if (w_in > 0.0f) {  // an o_in row of lse -inf is never read (it may hold anything)
            const float2 b = *reinterpret_cast<const float2*>(o_in + off + i * 8);
            a0 += b.x * w_in;
            a1 += b.y * w_in;
          }
          StorePair<OutT>(dst + i * 8, a0, a1);
        }
        if (lse != nullptr && tig == 0) lse[r] = lse_out;
      }
    }
  }
};

}  // namespace prefill

/// One CTA: item blockIdx.x, query rows [m0, m0 + kBlockM) of it (see the layout above).
/// T: q/K/V dtype; OutT: o dtype (float, __nv_bfloat16 or __half).
template <int HD, typename T, typename OutT>
__global__ void __launch_bounds__(PrefillTile<HD>::kThreads, PrefillTile<HD>::kMinBlocks)
    PrefillAttnKernel(PrefillArgs args) {
  using Tile = PrefillTile<HD>;
  using namespace prefill;
  constexpr int kBM = Tile::kBlockM;
  constexpr int kBN = Tile::kBlockN;
  constexpr int kThreads = Tile::kThreads;
  constexpr int kStages = Tile::kStages;
  constexpr int kMRep = Tile::kMRep;
  constexpr int kChunks = HD / 8;   // 16-byte chunks per row
  constexpr int kNTiles = kBN / 8;  // n8 tiles of S
  constexpr int kQChunksPerThread = kBM * kChunks / kThreads;
  constexpr int kKvChunksPerThread = kBN * kChunks / kThreads;
  static_assert(kQChunksPerThread * kThreads == kBM * kChunks);
  static_assert(kKvChunksPerThread * kThreads == kBN * kChunks);
  static_assert(kStages >= 2);

  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t s_q = SmemAddr(smem);
  const uint32_t s_kv = s_q + static_cast<uint32_t>(Tile::kQBytes);
  // Stage s: K at s_kv + 2 s kKvTileBytes, V one tile later.

  // Every thread reads the descriptor (items may be in mapped host memory: one request per warp).
  // The output fields are read again in the epilogue rather than held in registers across the loop.
  const PrefillAttnItem* item = args.items + blockIdx.x;
  const int group = args.group;
  const int64_t q_pos0 = item->q_pos0;
  const int64_t rows = static_cast<int64_t>(item->num_q) * group;
  const int64_t m0 =
      static_cast<int64_t>(args.num_m_blocks - 1 - static_cast<int>(blockIdx.y)) * kBM;
  if (m0 >= rows) return;  // uniform: this item has fewer queries than the longest

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int gid = lane >> 2;
  const int tig = lane & 3;

  const T* q = static_cast<const T*>(item->q);
  const T* k = static_cast<const T*>(item->k);
  const T* v = static_cast<const T*>(item->v);
  const int64_t kv_stride = item->kv_stride;
  // Paged rows (see PrefillAttnItem): K/V tile j starts at row j + (j & tile_hi) tiles, i.e. the
  // K tiles of a page are followed by as many V tiles; flat rows: tile_hi = 0.
  const int page_shift = item->kv_page_shift;
  const int32_t tile_hi = page_shift > 0 ? ~((1 << page_shift) / kBN - 1) : 0;
  // Last key any query may see: a history segment (kv_limit) ends before the causal limit.
  const int64_t kv_limit = item->kv_limit;
  const int64_t kv_last = kv_limit > 0 ? kv_limit - 1 : INT64_MAX;

  // Causal range of the tile: the first row's token sees keys [0, min(q_pos0 + t_lo, kv_last)],
  // the last row's [0, min(q_pos0 + t_hi, kv_last)]. Tiles [0, n_full) need no mask; tiles
  // [n_full, n_tiles) are masked.
  const int64_t row_last = (m0 + kBM < rows ? m0 + kBM : rows) - 1;
  const int64_t t_lo = m0 / group;
  const int64_t t_hi = row_last / group;
  const int64_t kv_end = (q_pos0 + t_hi < kv_last ? q_pos0 + t_hi : kv_last) + 1;
  const int n_tiles = static_cast<int>((kv_end + kBN - 1) / kBN);
  const int n_full =
      static_cast<int>(((q_pos0 + t_lo < kv_last ? q_pos0 + t_lo : kv_last) + 1) / kBN);

  // Q tile: rows past the item are zero-filled (never written back).
  LoadQTile<HD, T, kThreads>(s_q, q, m0, rows, group, item->q_stride_tok);
  CpAsyncCommit();

  const KvTileLoader<HD, T, kThreads> load_kv{k, v, kv_stride, kv_end, tile_hi,
                                             s_kv + TileOffset<HD>(tid / kChunks, tid % kChunks)};
  // The first kStages - 1 tiles (from the diagonal down) start streaming now.
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < n_tiles) load_kv(n_tiles - 1 - st, st);
    CpAsyncCommit();
  }

  // The rows of this thread: row block mr of the warp, rows gid and gid + 8 (h = 0, 1). For each,
  // the last key position it may see, relative to the first key of the last tile (within
  // [-kBM, kBN): every row of the tile sees up to min(q_pos0 + t_lo, kv_last)). Padding rows
  // (past the item) take the last row's range; their Q is zero and they are not written.
  const int64_t r_base = m0 + warp * 16 * kMRep + gid;
  int limit_rel[kMRep][2];
  LastVisibleKeys<kBN, kMRep>(r_base, rows, group, q_pos0, kv_last, n_tiles, limit_rel);

  // Q fragments (A operand of S = Q K^T): lanes 0-15 address rows 0-15 of a row block at chunk
  // 2 kk, lanes 16-31 the same rows at chunk 2 kk + 1.
  const uint32_t q_lane = s_q + LaneOffset<HD>(warp * 16 * kMRep + (lane & 15), lane >> 4);
  uint32_t qf[Tile::kQInRegs ? kMRep : 1][Tile::kQInRegs ? HD / 16 : 1][4];
  CpAsyncWait<kStages - 1>();  // Q landed (this thread's copies)
  __syncthreads();             // ... and everyone's
  if constexpr (Tile::kQInRegs) {
#pragma unroll
    for (int mr = 0; mr < kMRep; ++mr) {
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        LdMatrixX4(qf[mr][kk], ChunkAddr(q_lane, kk) + mr * 16 * HD * 2);
      }
    }
  }

  // K fragments (B of S): matrices {keys 0-7, chunk 2kk}, {keys 0-7, 2kk+1}, {keys 8-15, 2kk},
  // {keys 8-15, 2kk+1} of a 16-key pair of n8 tiles -> b0, b1 of tile 2np and of tile 2np+1.
  const uint32_t k_lane = LaneOffset<HD>((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  // V fragments (B of P V, transposed): {keys 0-7, chunk 2dp}, {keys 8-15, 2dp}, {keys 0-7,
  // 2dp+1}, {keys 8-15, 2dp+1} -> b0, b1 of d tile 2dp and of d tile 2dp+1.
  const uint32_t v_lane = LaneOffset<HD>((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);

  RowState<HD, kMRep> st;  // O, running max and sum of this thread's rows
  st.Init();
  const float scale_log2 = args.scale_log2;

  // One K/V tile: S = Q K^T, mask, online softmax, O += P V.
  auto attend_tile = [&](int it, int stage, auto masked) {
    const uint32_t s_k = s_kv + static_cast<uint32_t>(2 * stage * Tile::kKvTileBytes);
    const uint32_t s_v = s_k + static_cast<uint32_t>(Tile::kKvTileBytes);
    float s[kMRep][kNTiles][4];
    TileScores<HD, T, kMRep, kNTiles, Tile::kQInRegs>(qf, q_lane, s_k + k_lane, scale_log2, s);
    if constexpr (decltype(masked)::value) MaskTile<kMRep, kNTiles>(limit_rel, it * kBN, tig, s);
    uint32_t pp[kMRep][kNTiles][2];
    st.template Softmax<T, kNTiles>(s, pp);
    st.template AddPV<T, kNTiles>(pp, s_v + v_lane);
  };

  // Tiles from the diagonal (masked) down to 0; tiles it + 1 .. it + kStages - 1 stream in while
  // tile it is used. One commit group per iteration (empty at the end) keeps the wait count fixed.
  int stage = 0;  // it % kStages
  for (int it = 0; it < n_tiles; ++it) {
    const int j = n_tiles - 1 - it;
    CpAsyncWait<kStages - 2>();  // tile it landed (this thread's copies)
    __syncthreads();  // ... everyone's; and everyone is done with tile it - 1, whose stage is next
    const int ahead = it + kStages - 1;
    if (ahead < n_tiles) load_kv(n_tiles - 1 - ahead, stage == 0 ? kStages - 1 : stage - 1);
    CpAsyncCommit();
    if (j >= n_full) {
      attend_tile(it, stage, std::true_type{});
    } else {
      attend_tile(it, stage, std::false_type{});
    }
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }

  st.template WriteOut<OutT>(item, r_base, rows, group, lane);
}

}  // namespace kvferry::cuda
