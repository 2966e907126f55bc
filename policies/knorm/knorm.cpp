// Copyright kvferry authors. Apache-2.0.
#include "policies/knorm/knorm.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/check.h"
#include "base/offload_split.h"
#include "policies/knorm/select.h"
#include "policies/policy.h"

namespace kvferry {

float KnormOf(const float* row, int d) {
  float s = 0.0f;
  for (int i = 0; i < d; ++i) s += row[i] * row[i];
  return std::sqrt(s);
}

void KnormPicks(const float* norms, int64_t lo, int64_t hi, int64_t k, int32_t* out) {
  if (k <= 0 || hi <= lo) return;
  thread_local std::vector<int32_t> order;  // calls for different heads run concurrently
  order.resize(static_cast<size_t>(hi - lo));
  std::iota(order.begin(), order.end(), 0);
  const float* nm = norms + lo;
  const int64_t take = std::min<int64_t>(k, hi - lo);
  std::partial_sort(order.begin(), order.begin() + take, order.end(), [nm](int32_t a, int32_t b) {
    return nm[a] < nm[b] || (nm[a] == nm[b] && a < b);
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
  // The norms of the offloaded keys, at their positions' offsets.
  thread_local std::vector<float> row, norms;
  row.resize(static_cast<size_t>(ctx.params.head_dim));
  norms.resize(static_cast<size_t>(s.off_hi));
  for (int64_t j = s.off_lo; j < s.off_hi; ++j) {
    LoadKvRowF32(ctx.kv, ctx.params, j, /*value=*/false, row.data());
    norms[static_cast<size_t>(j)] = KnormOf(row.data(), ctx.params.head_dim);
  }
  KnormPicks(norms.data(), s.off_lo, s.off_hi, s.k_off, out.data() + c);
  for (int64_t i = s.off_hi; i < ctx.n; ++i) out.push_back(static_cast<int32_t>(i));
  return Status::Ok();
}

Result<std::unique_ptr<Policy>> MakeKnormPolicy(const RuntimeConfig& config) {
  KVF_CHECK_ARG(config.policy.params.empty(), "policy 'knorm' takes no parameters, got '",
                config.policy.params.empty() ? "" : config.policy.params.begin()->first, "'");
  return std::unique_ptr<Policy>(new KnormPolicy());
}

}  // namespace kvferry
