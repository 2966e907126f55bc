// Copyright kvferry authors. Apache-2.0.
#pragma once
// The token bank's page tables (position -> slot), in HiP's two forms (offload/token_bank.h says
// how the bank uses them): the host maps, and the layout and hash the device copies share
// (gpu/bank_map.cuh, gpu/device_bank.h, the host backend's twin in cpu/decode_step.cpp). Here,
// below every folder that reads them; the out-of-line members are in offload/token_bank.cpp.

#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define KVF_HOST_DEVICE __host__ __device__
#else
#define KVF_HOST_DEVICE
#endif

namespace kvferry {

enum class BankMapKind : uint8_t { kVector = 0, kHash = 1 };

/// Position -> slot as a position-indexed array (uint16 slot ids, 0xffff = none). Grows on demand
/// up to max_positions so that memory follows the context length, as HiP's O(T) table does.
class VectorPageMap {
 public:
  static constexpr uint16_t kNone = 0xffff;
  explicit VectorPageMap(int64_t max_positions = 0) : max_positions_(max_positions) {}
  [[nodiscard]] int32_t Find(int32_t pos) const {
    return static_cast<size_t>(pos) < slot_of_.size() && slot_of_[pos] != kNone ? slot_of_[pos]
                                                                               : -1;
  }
  /// False if pos is outside [0, max_positions).
  bool Insert(int32_t pos, int32_t slot);
  void Erase(int32_t pos) {
    if (static_cast<size_t>(pos) < slot_of_.size()) {
      slot_of_[pos] = kNone;
      if (dirty_ != nullptr) dirty_->push_back(pos);
    }
  }
  /// Raw entry (kNone when absent or past the grown length).
  [[nodiscard]] uint16_t raw(int64_t pos) const {
    return static_cast<size_t>(pos) < slot_of_.size() ? slot_of_[pos] : kNone;
  }
  /// When set, every written index is appended to \p log (device mirror updates).
  void set_dirty_log(std::vector<uint32_t>* log) { dirty_ = log; }
  void Clear() { slot_of_.assign(slot_of_.size(), kNone); }
  /// Bytes of the table.
  [[nodiscard]] size_t bytes() const { return slot_of_.capacity() * sizeof(uint16_t); }

 private:
  int64_t max_positions_;
  std::vector<uint16_t> slot_of_;
  std::vector<uint32_t>* dirty_ = nullptr;
};

/// Position -> slot by open addressing with linear probing; entries pack (pos << 32 | slot);
/// deletion shifts the cluster back (no tombstones), so lookups stay short after churn.
class HashPageMap {
 public:
  /// \p capacity is rounded up to a power of two (>= 1).
  explicit HashPageMap(int64_t capacity = 1);
  [[nodiscard]] int32_t Find(int32_t pos) const;
  /// False when the table is full (size == capacity). Inserting a present key updates its slot.
  bool Insert(int32_t pos, int32_t slot);
  void Erase(int32_t pos);
  void Clear();
  [[nodiscard]] int64_t size() const { return size_; }
  [[nodiscard]] int64_t capacity() const { return static_cast<int64_t>(entries_.size()); }
  [[nodiscard]] size_t bytes() const { return entries_.size() * sizeof(uint64_t); }
  /// Home bucket of \p pos in a table of 2^log2_capacity entries (Fibonacci hashing); also called
  /// by the CUDA kernels that probe the device copies (gpu/bank_map.cuh).
  KVF_HOST_DEVICE static uint32_t Bucket(int32_t pos, int log2_capacity) {
    if (log2_capacity == 0) return 0;
    return (static_cast<uint32_t>(pos) * 0x9E3779B1u) >> (32 - log2_capacity);
  }
  [[nodiscard]] int log2_capacity() const { return log2_cap_; }
  /// Probes made by Find/Insert since construction (for the benchmark).
  [[nodiscard]] int64_t probes() const { return probes_; }
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  /// Raw packed entry i ((pos << 32) | slot, or kEmpty).
  [[nodiscard]] uint64_t entry(int64_t i) const { return entries_[static_cast<size_t>(i)]; }
  /// When set, every written bucket index is appended to \p log (device mirror updates).
  void set_dirty_log(std::vector<uint32_t>* log) { dirty_ = log; }

 private:
  void Set(uint64_t i, uint64_t e) {
    entries_[i] = e;
    if (dirty_ != nullptr) dirty_->push_back(static_cast<uint32_t>(i));
  }
  std::vector<uint64_t> entries_;
  std::vector<uint32_t>* dirty_ = nullptr;
  int log2_cap_ = 0;
  int64_t size_ = 0;
  mutable int64_t probes_ = 0;
};

}  // namespace kvferry
