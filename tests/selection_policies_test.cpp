// Copyright kvferry authors. Apache-2.0.
// quest, sparcas, hip and kvpop through the Runtime (host backend): at a budget that covers every
// position each equals dense attention to fp32 rounding; under a small budget every selection
// keeps the contract (ascending, unique, in range, sinks and window, at most the budget) for GQA
// 1/3/4/8 and a batch of two; bad parameters fail at Create naming the parameter.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kvferry/kvferry.h"
#include "policies/policy.h"

namespace kvferry {
namespace {

const std::vector<std::string> kPolicies = {"quest", "sparcas", "hip", "kvpop"};

RuntimeConfig Config(const std::string& policy, int head_dim, int group, int64_t budget) {
  RuntimeConfig c;
  c.model.num_layers = 4;  // past the first layers sparcas/hip keep exact
  c.model.num_kv_heads = 2;
  c.model.num_q_heads = 2 * group;
  c.model.head_dim = head_dim;
  c.model.kv_dtype = DType::kBF16;
  c.capacity.max_sequences = 3;
  c.capacity.max_batch = 2;
  c.capacity.max_tokens_per_sequence = 4096;
  c.capacity.max_prefill_chunk = 2048;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 16;
  c.policy.name = policy;
  c.policy.budget_tokens = budget;
  c.backend = Backend::kHost;
  return c;
}

// Runs the same prefill + decode steps through a policy's runtime and a dense one; returns the
// largest relative L2 error of the decode outputs and checks every selection's contract.
double RunAgainstDense(const std::string& policy, int head_dim, int group, int64_t context,
                       int64_t budget, int batch, int steps, uint32_t seed) {
  auto rp = Runtime::Create(Config(policy, head_dim, group, budget));
  auto rd = Runtime::Create(Config("dense", head_dim, group, budget));
  EXPECT_TRUE(rp.ok()) << rp.status().ToString();
  EXPECT_TRUE(rd.ok()) << rd.status().ToString();
  if (!rp.ok() || !rd.ok()) return INFINITY;
  Runtime& a = *rp.value();
  Runtime& b = *rd.value();
  const RuntimeConfig c = Config(policy, head_dim, group, budget);
  const int hq = c.model.num_q_heads, hkv = c.model.num_kv_heads, d = head_dim;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  auto random = [&](int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = nd(rng);
    return x;
  };
  auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, d});
  };
  std::vector<SequenceId> seqs;
  for (int s = 0; s < batch; ++s) {
    seqs.push_back(10 + s);
    EXPECT_TRUE(a.AddSequence(10 + s).ok());
    EXPECT_TRUE(b.AddSequence(10 + s).ok());
    for (int layer = 0; layer < c.model.num_layers; ++layer) {
      const int64_t t = context + s;  // sequences of different lengths
      auto q = random(t * hq * d), k = random(t * hkv * d), v = random(t * hkv * d);
      std::vector<float> o1(q.size()), o2(q.size());
      EXPECT_TRUE(a.Prefill(10 + s, layer, view(q, t, hq), view(k, t, hkv), view(v, t, hkv),
                            view(o1, t, hq)).ok());
      EXPECT_TRUE(b.Prefill(10 + s, layer, view(q, t, hq), view(k, t, hkv), view(v, t, hkv),
                            view(o2, t, hq)).ok());
    }
  }
  double worst = 0;
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < c.model.num_layers; ++layer) {
      auto q = random(batch * hq * d), k = random(batch * hkv * d), v = random(batch * hkv * d);
      std::vector<float> o1(q.size(), NAN), o2(q.size(), NAN);
      Status s1 = a.Decode(seqs, layer, view(q, batch, hq), view(k, batch, hkv),
                           view(v, batch, hkv), view(o1, batch, hq));
      Status s2 = b.Decode(seqs, layer, view(q, batch, hq), view(k, batch, hkv),
                           view(v, batch, hkv), view(o2, batch, hq));
      EXPECT_TRUE(s1.ok()) << s1.ToString();
      EXPECT_TRUE(s2.ok()) << s2.ToString();
      if (!s1.ok() || !s2.ok()) return INFINITY;
      double num = 0, den = 0;
      for (size_t i = 0; i < o1.size(); ++i) {
        num += (o1[i] - o2[i]) * (o1[i] - o2[i]);
        den += o2[i] * o2[i];
      }
      EXPECT_GT(den, 0.0);
      worst = std::max(worst, std::sqrt(num / den));
      for (int s = 0; s < batch; ++s) {
        const int64_t n = context + s + step + 1;
        for (int h = 0; h < hkv; ++h) {
          auto sel = a.LastSelection(seqs[s], layer, h);
          EXPECT_TRUE(sel.ok());
          if (!sel.ok()) continue;
          const std::vector<int32_t>& p = sel.value();
          EXPECT_TRUE(std::is_sorted(p.begin(), p.end()));
          EXPECT_TRUE(std::adjacent_find(p.begin(), p.end()) == p.end());
          EXPECT_LE(static_cast<int64_t>(p.size()), std::max<int64_t>(budget, std::min<int64_t>(n, 20)));
          // Every policy fills the budget; hip up to twice its block size less 2 (bk = 2: one
          // token short when the offloaded budget is odd, one more when its mask holds the
          // offloaded range's last block, cut short).
          EXPECT_LE(static_cast<int64_t>(p.size()), std::min(n, budget)) << policy << " n " << n;
          EXPECT_GE(static_cast<int64_t>(p.size()), std::min(n, budget) - (policy == "hip" ? 2 : 0))
              << policy << " n " << n;
          if (!p.empty()) {
            EXPECT_GE(p.front(), 0);
            EXPECT_LT(p.back(), n);
            EXPECT_EQ(p.back(), n - 1) << "the new token is always attended";
          }
        }
      }
    }
  }
  return worst;
}

using FullParam = std::tuple<std::string, int, int, int64_t>;  // policy, head_dim, group, context
class SparsePolicyFullBudget : public ::testing::TestWithParam<FullParam> {};

TEST_P(SparsePolicyFullBudget, EqualsDense) {
  const auto& [policy, head_dim, group, context] = GetParam();
  const double err = RunAgainstDense(policy, head_dim, group, context, context + 8, 1, 3,
                                     static_cast<uint32_t>(head_dim * 131 + group * 7 + context));
  EXPECT_LT(err, 1e-5);
}

std::string FullName(const ::testing::TestParamInfo<FullParam>& info) {
  const auto& [policy, head_dim, group, context] = info.param;
  return policy + "_d" + std::to_string(head_dim) + "_g" + std::to_string(group) + "_n" +
         std::to_string(context);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SparsePolicyFullBudget,
    ::testing::Combine(::testing::ValuesIn(kPolicies), ::testing::Values(64, 128),
                       ::testing::Values(1, 3, 4, 8), ::testing::Values<int64_t>(1, 17, 97)),
    FullName);

using BudgetParam = std::tuple<std::string, int>;  // policy, group
class SparsePolicyUnderBudget : public ::testing::TestWithParam<BudgetParam> {};

TEST_P(SparsePolicyUnderBudget, KeepsTheContractForABatch) {
  const auto& [policy, group] = GetParam();
  // 4 + 16 resident + 43 offloaded picks of about 600; the output is a sparse approximation.
  const double err = RunAgainstDense(policy, 64, group, 601, 63, 2, 4, 1000u + group);
  // Random data spreads attention thinly, so the sparse output is far from dense: only finite.
  EXPECT_TRUE(std::isfinite(err));
}

std::string BudgetName(const ::testing::TestParamInfo<BudgetParam>& info) {
  return std::get<0>(info.param) + "_g" + std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Groups, SparsePolicyUnderBudget,
                         ::testing::Combine(::testing::ValuesIn(kPolicies),
                                            ::testing::Values(1, 3, 4, 8)),
                         BudgetName);

TEST(SparsePolicies, RegisteredAndBadParametersNamed) {
  const std::vector<std::string> names = PolicyNames();
  for (const std::string& p : kPolicies) {
    EXPECT_NE(std::find(names.begin(), names.end(), p), names.end()) << p;
    RuntimeConfig c = Config(p, 64, 3, 64);
    c.policy.params = {{"no_such_knob", 1.0}};
    auto r = Runtime::Create(c);
    ASSERT_FALSE(r.ok()) << p;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("no_such_knob"), std::string::npos)
        << r.status().message();
  }
  const std::vector<std::tuple<std::string, std::string, double>> bad = {
      {"quest", "page", 0}, {"sparcas", "d_b", 65}, {"sparcas", "u", -1}, {"hip", "bk", 0},
      {"hip", "r_m", 0.5}, {"kvpop", "scorer", 7}, {"kvpop", "gamma_max", 2}};
  for (const auto& [p, key, value] : bad) {
    RuntimeConfig c = Config(p, 64, 3, 64);
    c.policy.params = {{key, value}};
    auto r = Runtime::Create(c);
    ASSERT_FALSE(r.ok()) << p << " " << key;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace kvferry
