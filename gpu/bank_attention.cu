// Copyright kvferry authors. Apache-2.0.
// Position-list decode attention for HiP's token bank (BankAttnItem, cuda_kernels.h): the kernel
// resolves each selected position itself - through the bank's device page table (vector map: one
// uint16 load; hash map: a linear probe) or directly in a row store - so the host sends positions
// only and does no per-row work on the critical path. Bank hits (HBM) and misses (pinned host
// memory read zero-copy over PCIe) are either separate launches (kHits, kMisses; two streams,
// merged by lse) or one launch (kAll) that reads each row from wherever it is; a pass that reads
// misses also stages them in device memory so that admission is a device-to-device copy.

#include <algorithm>
#include <utility>

#include "gpu/attention.cuh"
#include "gpu/bank_map.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "base/check.h"

namespace kvferry::cuda {
namespace {

__device__ __forceinline__ int32_t BankFind(const BankAttnItem& it, int32_t pos) {
  if (it.vector_map != nullptr) {
    if (pos < 0 || pos >= it.vector_len) return -1;
    const uint16_t s = __ldg(it.vector_map + pos);
    return s == 0xffff ? -1 : static_cast<int32_t>(s);
  }
  if (it.hash_map == nullptr) return -1;
  int32_t slot = -1;
  BankHashFind<true>(reinterpret_cast<const unsigned long long*>(it.hash_map), it.hash_log2, pos,
                     &slot);
  return slot;
}

struct BankArgs {
  const BankAttnItem* items = nullptr;
  int32_t group = 1;
  int32_t num_splits = 1;
  int32_t min_chunk = 64;
  int32_t pass = 0;
  float scale_log2 = 0.0f;
  float* ws_o = nullptr;
  float* ws_lse = nullptr;
};

template <int HD, typename T, int G>
__device__ void AttendBankRange(const BankAttnItem& it, BankPass pass, const float* __restrict__ q,
                                int gcount, float scale_log2, int64_t begin, int64_t end,
                                float* red_m, float* red_l, float* red_o, float* warp_buf) {
  constexpr int kLpr = HD / 8;
  constexpr int kRpw = 32 / kLpr;
  constexpr int kSteps = G <= 4 ? 8 : 4;
  constexpr size_t kRowB = HD * sizeof(T);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane / kLpr;
  const int dl = lane % kLpr;

  float qr[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int i = 0; i < 8; ++i) qr[g][i] = g < gcount ? q[g * HD + dl * 8 + i] * scale_log2 : 0.0f;
  }
  LaneState<G> st;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    st.m[g] = -INFINITY;
    st.l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) st.acc[g][i] = 0.0f;
  }

  constexpr int64_t kRowsPerBlock = static_cast<int64_t>(kRpw) * kSteps;
  for (int64_t blk = begin + warp * kRowsPerBlock; blk < end; blk += kRowsPerBlock * kAttnWarps) {
    int32_t pos[kSteps];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int64_t r = blk + s * kRpw + sub;
      pos[s] = r < end ? __ldg(it.positions + r) : -1;
    }
    int32_t slot[kSteps];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      slot[s] = pass != BankPass::kDirect && pos[s] >= 0 ? BankFind(it, pos[s]) : -1;
    }
    uint4 kraw[kSteps], vraw[kSteps];
    bool valid[kSteps];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      kraw[s] = make_uint4(0, 0, 0, 0);
      vraw[s] = make_uint4(0, 0, 0, 0);
      const char* kp = nullptr;
      if (pos[s] >= 0) {
        if (pass == BankPass::kHits || (pass == BankPass::kAll && slot[s] >= 0)) {
          if (slot[s] >= 0) kp = it.bank_rows + static_cast<size_t>(slot[s]) * 2 * kRowB;
        } else if (pass == BankPass::kDirect || slot[s] < 0) {
          kp = it.store + static_cast<int64_t>(pos[s]) * it.store_stride;
        }
      }
      valid[s] = kp != nullptr;
      if (valid[s]) {
        kraw[s] = Load16(kp + dl * 16);
        vraw[s] = Load16(kp + kRowB + dl * 16);
      }
    }
    // Side effects after all loads are in flight (a store waits for its data).
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if (!valid[s]) continue;
      const int64_t r = blk + s * kRpw + sub;
      if (pass == BankPass::kHits || (pass == BankPass::kAll && slot[s] >= 0)) {
        if (dl == 0 && it.ref_bits != nullptr) {
          atomicOr(it.ref_bits + (slot[s] >> 5), 1u << (slot[s] & 31));
        }
      } else if (pass == BankPass::kMisses || pass == BankPass::kAll) {
        if (it.stage != nullptr) {
          char* dst = it.stage + static_cast<size_t>(r) * 2 * kRowB + dl * 16;
          *reinterpret_cast<uint4*>(dst) = kraw[s];
          *reinterpret_cast<uint4*>(dst + kRowB) = vraw[s];
        }
        if (dl == 0 && it.miss_list != nullptr) {
          const int32_t idx = atomicAdd(it.miss_list, 1);
          if (idx < it.miss_cap) it.miss_list[1 + idx] = static_cast<int32_t>(r);
        }
      }
    }
    ConsumeSteps<HD, T, G, kSteps>(st, qr, kraw, vraw, valid);
  }
  ReduceCta<HD, G>(st, red_m, red_l, red_o, warp_buf);
}

// Row address of list index r for \p pass, or null when the pass skips it; slot_out: the bank slot
// (kHits) or 0.
template <size_t kRowB>
__device__ __forceinline__ const char* BankRow(const BankAttnItem& it, BankPass pass, int64_t r,
                                               int32_t& slot_out) {
  slot_out = 0;
  if (pass == BankPass::kStaged) {  // the r-th listed miss, staged by LaunchBankGather
    return it.stage + static_cast<int64_t>(it.miss_list[1 + r]) * 2 * kRowB;
  }
  if (pass == BankPass::kResolved) {  // resolved by LaunchBankResolve; slot_out -1 for a miss
    const int32_t v = it.resolved[r];
    slot_out = v >= 0 ? v : -1;
    if (v >= 0) return it.bank_rows + static_cast<size_t>(v) * 2 * kRowB;
    if (v == kResolvedFromStore) {
      return it.store + static_cast<int64_t>(__ldg(it.positions + r)) * it.store_stride;
    }
    const int64_t first = it.stage_first != nullptr ? *it.stage_first : 0;
    return it.stage + (first - 1 - v) * 2 * static_cast<int64_t>(kRowB);
  }
  const int32_t pos = __ldg(it.positions + r);
  if (pass == BankPass::kDirect) return it.store + static_cast<int64_t>(pos) * it.store_stride;
  const int32_t slot = BankFind(it, pos);

  if (pass == BankPass::kHits) {
    slot_out = slot;
    return slot >= 0 ? it.bank_rows + static_cast<size_t>(slot) * 2 * kRowB : nullptr;
  }
  return slot < 0 ? it.store + static_cast<int64_t>(pos) * it.store_stride : nullptr;
}

// kHits / kDirect over device memory: the cp.async pipeline of AttendRangePipelined, with the
// per-row lookups done by the issuing threads and the resolved slot (-1 = skipped row) kept per
// stage in shared memory (slots_smem [kPipeStages][kTile]) for the compute warps.
template <int HD, typename T, int G>
__device__ void AttendBankPipelined(const BankAttnItem& it, BankPass pass,
                                    const float* __restrict__ q, int gcount, float scale_log2,
                                    int64_t begin, int64_t end, char* pipe, int32_t* slots_smem,
                                    float* red_m, float* red_l, float* red_o, float* warp_buf) {
  constexpr int kLpr = HD / 8;
  constexpr int kRpw = 32 / kLpr;
  constexpr int kTile = kPipeTileRows<HD>;
  constexpr int kSteps = kTile / (kRpw * kAttnWarps);
  constexpr size_t kRowB = HD * sizeof(T);
  constexpr size_t kStageB = kPipeStageBytes<HD, T>;
  constexpr int kRowChunks = kTile * kLpr / kAttnThreads;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int sub = lane / kLpr;
  const int dl = lane % kLpr;

  const int64_t ntiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;
  auto issue = [&](int64_t t) {
    char* stage = pipe + (t % kPipeStages) * kStageB;
    int32_t* sl = slots_smem + (t % kPipeStages) * kTile;
    const int64_t r0 = begin + t * kTile;
#pragma unroll
    for (int i = 0; i < kRowChunks; ++i) {
      const int c = threadIdx.x + i * kAttnThreads;
      const int rr = c / kLpr;
      const int piece = c % kLpr;
      int32_t slot = -1;
      const char* kp = nullptr;
      if (r0 + rr < end) kp = BankRow<kRowB>(it, pass, r0 + rr, slot);
      if (piece == 0) sl[rr] = kp != nullptr ? slot : -2;
      if (kp != nullptr) {
        CpAsync16(stage + rr * kRowB + piece * 16, kp + piece * 16);
        CpAsync16(stage + (kTile + rr) * kRowB + piece * 16, kp + kRowB + piece * 16);
      }
    }
  };
#pragma unroll
  for (int t = 0; t < kPipeStages - 1; ++t) {
    if (t < ntiles) issue(t);
    CpAsyncCommit();
  }
  float qr[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int i = 0; i < 8; ++i) qr[g][i] = g < gcount ? q[g * HD + dl * 8 + i] * scale_log2 : 0.0f;
  }
  LaneState<G> st;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    st.m[g] = -INFINITY;
    st.l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) st.acc[g][i] = 0.0f;
  }
  for (int64_t t = 0; t < ntiles; ++t) {
    CpAsyncWait<kPipeStages - 2>();
    __syncthreads();
    if (t + kPipeStages - 1 < ntiles) issue(t + kPipeStages - 1);
    CpAsyncCommit();
    const char* stage = pipe + (t % kPipeStages) * kStageB;
    const int32_t* sl = slots_smem + (t % kPipeStages) * kTile;
    const int64_t r0 = begin + t * kTile;
    uint4 kraw[kSteps], vraw[kSteps];
    bool valid[kSteps];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int rr = (s * kAttnWarps + warp) * kRpw + sub;
      const int32_t slot = r0 + rr < end ? sl[rr] : -2;
      valid[s] = slot >= -1 && (pass != BankPass::kHits || slot >= 0);
      kraw[s] = make_uint4(0, 0, 0, 0);
      vraw[s] = make_uint4(0, 0, 0, 0);
      if (valid[s]) {
        kraw[s] = *reinterpret_cast<const uint4*>(stage + rr * kRowB + dl * 16);
        vraw[s] = *reinterpret_cast<const uint4*>(stage + (kTile + rr) * kRowB + dl * 16);
        if ((pass == BankPass::kHits || pass == BankPass::kResolved) && slot >= 0 && dl == 0 &&
            it.ref_bits != nullptr) {
          atomicOr(it.ref_bits + (slot >> 5), 1u << (slot & 31));
        }
      }
    }
    ConsumeSteps<HD, T, G, kSteps>(st, qr, kraw, vraw, valid);
  }
  CpAsyncWait<0>();
  __syncthreads();
  ReduceCta<HD, G>(st, red_m, red_l, red_o, warp_buf);
}

template <int HD, typename T, int G, bool kPipe>
__global__ void __launch_bounds__(kAttnThreads, kPipe&& G <= 4 ? 3 : 1)
    BankAttnKernel(BankArgs args) {
  extern __shared__ __align__(16) float smem[];
  float* warp_buf = smem;
  float* red_o = warp_buf + kAttnWarps * G * (HD + 2);
  float* red_m = red_o + G * HD;
  float* red_l = red_m + G;
  __shared__ alignas(BankAttnItem) unsigned char item_raw[sizeof(BankAttnItem)];
  if (threadIdx.x == 0) memcpy(item_raw, args.items + blockIdx.x, sizeof(BankAttnItem));
  __syncthreads();
  const BankAttnItem& item = *reinterpret_cast<const BankAttnItem*>(item_raw);
  const int g0 = blockIdx.z * G;
  const int gcount = min(G, args.group - g0);
  const int split = blockIdx.y;
  const int64_t len = args.pass == static_cast<int32_t>(BankPass::kStaged)
                          ? min(*item.miss_list, item.miss_cap)
                          : item.count;
  int64_t chunk = (len + args.num_splits - 1) / args.num_splits;
  if (chunk < args.min_chunk) chunk = args.min_chunk;
  if constexpr (kPipe)
    chunk = (chunk + kPipeTileRows<HD> - 1) / kPipeTileRows<HD> * kPipeTileRows<HD>;
  const int64_t begin = chunk * split < len ? chunk * split : len;
  const int64_t end = begin + chunk < len ? begin + chunk : len;
  if (begin >= end) {  // empty split (the list is shorter than splits x min_chunk): nothing to read
    if (args.num_splits == 1) {
      for (int i = threadIdx.x; i < gcount * HD; i += kAttnThreads) item.o[g0 * HD + i] = 0.0f;
      if (threadIdx.x < gcount) item.lse[g0 + threadIdx.x] = -INFINITY;
    } else {
      const size_t part = static_cast<size_t>(blockIdx.x) * args.num_splits + split;
      for (int i = threadIdx.x; i < gcount * HD; i += kAttnThreads) {
        args.ws_o[(part * args.group + g0) * HD + i] = 0.0f;
      }
      if (threadIdx.x < gcount) args.ws_lse[part * args.group + g0 + threadIdx.x] = -INFINITY;
    }
    return;
  }
  if constexpr (kPipe) {
    AttendBankPipelined<HD, T, G>(
        item, static_cast<BankPass>(args.pass), item.q + static_cast<size_t>(g0) * HD, gcount,
        args.scale_log2, begin, end, reinterpret_cast<char*>(smem),
        reinterpret_cast<int32_t*>(reinterpret_cast<char*>(smem) + kPipeSmemBytes<HD, T>), red_m,
        red_l, red_o, warp_buf);
  } else {
    AttendBankRange<HD, T, G>(item, static_cast<BankPass>(args.pass),
                              item.q + static_cast<size_t>(g0) * HD, gcount, args.scale_log2, begin,
                              end, red_m, red_l, red_o, warp_buf);
  }
  if (args.num_splits == 1) {
    WriteResult<HD, G>(red_m, red_l, red_o, gcount, item.o + static_cast<size_t>(g0) * HD,
                       item.lse + g0);
  } else {
    const size_t part = static_cast<size_t>(blockIdx.x) * args.num_splits + split;
    WriteResult<HD, G>(red_m, red_l, red_o, gcount, args.ws_o + (part * args.group + g0) * HD,
                       args.ws_lse + part * args.group + g0);
  }
}

template <int HD, typename T, int G, bool kPipe>
struct BankKernelConfig {
  static size_t Smem() {
    const size_t red =
        (static_cast<size_t>(kAttnWarps) * G * (HD + 2) + G * HD + 2 * G) * sizeof(float);
    return kPipe ? std::max(red, kPipeSmemBytes<HD, T>) +
                       kPipeStages * kPipeTileRows<HD> * sizeof(int32_t)
                 : red;
  }
  static Result<int> Prepare() {
    return PrepareAttnKernel<BankAttnKernel<HD, T, G, kPipe>>(Smem(), "BankAttnKernel");
  }
};

// Splits: enough CTAs for one wave of resident CTAs, but no more than the rows need (max_rows, when
// the caller knows it, at 64 rows per split at least: shorter splits are empty CTAs).
template <int HD, typename T, int G, bool kPipe>
Status LaunchBankG(const AttnParams& p, const BankAttnItem* items, int64_t num_items, BankPass pass,
                   int64_t max_rows, const LaunchInfo& info, AttnWorkspace ws,
                   cudaStream_t stream) {
  using Config = BankKernelConfig<HD, T, G, kPipe>;
  KVF_ASSIGN_OR_RETURN(const int per_sm, Config::Prepare());
  const int gz = (p.group + G - 1) / G;
  KVF_CHECK_CODE(num_items <= 0x7fffffff && gz <= 65535, StatusCode::kInvalidArgument,
                 "CUDA bank attention: too many items (", num_items, ")");
  const int64_t ctas = num_items * gz;
  constexpr int kMinChunk = 64;
  int64_t splits = std::max<int64_t>(static_cast<int64_t>(info.num_sms) * per_sm / ctas, 1);
  if (max_rows > 0) splits = std::min<int64_t>(splits, (max_rows + kMinChunk - 1) / kMinChunk);
  splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(info.max_splits, kAttnThreads));
  const size_t per_split = static_cast<size_t>(num_items) * p.group * (HD + 1) * sizeof(float);
  if (per_split > 0) splits = std::min<int64_t>(splits, static_cast<int64_t>(ws.bytes / per_split));
  splits = std::max<int64_t>(splits, 1);
  BankArgs args;
  args.items = items;
  args.group = p.group;
  args.num_splits = static_cast<int32_t>(splits);
  args.min_chunk = kMinChunk;
  args.pass = static_cast<int32_t>(pass);
  args.scale_log2 = p.scale * kLog2e;
  if (splits > 1) {
    args.ws_o = ws.data;
    args.ws_lse = ws.data + static_cast<size_t>(num_items) * splits * p.group * HD;
  }
  const dim3 grid(static_cast<unsigned>(num_items), static_cast<unsigned>(splits),
                  static_cast<unsigned>(gz));
  BankAttnKernel<HD, T, G, kPipe><<<grid, kAttnThreads, Config::Smem(), stream>>>(args);
  KVF_CUDA_CHECK_LAUNCH(BankAttnKernel);
  if (splits > 1) {
    DecodeAttnArgs cargs;
    cargs.items = items;
    cargs.num_items = static_cast<int32_t>(num_items);
    cargs.group = p.group;
    cargs.num_splits = static_cast<int32_t>(splits);
    cargs.ws_o = args.ws_o;
    cargs.ws_lse = args.ws_lse;
    const dim3 cgrid(static_cast<unsigned>(num_items), static_cast<unsigned>(p.group));
    CombineSplitsKernel<BankAttnItem><<<cgrid, kAttnThreads, 0, stream>>>(cargs, HD);
    KVF_CUDA_CHECK_LAUNCH(CombineSplitsKernel);
  }
  return Status::Ok();
}

template <int HD, typename T>
Status LaunchBankHd(const AttnParams& p, const BankAttnItem* items, int64_t num_items,
                    BankPass pass, int64_t max_rows, const LaunchInfo& info, AttnWorkspace ws,
                    cudaStream_t stream) {
  // Rows in device memory (bank hits; a device store) stream through the cp.async pipeline; rows
  // that may be pinned host memory (misses; a host store) use register loads.
  const bool pipe = pass == BankPass::kHits || pass == BankPass::kDirect ||
                    pass == BankPass::kStaged || pass == BankPass::kResolved;
  if (pass == BankPass::kDirectZeroCopy) pass = BankPass::kDirect;
  if (p.group <= 4) {
    return pipe ? LaunchBankG<HD, T, 4, true>(p, items, num_items, pass, max_rows, info, ws, stream)
                : LaunchBankG<HD, T, 4, false>(p, items, num_items, pass, max_rows, info, ws,
                                               stream);
  }
  return pipe ? LaunchBankG<HD, T, 8, true>(p, items, num_items, pass, max_rows, info, ws, stream)
              : LaunchBankG<HD, T, 8, false>(p, items, num_items, pass, max_rows, info, ws, stream);
}

// LaunchBankGather, phase 1: the misses of each position list (page-table lookups only) appended
// to the item's miss list.
constexpr int kResolveThreads = 256;
__global__ void __launch_bounds__(kResolveThreads) BankResolveKernel(const BankAttnItem* items) {
  const BankAttnItem& it = items[blockIdx.x];
  const int64_t r = static_cast<int64_t>(blockIdx.y) * kResolveThreads + threadIdx.x;
  const int32_t count = __ldg(&it.count);
  if (r >= count) return;
  const int32_t pos = __ldg(it.positions + r);
  const int32_t slot = BankFind(it, pos);
  int32_t* resolved = it.resolved;
  if (slot >= 0) {
    if (resolved != nullptr) resolved[r] = slot;
    return;
  }
  int32_t* ml = it.miss_list;
  const int32_t idx = atomicAdd(ml, 1);
  const bool listed = idx < __ldg(&it.miss_cap);
  if (listed) ml[1 + idx] = static_cast<int32_t>(r);
  if (resolved != nullptr) resolved[r] = listed ? -1 - idx : kResolvedFromStore;
}

// Phase 2: the listed rows copied from the (pinned host) store to staging, every warp busy: one
// warp per row (K and V contiguous, 16 B per lane), four rows per warp with every load issued
// before the first store, so that enough PCIe reads are in flight to approach the link.
constexpr int kCopyWarps = 8, kCopyRowsPerWarp = 4;
template <int kRowB>
__global__ void __launch_bounds__(kCopyWarps * 32) BankCopyMissesKernel(const BankAttnItem* items) {
  constexpr int kChunks = 2 * kRowB / 16;
  constexpr int kPerLane = (kChunks + 31) / 32;
  const BankAttnItem& it = items[blockIdx.x];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t n = min(*it.miss_list, __ldg(&it.miss_cap));
  const int64_t j0 = (static_cast<int64_t>(blockIdx.y) * kCopyWarps + warp) * kCopyRowsPerWarp;
  if (j0 >= n) return;
  const char* store = it.store;
  const int64_t stride = it.store_stride;
  int32_t row[kCopyRowsPerWarp];
  const char* src[kCopyRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kCopyRowsPerWarp; ++i) {
    row[i] = j0 + i < n ? it.miss_list[1 + j0 + i] : -1;
  }
#pragma unroll
  for (int i = 0; i < kCopyRowsPerWarp; ++i) {
    src[i] = row[i] >= 0 ? store + static_cast<int64_t>(__ldg(it.positions + row[i])) * stride
                         : nullptr;
  }
  uint4 v[kCopyRowsPerWarp][kPerLane];
#pragma unroll
  for (int i = 0; i < kCopyRowsPerWarp; ++i) {
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int chunk = lane + c * 32;
      if (src[i] != nullptr && chunk < kChunks) {
        v[i][c] = *reinterpret_cast<const uint4*>(src[i] + chunk * 16);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kCopyRowsPerWarp; ++i) {
    if (src[i] == nullptr) continue;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int chunk = lane + c * 32;
      if (chunk < kChunks) {
        *reinterpret_cast<uint4*>(it.stage + static_cast<int64_t>(row[i]) * 2 * kRowB +
                                  chunk * 16) = v[i][c];
      }
    }
  }
}

}  // namespace

Status LaunchBankGather(const AttnParams& p, const BankAttnItem* items, int64_t num_items,
                        int64_t max_rows, cudaStream_t stream) {
  KVF_RETURN_IF_ERROR(CheckAttnShape(p));
  if (num_items == 0 || max_rows == 0) return Status::Ok();
  KVF_CHECK_ARG(items != nullptr, "CUDA bank gather: null item array");
  KVF_CHECK_ARG(p.head_dim == 128, "CUDA bank gather: head_dim ", p.head_dim,
                " (instantiated for 128)");
  KVF_CHECK_ARG(num_items <= 0x7fffffff && max_rows > 0, "CUDA bank gather: ", num_items,
                " items of up to ", max_rows, " rows");
  const int64_t per_block = kCopyWarps * kCopyRowsPerWarp;
  const int64_t gy2 = (max_rows + per_block - 1) / per_block;
  KVF_CHECK_ARG(gy2 <= 65535, "CUDA bank gather: ", max_rows, " rows per item is too many");
  KVF_RETURN_IF_ERROR(LaunchBankResolve(items, num_items, max_rows, stream));
  BankCopyMissesKernel<256><<<dim3(static_cast<unsigned>(num_items), static_cast<unsigned>(gy2)),
                              kCopyWarps * 32, 0, stream>>>(items);
  KVF_CUDA_CHECK_LAUNCH(BankCopyMissesKernel);
  return Status::Ok();
}

Status LaunchBankResolve(const BankAttnItem* items, int64_t num_items, int64_t max_rows,
                         cudaStream_t stream) {
  if (num_items == 0 || max_rows == 0) return Status::Ok();
  KVF_CHECK_ARG(items != nullptr, "CUDA bank resolve: null item array");
  KVF_CHECK_ARG(num_items <= 0x7fffffff && max_rows > 0, "CUDA bank resolve: ", num_items,
                " items of up to ", max_rows, " rows");
  const int64_t gy = (max_rows + kResolveThreads - 1) / kResolveThreads;
  KVF_CHECK_ARG(gy <= 65535, "CUDA bank resolve: ", max_rows, " rows per item is too many");
  BankResolveKernel<<<dim3(static_cast<unsigned>(num_items), static_cast<unsigned>(gy)),
                      kResolveThreads, 0, stream>>>(items);
  KVF_CUDA_CHECK_LAUNCH(BankResolveKernel);
  return Status::Ok();
}

Status LaunchAttendBank(const AttnParams& p, const BankAttnItem* items, int64_t num_items,
                        BankPass pass, int64_t max_rows, const LaunchInfo& info, AttnWorkspace ws,
                        cudaStream_t stream) {
  KVF_RETURN_IF_ERROR(CheckAttnShape(p));
  if (num_items == 0) return Status::Ok();
  KVF_CHECK_ARG(items != nullptr, "CUDA bank attention: null item array");
  KVF_CHECK_ARG(p.head_dim == 128, "CUDA bank attention: head_dim ", p.head_dim,
                " (instantiated for 128)");
  if (p.kv_dtype == DType::kBF16) {
    return LaunchBankHd<128, __nv_bfloat16>(p, items, num_items, pass, max_rows, info, ws, stream);
  }
  return LaunchBankHd<128, __half>(p, items, num_items, pass, max_rows, info, ws, stream);
}

}  // namespace kvferry::cuda
