// Copyright kvferry authors. Apache-2.0.
// The Runtime's decode step on the GPU (DecodeStepArgs): one launch per layer (two when k/v come
// in another dtype than the cache's), reading nothing the host wrote for this call. Append writes
// the new token through to the host store and its resident row; attend converts q and runs the split decode loops of attention.cuh
// over a row source that turns a list index into a position and the position into an address
// (resident tier or host store, read zero-copy), and the last CTA of each item merges the splits,
// and the CPU part when there is one, into the caller's output in its dtype.

#include <algorithm>

#include "gpu/attention.cuh"
#include "gpu/bank_map.cuh"
#include "gpu/device_bank.h"
#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/dispatch.cuh"
#include "base/check.h"

namespace kvferry::cuda {
namespace {

// Where one item's rows live.
struct ItemPlace {
  int64_t n;          // positions stored, the new token included
  const char* res_k;  // resident K rows; V rows follow at res_v_off
  const unsigned long long* pages;  // host-store page table of the item
};

__device__ __forceinline__ ItemPlace PlaceOf(const DecodeStepArgs& a, int32_t b, int32_t h) {
  const int64_t slot = a.slots[b];
  const int64_t t = (slot * a.num_layers + a.layer) * a.num_kv_heads + h;
  const int64_t rows_per_slot = static_cast<int64_t>(a.sink) + a.window;
  const size_t row_bytes = static_cast<size_t>(a.params.head_dim) * DTypeSize(a.params.kv_dtype);
  ItemPlace p;
  p.n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  p.res_k = a.resident + static_cast<size_t>(t * 2 * rows_per_slot) * row_bytes;
  p.pages = reinterpret_cast<const unsigned long long*>(a.store.pages) + t * a.store.max_pages;
  return p;
}

// (1) append of one item's new token: K/V converted to the KV dtype, written through to the
// host store and to its resident row, by the threads of one CTA.
__device__ void AppendItem(const DecodeStepArgs& a, int32_t b, int32_t h, const ItemPlace& pl) {
  const int d = a.params.head_dim;
  const int64_t pos = pl.n - 1;
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(a.params.kv_dtype);
  const uint32_t pt = static_cast<uint32_t>(a.store.page_tokens);
  const uint32_t off = static_cast<uint32_t>(pos) % pt;
  char* page = reinterpret_cast<char*>(pl.pages[static_cast<uint32_t>(pos) / pt]);
  char* store_k = page + off * row_bytes;
  char* store_v = page + (pt + off) * row_bytes;
  const int64_t row = ResidentRowOf(pos, pl.n, a.sink, a.window);
  char* res_k = const_cast<char*>(pl.res_k) + row * row_bytes;
  char* res_v = res_k + static_cast<size_t>(static_cast<int64_t>(a.sink) + a.window) * row_bytes;
  const int64_t src = (static_cast<int64_t>(b) * a.num_kv_heads + h) * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float kx = LoadElem(a.k, a.k_dtype, src + i);
    const float vx = LoadElem(a.v, a.v_dtype, src + i);
    if (!a.host_writes_store) {
      StoreElem(store_k, a.params.kv_dtype, i, kx);
      StoreElem(store_v, a.params.kv_dtype, i, vx);
    }
    StoreElem(res_k, a.params.kv_dtype, i, kx);  // the new token is always in the window
    StoreElem(res_v, a.params.kv_dtype, i, vx);
  }
}

// (1) append as its own launch, grid (batch, num_kv_heads): when k/v arrive in another dtype than
// the KV cache's, the attention reads the new token from its resident row, written here first.
__global__ void StepAppendKernel(DecodeStepArgs a) {
  AppendItem(a, blockIdx.x, blockIdx.y, PlaceOf(a, blockIdx.x, blockIdx.y));
}

// List index -> position -> row address: resident rows from device memory, the others from the
// host store (zero-copy).
// new_k / new_v (when set): the new token's K and V straight from the caller's input, which the
// step's own append may still be writing to the resident row.
struct StepRows {
  const char* res_k;
  const unsigned long long* pages;
  const int32_t* list;  // kList, else null
  const char* new_k;
  const char* new_v;
  int64_t n, sinks, recent_begin;
  size_t res_v_off;  // (sink + window) rows: past 4 GiB for a window of 2^24 256-byte rows
  uint32_t row_bytes, page_tokens;
  int32_t sink, window;
  __device__ __forceinline__ int64_t PositionOf(int64_t j) const {
    return list != nullptr ? list[j] : (j < sinks ? j : recent_begin + (j - sinks));
  }
  __device__ __forceinline__ void Rows(int64_t j, const char*& k, const char*& v) const {
    const int64_t pos = PositionOf(j);
    if (!DeviceRows(pos, k, v)) HostRow(pos, k, v);
  }
  // The rows of \p pos in device memory: the new token's input (new_k), else its resident row;
  // false (k, v untouched) for an offloaded position.
  __device__ __forceinline__ bool DeviceRows(int64_t pos, const char*& k, const char*& v) const {
    if (new_k != nullptr && pos == n - 1) {
      k = new_k;
      v = new_v;
      return true;
    }
    const int64_t row = ResidentRowOf(pos, n, sink, window);
    if (row < 0) return false;
    k = res_k + static_cast<size_t>(row) * row_bytes;
    v = k + res_v_off;
    return true;
  }
  // An offloaded row in the host store (zero-copy).
  __device__ __forceinline__ void HostRow(int64_t pos, const char*& k, const char*& v) const {
    const uint32_t p = static_cast<uint32_t>(pos);
    const uint32_t page = p / page_tokens;
    const uint32_t off = p - page * page_tokens;
    const char* base = reinterpret_cast<const char*>(__ldg(pages + page));
    k = base + static_cast<size_t>(off) * row_bytes;
    v = base + static_cast<size_t>(off + page_tokens) * row_bytes;
  }
};

// StepRows with the device token bank in front of the host store (DecodeStepArgs::bank): an
// offloaded position found in the item's page table is read from its bank slot; AfterLoad sets
// the reference bit of each hit and stages each miss (K and V rows at its list index) and lists
// it for the admission that follows the step. Only the CTAs of head chunk 0 record (record), so
// an item's rows are staged and counted once however many head chunks read them.
struct BankStepRows : StepRows {
  StepBankView bank;
  int64_t table;
  char* stage;    // this item's stage: list index j at stage + 2 j row_bytes
  int32_t* miss;  // this item's miss list
  bool record;
  mutable uint32_t hits;  // hits this lane recorded (dl == 0 lanes)

  __device__ __forceinline__ int32_t SlotOf(int64_t pos) const {
    if (bank.vmap != nullptr) {
      const uint16_t s = __ldg(bank.vmap + table * bank.max_positions + pos);
      return s == 0xffff ? -1 : static_cast<int32_t>(s);
    }
    int32_t slot = -1;
    BankHashFind<true>(bank.hmap + (table << bank.hash_log2), bank.hash_log2,
                       static_cast<int32_t>(pos), &slot);
    return slot;
  }
  __device__ __forceinline__ const char* SlotK(int32_t slot) const {
    return bank.rows + (static_cast<size_t>(table) * bank.slots + slot) * 2 * row_bytes;
  }
  // Sets the reference bit of a slot this step read.
  __device__ __forceinline__ void MarkHit(int32_t slot) const {
    atomicOr(bank.refs + table * bank.ref_words + (slot >> 5), 1u << (slot & 31));
  }
  // Where a miss at list index j is staged: its K row (the V row follows).
  __device__ __forceinline__ char* StageK(int64_t j) const {
    return stage + static_cast<size_t>(j) * 2 * row_bytes;
  }
  // A bank slot for offloaded positions (>= 0), -1 for an offloaded miss, -2 for a resident row.
  __device__ __forceinline__ int32_t Classify(int64_t pos) const {
    if ((new_k != nullptr && pos == n - 1) || ResidentRowOf(pos, n, sink, window) >= 0) return -2;
    return SlotOf(pos);
  }
  __device__ __forceinline__ void Rows(int64_t j, const char*& k, const char*& v) const {
    const int64_t pos = PositionOf(j);
    if (DeviceRows(pos, k, v)) return;
    const int32_t slot = SlotOf(pos);
    if (slot >= 0) {
      k = SlotK(slot);
      v = k + row_bytes;
    } else if (bank.staged) {  // prefetched at its list index (Device::PrefetchListRows)
      k = StageK(j);
      v = k + row_bytes;
    } else {
      HostRow(pos, k, v);
    }
  }
  __device__ __forceinline__ void AfterLoad(int64_t j, bool valid, const uint4& kraw,
                                            const uint4& vraw, int dl) const {
    if (!record || !valid) return;
    const int32_t slot = Classify(PositionOf(j));  // the same answer Rows had: the map is fixed
    if (slot >= 0) {
      if (dl == 0) {
        MarkHit(slot);
        ++hits;
      }
    } else if (slot == -1) {
      if (!bank.staged) {  // a prefetched row is in the stage already
        char* dst = StageK(j) + dl * 16;
        *reinterpret_cast<uint4*>(dst) = kraw;
        *reinterpret_cast<uint4*>(dst + row_bytes) = vraw;
      }
      if (dl == 0) {
        const int32_t idx = atomicAdd(miss, 1);
        if (idx < bank.miss_cap) miss[1 + idx] = static_cast<int32_t>(j);
      }
    }
  }
};

// Every resident row of the item, in row order: the attended set when all of it is resident and
// the count equals the rows in use (dense over a context the tier holds, or streaming whose
// recent part is the whole ring). No position arithmetic per row.
struct ResidentRows {
  const char* res_k;
  const char* new_k;  // as in StepRows: row new_row is read from the input
  const char* new_v;
  int64_t new_row;
  size_t res_v_off;
  uint32_t row_bytes;
  __device__ __forceinline__ void Rows(int64_t j, const char*& k, const char*& v) const {
    if (j == new_row) {
      k = new_k;
      v = new_v;
      return;
    }
    k = res_k + static_cast<size_t>(j) * row_bytes;
    v = k + res_v_off;
  }
};

// The pipelined list step (kList kernels, bank on): the rows of a CTA's range, resolved to device
// addresses once (ResolveListRange) and read from shared memory by the cp.async loop.
struct TableRows {
  const char* const* k;
  const char* const* v;
  int64_t begin;
  __device__ __forceinline__ void Rows(int64_t j, const char*& kp, const char*& vp) const {
    kp = k[j - begin];
    vp = v[j - begin];
  }
};

// Most rows one CTA of the pipelined list step takes (its address table's size).
constexpr int kListChunkMax = 256;
// The fewest splits whose tables hold a list of list_cap rows.
inline int64_t ListMinSplits(int64_t list_cap) { return (list_cap + kListChunkMax - 1) / kListChunkMax; }
// Bytes of that table: K and V addresses and the misses' list indices.
constexpr size_t kListTableBytes = kListChunkMax * (2 * sizeof(const char*) + sizeof(int32_t));

// Resolves list rows [begin, end) of an item through the bank, every thread a row at a time, so the
// CTA's list reads, map lookups and misses' host reads are each one round of loads in flight
// together (the register loop did the three one after the other for every row step):
// - resident rows and the new token: their device rows;
// - bank hits: their slots (reference bit set, counted);
// - misses: read from the host store zero-copy into the item's stage at their list index (where
//   the admission after the step finds them), listed, and read from there (already staged when
//   the cross-layer prefetch ran: StepBankView::staged).
// Leaves K / V addresses in tk / tv (index j - begin); the caller syncs before the table is read.
template <int HD>
__device__ void ResolveListRange(const BankStepRows& bs, int64_t begin, int64_t end,
                                 const char** tk, const char** tv, int32_t* mj) {
  constexpr int kLpr = HD / 8;
  __shared__ int32_t s_miss, s_base;
  __shared__ uint32_t s_hits;
  if (threadIdx.x == 0) {
    s_miss = 0;
    s_hits = 0;
  }
  __syncthreads();
  uint32_t hits = 0;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const char* k;
    const char* v;
    const int32_t slot = bs.Classify(bs.PositionOf(j));
    if (slot == -2) {  // resident, or the new token: the plain row source's address
      bs.StepRows::Rows(j, k, v);
    } else if (slot >= 0) {
      k = bs.SlotK(slot);
      v = k + bs.row_bytes;
      bs.MarkHit(slot);
      ++hits;
    } else {
      k = bs.StageK(j);
      v = k + bs.row_bytes;
      mj[atomicAdd(&s_miss, 1)] = static_cast<int32_t>(j);
    }
    tk[j - begin] = k;
    tv[j - begin] = v;
  }
  hits = __reduce_add_sync(0xffffffffu, hits);
  if ((threadIdx.x & 31) == 0 && hits != 0) atomicAdd(&s_hits, hits);
  __syncthreads();
  const int nm = s_miss;
  if (threadIdx.x == 0) {
    if (s_hits != 0) atomicAdd(bs.bank.hits, static_cast<unsigned long long>(s_hits));
    if (nm > 0) s_base = atomicAdd(bs.miss, nm);
  }
  if (nm == 0) return;
  __syncthreads();
  // The misses' rows, K then V, 16 bytes a thread, four loads in flight before their stores (none
  // when a prefetch staged them: StepBankView::staged).
  const int chunks = bs.bank.staged ? 0 : nm * 2 * kLpr;
  for (int c0 = threadIdx.x; c0 < chunks; c0 += 4 * blockDim.x) {
    uint4 raw[4];
    char* dst[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int c = c0 + u * blockDim.x;
      dst[u] = nullptr;
      if (c < chunks) {
        const int i = c / (2 * kLpr), part = c % (2 * kLpr);
        const int64_t j = mj[i];
        const char* hk;
        const char* hv;
        bs.HostRow(bs.PositionOf(j), hk, hv);
        const int off = (part % kLpr) * 16;
        raw[u] = Load16((part < kLpr ? hk : hv) + off);
        dst[u] = bs.StageK(j) + (part < kLpr ? 0 : bs.row_bytes) + off;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (dst[u] != nullptr) *reinterpret_cast<uint4*>(dst[u]) = raw[u];
    }
  }
  for (int i = threadIdx.x; i < nm; i += blockDim.x) {
    if (s_base + i < bs.bank.miss_cap) bs.miss[1 + s_base + i] = mj[i];
  }
  // The cp.async loop reads the staged rows through L2.
  __threadfence();
}

struct StepLaunch {
  int32_t prefetch_rows;  // rows of the split's range warmed in L2 before griddepcontrol.wait
  int32_t table_off;      // kList kernels: bytes into the dynamic shared memory of the row table
  bool fused_append;  // the attention kernel appends (k/v already in the KV dtype)
  int32_t num_splits;
  int32_t min_chunk;
  float scale_log2;
};

// (3) combine of the CTA's query heads g0 .. g0+gcount of an item: the splits' partials and the
// optional CPU part (entry `splits`), weighted by their lse, into out in its dtype. Run by the
// item's last CTA. Warp w weighs the splits of heads w, w + warps, ...; then every thread sums
// (head, dimension) outputs over the splits with eight independent loads in flight, so the tail
// after the last split finishes is a few L2 round trips, not one per split and head.
// wbuf: shared memory for gcount * (splits + 1) floats.
template <int HD, int G>
__device__ void CombineHeads(const DecodeStepArgs& a, int32_t item, int g0, int gcount,
                             int32_t splits, size_t items, float* wbuf) {
  __shared__ float inv_sh[G];
  const int group = a.params.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const size_t base = static_cast<size_t>(item) * splits;
  const int wn = splits + 1;
  for (int gi = warp; gi < gcount; gi += kAttnWarps) {
    const int g = g0 + gi;
    const int64_t row = static_cast<int64_t>(item) * group + g;  // (b, h * group + g)
    const float* ws_lse = a.ws + items * splits * group * HD;
    float* w = wbuf + gi * wn;
    float m = -INFINITY;
    for (int y = lane; y <= splits; y += 32) {
      float l = -INFINITY;
      if (y < splits) {
        l = __ldcg(ws_lse + (base + y) * group + g);
      } else if (a.lse_cpu != nullptr) {
        l = a.lse_cpu[row];
      }
      w[y] = l;  // read back below by this same lane
      m = fmaxf(m, l);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float sum = 0.0f;
    for (int y = lane; y <= splits; y += 32) {
      const float l = w[y];
      const float wt = (l == -INFINITY || m == -INFINITY) ? 0.0f : expf(l - m);
      w[y] = wt;
      sum += wt;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      inv_sh[gi] = sum > 0.0f ? 1.0f / sum : 0.0f;
      if (a.lse != nullptr) a.lse[row] = m == -INFINITY ? -INFINITY : m + logf(sum);
    }
  }
  __syncthreads();
  // Each thread sums four adjacent outputs (one float4 per split) with kBatch loads in flight, so
  // the tail is ceil(splits / kBatch) L2 round trips (the launcher checks ws's 16-byte alignment).
  constexpr int kBatch = 16;
  const size_t ys4 = static_cast<size_t>(group) * HD / 4;
  for (int c = threadIdx.x; c < gcount * HD / 4; c += kAttnThreads) {
    const int gi = c * 4 / HD, i = c * 4 - gi * HD;
    const float* w = wbuf + gi * wn;
    const float4* src = reinterpret_cast<const float4*>(a.ws + (base * group + g0 + gi) * HD + i);
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int y = 0; y < splits; y += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        v[u] = y + u < splits ? __ldcg(src + (y + u) * ys4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const float wt = y + u < splits ? w[y + u] : 0.0f;
        acc.x = fmaf(wt, v[u].x, acc.x);
        acc.y = fmaf(wt, v[u].y, acc.y);
        acc.z = fmaf(wt, v[u].z, acc.z);
        acc.w = fmaf(wt, v[u].w, acc.w);
      }
    }
    const int64_t out_row = static_cast<int64_t>(item) * group + g0 + gi;
    float o[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (a.o_cpu != nullptr) o[e] = fmaf(w[splits], a.o_cpu[out_row * HD + i + e], o[e]);
      StoreElem(a.out, a.out_dtype, out_row * HD + i + e, o[e] * inv_sh[gi]);
    }
  }
}

// The split's rows [begin, end) of a list of len rows (kPipe: whole pipeline tiles a split).
template <int HD, bool kPipe>
__device__ __forceinline__ void SplitRange(const StepLaunch& l, int split, int64_t len, int64_t& begin,
                                           int64_t& end) {
  int64_t chunk = (len + l.num_splits - 1) / l.num_splits;
  if (chunk < l.min_chunk) chunk = l.min_chunk;
  if constexpr (kPipe) chunk = (chunk + kPipeTileRows<HD> - 1) / kPipeTileRows<HD> * kPipeTileRows<HD>;
  begin = chunk * split < len ? chunk * split : len;
  end = begin + chunk < len ? begin + chunk : len;
}

// Before griddepcontrol.wait (PDL): warms L2 with the first l.prefetch_rows K and V rows of the
// split when the step reads the item's resident rows whole (a hint; reads nothing a kernel writes).
template <int HD, typename T>
__device__ __forceinline__ void WarmResidentRows(const DecodeStepArgs& a, const StepLaunch& l,
                                                 const ItemPlace& pl, int split) {
  if (l.prefetch_rows <= 0 || !a.all_resident || a.mode == StepRowMode::kList) return;
  const StepRange r =
      SinksAndRecent(pl.n, a.sink, StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, pl.n));
  if (r.count != min(pl.n, static_cast<int64_t>(a.sink) + a.window)) return;
  int64_t begin, end;
  SplitRange<HD, true>(l, split, r.count, begin, end);
  end = min(end, begin + l.prefetch_rows);
  const size_t row_b = HD * sizeof(T);
  const size_t v_off = static_cast<size_t>(static_cast<int64_t>(a.sink) + a.window) * row_b;
  const int lines = static_cast<int>((end - begin) * row_b / 128);
  for (int i = threadIdx.x; i < 2 * lines; i += blockDim.x) {
    const char* p = pl.res_k + begin * row_b + (i < lines ? i : i - lines + v_off / 128) * 128;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
  }
}

// The item's rows as the step reads them: its list (kList) or its sinks and recent rows; len is
// how many, contiguous whether they are the item's resident rows whole.
__device__ __forceinline__ StepRows StepRowsOf(const DecodeStepArgs& a, const ItemPlace& pl, int32_t item,
                                               const char* new_k, const char* new_v, size_t row_bytes,
                                               int64_t& len, bool& contiguous) {
  StepRows src;
  src.new_k = new_k;
  src.new_v = new_v;
  src.res_k = pl.res_k;
  src.pages = pl.pages;
  src.n = pl.n;
  src.sink = a.sink;
  src.window = a.window;
  src.row_bytes = row_bytes;
  src.res_v_off = static_cast<size_t>(static_cast<int64_t>(a.sink) + a.window) * row_bytes;
  src.page_tokens = static_cast<uint32_t>(a.store.page_tokens);
  contiguous = false;
  if (a.mode == StepRowMode::kList) {
    src.list = a.list + item * a.list_cap;
    src.sinks = 0;
    src.recent_begin = 0;
    len = a.list_count[item];
  } else {
    src.list = nullptr;
    const StepRange r =
        SinksAndRecent(pl.n, a.sink, StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, pl.n));
    src.sinks = r.sinks;
    src.recent_begin = r.recent_begin;
    len = r.count;
    const int64_t in_use = min(pl.n, static_cast<int64_t>(a.sink) + a.window);
    contiguous = a.all_resident && len == in_use;
  }
  return src;
}

// The bank's admission item of \p item, read by the admission launched after the step.
__device__ __forceinline__ void WriteAdmitItem(const DecodeStepArgs& a, int32_t item, size_t row_bytes) {
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  BankAdmitItem ai;
  ai.table = static_cast<int32_t>((static_cast<int64_t>(a.slots[b]) * a.num_layers + a.layer) *
                                      a.num_kv_heads + h);
  ai.miss_cap = a.bank.miss_cap;
  ai.positions = a.list + item * a.list_cap;
  ai.miss_list = a.bank.miss + static_cast<int64_t>(item) * (1 + a.bank.miss_cap);
  ai.stage = a.bank.stage + static_cast<size_t>(item) * a.list_cap * 2 * row_bytes;
  ai.stage_first = nullptr;
  static_cast<BankAdmitItem*>(a.bank.admit)[item] = ai;
}

// (2) attend + (3) combine: grid (items, splits, head chunks). Each CTA writes its partial result
// to ws; the last CTA of an (item, head chunk) to finish (a counter per pair, reset by it) merges
// them into out, so a layer costs two launches.
// kPipe: rows stream through the cp.async pipeline: all-resident rows, or (kList) a list through
// the token bank whose rows each CTA first resolves to device addresses (ResolveListRange).
template <int HD, typename T, int G, bool kPipe, bool kList = false>
__global__ void __launch_bounds__(kAttnThreads, kPipeMinBlocks<HD, G, kPipe>)
    StepAttnKernel(DecodeStepArgs a, StepLaunch l) {
  static_assert(kPipe || !kList);
  extern __shared__ __align__(16) float smem[];
  float* warp_buf = smem;
  float* red_o = warp_buf + kAttnWarps * G * (HD + 2);
  float* red_m = red_o + G * HD;
  float* red_l = red_m + G;
  const int32_t item = blockIdx.x;
  const int32_t b = item / a.num_kv_heads, h = item % a.num_kv_heads;
  const int group = a.params.group;
  const int g0 = blockIdx.z * G;
  const int gcount = min(G, group - g0);
  const int split = blockIdx.y;
  // Slots, positions and page tables come from host copies, never from a kernel: safe to read
  // before the wait below.
  const ItemPlace pl = PlaceOf(a, b, h);
  auto split_range = [&](int64_t len, int64_t& begin, int64_t& end) {
    SplitRange<HD, kPipe>(l, split, len, begin, end);
  };
  // Programmatic dependent launch (LaunchStepG): the next kernel on the stream may start while this
  // one runs, and this one may have started before the kernel ahead of it finished. Until
  // griddepcontrol.wait it reads nothing a kernel writes and writes nothing: it only warms L2 with
  // the first tiles of its resident rows (a hint: L2 is where the GPU's writes meet, so a row the
  // kernel ahead is still writing reads correctly after the wait). Both are no-ops without PDL.
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if constexpr (kPipe) WarmResidentRows<HD, T>(a, l, pl, split);
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  // The CTA's query heads in fp32 (converted from the caller's dtype here: no separate pass).
  __shared__ float q_s[G * HD];
  const int64_t q0 = ((static_cast<int64_t>(b) * a.num_kv_heads + h) * group + g0) * HD;
  for (int i = threadIdx.x; i < gcount * HD; i += blockDim.x) q_s[i] = LoadElem(a.q, a.q_dtype, q0 + i);
  const char* new_k = nullptr;
  const char* new_v = nullptr;
  if (l.fused_append) {
    const size_t in_row = (static_cast<size_t>(b) * a.num_kv_heads + h) * HD * sizeof(T);
    new_k = static_cast<const char*>(a.k) + in_row;
    new_v = static_cast<const char*>(a.v) + in_row;
    // Nothing in this step reads the new token's resident or store row (it is read from the
    // input above, and the row it takes held a position now outside the window), so one CTA
    // per item writes them while the others attend.
    if (split == 0 && blockIdx.z == 0) AppendItem(a, b, h, pl);
  }
  __syncthreads();

  int64_t len;
  bool contiguous = false;
  const StepRows src = StepRowsOf(a, pl, item, new_k, new_v, HD * sizeof(T), len, contiguous);

  int64_t begin, end;
  split_range(len, begin, end);
  const size_t part = static_cast<size_t>(item) * l.num_splits + split;
  float* ws_o = a.ws + (part * group + g0) * HD;
  float* ws_lse = a.ws + static_cast<size_t>(gridDim.x) * l.num_splits * group * HD + part * group + g0;
  if (begin >= end) {
    for (int i = threadIdx.x; i < gcount * HD; i += blockDim.x) ws_o[i] = 0.0f;
    if (threadIdx.x < gcount) ws_lse[threadIdx.x] = -INFINITY;
  } else {
    const float* q = q_s;
    auto attend = [&](const auto& rows) {
      if constexpr (kPipe) {
        AttendRangeStaged<HD, T, G>(rows, q, gcount, l.scale_log2, begin, end,
                                    reinterpret_cast<char*>(smem), red_m, red_l, red_o, warp_buf);
      } else {
        AttendRange<HD, T, G>(rows, q, gcount, l.scale_log2, begin, end, red_m, red_l, red_o, warp_buf);
      }
    };
    // The item's rows through the token bank (its table, stage and miss list).
    auto bank_rows = [&] {
      BankStepRows bs;
      static_cast<StepRows&>(bs) = src;
      bs.bank = a.bank;
      bs.table = (static_cast<int64_t>(a.slots[b]) * a.num_layers + a.layer) * a.num_kv_heads + h;
      bs.stage = a.bank.stage + static_cast<size_t>(item) * a.list_cap * 2 * src.row_bytes;
      bs.miss = a.bank.miss + static_cast<int64_t>(item) * (1 + a.bank.miss_cap);
      bs.record = blockIdx.z == 0;
      bs.hits = 0;
      return bs;
    };
    if constexpr (kList) {
      // One head chunk (the launcher's condition), so this CTA records its rows' hits and misses.
      const BankStepRows bs = bank_rows();
      char* table = reinterpret_cast<char*>(smem) + l.table_off;
      const char** tk = reinterpret_cast<const char**>(table);
      const char** tv = tk + kListChunkMax;
      int32_t* mj = reinterpret_cast<int32_t*>(tv + kListChunkMax);
      if (end - begin > kListChunkMax) __trap();  // the launcher sizes the splits for the table
      ResolveListRange<HD>(bs, begin, end, tk, tv, mj);
      __syncthreads();
      attend(TableRows{tk, tv, begin});
    } else if (contiguous) {
      attend(ResidentRows{pl.res_k, new_k, new_v,
                          new_k != nullptr ? ResidentRowOf(pl.n - 1, pl.n, a.sink, a.window) : -1,
                          src.res_v_off, src.row_bytes});
    } else if (!kPipe && a.bank.rows != nullptr) {
      const BankStepRows bs = bank_rows();
      attend(bs);
      // One atomic per warp for the hits its lanes recorded.
      const uint32_t warp_hits = __reduce_add_sync(0xffffffffu, bs.hits);
      if ((threadIdx.x & 31) == 0 && warp_hits != 0) atomicAdd(a.bank.hits, static_cast<unsigned long long>(warp_hits));
    } else {
      attend(src);
    }
    WriteResult<HD, G>(red_m, red_l, red_o, gcount, ws_o, ws_lse);
  }
  // The bank's admission item of this item, read by the admission launched after this kernel.
  if (a.bank.rows != nullptr && split == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
    WriteAdmitItem(a, item, src.row_bytes);
  }
  // Publish the partial, then count it; the last CTA combines.
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  int32_t* counter = a.counters + static_cast<size_t>(item) * gridDim.z + blockIdx.z;
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == l.num_splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // The attention's shared memory is free now: it holds the combine's weights (G * kAttnThreads floats
  // at most, below the reduction buffers' size).
  CombineHeads<HD, G>(a, item, g0, gcount, l.num_splits, gridDim.x, smem);
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or graph replay)
}

template <int HD, typename T, int G, bool kPipe, bool kList = false>
Status LaunchStepG(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream) {
  constexpr size_t kRed = (static_cast<size_t>(kAttnWarps) * G * (HD + 2) + G * HD + 2 * G) * sizeof(float);
  const size_t smem_attn = kPipe ? std::max(kRed, kPipeSmemBytes<HD, T>) : kRed;
  // kList: the CTA's row table follows the stages.
  const size_t smem = kList ? (smem_attn + 15) / 16 * 16 + kListTableBytes : smem_attn;
  static_assert(kRed >= static_cast<size_t>(G) * kAttnThreads * sizeof(float),
                "the combine's weights fit in the reduction buffers");
  static const bool pdl = [] {
    int dev = 0, major = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    return major >= 9;
  }();
  // Tiles of its range each CTA warms in L2 before the wait. Measured on
  // the H100 (dense all-resident, 32K, batch 1, 32 layers; 1.827 ms without PDL): 0 tiles 1.831,
  // 3 tiles 1.792, 8 tiles 1.771 ms. 8 tiles of 264 CTAs are 34 MB, within the 50 MB L2.
  constexpr int prefetch_tiles = 8;
  // With PDL the kernel asks for enough shared memory that two CTAs fill an SM: a third would be
  // the next layer's, waiting, and the SMs that free first would then take three of it.
  // (Lists: three CTAs an SM, which resolve their rows while others compute.)
  const size_t smem_launch = pdl && kPipe && !kList ? std::max<size_t>(smem, 80 * 1024) : smem;
  KVF_ASSIGN_OR_RETURN(const int per_sm,
                       (PrepareAttnKernel<StepAttnKernel<HD, T, G, kPipe, kList>>(smem_launch, "StepAttnKernel")));
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  const int gz = (a.params.group + G - 1) / G;
  const int64_t ctas = items * gz;
  // All-resident rows: at most two CTAs per SM. Measured on the H100 (32 layers of the Llama
  // shape): the third CTA's splits cost more in prologue and combine than they add in bandwidth
  // (32K b1 2.04 -> 1.92 ms per token step, 128K b1 6.65 -> 6.19, 32K b4 6.52 -> 6.21).
  const int64_t slots = static_cast<int64_t>(info.num_sms) * (kList ? per_sm : kPipe ? std::min(per_sm, 2) : 8);
  StepLaunch l;
  // Short resident lists get more, shorter splits: the step is latency-bound there.
  // Rows found one by one (a list through the bank, or the host store) take at least
  // 128 rows a split. The loop is latency-bound there (ncu at
  // 128K, 2% of 32 layers through the bank: one warp a scheduler, an instruction every 9 cycles),
  // so more CTAs help until a second wave (246 registers a thread: two CTAs an SM). Measured
  // (stop 20, sparcas_bank / quest_bank at 128K, ms per token step): 256 rows 6.99 / 5.63, 128
  // 6.40 / 5.19, 64 6.83 / 5.56, 32 7.23 / 5.93.
  constexpr int list_min_chunk = 128;
  // Pipelined lists: 4 tiles a split at least (128 rows at head_dim 128), at most kListChunkMax.
  // Measured (H100, 128K b1, 32 layers, ms per token step, sparcas_bank / quest_bank):
  // 32 rows 3.81 / 3.50, 64 3.88 / 3.48, 128 3.78 / 3.46; the register loop 4.62 / 4.14.
  const int list_pipe_chunk =
      static_cast<int>(std::min<int64_t>(int64_t{4} * kPipeTileRows<HD>, kListChunkMax));
  l.min_chunk = kList ? list_pipe_chunk : kPipe ? 2 * kPipeTileRows<HD> : list_min_chunk;
  l.table_off = static_cast<int32_t>((smem_attn + 15) / 16 * 16);
  l.fused_append = a.k_dtype == a.params.kv_dtype && a.v_dtype == a.params.kv_dtype &&
                   reinterpret_cast<uintptr_t>(a.k) % 16 == 0 && reinterpret_cast<uintptr_t>(a.v) % 16 == 0;
  int64_t splits = kPipe ? std::max<int64_t>(slots / ctas, 1) : (slots + ctas - 1) / ctas;
  if (a.max_rows_hint > 0) splits = std::min<int64_t>(splits, (a.max_rows_hint + l.min_chunk - 1) / l.min_chunk);
  // A pipelined list's split holds at most kListChunkMax rows (its table).
  if constexpr (kList) splits = std::max<int64_t>(splits, ListMinSplits(a.list_cap));
  // The combine kernel keeps one split per thread, plus the CPU part.
  splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(info.max_splits, kAttnThreads - 1));
  const int64_t per_split = items * a.params.group * (HD + 1);
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, a.ws_floats / per_split));
  KVF_CHECK_CODE(a.ws_floats >= per_split * splits, StatusCode::kInternal,
                 "decode step workspace of ", a.ws_floats, " floats is too small");
  KVF_CHECK_CODE(!kList || splits * kListChunkMax >= a.list_cap, StatusCode::kInternal,
                 "decode step: ", splits, " splits cannot hold a list of ", a.list_cap, " rows");
  l.num_splits = static_cast<int32_t>(splits);
  l.scale_log2 = a.params.scale * kLog2e;
  l.prefetch_rows = pdl ? prefetch_tiles * kPipeTileRows<HD> : 0;

  if (!l.fused_append) {
    StepAppendKernel<<<dim3(a.batch, a.num_kv_heads), kAttnThreads, 0, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(StepAppendKernel);
  }
  KVF_CHECK_CODE(reinterpret_cast<uintptr_t>(a.ws) % 16 == 0, StatusCode::kInternal,
                 "decode step workspace is not 16-byte aligned");
  const dim3 grid(static_cast<unsigned>(items), static_cast<unsigned>(splits), static_cast<unsigned>(gz));
  // Programmatic dependent launch: the kernel may be scheduled while the one ahead of it on the
  // stream drains (its CTAs take the SMs' free slots and wait in griddepcontrol.wait, having
  // warmed L2), which hides the launch and the first loads' latency behind that kernel's tail.
  // Graph capture keeps it as a programmatic edge (compute capability 9 and up).
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kAttnThreads);
  cfg.dynamicSmemBytes = smem_launch;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  KVF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, StepAttnKernel<HD, T, G, kPipe, kList>, a, l));
  KVF_CUDA_CHECK_LAUNCH(StepAttnKernel);
  return Status::Ok();
}

// Whether a layer takes the pipelined list step: a list through the token bank, one
// head chunk an item (its CTA records the rows), and a list the splits' tables hold.
// Otherwise the register loop (StepRows through BankStepRows).
bool PipelinedList(const DecodeStepArgs& a, const LaunchInfo& info) {
  const int64_t splits = ListMinSplits(a.list_cap);
  return a.mode == StepRowMode::kList && a.bank.rows != nullptr && !a.all_resident &&
         a.params.group <= 8 && splits <= std::min<int64_t>(info.max_splits, kAttnThreads - 1) &&
         a.ws_floats >= static_cast<int64_t>(a.batch) * a.num_kv_heads * a.params.group *
                            (a.params.head_dim + 1) * splits;
}

}  // namespace

Status LaunchDecodeStep(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream) {
  KVF_RETURN_IF_ERROR(CheckAttnShape(a.params));
  if (a.batch == 0) return Status::Ok();
  KVF_CHECK_ARG(a.ws != nullptr && a.counters != nullptr && a.slots != nullptr && a.positions != nullptr && a.store.pages != nullptr,
                "decode step: null workspace, slots, positions or page table");
  KVF_CHECK_ARG(a.mode != StepRowMode::kList || (a.list != nullptr && a.list_count != nullptr),
                "decode step: list mode without a list");
  KVF_CHECK_ARG(a.bank.rows == nullptr ||
                    (a.mode == StepRowMode::kList && !a.all_resident && a.bank.stage != nullptr &&
                     a.bank.miss != nullptr && a.bank.admit != nullptr && a.bank.hits != nullptr &&
                     a.bank.refs != nullptr && (a.bank.vmap != nullptr || a.bank.hmap != nullptr)),
                "decode step: a token bank needs list mode, staging, miss lists, admission items "
                "and a page table");
  KVF_CHECK_ARG(a.params.group <= 65535 && a.batch <= 65535, "decode step: group ", a.params.group,
                " or batch ", a.batch, " too large");
  return DISPATCH_HEAD_DIM(a.params.head_dim, HD, [&] {
    return DISPATCH_KV_DTYPE(a.params.kv_dtype, T, [&] {
      const bool list = PipelinedList(a, info);
      if (a.params.group <= 4) {
        if (list) return LaunchStepG<HD, T, 4, true, true>(a, info, stream);
        return a.all_resident ? LaunchStepG<HD, T, 4, true>(a, info, stream)
                              : LaunchStepG<HD, T, 4, false>(a, info, stream);
      }
      if (list) return LaunchStepG<HD, T, 8, true, true>(a, info, stream);
      return a.all_resident ? LaunchStepG<HD, T, 8, true>(a, info, stream)
                            : LaunchStepG<HD, T, 8, false>(a, info, stream);
    });
  });
}

namespace {

constexpr int kSplitThreads = 256;
constexpr int kSplitWarps = kSplitThreads / 32;

// SplitListArgs: a CTA per item. Pass 1 counts the item's misses; pass 2 walks the list in
// chunks of kSplitThreads, an exclusive prefix count of the misses (ballots, then the warps'
// totals) placing each entry: miss number r goes to the CPU when r >= keep, at r - keep; every
// other entry j to the device, at j - (CPU entries before it).
__global__ void __launch_bounds__(kSplitThreads) SplitListKernel(DecodeStepArgs a, SplitListArgs s) {
  const int64_t item = blockIdx.x;
  const int32_t b = static_cast<int32_t>(item / a.num_kv_heads);
  const int64_t n = a.positions[static_cast<int64_t>(b) * a.num_layers + a.layer] + 1;
  const int32_t* list = a.list + item * a.list_cap;
  const int64_t count = a.list_count[item];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ int32_t warp_sum[kSplitWarps];
  __shared__ int64_t total;
  int32_t mine = 0;
  for (int64_t j = threadIdx.x; j < count; j += kSplitThreads) {
    mine += ResidentRowOf(list[j], n, a.sink, a.window) < 0;
  }
  mine = __reduce_add_sync(0xffffffffu, mine);
  if (lane == 0) warp_sum[warp] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t t = 0;
    for (int w = 0; w < kSplitWarps; ++w) t += warp_sum[w];
    total = t;
  }
  __syncthreads();
  const int64_t misses = total;
  const int64_t keep = misses - SplitCpuRows(misses, s.cpu_q10);
  int32_t* gpu = s.gpu_list + item * a.list_cap;
  int32_t* cpu = s.cpu_list + item * a.list_cap;
  __shared__ int32_t warp_base[kSplitWarps];
  int64_t before = 0;  // misses ahead of this chunk
  for (int64_t base = 0; base < count; base += kSplitThreads) {
    __syncthreads();  // warp_sum of the last chunk read by every thread
    const int64_t j = base + threadIdx.x;
    const int32_t pos = j < count ? list[j] : 0;
    const bool miss = j < count && ResidentRowOf(pos, n, a.sink, a.window) < 0;
    const uint32_t ballot = __ballot_sync(0xffffffffu, miss);
    if (lane == 0) warp_sum[warp] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
      int32_t run = 0;
      for (int w = 0; w < kSplitWarps; ++w) {
        warp_base[w] = run;
        run += warp_sum[w];
      }
    }
    __syncthreads();
    const int64_t r = before + warp_base[warp] + __popc(ballot & ((1u << lane) - 1u));
    if (j < count) {
      if (miss && r >= keep) {
        cpu[r - keep] = pos;
      } else {
        gpu[j - (r > keep ? r - keep : 0)] = pos;
      }
    }
    int64_t chunk = 0;
    for (int w = 0; w < kSplitWarps; ++w) chunk += warp_sum[w];
    before += chunk;
  }
  if (threadIdx.x == 0) {
    const int64_t to_cpu = misses - keep;
    s.gpu_count[item] = static_cast<int32_t>(count - to_cpu);
    s.cpu_count[item] = static_cast<int32_t>(to_cpu);
  }
}

}  // namespace

Status LaunchSplitStepList(const DecodeStepArgs& a, const SplitListArgs& s, cudaStream_t stream) {
  if (a.batch == 0) return Status::Ok();
  KVF_CHECK_ARG(a.list != nullptr && a.list_count != nullptr && a.positions != nullptr &&
                    s.gpu_list != nullptr && s.gpu_count != nullptr && s.cpu_list != nullptr &&
                    s.cpu_count != nullptr && s.cpu_q10 >= 0 && s.cpu_q10 <= 1024,
                "split step list: null list, positions or outputs, or a CPU share of ", s.cpu_q10,
                "/1024");
  const unsigned items = static_cast<unsigned>(a.batch) * static_cast<unsigned>(a.num_kv_heads);
  SplitListKernel<<<items, kSplitThreads, 0, stream>>>(a, s);
  KVF_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

namespace {

constexpr int kPrefetchThreads = 256;
constexpr int kPrefetchWarps = kPrefetchThreads / 32;

// Device::PrefetchListRows: grid (CTAs an item, items), a warp a list entry at a time. Lane 0
// classifies the entry (resident, bank hit or miss) as the step's BankStepRows::Classify does;
// for a miss the warp copies its K and V rows from the host store into the stage at its list
// index, 16 bytes a lane, every lane's loads issued before its stores.
__global__ void __launch_bounds__(kPrefetchThreads) PrefetchListKernel(DecodeStepArgs a) {
  const int64_t item = blockIdx.y;
  const int32_t b = static_cast<int32_t>(item / a.num_kv_heads), h = static_cast<int32_t>(item % a.num_kv_heads);
  const ItemPlace pl = PlaceOf(a, b, h);
  const int64_t table = (static_cast<int64_t>(a.slots[b]) * a.num_layers + a.layer) * a.num_kv_heads + h;
  const uint32_t row_bytes = static_cast<uint32_t>(a.params.head_dim) * static_cast<uint32_t>(DTypeSize(a.params.kv_dtype));
  const uint32_t pt = static_cast<uint32_t>(a.store.page_tokens);
  const int32_t* list = a.list + item * a.list_cap;
  const int64_t count = a.list_count[item];
  char* stage = a.bank.stage + static_cast<size_t>(item) * a.list_cap * 2 * row_bytes;
  const int lane = threadIdx.x & 31;
  const int chunks = static_cast<int>(row_bytes / 16);  // of a row; K then V: 2 * chunks
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kPrefetchWarps;
  for (int64_t j = blockIdx.x * kPrefetchWarps + (threadIdx.x >> 5); j < count; j += warps) {
    const int32_t pos = list[j];
    if (ResidentRowOf(pos, pl.n, a.sink, a.window) >= 0) continue;  // uniform over the warp
    int32_t slot = -1;
    if (lane == 0) {
      if (a.bank.vmap != nullptr) {
        const uint16_t s = __ldg(a.bank.vmap + table * a.bank.max_positions + pos);
        slot = s == 0xffff ? -1 : static_cast<int32_t>(s);
      } else if (a.bank.hmap != nullptr) {
        BankHashFind<true>(a.bank.hmap + (table << a.bank.hash_log2), a.bank.hash_log2, pos, &slot);
      }
    }
    if (__shfl_sync(0xffffffffu, slot, 0) >= 0) continue;  // a bank hit: the step reads its slot
    const uint32_t page = static_cast<uint32_t>(pos) / pt, off = static_cast<uint32_t>(pos) - page * pt;
    const char* base = reinterpret_cast<const char*>(__ldg(pl.pages + page));
    const char* hk = base + static_cast<size_t>(off) * row_bytes;
    const char* hv = base + static_cast<size_t>(off + pt) * row_bytes;
    char* dst = stage + static_cast<size_t>(j) * 2 * row_bytes;
    constexpr int kPer = 4;  // chunks a lane has in flight
    for (int c0 = lane; c0 < 2 * chunks; c0 += 32 * kPer) {
      uint4 raw[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int c = c0 + u * 32;
        if (c < 2 * chunks) raw[u] = Load16((c < chunks ? hk : hv) + (c % chunks) * 16);
      }
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int c = c0 + u * 32;
        if (c < 2 * chunks) *reinterpret_cast<uint4*>(dst + static_cast<size_t>(c) * 16) = raw[u];
      }
    }
  }
}

}  // namespace

Status LaunchPrefetchListRows(const DecodeStepArgs& a, const LaunchInfo& info, cudaStream_t stream) {
  if (a.batch == 0) return Status::Ok();
  const size_t row_bytes = static_cast<size_t>(a.params.head_dim) * DTypeSize(a.params.kv_dtype);
  KVF_CHECK_ARG(a.list != nullptr && a.list_count != nullptr && a.positions != nullptr &&
                    a.slots != nullptr && a.store.pages != nullptr && a.bank.stage != nullptr &&
                    row_bytes % 16 == 0 && a.store.page_tokens > 0,
                "prefetch list rows: null list, positions, slots, page table or stage, or rows of ",
                row_bytes, " bytes (a multiple of 16 is needed)");
  const int64_t items = static_cast<int64_t>(a.batch) * a.num_kv_heads;
  KVF_CHECK_ARG(items <= 65535, "prefetch list rows: ", items, " items");
  // Enough warps in flight to keep PCIe's reads outstanding (each a 512-byte row pair at
  // head_dim 128 bf16) without taking the SMs the step beside it runs on: about two CTAs an SM in
  // all, at most one a 64 list entries of an item.
  const int64_t per_item_cap = std::max<int64_t>(1, (a.list_cap + 64 * kPrefetchWarps - 1) / (64 * kPrefetchWarps));
  const int64_t per_item = std::clamp<int64_t>((2 * static_cast<int64_t>(info.num_sms) + items - 1) / items, 1, per_item_cap);
  PrefetchListKernel<<<dim3(static_cast<unsigned>(per_item), static_cast<unsigned>(items)), kPrefetchThreads, 0, stream>>>(a);
  KVF_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace kvferry::cuda
