// Copyright kvferry authors. Apache-2.0.
// knorm's device selection: no state between steps (a StatelessSelector). The kernel (select.cu)
// scores every key by its norm and the shared top-k (gpu/decode_select.cu) takes the offloaded
// range's best; its host twin, here, ranks with the host Select's own KnormPicks.
#include <memory>

#include "cpu/select_items.h"
#include "policies/device_selector.h"
#include "policies/knorm/knorm.h"

namespace kvferry::cuda {
/// The selection of a step on the GPU (select.cu; args: DecodeStepArgs).
Status KnormSelectCuda(const void* args, const LaunchInfo& info, void* stream);
}  // namespace kvferry::cuda

namespace kvferry::detail {
namespace {

Status KnormSelectHost(const void* args) {
  return cpu::ForEachSelectItem(args, [](const DecodeStepArgs& a, const cpu::SelectItem& it) {
    return cpu::WriteRankedList(a, it.n, it.out, [&](const OffloadSplit& sp, int64_t c) {
      KnormPicks(it.kv, a.params, sp.off_lo, sp.off_hi, sp.k_off, it.out + c);
      return c + sp.k_off;
    });
  });
}

constexpr DeviceKernel kKnormSelect{"knorm select", KVF_CUDA_FN(cuda::KnormSelectCuda), &KnormSelectHost};

}  // namespace
}  // namespace kvferry::detail

namespace kvferry {

std::unique_ptr<detail::DeviceSelector> KnormPolicy::MakeDeviceSelector(
    const detail::SelectorShape& shape) const {
  return std::make_unique<detail::StatelessSelector>(shape, detail::kKnormSelect, SelectRanks::kOffloaded);
}

}  // namespace kvferry
