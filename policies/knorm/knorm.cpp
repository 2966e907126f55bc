// Copyright kvferry authors. Apache-2.0.
#include "policies/knorm/knorm.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/check.h"
#include "base/offload_split.h"
#include "policies/policy.h"

namespace kvferry {

void KnormPicks(const KvPages& kv, const AttnParams& params, int64_t lo, int64_t hi, int64_t k,
                  int32_t* out) {
  if (k <= 0 || hi <= lo) return;
  // Calls for different heads run concurrently: per-thread scratch.
  thread_local std::vector<float> row, norm;
  thread_local std::vector<int32_t> order;
  row.resize(static_cast<size_t>(params.head_dim));
  norm.resize(static_cast<size_t>(hi - lo));
  for (int64_t j = lo; j < hi; ++j) {
    LoadKvRowF32(kv, params, j, /*value=*/false, row.data());
    float s = 0.0f;
    for (float x : row) s += x * x;
    norm[static_cast<size_t>(j - lo)] = std::sqrt(s);
  }
  order.resize(norm.size());
  std::iota(order.begin(), order.end(), 0);
  const int64_t take = std::min<int64_t>(k, hi - lo);
  std::partial_sort(order.begin(), order.begin() + take, order.end(), [](int32_t a, int32_t b) {
    return norm[a] < norm[b] || (norm[a] == norm[b] && a < b);
  });
  std::sort(order.begin(), order.begin() + take);
  for (int64_t i = 0; i < take; ++i) out[i] = static_cast<int32_t>(lo + order[i]);
}

Status KnormPolicy::Select(const SelectContext& ctx, std::vector<int32_t>& out) {
  const OffloadSplit s = SplitPositions(ctx.n, ctx.sink, ctx.window, ctx.budget);
  out.clear();
  if (s.all) {
    for (int64_t i = 0; i < ctx.n; ++i) out.push_back(static_cast<int32_t>(i));
    return Status::Ok();
  }
  for (int64_t i = 0; i < s.sink; ++i) out.push_back(static_cast<int32_t>(i));
  const size_t c = out.size();
  out.resize(c + static_cast<size_t>(std::max<int64_t>(s.k_off, 0)));
  KnormPicks(ctx.kv, ctx.params, s.off_lo, s.off_hi, s.k_off, out.data() + c);
  for (int64_t i = s.off_hi; i < ctx.n; ++i) out.push_back(static_cast<int32_t>(i));
  return Status::Ok();
}

Result<std::unique_ptr<Policy>> MakeKnormPolicy(const RuntimeConfig& config) {
  KVF_CHECK_ARG(config.policy.params.empty(), "policy 'knorm' takes no parameters, got '",
                config.policy.params.empty() ? "" : config.policy.params.begin()->first, "'");
  return std::unique_ptr<Policy>(new KnormPolicy());
}

}  // namespace kvferry
