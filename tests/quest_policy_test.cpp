// Copyright kvferry authors. Apache-2.0.
// Quest: page bounds, upper-bound scores that never fall below a true score, incremental bounds
// equal to bounds built at once, the selection contract, parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "policies/basic.h"
#include "policies/quest/quest.h"
#include "tests/policy_test_util.h"

namespace kvferry {
namespace {

using testing_util::Context;
using testing_util::ExpectValidSelection;
using testing_util::OffloadedRecall;
using testing_util::Synthetic;

TEST(QuestCore, UpperBoundNeverBelowATrueScore) {
  for (int head_dim : {8, 64, 128}) {
    for (int group : {1, 3, 4}) {
      std::mt19937 rng(head_dim * 31 + group);
      std::normal_distribution<float> nd;
      const int page = 17;
      const int64_t pages = 9;
      std::vector<float> keys(static_cast<size_t>(pages * page * head_dim)), q(group * head_dim);
      for (float& x : keys) x = nd(rng) * 2.0f;
      for (float& x : q) x = nd(rng);
      std::vector<float> mins(pages * head_dim), maxs(pages * head_dim), ub(group * pages);
      for (int64_t p = 0; p < pages; ++p) {
        QuestPageBounds(keys.data() + p * page * head_dim, page, head_dim,
                        mins.data() + p * head_dim, maxs.data() + p * head_dim);
      }
      const float scale = 0.125f;
      QuestUpperBoundScores(q.data(), group, head_dim, mins.data(), maxs.data(), pages, scale,
                            ub.data());
      double norm = 0;
      for (int g = 0; g < group; ++g) {
        for (int64_t p = 0; p < pages; ++p) {
          for (int j = 0; j < page; ++j) {
            const float* k = keys.data() + (p * page + j) * head_dim;
            float s = 0;  // same order and precision as the bound
            for (int d = 0; d < head_dim; ++d) s += q[g * head_dim + d] * k[d];
            ASSERT_GE(ub[g * pages + p], scale * s) << "d" << head_dim << " g" << g << " page " << p;
            norm += std::fabs(s);
          }
        }
      }
      EXPECT_GT(norm, 0.0);
    }
  }
}

TEST(QuestCore, BoundsAreElementwiseMinMaxAndExtendMatches) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const int hd = 97;
  std::vector<float> keys(13 * hd);
  for (float& x : keys) x = nd(rng);
  std::vector<float> mn(hd), mx(hd), mn2(hd, INFINITY), mx2(hd, -INFINITY);
  QuestPageBounds(keys.data(), 13, hd, mn.data(), mx.data());
  for (int j = 0; j < 13; ++j) QuestExtendBounds(keys.data() + j * hd, hd, mn2.data(), mx2.data());
  for (int d = 0; d < hd; ++d) {
    float a = INFINITY, b = -INFINITY;
    for (int j = 0; j < 13; ++j) a = std::min(a, keys[j * hd + d]), b = std::max(b, keys[j * hd + d]);
    EXPECT_EQ(mn[d], a);
    EXPECT_EQ(mx[d], b);
    EXPECT_EQ(mn2[d], a);
    EXPECT_EQ(mx2[d], b);
  }
}

TEST(QuestPolicy, IncrementalSelectEqualsFreshPolicy) {
  // A policy that saw the sequence grow step by step selects what a fresh one selects.
  Synthetic syn(0, 3, 64, 1);
  Synthetic src(611, 3, 64, 2);
  QuestPolicy grown(QuestParams{}, 1, 1, 1);
  std::vector<int32_t> a, b;
  for (int64_t i = 0; i < src.kv.n(); ++i) {
    std::vector<float> k = src.kv.Key(i), v(64, 0.5f);
    syn.kv.Append(k.data(), v.data());
    if (i % 37 == 0 || i + 1 == src.kv.n()) {
      SelectContext ctx = Context(syn.kv, src.q.data(), 3, 4, 16, 100);
      ASSERT_TRUE(grown.Select(ctx, a).ok());
      QuestPolicy fresh(QuestParams{}, 1, 1, 1);
      ASSERT_TRUE(fresh.Select(ctx, b).ok());
      EXPECT_EQ(a, b) << "n " << ctx.n;
      ExpectValidSelection(ctx, a);
    }
  }
}

TEST(QuestPolicy, SelectsWholePagesAndBeatsStreamingOnRecall) {
  double quest = 0, stream = 0;
  for (uint32_t seed = 0; seed < 6; ++seed) {
    Synthetic syn(1501, 4, 64, 100 + seed);
    SelectContext ctx = Context(syn.kv, syn.q.data(), 4, 4, 32, 4 + 32 + 160);
    QuestPolicy policy(QuestParams{}, 1, 1, 1);
    std::vector<int32_t> sel, st;
    ASSERT_TRUE(policy.Select(ctx, sel).ok());
    ExpectValidSelection(ctx, sel);
    EXPECT_EQ(static_cast<int64_t>(sel.size()), ctx.budget);
    quest += OffloadedRecall(ctx, sel);
    StreamingSelect(ctx.n, ctx.sink, ctx.budget, st);
    stream += OffloadedRecall(ctx, st);
  }
  EXPECT_GT(quest, stream + 0.5) << "quest " << quest / 6 << " streaming " << stream / 6;
}

TEST(QuestPolicy, BadParametersNameTheParameter) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, double>>{
           {"page", 0}, {"page", 1.5}, {"page", 5000}, {"pages", 16}}) {
    auto r = ParseQuestParams({{key, value}});
    ASSERT_FALSE(r.ok()) << key << "=" << value;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().message();
  }
  auto ok = ParseQuestParams({{"page", 8}});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok.value().page, 8);
}

}  // namespace
}  // namespace kvferry
