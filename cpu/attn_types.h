// Copyright kvferry authors. Apache-2.0.
#pragma once
// Plain work descriptors shared by the scalar reference, the CPU fast paths and the CUDA kernels.
// Every pointer is valid for the memory space of whoever executes the work (host pointers for the
// CPU, device or mapped pinned-host pointers for CUDA). Nothing here owns memory.

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

/// Address of the K (or V) row of \p pos in \p kv.
inline const void* PagedKRow(const KvPages& kv, int64_t pos, int head_dim, size_t elem) {
  const char* page = static_cast<const char*>(kv.pages[pos / kv.page_tokens]);
  return page + static_cast<size_t>(pos % kv.page_tokens) * head_dim * elem;
}
inline const void* PagedVRow(const KvPages& kv, int64_t pos, int head_dim, size_t elem) {
  const char* page = static_cast<const char*>(kv.pages[pos / kv.page_tokens]);
  return page + (static_cast<size_t>(kv.page_tokens) + pos % kv.page_tokens) * head_dim * elem;
}

/// Attention of one GQA group (group query heads sharing a KV head) over an explicit list of KV
/// rows, in any order. Output o is normalised; lse[g] = log(sum_j exp(scale * q_g . k_j)) in
/// natural log. With count == 0: o = 0 and lse = -inf.
struct RowAttnItem {
  const float* q = nullptr;       ///< [group, head_dim] fp32
  float* o = nullptr;             ///< [group, head_dim] fp32
  float* lse = nullptr;           ///< [group]
  const void* const* k_rows = nullptr;  ///< [count] row addresses
  const void* const* v_rows = nullptr;  ///< [count]
  int32_t count = 0;
};

/// Causal attention of num_q consecutive queries (positions q_pos0 .. q_pos0+num_q-1) of one GQA
/// group over the paged rows of one KV head: query t attends positions [0, q_pos0 + t].
/// Decode over everything is num_q = 1, q_pos0 = n - 1.
struct PagedAttnItem {
  const float* q = nullptr;  ///< [num_q, group, head_dim] fp32
  float* o = nullptr;        ///< [num_q, group, head_dim] fp32
  float* lse = nullptr;      ///< [num_q, group]
  KvPages kv;
  int64_t q_pos0 = 0;
  int32_t num_q = 1;
};

}  // namespace kvferry
