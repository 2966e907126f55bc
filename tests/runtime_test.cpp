// Copyright kvferry authors. Apache-2.0.
// Runtime integration tests on the host-emulated device: full-budget policies equal dense
// attention, oracle/streaming select what they promise, sequences come and go, and bad input gets
// a clear error without disturbing other sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "cpu/dtype.h"
#include "kvferry/kvferry.h"

namespace kvferry {
namespace {

// What the test knows about one sequence: every K/V row, rounded to the KV dtype as stored.
struct RefSeq {
  std::vector<std::vector<float>> k, v;  // per layer: [n, hkv, d]
  int64_t row_width = 1;                 // hkv * d
  int64_t n(int layer) const { return static_cast<int64_t>(k[layer].size()) / row_width; }
};

float RoundTo(DType dtype, float x) {
  return dtype == DType::kBF16 ? cpu::Bf16ToF32(cpu::F32ToBf16(x)) : cpu::F16ToF32(cpu::F32ToF16(x));
}

class Harness {
 public:
  explicit Harness(const RuntimeConfig& config, uint32_t seed) : config_(config), rng_(seed) {
    auto r = Runtime::Create(config);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (r.ok()) rt_ = std::move(r).value();
  }
  Runtime& rt() { return *rt_; }
  int hq() const { return config_.model.num_q_heads; }
  int hkv() const { return config_.model.num_kv_heads; }
  int d() const { return config_.model.head_dim; }

  std::vector<float> Random(int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = normal_(rng_);
    return x;
  }
  TensorView View(std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, d()});
  }

  void Add(SequenceId s) {
    ASSERT_TRUE(rt_->AddSequence(s).ok());
    refs_[s].k.assign(static_cast<size_t>(config_.model.num_layers), {});
    refs_[s].v.assign(static_cast<size_t>(config_.model.num_layers), {});
    refs_[s].row_width = static_cast<int64_t>(hkv()) * d();
  }
  void Remove(SequenceId s) {
    ASSERT_TRUE(rt_->RemoveSequence(s).ok());
    refs_.erase(s);
  }

  void Record(SequenceId s, int layer, const std::vector<float>& k, const std::vector<float>& v,
              int64_t row0, int64_t rows) {
    const int64_t w = static_cast<int64_t>(hkv()) * d();
    for (int64_t i = row0 * w; i < (row0 + rows) * w; ++i) {
      refs_[s].k[layer].push_back(RoundTo(config_.model.kv_dtype, k[i]));
      refs_[s].v[layer].push_back(RoundTo(config_.model.kv_dtype, v[i]));
    }
  }

  // Reference attention of query head qh of sequence s at layer over positions `pos`, in double.
  std::vector<double> RefAttend(SequenceId s, int layer, const float* q, int qh,
                                const std::vector<int32_t>& pos) const {
    const RefSeq& r = refs_.at(s);
    const int h = qh / (hq() / hkv());
    const double scale = 1.0 / std::sqrt(static_cast<double>(d()));
    std::vector<double> logits(pos.size());
    double m = -INFINITY;
    for (size_t j = 0; j < pos.size(); ++j) {
      const float* kr = &r.k[layer][(static_cast<size_t>(pos[j]) * hkv() + h) * d()];
      double dot = 0;
      for (int e = 0; e < d(); ++e) dot += static_cast<double>(q[e]) * kr[e];
      logits[j] = dot * scale;
      m = std::max(m, logits[j]);
    }
    std::vector<double> o(static_cast<size_t>(d()), 0.0);
    double sum = 0;
    for (size_t j = 0; j < pos.size(); ++j) {
      const double w = std::exp(logits[j] - m);
      sum += w;
      const float* vr = &r.v[layer][(static_cast<size_t>(pos[j]) * hkv() + h) * d()];
      for (int e = 0; e < d(); ++e) o[e] += w * vr[e];
    }
    for (double& x : o) x /= sum;
    return o;
  }

  std::vector<int32_t> All(SequenceId s, int layer) const {
    std::vector<int32_t> a(static_cast<size_t>(refs_.at(s).n(layer)));
    std::iota(a.begin(), a.end(), 0);
    return a;
  }

  // Relative L2 error of out (one token, [hq, d]) against attention over `pos` for each head.
  double RelErr(SequenceId s, int layer, const float* q, const float* out,
                const std::vector<int32_t>& pos) const {
    double num = 0, den = 0;
    for (int qh = 0; qh < hq(); ++qh) {
      std::vector<double> ref = RefAttend(s, layer, q + qh * d(), qh, pos);
      for (int e = 0; e < d(); ++e) {
        const double diff = out[qh * d() + e] - ref[e];
        num += diff * diff;
        den += ref[e] * ref[e];
      }
    }
    EXPECT_GT(den, 0.0) << "reference output is all zero";
    return std::sqrt(num / den);
  }

  void Prefill(SequenceId s, int64_t tokens, int64_t chunk = 1 << 30) {
    for (int layer = 0; layer < config_.model.num_layers; ++layer) {
      for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
        const int64_t t = std::min(chunk, tokens - t0);
        auto q = Random(t * hq() * d()), k = Random(t * hkv() * d()), v = Random(t * hkv() * d());
        std::vector<float> out(q.size(), NAN);
        Status st = rt_->Prefill(s, layer, View(q, t, hq()), View(k, t, hkv()), View(v, t, hkv()),
                                 View(out, t, hq()));
        ASSERT_TRUE(st.ok()) << st.ToString();
        Record(s, layer, k, v, 0, t);
        // Spot-check the last row of the chunk: causal attention over everything so far. Prefill
        // may run through oneDNN with q and the softmax weights rounded to the KV dtype (as flash
        // attention does), so its tolerance is the dtype's; decode is held to fp32 rounding.
        const double err = RelErr(s, layer, &q[(t - 1) * hq() * d()], &out[(t - 1) * hq() * d()],
                                  All(s, layer));
        EXPECT_LT(err, 2e-2) << "prefill seq " << s << " layer " << layer;
      }
    }
  }

  // One decode step of `seqs` at every layer. Returns the worst rel err against dense, or against
  // the runtime's reported selection when `vs_selection`.
  double DecodeStep(const std::vector<SequenceId>& seqs, bool vs_selection) {
    double worst = 0;
    const int64_t b = static_cast<int64_t>(seqs.size());
    for (int layer = 0; layer < config_.model.num_layers; ++layer) {
      auto q = Random(b * hq() * d()), k = Random(b * hkv() * d()), v = Random(b * hkv() * d());
      std::vector<float> out(q.size(), NAN);
      Status st = rt_->Decode(seqs, layer, View(q, b, hq()), View(k, b, hkv()), View(v, b, hkv()),
                              View(out, b, hq()));
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (!st.ok()) return INFINITY;
      for (int64_t i = 0; i < b; ++i) {
        Record(seqs[i], layer, k, v, i, 1);
        std::vector<int32_t> pos = All(seqs[i], layer);
        if (vs_selection) {
          auto sel = rt_->LastSelection(seqs[i], layer, 0);
          EXPECT_TRUE(sel.ok());
          if (hkv() == 1) pos = sel.value();
        }
        worst = std::max(worst, RelErr(seqs[i], layer, &q[i * hq() * d()], &out[i * hq() * d()], pos));
      }
    }
    return worst;
  }

 private:
  RuntimeConfig config_;
  std::unique_ptr<Runtime> rt_;
  std::mt19937 rng_;
  std::normal_distribution<float> normal_;
  std::map<SequenceId, RefSeq> refs_;
};

RuntimeConfig SmallConfig(int head_dim, int group, int num_kv_heads, const std::string& policy) {
  RuntimeConfig c;
  c.model.num_layers = 2;
  c.model.num_kv_heads = num_kv_heads;
  c.model.num_q_heads = num_kv_heads * group;
  c.model.head_dim = head_dim;
  c.model.kv_dtype = DType::kBF16;
  c.capacity.max_sequences = 4;
  c.capacity.max_batch = 4;
  c.capacity.max_tokens_per_sequence = 8192;
  c.capacity.max_prefill_chunk = 4200;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 16;
  c.policy.name = policy;
  c.backend = Backend::kHost;
  return c;
}

// ---- every policy at full budget equals dense ----------------------------------------------

using FullParam = std::tuple<std::string, int, int, int64_t, Route>;  // policy, D, group, ctx, route

class FullBudget : public ::testing::TestWithParam<FullParam> {};

TEST_P(FullBudget, EqualsDense) {
  const auto& [policy, head_dim, group, context, route] = GetParam();
  RuntimeConfig c = SmallConfig(head_dim, group, 2, policy);
  c.policy.budget_tokens = context + 8;  // covers every position
  c.route = route;
  Harness h(c, static_cast<uint32_t>(head_dim * 131 + group * 7 + context));
  h.Add(1);
  h.Prefill(1, context);
  for (int step = 0; step < 3; ++step) EXPECT_LT(h.DecodeStep({1}, false), 1e-5) << "step " << step;
}

std::string FullName(const ::testing::TestParamInfo<FullParam>& info) {
  const auto& [policy, head_dim, group, context, route] = info.param;
  return policy + "_d" + std::to_string(head_dim) + "_g" + std::to_string(group) + "_n" +
         std::to_string(context) + "_" + RouteName(route);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FullBudget,
    ::testing::Combine(::testing::Values("dense", "streaming", "oracle", "lfps"),
                       ::testing::Values(64, 128),
                       ::testing::Values(1, 3, 4, 8), ::testing::Values<int64_t>(1, 17, 97),
                       ::testing::Values(Route::kAuto)),
    FullName);
INSTANTIATE_TEST_SUITE_P(
    Routes, FullBudget,
    ::testing::Combine(::testing::Values("dense", "streaming", "oracle", "lfps"),
                       ::testing::Values(64),
                       ::testing::Values(4), ::testing::Values<int64_t>(97),
                       ::testing::Values(Route::kGpu, Route::kCpu)),
    FullName);
INSTANTIATE_TEST_SUITE_P(
    Long, FullBudget,
    ::testing::Combine(::testing::Values("dense", "oracle"), ::testing::Values(64),
                       ::testing::Values(1, 4), ::testing::Values<int64_t>(4099),
                       ::testing::Values(Route::kAuto)),
    FullName);

// ---- selection contracts ----------------------------------------------------------------------

TEST(Selection, StreamingAttendsExactlySinksAndWindow) {
  RuntimeConfig c = SmallConfig(64, 4, 1, "streaming");
  c.policy.budget_tokens = 40;
  Harness h(c, 11);
  h.Add(7);
  h.Prefill(7, 300);
  EXPECT_LT(h.DecodeStep({7}, true), 1e-5);
  for (int layer = 0; layer < 2; ++layer) {
    auto sel = h.rt().LastSelection(7, layer, 0);
    ASSERT_TRUE(sel.ok());
    std::vector<int32_t> expect = {0, 1, 2, 3};
    for (int32_t p = 301 - 36; p < 301; ++p) expect.push_back(p);
    EXPECT_EQ(sel.value(), expect);
  }
}

TEST(Selection, OracleIsExactTopKOfGroupMassAndMatchesItsOutput) {
  for (int group : {1, 3, 8}) {
    RuntimeConfig c = SmallConfig(64, group, 1, "oracle");
    c.model.num_layers = 1;
    c.policy.budget_tokens = 50;
    Harness h(c, 100 + group);
    h.Add(3);
    h.Prefill(3, 500);
    // Output equals attention over exactly the selected set.
    EXPECT_LT(h.DecodeStep({3}, true), 1e-5);
    auto sel = h.rt().LastSelection(3, 0, 0);
    ASSERT_TRUE(sel.ok());
    EXPECT_EQ(sel.value().size(), 50u);
    EXPECT_TRUE(std::is_sorted(sel.value().begin(), sel.value().end()));
  }
}

TEST(Selection, OracleRecallOfIndependentTopKIsOne) {
  // Independent top-k: group-summed softmax weights computed here in double.
  RuntimeConfig c = SmallConfig(64, 4, 1, "oracle");
  c.model.num_layers = 1;
  c.policy.budget_tokens = 64;
  c.capacity.max_prefill_chunk = 1024;
  auto rt = Runtime::Create(c).value();
  ASSERT_TRUE(rt->AddSequence(1).ok());
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  const int64_t n0 = 1000;
  const int d = 64, hq = 4;
  std::vector<float> q(n0 * hq * d), k(n0 * d), v(n0 * d), out(n0 * hq * d);
  for (auto* vec : {&q, &k, &v}) for (float& x : *vec) x = normal(rng);
  auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, d});
  };
  ASSERT_TRUE(rt->Prefill(1, 0, view(q, n0, hq), view(k, n0, 1), view(v, n0, 1), view(out, n0, hq)).ok());
  std::vector<float> q1(hq * d), k1(d), v1(d), o1(hq * d);
  for (auto* vec : {&q1, &k1, &v1}) for (float& x : *vec) x = normal(rng);
  SequenceId s = 1;
  ASSERT_TRUE(rt->Decode({&s, 1}, 0, view(q1, 1, hq), view(k1, 1, 1), view(v1, 1, 1), view(o1, 1, hq)).ok());
  k.insert(k.end(), k1.begin(), k1.end());
  const int64_t n = n0 + 1;
  std::vector<double> mass(n, 0.0);
  for (int g = 0; g < hq; ++g) {
    std::vector<double> l(n);
    double m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (int e = 0; e < d; ++e) dot += q1[g * d + e] * RoundTo(DType::kBF16, k[j * d + e]);
      l[j] = dot / 8.0;
      m = std::max(m, l[j]);
    }
    for (int64_t j = 0; j < n; ++j) sum += std::exp(l[j] - m);
    for (int64_t j = 0; j < n; ++j) mass[j] += std::exp(l[j] - m) / sum;
  }
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return mass[a] > mass[b]; });
  std::set<int32_t> expect(idx.begin(), idx.begin() + 64);
  auto sel = rt->LastSelection(1, 0, 0).value();
  int hits = 0;
  for (int32_t p : sel) hits += expect.count(p);
  EXPECT_EQ(hits, 64) << "oracle recall " << hits / 64.0;
}

// ---- several sequences, added and removed in between -------------------------------------------

TEST(MultiSequence, BatchedDecodeWithChurnMatchesReference) {
  for (const char* policy : {"dense", "oracle", "streaming"}) {
    RuntimeConfig c = SmallConfig(64, 4, 2, policy);
    c.policy.budget_tokens = 10000;
    Harness h(c, 77);
    h.Add(10);
    h.Add(20);
    h.Prefill(10, 97);
    h.Prefill(20, 17, 5);  // chunked prefill
    EXPECT_LT(h.DecodeStep({10, 20}, false), 1e-5) << policy;
    h.Add(30);
    h.Prefill(30, 33);
    EXPECT_LT(h.DecodeStep({30, 10, 20}, false), 1e-5) << policy;
    h.Remove(10);
    EXPECT_LT(h.DecodeStep({20, 30}, false), 1e-5) << policy;
    h.Add(10);  // same id, fresh sequence, reused slot
    h.Prefill(10, 1);
    h.Add(40);
    h.Prefill(40, 64);
    for (int i = 0; i < 3; ++i) EXPECT_LT(h.DecodeStep({40, 10, 30, 20}, false), 1e-5) << policy;
  }
}

// ---- bad input: clear errors, others intact ---------------------------------------------------

TEST(BadInput, ConfigErrorsNameTheValue) {
  RuntimeConfig c = SmallConfig(64, 4, 2, "oracle");
  c.policy.budget_tokens = 0;
  auto r = Runtime::Create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("policy 'oracle' needs a budget"), std::string::npos)
      << r.status().ToString();
  c.policy.budget_tokens = -5;  // a negative budget is named as such, not as a zero one
  r = Runtime::Create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("budget_tokens -5 must be >= 0"), std::string::npos)
      << r.status().ToString();

  c = SmallConfig(64, 4, 2, "nonesuch");
  r = Runtime::Create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("nonesuch"), std::string::npos);

  c = SmallConfig(64, 4, 2, "dense");
  c.model.num_q_heads = 7;
  r = Runtime::Create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("num_q_heads 7"), std::string::npos);

  c = SmallConfig(64, 4, 2, "dense");
  c.model.kv_dtype = DType::kF32;
  r = Runtime::Create(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("kv_dtype f32"), std::string::npos);

  c = SmallConfig(64, 4, 2, "streaming");
  c.policy.params["bogus"] = 1.0;
  EXPECT_FALSE(Runtime::Create(c).ok());
}

TEST(BadInput, ErrorsLeaveOtherSequencesIntact) {
  RuntimeConfig c = SmallConfig(64, 4, 2, "oracle");
  c.policy.budget_tokens = 10000;
  c.capacity.max_sequences = 2;
  c.capacity.max_batch = 2;
  c.capacity.max_tokens_per_sequence = 40;
  Harness h(c, 9);
  h.Add(1);
  h.Prefill(1, 20);
  EXPECT_LT(h.DecodeStep({1}, false), 1e-5);
  Runtime& rt = h.rt();
  const int hq = h.hq(), hkv = h.hkv(), d = h.d();
  auto q = h.Random(hq * d), k = h.Random(hkv * d), v = h.Random(hkv * d);
  std::vector<float> out(q.size());
  auto Q = h.View(q, 1, hq), K = h.View(k, 1, hkv), V = h.View(v, 1, hkv), O = h.View(out, 1, hq);
  auto code = [](const Status& s) { return s.code(); };
  SequenceId unknown = 99, one = 1, two = 2;

  EXPECT_EQ(code(rt.Decode({&unknown, 1}, 0, Q, K, V, O)), StatusCode::kNotFound);
  EXPECT_EQ(code(rt.Decode({&one, 1}, 5, Q, K, V, O)), StatusCode::kInvalidArgument);
  Status layer_err = rt.Decode({&one, 1}, -1, Q, K, V, O);
  EXPECT_NE(layer_err.message().find("layer -1 out of range [0, 2)"), std::string::npos)
      << layer_err.ToString();
  // Shape mismatch: k with the q head count.
  EXPECT_EQ(code(rt.Decode({&one, 1}, 0, Q, Q, V, O)), StatusCode::kInvalidArgument);
  // Head dim mismatch.
  TensorView bad_d = TensorView::Contiguous(q.data(), DType::kF32, MemoryKind::kHost, {1, hq, d / 2});
  EXPECT_EQ(code(rt.Decode({&one, 1}, 0, bad_d, K, V, O)), StatusCode::kInvalidArgument);
  // Device memory on the host backend.
  TensorView dev = Q;
  dev.where = MemoryKind::kDevice;
  EXPECT_EQ(code(rt.Decode({&one, 1}, 0, dev, K, V, O)), StatusCode::kInvalidArgument);
  // Non-contiguous.
  TensorView strided = Q;
  strided.stride[1] *= 2;
  EXPECT_EQ(code(rt.Decode({&one, 1}, 0, strided, K, V, O)), StatusCode::kInvalidArgument);
  // Decode before prefill.
  h.Add(2);
  Status before = rt.Decode({&two, 1}, 0, Q, K, V, O);
  EXPECT_EQ(before.code(), StatusCode::kFailedPrecondition) << before.ToString();
  EXPECT_NE(before.message().find("decode before prefill"), std::string::npos);
  // Batch containing a bad sequence fails as a whole and changes nothing.
  std::vector<SequenceId> mixed = {1, 2};
  auto q2 = h.Random(2 * hq * d), k2 = h.Random(2 * hkv * d), v2 = h.Random(2 * hkv * d);
  std::vector<float> o2(q2.size());
  EXPECT_EQ(code(rt.Decode(mixed, 0, h.View(q2, 2, hq), h.View(k2, 2, hkv), h.View(v2, 2, hkv),
                           h.View(o2, 2, hq))),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(rt.SequenceLength(1, 0).value(), 21);
  // Capacity: too many sequences, too many tokens.
  EXPECT_EQ(code(rt.AddSequence(3)), StatusCode::kResourceExhausted);
  EXPECT_EQ(code(rt.AddSequence(1)), StatusCode::kInvalidArgument);
  auto big_q = h.Random(30 * hq * d), big_k = h.Random(30 * hkv * d);
  std::vector<float> big_o(big_q.size());
  EXPECT_EQ(code(rt.Prefill(1, 0, h.View(big_q, 30, hq), h.View(big_k, 30, hkv),
                            h.View(big_k, 30, hkv), h.View(big_o, 30, hq))),
            StatusCode::kResourceExhausted);
  // Removed sequence.
  h.Remove(2);
  EXPECT_EQ(code(rt.Decode({&two, 1}, 0, Q, K, V, O)), StatusCode::kNotFound);
  EXPECT_EQ(code(rt.RemoveSequence(2)), StatusCode::kNotFound);
  // Sequence 1 is intact and keeps decoding correctly.
  EXPECT_EQ(rt.SequenceLength(1, 0).value(), 21);
  EXPECT_LT(h.DecodeStep({1}, false), 1e-5);
}

TEST(BadInput, HostStoreLimitIsResourceExhausted) {
  RuntimeConfig c = SmallConfig(64, 4, 2, "dense");
  c.capacity.max_host_bytes = 2 * 2 * 256 * 64 * 2;  // two pages
  Harness h(c, 4);
  h.Add(1);
  auto q = h.Random(300 * h.hq() * h.d()), k = h.Random(300 * h.hkv() * h.d());
  std::vector<float> o(q.size());
  Status st = h.rt().Prefill(1, 0, h.View(q, 300, h.hq()), h.View(k, 300, h.hkv()),
                             h.View(k, 300, h.hkv()), h.View(o, 300, h.hq()));
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_EQ(h.rt().SequenceLength(1, 0).value(), 0);
}

TEST(Dtypes, Bf16AndF16ActivationsAndKv) {
  for (DType kv : {DType::kBF16, DType::kF16}) {
    RuntimeConfig c = SmallConfig(64, 2, 1, "dense");
    c.model.kv_dtype = kv;
    c.model.num_layers = 1;
    auto rt = Runtime::Create(c).value();
    ASSERT_TRUE(rt->AddSequence(1).ok());
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    const int n = 33, d = 64, hq = 2;
    std::vector<uint16_t> q(n * hq * d), k(n * d), v(n * d), o(n * hq * d);
    std::vector<float> kf(n * d), vf(n * d), qf(n * hq * d);
    for (size_t i = 0; i < q.size(); ++i) { qf[i] = normal(rng); q[i] = cpu::F32ToBf16(qf[i]); qf[i] = cpu::Bf16ToF32(q[i]); }
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = cpu::F32ToF16(normal(rng)); kf[i] = RoundTo(kv, cpu::F16ToF32(k[i]));
      v[i] = cpu::F32ToF16(normal(rng)); vf[i] = RoundTo(kv, cpu::F16ToF32(v[i]));
    }
    auto view = [&](std::vector<uint16_t>& x, DType t, int heads) {
      return TensorView::Contiguous(x.data(), t, MemoryKind::kHost, {n, heads, d});
    };
    Status st = rt->Prefill(1, 0, view(q, DType::kBF16, hq), view(k, DType::kF16, 1),
                            view(v, DType::kF16, 1), view(o, DType::kF16, hq));
    ASSERT_TRUE(st.ok()) << st.ToString();
    // Last row, head 1 against a double reference; output rounded to f16.
    double num = 0, den = 0;
    const float* qq = &qf[((n - 1) * hq + 1) * d];
    std::vector<double> l(n), acc(d, 0.0);
    double m = -INFINITY, sum = 0;
    for (int j = 0; j < n; ++j) {
      double dot = 0;
      for (int e = 0; e < d; ++e) dot += qq[e] * kf[j * d + e];
      l[j] = dot / 8.0;
      m = std::max(m, l[j]);
    }
    for (int j = 0; j < n; ++j) {
      double w = std::exp(l[j] - m);
      sum += w;
      for (int e = 0; e < d; ++e) acc[e] += w * vf[j * d + e];
    }
    for (int e = 0; e < d; ++e) {
      double ref = acc[e] / sum, got = cpu::F16ToF32(o[((n - 1) * hq + 1) * d + e]);
      num += (got - ref) * (got - ref);
      den += ref * ref;
    }
    EXPECT_LT(std::sqrt(num / den), 2e-2) << DTypeName(kv);  // prefill: dtype-rounded operands
  }
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

// The token bank changes where rows come from, never the result: outputs equal attention over the
// selected set exactly, and repeated selections hit the bank.
TEST(TokenBankRuntime, HitsServeRowsAndOutputsStayExact) {
  for (const char* map : {"vector", "hash"}) {
    for (Route route : {Route::kGpu, Route::kAuto}) {
      RuntimeConfig c = SmallConfig(64, 4, 1, "oracle");
      c.policy.budget_tokens = 40;
      c.tiers.window_tokens = 8;
      c.tiers.bank_slots = 64;
      c.tiers.bank_map = map;
      c.route = route;
      Harness h(c, 21);
      h.Add(1);
      h.Add(2);
      h.Prefill(1, 300);
      h.Prefill(2, 150);
      for (int step = 0; step < 6; ++step) {
        EXPECT_LT(h.DecodeStep({1, 2}, true), 1e-5) << map << " step " << step;
      }
      h.Remove(2);  // its bank rows are forgotten; sequence 1 unaffected
      EXPECT_LT(h.DecodeStep({1}, true), 1e-5) << map;
      const Stats s = h.rt().GetStats();
      EXPECT_GT(s.rows_bank_hit, 0) << map;
      EXPECT_GT(s.bank_admitted, 0) << map;
      EXPECT_EQ(s.rows_selected, s.rows_resident + s.rows_bank_hit + s.rows_fetched + s.rows_cpu);
    }
  }
}

// The PCIe-aware split of a step's misses on the host path (runtime/scheduler.h CpuShare; hip at
// 16 bits selects on the host, so route auto splits its misses between the GPU branch, read over PCIe,
// and the CPU branch): with route auto both branches get rows, every selected row is attended
// exactly once (the output equals attention over exactly the reported selection: a lost or
// doubled row would show) and the counters add up; routes gpu and cpu give one branch each.
TEST(SchedulerSplit, BranchesPartitionTheSelection) {
  for (Route route : {Route::kAuto, Route::kGpu, Route::kCpu}) {
    RuntimeConfig c = SmallConfig(64, 4, 1, "hip");
    c.policy.params["bits"] = 16;  // fp32 scores: the host selects (at 4 bits the device would)
    c.policy.budget_tokens = 64;
    c.tiers.window_tokens = 8;
    c.route = route;
    c.probe_at_start = false;  // the cost model's defaults: 20 GB/s on the CPU, 52 over PCIe
    Harness h(c, 33);
    h.Add(1);
    h.Add(2);
    h.Prefill(1, 600);
    h.Prefill(2, 333);
    for (int step = 0; step < 6; ++step) {
      EXPECT_LT(h.DecodeStep({1, 2}, true), 1e-5) << "route " << static_cast<int>(route) << " step " << step;
    }
    const Stats s = h.rt().GetStats();
    EXPECT_EQ(s.rows_selected, s.rows_resident + s.rows_bank_hit + s.rows_fetched + s.rows_cpu);
    EXPECT_GT(s.rows_selected, s.rows_resident);
    if (route == Route::kAuto) {
      EXPECT_GT(s.rows_cpu, 0);
      EXPECT_GT(s.rows_fetched, 0);
      // The model's share: cpu / (cpu + pcie) of the misses, per item rounded.
      const double share = static_cast<double>(s.rows_cpu) / static_cast<double>(s.rows_cpu + s.rows_fetched);
      EXPECT_NEAR(share, 20.0 / 72.0, 0.05);
    } else if (route == Route::kGpu) {
      EXPECT_EQ(s.rows_cpu, 0);
    } else {
      EXPECT_EQ(s.rows_fetched, 0);
    }
  }
}

}  // namespace
}  // namespace kvferry
