// Copyright kvferry authors. Apache-2.0.
// What every device selector shares (policies/<name>/device_selector.cpp holds each policy's).
#include "policies/device_selector.h"

namespace kvferry::detail {

int64_t DeviceSelector::MctaMinRanked() const { return kSelectMctaMinKeys; }

std::pair<size_t, size_t> DeviceSelector::ItemsOf(int slot) const {
  const size_t per_slot = static_cast<size_t>(shape_.model.num_layers) * shape_.model.num_kv_heads;
  if (slot < 0) return {0, per_slot * shape_.max_sequences};
  return {static_cast<size_t>(slot) * per_slot, per_slot};
}

}  // namespace kvferry::detail
