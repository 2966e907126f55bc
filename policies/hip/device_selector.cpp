// Copyright kvferry authors. Apache-2.0.
// HiP's device selection (select.cu): SparCas's compact rows with every dimension at
// 4 bits; per item a hierarchical mask of k_off / bk blocks kept in its blocks buffers and rebuilt
// every r_m ranked steps. Layers below HipDense take SparCas's path. With lag 1 on CUDA a due
// rebuild runs beside the step on a stream of the selector's own (select.cu's HipDeferredCuda) and is
// used from the item's next ranked step.
#include <algorithm>
#include <string>
#include <vector>

#include "base/check.h"
#include "policies/hip/mask.h"
#include "base/offload_split.h"
#include "policies/hip/select.h"
#include "policies/sparcas/device_selector.h"
#include "policies/hip/hip.h"

namespace kvferry::detail {
namespace {

constexpr DeviceKernel kHipSelect{"hip select", KVF_CUDA_FN(cuda::HipSelectCuda), &HipSelectHost};
// The host backend builds a due mask inside the selection: nothing beside the step.
constexpr DeviceKernel kHipDeferred{"hip deferred rebuilds", KVF_CUDA_FN(cuda::HipDeferredCuda),
                                    [](const void*) { return Status::Ok(); }};

class HipSelector final : public SparcasSelector {
 public:
  HipSelector(const HipPolicy& policy, const HipSelectArgs& args, const SelectorShape& shape)
      : SparcasSelector(std::string(policy.name()), args.sparcas, shape), hip_(args.hip) {
    hip_.max_nodes = static_cast<int32_t>(std::max<int64_t>(shape.item_cap / std::max(hip_.bk, 1), 1));
  }
  ~HipSelector() override { Release(); }

  Status Size(std::vector<SelectorBuffer>& buffers) const override {
    KVF_RETURN_IF_ERROR(CheckParams());
    // The cached masks: k_off / bk blocks at most (k_off <= the item budget).
    KVF_CHECK_ARG(hip_.bk >= 1 && hip_.r_m >= 1 && hip_.rep >= 0 && hip_.rep <= 3 &&
                      sp_.db == shape_.model.head_dim && sp_.bits == 4 &&
                      shape_.item_cap / hip_.bk <= kHipMaxNodes,
                  "policy '", name_, "': bk ", hip_.bk, ", r_m ", hip_.r_m, ", rep ", hip_.rep,
                  ", a budget of ", shape_.item_cap, " tokens over ", kHipMaxNodes, " nodes");
    KVF_RETURN_IF_ERROR(SparcasSelector::Size(buffers));
    const size_t items = shape_.items();
    buffers.push_back({state_part(), items * sizeof(HipState)});
    buffers.push_back({state_part(), items * 2 * static_cast<size_t>(hip_.max_nodes) * sizeof(int32_t)});
    // Each item's build query: CUDA's side stream builds a requested mask from it (lag 1), drift
    // compares the step's query with it. The host backend's twin builds a requested mask at once.
    if (side() || drift()) {
      buffers.push_back({state_part(), items * static_cast<size_t>(HipQueryWords(shape_.group, shape_.model.head_dim)) *
                                           sizeof(uint32_t)});
    }
    return Status::Ok();
  }
  int extra_streams() const override { return side() ? 1 : 0; }
  bool runs_beside_step() const override { return hip_.lag != 0; }

  Status Bind(std::span<void* const> buffers, Device& device, StreamHandle stream) override {
    device_ = &device;
    hip_.state = static_cast<HipState*>(buffers[3]);
    hip_.blocks = static_cast<int32_t*>(buffers[4]);
    if (side() || drift()) hip_.query = static_cast<uint32_t*>(buffers[5]);
    if (side()) {
      KVF_ASSIGN_OR_RETURN(side_stream_, device.CreateStream());
      KVF_ASSIGN_OR_RETURN(fork_, device.CreateEvent());
      KVF_ASSIGN_OR_RETURN(join_, device.CreateEvent());
    }
    return SparcasSelector::Bind(buffers.first(3), device, stream);
  }
  void Release() override {
    if (side_stream_ == nullptr) return;
    device_->SynchronizeStream(side_stream_).IgnoreError();
    device_->DestroyEvent(fork_);
    device_->DestroyEvent(join_);
    device_->DestroyStream(side_stream_);
    side_stream_ = nullptr;
  }
  Status Reset(int slot, StreamHandle stream) override {
    KVF_RETURN_IF_ERROR(Join(-1, stream));  // the masks' side rebuilds first
    if (hip_.state != nullptr) {  // a zero count: the next ranked step builds the mask
      KVF_RETURN_IF_ERROR(ZeroItems(hip_.state, slot, stream, /*wait=*/false));
    }
    return SparcasSelector::Reset(slot, stream);
  }

  const DeviceKernel& select_kernel() const override { return kHipSelect; }
  void Fill(DecodeStepArgs& a) const override {
    SparcasSelector::Fill(a);
    SetSelectorArgs(a, HipSelectArgs{sp_, hip_});
  }
  // The mask's state advances when it ranks: a layer that takes the previous one's list still does.
  bool ranking_skippable() const override { return false; }
  Status AfterSelect(const DecodeStepArgs& a, int layer, StreamHandle stream) override {
    if (side_stream_ == nullptr || layer < Dense()) return Status::Ok();
    KVF_RETURN_IF_ERROR(device_->RecordEvent(fork_, stream));
    KVF_RETURN_IF_ERROR(device_->WaitEvent(side_stream_, fork_));
    KVF_RETURN_IF_ERROR(device_->Run(kHipDeferred, &a, side_stream_));
    side_layer_ = std::max(side_layer_, layer);
    return Status::Ok();
  }
  Status Join(int layer, StreamHandle stream) override {
    if (side_layer_ < 0 || (layer >= 0 && layer > side_layer_)) return Status::Ok();
    KVF_RETURN_IF_ERROR(device_->RecordEvent(join_, side_stream_));
    KVF_RETURN_IF_ERROR(device_->WaitEvent(stream, join_));
    side_layer_ = -1;
    return Status::Ok();
  }

  int64_t KeyBytes(int64_t n, int64_t budget, int layer) const override {
    const OffloadSplit s = SplitPositions(n, shape_.sink, shape_.window, budget);
    const bool ranks = s.k_off > 0 && !s.all;
    if (layer < Dense()) return CompactKeyBytes(n, layer, ranks);  // SparCas's path, every key
    // The mask's representative rows when it is rebuilt, averaged over its r_m steps: an
    // iteration scores at most 2 K' branches of bk rows, until the nodes of about nb / K' blocks
    // are one block each.
    const int64_t bk = hip_.bk;
    if (!ranks || s.k_off < bk) return 0;
    const int64_t nb = (s.n_off() + bk - 1) / bk, kn = s.k_off / bk;
    int64_t iters = 0;
    for (int64_t len = (nb + kn - 1) / kn; len > 1; len = (len + 1) / 2) ++iters;
    const int64_t row = SparcasRowElems(shape_.model.head_dim, 4) * static_cast<int64_t>(shape_.kv_elem);
    return iters * 2 * kn * bk * row / std::max(hip_.r_m, 1);
  }
  int32_t ListBlock(int layer) const override { return layer >= Dense() ? hip_.bk : 0; }

 private:
  const char* keys_part() const override { return "hip compact keys"; }
  const char* state_part() const override { return "hip selection state"; }
  // The first layer its mask ranks (below it, SparCas's path).
  int Dense() const { return std::max(sp_.dense_layers, hip_.dense_layers); }
  bool side() const { return hip_.lag != 0 && shape_.cuda; }
  bool drift() const { return hip_.drift > 0.0f; }

  HipStepArgs hip_;  // its parameters and, from Bind, its buffers
  StreamHandle side_stream_ = nullptr;
  EventHandle fork_ = nullptr, join_ = nullptr;
  int side_layer_ = -1;  // the last layer with a rebuild beside the stream, -1: joined
};

}  // namespace

}  // namespace kvferry::detail

namespace kvferry {

std::unique_ptr<detail::DeviceSelector> HipPolicy::MakeDeviceSelector(const detail::SelectorShape& shape) const {
  if (!device()) return nullptr;
  return std::make_unique<detail::HipSelector>(*this, device_args(shape.model.head_dim), shape);
}

}  // namespace kvferry
