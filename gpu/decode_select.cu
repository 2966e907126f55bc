// Copyright kvferry authors. Apache-2.0.
// The building blocks of a planned decode step's selection on the GPU, which the policies'
// selections (policies/*/select.cu) call after their scoring: the top-k of an item's scores
// (one CTA an item, or the multi-CTA top-k for items that rank many; Quest's pages walked by
// score), PrHS's depth window on the finished lists, and the checks and grid every scoring
// shares. The scores: for each query head g of the item's GQA group and position j,
// select_ws[item][g][j] in the log2 domain; per head the softmax max and sum, the group's summed
// weight per position, the exact top-k (topk.cuh), then the winners re-sorted by position into
// the item's list. Grid shapes come from capacities and every per-step value (slots, lengths,
// budgets) is read on the device, so the launches can be captured in a CUDA graph. Items that
// rank many scores (kSelectMctaMinKeys) take the multi-CTA top-k below instead of the one CTA
// (see "Multi-CTA top-k" and docs/cuda.md).

#include <cuda/atomic>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <limits>

#include "base/check.h"
#include "base/psaw.h"
#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "gpu/select_kernels.cuh"
#include "gpu/topk.cuh"

namespace kvferry::cuda {
namespace {

template <typename Op>
__device__ __forceinline__ float BlockReduce(float x, Op op, float* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, off));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  float r = red[0];
  const int warps = static_cast<int>(blockDim.x >> 5);
  for (int i = 1; i < warps; ++i) r = op(r, red[i]);
  return r;
}

// The group's summed softmax weight of every position [0, n) of the logits l (row g at
// l + g * ld, log2 domain) over row 0, then the top k of positions [lo, lo + count) into sel, re-sorted
// by position (sel[i] = position - lo for i < k). Every thread of a kTopKThreads CTA calls it.
__device__ void GroupWeightsTopK(float* l, int64_t ld, int group, int64_t n, int64_t lo,
                                 int64_t count, int64_t k, unsigned long long* sel, int& sort_n) {
  __shared__ float red[kTopKThreads / 32];
  __shared__ float m_s[64], inv_s[64];
  for (int g = 0; g < group; ++g) {
    const float* lg = l + static_cast<size_t>(g) * ld;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, lg[j]);
    m = BlockReduce(m, [](float x, float y) { return fmaxf(x, y); }, red);
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += exp2f(lg[j] - m);
    s = BlockReduce(s, [](float x, float y) { return x + y; }, red);
    if (threadIdx.x == 0) {
      m_s[g] = m;
      inv_s[g] = 1.0f / s;
    }
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    float w = 0.0f;
    for (int g = 0; g < group; ++g) w += exp2f(l[static_cast<size_t>(g) * ld + j] - m_s[g]) * inv_s[g];
    l[j] = w;  // only this thread reads position j
  }
  __syncthreads();
  sort_n = 1;
  while (sort_n < k) sort_n <<= 1;
  TopKSelect(l + lo, count, static_cast<int>(k), sort_n, sel);
  // Re-sort the winners by position: lists are ascending, as the host policies return them.
  for (int i = threadIdx.x; i < sort_n; i += blockDim.x) {
    sel[i] = i < k ? (sel[i] & 0xffffffffull) : ~0ull;
  }
  BitonicSortBlock(sel, sort_n);
}


// The pages of sel[0, want) (ranked: (~key << 32 | page - p_lo), best first; sel has sort_n
// entries, sort_n a power of two >= want, at most kTopKSmemItems) walked by score until k_off
// positions are taken, their positions written to out[s.sinks, ...) ascending. Returns the count
// taken (every thread). sel and offs (sort_n ints) in shared memory; every thread of the CTA
// (kTopKThreads of them) calls. The walk and the offsets are block scans (four entries a thread):
// a serial walk by one thread took about half of the 38 us MctaPagesListKernel spent a layer at
// 8K pages.
__device__ int64_t TakePages(const DecodeStepArgs& a, const ItemSplit& s,
                                  unsigned long long* sel, int32_t* offs, int sort_n, int64_t want,
                                  int32_t* out) {
  constexpr int kPer = kTopKSmemItems / kTopKThreads;
  using Scan = cub::BlockScan<int32_t, kTopKThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int base = static_cast<int>(threadIdx.x) * kPer;
  // Positions each ranked page holds in the offloaded range, and how many the pages ranked above
  // it hold: page i takes min(len, k_off - above) when that is positive.
  int32_t len[kPer], above[kPer];
  int64_t pg[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = base + u;
    len[u] = 0;
    pg[u] = 0;
    if (i < want && i < sort_n) {
      pg[u] = s.p_lo + static_cast<int64_t>(sel[i] & 0xffffffffu);
      const int64_t lo = max(pg[u] * a.meta_page, s.off_lo);
      len[u] = static_cast<int32_t>(min((pg[u] + 1) * a.meta_page, s.off_hi) - lo);
    }
  }
  int32_t ranked_total = 0;
  Scan(scan_tmp).ExclusiveSum(len, above, ranked_total);
  __syncthreads();  // every thread has read sel (and the scan's storage) before either is rewritten
  // Key the taken pages by page for the sort.
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = base + u;
    if (i >= sort_n) continue;
    unsigned long long key = ~0ull;
    if (len[u] > 0 && above[u] < s.k_off) {
      const int64_t take = min(static_cast<int64_t>(len[u]), s.k_off - above[u]);
      key = (static_cast<unsigned long long>(pg[u]) << 32) | static_cast<unsigned long long>(take);
    }
    sel[i] = key;
  }
  __syncthreads();
  BitonicSortBlock(sel, sort_n);
  __syncthreads();
  // Prefix offsets of the pages' positions, in page order.
  int32_t take[kPer], off[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = base + u;
    take[u] = i < sort_n && sel[i] != ~0ull ? static_cast<int32_t>(sel[i] & 0xffffffffu) : 0;
  }
  Scan(scan_tmp).ExclusiveSum(take, off);
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    if (base + u < sort_n) offs[base + u] = off[u];
  }
  __syncthreads();
  // One warp per page writes its positions.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = warp; i < sort_n; i += static_cast<int>(blockDim.x >> 5)) {
    const unsigned long long key = sel[i];
    if (key == ~0ull) break;
    const int64_t pg = static_cast<int64_t>(key >> 32);
    const int64_t off = offs[i];
    const int64_t take = static_cast<int64_t>(key & 0xffffffffu);
    const int64_t lo = max(pg * a.meta_page, s.off_lo);
    for (int64_t j = lane; j < take; j += 32) out[s.sinks + off + j] = static_cast<int32_t>(lo + j);
  }
  return min(s.k_off, static_cast<int64_t>(ranked_total));
}

// A CTA per item: group page scores over row g = 0, the best pages, the list (sinks, pages'
// positions ascending, window).
__global__ void __launch_bounds__(kTopKThreads) PagesTopKKernel(DecodeStepArgs a, int64_t mcta_min) {
  extern __shared__ unsigned long long sort_smem[];
  __shared__ float red[kTopKThreads / 32];
  const int32_t item = blockIdx.x;
  if (MctaTakes(a, item, mcta_min)) return;
  const ListItem li = ListItemOf(a, item);
  if (WriteListHead(a, item, li.s, li.n, li.out)) return;
  const auto& [b, n, s, out] = li;
  const int group = a.params.group;
  int64_t taken = 0;
  if (s.k_off > 0) {
    float* l = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
    // score[p] = max_g (ub_g[p] - max ub_g), into row 0 (each thread owns its p).
    float mx[64];
    for (int g = 0; g < group; ++g) {
      const float* lg = l + static_cast<size_t>(g) * a.select_ld;
      float m = -INFINITY;
      for (int64_t p = threadIdx.x; p < s.np; p += blockDim.x) m = fmaxf(m, lg[p]);
      mx[g] = BlockReduce(m, [](float x, float y) { return fmaxf(x, y); }, red);
    }
    for (int64_t p = threadIdx.x; p < s.np; p += blockDim.x) {
      float sc = -INFINITY;
      for (int g = 0; g < group; ++g) sc = fmaxf(sc, l[static_cast<size_t>(g) * a.select_ld + p] - mx[g]);
      l[p] = sc;
    }
    __syncthreads();
    const int64_t want = PagesWanted(a, s);
    int sort_n = 1;
    while (sort_n < want) sort_n <<= 1;
    unsigned long long* sel = sort_smem;
    TopKSelect(l, s.np, static_cast<int>(want), sort_n, sel);
    taken = TakePages(a, s, sel, reinterpret_cast<int32_t*>(sort_smem + sort_n), sort_n, want,
                           out);
  }
  WriteListTail(a, item, s.sinks, s.off_hi, n, taken, out);
}




// A CTA per item: the top k of the group-summed softmax weights over the item's logits rows.
// kSplit (SparCas): the list is the sinks, the top k_off of the offloaded range, the window;
// layers below dense_layers score every dimension from the compact rows (DenseCompactScoreKernel;
// GQA groups over kDenseThreadMaxGroup: SelectScoreKernel<.., kCompact>). Otherwise (the oracle)
// the top k of every position.
template <bool kSplit>
__global__ void __launch_bounds__(kTopKThreads) WeightsTopKKernel(DecodeStepArgs a, int sort_cap,
                                                                  int64_t mcta_min) {
  extern __shared__ unsigned long long sort_smem[];
  const int32_t item = blockIdx.x;
  if (MctaTakes(a, item, mcta_min)) return;
  const int32_t b = item / a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  ItemSplit sp{};
  if constexpr (kSplit) {
    sp = ItemSplitOf(a, n);
    if (WriteListHead(a, item, sp, n, out)) return;
  } else {  // the whole range is ranked
    sp.off_hi = n;
    sp.k_off = min(StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n), n);
  }
  int64_t taken = 0;
  if (sp.k_off > 0) {
    float* l = a.select_ws + static_cast<size_t>(item) * a.params.group * a.select_ld;
    unsigned long long* sel = sort_cap <= kTopKSmemItems
                                  ? sort_smem
                                  : a.topk_ws + static_cast<size_t>(item) * sort_cap;
    int sort_n = 0;
    GroupWeightsTopK(l, a.select_ld, a.params.group, n, sp.off_lo, sp.off_hi - sp.off_lo, sp.k_off,
                     sel, sort_n);
    for (int64_t i = threadIdx.x; i < sp.k_off; i += blockDim.x) {
      out[sp.sinks + i] = static_cast<int32_t>(sp.off_lo + static_cast<int64_t>(sel[i]));
    }
    taken = sp.k_off;
  }
  if constexpr (kSplit) {
    WriteListTail(a, item, sp.sinks, sp.off_hi, n, taken, out);
  } else if (threadIdx.x == 0) {
    a.list_count[item] = static_cast<int32_t>(taken);
  }
}

// ---- Multi-CTA top-k ----------------------------------------------------------------------------
// The one-CTA kernels above rank an item's n scores with one CTA: 8 CTAs for a batch-1 step of
// 8 KV heads, the rest of the GPU idle (755 us at 128K keys on an H100). These split each item's
// scores over gridDim.y CTAs. Written here rather than with CUB: cub::DeviceTopK gives no tie
// order and a segmented radix sort would sort all n keys (and size its temporary storage per
// call); a radix select needs only histograms. Block-level CUB (scan, reduce) does the in-CTA work.
// Launches, each grid (items, ctas), every per-step value read on the device (capture-safe):
//   1. MctaStats: per CTA and query head the max and sum of exp2(l - max) of its chunk of [0, n)
//      (Quest: the max); CTA 0 zeroes the item's histograms.
//   2. MctaWeights: combines the partials (online softmax), writes the group's summed weight
//      (Quest: max_g (ub_g - max ub_g)) over row 0 for the ranked range, and adds the top byte of
//      each weight's OrderedKey to histogram 0 (global atomics, once per bin per CTA).
//   3. MctaRadix x 3: each CTA re-derives the prefix from the histograms so far (a 256-bin scan)
//      and adds the next byte of the keys under it to the next histogram.
//   4. MctaCount: the k-th largest key T is known; per CTA the keys > T and == T of its chunk.
//   5. MctaWrite: per CTA its offset from the counts of the chunks before it; an ordered pass writes
//      every key > T and the first (by position) keys == T, so the list comes out ascending with
//      the ties of TopKSelect (value descending, lower position first, NaN as -inf). Quest writes
//      its winning pages to the scratch and MctaQuestList (a CTA per item, at most
//      kSelectMctaMaxPicks pages) sorts them by score and walks them as PagesTopKKernel does.
// The fused kernel (one cooperative launch, a barrier among an item's CTAs between passes) replaces
// 3-5 there: its weights pass histograms the top 12 bits of the keys (4096 bins) instead of 8; when
// the bucket of the k-th key holds at most kSelectMctaCandCap keys (the usual case: fine-grained
// weights), each CTA lists its keys of that bucket with their positions and counts its keys above
// it (one barrier), and every CTA then finds the last 20 bits of T from the list in shared memory
// and its output offset from the counts and the list, and writes its chunk: three barriers after
// the statistics instead of six. A crowded bucket (heavy ties) takes 8, 8 and 4 more bits by
// histograms, then the count and the write, as the per-pass launches.
// The softmax sum is added in another order than the one-CTA kernel's, so the weights can differ
// from it in the last bit: lists differ only where two weights are within that of each other at
// the k-th place (as the host backend's lists already may).

constexpr int kMctaThreads = 512;
// Dynamic shared memory above which a Quest list kernel opts in to more (static + dynamic must
// stay under 48 KiB otherwise).
constexpr size_t kPagesSmemOptIn = 40 * 1024;

// An item's multi-CTA scratch (SelectMctaItemWords words).
// This CTA's chunk [begin, end) of [0, count): whole tiles of positions, so that every warp of a
// tile loop runs the same iterations (the warp-aggregated histograms need full warps). A tile is
// kMctaVec consecutive positions a thread, kMctaVec * blockDim.x in all: a thread issues its
// kMctaVec loads together (the passes are latency-bound, each CTA reads a few KiB) and the ordered
// write needs one pair of block scans a tile, not one a key.
constexpr int kMctaVec = 4;
struct Chunk {
  int64_t begin, end, tiles_end;  // tiles_end: begin + whole tiles covering [begin, end)
};

__device__ __forceinline__ Chunk ChunkOf(int64_t count) {
  const int64_t per = (count + gridDim.y - 1) / gridDim.y;
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kMctaVec;
  const int64_t chunk = (per + tile - 1) / tile * tile;
  Chunk c;
  c.begin = min(static_cast<int64_t>(blockIdx.y) * chunk, count);
  c.end = min(c.begin + chunk, count);
  c.tiles_end = c.begin + (c.end - c.begin + tile - 1) / tile * tile;
  return c;
}

// Thread t's positions of the tile at j0: j0 + kMctaVec t + u, u < kMctaVec (consecutive threads
// hold consecutive positions, so position order is thread order).
__device__ __forceinline__ int64_t TileFirst(int64_t j0) {
  return j0 + static_cast<int64_t>(threadIdx.x) * kMctaVec;
}

// Thread's kMctaVec values of the tile at jt = TileFirst(j0): row[jt + u], or `fill` past `end`
// (the loads issued together). Row: a pointer or a WeightRow.
template <typename Row>
__device__ __forceinline__ void LoadTile(const Row& row, int64_t jt, int64_t end, float fill,
                                         float (&x)[kMctaVec]) {
#pragma unroll
  for (int u = 0; u < kMctaVec; ++u) x[u] = jt + u < end ? row[jt + u] : fill;
}

// The radix state after `passes` histograms of an item ranking its k largest keys: the key bits
// found so far (prefix, under mask) and how many keys equal to the prefix there remain to take.
// Every thread of a kMctaThreads CTA calls it; as TopKSelect's digit search, in parallel.
struct RadixState {
  uint32_t prefix = 0, mask = 0, remaining = 0;
};

// One digit of the select: of the NB bins of hist (the digit at bits [shift, shift + log2 NB) of
// the keys under r's prefix), the digit where the count from the top first reaches r.remaining
// (digit 0 when none does before it, as TopKSelect's loop ends); r takes it. Returns that bin's
// count. Every thread of a kMctaThreads CTA calls it (thread t holds digits NB - 1 - t * per - i,
// i < per, a block scan ranks them from the top); synchronises before returning. kGlobal: hist is
// the item's scratch, filled by other CTAs' atomics in L2 (read past L1).
template <int NB, bool kGlobal>
__device__ uint32_t DigitStep(const uint32_t* hist, int shift, RadixState& r) {
  constexpr int kPer = NB > kMctaThreads ? NB / kMctaThreads : 1;
  static_assert(NB <= kMctaThreads || NB % kMctaThreads == 0);
  using Scan = cub::BlockScan<uint32_t, kMctaThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ uint32_t s_digit, s_above, s_count;
  const int t = threadIdx.x;
  uint32_t h[kPer], sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = NB - 1 - (t * kPer + i);
    h[i] = d < 0 ? 0u : kGlobal ? __ldcg(hist + d) : hist[d];
    sum += h[i];
  }
  uint32_t above = 0;
  Scan(scan_tmp).ExclusiveSum(sum, above);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = NB - 1 - (t * kPer + i);
    if (d >= 0 && above < r.remaining && (above + h[i] >= r.remaining || d == 0)) {
      s_digit = static_cast<uint32_t>(d);
      s_above = above;
      s_count = h[i];
    }
    above += h[i];
  }
  __syncthreads();
  r.prefix |= s_digit << shift;
  r.mask |= static_cast<uint32_t>(NB - 1) << shift;
  r.remaining -= s_above;
  const uint32_t count = s_count;
  __syncthreads();  // the s_* and scan_tmp are rewritten by the next step
  return count;
}

// The state after the first `passes` 8-bit histograms of hist (the per-pass kernels' radix).
__device__ RadixState MctaPrefix(const uint32_t* hist, int passes, int64_t k) {
  RadixState r;
  r.remaining = static_cast<uint32_t>(k);
  for (int p = 0; p < passes; ++p) DigitStep<256, true>(hist + p * 256, 24 - 8 * p, r);
  return r;
}

// Adds bins[0, nb) of the CTA to the item's histogram (the bins this CTA saw only).
__device__ __forceinline__ void FlushHistogram(const unsigned int* bins, uint32_t* global, int nb = 256) {
  __syncthreads();
  for (int i = threadIdx.x; i < nb; i += blockDim.x) {
    if (bins[i] != 0) atomicAdd(global + i, bins[i]);
  }
}

// Counts key's bin (key >> shift & dmask) into bins when `in`, one atomic per bin per warp (keys
// of one row share their high bits). Every lane of the warp calls.
__device__ __forceinline__ void CountBin(unsigned int* bins, uint32_t key, int shift, bool in,
                                         uint32_t dmask = 0xffu) {
  const uint32_t bin = in ? (key >> shift) & dmask : 0xffffffffu;
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  if (in && static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1) {
    atomicAdd(&bins[bin], static_cast<unsigned>(__popc(peers)));
  }
}

// One read of the chunk for up to kStatsHeads query heads at a time: each thread keeps a running
// (max, sum) per head (Quest: the max), then one reduction for those heads (warp shuffles, a row
// of shared memory per warp). The sum is the online softmax's, so it may differ from a two-pass
// sum in its last bits (as the one-CTA kernel's order already does).
constexpr int kStatsHeads = 4;

// An item's row of weights as a pass reads it: position j (of the ranked range, 0 at it.lo) at
// p[j - base]. The per-pass kernels read row 0 of the item's workspace (base 0); the fused kernel
// reads its chunk from shared memory (base = the chunk's first position).
struct WeightRow {
  float* p;
  int64_t base;
  __device__ __forceinline__ float& operator[](int64_t j) const { return p[j - base]; }
};

// The passes' bodies: every thread of a kMctaThreads CTA of an item with it.mcta calls them, the
// per-pass kernels below once each, the fused kernel all of them between grid barriers.

// 1. Per query head the (max, sum of exp2(l - max)) of this CTA's chunk of [0, it.n) (Quest: the
// max) into ws.stats; CTA 0 zeroes the item's histograms.
template <bool kPaged>
__device__ void MctaStatsPass(const DecodeStepArgs& a, const TopKItem& it, const MctaScratch& ws) {
  const int32_t item = blockIdx.x;
  if (blockIdx.y == 0) MctaZeroHistograms(ws);
  const Chunk c = ChunkOf(it.n);
  const int group = a.params.group;
  const float* l = a.select_ws + static_cast<size_t>(item) * group * a.select_ld;
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kMctaVec;
  for (int g0 = 0; g0 < group; g0 += kStatsHeads) {
    float m[kStatsHeads], s[kStatsHeads];
#pragma unroll
    for (int gg = 0; gg < kStatsHeads; ++gg) {
      m[gg] = -INFINITY;
      s[gg] = 0.0f;
    }
    for (int64_t j0 = c.begin; j0 < c.end; j0 += tile) {
      const int64_t jt = TileFirst(j0);
      float v[kStatsHeads][kMctaVec];
#pragma unroll
      for (int gg = 0; gg < kStatsHeads; ++gg) {
        // Heads past the group read nothing (an end of 0).
        LoadTile(l + static_cast<size_t>(g0 + gg) * a.select_ld, jt, g0 + gg < group ? c.end : 0,
                 -INFINITY, v[gg]);
      }
#pragma unroll
      for (int gg = 0; gg < kStatsHeads; ++gg) {
#pragma unroll
        for (int u = 0; u < kMctaVec; ++u) {
          if (kPaged) {
            m[gg] = fmaxf(m[gg], v[gg][u]);
          } else {
            SoftmaxAdd(m[gg], s[gg], v[gg][u]);
          }
        }
      }
    }
    WriteSoftmaxPartials<kMctaThreads, kStatsHeads, kPaged>(m, s, g0, group, ws.stats);
  }
}

// 2. Combines the `parts` partials of each head (the statistics pass's, one a CTA, or the scoring
// kernel's), writes the group's summed weight (Quest: max_g (ub_g - max ub_g)) of this CTA's
// chunk of the ranked range into w (and into `also` when not null), and adds the top kBits bits of
// each weight's OrderedKey to `hist` (8: histogram 0 of the radix passes; 12: the fused kernel's
// hist12), counted first in `bins` (shared memory, 2^kBits of them).
template <bool kPaged, int kBits>
__device__ void MctaWeightsPass(const DecodeStepArgs& a, const TopKItem& it, WeightRow w, float* also,
                                int parts, const MctaScratch& ws, unsigned int* bins, uint32_t* hist) {
  using Reduce = cub::BlockReduce<float, kMctaThreads>;
  __shared__ typename Reduce::TempStorage red_tmp;
  __shared__ float m_s[64], inv_s[64];
  constexpr int kBins = 1 << kBits;
  const int32_t item = blockIdx.x;
  const int group = a.params.group;
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) bins[i] = 0;
  // Per head, the max of the partial maxima, then the sum of the partial sums rescaled to it: a
  // thread a partial (up to kSelectMctaStatsSlots of them), two block reductions.
  for (int g = 0; g < group; ++g) {
    const float2* st = ws.stats + g * kSelectMctaStatsSlots;
    float m = -INFINITY;
    for (int y = threadIdx.x; y < parts; y += blockDim.x) m = fmaxf(m, st[y].x);
    m = Reduce(red_tmp).Reduce(m, FMaxOp{});
    if (threadIdx.x == 0) m_s[g] = m;
    __syncthreads();  // m_s[g] visible; red_tmp free again
    float s = 0.0f;
    if (!kPaged) {
      m = m_s[g];
      for (int y = threadIdx.x; y < parts; y += blockDim.x) {
        if (st[y].x != -INFINITY) s += st[y].y * exp2f(st[y].x - m);
      }
      s = Reduce(red_tmp).Sum(s);
    }
    if (threadIdx.x == 0) inv_s[g] = 1.0f / s;  // Quest: unused
    __syncthreads();
  }
  const Chunk c = ChunkOf(it.count);
  const float* l = a.select_ws + static_cast<size_t>(item) * group * a.select_ld + it.lo;
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kMctaVec;
  for (int64_t j0 = c.begin; j0 < c.tiles_end; j0 += tile) {
    const int64_t jt = TileFirst(j0);
    float wt[kMctaVec];
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) wt[u] = kPaged ? -INFINITY : 0.0f;
#pragma unroll 4
    for (int g = 0; g < group; ++g) {
      const float* lg = l + static_cast<size_t>(g) * a.select_ld;
      float x[kMctaVec];
      LoadTile(lg, jt, c.end, 0.0f, x);
#pragma unroll
      for (int u = 0; u < kMctaVec; ++u) {
        if (kPaged) {
          wt[u] = fmaxf(wt[u], x[u] - m_s[g]);
        } else {
          wt[u] += exp2f(x[u] - m_s[g]) * inv_s[g];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) {
      const bool in = jt + u < c.end;
      // Row 0 of the workspace: only this thread reads position j of any row in this pass.
      if (in) {
        w[jt + u] = wt[u];
        if (also != nullptr) also[jt + u] = wt[u];
      }
      CountBin(bins, in ? OrderedKey(wt[u]) : 0u, 32 - kBits, in, kBins - 1);
    }
  }
  FlushHistogram(bins, hist, kBins);
}

// f(j, in, key) for each position j of the chunk's whole tiles in tile order, key the OrderedKey
// of w[j] (in: j < c.end); every lane of every warp calls f.
template <typename F>
__device__ __forceinline__ void ForEachTileKey(const WeightRow& w, const Chunk& c, F&& f) {
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kMctaVec;
  for (int64_t j0 = c.begin; j0 < c.tiles_end; j0 += tile) {
    const int64_t jt = TileFirst(j0);
    float x[kMctaVec];
    LoadTile(w, jt, c.end, 0.0f, x);
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) f(jt + u, jt + u < c.end, OrderedKey(x[u]));
  }
}

// 3. Adds the digit (key >> shift & dmask) of this CTA's keys under r's prefix to `hist`, counted
// first in `bins` (shared memory, zero on entry, dmask + 1 of them).
__device__ void MctaDigitPass(const TopKItem& it, WeightRow w, const RadixState& r, int shift, uint32_t dmask,
                              unsigned int* bins, uint32_t* hist) {
  ForEachTileKey(w, ChunkOf(it.count), [&](int64_t, bool in, uint32_t key) {
    CountBin(bins, key, shift, in && (key & r.mask) == r.prefix, dmask);
  });
  FlushHistogram(bins, hist, static_cast<int>(dmask) + 1);
}

// 3 (per-pass kernels). Re-derives the prefix from histograms [0, pass) and adds the next byte of
// the keys under it to histogram `pass`.
__device__ void MctaRadixPass(const TopKItem& it, const MctaScratch& ws, WeightRow w, int pass) {
  __shared__ unsigned int bins[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) bins[i] = 0;
  const RadixState r = MctaPrefix(ws.hist, pass, it.k);  // synchronises: bins are zero
  MctaDigitPass(it, w, r, 24 - 8 * pass, 0xffu, bins, ws.hist + pass * 256);
}

// 4. The k-th largest key T = r.prefix is known: this CTA's keys > T and == T into ws.counts.
__device__ void MctaCountPass(const TopKItem& it, const MctaScratch& ws, WeightRow w, const RadixState& r) {
  using Reduce = cub::BlockReduce<int, kMctaThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  int gt = 0, eq = 0;
  ForEachTileKey(w, ChunkOf(it.count), [&](int64_t, bool in, uint32_t key) {
    gt += in && key > r.prefix;
    eq += in && key == r.prefix;
  });
  gt = Reduce(tmp).Sum(gt);
  __syncthreads();
  eq = Reduce(tmp).Sum(eq);
  if (threadIdx.x == 0) {
    ws.counts[2 * blockIdx.y] = gt;
    ws.counts[2 * blockIdx.y + 1] = eq;
  }
}

// 5. The ordered pass of this CTA's chunk: writes every key > T and, of the keys == T, those
// whose rank among all of them (by position) is below `remaining`; out_base entries of the
// selection and eq_base keys == T come before the chunk. CTA 0 also writes the rest of a SparCas
// list (sinks, window, count).
template <bool kPaged>
__device__ void MctaWriteChunk(const DecodeStepArgs& a, const TopKItem& it, const MctaScratch& ws,
                               WeightRow w, uint32_t T, int64_t remaining, int64_t out_base,
                               int64_t eq_base) {
  using Scan = cub::BlockScan<int, kMctaThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int32_t item = blockIdx.x;
  const RadixState r{T, 0xffffffffu, static_cast<uint32_t>(remaining)};
  const int32_t b = item / a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  int64_t sinks = 0, off_hi = n;
  if (!kPaged && a.ranks == SelectRanks::kOffloaded) {
    const ItemSplit sp = ItemSplitOf(a, n);
    sinks = sp.sinks;
    off_hi = sp.off_hi;
  }
  int32_t* list = a.list + static_cast<size_t>(item) * a.list_cap;
  const Chunk c = ChunkOf(it.count);
  const int64_t tile = static_cast<int64_t>(blockDim.x) * kMctaVec;
  for (int64_t j0 = c.begin; j0 < c.end; j0 += tile) {
    const int64_t jt = TileFirst(j0);
    float x[kMctaVec];
    LoadTile(w, jt, c.end, 0.0f, x);
    uint32_t key[kMctaVec];
    int eq = 0;
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) {
      key[u] = jt + u < c.end ? OrderedKey(x[u]) : 0u;
      eq += jt + u < c.end && key[u] == r.prefix;
    }
    int eq_rank = 0, eq_total = 0;
    Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_total);
    // Position order is (thread, u) order: this thread's keys == T come after eq_rank others.
    unsigned sel_mask = 0;
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) {
      const bool in = jt + u < c.end;
      if (in && key[u] > r.prefix) {
        sel_mask |= 1u << u;
      } else if (in && key[u] == r.prefix) {
        if (eq_base + eq_rank < remaining) sel_mask |= 1u << u;
        ++eq_rank;
      }
    }
    int rank = 0, sel_total = 0;
    __syncthreads();
    Scan(scan_tmp).ExclusiveSum(__popc(sel_mask), rank, sel_total);
#pragma unroll
    for (int u = 0; u < kMctaVec; ++u) {
      if (sel_mask & (1u << u)) {
        const int64_t j = jt + u;
        if (kPaged) {
          ws.picks[out_base + rank] = static_cast<int32_t>(j);
        } else {
          list[sinks + out_base + rank] = static_cast<int32_t>(it.lo + j);
        }
        ++rank;
      }
    }
    out_base += sel_total;
    eq_base += eq_total;
    __syncthreads();
  }
  if constexpr (!kPaged) {
    if (blockIdx.y != 0) return;
    // CTA 0 writes the rest of the list: SparCas's sinks and window, and the count.
    for (int64_t i = threadIdx.x; i < sinks; i += blockDim.x) list[i] = static_cast<int32_t>(i);
    WriteListTail(a, item, sinks, off_hi, n, it.k, list);
  }
}

// 5. This CTA's offset from the counts of the chunks before it, then its ordered pass.
template <bool kPaged>
__device__ void MctaWritePass(const DecodeStepArgs& a, const TopKItem& it, const MctaScratch& ws,
                              WeightRow w, const RadixState& r) {
  __shared__ int64_t s_out, s_eq;
  const int64_t remaining = r.remaining;
  // Selected before this chunk: every key > T of the chunks before it, and of their keys == T
  // the first `remaining` in position order.
  if (threadIdx.x == 0) {
    int64_t out = 0, eq = 0;
    for (unsigned y = 0; y < blockIdx.y; ++y) {
      const int64_t e = ws.counts[2 * y + 1];
      out += ws.counts[2 * y] + max(int64_t{0}, min(e, remaining - eq));
      eq += e;
    }
    s_out = out;
    s_eq = eq;
  }
  __syncthreads();
  MctaWriteChunk<kPaged>(a, it, ws, w, r.prefix, remaining, s_out, s_eq);
}

// The fused kernel's candidate finish, when the bucket of the k-th key (its top 12 bits found,
// state r) holds at most kSelectMctaCandCap keys.
// a. Each CTA lists its keys in the bucket (key, position) in ws.cand (a warp's lanes take their
//    slots with one atomic) and counts its keys above the bucket into ws.counts.
__device__ void MctaCandidatePass(const TopKItem& it, const MctaScratch& ws, WeightRow w,
                                  const RadixState& r) {
  using Reduce = cub::BlockReduce<int, kMctaThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int lane = threadIdx.x & 31;
  int gt = 0;
  ForEachTileKey(w, ChunkOf(it.count), [&](int64_t j, bool in, uint32_t key) {
    gt += in && (key & r.mask) > r.prefix;
    const bool cand = in && (key & r.mask) == r.prefix;
    const unsigned ballot = __ballot_sync(0xffffffffu, cand);
    if (ballot != 0) {
      const int leader = __ffs(ballot) - 1;
      unsigned base = 0;
      if (lane == leader) base = atomicAdd(ws.cand_count, static_cast<unsigned>(__popc(ballot)));
      base = __shfl_sync(0xffffffffu, base, leader);
      if (cand) {
        ws.cand[base + __popc(ballot & ((1u << lane) - 1u))] = make_uint2(key, static_cast<uint32_t>(j));
      }
    }
  });
  gt = Reduce(tmp).Sum(gt);
  if (threadIdx.x == 0) ws.counts[2 * blockIdx.y] = gt;
}

// b. Every CTA: the list into shared memory (cand_s), the last 20 bits of T by three digit steps
//    over it (8, 8 and 4 bits), this CTA's offset (the keys above the bucket of the chunks before
//    it, and the listed keys before its chunk that are taken), then its ordered pass.
template <bool kPaged>
__device__ void MctaCandidateFinish(const DecodeStepArgs& a, const TopKItem& it, const MctaScratch& ws,
                                    WeightRow w, RadixState r, uint2* cand_s) {
  using Reduce = cub::BlockReduce<int, kMctaThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ uint32_t bins[256];
  __shared__ int64_t s_out, s_eq;
  const int nc = static_cast<int>(__ldcg(ws.cand_count));
  for (int i = threadIdx.x; i < nc; i += blockDim.x) cand_s[i] = __ldcg(ws.cand + i);
  for (int step = 0; step < 3; ++step) {
    const int shift = step == 0 ? 12 : step == 1 ? 4 : 0;
    const uint32_t dmask = step < 2 ? 0xffu : 0xfu;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) bins[i] = 0;
    __syncthreads();  // (and the list is in shared memory)
    for (int i = threadIdx.x; i < nc; i += blockDim.x) {
      const uint32_t key = cand_s[i].x;
      if ((key & r.mask) == r.prefix) atomicAdd(&bins[(key >> shift) & dmask], 1u);
    }
    __syncthreads();
    if (step < 2) {
      DigitStep<256, false>(bins, shift, r);
    } else {
      DigitStep<16, false>(bins, shift, r);
    }
  }
  const uint32_t T = r.prefix;
  const int64_t remaining = r.remaining;
  const int64_t begin = ChunkOf(it.count).begin;
  int gt = 0, eq = 0;
  for (int i = threadIdx.x; i < nc; i += blockDim.x) {
    const uint2 e = cand_s[i];
    if (e.y < begin) {
      gt += e.x > T;
      eq += e.x == T;
    }
  }
  gt = Reduce(tmp).Sum(gt);
  __syncthreads();
  eq = Reduce(tmp).Sum(eq);
  if (threadIdx.x == 0) {
    int64_t out = gt + min(int64_t{eq}, remaining);
    for (unsigned y = 0; y < blockIdx.y; ++y) out += ws.counts[2 * y];
    s_out = out;
    s_eq = eq;
  }
  __syncthreads();
  MctaWriteChunk<kPaged>(a, it, ws, w, T, remaining, s_out, s_eq);
}

__device__ __forceinline__ WeightRow Row0Of(const DecodeStepArgs& a, const TopKItem& it) {
  return WeightRow{a.select_ws + static_cast<size_t>(blockIdx.x) * a.params.group * a.select_ld + it.lo, 0};
}

// The per-pass kernels: one launch a pass, the weights in row 0 of the workspace.
template <bool kPaged>
__global__ void __launch_bounds__(kMctaThreads) MctaStatsKernel(DecodeStepArgs a, int64_t mcta_min) {
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (it.mcta) MctaStatsPass<kPaged>(a, it, MctaScratchOf(a, blockIdx.x));
}

template <bool kPaged>
__global__ void __launch_bounds__(kMctaThreads) MctaWeightsKernel(DecodeStepArgs a, int64_t mcta_min,
                                                                  int parts) {
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  __shared__ unsigned int bins[256];
  const MctaScratch ws = MctaScratchOf(a, blockIdx.x);
  if (it.mcta) MctaWeightsPass<kPaged, 8>(a, it, Row0Of(a, it), nullptr, parts, ws, bins, ws.hist);
}

__global__ void __launch_bounds__(kMctaThreads) MctaRadixKernel(DecodeStepArgs a, int64_t mcta_min,
                                                                int pass) {
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (it.mcta) MctaRadixPass(it, MctaScratchOf(a, blockIdx.x), Row0Of(a, it), pass);
}

__global__ void __launch_bounds__(kMctaThreads) MctaCountKernel(DecodeStepArgs a, int64_t mcta_min) {
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (!it.mcta) return;
  const MctaScratch ws = MctaScratchOf(a, blockIdx.x);
  MctaCountPass(it, ws, Row0Of(a, it), MctaPrefix(ws.hist, 4, it.k));
}

template <bool kPaged>
__global__ void __launch_bounds__(kMctaThreads) MctaWriteKernel(DecodeStepArgs a, int64_t mcta_min) {
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (!it.mcta) return;
  const MctaScratch ws = MctaScratchOf(a, blockIdx.x);
  MctaWritePass<kPaged>(a, it, ws, Row0Of(a, it), MctaPrefix(ws.hist, 4, it.k));
}

// The fused kernel's barrier among an item's CTAs: barrier i (from 1) of a launch waits until
// the counter, zeroed by the one-CTA kernel before this launch, reaches i * gridDim.y. Thread 0
// of each CTA arrives (release, after the CTA's writes) and spins (acquire); the CTA's other
// threads wait at __syncthreads. Spinning is safe because the launch is cooperative: every CTA of
// the grid is resident.
__device__ __forceinline__ void ItemBarrier(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_device> c(*counter);
    c.fetch_add(1u, ::cuda::memory_order_release);
    while (c.load(::cuda::memory_order_acquire) < target) {
    }
  }
  __syncthreads();
}

// The fused top-k: the passes in one cooperative launch, a barrier among the item's CTAs between
// them (items do not wait for each other), each CTA's chunk of weights kept in shared memory from
// the weights pass on (the later passes read no global memory but the histograms, counts and
// candidates); the candidate finish where the k-th key's 12-bit bucket is small (see above). CTAs of items the one-CTA kernel takes return at once. Quest also writes its weights to
// row 0, where MctaQuestList reads its winners' scores. stats_parts > 0: the scoring kernel left
// that many partial statistics a head and zeroed the histograms, so the statistics pass and its
// barrier are skipped.
template <bool kPaged>
__global__ void __launch_bounds__(kMctaThreads, 2) MctaFusedKernel(DecodeStepArgs a, int64_t mcta_min,
                                                                   int stats_parts) {
  extern __shared__ float fused_w[];
  const TopKItem it = TopKItemOf(a, blockIdx.x, mcta_min);
  if (!it.mcta) return;
  const MctaScratch ws = MctaScratchOf(a, blockIdx.x);
  unsigned* bar = MctaBarrierOf(a, blockIdx.x);
  unsigned arrivals = 0;
  const WeightRow w{fused_w, ChunkOf(it.count).begin};
  if (kPaged) stats_parts = 0;  // Quest's bounds have no statistics from their scoring
  if (stats_parts == 0) {
    MctaStatsPass<kPaged>(a, it, ws);
    ItemBarrier(bar, arrivals += gridDim.y);
  }
  // The 12-bit bins of the weights pass, later the candidate list (16 KiB either way).
  __shared__ uint2 cand_s[kSelectMctaCandCap];
  static_assert(sizeof(cand_s) == sizeof(uint32_t) << kSelectMctaBucketBits);
  unsigned int* bins = reinterpret_cast<unsigned int*>(cand_s);
  MctaWeightsPass<kPaged, kSelectMctaBucketBits>(a, it, w, kPaged ? Row0Of(a, it).p : nullptr,
                                                 stats_parts == 0 ? static_cast<int>(gridDim.y) : stats_parts,
                                                 ws, bins, ws.hist12);
  ItemBarrier(bar, arrivals += gridDim.y);
  RadixState r;
  r.remaining = static_cast<uint32_t>(it.k);
  const uint32_t bucket = DigitStep<1 << kSelectMctaBucketBits, true>(ws.hist12, 32 - kSelectMctaBucketBits, r);
  if (bucket <= static_cast<uint32_t>(kSelectMctaCandCap)) {
    MctaCandidatePass(it, ws, w, r);
    ItemBarrier(bar, arrivals += gridDim.y);
    MctaCandidateFinish<kPaged>(a, it, ws, w, r, cand_s);
    return;
  }
  // A crowded bucket: 8, 8 and 4 more bits by histograms over the item's CTAs.
  for (int pass = 1; pass < 4; ++pass) {
    const int shift = pass < 3 ? 20 - 8 * pass : 0;
    const uint32_t dmask = pass < 3 ? 0xffu : 0xfu;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) bins[i] = 0;
    __syncthreads();
    MctaDigitPass(it, w, r, shift, dmask, bins, ws.hist + pass * 256);
    ItemBarrier(bar, arrivals += gridDim.y);
    if (pass < 3) {
      DigitStep<256, true>(ws.hist + pass * 256, shift, r);
    } else {
      DigitStep<16, true>(ws.hist + pass * 256, shift, r);
    }
  }
  MctaCountPass(it, ws, w, r);
  ItemBarrier(bar, arrivals += gridDim.y);
  MctaWritePass<kPaged>(a, it, ws, w, r);
}

// A CTA per item: the multi-CTA Quest winners (ascending pages in the scratch) ranked by score,
// then walked into the list as PagesTopKKernel does.
__global__ void __launch_bounds__(kTopKThreads) MctaPagesListKernel(DecodeStepArgs a, int64_t mcta_min) {
  extern __shared__ unsigned long long sort_smem[];
  const int32_t item = blockIdx.x;
  const TopKItem it = TopKItemOf(a, item, mcta_min);
  if (!it.mcta) return;
  const MctaScratch ws = MctaScratchOf(a, item);
  const int32_t b = item / a.num_kv_heads;
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const ItemSplit s = ItemSplitOf(a, n);
  const float* l = a.select_ws + static_cast<size_t>(item) * a.params.group * a.select_ld;
  int sort_n = 1;
  while (sort_n < it.k) sort_n <<= 1;
  unsigned long long* sel = sort_smem;
  for (int i = threadIdx.x; i < sort_n; i += blockDim.x) {
    unsigned long long key = ~0ull;
    if (i < it.k) {
      const int32_t p = ws.picks[i];
      key = (static_cast<unsigned long long>(~OrderedKey(l[p])) << 32) | static_cast<uint32_t>(p);
    }
    sel[i] = key;
  }
  BitonicSortBlock(sel, sort_n);
  int32_t* out = a.list + static_cast<size_t>(item) * a.list_cap;
  for (int64_t i = threadIdx.x; i < s.sinks; i += blockDim.x) out[i] = static_cast<int32_t>(i);
  const int64_t taken = TakePages(a, s, sel, reinterpret_cast<int32_t*>(sort_smem + sort_n),
                                       sort_n, it.k, out);
  WriteListTail(a, item, s.sinks, s.off_hi, n, taken, out);
}

// Most dynamic shared memory a fused CTA takes for its chunk of weights (two CTAs an SM).
constexpr size_t kMctaFusedMaxSmem = 96 * 1024;

// Bytes of the fused kernel's chunk for items of up to keys_cap scores over ctas CTAs each (the
// largest chunk ChunkOf can give).
size_t MctaFusedSmem(int64_t keys_cap, unsigned ctas) {
  const int64_t tile = int64_t{kMctaThreads} * kMctaVec;
  const int64_t per = (keys_cap + ctas - 1) / ctas;
  return static_cast<size_t>((per + tile - 1) / tile * tile) * sizeof(float);
}

// Launches the fused top-k when its grid can be co-resident on this device (cooperative launch,
// capturable in a CUDA graph); *launched says whether it did (when not, the per-pass launches run).
template <bool kPaged>
Status LaunchMctaFused(const DecodeStepArgs& a, int64_t mcta_min, dim3 grid, int64_t keys_cap,
                       int stats_parts, cudaStream_t stream, bool* launched) {
  *launched = false;
  const size_t smem = MctaFusedSmem(keys_cap, grid.y);
  if (smem > kMctaFusedMaxSmem) return Status::Ok();
  // Co-residency of this grid on the current device, cached for the last (device, smem) asked.
  struct Fit {
    int device = -1;
    size_t smem = 0;
    int64_t blocks = 0;  // CTAs the device holds at once, 0 without cooperative launch
  };
  thread_local Fit fit[2];
  Fit& f = fit[kPaged ? 1 : 0];
  int device = 0;
  KVF_CUDA_CHECK(cudaGetDevice(&device));
  if (f.device != device || f.smem != smem) {
    int coop = 0, sms = 0, per_sm = 0;
    KVF_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device));
    KVF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    KVF_CUDA_CHECK(cudaFuncSetAttribute(MctaFusedKernel<kPaged>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kMctaFusedMaxSmem)));
    KVF_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, MctaFusedKernel<kPaged>,
                                                                 kMctaThreads, smem));
    f.device = device;
    f.smem = smem;
    f.blocks = coop != 0 ? int64_t{per_sm} * sms : 0;
  }
  if (int64_t{grid.x} * grid.y > f.blocks) return Status::Ok();
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kMctaThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  KVF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, MctaFusedKernel<kPaged>, a, mcta_min, stats_parts));
  *launched = true;
  return Status::Ok();
}

// The multi-CTA launches of an item set (see above); ctas CTAs per item of up to keys_cap scores:
// the fused kernel when it fits, else one launch a pass. stats_parts > 0 (not Quest): the scoring
// kernel wrote the statistics and zeroed the histograms (no statistics pass).
Status LaunchMctaTopK(const DecodeStepArgs& a, int64_t mcta_min, unsigned ctas, int64_t keys_cap,
                      size_t pages_smem, bool allow_fused, int stats_parts, cudaStream_t stream) {
  const unsigned items = static_cast<unsigned>(int64_t{a.batch} * a.num_kv_heads);
  const dim3 grid(items, ctas);
  const bool paged = a.ranks == SelectRanks::kPages;
  bool fused = false;
  if (allow_fused && paged) {
    KVF_RETURN_IF_ERROR(LaunchMctaFused<true>(a, mcta_min, grid, keys_cap, 0, stream, &fused));
  } else if (allow_fused) {
    KVF_RETURN_IF_ERROR(LaunchMctaFused<false>(a, mcta_min, grid, keys_cap, stats_parts, stream, &fused));
  }
  if (!fused) {
    if (paged) {
      MctaStatsKernel<true><<<grid, kMctaThreads, 0, stream>>>(a, mcta_min);
      KVF_CUDA_CHECK_LAUNCH(MctaStatsKernel);
      MctaWeightsKernel<true><<<grid, kMctaThreads, 0, stream>>>(a, mcta_min, static_cast<int>(ctas));
      KVF_CUDA_CHECK_LAUNCH(MctaWeightsKernel);
    } else {
      if (stats_parts == 0) {
        MctaStatsKernel<false><<<grid, kMctaThreads, 0, stream>>>(a, mcta_min);
        KVF_CUDA_CHECK_LAUNCH(MctaStatsKernel);
      }
      MctaWeightsKernel<false><<<grid, kMctaThreads, 0, stream>>>(
          a, mcta_min, stats_parts == 0 ? static_cast<int>(ctas) : stats_parts);
      KVF_CUDA_CHECK_LAUNCH(MctaWeightsKernel);
    }
    for (int pass = 1; pass < 4; ++pass) {
      MctaRadixKernel<<<grid, kMctaThreads, 0, stream>>>(a, mcta_min, pass);
      KVF_CUDA_CHECK_LAUNCH(MctaRadixKernel);
    }
    MctaCountKernel<<<grid, kMctaThreads, 0, stream>>>(a, mcta_min);
    KVF_CUDA_CHECK_LAUNCH(MctaCountKernel);
    if (paged) {
      MctaWriteKernel<true><<<grid, kMctaThreads, 0, stream>>>(a, mcta_min);
      KVF_CUDA_CHECK_LAUNCH(MctaWriteKernel);
    } else {
      MctaWriteKernel<false><<<grid, kMctaThreads, 0, stream>>>(a, mcta_min);
      KVF_CUDA_CHECK_LAUNCH(MctaWriteKernel);
    }
  }
  if (!paged) return Status::Ok();
  if (pages_smem > kPagesSmemOptIn) {
    KVF_CUDA_CHECK(cudaFuncSetAttribute(MctaPagesListKernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(pages_smem)));
  }
  MctaPagesListKernel<<<items, kTopKThreads, pages_smem, stream>>>(a, mcta_min);
  KVF_CUDA_CHECK_LAUNCH(MctaPagesListKernel);
  return Status::Ok();
}

}  // namespace

Status CheckSelectArgs(const DecodeStepArgs& a) {
  KVF_RETURN_IF_ERROR(CheckAttnShape(a.params));
  KVF_CHECK_ARG(a.ranks == SelectRanks::kPositions || a.ranks == SelectRanks::kPages ||
                    a.ranks == SelectRanks::kOffloaded,
                "DecodeSelect: unknown ranks ", static_cast<int>(a.ranks));
  KVF_CHECK_ARG(a.list != nullptr && a.list_count != nullptr && a.select_ws != nullptr &&
                    a.slots != nullptr && a.positions != nullptr,
                "DecodeSelect: null list, workspace, slots or positions");
  KVF_CHECK_ARG(a.params.group >= 1 && a.params.group <= 64, "DecodeSelect: group ",
                a.params.group, " not in [1, 64]");
  KVF_CHECK_ARG(a.budget_cap >= 1 && a.list_cap >= a.budget_cap && a.budget_cap < (int64_t{1} << 30),
                "DecodeSelect: list_cap ", a.list_cap, " < budget_cap ", a.budget_cap);
  KVF_CHECK_ARG(a.ranks != SelectRanks::kPages || a.meta_page >= 1,
                "DecodeSelect: a page of ", a.meta_page, " tokens");
  return Status::Ok();
}

int64_t SelectSortCap(const DecodeStepArgs& a) {
  const int64_t want = a.ranks == SelectRanks::kPages ? a.budget_cap / a.meta_page + 3
                                                               : a.budget_cap;
  int64_t sort_cap = 1;
  while (sort_cap < want) sort_cap <<= 1;
  return sort_cap;
}


// PrHS's depth window on the finished lists (DecodeStepArgs::hide_fraction): the parallel form of
// base/psaw.h's PsawFilterList, one CTA per item. The list is ascending, so each binary search of
// the host version is a count of a monotone predicate here (__syncthreads_count over the list);
// the refill's cut p* = n - take - s + c, c = #{i : u_i >= take}, u_i = (n - 1 - S[i]) - (s - 1 -
// i) the unselected positions above the i-th kept entry S[i] >= hide_end (u_i is non-increasing).
namespace {

constexpr int kPsawThreads = 256;

__global__ void __launch_bounds__(kPsawThreads) PsawFilterKernel(DecodeStepArgs a) {
  const int64_t item = blockIdx.x;
  const int b = static_cast<int>(item / a.num_kv_heads);
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int64_t sink = min(max(static_cast<int64_t>(a.sink), int64_t{0}), n);
  const int64_t hide_end = static_cast<int64_t>(floor(a.hide_fraction * static_cast<double>(n)));
  if (hide_end <= sink) return;
  int32_t* list = a.list + item * a.list_cap;
  const int64_t count = a.list_count[item];
  const int tid = threadIdx.x;
  // i0 = #{list < sink}, i1 = #{list < hide_end}.
  int64_t i0 = 0, i1 = 0;
  for (int64_t base = 0; base < count; base += kPsawThreads) {
    const int64_t j = base + tid;
    const int32_t v = j < count ? list[j] : INT32_MAX;
    i0 += __syncthreads_count(v < sink);
    i1 += __syncthreads_count(v < hide_end);
  }
  // Compact the suffix [i1, count) down to i0 (chunks: every read before any write of a chunk).
  for (int64_t base = 0; base < count - i1; base += kPsawThreads) {
    const int64_t j = base + tid;
    const int32_t v = j < count - i1 ? list[i1 + j] : 0;
    __syncthreads();
    if (j < count - i1) list[i0 + j] = v;
    __syncthreads();
  }
  const int64_t kept = i0 + (count - i1);
  const int64_t budget = min(StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n), n);
  const int64_t target = min(budget, sink + (n - hide_end));
  int64_t out = kept;
  if (kept < target) {
    const int64_t s = kept - i0;
    const int64_t take = min(target - kept, (n - hide_end) - s);
    if (take > 0) {
      int64_t c = 0;
      for (int64_t base = 0; base < s; base += kPsawThreads) {
        const int64_t i = base + tid;
        const bool pred = i < s && (n - 1 - list[i0 + i]) - (s - 1 - i) >= take;
        c += __syncthreads_count(pred);
      }
      const int64_t p_star = n - take - s + c;
      const int64_t j0 = i0 + c;
      for (int64_t t = tid; t < n - p_star; t += kPsawThreads) {
        list[j0 + t] = static_cast<int32_t>(p_star + t);
      }
      out = j0 + (n - p_star);
      __syncthreads();
    }
    // The sinks not selected, ascending: the host version's step, on one thread.
    if (out < target && tid == 0) out = PsawAddSinks(list, i0, out, sink, target);
  }
  if (tid == 0) a.list_count[item] = static_cast<int32_t>(out);
}

}  // namespace

Status LaunchPsawFilter(const DecodeStepArgs& a, cudaStream_t stream) {
  if (a.hide_fraction <= 0.0) return Status::Ok();
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  PsawFilterKernel<<<static_cast<unsigned>(items), kPsawThreads, 0, stream>>>(a);
  KVF_CUDA_CHECK_LAUNCH(PsawFilterKernel);
  return Status::Ok();
}

Status LaunchSelectTopK(const DecodeStepArgs& a, const LaunchInfo& info, SelectTopKPath path,
                        cudaStream_t stream, int32_t stats_parts) {
  if (a.batch == 0 || a.ranks == SelectRanks::kNone) return Status::Ok();
  KVF_RETURN_IF_ERROR(CheckSelectArgs(a));
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  const bool paged = a.ranks == SelectRanks::kPages;
  const int64_t sort_cap = SelectSortCap(a);
  if (paged) {
    KVF_CHECK_ARG(sort_cap <= kTopKSmemItems, "DecodeSelect: a page-ranked budget ", a.budget_cap,
                  " over ", kTopKSmemItems, " pages of ", a.meta_page);
  } else {
    KVF_CHECK_ARG(sort_cap <= kTopKSmemItems || a.topk_ws != nullptr,
                  "DecodeSelect: budget_cap ", a.budget_cap, " needs a top-k workspace");
  }
  // Scores an item ranks at most: positions, or Quest's pages.
  const int64_t keys_cap = paged ? (a.select_ld + a.meta_page - 1) / a.meta_page + 1 : a.select_ld;
  const int64_t min_keys = paged ? SelectMctaMinPages() : kSelectMctaMinKeys;
  int64_t mcta_min = std::numeric_limits<int64_t>::max();  // no item takes the multi-CTA path
  if (path == SelectTopKPath::kMultiCta || path == SelectTopKPath::kMultiCtaPerPass) {
    KVF_CHECK_ARG(a.select_mcta_ws != nullptr, "DecodeSelect: multi-CTA top-k without its scratch");
    mcta_min = 1;
  } else if (path == SelectTopKPath::kAuto && a.select_mcta_ws != nullptr &&
             keys_cap >= min_keys) {
    mcta_min = min_keys;
    // Called eagerly with every item short: the multi-CTA launches would all return at once, so
    // leave them out (their launch cost is the one-CTA path's at these lengths). Inside a capture
    // they stay: the graph is replayed at later lengths.
    const int64_t hint = a.max_len_hint;
    const int64_t hint_keys = paged ? (hint + a.meta_page - 1) / a.meta_page + 1 : hint;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    KVF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (hint > 0 && hint_keys < min_keys && capture == cudaStreamCaptureStatusNone) {
      mcta_min = std::numeric_limits<int64_t>::max();
    }
  }
  // The one-CTA kernel always runs: it takes the items below the threshold (chosen on the device
  // from this step's lengths, so one launch sequence serves every step of a captured graph) and
  // the items with nothing to rank; it returns at once for the others.
  const size_t smem = paged ? static_cast<size_t>(sort_cap) * (sizeof(unsigned long long) + sizeof(int32_t))
                     : sort_cap <= kTopKSmemItems ? sort_cap * sizeof(unsigned long long)
                                                  : 0;
  if (paged) {
    if (smem > kPagesSmemOptIn) {  // 4096 pages: 48 KiB besides the kernel's static shared memory
      KVF_CUDA_CHECK(cudaFuncSetAttribute(PagesTopKKernel,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    PagesTopKKernel<<<static_cast<unsigned>(items), kTopKThreads, smem, stream>>>(a, mcta_min);
    KVF_CUDA_CHECK_LAUNCH(PagesTopKKernel);
  } else if (a.ranks == SelectRanks::kOffloaded) {
    WeightsTopKKernel<true><<<static_cast<unsigned>(items), kTopKThreads, smem, stream>>>(
        a, static_cast<int>(sort_cap), mcta_min);
    KVF_CUDA_CHECK_LAUNCH(WeightsTopKKernel<true>);
  } else {
    WeightsTopKKernel<false><<<static_cast<unsigned>(items), kTopKThreads, smem, stream>>>(
        a, static_cast<int>(sort_cap), mcta_min);
    KVF_CUDA_CHECK_LAUNCH(WeightsTopKKernel<false>);
  }
  if (mcta_min == std::numeric_limits<int64_t>::max()) return Status::Ok();
  // The multi-CTA top-k's CTAs per SM in all.
  constexpr int per_sm = 2;
  const int32_t ctas = SelectMctaCtas(items, keys_cap, info.num_sms, per_sm);
  return LaunchMctaTopK(a, mcta_min, static_cast<unsigned>(ctas), keys_cap, smem,
                        path != SelectTopKPath::kMultiCtaPerPass, paged ? 0 : stats_parts, stream);
}

Result<SelectLaunch> OpenSelectLaunch(const void* args, const LaunchInfo& info, void* stream) {
  const DecodeStepArgs& a = *static_cast<const DecodeStepArgs*>(args);
  SelectLaunch l;
  if (a.batch == 0) return l;
  KVF_RETURN_IF_ERROR(CheckSelectArgs(a));
  KVF_CHECK_ARG(a.store.pages != nullptr, "DecodeSelect: null page table");
  l.step = &a;
  l.stream = static_cast<cudaStream_t>(stream);
  l.grid = SelectGridOf(a, info);
  return l;
}

SelectGrid SelectGridOf(const DecodeStepArgs& a, const LaunchInfo& info) {
  SelectGrid g;
  g.items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  g.q_smem = static_cast<size_t>(a.params.group) * a.params.head_dim * sizeof(float);
  g.fill = std::max<int64_t>(1, int64_t{info.num_sms} * 8 / g.items);
  const int64_t want = (a.select_ld + kScoreWarps * 8 - 1) / (kScoreWarps * 8);
  g.gy = static_cast<unsigned>(std::clamp<int64_t>(std::min(want, g.fill), 1, 65535));
  return g;
}

}  // namespace kvferry::cuda
