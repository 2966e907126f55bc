// Copyright kvferry authors. Apache-2.0.
#pragma once
// HiP's GPU token bank: a fixed number of slots per (sequence slot, layer, KV head) ("table"), each
// holding one offloaded token's K and V row in device memory, and a page table per table mapping
// position -> slot in one of HiP's two forms:
//   * vector map: a position-indexed array of slot ids (O(T) memory, one load per lookup);
//   * hash map:   open addressing with linear probing over packed (position, slot) entries
//                 (O(slots) memory, a few probes per lookup).
// Replacement is CLOCK over per-slot access counts (approximate LRU): a hit raises the slot's count
// (saturating), the clock hand lowers counts as it passes and evicts the first slot at zero.
//
// The maps live in host memory and are consulted while the runtime plans a step, so the logic is
// plain C++ and runs on the host-emulated device too. Bank memory comes from Device::AllocDevice
// and admissions are Device::CopyRows from the pinned host store on a side stream.
//
// Use in a decode step (one thread; see docs/cuda.md):
//   plan:   Resolve(table, positions, ...)       -> hit row addresses (bank) + miss positions
//           WaitReady(compute_stream)            -> compute waits for the previous admission
//   run:    attention over resident + hit rows + fetched misses on compute_stream;
//           RecordEvent(step_done, compute_stream)
//   after:  BeginAdmit(side_stream, step_done)   -> side stream waits until the step read the bank
//           Admit(table, fetched positions, their host K/V rows) for each table
//           CommitAdmit()                        -> one CopyRows on the side stream

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "base/bank_map.h"  // BankMapKind, VectorPageMap, HashPageMap
#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry {

struct TokenBankConfig {
  int max_sequences = 1;
  int num_layers = 1;
  int num_kv_heads = 1;
  int slots = 0;                 ///< slots per table (<= 65534)
  int64_t max_positions = 0;     ///< tokens per sequence (vector map length bound)
  int head_dim = 128;
  DType kv_dtype = DType::kBF16;
  BankMapKind map = BankMapKind::kVector;
  /// Hash map entries per table: 0 = the power of two >= 2 * slots (load <= 0.5). Smaller values
  /// (even < slots) are allowed; admission then stops when a table's map is full.
  int64_t hash_capacity = 0;
  /// Most rows admitted per table per Admit call (0 = slots / 4, at least 1).
  int max_admit_per_table = 0;
  /// Most rows admitted per CommitAdmit over all tables (sizes the pinned staging buffers;
  /// 0 = 64 per table, capped at 1 << 20).
  int64_t max_admit_rows = 0;
  /// Keep a device copy of every page table (vector: uint16 per position; hash: the packed
  /// entries) and a per-slot reference bitmap that a kernel could resolve positions through (no
  /// kernel of the tree reads them; the planned step uses cuda::DeviceBank). CommitAdmit then
  /// also updates the copies on the admission stream.
  bool device_map = false;
};

/// Counters since creation or ResetCounters.
struct TokenBankCounters {
  int64_t lookups = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t admitted = 0;
  int64_t evicted = 0;
  int64_t rejected = 0;  ///< candidates not admitted: no victim, full map or full staging
  [[nodiscard]] double hit_rate() const {
    return lookups > 0 ? static_cast<double>(hits) / static_cast<double>(lookups) : 0.0;
  }
};

class TokenBank {
 public:
  /// Allocates the bank (num_tables * slots * 2 rows of device memory), the maps, two pinned
  /// staging buffers and their events. \p device must outlive the bank.
  static Result<std::unique_ptr<TokenBank>> Create(Device* device, const TokenBankConfig& config);
  /// Device bytes a bank of \p config allocates (Create allocates exactly these; the runtime's
  /// device memory plan reads them): the rows and, with device_map, the page-table copies and
  /// reference bitmaps. The maps and slot state themselves live in host memory.
  struct DeviceSizes {
    size_t rows = 0;
    size_t page_tables = 0;  ///< device_map only
    size_t ref_bits = 0;     ///< device_map only
    [[nodiscard]] size_t total() const { return rows + page_tables + ref_bits; }
  };
  [[nodiscard]] static DeviceSizes DeviceSizesFor(const TokenBankConfig& config);
  ~TokenBank();
  TokenBank(const TokenBank&) = delete;
  TokenBank& operator=(const TokenBank&) = delete;

  [[nodiscard]] int num_tables() const { return num_tables_; }
  [[nodiscard]] int TableIndex(int seq_slot, int layer, int kv_head) const {
    return (seq_slot * config_.num_layers + layer) * config_.num_kv_heads + kv_head;
  }

  struct ResolveCounts {
    int64_t hits = 0;
    int64_t misses = 0;
  };
  /// Splits \p positions of \p table into bank hits and misses, in input order. For the i-th hit:
  /// hit_k_rows[i] / hit_v_rows[i] = its K / V row in bank memory (device-readable), and
  /// hit_positions[i] = its position when hit_positions != null. Misses go to miss_positions.
  /// Output arrays hold positions.size() entries. A hit counts as an access of its slot.
  /// Rows of slots admitted since the last WaitReady are valid on a stream only after it.
  ResolveCounts Resolve(int table, std::span<const int32_t> positions, const void** hit_k_rows,
                        const void** hit_v_rows, int32_t* hit_positions, int32_t* miss_positions);
  /// Bank slot of \p pos in \p table, or -1 (no access is counted).
  [[nodiscard]] int32_t Find(int table, int32_t pos) const;

  /// Starts an admission batch: \p stream (a side stream) waits for \p after (recorded where the
  /// last reads of the bank were issued; may be null), and the staging buffer about to be reused
  /// is waited for on the host (it was used two batches ago, normally long finished).
  Status BeginAdmit(StreamHandle stream, EventHandle after);
  /// Admits up to max_admit_per_table of \p positions (rows already fetched for this step; those
  /// already in the bank are skipped) into \p table, evicting by CLOCK. k_src[i] / v_src[i] are
  /// device-readable rows of positions[i] (the pinned host store). Map updates happen now; the
  /// copies are queued for CommitAdmit. Returns how many were admitted.
  int64_t Admit(int table, std::span<const int32_t> positions, const void* const* k_src,
                const void* const* v_src);
  /// Issues the batch's row copies on the stream of BeginAdmit and records the ready event. If
  /// that fails, the batch is undone: its slots are free again and its positions miss (their rows
  /// stay in the host store), as if nothing had been admitted; the rows it evicted stay evicted.
  Status CommitAdmit();
  /// Makes \p stream wait for the last committed admission (no-op when none is pending).
  Status WaitReady(StreamHandle stream);

  // ---- device page tables (config.device_map) ----
  /// What a kernel needs to resolve positions of \p table on the device.
  struct DeviceTable {
    const uint16_t* vector_map = nullptr;  ///< [vector_len] (vector kind)
    int64_t vector_len = 0;
    const uint64_t* hash_map = nullptr;    ///< [2^hash_log2] (hash kind)
    int32_t hash_log2 = 0;
    const char* bank_rows = nullptr;       ///< SlotK(table, 0); slot s at + 2 s row bytes
    uint32_t* ref_bits = nullptr;          ///< [ceil(slots / 32)] set by the kernel per hit
  };
  [[nodiscard]] DeviceTable device_table(int table) const;
  /// Queues on \p stream (after the step's hit launches) a copy of the reference bitmaps to pinned
  /// memory and their reset; BeginAdmit waits for it and folds the bits into CLOCK (a set bit
  /// counts as one access of the slot, as a host Resolve hit does).
  Status SnapshotRefs(StreamHandle stream);
  /// Counts a step whose lookups ran on the device: \p lookups positions, \p misses of them missed.
  void CountDeviceLookups(int64_t lookups, int64_t misses) {
    counters_.lookups += lookups;
    counters_.misses += misses;
    counters_.hits += lookups - misses;
  }
  /// Device bytes of the page-table copies and reference bitmaps (0 without device_map).
  [[nodiscard]] size_t device_map_bytes() const { return device_map_bytes_; }

  /// Forgets every row of the tables of \p seq_slot (sequence removed). Call when no work that
  /// reads those rows is in flight.
  void ResetSequence(int seq_slot);

  [[nodiscard]] const TokenBankCounters& counters() const { return counters_; }
  void ResetCounters() { counters_ = {}; }
  /// Page-table bytes (vector or hash maps) over all tables.
  [[nodiscard]] size_t map_bytes() const;
  /// Per-slot metadata bytes (back-references and access counts), the same for both maps.
  [[nodiscard]] size_t slot_meta_bytes() const;
  /// Device bytes of the bank rows.
  [[nodiscard]] size_t bank_bytes() const { return bank_bytes_; }
  [[nodiscard]] const TokenBankConfig& config() const { return config_; }
  [[nodiscard]] int64_t rows_used(int table) const { return used_[table]; }
  /// K and V row of \p slot of \p table in bank memory.
  [[nodiscard]] void* SlotK(int table, int32_t slot) const {
    return bank_ + ((static_cast<size_t>(table) * config_.slots + slot) * 2) * row_bytes_;
  }
  [[nodiscard]] void* SlotV(int table, int32_t slot) const {
    return bank_ + ((static_cast<size_t>(table) * config_.slots + slot) * 2 + 1) * row_bytes_;
  }

 private:
  TokenBank(Device* device, const TokenBankConfig& config);
  Status Init();
  int32_t MapFind(int table, int32_t pos) const;
  bool MapInsert(int table, int32_t pos, int32_t slot);
  void MapErase(int table, int32_t pos);
  /// Next victim slot of \p table by CLOCK, or -1 if none within the sweep bound.
  int32_t PickVictim(int table);

  static constexpr uint8_t kMaxCount = 3;
  Status InitDeviceMaps();
  Status CommitMapUpdates();
  void FoldRefs();
  Status ResetDeviceTable(int table);

  Device* device_;
  TokenBankConfig config_;
  int num_tables_ = 0;
  size_t row_bytes_ = 0;
  size_t bank_bytes_ = 0;
  char* bank_ = nullptr;
  std::vector<VectorPageMap> vector_maps_;
  std::vector<HashPageMap> hash_maps_;
  std::vector<int32_t> pos_of_;   // [table * slots + slot] -> position, -1 = free
  std::vector<uint8_t> count_;    // [table * slots + slot] access count
  std::vector<int32_t> hand_;     // [table] clock hand
  std::vector<int64_t> used_;     // [table] slots in use

  // Admission staging: two pinned RowCopy buffers used alternately.
  RowCopy* staging_[2] = {nullptr, nullptr};
  EventHandle staging_done_[2] = {nullptr, nullptr};
  bool staging_used_[2] = {false, false};
  int64_t staging_rows_cap_ = 0;
  int cur_ = 0;
  int64_t cur_rows_ = 0;
  bool in_batch_ = false;
  // (table, slot) of each row admitted in the open batch, to undo it when CommitAdmit fails.
  std::vector<std::pair<int, int32_t>> batch_admits_;
  void AbortBatch();
  bool ready_pending_ = false;
  StreamHandle admit_stream_ = nullptr;
  EventHandle ready_ = nullptr;
  TokenBankCounters counters_;

  // Device page tables (config.device_map).
  uint16_t* dev_vector_ = nullptr;     // [tables][max_positions]
  uint64_t* dev_hash_ = nullptr;       // [tables][capacity]
  int64_t hash_cap_ = 0;
  int hash_log2_ = 0;
  uint32_t* dev_refs_ = nullptr;       // [tables][ref_words_]
  uint32_t* refs_host_ = nullptr;      // pinned snapshot
  uint32_t* refs_zero_ = nullptr;      // pinned zeros
  void* none_host_ = nullptr;          // pinned "empty" table image (ResetSequence)
  int64_t ref_words_ = 0;
  std::vector<uint32_t> ref_acc_;      // folded reference bits not yet seen by the hand
  EventHandle refs_done_ = nullptr;
  bool refs_pending_ = false;
  std::vector<std::vector<uint32_t>> dirty_;  // [table] written map indices this batch
  std::vector<int> dirty_tables_;
  RowCopy* map_staging_[2] = {nullptr, nullptr};
  uint64_t* map_values_[2] = {nullptr, nullptr};
  int64_t map_staging_cap_ = 0;
  size_t device_map_bytes_ = 0;
};

}  // namespace kvferry
