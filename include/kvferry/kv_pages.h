// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file kv_pages.h
/// \brief How a policy sees the stored KV rows of one (sequence, layer, KV head): the attention
/// parameters and the host store's pages. Plain descriptors, shared by the library's kernels;
/// nothing here owns memory.

#include <cstddef>
#include <cstdint>

#include "kvferry/tensor.h"

namespace kvferry {

/// Parameters common to a batch of attention work.
struct AttnParams {
  int32_t group = 1;      ///< query heads per KV head (GQA ratio)
  int32_t head_dim = 128;
  DType kv_dtype = DType::kBF16;  ///< dtype of K and V rows
  float scale = 0.0f;     ///< softmax scale applied to q.k
};

/// The host store's pages of one (sequence, layer, KV head). Page p holds positions
/// [p*page_tokens, (p+1)*page_tokens): first page_tokens K rows, then page_tokens V rows, each row
/// head_dim contiguous elements.
struct KvPages {
  void* const* pages = nullptr;
  int32_t page_tokens = 256;
};

/// Address of the K (or V) row of \p pos in \p kv; \p elem is DTypeSize of the KV dtype.
inline const void* PagedKRow(const KvPages& kv, int64_t pos, int head_dim, size_t elem) {
  const char* page = static_cast<const char*>(kv.pages[pos / kv.page_tokens]);
  return page + static_cast<size_t>(pos % kv.page_tokens) * head_dim * elem;
}
inline const void* PagedVRow(const KvPages& kv, int64_t pos, int head_dim, size_t elem) {
  const char* page = static_cast<const char*>(kv.pages[pos / kv.page_tokens]);
  return page + (static_cast<size_t>(kv.page_tokens) + pos % kv.page_tokens) * head_dim * elem;
}

}  // namespace kvferry
