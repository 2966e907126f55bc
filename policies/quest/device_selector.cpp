// Copyright kvferry authors. Apache-2.0.
// Quest's device selection (select.cu): per page of page_tokens keys the element-wise min and
// max (PageBoundsArgs), extended at each store of rows (its page-bounds kernel) and by the
// selection for the new token; the pages' bounds on q.k rank them.
#include <algorithm>

#include "base/check.h"
#include "base/offload_split.h"
#include "policies/device_selector.h"
#include "policies/quest/select.h"
#include "policies/quest/quest.h"

namespace kvferry::detail {
namespace {

constexpr DeviceKernel kQuestSelect{"quest select", KVF_CUDA_FN(cuda::QuestSelectCuda), &QuestSelectHost};
constexpr DeviceKernel kPageBounds{"quest page bounds", KVF_CUDA_FN(cuda::QuestPageBoundsCuda),
                                   &QuestPageBoundsHost};

class QuestSelector final : public DeviceSelector {
 public:
  QuestSelector(const QuestPolicy& policy, const SelectorShape& shape)
      : DeviceSelector(shape), name_(policy.name()), page_(policy.params().page) {
    pages_ = page_ >= 1 ? (shape.max_tokens + page_ - 1) / page_ : 0;
  }

  Status Size(std::vector<SelectorBuffer>& buffers) const override {
    KVF_CHECK_ARG(page_ >= 1, "policy '", name_, "': page of ", page_, " tokens");
    buffers.push_back({"quest page bounds", shape_.items() * static_cast<size_t>(pages_) * 2 * shape_.row_bytes});
    return Status::Ok();
  }
  // An item ranks its pages: the multi-CTA top-k takes items of enough pages.
  int64_t RankedCap(int64_t select_ld) const override { return (select_ld + page_ - 1) / page_ + 1; }
  int64_t MctaMinRanked() const override { return SelectMctaMinPages(); }

  Status Bind(std::span<void* const> buffers, Device& device, StreamHandle) override {
    device_ = &device;
    meta_ = static_cast<char*>(buffers[0]);
    return Status::Ok();
  }
  bool tracks_store() const override { return true; }
  Status OnStored(int slot, int layer, int64_t pos0, int64_t new_len, const StoreTable& store,
                  StreamHandle stream) override {
    const ModelShape& m = shape_.model;
    PageBoundsArgs a;
    a.params = AttnParams{shape_.group, m.head_dim, m.kv_dtype, shape_.scale};
    a.num_kv_heads = m.num_kv_heads;
    a.num_layers = m.num_layers;
    a.layer = layer;
    a.slot = slot;
    a.pos0 = pos0;
    a.new_len = new_len;
    a.store = store;
    a.meta = meta_;
    a.meta_pages = pages_;
    a.meta_page = page_;
    return device_->Run(kPageBounds, &a, stream);
  }

  const DeviceKernel& select_kernel() const override { return kQuestSelect; }
  void Fill(DecodeStepArgs& a) const override {
    a.ranks = SelectRanks::kPages;
    a.meta = meta_;
    a.meta_pages = pages_;
    a.meta_page = page_;
  }
  // The min and max rows of the pages over the offloaded range (ItemSplitOf in
  // gpu/decode_select.cu splits it alike).
  int64_t KeyBytes(int64_t n, int64_t budget, int) const override {
    const OffloadSplit s = SplitPositions(n, shape_.sink, shape_.window, budget);
    if (s.k_off <= 0 || s.all) return 0;
    const int64_t p_lo = s.off_lo / page_;
    const int64_t pages = (s.off_hi - 1) / page_ + 1 - p_lo;
    return pages * 2 * static_cast<int64_t>(shape_.row_bytes);
  }

 private:
  std::string name_;
  int32_t page_ = 16;
  int64_t pages_ = 0;
  char* meta_ = nullptr;
};

}  // namespace

}  // namespace kvferry::detail

namespace kvferry {

std::unique_ptr<detail::DeviceSelector> QuestPolicy::MakeDeviceSelector(const detail::SelectorShape& shape) const {
  return std::make_unique<detail::QuestSelector>(*this, shape);
}

}  // namespace kvferry
