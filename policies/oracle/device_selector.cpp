// Copyright kvferry authors. Apache-2.0.
// The oracle's device selection (SelectScoring::kExactTopK): the exact top-k of the group's summed
// softmax weight over every key. It keeps no state between steps.
#include "policies/device_selector.h"

namespace kvferry::detail {
namespace {

class ExactTopKSelector final : public DeviceSelector {
 public:
  explicit ExactTopKSelector(const SelectorShape& shape) : DeviceSelector(shape) {}
  SelectScoring scoring() const override { return SelectScoring::kExactTopK; }
  Status Size(std::vector<SelectorBuffer>&) const override { return Status::Ok(); }
  Status Bind(std::span<void* const>, Device& device, StreamHandle) override {
    device_ = &device;
    return Status::Ok();
  }
  void Fill(DecodeStepArgs&) const override {}
  // Every key of the item.
  int64_t KeyBytes(int64_t n, int64_t, int) const override {
    return n * static_cast<int64_t>(shape_.row_bytes);
  }
};

}  // namespace

std::unique_ptr<DeviceSelector> MakeExactTopKSelector(const Policy&, const SelectorShape& shape) {
  return std::make_unique<ExactTopKSelector>(shape);
}

}  // namespace kvferry::detail
