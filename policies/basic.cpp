// Copyright kvferry authors. Apache-2.0.
// The three reference policies: dense (everything), streaming (StreamingLLM: sinks + recent
// window) and oracle (exact top-k of the GQA group's summed softmax weight; the accuracy ceiling).
#include "policies/basic.h"
#include "policies/device_selector.h"
#include "policies/oracle/select.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/attention.h"
#include "base/check.h"

namespace kvferry {
namespace {

class DensePolicy final : public Policy {
 public:
  std::string_view name() const override { return "dense"; }
  Placement placement() const override { return Placement::kGpu; }
  bool is_dense() const override { return true; }
  bool selects_sinks_and_recent() const override { return true; }
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    out.resize(static_cast<size_t>(ctx.n));
    for (int64_t i = 0; i < ctx.n; ++i) out[i] = static_cast<int32_t>(i);
    return Status::Ok();
  }
};

class StreamingPolicy final : public Policy {
 public:
  std::string_view name() const override { return "streaming"; }
  Placement placement() const override { return Placement::kGpu; }
  bool selects_sinks_and_recent() const override { return true; }
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    StreamingSelect(ctx.n, ctx.sink, ctx.budget, out);
    return Status::Ok();
  }
};

class OraclePolicy final : public Policy {
 public:
  std::string_view name() const override { return "oracle"; }
  Placement placement() const override { return Placement::kGpu; }
  std::unique_ptr<detail::DeviceSelector> MakeDeviceSelector(const detail::SelectorShape& shape) const override {
    return detail::MakeExactTopKSelector(shape);
  }
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    OracleSelect(ctx, out);
    return Status::Ok();
  }
};

}  // namespace

void StreamingSelect(int64_t n, int sink, int64_t budget, std::vector<int32_t>& out) {
  out.clear();
  const StepRange r = SinksAndRecent(n, sink, budget);
  for (int64_t i = 0; i < r.sinks; ++i) out.push_back(static_cast<int32_t>(i));
  for (int64_t i = r.recent_begin; i < n; ++i) out.push_back(static_cast<int32_t>(i));
}

void GroupAttentionWeights(const SelectContext& ctx, std::vector<float>& logits,
                           std::vector<float>& weights) {
  const int64_t n = ctx.n;
  const int group = ctx.params.group;
  logits.resize(static_cast<size_t>(n) * group);
  weights.assign(static_cast<size_t>(n), 0.0f);
  cpu::ScorePaged(ctx.params, ctx.q, ctx.kv, n, logits.data());
  for (int g = 0; g < group; ++g) {
    cpu::SoftmaxAccumulate(logits.data() + static_cast<int64_t>(g) * n, n, 1.0f, weights.data());
  }
}

void OracleSelect(const SelectContext& ctx, std::vector<int32_t>& out) {
  thread_local std::vector<float> logits, weights;
  out.resize(static_cast<size_t>(std::min(ctx.budget, ctx.n)));
  cpu::ExactTopKSelect(ctx.params, ctx.q, ctx.kv, ctx.n, ctx.budget, logits, weights, out.data());
}

Result<std::unique_ptr<Policy>> MakeBasicPolicy(const RuntimeConfig& config) {
  const std::string& name = config.policy.name;
  if (!config.policy.params.empty()) {
    return InvalidArgument(detail::StrCat("policy '", name, "' takes no parameters, got '",
                                          config.policy.params.begin()->first, "'"));
  }
  if (name == "dense") return std::unique_ptr<Policy>(new DensePolicy());
  if (name == "streaming") return std::unique_ptr<Policy>(new StreamingPolicy());
  if (name == "oracle") return std::unique_ptr<Policy>(new OraclePolicy());
  return NotFound(detail::StrCat("no basic policy '", name, "'"));
}

}  // namespace kvferry
