// Copyright kvferry authors. Apache-2.0.
// The host twin of the oracle's device selection (policies/oracle/select.cu): the exact top-k of
// every key's group-summed softmax weight (cpu::ExactTopKSelect).
#include <vector>

#include "cpu/attention.h"
#include "cpu/select_items.h"
#include "policies/oracle/select.h"

namespace kvferry::detail {

Status ExactSelectHost(const void* args) {
  return cpu::ForEachSelectItem(args, [](const DecodeStepArgs& a, const cpu::SelectItem& it) {
    thread_local std::vector<float> logits, weights;
    cpu::ExactTopKSelect(a.params, it.q, it.kv, it.n, it.k, logits, weights, it.out);
    return it.k;
  });
}

}  // namespace kvferry::detail
