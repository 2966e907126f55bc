// Copyright kvferry authors. Apache-2.0.
// KVpop: online argmin eviction equals the top-k of the eligible set by static priority, the zero
// scorer is exactly streaming, evicted + retained + resident = every position, the MLP scorer and
// the decay, the safetensors loader, parameters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "policies/basic.h"
#include "policies/kvpop.h"
#include "tests/policy_test_util.h"

namespace kvferry {
namespace {

using testing_util::Context;
using testing_util::ExpectValidSelection;
using testing_util::PagedHead;

RuntimeConfig OneHead(int layers = 1, int heads = 1, int hd = 64) {
  RuntimeConfig c;
  c.model.num_layers = layers;
  c.model.num_kv_heads = heads;
  c.model.num_q_heads = heads;
  c.model.head_dim = hd;
  c.capacity.max_sequences = 2;
  return c;
}

KvpopScorerWeights RandomWeights(int layers, int heads, int hd, int hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  KvpopScorerWeights w;
  w.num_layers = layers;
  w.num_kv_heads = heads;
  w.in_dim = 2 * hd;
  w.hidden = hidden;
  const size_t lh = static_cast<size_t>(layers) * heads;
  w.w1.resize(lh * hidden * w.in_dim);
  w.b1.resize(lh * hidden);
  w.w2.resize(lh * hidden);
  w.b2.resize(lh);
  w.alpha.resize(lh);
  for (float& x : w.w1) x = 0.2f * nd(rng);
  for (float& x : w.b1) x = 0.1f * nd(rng);
  for (float& x : w.w2) x = nd(rng);
  for (float& x : w.b2) x = nd(rng);
  for (float& x : w.alpha) x = nd(rng);
  return w;
}

TEST(KvpopCore, OnlineAdmissionEqualsTopKOfEligible) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t n = 1 + rng() % 300;
    const int64_t k = rng() % 40;
    std::vector<float> prio(n);
    for (float& p : prio) p = static_cast<float>(rng() % 7);  // many ties
    std::vector<int32_t> pos(std::max<int64_t>(k, 1));
    std::vector<float> pr(std::max<int64_t>(k, 1));
    int64_t count = 0;
    std::vector<int32_t> evicted;
    for (int64_t u = 0; u < n; ++u) {
      const int64_t ev = KvpopAdmit(pos.data(), pr.data(), &count, k, static_cast<int32_t>(u), prio[u]);
      if (ev >= 0) evicted.push_back(static_cast<int32_t>(ev));
      // Brute force over the eligible prefix [0, u]: priority descending, then position ascending.
      std::vector<int32_t> ref(u + 1);
      std::iota(ref.begin(), ref.end(), 0);
      std::stable_sort(ref.begin(), ref.end(), [&](int a, int b) { return prio[a] > prio[b]; });
      ref.resize(std::min<int64_t>(k, u + 1));
      std::sort(ref.begin(), ref.end());
      std::vector<int32_t> got(pos.begin(), pos.begin() + count);
      std::sort(got.begin(), got.end());
      ASSERT_EQ(got, ref) << "trial " << trial << " u " << u << " k " << k;
    }
    EXPECT_EQ(static_cast<int64_t>(evicted.size()) + count, n);
  }
}

TEST(KvpopCore, PriorityDecayAndMlp) {
  const float lg = KvpopLogGamma(0.0f, 0.999f, 0.999999f);
  EXPECT_NEAR(lg, 0.5 * (std::log(0.999) + std::log(0.999999)), 1e-7);
  EXPECT_NEAR(KvpopLogGamma(-50.0f, 0.999f, 0.999999f), std::log(0.999), 1e-7);
  EXPECT_LT(lg, 0.0f);
  EXPECT_EQ(KvpopPriorityOf(1.5f, 1000, lg), std::fma(-1000.0f, lg, 1.5f));
  EXPECT_GT(KvpopPriorityOf(0.0f, 11, lg), KvpopPriorityOf(0.0f, 10, lg));  // newer wins at r = 0
  KvpopScorerWeights w = RandomWeights(1, 1, 8, 5, 3);
  std::vector<float> x(16);
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  for (float& e : x) e = nd(rng);
  double ref = w.b2[0];
  for (int i = 0; i < 5; ++i) {
    double z = w.b1[i];
    for (int j = 0; j < 16; ++j) z += static_cast<double>(w.w1[i * 16 + j]) * x[j];
    ref += w.w2[i] * z / (1 + std::exp(-z));
  }
  EXPECT_NEAR(KvpopMlp(x.data(), 16, 5, w.w1.data(), w.b1.data(), w.w2.data(), w.b2[0]), ref,
              1e-4);
}

// The zero scorer keeps the newest eligible tokens: exactly streaming, step after step.
TEST(KvpopPolicy, ZeroScorerIsStreaming) {
  for (int sink : {0, 4}) {
    for (int window : {1, 16}) {
      for (int64_t budget : {int64_t{40}, int64_t{97}}) {
        KvpopParams kp;
        kp.scorer = 0;
        auto policy = KvpopPolicy::Create(kp, nullptr, OneHead());
        ASSERT_TRUE(policy.ok()) << policy.status().ToString();
        PagedHead kv(64, DType::kBF16);
        std::mt19937 rng(sink * 100 + window + budget);
        std::normal_distribution<float> nd;
        std::vector<float> k(64), v(64), q(64);
        for (float& x : q) x = nd(rng);
        std::vector<int32_t> sel, ref;
        for (int64_t n = 1; n <= 400; ++n) {
          for (int d = 0; d < 64; ++d) k[d] = nd(rng), v[d] = nd(rng);
          kv.Append(k.data(), v.data());
          if (n < 150 && n % 50 != 0) continue;  // a prefill, then decode steps
          SelectContext ctx = Context(kv, q.data(), 1, sink, window, budget);
          ASSERT_TRUE(policy.value()->Select(ctx, sel).ok());
          StreamingSelect(n, sink, budget, ref);
          ASSERT_EQ(sel, ref) << "sink " << sink << " window " << window << " budget " << budget
                              << " n " << n;
        }
      }
    }
  }
}

// Evicted rows stay in the host store: evicted + retained + sinks + window = [0, n), disjoint.
TEST(KvpopPolicy, EvictedUnionRetainedIsEveryPosition) {
  for (int group : {1, 4}) {
    auto weights = std::make_shared<const KvpopScorerWeights>(RandomWeights(2, 1, 64, 7, group));
    KvpopParams kp;
    kp.scorer = 1;
    auto policy = KvpopPolicy::Create(kp, weights, OneHead(2));
    ASSERT_TRUE(policy.ok()) << policy.status().ToString();
    EXPECT_TRUE(policy.value()->trained());
    PagedHead kv(64, DType::kBF16);
    std::mt19937 rng(group);
    std::normal_distribution<float> nd;
    std::vector<float> k(64), v(64), q(group * 64);
    for (float& x : q) x = nd(rng);
    std::vector<int32_t> sel;
    const int sink = 4, window = 16;
    const int64_t budget = 4 + 16 + 33;
    bool differs_from_streaming = false;
    for (int64_t n = 1; n <= 1201; ++n) {
      for (int d = 0; d < 64; ++d) k[d] = nd(rng), v[d] = nd(rng);
      kv.Append(k.data(), v.data());
      if (n < 500 && n != 97) continue;
      SelectContext ctx = Context(kv, q.data(), group, sink, window, budget, 1);
      ctx.slot = 1;
      ASSERT_TRUE(policy.value()->Select(ctx, sel).ok());
      ExpectValidSelection(ctx, sel);
      ASSERT_EQ(static_cast<int64_t>(sel.size()), std::min<int64_t>(budget, n));
      std::vector<int32_t> ref;
      StreamingSelect(n, sink, budget, ref);
      differs_from_streaming |= sel != ref;
      const std::vector<int32_t> kept = policy.value()->Retained(1, 1, 0);
      const std::vector<int32_t> gone = policy.value()->Evicted(1, 1, 0);
      std::vector<int> seen(static_cast<size_t>(n), 0);
      for (int64_t i = 0; i < std::min<int64_t>(sink, n); ++i) ++seen[i];
      for (int64_t i = std::max<int64_t>(sink, n - window); i < n; ++i) ++seen[i];
      for (int32_t p : kept) ++seen[p];
      for (int32_t p : gone) ++seen[p];
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << "position " << i << " n " << n;
    }
    EXPECT_TRUE(differs_from_streaming) << "a random scorer should not be pure recency";
    policy.value()->OnSequenceRemoved(1);
    EXPECT_TRUE(policy.value()->Retained(1, 1, 0).empty());
  }
}

// A minimal safetensors writer (F32 tensors) for the loader's tests.
void WriteSafetensors(const std::string& path,
                      const std::vector<std::pair<std::string, std::pair<std::vector<int64_t>,
                                                                          std::vector<float>>>>& ts,
                      const std::string& meta) {
  std::string header = "{";
  size_t off = 0;
  std::string data;
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto& [name, t] = ts[i];
    std::string shape;
    for (int64_t d : t.first) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    const size_t bytes = t.second.size() * 4;
    header += "\"" + name + "\":{\"dtype\":\"F32\",\"shape\":[" + shape + "],\"data_offsets\":[" +
              std::to_string(off) + "," + std::to_string(off + bytes) + "]},";
    data.append(reinterpret_cast<const char*>(t.second.data()), bytes);
    off += bytes;
  }
  header += "\"__metadata__\":{" + meta + "}}";
  std::ofstream f(path, std::ios::binary);
  const uint64_t len = header.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f << header << data;
}

// Writes weights \p w in the layout LoadKvpopWeights reads, with metadata \p meta.
void WriteWeights(const std::string& path, const KvpopScorerWeights& w, const std::string& meta) {
  const int64_t l = w.num_layers, h = w.num_kv_heads, hid = w.hidden;
  WriteSafetensors(path,
                   {{"w1", {{l, h, hid, w.in_dim}, w.w1}},
                    {"b1", {{l, h, hid}, w.b1}},
                    {"w2", {{l, h, hid}, w.w2}},
                    {"b2", {{l, h}, w.b2}},
                    {"alpha", {{l, h}, w.alpha}}},
                   meta);
}

// The device selection uploads every (layer, KV head)'s scorer at Create: weights of another
// model shape are refused there with both shapes named, and nothing is left half made; with
// "device" 0 the runtime is made and the host Select refuses them at its first call.
TEST(KvpopWeights, DeviceSelectionRefusesWeightsOfAnotherModelAtCreate) {
  const KvpopScorerWeights w = RandomWeights(3, 2, 8, 4, 9);
  const std::string path = ::testing::TempDir() + "kvpop_weights_shape_test.safetensors";
  WriteWeights(path, w, "");
  ASSERT_EQ(setenv("KVFERRY_KVPOP_WEIGHTS", path.c_str(), 1), 0);
  struct Unset {
    ~Unset() { unsetenv("KVFERRY_KVPOP_WEIGHTS"); }
  } unset;  // also when an assertion returns early
  RuntimeConfig c;
  c.model = {.num_layers = 2, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 8,
             .kv_dtype = DType::kBF16};
  c.capacity.max_sequences = 1;
  c.capacity.max_tokens_per_sequence = 256;
  c.capacity.max_batch = 1;
  c.capacity.max_prefill_chunk = 64;
  c.tiers.sink_tokens = 2;
  c.tiers.window_tokens = 8;
  c.policy.name = "kvpop";
  c.policy.budget_tokens = 20;
  c.backend = Backend::kHost;
  c.cpu_threads = 1;
  c.probe_at_start = false;
  auto rt = Runtime::Create(c);
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rt.status().message().find("3 layers x 2 KV heads"), std::string::npos) << rt.status().message();
  EXPECT_NE(rt.status().message().find("the model has 2 layers"), std::string::npos) << rt.status().message();
  c.model.num_layers = 3;  // the weights' shape: made
  EXPECT_TRUE(Runtime::Create(c).ok());
  c.model.num_layers = 2;
  c.policy.params["device"] = 0;
  auto host = Runtime::Create(c);
  EXPECT_TRUE(host.ok()) << host.status().ToString();
  std::remove(path.c_str());
}

TEST(KvpopWeights, LoadRoundTripAndErrors) {
  const KvpopScorerWeights w = RandomWeights(3, 2, 8, 4, 9);
  const std::string path = ::testing::TempDir() + "kvpop_weights_test.safetensors";
  WriteWeights(path, w, "\"gamma_min\":\"0.99\",\"gamma_max\":\"0.9999\"");
  auto r = LoadKvpopWeights(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r.value().num_layers, 3);
  EXPECT_EQ(r.value().num_kv_heads, 2);
  EXPECT_EQ(r.value().hidden, 4);
  EXPECT_EQ(r.value().in_dim, 16);
  EXPECT_EQ(r.value().w1, w.w1);
  EXPECT_EQ(r.value().alpha, w.alpha);
  EXPECT_FLOAT_EQ(r.value().gamma_min, 0.99f);
  EXPECT_FLOAT_EQ(r.value().gamma_max, 0.9999f);
  // A model of another shape is refused at Select, naming both shapes.
  auto shared = std::make_shared<const KvpopScorerWeights>(r.value());
  auto other = KvpopPolicy::Create(KvpopParams{}, shared, OneHead(30, 3, 64));
  ASSERT_TRUE(other.ok());
  PagedHead kv(64, DType::kBF16);
  std::vector<float> row(64, 0.25f), q(64, 1.0f), sel;
  for (int i = 0; i < 200; ++i) kv.Append(row.data(), row.data());
  std::vector<int32_t> out;
  SelectContext ctx = Context(kv, q.data(), 1, 4, 16, 60, 7);
  Status st = other.value()->Select(ctx, out);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("layers"), std::string::npos) << st.message();
  // A tensor of the wrong shape is named.
  WriteSafetensors(path,
                   {{"w1", {{3, 2, 4, 16}, w.w1}},
                    {"b1", {{3, 2, 5}, std::vector<float>(30)}},
                    {"w2", {{3, 2, 4}, w.w2}},
                    {"b2", {{3, 2}, w.b2}},
                    {"alpha", {{3, 2}, w.alpha}}},
                   "");
  auto r2 = LoadKvpopWeights(path);
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("b1"), std::string::npos) << r2.status().message();
  std::remove(path.c_str());
  auto r3 = LoadKvpopWeights(path);
  ASSERT_FALSE(r3.ok());
  EXPECT_EQ(r3.status().code(), StatusCode::kIoError);
}

TEST(KvpopPolicy, BadParametersNameTheParameter) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, double>>{
           {"scorer", 2}, {"scorer", 0.5}, {"gamma_min", 1.0}, {"gamma_max", 0}, {"gamma", 0.9}}) {
    auto r = ParseKvpopParams({{key, value}});
    ASSERT_FALSE(r.ok()) << key << "=" << value;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().message();
  }
  KvpopParams kp;
  kp.scorer = 1;
  auto r = KvpopPolicy::Create(kp, nullptr, OneHead());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("scorer"), std::string::npos);
}

}  // namespace
}  // namespace kvferry
