// Copyright kvferry authors. Apache-2.0.
#pragma once
// Quest (Tang et al., ICML'24; the baseline SparCas and HiP compare against): per page of `page`
// tokens the element-wise min and max of its keys bound every q.k in the page from above,
// sum_d max(q_d min_d, q_d max_d); the pages with the best bounds are attended.
//
// Host reference. The bounds of a (slot, layer, KV head) live in the policy and are extended
// incrementally from ctx.kv for positions not yet seen (the GPU port keeps the same arrays on the
// device and extends them at append). GQA: a page's score is the largest, over the group's query
// heads, of its scaled bound minus that head's best page bound (each head normalised to its own
// maximum, the "max logit" aggregation for proxies in docs/policies.md). Pages are ranked over the
// offloaded range [sink, n - window); a page cut by the range contributes only its offloaded
// positions; the page that overflows k_off contributes its first positions. Ties: lower page.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "policies/policy.h"
#include "policies/select_util.h"

namespace kvferry {

// ---- numeric core (pure functions; the CUDA port is tested against these) ----------------------

/// Element-wise bounds of \p count key rows: keys row-major [count][head_dim] fp32;
/// out_min[d] = min_j keys[j][d], out_max[d] = max_j keys[j][d]. count == 0 gives +inf / -inf.
void QuestPageBounds(const float* keys, int64_t count, int head_dim, float* out_min,
                     float* out_max);

/// Extends one page's bounds by one key row (min/max in place).
void QuestExtendBounds(const float* key, int head_dim, float* min, float* max);

/// Upper bounds of q.k for every page: mins, maxs [num_pages][head_dim] fp32; q [group][head_dim]
/// fp32; out [group][num_pages] = scale * sum_d max(q_d * min_d, q_d * max_d), summed in ascending
/// d in fp32 (an empty page, min = +inf, gives -inf or NaN: callers skip it).
void QuestUpperBoundScores(const float* q, int group, int head_dim, const float* mins,
                           const float* maxs, int64_t num_pages, float scale, float* out);

/// The group's page score from the bounds above: score[p] = max_g (ub[g][p] - max_p' ub[g][p'])
/// over pages [0, num_pages); ld is the row stride of ub.
void QuestGroupPageScores(const float* ub, int group, int64_t num_pages, int64_t ld, float* score);

// ---- policy -------------------------------------------------------------------------------------

struct QuestParams {
  int page = 16;  ///< "page": tokens per page, in [1, 4096]
};

/// Parses config.policy.params ("page"); unknown keys and bad values are kInvalidArgument.
Result<QuestParams> ParseQuestParams(const std::map<std::string, double>& params);

class QuestPolicy final : public Policy {
 public:
  QuestPolicy(const QuestParams& params, int max_sequences, int num_layers, int num_kv_heads);
  [[nodiscard]] std::string_view name() const override { return "quest"; }
  [[nodiscard]] Placement placement() const override { return Placement::kGpu; }
  /// Inside a planned step the device keeps the page bounds and selects (policies/quest/select.cu).
  [[nodiscard]] std::unique_ptr<detail::DeviceSelector> MakeDeviceSelector(
      const detail::SelectorShape& shape) const override;
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override;
  void OnSequenceRemoved(int slot) override { states_.RemoveSlot(slot); }
  [[nodiscard]] const QuestParams& params() const { return params_; }

 private:
  struct HeadState {
    int64_t seen = 0;         ///< positions [0, seen) are in the bounds
    std::vector<float> mins;  ///< [pages][head_dim]
    std::vector<float> maxs;
  };
  QuestParams params_;
  HeadStateTable<HeadState> states_;
};

Result<std::unique_ptr<Policy>> MakeQuestPolicy(const RuntimeConfig& config);

}  // namespace kvferry
