// Copyright kvferry authors. Apache-2.0.
#pragma once
// The host store: every token's K and V per (sequence slot, layer, KV head), token-major rows,
// append-only, in pages of page_tokens tokens (K rows then V rows per page). Pages come from the
// Device's host allocator (pinned and mapped with CUDA, 64-byte aligned and NUMA-bound
// otherwise) in chunks, are recycled through a free list, and are addressed by one flat page
// table that the GPU can read too.

#include <cstdint>
#include <utility>
#include <vector>

#include "base/attn_types.h"
#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry {

struct HostStoreShape {
  int max_slots = 1;
  int num_layers = 1;
  int num_kv_heads = 1;
  int head_dim = 128;
  DType kv_dtype = DType::kBF16;
  int page_tokens = 256;
  int64_t max_tokens = 4096;   ///< per sequence
  int64_t max_bytes = 0;       ///< cap on page bytes in use (0 = none)
};

class HostStore {
 public:
  HostStore(Device* device, const HostStoreShape& shape);
  ~HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  /// Allocates the page table (pinned) and its device copy.
  Status Init();
  /// Device bytes a store of \p shape holds: the device copy of its page table (Init allocates
  /// exactly these; the pages themselves are host memory).
  [[nodiscard]] static int64_t DeviceTableBytes(const HostStoreShape& shape);
  /// Bytes of one page (K and V rows of page_tokens tokens) and pages per (slot, layer, head).
  [[nodiscard]] static int64_t PageBytes(const HostStoreShape& shape);
  [[nodiscard]] static int64_t MaxPages(const HostStoreShape& shape);

  /// Makes sure (slot, layer, every KV head) has pages for positions [0, new_len). On failure
  /// nothing is allocated.
  Status Reserve(int slot, int layer, int64_t new_len);
  /// Allocates (and pins) pages for at least \p bytes up front, in chunks of at most 1 GiB; they
  /// wait on the free list. Within max_bytes.
  Status Prepin(int64_t bytes);
  /// Returns every page of \p slot to the free list.
  void Release(int slot);

  [[nodiscard]] int64_t max_pages() const { return max_pages_; }
  /// The page table's copy in device memory as the kernels take it, from table \p first on: table
  /// t = (slot * num_layers + layer) * num_kv_heads + kv_head holds KvPages::pages of that head.
  /// Entries that Reserve set since the last FlushTable reach it with FlushTable.
  [[nodiscard]] StoreTable device_store(int64_t first = 0) const {
    return StoreTable{table_dev_ + first * max_pages_, max_pages_, shape_.page_tokens};
  }
  /// Enqueues on \p stream the copies of the table entries Reserve set since the last call.
  Status FlushTable(StreamHandle stream);

  [[nodiscard]] KvPages pages(int slot, int layer, int kv_head) const {
    return KvPages{table_ + TableIndex(slot, layer, kv_head, 0), shape_.page_tokens};
  }
  [[nodiscard]] void* k_row(int slot, int layer, int kv_head, int64_t pos) const {
    return const_cast<void*>(
        PagedKRow(pages(slot, layer, kv_head), pos, shape_.head_dim, row_elem_bytes_));
  }
  [[nodiscard]] void* v_row(int slot, int layer, int kv_head, int64_t pos) const {
    return const_cast<void*>(
        PagedVRow(pages(slot, layer, kv_head), pos, shape_.head_dim, row_elem_bytes_));
  }
  /// Bytes of one page (K and V rows of page_tokens tokens).
  [[nodiscard]] int64_t page_bytes() const { return page_bytes_; }
  /// Page bytes handed out now.
  [[nodiscard]] int64_t bytes_in_use() const { return pages_in_use_ * page_bytes_; }
  [[nodiscard]] int64_t bytes_reserved() const { return chunks_bytes_ + table_bytes_; }
  [[nodiscard]] const HostStoreShape& shape() const { return shape_; }

 private:
  [[nodiscard]] int64_t TableIndex(int slot, int layer, int kv_head, int64_t page) const {
    return ((static_cast<int64_t>(slot) * shape_.num_layers + layer) * shape_.num_kv_heads +
            kv_head) * max_pages_ + page;
  }
  Status Grow(int64_t pages);

  Device* device_;
  HostStoreShape shape_;
  size_t row_elem_bytes_;
  int64_t page_bytes_;
  int64_t max_pages_;
  void** table_ = nullptr;
  void** table_dev_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> dirty_;  // table entries [first, first + count)
  int64_t table_bytes_ = 0;
  std::vector<int64_t> pages_allocated_;  // per (slot, layer): pages each KV head has
  std::vector<void*> free_pages_;
  std::vector<void*> chunks_;
  int64_t chunks_bytes_ = 0;
  int64_t pages_in_use_ = 0;
};

}  // namespace kvferry
