// Copyright kvferry authors. Apache-2.0.
// SparCas: dimension choice, partial scores, d_b = head_dim gives exactly the oracle's ranking,
// recall of the exact top-k monotone in d_b, refresh every u steps, parameters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "policies/sparcas.h"
#include "tests/policy_test_util.h"

namespace kvferry {
namespace {

using testing_util::Context;
using testing_util::ExpectValidSelection;
using testing_util::OffloadedRecall;
using testing_util::Synthetic;

TEST(SparcasCore, ChooseDimsIsArgsortOfGroupAbsSumTiesLowerDim) {
  const int hd = 17, group = 3;
  std::vector<float> q(group * hd);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (float& x : q) x = nd(rng);
  q[0 * hd + 5] = 0, q[1 * hd + 5] = 0, q[2 * hd + 5] = 0;  // a tie at zero with dim 9
  q[0 * hd + 9] = 0, q[1 * hd + 9] = 0, q[2 * hd + 9] = 0;
  for (int d_b : {1, 4, 16, 17}) {
    std::vector<int32_t> dims(d_b);
    SparcasChooseDims(q.data(), group, hd, d_b, dims.data());
    std::vector<float> imp(hd, 0.0f);
    for (int g = 0; g < group; ++g) for (int d = 0; d < hd; ++d) imp[d] += std::fabs(q[g * hd + d]);
    std::vector<int32_t> ref(hd);
    std::iota(ref.begin(), ref.end(), 0);
    std::stable_sort(ref.begin(), ref.end(), [&](int a, int b) { return imp[a] > imp[b]; });
    ref.resize(d_b);
    std::sort(ref.begin(), ref.end());
    EXPECT_EQ(dims, ref) << "d_b " << d_b;
  }
}

TEST(SparcasCore, ApproxScoresWithAllDimsAreTheDotProducts) {
  const int hd = 64, group = 4;
  const int64_t n = 97;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  std::vector<float> q(group * hd), keys(n * hd), out(group * n);
  for (float& x : q) x = nd(rng);
  for (float& x : keys) x = nd(rng);
  std::vector<int32_t> dims(hd);
  std::iota(dims.begin(), dims.end(), 0);
  SparcasApproxScores(q.data(), group, hd, dims.data(), hd, keys.data(), n, 0.5f, out.data(), n);
  double norm = 0;
  for (int g = 0; g < group; ++g) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0;
      for (int d = 0; d < hd; ++d) ref += static_cast<double>(q[g * hd + d]) * keys[j * hd + d];
      EXPECT_NEAR(out[g * n + j], 0.5 * ref, 1e-4);
      norm += std::fabs(ref);
    }
  }
  EXPECT_GT(norm, 0.0);
  // Gather picks the dims.
  std::vector<int32_t> some = {1, 7, 33};
  float c[3];
  SparcasGatherCompact(keys.data(), some.data(), 3, c);
  EXPECT_EQ(c[0], keys[1]);
  EXPECT_EQ(c[1], keys[7]);
  EXPECT_EQ(c[2], keys[33]);
}

// d_b = head_dim: the selection equals the oracle's (exact top-k of the group's summed softmax
// over all keys, the resident positions forced in).
TEST(SparcasPolicy, FullDimsGiveTheOracleMask) {
  for (int hd : {64, 128}) {
    for (int group : {1, 3, 4, 8}) {
      for (int64_t n : {17, 97, 1203}) {
        Synthetic syn(n, group, hd, static_cast<uint32_t>(hd + group * 7 + n));
        SparcasParams sp;
        sp.d_b = hd;
        SparcasPolicy policy(sp, 1, 1, 1);
        sp.dense_layers = 0;
        SelectContext ctx = Context(syn.kv, syn.q.data(), group, 4, 8, 4 + 8 + n / 5);
        std::vector<int32_t> sel, exact;
        ASSERT_TRUE(policy.Select(ctx, sel).ok());
        ExpectValidSelection(ctx, sel);
        const OffloadSplit s = SplitPositions(ctx.n, ctx.sink, ctx.window, ctx.budget);
        if (s.all) continue;
        const int64_t k = ExactOffloadedTopK(ctx, s, exact);
        std::vector<int32_t> oracle;
        FinishSelection(s, exact.data(), k, oracle);
        EXPECT_EQ(sel, oracle) << "hd " << hd << " group " << group << " n " << n;
      }
    }
  }
}

TEST(SparcasPolicy, RecallMonotoneInDb) {
  const int hd = 64;
  std::vector<int> dbs = {1, 2, 4, 8, 16, 32, 64};
  std::vector<double> recall(dbs.size(), 0.0);
  const int trials = 12;
  for (int t = 0; t < trials; ++t) {
    Synthetic syn(2049, 3, hd, 500 + t);
    for (size_t i = 0; i < dbs.size(); ++i) {
      SparcasParams sp;
      sp.d_b = dbs[i];
      sp.dense_layers = 0;
      SparcasPolicy policy(sp, 1, 1, 1);
      SelectContext ctx = Context(syn.kv, syn.q.data(), 3, 4, 32, 4 + 32 + 128);
      std::vector<int32_t> sel;
      ASSERT_TRUE(policy.Select(ctx, sel).ok());
      recall[i] += OffloadedRecall(ctx, sel) / trials;
    }
  }
  for (size_t i = 0; i + 1 < dbs.size(); ++i) {
    EXPECT_GE(recall[i + 1], recall[i] - 0.005) << "d_b " << dbs[i] << " -> " << dbs[i + 1];
  }
  EXPECT_DOUBLE_EQ(recall.back(), 1.0);
  EXPECT_GT(recall[3], 0.6) << "d_b 8 of 64";
  for (size_t i = 0; i < dbs.size(); ++i) std::printf("d_b %d recall %.4f\n", dbs[i], recall[i]);
}

TEST(SparcasPolicy, DimsRefreshEveryUStepsAndFirstLayersUseEveryDim) {
  const int hd = 64;
  Synthetic syn(800, 1, hd, 77);
  SparcasParams sp;
  sp.u = 3;
  SparcasPolicy policy(sp, 1, 4, 1);
  // Layer 0 (< dense_layers 2) behaves as d_b = head_dim: the oracle mask.
  SelectContext ctx0 = Context(syn.kv, syn.q.data(), 1, 4, 16, 100, 0);
  std::vector<int32_t> sel, exact, oracle;
  ASSERT_TRUE(policy.Select(ctx0, sel).ok());
  const OffloadSplit s = SplitPositions(ctx0.n, 4, 16, 100);
  const int64_t k = ExactOffloadedTopK(ctx0, s, exact);
  FinishSelection(s, exact.data(), k, oracle);
  EXPECT_EQ(sel, oracle);
  // Layer 3: the dims chosen from the first query are kept for u = 3 steps, whatever q does.
  std::vector<float> q2(hd);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& x : q2) x = nd(rng);
  SelectContext c1 = Context(syn.kv, syn.q.data(), 1, 4, 16, 100, 3);
  SelectContext c2 = Context(syn.kv, q2.data(), 1, 4, 16, 100, 3);
  std::vector<int32_t> a, b, b_fresh;
  ASSERT_TRUE(policy.Select(c1, a).ok());  // dims from q (step 1 of 3)
  ASSERT_TRUE(policy.Select(c2, b).ok());  // step 2: dims of q, scores of q2
  std::vector<int32_t> dims_q(SparcasDb(sp, hd)), dims_q2(SparcasDb(sp, hd));
  SparcasChooseDims(syn.q.data(), 1, hd, SparcasDb(sp, hd), dims_q.data());
  SparcasChooseDims(q2.data(), 1, hd, SparcasDb(sp, hd), dims_q2.data());
  ASSERT_NE(dims_q, dims_q2);
  SparcasPolicy fresh(sp, 1, 4, 1);
  ASSERT_TRUE(fresh.Select(c2, b_fresh).ok());  // dims of q2
  ASSERT_TRUE(policy.Select(c2, b).ok());  // step 3: still q's dims
  std::vector<int32_t> b4;
  ASSERT_TRUE(policy.Select(c2, b4).ok());  // step 4: refreshed to q2's dims
  EXPECT_EQ(b4, b_fresh);
  EXPECT_NE(b, b_fresh) << "dims should not have refreshed before u steps";
}

TEST(SparcasPolicy, BadParametersNameTheParameter) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, double>>{
           {"d_b", 0}, {"d_b", 2.5}, {"u", 0}, {"dense_layers", -1}, {"db", 16}}) {
    auto r = ParseSparcasParams({{key, value}});
    ASSERT_FALSE(r.ok()) << key << "=" << value;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(SparcasDb(SparcasParams{}, 128), 16);
  EXPECT_EQ(SparcasDb(SparcasParams{}, 64), 8);
}

}  // namespace
}  // namespace kvferry
