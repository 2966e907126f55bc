// Copyright kvferry authors. Apache-2.0.
#include "offload/host_store.h"

#include <algorithm>
#include <cstring>

#include "base/check.h"

namespace kvferry {
namespace {
// Pages are carved from chunks of about this many bytes, so pinning cost is paid rarely.
constexpr int64_t kChunkBytes = int64_t{8} << 20;
constexpr int64_t kMaxChunkBytes = int64_t{1} << 30;
}  // namespace

HostStore::HostStore(Device* device, const HostStoreShape& shape)
    : device_(device),
      shape_(shape),
      row_elem_bytes_(DTypeSize(shape.kv_dtype)),
      page_bytes_(PageBytes(shape)),
      max_pages_(MaxPages(shape)) {}

HostStore::~HostStore() {
  for (void* c : chunks_) device_->FreeHost(c);
  if (table_ != nullptr) device_->FreeHost(table_);
  if (table_dev_ != nullptr) device_->FreeDevice(table_dev_);
}

int64_t HostStore::PageBytes(const HostStoreShape& shape) {
  return int64_t{2} * shape.page_tokens * shape.head_dim *
         static_cast<int64_t>(DTypeSize(shape.kv_dtype));
}

int64_t HostStore::MaxPages(const HostStoreShape& shape) {
  return (shape.max_tokens + shape.page_tokens - 1) / shape.page_tokens;
}

int64_t HostStore::DeviceTableBytes(const HostStoreShape& shape) {
  return static_cast<int64_t>(shape.max_slots) * shape.num_layers * shape.num_kv_heads *
         MaxPages(shape) * static_cast<int64_t>(sizeof(void*));
}

Status HostStore::Init() {
  // The pinned table and its device copy have the same size.
  table_bytes_ = DeviceTableBytes(shape_);
  KVF_ASSIGN_OR_RETURN(void* table, device_->AllocHost(static_cast<size_t>(table_bytes_)));
  table_ = static_cast<void**>(table);
  std::memset(table_, 0, static_cast<size_t>(table_bytes_));
  KVF_ASSIGN_OR_RETURN(void* table_dev, device_->AllocDevice(static_cast<size_t>(table_bytes_)));
  table_dev_ = static_cast<void**>(table_dev);
  KVF_RETURN_IF_ERROR(device_->CopyAsync(table_dev_, table_, static_cast<size_t>(table_bytes_),
                                         device_->default_stream()));
  KVF_RETURN_IF_ERROR(device_->SynchronizeStream(device_->default_stream()));
  pages_allocated_.assign(static_cast<size_t>(shape_.max_slots) * shape_.num_layers, 0);
  return Status::Ok();
}

Status HostStore::Prepin(int64_t bytes) {
  int64_t pages = (bytes + page_bytes_ - 1) / page_bytes_;
  if (shape_.max_bytes > 0) pages = std::min(pages, (shape_.max_bytes - chunks_bytes_) / page_bytes_);
  const int64_t per_chunk = std::max<int64_t>(1, kMaxChunkBytes / page_bytes_);
  while (pages > 0) {
    const int64_t n = std::min(pages, per_chunk);
    KVF_ASSIGN_OR_RETURN(void* chunk, device_->AllocHost(static_cast<size_t>(n * page_bytes_)));
    chunks_.push_back(chunk);
    chunks_bytes_ += n * page_bytes_;
    for (int64_t i = n - 1; i >= 0; --i) free_pages_.push_back(static_cast<char*>(chunk) + i * page_bytes_);
    pages -= n;
  }
  return Status::Ok();
}

Status HostStore::Grow(int64_t pages) {
  // Chunks grow with the store (a quarter of what it holds, 8 MiB to 1 GiB), so that filling
  // tens of GiB pins memory in a few dozen calls rather than thousands; never past max_bytes.
  const int64_t grown = std::clamp<int64_t>(chunks_bytes_ / 4, kChunkBytes, kMaxChunkBytes);
  int64_t chunk_pages = std::max<int64_t>({1, grown / page_bytes_, pages});
  if (shape_.max_bytes > 0) {
    chunk_pages = std::max(pages, std::min(chunk_pages, (shape_.max_bytes - chunks_bytes_) / page_bytes_));
  }
  KVF_ASSIGN_OR_RETURN(void* chunk, device_->AllocHost(static_cast<size_t>(chunk_pages * page_bytes_)));
  chunks_.push_back(chunk);
  chunks_bytes_ += chunk_pages * page_bytes_;
  for (int64_t i = chunk_pages - 1; i >= 0; --i) {
    free_pages_.push_back(static_cast<char*>(chunk) + i * page_bytes_);
  }
  return Status::Ok();
}

Status HostStore::Reserve(int slot, int layer, int64_t new_len) {
  KVF_CHECK_CODE(new_len <= shape_.max_tokens, StatusCode::kResourceExhausted, "sequence length ",
                 new_len, " exceeds max_tokens_per_sequence ", shape_.max_tokens);
  int64_t& have = pages_allocated_[static_cast<size_t>(slot) * shape_.num_layers + layer];
  const int64_t need = (new_len + shape_.page_tokens - 1) / shape_.page_tokens;
  if (need <= have) return Status::Ok();
  const int64_t new_pages = (need - have) * shape_.num_kv_heads;
  if (shape_.max_bytes > 0 && (pages_in_use_ + new_pages) * page_bytes_ > shape_.max_bytes) {
    return ResourceExhausted(detail::StrCat("host store limit of ", shape_.max_bytes,
                                            " bytes reached (", pages_in_use_ * page_bytes_,
                                            " in use, ", new_pages * page_bytes_, " requested)"));
  }
  if (static_cast<int64_t>(free_pages_.size()) < new_pages) {
    KVF_RETURN_IF_ERROR(Grow(new_pages - static_cast<int64_t>(free_pages_.size())));
  }
  for (int h = 0; h < shape_.num_kv_heads; ++h) {
    for (int64_t p = have; p < need; ++p) {
      table_[TableIndex(slot, layer, h, p)] = free_pages_.back();
      free_pages_.pop_back();
    }
    dirty_.emplace_back(TableIndex(slot, layer, h, have), need - have);
  }
  pages_in_use_ += new_pages;
  have = need;
  return Status::Ok();
}

Status HostStore::FlushTable(StreamHandle stream) {
  // The pinned entries are not rewritten before the copy runs: only Release clears them, after
  // the runtime has waited for its streams.
  for (const auto& [first, count] : dirty_) {
    KVF_RETURN_IF_ERROR(device_->CopyAsync(table_dev_ + first, table_ + first,
                                           static_cast<size_t>(count) * sizeof(void*), stream));
  }
  dirty_.clear();
  return Status::Ok();
}

void HostStore::Release(int slot) {
  for (int l = 0; l < shape_.num_layers; ++l) {
    int64_t& have = pages_allocated_[static_cast<size_t>(slot) * shape_.num_layers + l];
    for (int h = 0; h < shape_.num_kv_heads; ++h) {
      for (int64_t p = 0; p < have; ++p) {
        void*& entry = table_[TableIndex(slot, l, h, p)];
        free_pages_.push_back(entry);
        entry = nullptr;
      }
    }
    pages_in_use_ -= have * shape_.num_kv_heads;
    have = 0;
  }
}

}  // namespace kvferry
