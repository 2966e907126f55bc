// Copyright kvferry authors. Apache-2.0.
#include "policies/quest/quest.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/check.h"

namespace kvferry {

void QuestPageBounds(const float* keys, int64_t count, int head_dim, float* out_min,
                     float* out_max) {
  std::fill(out_min, out_min + head_dim, std::numeric_limits<float>::infinity());
  std::fill(out_max, out_max + head_dim, -std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < count; ++j) QuestExtendBounds(keys + j * head_dim, head_dim, out_min, out_max);
}

void QuestExtendBounds(const float* key, int head_dim, float* min, float* max) {
  for (int d = 0; d < head_dim; ++d) {
    min[d] = std::min(min[d], key[d]);
    max[d] = std::max(max[d], key[d]);
  }
}

void QuestUpperBoundScores(const float* q, int group, int head_dim, const float* mins,
                           const float* maxs, int64_t num_pages, float scale, float* out) {
  for (int g = 0; g < group; ++g) {
    const float* qg = q + static_cast<int64_t>(g) * head_dim;
    for (int64_t p = 0; p < num_pages; ++p) {
      const float* lo = mins + p * head_dim;
      const float* hi = maxs + p * head_dim;
      float s = 0.0f;
      for (int d = 0; d < head_dim; ++d) s += std::max(qg[d] * lo[d], qg[d] * hi[d]);
      out[g * num_pages + p] = scale * s;
    }
  }
}

void QuestGroupPageScores(const float* ub, int group, int64_t num_pages, int64_t ld, float* score) {
  std::fill(score, score + num_pages, -std::numeric_limits<float>::infinity());
  for (int g = 0; g < group; ++g) {
    const float* u = ub + g * ld;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_pages; ++p) mx = std::max(mx, u[p]);
    for (int64_t p = 0; p < num_pages; ++p) score[p] = std::max(score[p], u[p] - mx);
  }
}

Result<QuestParams> ParseQuestParams(const std::map<std::string, double>& params) {
  static const ParamSpec<QuestParams> kTable[] = {{"page", &QuestParams::page, 1, 4096}};
  return ParseParams<QuestParams>("quest", params, kTable);
}

QuestPolicy::QuestPolicy(const QuestParams& params, int max_sequences, int num_layers,
                         int num_kv_heads)
    : params_(params), states_(max_sequences, num_layers, num_kv_heads) {}

Status QuestPolicy::Select(const SelectContext& ctx, std::vector<int32_t>& out) {
  KVF_ASSIGN_OR_RETURN(HeadState * st, states_.ForSelect("quest", ctx));
  const AttnParams& p = ctx.params;
  const int hd = p.head_dim;
  const int64_t n = ctx.n;
  const int64_t page = params_.page;
  // Extend the bounds with the positions stored since the last call (the append hook's work).
  if (st->seen > n) st->seen = 0, st->mins.clear(), st->maxs.clear();  // a new sequence
  const int64_t pages_n = (n + page - 1) / page;
  if (static_cast<int64_t>(st->mins.size()) < pages_n * hd) {
    st->mins.resize(static_cast<size_t>(pages_n * hd), std::numeric_limits<float>::infinity());
    st->maxs.resize(static_cast<size_t>(pages_n * hd), -std::numeric_limits<float>::infinity());
  }
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(hd));
  for (int64_t pos = st->seen; pos < n; ++pos) {
    LoadRowF32(ctx.kv, p, pos, false, row.data());
    const int64_t pg = pos / page;
    QuestExtendBounds(row.data(), hd, st->mins.data() + pg * hd, st->maxs.data() + pg * hd);
  }
  st->seen = n;

  const OffloadSplit s = SplitPositions(n, ctx.sink, ctx.window, ctx.budget);
  if (s.all) {
    SelectAll(n, out);
    return Status::Ok();
  }
  if (s.k_off <= 0) {
    FinishSelection(s, nullptr, 0, out);
    return Status::Ok();
  }
  // Pages overlapping the offloaded range.
  const int64_t p_lo = s.off_lo / page, p_hi = (s.off_hi - 1) / page + 1;
  const int64_t np = p_hi - p_lo;
  thread_local std::vector<float> ub, score;
  thread_local std::vector<int32_t> order, chosen;
  ub.resize(static_cast<size_t>(p.group * np));
  score.resize(static_cast<size_t>(np));
  QuestUpperBoundScores(ctx.q, p.group, hd, st->mins.data() + p_lo * hd,
                        st->maxs.data() + p_lo * hd, np, p.scale, ub.data());
  QuestGroupPageScores(ub.data(), p.group, np, np, score.data());
  // Pages by score (descending, ties lower page), until k_off positions are taken.
  order.resize(static_cast<size_t>(np));
  for (int64_t i = 0; i < np; ++i) order[i] = static_cast<int32_t>(i);
  const auto better = [&](int32_t a, int32_t b) {
    const float sa = score[a] == score[a] ? score[a] : -std::numeric_limits<float>::infinity();
    const float sb = score[b] == score[b] ? score[b] : -std::numeric_limits<float>::infinity();
    return sa > sb || (sa == sb && a < b);
  };
  // Enough pages to fill k_off even if every one is cut (at most k_off + 2 pages).
  const int64_t want_pages = std::min<int64_t>(np, s.k_off / page + 2);
  std::partial_sort(order.begin(), order.begin() + want_pages, order.end(), better);
  chosen.clear();
  int64_t left = s.k_off;
  for (int64_t i = 0; i < np && left > 0; ++i) {
    if (i == want_pages) {  // rare: more cut pages than foreseen
      std::sort(order.begin() + i, order.end(), better);
    }
    const int64_t pg = p_lo + order[i];
    const int64_t a = std::max(pg * page, s.off_lo);
    const int64_t b = std::min((pg + 1) * page, s.off_hi);
    for (int64_t pos = a; pos < b && left > 0; ++pos, --left) chosen.push_back(static_cast<int32_t>(pos));
  }
  std::sort(chosen.begin(), chosen.end());
  FinishSelection(s, chosen.data(), static_cast<int64_t>(chosen.size()), out);
  return Status::Ok();
}

Result<std::unique_ptr<Policy>> MakeQuestPolicy(const RuntimeConfig& config) {
  KVF_ASSIGN_OR_RETURN(QuestParams params, ParseQuestParams(config.policy.params));
  KVF_RETURN_IF_ERROR(CheckPolicyShape("quest", config));
  return std::unique_ptr<Policy>(new QuestPolicy(params, config.capacity.max_sequences,
                                                 config.model.num_layers,
                                                 config.model.num_kv_heads));
}

}  // namespace kvferry
