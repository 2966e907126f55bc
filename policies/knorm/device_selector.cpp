// Copyright kvferry authors. Apache-2.0.
// knorm's device selector: no state between steps. The kernel scores every key by its norm and
// the shared top-k (gpu/decode_select.cu) takes the offloaded range's best.
#include <memory>
#include <span>
#include <vector>

#include "policies/device_selector.h"
#include "policies/knorm/knorm.h"
#include "policies/knorm/select.h"

namespace kvferry::detail {
namespace {

constexpr DeviceKernel kKnormSelect{"knorm select", KVF_CUDA_FN(cuda::KnormSelectCuda),
                                      &KnormSelectHost};

class KnormSelector final : public DeviceSelector {
 public:
  explicit KnormSelector(const SelectorShape& shape) : DeviceSelector(shape) {}
  Status Size(std::vector<SelectorBuffer>&) const override { return Status::Ok(); }
  Status Bind(std::span<void* const>, Device& device, StreamHandle) override {
    device_ = &device;
    return Status::Ok();
  }
  void Fill(DecodeStepArgs& a) const override { a.ranks = SelectRanks::kOffloaded; }
  const DeviceKernel& select_kernel() const override { return kKnormSelect; }
  // Every key of the item.
  int64_t KeyBytes(int64_t n, int64_t, int) const override {
    return n * static_cast<int64_t>(shape_.row_bytes);
  }
};

}  // namespace
}  // namespace kvferry::detail

namespace kvferry {

std::unique_ptr<detail::DeviceSelector> KnormPolicy::MakeDeviceSelector(
    const detail::SelectorShape& shape) const {
  return std::make_unique<detail::KnormSelector>(shape);
}

}  // namespace kvferry
