// Copyright kvferry authors. Apache-2.0.
// The host twins of knorm's device kernels: the norms kept in the selector's buffer as the CUDA
// kernels keep them, ranked by the host Select's own KnormPicks.
#include <vector>

#include "cpu/select_items.h"
#include "policies/knorm/knorm.h"
#include "policies/knorm/select.h"

namespace kvferry::detail {
namespace {

float RowNorm(const KvPages& kv, const AttnParams& params, int64_t j) {
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(params.head_dim));
  LoadKvRowF32(kv, params, j, /*value=*/false, row.data());
  return KnormOf(row.data(), params.head_dim);
}

}  // namespace

Status KnormStoreHost(const void* args) {
  const KnormStoreArgs& a = *static_cast<const KnormStoreArgs*>(args);
  for (int h = 0; h < a.num_kv_heads; ++h) {
    const int64_t t = (static_cast<int64_t>(a.slot) * a.num_layers + a.layer) * a.num_kv_heads + h;
    const KvPages kv{a.store.pages + t * a.store.max_pages, a.store.page_tokens};
    float* norms = a.state.norms + t * a.state.cap;
    for (int64_t j = a.pos0; j < a.new_len; ++j) norms[j] = RowNorm(kv, a.params, j);
  }
  return Status::Ok();
}

Status KnormSelectHost(const void* args) {
  return cpu::ForEachSelectItem(args, [](const DecodeStepArgs& a, const cpu::SelectItem& it) {
    const KnormStepArgs s = SelectorArgsOf<KnormStepArgs>(a);
    float* norms = s.norms + it.t * s.cap;
    norms[it.n - 1] = RowNorm(it.kv, a.params, it.n - 1);  // the new token, written through
    return cpu::WriteRankedList(a, it.n, it.out, [&](const OffloadSplit& sp, int64_t c) {
      KnormPicks(norms, sp.off_lo, sp.off_hi, sp.k_off, it.out + c);
      return c + sp.k_off;
    });
  });
}

}  // namespace kvferry::detail
