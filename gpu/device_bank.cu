// Copyright kvferry authors. Apache-2.0.
// The device-resident token bank (device_bank.h): page tables, CLOCK and admission in one kernel.
//
// Admission of one table is one CTA of kThreads threads:
//   1. fold the step's reference bits into the CLOCK counts (saturating at kMaxCount), clear them;
//   2. load the miss list's positions into shared memory, bitonic-sort them, keep the first of each
//      position that is in range and not already mapped, at most max_admit;
//   3. CLOCK in chunks of kThreads slots from the hand: a block scan ranks the chunk's zero-count
//      slots, the first `need` become victims (count set to 1 so a wrapped sweep cannot take them
//      twice), every non-zero slot the hand passes is decremented, the hand stops after the last
//      victim taken;
//   4. unmap the victims' old positions (vector: 0xffff; hash: tombstone), then map the new ones
//      (vector: a store; hash: atomicCAS into the first empty or tombstone entry of the probe);
//   5. copy the staged K/V rows into the victims' slots (16 B per thread per iteration);
//   6. hash only: rebuild the table in place when tombstones pass a quarter of it.
// Every table's state is touched by its own CTA only, so tables of one Admit run in parallel.

#include "gpu/device_bank.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <type_traits>
#include <utility>

#include "gpu/bank_map.cuh"
#include "gpu/cuda_check.h"
#include "base/check.h"

namespace kvferry::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCount = 3;
// A slot chosen as a victim in this admission: neither a candidate again nor decremented by the
// later passes of the hand (a victim's count of 1 fell to 0 one pass later and the slot was chosen
// twice: two positions mapped to one slot, the second one's hits then read the first one's row).
constexpr uint8_t kChosen = 255;
constexpr unsigned long long kEmpty = kBankHashEmpty;
constexpr unsigned long long kTomb = kBankHashTomb;  // pos field -2: matches no position
constexpr uint16_t kNoSlot = 0xffff;

struct AdmitArgs {
  const BankAdmitItem* items = nullptr;
  int32_t slots = 0;
  int64_t max_positions = 0;
  int32_t max_admit = 0;
  uint16_t* vmap = nullptr;             // vector map, or null
  unsigned long long* hmap = nullptr;   // hash map, or null
  int32_t hash_log2 = 0;
  int32_t* slot_pos = nullptr;
  uint8_t* count = nullptr;
  uint32_t* refs = nullptr;
  int64_t ref_words = 0;
  DeviceBank::TableState* state = nullptr;
  char* bank = nullptr;
  int64_t row_bytes = 0;
};

// Entry index of pos, or -1 (plain loads: admission writes the table).
__device__ __forceinline__ int64_t HashFind(const unsigned long long* h, int log2, int32_t pos) {
  return BankHashFind<false>(h, log2, pos);
}

// Inserts (pos, slot) for a pos known to be absent; false when no entry is free. *reused counts
// tombstones taken.
__device__ bool HashInsert(unsigned long long* h, int log2, int32_t pos, int32_t slot,
                           int* reused) {
  const uint32_t cap = 1u << log2, mask = cap - 1;
  const unsigned long long e = (static_cast<unsigned long long>(static_cast<uint32_t>(pos)) << 32) |
                               static_cast<uint32_t>(slot);
  uint32_t i = HashPageMap::Bucket(pos, log2);
  for (uint32_t n = 0; n < cap;) {
    const unsigned long long cur = *reinterpret_cast<volatile unsigned long long*>(h + i);
    if (cur == kEmpty || cur == kTomb) {
      if (atomicCAS(h + i, cur, e) == cur) {
        if (cur == kTomb) ++*reused;
        return true;
      }
      continue;  // lost the entry to another insert: look at it again
    }
    ++n;
    i = (i + 1) & mask;
  }
  return false;
}

// Exclusive block scan of v; *total = the block's sum. All threads must call it.
__device__ int BlockScan(int v, int* total, int* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) smem[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kWarps ? smem[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < kWarps) smem[lane] = w;
  }
  __syncthreads();
  const int off = warp > 0 ? smem[warp - 1] : 0;
  *total = smem[kWarps - 1];
  __syncthreads();
  return off + x - v;
}

// Step 1: the reference bits of the step folded into the CLOCK counts (saturating), cleared.
__device__ void CountReferences(uint32_t* refs, int64_t ref_words, uint8_t* cnt, int32_t S) {
  for (int64_t w = threadIdx.x; w < ref_words; w += kThreads) {
    uint32_t bits = refs[w];
    if (bits == 0) continue;
    refs[w] = 0;
    while (bits != 0) {
      const int b = __ffs(bits) - 1;
      bits &= bits - 1;
      const int64_t s = w * 32 + b;
      if (s < S && cnt[s] < kMaxCount) cnt[s] = static_cast<uint8_t>(cnt[s] + 1);
    }
  }
}

// Step 2: the item's n misses sorted by position (a bitonic sort padded to a power of two with
// INT_MAX, in keys and vals), then the first of each position, in range and not mapped yet,
// compacted in order into new_pos and new_row (where the row is staged), at most max_admit;
// returns how many (every thread).
__device__ int NewMissesByPosition(const AdmitArgs& a, const BankAdmitItem& it, int n, bool compact,
                                   const uint16_t* vmap, const unsigned long long* hmap, int32_t* keys,
                                   int32_t* vals, int32_t* new_pos, int32_t* new_row, int* scan_smem) {
  const int tid = threadIdx.x;
  int p2 = 1;
  while (p2 < n) p2 <<= 1;
  for (int j = tid; j < p2; j += kThreads) {
    if (j < n) {
      const int32_t r = it.miss_list[1 + j];
      keys[j] = it.positions[r];
      vals[j] = compact ? j : r;  // where the row is staged: miss-list entry or list index
    } else {
      keys[j] = INT_MAX;
      vals[j] = 0;
    }
  }
  __syncthreads();
  for (int k = 2; k <= p2; k <<= 1) {
    for (int jj = k >> 1; jj > 0; jj >>= 1) {
      for (int i = tid; i < p2; i += kThreads) {
        const int ixj = i ^ jj;
        if (ixj > i) {
          const bool up = (i & k) == 0;
          const bool gt = keys[i] > keys[ixj] || (keys[i] == keys[ixj] && vals[i] > vals[ixj]);
          if (gt == up) {
            const int32_t tk = keys[i], tv = vals[i];
            keys[i] = keys[ixj];
            vals[i] = vals[ixj];
            keys[ixj] = tk;
            vals[ixj] = tv;
          }
        }
      }
      __syncthreads();
    }
  }
  int m = 0;
  for (int base = 0; base < p2; base += kThreads) {
    const int j = base + tid;
    bool keep = false;
    if (j < n) {
      const int32_t pos = keys[j];
      keep = pos >= 0 && pos < a.max_positions && (j == 0 || keys[j - 1] != pos);
      if (keep) {
        keep = vmap != nullptr ? vmap[pos] == kNoSlot : HashFind(hmap, a.hash_log2, pos) < 0;
      }
    }
    int total = 0;
    const int rank = BlockScan(keep ? 1 : 0, &total, scan_smem);
    if (keep && m + rank < a.max_admit) {
      new_pos[m + rank] = keys[j];
      new_row[m + rank] = vals[j];
    }
    m = min(m + total, a.max_admit);
  }
  return m;
}

// Step 3: up to m CLOCK victims of the table from its hand on (count 0: taken and marked
// kChosen; passed over: count - 1), into victims[0, found); returns found (every thread) and
// moves the hand. sh_stop: one int of shared memory.
__device__ int ClockVictims(DeviceBank::TableState* ts, uint8_t* cnt, int32_t S, int m, int32_t* victims,
                            int* scan_smem, int* sh_stop) {
  const int tid = threadIdx.x;
  const int B = min(kThreads, S);
  int32_t hand = ts->hand;
  int found = 0;
  int64_t swept = 0;
  const int64_t sweep_limit = static_cast<int64_t>(kMaxCount + 2) * S;
  while (found < m && swept < sweep_limit) {
    const int32_t s = static_cast<int32_t>((static_cast<int64_t>(hand) + tid) % S);
    const int c = tid < B ? cnt[s] : 255;
    const bool cand = tid < B && c == 0;
    int total = 0;
    const int rank = BlockScan(cand ? 1 : 0, &total, scan_smem);
    const int need = m - found;
    if (tid == 0) (*sh_stop) = B - 1;
    __syncthreads();
    if (cand && rank == need - 1) (*sh_stop) = tid;
    __syncthreads();
    const int stop = (*sh_stop);
    if (cand && rank < need) {
      victims[found + rank] = s;
      cnt[s] = kChosen;  // step 4 sets its count
    } else if (tid < B && tid <= stop && c > 0 && c != kChosen) {
      cnt[s] = static_cast<uint8_t>(c - 1);
    }
    hand = static_cast<int32_t>((static_cast<int64_t>(hand) + stop + 1) % S);
    swept += stop + 1;
    found += min(total, need);
    __syncthreads();
  }
  if (tid == 0) ts->hand = hand;
  return found;
}

__global__ void __launch_bounds__(kThreads) AdmitKernel(AdmitArgs a) {
  __shared__ int32_t keys[DeviceBank::kMaxAdmit], vals[DeviceBank::kMaxAdmit];
  __shared__ int32_t new_pos[DeviceBank::kMaxAdmit], new_row[DeviceBank::kMaxAdmit];
  __shared__ int32_t victims[DeviceBank::kMaxAdmit];
  __shared__ int scan_smem[kWarps];
  __shared__ int sh_stop, sh_admitted, sh_evicted, sh_used_delta, sh_tomb_delta;
  const BankAdmitItem it = a.items[blockIdx.x];
  const int tid = threadIdx.x;
  const int32_t S = a.slots;
  const size_t t = static_cast<size_t>(it.table);
  int32_t* spos = a.slot_pos + t * S;
  uint8_t* cnt = a.count + t * S;
  uint32_t* refs = a.refs + t * a.ref_words;
  uint16_t* vmap = a.vmap != nullptr ? a.vmap + t * a.max_positions : nullptr;
  unsigned long long* hmap = a.hmap != nullptr ? a.hmap + (t << a.hash_log2) : nullptr;
  DeviceBank::TableState* ts = a.state + t;
  const int reported = max(it.miss_list[0], 0);
  const int n = min(min(reported, it.miss_cap), DeviceBank::kMaxAdmit);
  const bool compact = it.stage_first != nullptr;
  const int64_t stage_base = compact ? *it.stage_first : 0;
  if (tid == 0) {
    sh_admitted = 0;
    sh_evicted = 0;
    sh_used_delta = 0;
    sh_tomb_delta = 0;
  }

  CountReferences(refs, a.ref_words, cnt, S);  // 1.
  // 2. The new misses by position, at most max_admit (and S).
  const int m = min(NewMissesByPosition(a, it, n, compact, vmap, hmap, keys, vals, new_pos, new_row,
                                        scan_smem),
                    static_cast<int>(S));
  // 3. CLOCK victims.
  const int found = ClockVictims(ts, cnt, S, m, victims, scan_smem, &sh_stop);


  // 4. Unmap the victims' old rows, then map the new ones.
  int tomb_local = 0;
  for (int j = tid; j < found; j += kThreads) {
    const int32_t old = spos[victims[j]];
    if (old >= 0) {
      if (vmap != nullptr) {
        vmap[old] = kNoSlot;
      } else {
        const int64_t e = HashFind(hmap, a.hash_log2, old);
        if (e >= 0) {
          hmap[e] = kTomb;
          ++tomb_local;
        }
      }
      atomicAdd(&sh_evicted, 1);
      atomicAdd(&sh_used_delta, -1);
    }
  }
  __syncthreads();
  int reused = 0;
  for (int j = tid; j < found; j += kThreads) {
    const int32_t s = victims[j];
    const int32_t pos = new_pos[j];
    bool ok = true;
    if (vmap != nullptr) {
      vmap[pos] = static_cast<uint16_t>(s);
    } else {
      ok = HashInsert(hmap, a.hash_log2, pos, s, &reused);
    }
    if (ok) {
      spos[s] = pos;
      cnt[s] = 1;  // survives one pass of the hand
      atomicAdd(&sh_admitted, 1);
      atomicAdd(&sh_used_delta, 1);
    } else {
      spos[s] = -1;
      cnt[s] = 0;
      victims[j] = -1;
    }
  }
  if (tomb_local - reused != 0) atomicAdd(&sh_tomb_delta, tomb_local - reused);
  __syncthreads();

  // 5. Staged rows -> bank slots.
  const int64_t chunks = a.row_bytes * 2 / 16;
  for (int64_t idx = tid; idx < static_cast<int64_t>(found) * chunks; idx += kThreads) {
    const int64_t j = idx / chunks, piece = idx % chunks;
    const int32_t s = victims[j];
    if (s < 0) continue;
    const uint4* src = reinterpret_cast<const uint4*>(
        it.stage + (stage_base + new_row[j]) * 2 * a.row_bytes) + piece;
    uint4* dst =
        reinterpret_cast<uint4*>(a.bank + (t * S + s) * 2 * a.row_bytes) + piece;
    *dst = *src;
  }

  // 6. Hash: drop tombstones when they pass a quarter of the table.
  bool rebuild = false;
  if (hmap != nullptr) {
    const int tombs = ts->tombs + sh_tomb_delta;
    rebuild = static_cast<int64_t>(tombs) * 4 > (int64_t{1} << a.hash_log2);
    if (rebuild) {
      __syncthreads();
      for (int64_t i = tid; i < (int64_t{1} << a.hash_log2); i += kThreads) hmap[i] = kEmpty;
      __syncthreads();
      int unused = 0;
      for (int32_t s = tid; s < S; s += kThreads) {
        if (spos[s] >= 0 && !HashInsert(hmap, a.hash_log2, spos[s], s, &unused)) {
          spos[s] = -1;  // cannot happen: the rebuilt table holds at least what it held
          cnt[s] = 0;
          atomicAdd(&sh_used_delta, -1);
        }
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    ts->used += sh_used_delta;
    ts->tombs = rebuild ? 0 : ts->tombs + sh_tomb_delta;
    ts->misses += static_cast<unsigned long long>(reported);
    ts->admitted += static_cast<unsigned long long>(sh_admitted);
    ts->evicted += static_cast<unsigned long long>(sh_evicted);
    ts->rejected += static_cast<unsigned long long>(reported - sh_admitted);
    if (rebuild) ts->rebuilds += 1;
    it.miss_list[0] = 0;  // ready for the next step
  }
}

__global__ void ResetStateKernel(DeviceBank::TableState* state, int first, int count) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) {
    state[first + i].hand = 0;
    state[first + i].used = 0;
    state[first + i].tombs = 0;
  }
}

}  // namespace

Result<std::unique_ptr<DeviceBank>> DeviceBank::Create(CudaDevice* device,
                                                        const DeviceBankConfig& config) {
  KVF_CHECK_ARG(device != nullptr, "DeviceBank needs a CUDA device");
  KVF_CHECK_ARG(config.num_tables >= 1, "DeviceBank num_tables ", config.num_tables,
                " must be >= 1");
  KVF_CHECK_ARG(config.slots >= 1 && config.slots <= 65534, "DeviceBank slots ", config.slots,
                " must be in [1, 65534]");
  KVF_CHECK_ARG(config.max_positions >= 1 && config.max_positions <= INT32_MAX,
                "DeviceBank max_positions ", config.max_positions, " must be in [1, 2^31)");
  KVF_CHECK_ARG(config.head_dim >= 8 && config.head_dim % 8 == 0, "DeviceBank head_dim ",
                config.head_dim, " must be a positive multiple of 8");
  KVF_CHECK_ARG(config.kv_dtype == DType::kBF16 || config.kv_dtype == DType::kF16,
                "DeviceBank rows must be bf16 or f16");
  KVF_CHECK_ARG(config.hash_capacity >= 0 && config.hash_capacity <= (int64_t{1} << 30),
                "DeviceBank hash_capacity ", config.hash_capacity, " must be in [0, 2^30]");
  KVF_CHECK_ARG(config.max_admit_per_table >= 0 && config.max_admit_per_table <= kMaxAdmit,
                "DeviceBank max_admit_per_table ", config.max_admit_per_table,
                " must be in [0, ", kMaxAdmit, "]");
  std::unique_ptr<DeviceBank> bank(new DeviceBank(device, config));
  KVF_RETURN_IF_ERROR(bank->Init());
  return std::move(bank);
}

DeviceBank::Sizes DeviceBank::SizesFor(const DeviceBankConfig& config) {
  // Every allocation is at least 16 bytes (what Init asks cudaMalloc for).
  auto at_least = [](size_t bytes) { return std::max<size_t>(bytes, 16); };
  const size_t tables = static_cast<size_t>(config.num_tables);
  const size_t slots = static_cast<size_t>(config.slots);
  const size_t row_bytes = static_cast<size_t>(config.head_dim) * 2;
  Sizes z;
  z.ref_words = (config.slots + 31) / 32;
  z.bank = at_least(tables * slots * 2 * row_bytes);
  if (config.map == BankMapKind::kHash) {
    const int64_t want =
        config.hash_capacity > 0 ? config.hash_capacity : 2 * int64_t{config.slots};
    z.hash_cap = 1;
    while (z.hash_cap < want) {
      z.hash_cap <<= 1;
      ++z.hash_log2;
    }
    z.map = at_least(tables * static_cast<size_t>(z.hash_cap) * sizeof(unsigned long long));
  } else {
    z.map = at_least(tables * static_cast<size_t>(config.max_positions) * sizeof(uint16_t));
  }
  z.slot_pos = at_least(tables * slots * sizeof(int32_t));
  z.count = at_least(tables * slots);
  z.refs = at_least(tables * static_cast<size_t>(z.ref_words) * 4);
  z.state = at_least(tables * sizeof(TableState));
  return z;
}

Status DeviceBank::Init() {
  KVF_CUDA_CHECK(cudaSetDevice(device_->device_id()));
  if (config_.max_admit_per_table == 0) {
    config_.max_admit_per_table = std::clamp(config_.slots / 4, 1, kMaxAdmit);
  }
  const size_t tables = static_cast<size_t>(config_.num_tables);
  const Sizes z = SizesFor(config_);
  row_bytes_ = static_cast<size_t>(config_.head_dim) * 2;
  bank_bytes_ = z.bank;
  ref_words_ = z.ref_words;
  hash_cap_ = z.hash_cap;
  hash_log2_ = z.hash_log2;
  map_bytes_ = z.map;
  meta_bytes_ = z.slot_pos + z.count + z.refs + z.state;
  auto alloc = [&](size_t bytes, auto** out) -> Status {
    KVF_ASSIGN_OR_RETURN(void* p, device_->AllocDevice(bytes));
    *out = static_cast<std::remove_reference_t<decltype(**out)>*>(p);
    return Status::Ok();
  };
  KVF_RETURN_IF_ERROR(alloc(z.bank, &bank_));
  if (config_.map == BankMapKind::kHash) {
    KVF_RETURN_IF_ERROR(alloc(z.map, &hmap_));
  } else {
    KVF_RETURN_IF_ERROR(alloc(z.map, &vmap_));
  }
  KVF_RETURN_IF_ERROR(alloc(z.slot_pos, &slot_pos_));
  KVF_RETURN_IF_ERROR(alloc(z.count, &count_));
  KVF_RETURN_IF_ERROR(alloc(z.refs, &refs_));
  KVF_RETURN_IF_ERROR(alloc(z.state, &state_));
  // On the stream the reset and every later kernel use: a cudaMemset on the legacy stream is not
  // ordered before the device's non-blocking stream (docs/reliability.md, the engine's weights).
  const auto ds = static_cast<cudaStream_t>(device_->default_stream());
  KVF_CUDA_CHECK(cudaMemsetAsync(state_, 0, tables * sizeof(TableState), ds));
  KVF_RETURN_IF_ERROR(ResetTables(0, config_.num_tables, nullptr));
  KVF_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(device_->default_stream())));
  return Status::Ok();
}

DeviceBank::~DeviceBank() {
  for (void* p : {static_cast<void*>(bank_), static_cast<void*>(vmap_), static_cast<void*>(hmap_),
                  static_cast<void*>(slot_pos_), static_cast<void*>(count_),
                  static_cast<void*>(refs_), static_cast<void*>(state_)}) {
    if (p != nullptr) device_->FreeDevice(p);
  }
}

void DeviceBank::ViewAll(StepBankView* view) const {
  view->vmap = vmap_;
  view->max_positions = config_.max_positions;
  view->hmap = vmap_ != nullptr ? nullptr : hmap_;
  view->hash_log2 = hash_log2_;
  view->rows = bank_;
  view->slots = config_.slots;
  view->refs = refs_;
  view->ref_words = ref_words_;
}

Status DeviceBank::Admit(const BankAdmitItem* items, int num_items, StreamHandle stream) {
  if (num_items == 0) return Status::Ok();
  KVF_CHECK_ARG(items != nullptr && num_items > 0, "DeviceBank::Admit: ", num_items,
                " items at null");
  KVF_CUDA_CHECK(cudaSetDevice(device_->device_id()));
  AdmitArgs a;
  a.items = items;
  a.slots = config_.slots;
  a.max_positions = config_.max_positions;
  a.max_admit = config_.max_admit_per_table;
  a.vmap = vmap_;
  a.hmap = hmap_;
  a.hash_log2 = hash_log2_;
  a.slot_pos = slot_pos_;
  a.count = count_;
  a.refs = refs_;
  a.ref_words = ref_words_;
  a.state = state_;
  a.bank = bank_;
  a.row_bytes = static_cast<int64_t>(row_bytes_);
  const cudaStream_t s = stream == nullptr
                             ? static_cast<cudaStream_t>(device_->default_stream())
                             : static_cast<cudaStream_t>(stream);
  AdmitKernel<<<num_items, kThreads, 0, s>>>(a);
  KVF_CUDA_CHECK_LAUNCH(AdmitKernel);
  return Status::Ok();
}

Status DeviceBank::ResetTables(int first, int count, StreamHandle stream) {
  KVF_CHECK_ARG(first >= 0 && count >= 0 && first + count <= config_.num_tables,
                "DeviceBank::ResetTables: tables [", first, ", ", first + count,
                ") out of range [0, ", config_.num_tables, ")");
  if (count == 0) return Status::Ok();
  KVF_CUDA_CHECK(cudaSetDevice(device_->device_id()));
  const cudaStream_t s = stream == nullptr
                             ? static_cast<cudaStream_t>(device_->default_stream())
                             : static_cast<cudaStream_t>(stream);
  const size_t f = static_cast<size_t>(first), c = static_cast<size_t>(count);
  const size_t slots = static_cast<size_t>(config_.slots);
  if (vmap_ != nullptr) {
    const size_t per = static_cast<size_t>(config_.max_positions);
    KVF_CUDA_CHECK(cudaMemsetAsync(vmap_ + f * per, 0xff, c * per * sizeof(uint16_t), s));
  } else {
    const size_t per = static_cast<size_t>(hash_cap_);
    KVF_CUDA_CHECK(cudaMemsetAsync(hmap_ + f * per, 0xff, c * per * 8, s));
  }
  KVF_CUDA_CHECK(cudaMemsetAsync(slot_pos_ + f * slots, 0xff, c * slots * sizeof(int32_t), s));
  KVF_CUDA_CHECK(cudaMemsetAsync(count_ + f * slots, 0, c * slots, s));
  KVF_CUDA_CHECK(cudaMemsetAsync(refs_ + f * ref_words_, 0, c * ref_words_ * 4, s));
  ResetStateKernel<<<(count + 255) / 256, 256, 0, s>>>(state_, first, count);
  KVF_CUDA_CHECK_LAUNCH(ResetStateKernel);
  return Status::Ok();
}

Result<DeviceBankCounters> DeviceBank::Counters() const {
  KVF_CUDA_CHECK(cudaSetDevice(device_->device_id()));
  KVF_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<TableState> st(static_cast<size_t>(config_.num_tables));
  KVF_CUDA_CHECK(
      cudaMemcpy(st.data(), state_, st.size() * sizeof(TableState), cudaMemcpyDeviceToHost));
  DeviceBankCounters c;
  for (const TableState& s : st) {
    c.misses += static_cast<int64_t>(s.misses);
    c.admitted += static_cast<int64_t>(s.admitted);
    c.evicted += static_cast<int64_t>(s.evicted);
    c.rejected += static_cast<int64_t>(s.rejected);
    c.rebuilds += static_cast<int64_t>(s.rebuilds);
  }
  return c;
}

Result<std::vector<int32_t>> DeviceBank::SlotPositions(int table) const {
  KVF_CHECK_ARG(table >= 0 && table < config_.num_tables, "DeviceBank table ", table,
                " out of range [0, ", config_.num_tables, ")");
  KVF_CUDA_CHECK(cudaSetDevice(device_->device_id()));
  KVF_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> out(static_cast<size_t>(config_.slots));
  KVF_CUDA_CHECK(cudaMemcpy(out.data(), slot_pos_ + static_cast<size_t>(table) * config_.slots,
                            out.size() * 4, cudaMemcpyDeviceToHost));
  return out;
}

Result<std::vector<int32_t>> DeviceBank::FindAll(int table,
                                                 const std::vector<int32_t>& positions) const {
  KVF_CHECK_ARG(table >= 0 && table < config_.num_tables, "DeviceBank table ", table,
                " out of range [0, ", config_.num_tables, ")");
  KVF_CUDA_CHECK(cudaSetDevice(device_->device_id()));
  KVF_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> out(positions.size(), -1);
  const size_t t = static_cast<size_t>(table);
  if (vmap_ != nullptr) {
    std::vector<uint16_t> m(static_cast<size_t>(config_.max_positions));
    KVF_CUDA_CHECK(cudaMemcpy(m.data(), vmap_ + t * config_.max_positions, m.size() * 2,
                              cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < positions.size(); ++i) {
      const int32_t p = positions[i];
      if (p >= 0 && p < config_.max_positions && m[p] != kNoSlot) out[i] = m[p];
    }
    return out;
  }
  std::vector<unsigned long long> h(static_cast<size_t>(hash_cap_));
  KVF_CUDA_CHECK(
      cudaMemcpy(h.data(), hmap_ + (t << hash_log2_), h.size() * 8, cudaMemcpyDeviceToHost));
  const uint32_t mask = static_cast<uint32_t>(hash_cap_ - 1);
  for (size_t i = 0; i < positions.size(); ++i) {
    const int32_t p = positions[i];
    uint32_t b = HashPageMap::Bucket(p, hash_log2_);
    for (int64_t n = 0; n < hash_cap_; ++n, b = (b + 1) & mask) {
      if (h[b] == kEmpty) break;
      if (static_cast<int32_t>(h[b] >> 32) == p) {
        out[i] = static_cast<int32_t>(h[b] & 0xffffffffu);
        break;
      }
    }
  }
  return out;
}

namespace {

class CudaStepBank final : public StepBank {
 public:
  CudaStepBank(CudaDevice* device, std::unique_ptr<DeviceBank> bank, unsigned long long* hits)
      : device_(device), bank_(std::move(bank)), hits_(hits) {}
  ~CudaStepBank() override { device_->FreeDevice(hits_); }
  CudaStepBank(const CudaStepBank&) = delete;
  CudaStepBank& operator=(const CudaStepBank&) = delete;

  void View(StepBankView* view) const override {
    bank_->ViewAll(view);
    view->hits = hits_;
  }
  [[nodiscard]] size_t admit_item_bytes() const override { return sizeof(BankAdmitItem); }
  [[nodiscard]] int max_admit() const override { return DeviceBank::kMaxAdmit; }
  Status Admit(const void* items, int num_items, StreamHandle stream) override {
    return bank_->Admit(static_cast<const BankAdmitItem*>(items), num_items, stream);
  }
  Status ResetTables(int first, int count, StreamHandle stream) override {
    return bank_->ResetTables(first, count, stream);
  }
  Result<StepBankTotals> Totals() const override {
    KVF_ASSIGN_OR_RETURN(const DeviceBankCounters c, bank_->Counters());  // waits for the device
    unsigned long long hits = 0;
    KVF_CUDA_CHECK(cudaMemcpy(&hits, hits_, sizeof(hits), cudaMemcpyDeviceToHost));
    StepBankTotals t;
    t.hits = static_cast<int64_t>(hits);
    t.misses = c.misses;
    t.admitted = c.admitted;
    t.evicted = c.evicted;
    t.rejected = c.rejected;
    return t;
  }
  [[nodiscard]] size_t bytes() const override {
    return DeviceBank::SizesFor(bank_->config()).total() + sizeof(*hits_);
  }

 private:
  CudaDevice* device_;
  std::unique_ptr<DeviceBank> bank_;
  unsigned long long* hits_;
};

DeviceBankConfig ToDeviceBankConfig(const StepBankConfig& config) {
  DeviceBankConfig dc;
  dc.num_tables = config.num_tables;
  dc.slots = config.slots;
  dc.max_positions = config.max_positions;
  dc.head_dim = config.head_dim;
  dc.kv_dtype = config.kv_dtype;
  dc.map = config.hash_map ? BankMapKind::kHash : BankMapKind::kVector;
  return dc;
}

}  // namespace

Result<StepBankSizes> CudaStepBankSizes(const StepBankConfig& config) {
  const DeviceBank::Sizes z = DeviceBank::SizesFor(ToDeviceBankConfig(config));
  StepBankSizes s;
  s.rows = z.bank;
  s.page_tables = z.map;
  // The slot state includes the step's hit counter (MakeCudaStepBank).
  s.slot_state = z.slot_pos + z.count + z.refs + z.state + sizeof(unsigned long long);
  s.admit_item_bytes = sizeof(BankAdmitItem);
  s.max_admit = DeviceBank::kMaxAdmit;
  return s;
}

Result<std::unique_ptr<StepBank>> MakeCudaStepBank(CudaDevice* device, const StepBankConfig& config) {
  const DeviceBankConfig dc = ToDeviceBankConfig(config);
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<DeviceBank> bank, DeviceBank::Create(device, dc));
  KVF_ASSIGN_OR_RETURN(void* hits, device->AllocDevice(sizeof(unsigned long long)));
  KVF_CUDA_CHECK(cudaSetDevice(device->device_id()));
  // Ordered on the device's stream and finished before the bank is used (not the legacy stream).
  const auto ds = static_cast<cudaStream_t>(device->default_stream());
  cudaError_t err = cudaMemsetAsync(hits, 0, sizeof(unsigned long long), ds);
  if (err == cudaSuccess) err = cudaStreamSynchronize(ds);
  if (err != cudaSuccess) {
    device->FreeDevice(hits);
    KVF_CUDA_CHECK(err);
  }
  return std::unique_ptr<StepBank>(
      new CudaStepBank(device, std::move(bank), static_cast<unsigned long long*>(hits)));
}

}  // namespace kvferry::cuda
