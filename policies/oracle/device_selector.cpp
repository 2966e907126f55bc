// Copyright kvferry authors. Apache-2.0.
// The oracle's device selection (select.cu): the exact top-k of the group's summed
// softmax weight over every key. It keeps no state between steps.
#include <memory>

#include "policies/device_selector.h"
#include "policies/oracle/select.h"

namespace kvferry::detail {
namespace {

constexpr DeviceKernel kExactSelect{"oracle select", KVF_CUDA_FN(cuda::ExactSelectCuda), &ExactSelectHost};

}  // namespace

std::unique_ptr<DeviceSelector> MakeExactTopKSelector(const SelectorShape& shape) {
  return std::make_unique<StatelessSelector>(shape, kExactSelect, SelectRanks::kPositions);
}

}  // namespace kvferry::detail
