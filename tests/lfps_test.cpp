// Copyright kvferry authors. Apache-2.0.
// LFPS as a specification: the table invariant, the degenerate settings (candidates = everything
// is exact top-k, k = n is dense attention), the two history tables tracking what they claim to
// track, the bypass, and the parameter contract of the factory.
#include "policies/lfps/lfps.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>

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
// tokens plus the top-k of the group's summed softmax weight over the offloaded keys. rank 0 (the
// paper) normalises each head's softmax over the candidates; rank 1 also over the resident sinks
// and local tokens (closer to each head's weights over everything).
TEST(LfpsTest, AllCandidatesEqualsExactTopK) {
  for (int rank : {0, 1}) {
    for (int group : {1, 3, 4}) {
      std::mt19937 rng(10 + group + 7 * rank);
      KvHead head(3000);
      for (int i = 0; i < 2500; ++i) head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
      LfpsParams lp;
      lp.score_all = true;
      lp.eps = 2.0;
      lp.rank = rank;
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
      if (rank == 1) {  // normaliser rows
        for (int64_t i = 0; i < sink; ++i) rows.push_back(PagedKRow(head.kv(), i, kHd, 2));
        for (int64_t i = n - lp.local; i < n; ++i) rows.push_back(PagedKRow(head.kv(), i, kHd, 2));
      }
      const int32_t ld = static_cast<int32_t>(rows.size());
      std::vector<float> logits(static_cast<size_t>(group) * ld), w(static_cast<size_t>(m), 0.0f);
      cpu::ScoreRowsRef(Params(group), q.data(), rows.data(), ld, logits.data());
      for (int g = 0; g < group; ++g) {
        const float* l = logits.data() + g * ld;
        const float mx = *std::max_element(l, l + ld);
        double s = 0;
        for (int j = 0; j < ld; ++j) s += std::exp(l[j] - mx);
        for (int j = 0; j < m; ++j) w[j] += static_cast<float>(std::exp(l[j] - mx) / s);
      }
      std::vector<int32_t> top(static_cast<size_t>(k));
      cpu::TopKRef(w.data(), m, k, top.data());
      std::vector<int32_t> want;
      for (int i = 0; i < sink; ++i) want.push_back(i);
      for (int32_t j : top) want.push_back(static_cast<int32_t>(lo + j));
      for (int64_t i = hi; i < n; ++i) want.push_back(static_cast<int32_t>(i));
      std::sort(want.begin(), want.end());
      EXPECT_EQ(out, want) << "group " << group << " rank " << rank;
    }
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

// Primes a policy's head from the last 32 queries of a random prompt.
void Prime(LfpsPolicy& policy, const KvHead& head, int group, int kv_head, int sink, int window,
           std::mt19937& rng) {
  std::vector<float> qs = Gaussian(rng, 32 * group * kHd, 1);
  PrefillContext pc;
  pc.kv_head = kv_head;
  pc.q_pos0 = head.n() - 32;
  pc.num_q = 32;
  pc.n = head.n();
  pc.sink = sink;
  pc.window = window;
  pc.q = qs.data();
  pc.params = Params(group);
  pc.kv = head.kv();
  ASSERT_TRUE(policy.OnPrefill(pc).ok());
}

// The budget is used: whenever more tokens are offloaded than the budget leaves room for
// (n - sink - window > budget - sink - window), a step that is not bypassed attends exactly the
// budget (resident tokens included), with the scan, with the fill alone, and not in the paper's
// mode (which attends what the tables nominate).
TEST(LfpsTest, AttendsTheWholeBudget) {
  struct Mode {
    double fill;
    int scan;
    bool whole;
  };
  for (const Mode mode : {Mode{1.0, 16, true}, Mode{1.0, 0, true}, Mode{0.0, 0, false}}) {
    std::mt19937 rng(21);
    KvHead head(5000);
    for (int i = 0; i < 3000; ++i) head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
    LfpsParams lp;
    lp.eps = 2.0;
    lp.fill = mode.fill;
    lp.scan = mode.scan;
    lp.fallback = false;
    LfpsPolicy policy = MakePolicy(lp);
    const int sink = 4, window = 64, group = 3;
    Prime(policy, head, group, 0, sink, window, rng);
    std::vector<int32_t> out;
    int64_t steps = 0, whole = 0, big_steps = 0, big_whole = 0;
    for (int step = 0; step < 80; ++step) {
      head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
      const int64_t budget = std::vector<int64_t>{70, 82, 128, 256, 600}[step % 5];
      const std::vector<float> q = Gaussian(rng, group * kHd, 1.5);
      LfpsStepInfo info;
      ASSERT_TRUE(policy.SelectWithInfo(Ctx(head, q, group, budget, sink, window), out, &info).ok());
      ASSERT_TRUE(SortedUnique(out, head.n()));
      ASSERT_LE(static_cast<int64_t>(out.size()), budget);
      ASSERT_GT(head.n() - sink - window, budget - sink - window);
      ++steps;
      whole += static_cast<int64_t>(out.size()) == budget;
      big_steps += budget == 600;
      big_whole += budget == 600 && static_cast<int64_t>(out.size()) == budget;
    }
    if (mode.whole) {
      EXPECT_EQ(whole, steps) << "fill " << mode.fill << " scan " << mode.scan;
    } else {
      EXPECT_LT(big_whole, big_steps) << "the paper's mode leaves a large budget unused";
    }
  }
}

// A key the query matches at a new random offloaded position every step has no history, so only
// the scan can nominate it; with the scan it is attended (almost) every step, without it rarely.
TEST(LfpsTest, ScanFindsKeysWithoutHistory) {
  for (int scan : {16, 0}) {
    std::mt19937 rng(22);
    KvHead head(6000);
    std::vector<std::vector<float>> keys;
    for (int i = 0; i < 4000; ++i) {
      keys.push_back(Gaussian(rng, kHd, 1));
      head.Append(keys.back(), Gaussian(rng, kHd, 1));
    }
    LfpsParams lp;
    lp.eps = 2.0;
    lp.scan = scan;
    LfpsPolicy policy = MakePolicy(lp);
    const int sink = 4, window = 64, group = 2;
    Prime(policy, head, group, 0, sink, window, rng);
    std::vector<int32_t> out;
    int found = 0;
    const int steps = 60;
    for (int step = 0; step < steps; ++step) {
      head.Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
      const int64_t target = sink + static_cast<int64_t>(rng() % (head.n() - sink - window));
      std::vector<float> q = Gaussian(rng, group * kHd, 0.3f);
      for (int d = 0; d < kHd; ++d) q[d] += 1.5f * keys[target][d];  // head 0 retrieves it
      ASSERT_TRUE(policy.Select(Ctx(head, q, group, 128, sink, window), out).ok());
      found += std::binary_search(out.begin(), out.end(), static_cast<int32_t>(target));
    }
    if (scan > 0) {
      EXPECT_GE(found, steps - 2);
    } else {
      EXPECT_LT(found, steps / 3);
    }
  }
}

// The work of a decode step is bounded by the budget, not by the context (the defaults once cost
// more than exact top-k per step: the first scan quantised every K row inside a token step, and a
// step whose tables nominated nothing scored every offloaded key). Uniform random keys and a
// constant query, as kvferry-e2e makes them: flat tables from 32 prompt rows nominate nothing at the
// first steps. Every step scores at most the expansion of C0 plus the scan's and the fill's shares
// of k exactly, never every offloaded key, and quantises only its own new K row into the shadow.
TEST(LfpsTest, DecodeWorkIsBoundedByTheBudget) {
  for (const int64_t n0 : {int64_t{4099}, int64_t{20011}}) {
    std::mt19937 rng(23);
    std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
    auto uniform = [&](int n) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& v : x) v = uni(rng);
      return x;
    };
    const int steps = 24;
    KvHead head(n0 + steps);
    for (int64_t i = 0; i < n0; ++i) head.Append(uniform(kHd), uniform(kHd));
    LfpsParams lp;  // the defaults: rank 1, fill 1, scan 16, scan_factor 2
    LfpsPolicy policy = MakePolicy(lp);
    const int sink = 4, window = 256, group = 4;
    Prime(policy, head, group, 0, sink, window, rng);
    const std::vector<float> q = uniform(group * kHd);
    const std::vector<float> new_k = uniform(kHd), new_v = uniform(kHd);
    std::vector<int32_t> out;
    int64_t rescued = 0;
    for (int step = 0; step < steps; ++step) {
      head.Append(new_k, new_v);
      const int64_t budget = static_cast<int64_t>(std::ceil(0.02 * head.n())) + sink + window;
      LfpsStepInfo info;
      ASSERT_TRUE(
          policy.SelectWithInfo(Ctx(head, q, group, budget, sink, window), out, &info).ok());
      const int64_t k = budget - sink - window;
      ASSERT_GT(k, 0);
      const int64_t bound = 4 * info.c0 + static_cast<int64_t>(std::ceil(lp.scan_factor * k)) +
                            static_cast<int64_t>(std::ceil(lp.fill * k));
      EXPECT_FALSE(info.fallback) << "n0 " << n0 << " step " << step;
      EXPECT_LE(info.c1, bound) << "n0 " << n0 << " step " << step << " c0 " << info.c0;
      EXPECT_LT(info.c1, info.offloaded / 4) << "n0 " << n0 << " step " << step;
      EXPECT_EQ(static_cast<int64_t>(out.size()), budget) << "n0 " << n0 << " step " << step;
      rescued += info.rescued;
    }
    EXPECT_GT(rescued, 0) << "n0 " << n0;  // the workload reaches the no-candidate case
    const LfpsStats st = policy.stats();
    EXPECT_LE(st.shadow_rows_in_select, steps) << "n0 " << n0;
    EXPECT_LE(st.scored_keys, steps * (n0 / 4)) << "n0 " << n0;
  }
}

// Per-head budgets: heads whose attention lies on offloaded tokens get more of the layer's budget
// than sink-dominated heads, none more than ctx.budget, the layer's total at most heads x B.
TEST(LfpsTest, PerHeadBudgetFollowsNeed) {
  std::mt19937 rng(23);
  constexpr int kHeads = 3, group = 2, sink = 4, window = 32;
  std::vector<std::unique_ptr<KvHead>> heads;
  const std::vector<float> sink_key = Gaussian(rng, kHd, 1);
  for (int h = 0; h < kHeads; ++h) {
    heads.push_back(std::make_unique<KvHead>(4000));
    for (int i = 0; i < 2500; ++i) {
      heads[h]->Append(i == 0 && h > 0 ? sink_key : Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
    }
  }
  LfpsParams lp;
  lp.eps = 2.0;
  lp.per_head_budget = 150;
  LfpsPolicy policy(lp, 1, 1, kHeads, 1 << 14);
  for (int h = 0; h < kHeads; ++h) Prime(policy, *heads[h], group, h, sink, window, rng);
  std::vector<int32_t> out;
  std::vector<int64_t> attended(kHeads, 0);
  const int64_t cap = 400;
  for (int step = 0; step < 60; ++step) {
    int64_t total = 0;
    for (int h = 0; h < kHeads; ++h) {
      heads[h]->Append(Gaussian(rng, kHd, 1), Gaussian(rng, kHd, 1));
      // Head 0 spreads its attention over the offloaded keys; heads 1 and 2 look at the sink.
      std::vector<float> q = Gaussian(rng, group * kHd, 0.5f);
      if (h > 0) {
        for (int g = 0; g < group; ++g) {
          for (int d = 0; d < kHd; ++d) q[g * kHd + d] += 3.0f * sink_key[d];
        }
      }
      SelectContext c = Ctx(*heads[h], q, group, cap, sink, window);
      c.kv_head = h;
      ASSERT_TRUE(policy.Select(c, out).ok());
      ASSERT_TRUE(SortedUnique(out, heads[h]->n()));
      ASSERT_LE(static_cast<int64_t>(out.size()), cap);
      if (step >= 20) attended[h] += static_cast<int64_t>(out.size());
      total += static_cast<int64_t>(out.size()) - sink - window;
    }
    EXPECT_LE(total, kHeads * (150 - sink - window) + kHeads);
  }
  EXPECT_GT(attended[0], 2 * attended[1]);
  EXPECT_GT(attended[0], 2 * attended[2]);
}

TEST(LfpsTest, FactoryParsesBudgetFillingParams) {
  RuntimeConfig config;
  config.policy.name = "lfps";
  config.policy.params = {{"fill", 1.5}, {"rank", 0}, {"scan", 8}, {"scan_factor", 3},
                          {"scan_max_period", 4}, {"per_head_budget", 256}};
  auto policy = MakeLfpsPolicy(config);
  ASSERT_TRUE(policy.ok()) << policy.status().ToString();
  const auto& lfps = static_cast<const LfpsPolicy&>(**policy);
  EXPECT_DOUBLE_EQ(lfps.params().fill, 1.5);
  EXPECT_EQ(lfps.params().rank, 0);
  EXPECT_EQ(lfps.params().scan, 8);
  EXPECT_DOUBLE_EQ(lfps.params().scan_factor, 3.0);
  EXPECT_EQ(lfps.params().scan_max_period, 4);
  EXPECT_EQ(lfps.params().per_head_budget, 256);
  for (const auto& bad : std::vector<std::pair<std::string, double>>{
           {"rank", 3}, {"scan", 1.5}, {"scan", 300}, {"fill", -1}, {"scan_max_period", 0},
           {"per_head_budget", -2}}) {
    config.policy.params = {bad};
    EXPECT_EQ(MakeLfpsPolicy(config).status().code(), StatusCode::kInvalidArgument) << bad.first;
  }
}

}  // namespace
}  // namespace kvferry
