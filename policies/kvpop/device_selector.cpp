// Copyright kvferry authors. Apache-2.0.
// KVpop's device selection (select.cu): per item the long-range slots (position,
// priority) of the largest budget, and every (layer, KV head)'s scorer (the policy's table,
// uploaded at Bind). A token leaving the window is scored and competes for a slot.
#include <algorithm>
#include <vector>

#include "base/check.h"
#include "policies/kvpop/score.h"
#include "base/offload_split.h"
#include "policies/device_selector.h"
#include "policies/kvpop/select.h"
#include "policies/kvpop/kvpop.h"

namespace kvferry::detail {
namespace {

constexpr DeviceKernel kKvpopSelect{"kvpop select", KVF_CUDA_FN(cuda::KvpopSelectCuda), &KvpopSelectHost};

class KvpopSelector final : public DeviceSelector {
 public:
  KvpopSelector(const KvpopPolicy& policy, const SelectorShape& shape)
      : DeviceSelector(shape), policy_(policy) {
    k_.hidden = policy.device_hidden();
    k_.cap = std::max<int64_t>(shape.item_cap, 1);
  }

  Status Size(std::vector<SelectorBuffer>& buffers) const override {
    const ModelShape& m = shape_.model;
    KVF_CHECK_ARG(k_.hidden >= 0 && k_.hidden <= kKvpopMaxHidden && m.head_dim <= kKvpopMaxHeadDim,
                  "policy '", policy_.name(), "': a scorer of hidden width ", k_.hidden, " (at most ",
                  kKvpopMaxHidden, ") at head_dim ", m.head_dim, " (at most ", kKvpopMaxHeadDim,
                  ") on the device; kvpop's 'device' = 0 selects on the host");
    const char* part = "kvpop selection state (slots, priorities, scorers)";
    const size_t items = shape_.items();
    buffers.push_back({part, items * sizeof(KvpopState)});
    buffers.push_back({part, items * static_cast<size_t>(k_.cap) * (sizeof(int32_t) + sizeof(float))});
    buffers.push_back({part, ScorerFloats() * sizeof(float)});
    return Status::Ok();
  }
  // No ranking of every key: neither top-k workspace.
  bool uses_topk_ws() const override { return false; }
  int64_t RankedCap(int64_t) const override { return 0; }

  Status Bind(std::span<void* const> buffers, Device& device, StreamHandle stream) override {
    device_ = &device;
    k_.state = static_cast<KvpopState*>(buffers[0]);
    k_.pos = static_cast<int32_t*>(buffers[1]);
    k_.prio = reinterpret_cast<float*>(k_.pos + shape_.items() * static_cast<size_t>(k_.cap));
    float* scorer = static_cast<float*>(buffers[2]);
    k_.scorer = scorer;
    KVF_ASSIGN_OR_RETURN(std::vector<float> table, policy_.device_select_table(shape_.model));
    KVF_CHECK_CODE(table.size() == ScorerFloats(), StatusCode::kInternal, "policy '", policy_.name(),
                   "': a scorer table of ", table.size(), " floats for hidden width ", k_.hidden);
    KVF_RETURN_IF_ERROR(device.CopyAsync(scorer, table.data(), table.size() * sizeof(float), stream));
    seen_.assign(static_cast<size_t>(shape_.max_sequences) * shape_.model.num_layers, 0);
    return Reset(-1, stream);
  }
  Status Reset(int slot, StreamHandle stream) override {  // no slots, nothing scored yet
    const size_t layers = static_cast<size_t>(shape_.model.num_layers);
    std::fill(seen_.begin() + (slot < 0 ? 0 : static_cast<size_t>(slot) * layers),
              slot < 0 ? seen_.end() : seen_.begin() + (static_cast<size_t>(slot) + 1) * layers, int64_t{0});
    return ZeroItems(k_.state, slot, stream, /*wait=*/true);
  }

  const DeviceKernel& select_kernel() const override { return kKvpopSelect; }
  void Fill(DecodeStepArgs& a) const override {
    a.ranks = SelectRanks::kOffloaded;  // its kernel writes the list; CheckSelectArgs reads it
    SetSelectorArgs(a, k_);  // catchup 0: BeforeSelect's
  }
  // The slots' state advances at every step: a layer that takes the previous one's list ranks.
  bool ranking_skippable() const override { return false; }
  // The catch-up scored by a grid over the GPU (KvpopScoreKernel) when a prompt was stored since
  // an item's last step: 473 ms for the first step after a 128K prompt against 4155 ms with the
  // selection kernel's one CTA an item (H200). Speed only: the device state decides what is
  // scored.
  void BeforeSelect(DecodeStepArgs& a, std::span<const int> slots, std::span<const int64_t> positions,
                    int layer) override {
    if (!shape_.cuda) return;
    const int64_t sink = shape_.sink;
    for (size_t b = 0; b < slots.size(); ++b) {
      const int64_t n = positions[b] + 1;
      const int64_t off_hi = std::max(std::min(sink, n), n - shape_.window);
      int64_t& seen = seen_[static_cast<size_t>(slots[b]) * shape_.model.num_layers + layer];
      if (off_hi - std::max(seen, std::min(sink, n)) > 1) {
        KvpopStepArgs k = KvpopArgsOf(a);
        k.catchup = 1;
        SetSelectorArgs(a, k);
      }
      seen = off_hi;
    }
  }
  // The K and V rows of the token that left the window (no key is ranked against a query).
  int64_t KeyBytes(int64_t n, int64_t budget, int) const override {
    const OffloadSplit s = SplitPositions(n, shape_.sink, shape_.window, budget);
    return s.off_hi > s.off_lo ? 2 * static_cast<int64_t>(shape_.row_bytes) : 0;
  }

 private:
  size_t ScorerFloats() const {
    return static_cast<size_t>(shape_.model.num_layers) * shape_.model.num_kv_heads *
           static_cast<size_t>(KvpopScorerFloats(k_.hidden, 2 * shape_.model.head_dim));
  }

  const KvpopPolicy& policy_;
  KvpopStepArgs k_;  // the parameters and, from Bind, the buffers a step takes
  // Per (slot, layer) the offloaded range's end at its last decode step, as the host saw it.
  std::vector<int64_t> seen_;
};

}  // namespace

}  // namespace kvferry::detail

namespace kvferry {

std::unique_ptr<detail::DeviceSelector> KvpopPolicy::MakeDeviceSelector(const detail::SelectorShape& shape) const {
  if (params_.device == 0) return nullptr;  // the host selects
  return std::make_unique<detail::KvpopSelector>(*this, shape);
}

}  // namespace kvferry
