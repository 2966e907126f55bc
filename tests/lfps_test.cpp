// Copyright kvferry authors. Apache-2.0.
// LFPS as a specification: the table invariant, the degenerate settings (candidates = everything
// is exact top-k, k = n is dense attention), the two history tables tracking what they claim to
// track, the bypass, and the parameter contract of the factory.
#include "policies/lfps.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/reference.h"

namespace kvferry {
namespace {

constexpr int kHd = 64;
constexpr int kPage = 64;

// A growable bf16 KV head in the host store's page layout.
class KvHead {
 public:
  explicit KvHead(int64_t capacity) {
    const int64_t pages = (capacity + kPage - 1) / kPage;
    storage_.resize(static_cast<size_t>(pages));
    for (auto& s : storage_) {
      s.resize(static_cast<size_t>(2) * kPage * kHd);
      ptrs_.push_back(s.data());
    }
    kv_.pages = ptrs_.data();
    kv_.page_tokens = kPage;
  }
  void Append(const std::vector<float>& k, const std::vector<float>& v) {
    uint16_t* page = storage_[n_ / kPage].data();
    const int64_t row = n_ % kPage;
    for (int d = 0; d < kHd; ++d) {
      page[row * kHd + d] = cpu::F32ToBf16(k[d]);
      page[(kPage + row) * kHd + d] = cpu::F32ToBf16(v[d]);
    }
    ++n_;
  }
  int64_t n() const { return n_; }
  const KvPages& kv() const { return kv_; }

 private:
  std::vector<std::vector<uint16_t>> storage_;
  std::vector<void*> ptrs_;
  KvPages kv_;
  int64_t n_ = 0;
};

std::vector<float> Gaussian(std::mt19937& rng, int n, float sd) {
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = dist(rng);
  return x;
}

AttnParams Params(int group) {
  AttnParams p;
  p.group = group;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  return p;
}

SelectContext Ctx(const KvHead& head, const std::vector<float>& q, int group, int64_t budget,
                  int sink, int window) {
  SelectContext c;
  c.n = head.n();
  c.sink = sink;
  c.window = window;
  c.budget = budget;
  c.q = q.data();
  c.params = Params(group);
  c.kv = head.kv();
  return c;
}

bool SortedUnique(const std::vector<int32_t>& v, int64_t n) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] < 0 || v[i] >= n || (i > 0 && v[i] <= v[i - 1])) return false;
  }
  return true;
}

LfpsPolicy MakePolicy(const LfpsParams& lp) { return LfpsPolicy(lp, 2, 2, 2, 1 << 16); }

TEST(LfpsTest, TableSumsConvergeToHalfOverOneMinusR) {
  std::mt19937 rng(1);
  KvHead head(4096);
  for (int i = 0; i < 1500; ++i) head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
  LfpsParams lp;
  lp.eps = 2.0;  // no bypass
  LfpsPolicy policy = MakePolicy(lp);
  std::vector<int32_t> out;
  double ver = 0, sla = 0;
  // Cold start (no prefill): tables start at 0 and approach 0.5 / (1 - r) = 10 geometrically.
  for (int step = 0; step < 400; ++step) {
    head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
    const std::vector<float> q = Gaussian(rng, 2 * kHd, 2);
    ASSERT_TRUE(policy.Select(Ctx(head, q, 2, 64, 4, 16), out).ok());
    ASSERT_TRUE(SortedUnique(out, head.n()));
    ASSERT_LE(static_cast<int64_t>(out.size()), 64);
  }
  ASSERT_TRUE(policy.TableSums(0, 0, 0, &ver, &sla));
  EXPECT_NEAR(ver, 0.5 / (1 - 0.95), 1e-3 * 10 + 10 * std::pow(0.95, 400));
  EXPECT_NEAR(sla, 0.5 / (1 - 0.95), 1e-3 * 10 + 10 * std::pow(0.95, 400));
  // Primed tables start in the steady state and stay there.
  std::vector<float> qs = Gaussian(rng, 40 * 2 * kHd, 2);
  PrefillContext pc;
  pc.layer = 1;
  pc.q_pos0 = head.n() - 40;
  pc.num_q = 40;
  pc.n = head.n();
  pc.sink = 4;
  pc.window = 16;
  pc.q = qs.data();
  pc.params = Params(2);
  pc.kv = head.kv();
  ASSERT_TRUE(policy.OnPrefill(pc).ok());
  ASSERT_TRUE(policy.TableSums(0, 1, 0, &ver, &sla));
  EXPECT_NEAR(ver, 10.0, 1e-3);
  EXPECT_NEAR(sla, 10.0, 1e-3);
  for (int step = 0; step < 300; ++step) {  // crosses a renormalisation (r^270 < 1e-6)
    head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
    const std::vector<float> q = Gaussian(rng, 2 * kHd, 2);
    SelectContext c = Ctx(head, q, 2, 64, 4, 16);
    c.layer = 1;
    ASSERT_TRUE(policy.Select(c, out).ok());
  }
  ASSERT_TRUE(policy.TableSums(0, 1, 0, &ver, &sla));
  EXPECT_NEAR(ver, 10.0, 1e-2);
  EXPECT_NEAR(sla, 10.0, 1e-2);
}

// With every offloaded position a candidate, LFPS selects exactly the oracle's set: resident
// tokens plus the top-k of the group's summed softmax weight over the offloaded keys.
TEST(LfpsTest, AllCandidatesEqualsExactTopK) {
  for (int group : {1, 3, 4}) {
    std::mt19937 rng(10 + group);
    KvHead head(3000);
    for (int i = 0; i < 2500; ++i) head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
    LfpsParams lp;
    lp.score_all = true;
    lp.eps = 2.0;
    LfpsPolicy policy = MakePolicy(lp);
    const int sink = 4, window = 32;
    const int64_t budget = 100;
    const std::vector<float> q = Gaussian(rng, group * kHd, 3);
    std::vector<int32_t> out;
    ASSERT_TRUE(policy.Select(Ctx(head, q, group, budget, sink, window), out).ok());
    // The oracle, from the reference kernels.
    const int64_t n = head.n(), lo = sink, hi = n - window, k = budget - sink - window;
    std::vector<const void*> rows;
    for (int64_t i = lo; i < hi; ++i) rows.push_back(PagedKRow(head.kv(), i, kHd, 2));
    const int32_t m = static_cast<int32_t>(rows.size());
    std::vector<float> logits(static_cast<size_t>(group) * m), w(static_cast<size_t>(m), 0.0f);
    cpu::ScoreRowsRef(Params(group), q.data(), rows.data(), m, logits.data());
    for (int g = 0; g < group; ++g) {
      const float* l = logits.data() + g * m;
      const float mx = *std::max_element(l, l + m);
      double s = 0;
      for (int j = 0; j < m; ++j) s += std::exp(l[j] - mx);
      for (int j = 0; j < m; ++j) w[j] += static_cast<float>(std::exp(l[j] - mx) / s);
    }
    std::vector<int32_t> top(static_cast<size_t>(k));
    cpu::TopKRef(w.data(), m, k, top.data());
    std::vector<int32_t> want;
    for (int i = 0; i < sink; ++i) want.push_back(i);
    for (int32_t j : top) want.push_back(static_cast<int32_t>(lo + j));
    for (int64_t i = hi; i < n; ++i) want.push_back(static_cast<int32_t>(i));
    std::sort(want.begin(), want.end());
    EXPECT_EQ(out, want) << "group " << group;
  }
}

// k = n: the selection is everything and attention over it equals dense attention.
TEST(LfpsTest, FullBudgetEqualsDenseAttention) {
  std::mt19937 rng(3);
  KvHead head(1000);
  for (int i = 0; i < 777; ++i) head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
  LfpsPolicy policy = MakePolicy(LfpsParams{});
  const int group = 4;
  const std::vector<float> q = Gaussian(rng, group * kHd, 2);
  std::vector<int32_t> out;
  LfpsStepInfo info;
  ASSERT_TRUE(policy.SelectWithInfo(Ctx(head, q, group, head.n(), 4, 64), out, &info).ok());
  EXPECT_TRUE(info.all);
  ASSERT_EQ(static_cast<int64_t>(out.size()), head.n());
  std::vector<float> o(group * kHd), lse(group), o_ref(group * kHd), lse_ref(group);
  const AttnParams p = Params(group);
  cpu::PositionAttnItem item{q.data(), o.data(), lse.data(), head.kv(), out.data(),
                             static_cast<int32_t>(out.size())};
  cpu::AttendPositions(p, &item, 1);
  PagedAttnItem dense{q.data(), o_ref.data(), lse_ref.data(), head.kv(), head.n() - 1, 1};
  cpu::AttendPagedRef(p, dense);
  for (int i = 0; i < group * kHd; ++i) EXPECT_NEAR(o[i], o_ref[i], 2e-5) << i;
  for (int g = 0; g < group; ++g) EXPECT_NEAR(lse[g], lse_ref[g], 2e-5) << g;
}

// A key every query strongly matches (a fixed column) is found by the vertical table, without
// scoring everything: after warm-up the steps use the tables, not the exact fallback.
TEST(LfpsTest, VerticalTableKeepsAFixedColumn) {
  std::mt19937 rng(4);
  KvHead head(6000);
  const std::vector<float> needle = Gaussian(rng, kHd, 1);
  const int64_t needle_pos = 700;
  for (int i = 0; i < 3000; ++i) {
    head.Append(i == needle_pos ? needle : Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
  }
  LfpsParams lp;
  lp.eps = 2.0;
  LfpsPolicy policy = MakePolicy(lp);
  std::vector<int32_t> out;
  int with_needle = 0, table_steps = 0;
  int64_t scored = 0, offloaded = 0;
  for (int step = 0; step < 60; ++step) {
    head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
    std::vector<float> q = Gaussian(rng, kHd, 1);
    for (int d = 0; d < kHd; ++d) q[d] = 0.4f * q[d] + 2.5f * needle[d];
    LfpsStepInfo info;
    ASSERT_TRUE(policy.SelectWithInfo(Ctx(head, q, 1, 60, 4, 16), out, &info).ok());
    if (step < 5) continue;  // first steps may use the fallback to seed the tables
    with_needle += std::binary_search(out.begin(), out.end(), static_cast<int32_t>(needle_pos));
    table_steps += !info.fallback;
    scored += info.c1;
    offloaded += info.offloaded;
  }
  EXPECT_EQ(with_needle, 55);
  EXPECT_EQ(table_steps, 55);
  EXPECT_LT(static_cast<double>(scored) / offloaded, 0.2);
}

// A fixed diagonal (each query matches the key a fixed distance back) is tracked by the slash
// table: the matching key moves every step, so only the distance-indexed table can predict it.
TEST(LfpsTest, SlashTableKeepsAFixedDiagonal) {
  std::mt19937 rng(5);
  KvHead head(6000);
  std::vector<std::vector<float>> keys;
  for (int i = 0; i < 3000; ++i) {
    keys.push_back(Gaussian(rng, kHd, 1));
    head.Append(keys.back(), Gaussian(rng, kHd, 1));
  }
  constexpr int64_t kDistance = 100;
  LfpsParams lp;
  lp.eps = 2.0;
  LfpsPolicy policy = MakePolicy(lp);
  std::vector<int32_t> out;
  int hits = 0, table_steps = 0;
  int64_t scored = 0, offloaded = 0;
  for (int step = 0; step < 60; ++step) {
    keys.push_back(Gaussian(rng, kHd, 1));
    head.Append(keys.back(), Gaussian(rng, kHd, 1));
    const int64_t t = head.n() - 1;
    std::vector<float> q = Gaussian(rng, kHd, 1);
    for (int d = 0; d < kHd; ++d) q[d] = 0.4f * q[d] + 2.5f * keys[t - kDistance][d];
    LfpsStepInfo info;
    ASSERT_TRUE(policy.SelectWithInfo(Ctx(head, q, 1, 60, 4, 16), out, &info).ok());
    if (step < 5) continue;
    hits += std::binary_search(out.begin(), out.end(), static_cast<int32_t>(t - kDistance));
    table_steps += !info.fallback;
    scored += info.c1;
    offloaded += info.offloaded;
  }
  EXPECT_EQ(hits, 55);
  EXPECT_EQ(table_steps, 55);
  EXPECT_LT(static_cast<double>(scored) / offloaded, 0.2);
}

// A head whose attention is dominated by the sink is bypassed: it returns its resident set only
// and leaves its tables as they were; a head without a dominant sink is not.
TEST(LfpsTest, BypassReturnsResidentSetForSinkDominatedHeads) {
  std::mt19937 rng(6);
  KvHead head(3000);
  const std::vector<float> sink_key = Gaussian(rng, kHd, 1);
  for (int i = 0; i < 2000; ++i) {
    head.Append(i == 0 ? sink_key : Gaussian(rng, kHd, 0.3f), Gaussian(rng, kHd, 1));
  }
  std::vector<float> sink_q(kHd), plain_q = Gaussian(rng, kHd, 0.3f);
  for (int d = 0; d < kHd; ++d) sink_q[d] = 8.0f * sink_key[d];
  const int sink = 4, window = 32;
  PrefillContext pc;
  pc.q_pos0 = head.n() - 32;
  pc.num_q = 32;
  pc.n = head.n();
  pc.sink = sink;
  pc.window = window;
  std::vector<float> prefill_q;
  for (int r = 0; r < 32; ++r) prefill_q.insert(prefill_q.end(), plain_q.begin(), plain_q.end());
  pc.q = prefill_q.data();
  pc.params = Params(1);
  pc.kv = head.kv();
  LfpsPolicy policy = MakePolicy(LfpsParams{});
  ASSERT_TRUE(policy.OnPrefill(pc).ok());
  double ver0 = 0, sla0 = 0, ver1 = 0, sla1 = 0;
  ASSERT_TRUE(policy.TableSums(0, 0, 0, &ver0, &sla0));
  std::vector<int32_t> out;
  LfpsStepInfo info;
  ASSERT_TRUE(policy.SelectWithInfo(Ctx(head, sink_q, 1, 80, sink, window), out, &info).ok());
  EXPECT_TRUE(info.bypassed);
  EXPECT_GT(info.rho, 0.85);
  std::vector<int32_t> resident;
  for (int i = 0; i < sink; ++i) resident.push_back(i);
  for (int64_t i = head.n() - window; i < head.n(); ++i) resident.push_back(static_cast<int32_t>(i));
  EXPECT_EQ(out, resident);
  ASSERT_TRUE(policy.TableSums(0, 0, 0, &ver1, &sla1));
  EXPECT_EQ(ver0, ver1);
  EXPECT_EQ(sla0, sla1);
  // A diffuse query over the same head is not sink-dominated.
  ASSERT_TRUE(policy.SelectWithInfo(Ctx(head, plain_q, 1, 80, sink, window), out, &info).ok());
  EXPECT_FALSE(info.bypassed);
  EXPECT_LT(info.rho, 0.85);
  EXPECT_GT(out.size(), resident.size());
  EXPECT_EQ(policy.stats().bypassed, 1);
}

TEST(LfpsTest, FactoryParsesParamsAndRejectsUnknownKeys) {
  RuntimeConfig config;
  config.policy.name = "lfps";
  config.policy.params = {{"s", 16}, {"r", 0.9}, {"eps", 0.8}, {"a", 0.3}};
  auto policy = MakeLfpsPolicy(config);
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  EXPECT_EQ((*policy)->name(), "lfps");
  EXPECT_EQ((*policy)->placement(), Placement::kCpu);
  const auto& lfps = static_cast<const LfpsPolicy&>(**policy);
  EXPECT_EQ(lfps.params().s, 16);
  EXPECT_DOUBLE_EQ(lfps.params().r, 0.9);
  config.policy.params = {{"k_frac", 0.1}};
  auto bad = MakeLfpsPolicy(config);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("k_frac"), std::string::npos);
  config.policy.params = {{"r", 1.0}};
  EXPECT_EQ(MakeLfpsPolicy(config).status().code(), StatusCode::kInvalidArgument);
}

TEST(LfpsTest, SelectionIsResidentPlusAtMostBudget) {
  std::mt19937 rng(8);
  KvHead head(3000);
  for (int i = 0; i < 2000; ++i) head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
  LfpsPolicy policy = MakePolicy(LfpsParams{});
  std::vector<int32_t> out;
  for (int64_t budget : {1, 20, 36, 37, 500}) {
    const std::vector<float> q = Gaussian(rng, 3 * kHd, 1);
    ASSERT_TRUE(policy.Select(Ctx(head, q, 3, budget, 4, 32), out).ok());
    EXPECT_TRUE(SortedUnique(out, head.n()));
    EXPECT_LE(static_cast<int64_t>(out.size()), std::max<int64_t>(budget, 36));
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(std::binary_search(out.begin(), out.end(), i));
    EXPECT_EQ(out.back(), head.n() - 1);
  }
  SelectContext bad = Ctx(head, std::vector<float>(kHd), 1, 10, 4, 32);
  bad.slot = 7;
  EXPECT_EQ(policy.Select(bad, out).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry
