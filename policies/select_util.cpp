// Copyright kvferry authors. Apache-2.0.
#include "policies/select_util.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/attention.h"
#include "base/check.h"

namespace kvferry {

int64_t TopKAscendingIndices(const float* scores, int64_t count, int64_t k, int32_t base,
                             int32_t* out) {
  k = std::clamp<int64_t>(k, 0, count);
  if (k == 0) return 0;
  if (k == count) {
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(base + i);
    return count;
  }
  cpu::TopK(scores, count, k, out);  // descending score, ties lower index
  std::sort(out, out + k);
  for (int64_t i = 0; i < k; ++i) out[i] += base;
  return k;
}

void GroupSoftmaxSum(const float* logits, int group, int64_t count, int64_t ld, float* weights) {
  std::fill(weights, weights + count, 0.0f);
  for (int g = 0; g < group; ++g) cpu::SoftmaxAccumulate(logits + g * ld, count, 1.0f, weights);
}

Status CheckPolicyShape(const char* policy, const RuntimeConfig& config) {
  KVF_CHECK_ARG(config.capacity.max_sequences >= 1 && config.model.num_layers >= 1 &&
                    config.model.num_kv_heads >= 1 && config.model.head_dim >= 1,
                policy, " needs at least one sequence, layer and KV head and head_dim >= 1");
  return Status::Ok();
}

Result<int64_t> IntParam(const char* policy, const std::string& key, double value, int64_t lo,
                         int64_t hi) {
  KVF_CHECK_ARG(std::isfinite(value) && value == std::floor(value) &&
                    value >= static_cast<double>(lo) && value <= static_cast<double>(hi),
                policy, " parameter '", key, "' = ", value, " must be an integer in [", lo, ", ",
                hi, "]");
  return static_cast<int64_t>(value);
}

}  // namespace kvferry

namespace kvferry {

int64_t ExactOffloadedTopK(const SelectContext& ctx, const OffloadSplit& s,
                           std::vector<int32_t>& chosen) {
  thread_local std::vector<float> logits, weights;
  const int64_t n = ctx.n;
  logits.resize(static_cast<size_t>(ctx.params.group) * n);
  weights.resize(static_cast<size_t>(n));
  cpu::ScorePaged(ctx.params, ctx.q, ctx.kv, n, logits.data());
  GroupSoftmaxSum(logits.data(), ctx.params.group, n, n, weights.data());
  chosen.resize(static_cast<size_t>(std::max<int64_t>(s.k_off, 0)));
  return TopKAscendingIndices(weights.data() + s.off_lo, s.n_off(), s.k_off,
                              static_cast<int32_t>(s.off_lo), chosen.data());
}

}  // namespace kvferry
