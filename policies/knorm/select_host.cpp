// Copyright kvferry authors. Apache-2.0.
// The host twin of knorm's device selection: the host Select's own ranking (KnormPicks).
#include "cpu/select_items.h"
#include "policies/knorm/knorm.h"
#include "policies/knorm/select.h"

namespace kvferry::detail {

Status KnormSelectHost(const void* args) {
  return cpu::ForEachSelectItem(args, [](const DecodeStepArgs& a, const cpu::SelectItem& it) {
    return cpu::WriteRankedList(a, it.n, it.out, [&](const OffloadSplit& sp, int64_t c) {
      KnormPicks(it.kv, a.params, sp.off_lo, sp.off_hi, sp.k_off, it.out + c);
      return c + sp.k_off;
    });
  });
}

}  // namespace kvferry::detail
