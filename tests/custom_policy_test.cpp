// Copyright kvferry authors. Apache-2.0.
// A policy registered from outside the library through the public kvferry/policy.h (this file
// includes no internal header): it is listed by PolicyNames(), Runtime::Create accepts it, the
// runtime calls its Select and attends exactly what it returns, and with a budget that covers
// every position it equals dense attention to fp32 rounding (host backend). Unknown names and
// names the registry refuses still fail. examples/custom_policy is the longer version.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvferry/kvferry.h"
#include "kvferry/policy.h"

namespace kvferry {
namespace {

std::atomic<int64_t> g_selects{0};

// Sinks, the oldest offloaded positions the budget leaves room for, and the window: a selection
// that is easy to state and far from the recent positions.
class OldestPolicy final : public Policy {
 public:
  std::string_view name() const override { return "test_custom_oldest"; }
  Placement placement() const override { return Placement::kGpu; }
  bool selection_covers_resident() const override { return true; }
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    g_selects.fetch_add(1, std::memory_order_relaxed);
    const int64_t n = ctx.n, sink = std::min<int64_t>(ctx.sink, n);
    const int64_t off_hi = std::max(sink, n - ctx.window);
    const int64_t k_off = std::clamp<int64_t>(ctx.budget - (sink + n - off_hi), 0, off_hi - sink);
    out.clear();
    for (int64_t i = 0; i < sink + k_off; ++i) out.push_back(static_cast<int32_t>(i));
    for (int64_t i = off_hi; i < n; ++i) out.push_back(static_cast<int32_t>(i));
    return Status::Ok();
  }
};

Result<std::unique_ptr<Policy>> MakeOldest(const RuntimeConfig& c) {
  if (!c.policy.params.empty()) {
    return InvalidArgument("policy 'test_custom_oldest' takes no parameters, got '" +
                           c.policy.params.begin()->first + "'");
  }
  return std::unique_ptr<Policy>(new OldestPolicy());
}

// Registered during static initialisation, as an extension linked into an engine would.
const bool kRegisteredAtStart = RegisterPolicy("test_custom_oldest", MakeOldest);

RuntimeConfig Config(const std::string& policy, int64_t budget, int group) {
  RuntimeConfig c;
  c.model.num_layers = 2;
  c.model.num_kv_heads = 2;
  c.model.num_q_heads = 2 * group;
  c.model.head_dim = 64;
  c.model.kv_dtype = DType::kBF16;
  c.capacity.max_sequences = 2;
  c.capacity.max_batch = 2;
  c.capacity.max_tokens_per_sequence = 1024;
  c.capacity.max_prefill_chunk = 512;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 16;
  c.policy.name = policy;
  c.policy.budget_tokens = budget;
  c.backend = Backend::kHost;
  return c;
}

struct RunResult {
  double max_abs = INFINITY;  // largest |a - b| of the decode outputs
  double rel_l2 = INFINITY;   // largest relative L2 error of one decode output
  std::vector<std::vector<int32_t>> selections;  // LastSelection of every (step, layer, seq, head)
};

// The same prompt and decode steps through \p policy's runtime and a dense one (batch 2).
RunResult RunAgainstDense(const std::string& policy, int64_t budget, int group, int64_t context,
                          int steps, uint32_t seed) {
  RunResult res;
  auto ra = Runtime::Create(Config(policy, budget, group));
  auto rb = Runtime::Create(Config("dense", budget, group));
  EXPECT_TRUE(ra.ok()) << ra.status().ToString();
  EXPECT_TRUE(rb.ok()) << rb.status().ToString();
  if (!ra.ok() || !rb.ok()) return res;
  Runtime& a = *ra.value();
  Runtime& b = *rb.value();
  const RuntimeConfig c = Config(policy, budget, group);
  const int hq = c.model.num_q_heads, hkv = c.model.num_kv_heads, d = c.model.head_dim;
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
  const std::vector<SequenceId> seqs = {3, 4};
  for (size_t s = 0; s < seqs.size(); ++s) {
    EXPECT_TRUE(a.AddSequence(seqs[s]).ok());
    EXPECT_TRUE(b.AddSequence(seqs[s]).ok());
    for (int layer = 0; layer < c.model.num_layers; ++layer) {
      const int64_t t = context + static_cast<int64_t>(s) * 7;  // different lengths
      auto q = random(t * hq * d), k = random(t * hkv * d), v = random(t * hkv * d);
      std::vector<float> o1(q.size()), o2(q.size());
      EXPECT_TRUE(a.Prefill(seqs[s], layer, view(q, t, hq), view(k, t, hkv), view(v, t, hkv),
                            view(o1, t, hq)).ok());
      EXPECT_TRUE(b.Prefill(seqs[s], layer, view(q, t, hq), view(k, t, hkv), view(v, t, hkv),
                            view(o2, t, hq)).ok());
    }
  }
  const int64_t batch = static_cast<int64_t>(seqs.size());
  res.max_abs = 0;
  res.rel_l2 = 0;
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < c.model.num_layers; ++layer) {
      auto q = random(batch * hq * d), k = random(batch * hkv * d), v = random(batch * hkv * d);
      std::vector<float> o1(q.size(), NAN), o2(q.size(), NAN);
      const Status s1 = a.Decode(seqs, layer, view(q, batch, hq), view(k, batch, hkv),
                                 view(v, batch, hkv), view(o1, batch, hq));
      const Status s2 = b.Decode(seqs, layer, view(q, batch, hq), view(k, batch, hkv),
                                 view(v, batch, hkv), view(o2, batch, hq));
      EXPECT_TRUE(s1.ok()) << s1.ToString();
      EXPECT_TRUE(s2.ok()) << s2.ToString();
      if (!s1.ok() || !s2.ok()) {
        res.max_abs = res.rel_l2 = INFINITY;
        return res;
      }
      for (int64_t r = 0; r < batch; ++r) {
        double num = 0, den = 0;
        for (int64_t i = r * hq * d; i < (r + 1) * hq * d; ++i) {
          const double e = double{o1[i]} - o2[i];
          res.max_abs = std::max(res.max_abs, std::abs(e));
          num += e * e;
          den += double{o2[i]} * o2[i];
        }
        res.rel_l2 = std::max(res.rel_l2, std::sqrt(num / den));
        for (int h = 0; h < hkv; ++h) {
          auto sel = a.LastSelection(seqs[r], layer, h);
          EXPECT_TRUE(sel.ok()) << sel.status().ToString();
          res.selections.push_back(sel.ok() ? sel.value() : std::vector<int32_t>{});
        }
      }
    }
  }
  return res;
}

TEST(CustomPolicy, RegisteredFromOutsideIsListedAndCreated) {
  ASSERT_TRUE(kRegisteredAtStart);
  const std::vector<std::string> names = PolicyNames();
  EXPECT_NE(std::find(names.begin(), names.end(), "test_custom_oldest"), names.end());
  auto made = Runtime::Create(Config("test_custom_oldest", 64, 2));
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  // Its factory's parameter check is the one Create reports.
  RuntimeConfig c = Config("test_custom_oldest", 64, 2);
  c.policy.params = {{"no_such_knob", 1.0}};
  auto bad = Runtime::Create(c);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("no_such_knob"), std::string::npos)
      << bad.status().message();
}

TEST(CustomPolicy, FullBudgetEqualsDense) {
  for (const int group : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << "group " << group);
    const int64_t before = g_selects.load();
    const RunResult r = RunAgainstDense("test_custom_oldest", 400 + 64, group, 400, 3, 17u + group);
    EXPECT_GT(g_selects.load(), before) << "the runtime never called Select";
    EXPECT_LT(r.rel_l2, 1e-5);
    EXPECT_LT(r.max_abs, 1e-5);
    for (const std::vector<int32_t>& s : r.selections) {  // everything, i.e. [0, n)
      ASSERT_FALSE(s.empty());
      EXPECT_EQ(static_cast<int64_t>(s.size()), int64_t{s.back()} + 1);
    }
  }
}

TEST(CustomPolicy, RuntimeAttendsWhatSelectReturns) {
  // Budget 36: 4 sinks + 16 window + the 16 oldest offloaded positions [4, 20).
  const RunResult r = RunAgainstDense("test_custom_oldest", 36, 2, 300, 2, 5u);
  EXPECT_TRUE(std::isfinite(r.max_abs));
  EXPECT_GT(r.max_abs, 1e-3) << "a sparse selection over random data should differ from dense";
  ASSERT_FALSE(r.selections.empty());
  for (const std::vector<int32_t>& s : r.selections) {
    ASSERT_EQ(s.size(), 36u);
    for (int i = 0; i < 20; ++i) EXPECT_EQ(s[i], i);
    const int32_t n = s.back() + 1;
    for (int i = 0; i < 16; ++i) EXPECT_EQ(s[20 + i], n - 16 + i);
  }
}

TEST(CustomPolicy, UnknownAndRefusedNames) {
  auto r = Runtime::Create(Config("test_custom_no_such_policy", 64, 2));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("test_custom_no_such_policy"), std::string::npos);
  // The error lists registered names beside the built-in ones.
  EXPECT_NE(r.status().message().find("test_custom_oldest"), std::string::npos)
      << r.status().message();
  EXPECT_FALSE(RegisterPolicy("test_custom_oldest", MakeOldest));  // taken
  EXPECT_FALSE(RegisterPolicy("oracle", MakeOldest));              // a built-in
  EXPECT_FALSE(RegisterPolicy("", MakeOldest));
  EXPECT_FALSE(RegisterPolicy("cis+test_custom", MakeOldest));     // a wrapper's composed name
  EXPECT_FALSE(RegisterPolicy("test_custom_empty", PolicyFactory{}));
  const std::vector<std::string> names = PolicyNames();
  EXPECT_EQ(std::count(names.begin(), names.end(), "test_custom_oldest"), 1);
  EXPECT_EQ(std::find(names.begin(), names.end(), "test_custom_empty"), names.end());
}

// The PrHS wrappers build their inner policy by name, so they wrap a registered one too.
TEST(CustomPolicy, WrappersComposeWithIt) {
  for (const std::string p : {"cis+test_custom_oldest", "psaw+test_custom_oldest"}) {
    SCOPED_TRACE(p);
    const RunResult r = RunAgainstDense(p, 48, 2, 200, 2, 9u);
    EXPECT_TRUE(std::isfinite(r.max_abs));
    EXPECT_FALSE(r.selections.empty());
  }
}

// A factory may capture state (PolicyFactory is a std::function).
TEST(CustomPolicy, FactoryMayCapture) {
  auto built = std::make_shared<int>(0);
  ASSERT_TRUE(RegisterPolicy("test_custom_capturing", [built](const RuntimeConfig& c) {
    ++*built;
    return MakeOldest(c);
  }));
  auto made = Runtime::Create(Config("test_custom_capturing", 64, 1));
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  EXPECT_EQ(*built, 1);
}

}  // namespace
}  // namespace kvferry
