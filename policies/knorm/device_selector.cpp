// Copyright kvferry authors. Apache-2.0.
// knorm's device selector: one float a stored key (its L2 norm), written when rows are stored
// (OnStored: prefill, appends outside the planned step) and by the selection for the step's new
// token; the selection ranks them with the shared top-k (gpu/decode_select.cu).
#include <memory>
#include <span>
#include <vector>

#include "policies/device_selector.h"
#include "policies/knorm/knorm.h"
#include "policies/knorm/select.h"

namespace kvferry::detail {
namespace {

constexpr DeviceKernel kKnormSelect{"knorm select", KVF_CUDA_FN(cuda::KnormSelectCuda), &KnormSelectHost};
constexpr DeviceKernel kKnormStore{"knorm store", KVF_CUDA_FN(cuda::KnormStoreCuda), &KnormStoreHost};

class KnormSelector final : public DeviceSelector {
 public:
  explicit KnormSelector(const SelectorShape& shape) : DeviceSelector(shape) { s_.cap = shape.max_tokens; }
  Status Size(std::vector<SelectorBuffer>& buffers) const override {
    buffers.push_back({"knorm key norms", shape_.items() * static_cast<size_t>(s_.cap) * sizeof(float)});
    return Status::Ok();
  }
  Status Bind(std::span<void* const> buffers, Device& device, StreamHandle) override {
    device_ = &device;
    s_.norms = static_cast<float*>(buffers[0]);
    return Status::Ok();
  }
  // Nothing to reset: a position's norm is written when it is stored, before any step reads it.
  bool tracks_store() const override { return true; }
  Status OnStored(int slot, int layer, int64_t pos0, int64_t new_len, const StoreTable& store,
                  StreamHandle stream) override {
    const ModelShape& m = shape_.model;
    KnormStoreArgs a;
    a.params = AttnParams{shape_.group, m.head_dim, m.kv_dtype, shape_.scale};
    a.num_kv_heads = m.num_kv_heads;
    a.num_layers = m.num_layers;
    a.layer = layer;
    a.slot = slot;
    a.pos0 = pos0;
    a.new_len = new_len;
    a.store = store;
    a.state = s_;
    return device_->Run(kKnormStore, &a, stream);
  }
  void Fill(DecodeStepArgs& a) const override {
    a.ranks = SelectRanks::kOffloaded;
    SetSelectorArgs(a, s_);
  }
  const DeviceKernel& select_kernel() const override { return kKnormSelect; }
  // The selection stores the new token's norm: a layer that takes the previous one's list ranks.
  bool ranking_skippable() const override { return false; }
  // One float a position, every step.
  int64_t KeyBytes(int64_t n, int64_t, int) const override { return n * static_cast<int64_t>(sizeof(float)); }

 private:
  KnormStepArgs s_;  // the buffer Bind took
};

}  // namespace
}  // namespace kvferry::detail

namespace kvferry {

std::unique_ptr<detail::DeviceSelector> KnormPolicy::MakeDeviceSelector(
    const detail::SelectorShape& shape) const {
  return std::make_unique<detail::KnormSelector>(shape);
}

}  // namespace kvferry
