// Copyright kvferry authors. Apache-2.0.
// Run-time dispatch of the CPU attention entry points. (Scalar reference only for now; the SIMD
// implementations slot in ahead of it.)
#include "cpu/attention.h"

#include <vector>

#include "cpu/reference.h"

namespace kvferry::cpu {

void AttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items) {
  for (int64_t i = 0; i < num_items; ++i) AttendRowsRef(p, items[i]);
}

void AttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items) {
  for (int64_t i = 0; i < num_items; ++i) AttendPagedRef(p, items[i]);
}

void ScorePaged(const AttnParams& p, const float* q, const KvPages& kv, int64_t n, float* logits) {
  const size_t elem = DTypeSize(p.kv_dtype);
  std::vector<const void*> rows(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) rows[j] = PagedKRow(kv, j, p.head_dim, elem);
  ScoreRowsRef(p, q, rows.data(), static_cast<int32_t>(n), logits);
}

void TopK(const float* scores, int64_t n, int64_t k, int32_t* out_indices) {
  TopKRef(scores, n, k, out_indices);
}

const char* AttendRowsImplName() { return "scalar"; }

}  // namespace kvferry::cpu
