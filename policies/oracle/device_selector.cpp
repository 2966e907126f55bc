// Copyright kvferry authors. Apache-2.0.
// The oracle's device selection (select.cu): the exact top-k of the group's summed
// softmax weight over every key. It keeps no state between steps.
#include "policies/device_selector.h"
#include "policies/oracle/select.h"

namespace kvferry::detail {
namespace {

constexpr DeviceKernel kExactSelect{"oracle select", KVF_CUDA_FN(cuda::ExactSelectCuda), &ExactSelectHost};

class ExactTopKSelector final : public DeviceSelector {
 public:
  explicit ExactTopKSelector(const SelectorShape& shape) : DeviceSelector(shape) {}
  Status Size(std::vector<SelectorBuffer>&) const override { return Status::Ok(); }
  Status Bind(std::span<void* const>, Device& device, StreamHandle) override {
    device_ = &device;
    return Status::Ok();
  }
  void Fill(DecodeStepArgs& a) const override { a.ranks = SelectRanks::kPositions; }
  const DeviceKernel& select_kernel() const override { return kExactSelect; }
  // Every key of the item.
  int64_t KeyBytes(int64_t n, int64_t, int) const override {
    return n * static_cast<int64_t>(shape_.row_bytes);
  }
};

}  // namespace

std::unique_ptr<DeviceSelector> MakeExactTopKSelector(const SelectorShape& shape) {
  return std::make_unique<ExactTopKSelector>(shape);
}

}  // namespace kvferry::detail
