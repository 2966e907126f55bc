// Copyright kvferry authors. Apache-2.0.
// The one map from a policy's device scoring to its selector (policies/<name>/device_selector.cpp).
#include "policies/device_selector.h"

namespace kvferry::detail {

int64_t DeviceSelector::MctaMinRanked() const { return kSelectMctaMinKeys; }

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
