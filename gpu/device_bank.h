// Copyright kvferry authors. Apache-2.0.
#pragma once
// HiP's token bank kept entirely on the GPU (CUDA only): the rows, the page tables (vector map or
// hash map), the per-slot back-references and CLOCK counts, the clock hands and the counters all
// live in device memory, and admission is one kernel launch. The host never touches a row or a
// map entry on the decode path: a step is
//
//   the planned step    -> Device::DecodeStep with DecodeStepArgs::bank (gpu/decode_step.cu, the
//                          view from ViewAll): hits read bank rows (and set reference bits),
//                          misses read the pinned host store zero-copy, stage their rows and
//                          append to a miss list
//   DeviceBank::Admit   -> after the step's reads of the bank (stream order or an event): folds the
//                          reference bits into the CLOCK counts, de-duplicates the misses, picks
//                          victims by CLOCK, updates the page table and copies the staged rows
//                          into the victims' slots; resets the miss lists for the next step.
//
// offload/token_bank.h is the host-managed form (maps on the host, runs on the host-emulated
// device too, used by the runtime); this one is for CUDA engines whose selection is on the GPU or
// already in device memory. Replacement matches it: a hit raises the slot's count (max 3), the
// hand lowers counts as it passes and takes the first slot at zero, a new row starts at 1.
//
// Hash map on the device: open addressing with linear probing over packed (pos << 32 | slot)
// entries, as HashPageMap, but deletion leaves a tombstone (pos field -2, never a real position)
// so that admissions of one table run in parallel; lookups skip tombstones, inserts reuse them,
// and the admission kernel rebuilds a table in place when tombstones pass a quarter of it.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "base/bank_map.h"  // BankMapKind
#include "gpu/cuda_device.h"
#include "gpu/cuda_kernels.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

struct DeviceBankConfig {
  int num_tables = 1;          ///< (sequence, layer, KV head) tables
  int slots = 0;               ///< rows per table, in [1, 65534]
  int64_t max_positions = 0;   ///< positions per table (vector map length; hash keys must be below)
  int head_dim = 128;
  DType kv_dtype = DType::kBF16;
  BankMapKind map = BankMapKind::kVector;
  /// Hash entries per table: 0 = the power of two >= 2 * slots; otherwise rounded up to a power of
  /// two (may be < slots: admission then rejects rows once the map is full).
  int64_t hash_capacity = 0;
  /// Most rows admitted per table per Admit (0 = slots / 4, at least 1; at most kMaxAdmit).
  int max_admit_per_table = 0;
};

/// One table's admission work (an array of these in device memory is Admit's input).
struct BankAdmitItem {
  int32_t table = 0;
  int32_t miss_cap = 0;                 ///< capacity of miss_list after its count
  const int32_t* positions = nullptr;   ///< the step's position list of the table
  int32_t* miss_list = nullptr;         ///< [0] = misses, [1 + i] = list index; [0] reset to 0
  const char* stage = nullptr;          ///< list index j's K at stage + 2 j row_bytes, V next
  /// Compact staging: when set, the i-th listed miss's K is at stage + 2 (*stage_first + i)
  /// row_bytes instead (the rows of all tables can then be one block). Device memory.
  const int32_t* stage_first = nullptr;
};

/// Totals over all tables since creation (read back synchronously).
struct DeviceBankCounters {
  int64_t misses = 0;    ///< misses reported to Admit (including duplicates and uncapped ones)
  int64_t admitted = 0;
  int64_t evicted = 0;
  int64_t rejected = 0;  ///< not admitted: over max_admit, duplicate, full map or past max_positions
  int64_t rebuilds = 0;  ///< hash tables rebuilt to drop tombstones
};

class DeviceBank {
 public:
  /// Most misses one Admit considers per table (shared-memory sort).
  static constexpr int kMaxAdmit = 1024;

  static Result<std::unique_ptr<DeviceBank>> Create(CudaDevice* device,
                                                    const DeviceBankConfig& config);

  /// Bytes of each device allocation of a bank of \p config (Create allocates exactly these; the
  /// runtime's device memory plan reads them), and the derived table geometry.
  struct Sizes {
    size_t bank = 0, map = 0, slot_pos = 0, count = 0, refs = 0, state = 0;
    int64_t hash_cap = 0;  ///< hash entries per table (hash map)
    int hash_log2 = 0;
    int64_t ref_words = 0;  ///< reference-bit words per table
    [[nodiscard]] size_t total() const { return bank + map + slot_pos + count + refs + state; }
  };
  [[nodiscard]] static Sizes SizesFor(const DeviceBankConfig& config);
  ~DeviceBank();
  DeviceBank(const DeviceBank&) = delete;
  DeviceBank& operator=(const DeviceBank&) = delete;

  /// Base pointers of every table (table 0's, the others at their strides) for the planned step.
  void ViewAll(StepBankView* view) const;
  /// Queues the admission of \p num_items tables' misses on \p stream (items: device-readable).
  /// Must be ordered after every kernel that reads those tables' rows in this step.
  Status Admit(const BankAdmitItem* items, int num_items, StreamHandle stream);
  /// Empties tables [first, first + count) (sequence removed) on \p stream.
  Status ResetTables(int first, int count, StreamHandle stream);

  /// Synchronous read-backs (they wait for the device): counters and, for tests, one table's
  /// slot -> position array and the slot holding \p pos (-1 if none), found in the device map.
  Result<DeviceBankCounters> Counters() const;
  Result<std::vector<int32_t>> SlotPositions(int table) const;
  Result<std::vector<int32_t>> FindAll(int table, const std::vector<int32_t>& positions) const;

  [[nodiscard]] const DeviceBankConfig& config() const { return config_; }
  [[nodiscard]] int64_t hash_capacity() const { return hash_cap_; }
  /// Page-table bytes over all tables (vector: 2 B per position; hash: 8 B per entry).
  [[nodiscard]] size_t map_bytes() const { return map_bytes_; }
  /// Per-slot metadata bytes: back-reference, count, reference bit, plus per-table state.
  [[nodiscard]] size_t slot_meta_bytes() const { return meta_bytes_; }
  [[nodiscard]] size_t bank_bytes() const { return bank_bytes_; }
  [[nodiscard]] size_t row_bytes() const { return row_bytes_; }
  /// Device address of slot \p slot's K row in \p table (V follows).
  [[nodiscard]] const char* SlotK(int table, int32_t slot) const {
    return bank_ + (static_cast<size_t>(table) * config_.slots + slot) * 2 * row_bytes_;
  }

  /// Per-table state in device memory (public for the kernels).
  struct TableState {
    int32_t hand = 0;
    int32_t used = 0;
    int32_t tombs = 0;
    int32_t pad = 0;
    unsigned long long misses = 0, admitted = 0, evicted = 0, rejected = 0, rebuilds = 0;
  };

 private:
  DeviceBank(CudaDevice* device, const DeviceBankConfig& config)
      : device_(device), config_(config) {}
  Status Init();

  CudaDevice* device_;
  DeviceBankConfig config_;
  size_t row_bytes_ = 0, bank_bytes_ = 0, map_bytes_ = 0, meta_bytes_ = 0;
  int64_t hash_cap_ = 0;
  int hash_log2_ = 0;
  int64_t ref_words_ = 0;
  char* bank_ = nullptr;
  uint16_t* vmap_ = nullptr;          // [tables][max_positions]
  unsigned long long* hmap_ = nullptr;  // [tables][hash_cap]
  int32_t* slot_pos_ = nullptr;       // [tables][slots], -1 = free
  uint8_t* count_ = nullptr;          // [tables][slots]
  uint32_t* refs_ = nullptr;          // [tables][ref_words]
  TableState* state_ = nullptr;       // [tables]
};

/// The planned step's device token bank (Device::CreateStepBank on CUDA): a DeviceBank plus the
/// step's hit counter.
Result<std::unique_ptr<StepBank>> MakeCudaStepBank(CudaDevice* device, const StepBankConfig& config);
/// The device bytes MakeCudaStepBank(device, \p config) allocates (Device::StepBankSizesFor).
Result<StepBankSizes> CudaStepBankSizes(const StepBankConfig& config);

}  // namespace kvferry::cuda
