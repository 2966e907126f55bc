// Copyright kvferry authors. Apache-2.0.
#include "policies/sparcas/device_selector.h"

#include <string>
#include <utility>
#include <vector>

#include "base/check.h"
#include "base/offload_split.h"
#include "policies/sparcas/select.h"
#include "policies/sparcas/sparcas.h"

namespace kvferry::detail {

SparcasSelector::SparcasSelector(std::string name, const SparcasStepArgs& args, const SelectorShape& shape)
    : DeviceSelector(shape), name_(std::move(name)), sp_(args) {}

Status SparcasSelector::CheckParams() const {
  KVF_CHECK_ARG(sp_.db >= 1 && sp_.u >= 1 && sp_.dense_layers >= 0 &&
                    (sp_.bits == 16 || (sp_.bits == 4 && sp_.db % 8 == 0)),
                "policy '", name_, "': d_b ", sp_.db, ", u ", sp_.u, ", dense_layers ",
                sp_.dense_layers, ", bits ", sp_.bits);
  return Status::Ok();
}

Status SparcasSelector::Size(std::vector<SelectorBuffer>& buffers) const {
  KVF_RETURN_IF_ERROR(CheckParams());
  const ModelShape& m = shape_.model;
  // Compact rows of every position an item may hold (meta_pages = max_tokens), its state and its
  // chosen dimensions.
  const int64_t elems = SparcasCompactOffset(shape_.max_sequences, 0, 0, m.num_layers, m.num_kv_heads,
                                             shape_.max_tokens, m.head_dim, sp_.db, sp_.dense_layers,
                                             sp_.bits);
  buffers.push_back({keys_part(), static_cast<size_t>(elems) * shape_.kv_elem});
  buffers.push_back({state_part(), shape_.items() * sizeof(SparcasState)});
  buffers.push_back({state_part(), shape_.items() * static_cast<size_t>(m.head_dim) * sizeof(int32_t)});
  if (sp_.smooth != 0) {  // the channel scales (base/sparcas_q4.h)
    buffers.push_back({state_part(), shape_.items() * static_cast<size_t>(m.head_dim) * sizeof(float)});
  }
  return Status::Ok();
}

Status SparcasSelector::Bind(std::span<void* const> buffers, Device& device, StreamHandle stream) {
  device_ = &device;
  meta_ = static_cast<char*>(buffers[0]);
  sp_.state = static_cast<SparcasState*>(buffers[1]);
  sp_.dims = static_cast<int32_t*>(buffers[2]);
  sp_.scales = sp_.smooth != 0 ? static_cast<float*>(buffers[3]) : nullptr;
  return Reset(-1, stream);
}

Status SparcasSelector::Reset(int slot, StreamHandle stream) {
  if (sp_.scales != nullptr) {
    // The channel scales start at zero: the CUDA selection takes their maxima by atomicMax.
    KVF_RETURN_IF_ERROR(ZeroItems(sp_.scales, slot, stream, /*wait=*/true,
                                  static_cast<size_t>(shape_.model.head_dim)));
  }
  return ZeroItems(sp_.state, slot, stream, /*wait=*/true);
}

namespace {
constexpr DeviceKernel kSparcasSelect{"sparcas select", KVF_CUDA_FN(cuda::SparcasSelectCuda),
                                      &SparcasSelectHost};
}  // namespace

const DeviceKernel& SparcasSelector::select_kernel() const { return kSparcasSelect; }

void SparcasSelector::Fill(DecodeStepArgs& a) const {
  a.ranks = SelectRanks::kOffloaded;
  a.meta = meta_;
  a.meta_pages = shape_.max_tokens;
  SetSelectorArgs(a, sp_);
}

int64_t SparcasSelector::CompactKeyBytes(int64_t n, int layer, bool ranks) const {
  if (!ranks) return 0;
  const int32_t dims = SparcasDimsOf(layer, sp_.dense_layers, sp_.db, shape_.model.head_dim);
  const int64_t row = SparcasRowElems(dims, SparcasBitsOf(layer, sp_.dense_layers, sp_.bits));
  return n * row * static_cast<int64_t>(shape_.kv_elem);
}

int64_t SparcasSelector::KeyBytes(int64_t n, int64_t budget, int layer) const {
  const OffloadSplit s = SplitPositions(n, shape_.sink, shape_.window, budget);
  return CompactKeyBytes(n, layer, s.k_off > 0 && !s.all);
}

}  // namespace kvferry::detail

namespace kvferry {

std::unique_ptr<detail::DeviceSelector> SparcasPolicy::MakeDeviceSelector(const detail::SelectorShape& shape) const {
  return std::make_unique<detail::SparcasSelector>(std::string(name()), device_args(shape.model.head_dim),
                                                   shape);
}

}  // namespace kvferry
