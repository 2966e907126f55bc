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

#include "cpu/attention.h"
#include "kvferry/runtime.h"
#include "policies/basic.h"
#include "policies/kvpop/kvpop.h"
#include "policies/device_selector.h"
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
  RuntimeConfig c;
  c.policy.weights_path = path;
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
           {"scorer", 3}, {"scorer", 0.5}, {"gamma_min", 1.0}, {"gamma_max", 0}, {"gamma", 1.0}}) {
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

// decay 1's choice against a brute force on fresh random scores: each grid decay's kept set is the
// top k by (priority desc, position asc), the chosen one holds the most mass (the first on ties);
// attention on the newest positions picks the strongest decay, attention on the best-scored old
// positions the weakest.
TEST(KvpopDecay, ChoosesTheDecayWhoseKeptSetDrawsTheMostAttention) {
  std::mt19937 rng(static_cast<uint32_t>(std::random_device{}()));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t lo = 4, hi = 1004, k = 50, n = hi - lo;
  std::vector<float> grid{std::log(0.9995f)};
  for (double g : kKvpopDecayGrid) grid.push_back(static_cast<float>(std::log(g)));
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> r(n), mass(n);
    for (auto& x : r) x = nd(rng);
    for (auto& x : mass) x = std::abs(nd(rng));
    const int got = KvpopChooseDecay(r.data(), mass.data(), lo, hi, k, grid);
    double best = -1;
    int want = 0;
    for (size_t gi = 0; gi < grid.size(); ++gi) {
      std::vector<int64_t> idx(n);
      std::iota(idx.begin(), idx.end(), 0);
      std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) {
        const float pa = KvpopPriorityOf(r[a], lo + a, grid[gi]), pb = KvpopPriorityOf(r[b], lo + b, grid[gi]);
        return pa > pb || (pa == pb && a < b);
      });
      double m = 0;
      for (int64_t i = 0; i < k; ++i) m += mass[idx[i]];
      if (m > best * (1 + 1e-6)) {
        best = m;
        want = static_cast<int>(gi);
      }
    }
    EXPECT_EQ(got, want) << "trial " << trial;
  }
  // Directed cases on a fixed draw: attention on the newest k positions picks a strong decay
  // (recency), attention on the k best-scored positions wherever they are a weak one. Neither
  // keeps its set exactly (the age term reorders close scores), so the decay is checked.
  std::mt19937 fixed(7);
  std::vector<float> r(n), recent(n, 0.0f), scored(n, 0.0f);
  for (auto& x : r) x = nd(fixed);
  for (int64_t i = n - k; i < n; ++i) recent[i] = 1.0f;
  std::vector<int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return r[a] > r[b]; });
  for (int64_t i = 0; i < k; ++i) scored[idx[i]] = 1.0f;
  EXPECT_LE(grid[KvpopChooseDecay(r.data(), recent.data(), lo, hi, k, grid)], static_cast<float>(std::log(0.9)));
  EXPECT_GE(grid[KvpopChooseDecay(r.data(), scored.data(), lo, hi, k, grid)], static_cast<float>(std::log(0.9999)));
  // Nothing to choose: every eligible position fits.
  EXPECT_EQ(KvpopChooseDecay(r.data(), recent.data(), lo, lo + k, k, grid), 0);
}

TEST(KvpopDecay, PromptDecaySelectsOnTheHost) {
  auto r = ParseKvpopParams({{"decay", 1}, {"device", 1}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("decay"), std::string::npos) << r.status().message();
  EXPECT_FALSE(ParseKvpopParams({{"decay", 2}}).ok());
  auto ok = ParseKvpopParams({{"decay", 1}});
  ASSERT_TRUE(ok.ok());
  auto pol = KvpopPolicy::Create(*ok, nullptr, OneHead());
  ASSERT_TRUE(pol.ok());
  EXPECT_FALSE(detail::SelectsOnDevice(**pol));
  EXPECT_TRUE((*pol)->wants_prefill_queries());
}

// Scorer 2 (notes section 9 (b)): each token's score is the attention it received while in the
// window. Against a brute-force reference on fresh random keys and queries (the same fp32
// operations in the same order: cpu::SoftmaxAccumulate over the sinks and window of each
// query, summed over the token's window queries, max over the group, log(eps + mass / window), p = r - u log gamma, the
// top k of the eligible tokens by (p desc, position asc)): the policy's retained slots are the
// reference's at every step, the prompt's queries counted through OnPrefill in uneven chunks and
// the decode steps' through Select; a second policy prefilled in one chunk selects the same.
TEST(KvpopMass, RetainsTheTopKOfTheirWindowAttention) {
  for (int group : {1, 3}) {
    SCOPED_TRACE(group);
    const int hd = 32, sink = 3, window = 8;
    const int64_t budget = sink + window + 20, k = budget - sink - window;
    const int64_t prompt = 157, total = 420;
    std::mt19937 rng(40 + group);
    std::normal_distribution<float> nd;
    PagedHead kv(hd, DType::kBF16);
    std::vector<float> qs(static_cast<size_t>(total) * group * hd);
    for (float& x : qs) x = 1.5f * nd(rng);  // peaked softmaxes: the masses differ
    std::vector<float> key(hd), val(hd);
    for (int64_t t = 0; t < total; ++t) {
      for (int d = 0; d < hd; ++d) key[d] = nd(rng), val[d] = nd(rng);
      kv.Append(key.data(), val.data());
    }
    const AttnParams params = testing_util::Params(group, hd, DType::kBF16);
    KvpopParams kp;
    kp.scorer = 2;
    const float log_gamma = static_cast<float>(std::log(kp.gamma));  // scorer 2's decay
    // The reference's scores r_u of every token that has left the window by query total - 1.
    std::vector<float> r(static_cast<size_t>(total), 0.0f);
    {
      std::vector<float> mass(static_cast<size_t>(total) * group, 0.0f);
      for (int64_t d = 0; d < total; ++d) {
        const int64_t s_end = std::min<int64_t>(sink, d + 1), w_lo = std::max<int64_t>(sink, d - window + 1);
        std::vector<int64_t> rows;
        for (int64_t j = 0; j < s_end; ++j) rows.push_back(j);
        for (int64_t j = w_lo; j <= d; ++j) rows.push_back(j);
        for (int g = 0; g < group; ++g) {
          const float* q = qs.data() + (static_cast<size_t>(d) * group + g) * hd;
          std::vector<float> l;
          for (int64_t j : rows) {
            const std::vector<float> kj = kv.Key(j);
            float dot = 0.0f;
            for (int i = 0; i < hd; ++i) dot += q[i] * kj[i];
            l.push_back(dot * params.scale);
          }
          std::vector<float> w(l.size(), 0.0f);
          cpu::SoftmaxAccumulate(l.data(), static_cast<int64_t>(l.size()), 1.0f, w.data());
          for (size_t i = static_cast<size_t>(s_end); i < rows.size(); ++i) mass[rows[i] * group + g] += w[i];
        }
      }
      for (int64_t u = sink; u < total; ++u) r[u] = KvpopMassScore(&mass[u * group], group, window);
    }
    auto expected = [&](int64_t n) {  // the slots after the step of n stored positions
      std::vector<int32_t> eligible;
      for (int64_t u = sink; u < n - window; ++u) eligible.push_back(static_cast<int32_t>(u));
      std::stable_sort(eligible.begin(), eligible.end(), [&](int32_t a, int32_t b) {
        return KvpopPriorityOf(r[a], a, log_gamma) > KvpopPriorityOf(r[b], b, log_gamma);
      });
      eligible.resize(std::min<size_t>(eligible.size(), static_cast<size_t>(k)));
      std::sort(eligible.begin(), eligible.end());
      return eligible;
    };
    std::unique_ptr<KvpopPolicy> pol[2];
    for (auto& x : pol) {
      auto made = KvpopPolicy::Create(kp, nullptr, OneHead(1, 1, hd));
      ASSERT_TRUE(made.ok()) << made.status().ToString();
      x = std::move(made).value();
      EXPECT_TRUE(x->wants_prefill_queries());
      EXPECT_FALSE(detail::SelectsOnDevice(*x));  // the host selects
    }
    // The prompt's queries: policy 0 in chunks of 50, 7 and the rest; policy 1 in one.
    const std::vector<std::vector<int64_t>> chunks = {{0, 50, 57, prompt}, {0, prompt}};
    for (int which = 0; which < 2; ++which) {
      const auto& c = chunks[which];
      for (size_t i = 0; i + 1 < c.size(); ++i) {
        PrefillContext pc;
        pc.q_pos0 = c[i];
        pc.num_q = static_cast<int32_t>(c[i + 1] - c[i]);
        pc.n = c[i + 1];
        pc.sink = sink;
        pc.window = window;
        pc.q = qs.data() + static_cast<size_t>(c[i]) * group * hd;
        pc.params = params;
        pc.kv = kv.pages();
        ASSERT_TRUE(pol[which]->OnPrefill(pc).ok());
      }
    }
    std::vector<int32_t> sel[2];
    for (int64_t n = prompt + 1; n <= total; ++n) {
      for (int which = 0; which < 2; ++which) {
        SelectContext ctx = Context(kv, qs.data() + static_cast<size_t>(n - 1) * group * hd, group, sink, window, budget);
        ctx.n = n;
        ASSERT_TRUE(pol[which]->Select(ctx, sel[which]).ok());
        ExpectValidSelection(ctx, sel[which]);
      }
      ASSERT_EQ(sel[0], sel[1]) << "n " << n;
      ASSERT_EQ(pol[0]->Retained(0, 0, 0), expected(n)) << "n " << n;
    }
    std::vector<int32_t> ref;
    StreamingSelect(total, sink, budget, ref);
    EXPECT_NE(sel[0], ref) << "the window's attention should not be pure recency";
  }
}

// Scorer 2 through the Runtime (host backend): the prompt's queries reach OnPrefill chunk by
// chunk (max_prefill_chunk 64 of a 150-token prompt) and each decode step's reaches Select, so the
// runtime's selections equal a policy fed the same queries and rows directly, at every step.
// Values are multiples of 1/8 (exact in bf16, the store's dtype).
TEST(KvpopMass, ThroughTheRuntimeEqualsThePolicyFedDirectly) {
  const int hd = 32, group = 3, sink = 3, window = 8;
  const int64_t budget = 31, prompt = 150;
  RuntimeConfig rc;
  rc.model.num_layers = 1;
  rc.model.num_q_heads = group;
  rc.model.num_kv_heads = 1;
  rc.model.head_dim = hd;
  rc.capacity.max_sequences = 1;
  rc.capacity.max_tokens_per_sequence = 512;
  rc.capacity.max_batch = 1;
  rc.capacity.max_prefill_chunk = 64;
  rc.tiers.sink_tokens = sink;
  rc.tiers.window_tokens = window;
  rc.policy.name = "kvpop";
  rc.policy.budget_tokens = budget;
  rc.policy.params["scorer"] = 2;
  rc.backend = Backend::kHost;
  rc.cpu_threads = 1;
  rc.probe_at_start = false;
  auto made = Runtime::Create(rc);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  std::unique_ptr<Runtime> rt = std::move(made).value();
  KvpopParams kp;
  kp.scorer = 2;
  auto direct = KvpopPolicy::Create(kp, nullptr, OneHead(1, 1, hd));
  ASSERT_TRUE(direct.ok());
  std::mt19937 rng(3);
  auto eighth = [&] { return static_cast<float>(static_cast<int>(rng() % 33) - 16) / 8.0f; };
  const int64_t total = prompt + 60;
  std::vector<float> q(static_cast<size_t>(total) * group * hd), k(static_cast<size_t>(total) * hd),
      v(k.size());
  for (float& x : q) x = eighth();
  for (float& x : k) x = eighth();
  for (float& x : v) x = eighth();
  PagedHead kv(hd, DType::kBF16);
  for (int64_t t = 0; t < total; ++t) kv.Append(k.data() + t * hd, v.data() + t * hd);
  const AttnParams params = testing_util::Params(group, hd, DType::kBF16);
  auto host = [&](float* p, int64_t rows, int heads) {
    return TensorView::Contiguous(p, DType::kF32, MemoryKind::kHost, {rows, heads, hd});
  };
  ASSERT_TRUE(rt->AddSequence(7).ok());
  for (int64_t c0 = 0; c0 < prompt; c0 += 64) {
    const int64_t rows = std::min<int64_t>(64, prompt - c0);
    std::vector<float> out(static_cast<size_t>(rows) * group * hd);
    const Status st = rt->Prefill(7, 0, host(q.data() + c0 * group * hd, rows, group),
                                  host(k.data() + c0 * hd, rows, 1), host(v.data() + c0 * hd, rows, 1),
                                  host(out.data(), rows, group));
    ASSERT_TRUE(st.ok()) << st.ToString();
    PrefillContext pc;
    pc.q_pos0 = c0;
    pc.num_q = static_cast<int32_t>(rows);
    pc.n = c0 + rows;
    pc.sink = sink;
    pc.window = window;
    pc.q = q.data() + c0 * group * hd;
    pc.params = params;
    pc.kv = kv.pages();
    ASSERT_TRUE(direct.value()->OnPrefill(pc).ok());
  }
  const std::vector<SequenceId> seqs = {7};
  std::vector<int32_t> sel;
  for (int64_t t = prompt; t < total; ++t) {
    std::vector<float> out(static_cast<size_t>(group) * hd);
    const Status st = rt->Decode(seqs, 0, host(q.data() + t * group * hd, 1, group), host(k.data() + t * hd, 1, 1),
                                 host(v.data() + t * hd, 1, 1), host(out.data(), 1, group));
    ASSERT_TRUE(st.ok()) << st.ToString();
    SelectContext ctx = Context(kv, q.data() + t * group * hd, group, sink, window, budget);
    ctx.n = t + 1;
    ASSERT_TRUE(direct.value()->Select(ctx, sel).ok());
    auto got = rt->LastSelection(7, 0, 0);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got.value(), sel) << "step " << t;
  }
  std::vector<int32_t> ref;
  StreamingSelect(total, sink, budget, ref);
  EXPECT_NE(sel, ref);
}

// Scorer 2 with a position stored without its query (Runtime::Append, no OnPrefill): it adds no
// mass (score log eps) and the step still selects; a retried step (the same n) counts its query
// once; "device" 1 is refused naming both parameters.
TEST(KvpopMass, QueriesNotSeenAddNothingAndDeviceIsRefused) {
  const int hd = 16, sink = 2, window = 4;
  KvpopParams kp;
  kp.scorer = 2;
  auto made = KvpopPolicy::Create(kp, nullptr, OneHead(1, 1, hd));
  ASSERT_TRUE(made.ok());
  std::unique_ptr<KvpopPolicy> policy = std::move(made).value();
  PagedHead kv(hd, DType::kF32);
  std::vector<float> key(hd, 0.0f), q(hd, 0.0f);
  q[0] = 4.0f;
  for (int64_t t = 0; t < 60; ++t) {
    key.assign(hd, 0.0f);
    key[0] = t == 30 ? 3.0f : 0.0f;  // only position 30's key meets the queries
    kv.Append(key.data(), key.data());
  }
  // Positions [0, 59) were appended without queries; the step of n = 60 sees only its own.
  std::vector<int32_t> sel, again;
  const int64_t budget = sink + window + 5;
  SelectContext ctx = Context(kv, q.data(), 1, sink, window, budget);
  ASSERT_TRUE(policy->Select(ctx, sel).ok());
  ExpectValidSelection(ctx, sel);
  // Every eligible token scored log eps: the slots are the most recent ones (p's recency bonus).
  std::vector<int32_t> ref;
  StreamingSelect(60, sink, budget, ref);
  EXPECT_EQ(sel, ref);
  ASSERT_TRUE(policy->Select(ctx, again).ok());  // retried: the same step, the same selection
  EXPECT_EQ(again, sel);
  // From here every query is seen: a new token whose key meets them is kept after its window.
  for (int64_t t = 60; t < 90; ++t) {
    key.assign(hd, 0.0f);
    key[0] = t == 70 ? 3.0f : 0.0f;
    kv.Append(key.data(), key.data());
    ctx = Context(kv, q.data(), 1, sink, window, budget);
    ASSERT_TRUE(policy->Select(ctx, sel).ok());
  }
  const std::vector<int32_t> kept = policy->Retained(0, 0, 0);
  EXPECT_NE(std::find(kept.begin(), kept.end(), 70), kept.end()) << "position 70 drew its window's attention";
  EXPECT_EQ(std::find(kept.begin(), kept.end(), 30), kept.end()) << "position 30's queries were never seen";
  auto bad = ParseKvpopParams({{"scorer", 2}, {"device", 1}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("device"), std::string::npos);
  EXPECT_NE(bad.status().message().find("scorer"), std::string::npos);
  auto good = ParseKvpopParams({{"scorer", 2}});
  ASSERT_TRUE(good.ok());
}

}  // namespace
}  // namespace kvferry
