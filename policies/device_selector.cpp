// Copyright kvferry authors. Apache-2.0.
// The one map from a policy's device scoring to its selector (policies/<name>/device_selector.cpp).
#include "policies/device_selector.h"

namespace kvferry::detail {

int64_t DeviceSelector::MctaMinRanked() const { return kSelectMctaMinKeys; }

std::pair<size_t, size_t> DeviceSelector::ItemsOf(int slot) const {
  const size_t per_slot = static_cast<size_t>(shape_.model.num_layers) * shape_.model.num_kv_heads;
  if (slot < 0) return {0, per_slot * shape_.max_sequences};
  return {static_cast<size_t>(slot) * per_slot, per_slot};
}

std::unique_ptr<DeviceSelector> MakeDeviceSelector(const Policy& policy, const SelectorShape& shape) {
  switch (policy.device_scoring()) {
    case SelectScoring::kExactTopK: return MakeExactTopKSelector(policy, shape);
    case SelectScoring::kQuestPages: return MakeQuestSelector(policy, shape);
    case SelectScoring::kSparcas: return MakeSparcasSelector(policy, shape);
    case SelectScoring::kHip: return MakeHipSelector(policy, shape);
    case SelectScoring::kKvpop: return MakeKvpopSelector(policy, shape);
    default: return nullptr;
  }
}

}  // namespace kvferry::detail
