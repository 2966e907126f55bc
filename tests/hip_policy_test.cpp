// Copyright kvferry authors. Apache-2.0.
// HiP: the mask's shape (K' blocks, ascending, in range; everything when it fits), the centre
// representative beating random and first/last ones on recall at equal k, the cached mask and its
// refresh every r_m steps, parameters.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <random>
#include <set>
#include <vector>

#include "kvferry/kvferry.h"
#include "policies/hip/hip.h"
#include "policies/device_selector.h"
#include "tests/policy_test_util.h"

namespace kvferry {
namespace {

using testing_util::Context;
using testing_util::SelectedRecall;
using testing_util::Synthetic;

// HiP with its mask from layer 0 on (no dense layers), rebuilt every r_m ranked steps (and on
// drift), served with the given lag.
HipParams MaskParams(int r_m, int lag, double drift = 0.0) {
  HipParams hp;
  hp.r_m = r_m;
  hp.dense_layers = 0;
  hp.lag = lag;
  hp.drift = drift;
  return hp;
}

TEST(HipCore, MaskShape) {
  for (int bk : {1, 2, 3}) {
    for (int64_t len : {1, 17, 97, 1001}) {
      for (int64_t k : {0, 1, 5, 64, 2000}) {
       for (bool align : {true, false}) {
        Synthetic syn(len + 7, 2, 64, static_cast<uint32_t>(bk * 1000 + len + k));
        HipMaskOptions opt;
        opt.bk = bk;
        opt.align = align;
        std::vector<int32_t> blocks;
        const int64_t got = HipMask(testing_util::Params(2, 64, DType::kBF16), syn.q.data(),
                                    syn.kv.pages(), 7, 7 + len, k, opt, blocks);
        const int64_t nb = (len + bk - 1) / bk;
        EXPECT_EQ(got, static_cast<int64_t>(blocks.size()));
        EXPECT_EQ(got, std::min(nb, k / bk)) << "bk " << bk << " len " << len << " k " << k;
        EXPECT_TRUE(std::is_sorted(blocks.begin(), blocks.end()));
        EXPECT_TRUE(std::adjacent_find(blocks.begin(), blocks.end()) == blocks.end());
        for (int32_t b : blocks) {
          EXPECT_GE(b, 0);
          EXPECT_LT(b, nb);
        }
       }
      }
    }
  }
}

// The aligned first nodes keep the tree in place as the sequence grows: with the same query, the
// mask rebuilt 16 tokens later keeps nearly every block of the last one (only new blocks at the
// end may displace a few), where the paper's even nodes, whose bounds all move, change more.
TEST(HipCore, AlignedNodesKeepTheMaskAsTheSequenceGrows) {
  double kept[2] = {0, 0};
  const int trials = 8;
  for (int t = 0; t < trials; ++t) {
    Synthetic syn(4100, 2, 64, 500 + t, DType::kBF16, 0.97, 8, 24);
    const AttnParams p = testing_util::Params(2, 64, DType::kBF16);
    for (int align = 0; align < 2; ++align) {
      HipMaskOptions opt;
      opt.align = align != 0;
      std::vector<int32_t> a, b;
      HipMask(p, syn.q.data(), syn.kv.pages(), 4, 4000, 256, opt, a);
      HipMask(p, syn.q.data(), syn.kv.pages(), 4, 4016, 256, opt, b);
      std::vector<int32_t> common;
      std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(common));
      kept[align] += static_cast<double>(common.size()) / static_cast<double>(a.size()) / trials;
    }
  }
  std::printf("blocks kept after 16 tokens: even nodes %.3f, aligned %.3f\n", kept[0], kept[1]);
  EXPECT_GE(kept[1], 0.95);
  EXPECT_GT(kept[1], kept[0]);
}

TEST(HipCore, RepresentativeBlocks) {
  HipMaskOptions opt;
  EXPECT_EQ(HipRepresentativeBlock(10, 11, opt), 10);
  EXPECT_EQ(HipRepresentativeBlock(10, 14, opt), 11);
  EXPECT_EQ(HipRepresentativeBlock(10, 15, opt), 12);
  opt.rep = HipRepresentative::kFirst;
  EXPECT_EQ(HipRepresentativeBlock(10, 15, opt), 10);
  opt.rep = HipRepresentative::kLast;
  EXPECT_EQ(HipRepresentativeBlock(10, 15, opt), 14);
  opt.rep = HipRepresentative::kRandom;
  for (uint64_t s = 0; s < 50; ++s) {
    opt.seed = s;
    const int64_t r = HipRepresentativeBlock(10, 15, opt);
    EXPECT_GE(r, 10);
    EXPECT_LT(r, 15);
    EXPECT_EQ(r, HipRepresentativeBlock(10, 15, opt));  // deterministic
  }
}

TEST(HipCore, BlockScoreIsMaxOverGroupAndTokens) {
  Synthetic syn(20, 3, 64, 4);
  const AttnParams p = testing_util::Params(3, 64, DType::kBF16);
  const float s = HipBlockScore(p, syn.q.data(), syn.kv.pages(), 2, 19, 8, 2);  // tokens 18
  float best = -INFINITY;
  for (int64_t t : {18}) {
    std::vector<float> k = syn.kv.Key(t);
    for (int g = 0; g < 3; ++g) {
      float d = 0;
      for (int e = 0; e < 64; ++e) d += syn.q[g * 64 + e] * k[e];
      best = std::max(best, p.scale * d);
    }
  }
  EXPECT_FLOAT_EQ(s, best);
}

// Theorem 1 of the paper, on attention with locality: at equal k, the centre representative
// finds more of the exact top-k than a random, the first or the last block of each branch.
TEST(HipPolicy, CentreBeatsRandomAndFirstLastOnRecall) {
  double recall[4] = {0, 0, 0, 0};
  const int trials = 24;
  for (int t = 0; t < trials; ++t) {
    Synthetic syn(4001, 3, 64, 900 + t, DType::kBF16, 0.97, 8, 24);
    for (int rep = 0; rep < 4; ++rep) {
      HipParams hp;
      hp.rep = rep;
      hp.dense_layers = 0;
      hp.align = 0;  // the paper's even nodes (the aligned runs leave centre and first about even here)
      HipPolicy policy(hp, 1, 1, 1);
      recall[rep] += SelectedRecall(policy, Context(syn.kv, syn.q.data(), 3, 4, 64, 4 + 64 + 256)) / trials;
    }
  }
  std::printf("recall centre %.4f first %.4f last %.4f random %.4f\n", recall[0], recall[1],
              recall[2], recall[3]);
  EXPECT_GT(recall[0], recall[3]);
  EXPECT_GT(recall[0], recall[1]);
  EXPECT_GT(recall[0], recall[2]);
}

// The mask is kept r_m = 4 ranked steps, then rebuilt from the due step's query (step 5). With lag
// 0 (the default) that step uses it; with lag 1 the due step keeps the old mask and the rebuilt
// one serves from the next step (6), whatever that step's query. A first mask serves at once.
TEST(HipPolicy, MaskCachedForRmStepsThenRebuilt) {
  Synthetic syn(700, 1, 64, 12);
  std::vector<float> q2(64);
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  for (float& x : q2) x = nd(rng);
  const SelectContext c1 = Context(syn.kv, syn.q.data(), 1, 4, 32, 4 + 32 + 64);
  const SelectContext c2 = Context(syn.kv, q2.data(), 1, 4, 32, 4 + 32 + 64);
  for (int lag : {0, 1}) {
    const HipParams hp = MaskParams(4, lag);
    HipPolicy policy(hp, 1, 1, 1), fresh(hp, 1, 1, 1);
    std::vector<int32_t> first, sel, fresh_sel;
    ASSERT_TRUE(policy.Select(c1, first).ok());
    ASSERT_TRUE(fresh.Select(c2, fresh_sel).ok());
    ASSERT_NE(fresh_sel, first);
    for (int step = 2; step <= 4 + lag; ++step) {
      ASSERT_TRUE(policy.Select(c2, sel).ok());
      EXPECT_EQ(sel, first) << "lag " << lag << " step " << step << " should reuse the cached mask";
    }
    ASSERT_TRUE(policy.Select(lag == 0 ? c2 : c1, sel).ok());  // rebuilt from q2 at step 5
    EXPECT_EQ(sel, fresh_sel) << "lag " << lag;
  }
}

// drift's rule (policies/hip/mask.h): a head drifts when the cosine of its int8 codes to the build
// query's is below d; a group when any head does; 0 is off.
TEST(HipCore, DriftIsTheCodesCosineBelowTheThreshold) {
  EXPECT_FALSE(HipDriftedHead(9, 10, 10, 0.9f));    // cosine 0.9 exactly (d^2 rounds below 0.81)
  EXPECT_TRUE(HipDriftedHead(8, 10, 10, 0.9f));     // 0.8
  EXPECT_TRUE(HipDriftedHead(-1, 10, 10, 0.01f));   // pointing away
  EXPECT_FALSE(HipDriftedHead(-50, 10, 10, 0.0f));  // off
  EXPECT_FALSE(HipDriftedHead(0, 0, 0, 0.5f));      // a zero query: nothing to compare
  const int8_t built[8] = {10, 0, 0, 0, 0, 10, 0, 0};
  const int8_t same[8] = {20, 1, 0, 0, 0, 30, 0, 0};   // head 0 cosine 0.9988, head 1 1
  const int8_t moved[8] = {20, 1, 0, 0, 0, 3, 9, 0};   // head 1 cosine 0.316
  EXPECT_FALSE(HipQueryDrifted(built, same, 2, 4, 0.9f));
  EXPECT_TRUE(HipQueryDrifted(built, moved, 2, 4, 0.9f));
  EXPECT_FALSE(HipQueryDrifted(built, moved, 2, 4, 0.3f));
  EXPECT_EQ(HipSinceAfterBuild(7, 10, 99, 3, 10, 100, 8, 13, /*drifted=*/true), 0);
}

// With drift the mask is rebuilt before its interval at the step whose query moved (cosine below
// d; with lag 1 served from the next step), and kept while the query stays near the build query.
TEST(HipPolicy, DriftRebuildsTheMaskWhenTheQueryMoves) {
  Synthetic syn(700, 2, 64, 14);
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  std::vector<float> near(syn.q), far(syn.q.size());
  for (float& x : near) x += 0.05f * nd(rng);  // cosine about 0.999
  for (float& x : far) x = nd(rng);
  const SelectContext c1 = Context(syn.kv, syn.q.data(), 2, 4, 32, 4 + 32 + 64);
  const SelectContext cn = Context(syn.kv, near.data(), 2, 4, 32, 4 + 32 + 64);
  const SelectContext cf = Context(syn.kv, far.data(), 2, 4, 32, 4 + 32 + 64);
  for (int lag : {0, 1}) {
    for (double drift : {0.0, 0.9}) {
      const HipParams hp = MaskParams(100, lag, drift);
      HipPolicy policy(hp, 1, 1, 1), fresh(hp, 1, 1, 1);
      std::vector<int32_t> first, sel, far_sel;
      ASSERT_TRUE(policy.Select(c1, first).ok());
      ASSERT_TRUE(fresh.Select(cf, far_sel).ok());
      ASSERT_NE(far_sel, first);
      for (int step = 2; step <= 4; ++step) {
        ASSERT_TRUE(policy.Select(cn, sel).ok());
        EXPECT_EQ(sel, first) << "lag " << lag << " drift " << drift << " step " << step;
      }
      ASSERT_TRUE(policy.Select(cf, sel).ok());  // moved: lag 0 rebuilds in this step
      EXPECT_EQ(sel, drift > 0 && lag == 0 ? far_sel : first) << "lag " << lag << " drift " << drift;
      ASSERT_TRUE(policy.Select(cf, sel).ok());  // lag 1: the mask requested above serves
      EXPECT_EQ(sel, drift > 0 ? far_sel : first) << "lag " << lag << " drift " << drift;
    }
  }
}

// The first mask of layer l lives r_m - l % r_m steps (policies/hip/mask.h's HipSinceAfterBuild), so
// that the layers' rebuilds spread over the interval; every later one r_m steps.
TEST(HipPolicy, LayersRebuildOnStaggeredSteps) {
  Synthetic syn(700, 1, 64, 12);
  const HipParams hp = MaskParams(4, 0);
  HipPolicy policy(hp, 1, 4, 1);
  std::vector<float> q2(64);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (float& x : q2) x = nd(rng);
  SelectContext c1 = Context(syn.kv, syn.q.data(), 1, 4, 32, 4 + 32 + 64);
  SelectContext c2 = Context(syn.kv, q2.data(), 1, 4, 32, 4 + 32 + 64);
  c1.layer = c2.layer = 3;
  std::vector<int32_t> first, sel, fresh_sel;
  ASSERT_TRUE(policy.Select(c1, first).ok());  // step 1: built, since = 3 + 1
  HipPolicy fresh(hp, 1, 4, 1);
  ASSERT_TRUE(fresh.Select(c2, fresh_sel).ok());
  ASSERT_NE(fresh_sel, first);
  ASSERT_TRUE(policy.Select(c2, sel).ok());  // step 2: due (since 4 >= r_m): rebuilt from q2
  EXPECT_EQ(sel, fresh_sel);
  for (int step = 3; step <= 5; ++step) {  // then kept for r_m = 4 steps
    ASSERT_TRUE(policy.Select(c1, sel).ok());
    EXPECT_EQ(sel, fresh_sel) << "step " << step;
  }
  EXPECT_EQ(HipSinceAfterBuild(0, 0, 0, 0, 10, 100, 8, 13), 5);   // a first mask: layer % r_m
  EXPECT_EQ(HipSinceAfterBuild(7, 10, 99, 8, 10, 100, 8, 13), 0);  // the interval was due
  EXPECT_EQ(HipSinceAfterBuild(7, 9, 99, 3, 10, 100, 8, 13), 5);   // k_off moved
}


// Over a growing sequence with a new query each step, lag 1 selects what lag 0 does except at the
// steps where lag 0 rebuilt a due mask; there it keeps lag 0's previous mask (its offloaded
// positions) with this step's sinks and window. Every layer's rebuild cadence is the same.
TEST(HipPolicy, LagDiffersFromLagZeroOnlyAtDueSteps) {
  Synthetic syn(900, 2, 64, 12);
  for (int layer : {0, 1, 3}) {
    HipParams h0, h1;
    h0.r_m = h1.r_m = 4;
    h0.dense_layers = h1.dense_layers = 0;
    h0.lag = 0;
    h1.lag = 1;
    h0.drift = h1.drift = 0.0;  // the r_m clock alone (a new query each step turns every mask)
    HipPolicy p0(h0, 1, 4, 1), p1(h1, 1, 4, 1);
    std::mt19937 rng(17 + layer);
    std::normal_distribution<float> nd;
    std::vector<float> q(2 * 64);
    std::vector<int32_t> prev0, s0, s1;
    int64_t prev_hi = 0;
    int due = 0;
    const int sink = 4, window = 32;
    for (int step = 0; step < 30; ++step) {
      for (float& x : q) x = nd(rng);
      SelectContext c = Context(syn.kv, q.data(), 2, sink, window, sink + window + 96, layer);
      c.n = 600 + step;
      ASSERT_TRUE(p0.Select(c, s0).ok());
      ASSERT_TRUE(p1.Select(c, s1).ok());
      const int64_t off_hi = c.n - window;
      const auto offloaded = [&](const std::vector<int32_t>& s, int64_t hi) {
        std::vector<int32_t> r;
        for (int32_t x : s) {
          if (x >= sink && x < hi) r.push_back(x);
        }
        return r;
      };
      const bool rebuilt = step > 0 && offloaded(s0, off_hi) != offloaded(prev0, prev_hi);
      if (!rebuilt) {
        EXPECT_EQ(s1, s0) << "layer " << layer << " step " << step;
      } else {
        ++due;
        std::vector<int32_t> want;
        for (int32_t i = 0; i < sink; ++i) want.push_back(i);
        for (int32_t x : offloaded(prev0, prev_hi)) want.push_back(x);
        for (int64_t i = off_hi; i < c.n; ++i) want.push_back(static_cast<int32_t>(i));
        EXPECT_EQ(s1, want) << "layer " << layer << " step " << step;
      }
      prev0 = s0;
      prev_hi = off_hi;
    }
    EXPECT_GE(due, 6) << "layer " << layer;  // 30 steps at r_m 4
  }
}

// A budget that grows (a fraction of a growing n) keeps the mask until its interval; one that
// shrinks rebuilds it at once (the kept blocks would overrun the list).
TEST(HipPolicy, AGrowingBudgetWaitsForTheIntervalAShrinkingOneRebuilds) {
  Synthetic syn(700, 1, 64, 12);
  for (int lag : {0, 1}) {
    HipParams hp;
    hp.r_m = 4;
    hp.dense_layers = 0;
    hp.lag = lag;
    hp.drift = 0.0;  // the r_m clock alone
    HipPolicy policy(hp, 1, 1, 1);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd;
    std::vector<float> q(64);
    const auto offloaded = [](const std::vector<int32_t>& s, int64_t lo, int64_t hi) {
      std::vector<int32_t> r;
      for (int32_t x : s) {
        if (x >= lo && x < hi) r.push_back(x);
      }
      return r;
    };
    std::vector<int32_t> first, sel;
    SelectContext c = Context(syn.kv, syn.q.data(), 1, 4, 32, 4 + 32 + 64);
    c.n = 600;
    ASSERT_TRUE(policy.Select(c, first).ok());
    for (int step = 1; step < 4; ++step) {  // new queries, budget + 2 a step: the mask stays
      for (float& x : q) x = nd(rng);
      c.q = q.data();
      c.budget += 2;
      ASSERT_TRUE(policy.Select(c, sel).ok());
      EXPECT_EQ(offloaded(sel, 4, 600 - 32), offloaded(first, 4, 600 - 32)) << "lag " << lag << " step " << step;
    }
    c.budget -= 8;  // below the one it was built for: rebuilt now, from this step's query
    for (float& x : q) x = nd(rng);
    ASSERT_TRUE(policy.Select(c, sel).ok());
    HipPolicy fresh(hp, 1, 1, 1);
    std::vector<int32_t> want;
    ASSERT_TRUE(fresh.Select(c, want).ok());
    EXPECT_EQ(sel, want) << "lag " << lag;
    EXPECT_NE(offloaded(sel, 4, 600 - 32), offloaded(first, 4, 600 - 32));
  }
}

// The dense layers: at dense_bits 4 (the default) SparCas's 4-bit top-k over every dimension (the
// rows the mask scores), at 16 the exact top-k (the oracle's); past them the mask either way.
TEST(HipPolicy, DenseLayersTakeTheFourBitTopKOrTheExactOne) {
  Synthetic syn(900, 4, 64, 12);
  const SelectContext c = Context(syn.kv, syn.q.data(), 4, 4, 32, 4 + 32 + 96, 0);
  HipParams h4, h16;
  h4.dense_layers = h16.dense_layers = 2;
  h16.dense_bits = 16;
  ASSERT_EQ(h4.dense_bits, 4);
  HipPolicy p4(h4, 1, 4, 1), p16(h16, 1, 4, 1);
  EXPECT_TRUE(p4.DenseQ4(64));
  EXPECT_FALSE(p16.DenseQ4(64));
  SparcasPolicy sparcas(HipDenseRanking(), 1, 4, 1);
  std::vector<int32_t> a, b, want_q4, want_exact, chosen;
  for (int layer = 0; layer < 3; ++layer) {
    SelectContext cl = c;
    cl.layer = layer;
    ASSERT_TRUE(p4.Select(cl, a).ok());
    ASSERT_TRUE(p16.Select(cl, b).ok());
    ASSERT_TRUE(sparcas.Select(cl, want_q4).ok());
    const OffloadSplit sp_exact = SplitPositions(cl.n, cl.sink, cl.window, cl.budget);
    const int64_t got = ExactOffloadedTopK(cl, sp_exact, chosen);  // the exact top-k
    FinishSelection(sp_exact, chosen.data(), got, want_exact);
    if (layer < 2) {
      EXPECT_EQ(a, want_q4) << "layer " << layer;
      EXPECT_EQ(b, want_exact) << "layer " << layer;
    } else {  // the mask: both the same
      EXPECT_EQ(a, b);
    }
  }
  EXPECT_NE(want_q4, want_exact);  // the two dense paths differ here (else the test shows nothing)
}

// HiP selects on the device when the runtime's largest list (the budget plus the resident sinks
// and window: the bound the mask kernel's launch checks) fits kHipMaxNodes nodes, else on the
// host; either way the runtime is made. A budget whose nodes fit while its list does not once
// made the policy ask for the device and the runtime refuse it.
TEST(HipPolicy, DeviceMaskOnlyWhereTheListFitsAndTheRuntimeIsMade) {
  RuntimeConfig c;
  c.model = {.num_layers = 4, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 64,
             .kv_dtype = DType::kBF16};
  c.capacity.max_sequences = 1;
  c.capacity.max_batch = 1;
  c.capacity.max_tokens_per_sequence = 32768;
  c.capacity.max_prefill_chunk = 256;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 64;
  c.policy.name = "hip";
  c.backend = Backend::kHost;
  c.probe_at_start = false;
  const auto on_device = [&](int64_t budget) {
    c.policy.budget_tokens = budget;
    auto p = MakeHipPolicy(c);
    EXPECT_TRUE(p.ok());
    return p.ok() && detail::SelectsOnDevice(**p);
  };
  EXPECT_TRUE(on_device(2 * kHipMaxNodes - 68));   // list 2 * kHipMaxNodes
  EXPECT_FALSE(on_device(2 * kHipMaxNodes - 4));   // the budget's nodes fit, the list's not
  for (int64_t budget : {2 * kHipMaxNodes - 68, 2 * kHipMaxNodes - 4}) {
    c.policy.budget_tokens = budget;
    auto rt = Runtime::Create(c);
    EXPECT_TRUE(rt.ok()) << "budget " << budget << ": " << rt.status().ToString();
  }
  c.policy.params["bits"] = 16;  // fp32 scores: the host
  EXPECT_FALSE(on_device(64));
}

// The reference the candidate ranking (over) and the recall guard are held to: the k offloaded
// positions of [lo, hi) with the best 4-bit max-logit scores (HipBlockScoreQ4 of one token),
// ties to the lower position, ascending.
std::vector<int32_t> FourBitTopK(const SelectContext& c, int64_t lo, int64_t hi, int64_t k) {
  Q8Query q8;
  QuantizeQueryHeads(c.q, c.params.group, c.params.head_dim, nullptr, c.params.head_dim, &q8);
  std::vector<std::pair<float, int32_t>> s;
  for (int64_t t = lo; t < hi; ++t) {
    s.emplace_back(HipBlockScoreQ4(c.params, q8, c.kv, t, t + 1, 0, 1), static_cast<int32_t>(t));
  }
  std::sort(s.begin(), s.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  std::vector<int32_t> out;
  for (int64_t i = 0; i < k; ++i) out.push_back(s[i].second);
  std::sort(out.begin(), out.end());
  return out;
}

// over = c: the mask holds c k candidates and each step attends the k of them the step's query
// scores highest. With candidates covering the offloaded range (c k >= its length) that is the
// 4-bit top-k of the whole range, at every step, whatever the mask's age.
TEST(HipPolicy, OverRanksTheCandidatesByTheStepsQuery) {
  for (uint32_t seed : {3u, 4u}) {
    Synthetic syn(700, 2, 64, seed);
    std::vector<float> q2(2 * 64);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    for (float& x : q2) x = nd(rng);
    HipParams hp;
    hp.dense_layers = 0;
    hp.over = 16;  // 16 x 64 picks >= the 664 offloaded positions: every block a candidate
    HipPolicy policy(hp, 1, 1, 1);
    for (const float* q : {syn.q.data(), q2.data(), syn.q.data()}) {
      const SelectContext c = Context(syn.kv, q, 2, 4, 32, 4 + 32 + 64);
      std::vector<int32_t> sel;
      ASSERT_TRUE(policy.Select(c, sel).ok());
      const std::vector<int32_t> want = FourBitTopK(c, 4, 700 - 32, 64);
      const std::vector<int32_t> got(sel.begin() + 4, sel.end() - 32);
      EXPECT_EQ(got, want) << "seed " << seed;
    }
  }
}

// The recall guard: a head whose tree mask holds less than `guard` of the 4-bit ranking's top-k
// weight takes that ranking as its mask. guard 1 (every check fails unless the tree found the
// ranking's whole weight) with a check at every rebuild and a fresh mask every step: the
// selection is the 4-bit top-k; guard 0 is the tree, which on these keys differs from it.
TEST(HipPolicy, RecallGuardFallsBackToTheFourBitRanking) {
  Synthetic syn(4001, 3, 64, 77, DType::kBF16, 0.97, 8, 24);
  const SelectContext c = Context(syn.kv, syn.q.data(), 3, 4, 64, 4 + 64 + 128);
  const std::vector<int32_t> want = FourBitTopK(c, 4, 4001 - 64, 128);
  HipParams hp;
  hp.dense_layers = 0;
  hp.r_m = 1;
  hp.lag = 0;
  hp.guard_every = 1;
  hp.fresh = 0;  // the ranking as the head's mask (fresh 1: the test below)
  std::vector<int32_t> tree, guarded;
  HipPolicy plain(hp, 1, 1, 1);
  ASSERT_TRUE(plain.Select(c, tree).ok());
  hp.guard = 1.0;
  HipPolicy guard(hp, 1, 1, 1);
  ASSERT_TRUE(guard.Select(c, guarded).ok());
  EXPECT_EQ(std::vector<int32_t>(guarded.begin() + 4, guarded.end() - 64), want);
  EXPECT_NE(std::vector<int32_t>(tree.begin() + 4, tree.end() - 64), want);
  // Neither runs on the device: the device mask neither ranks candidates nor guards.
  RuntimeConfig rc;
  rc.model = {.num_layers = 2, .num_q_heads = 6, .num_kv_heads = 2, .head_dim = 64,
              .kv_dtype = DType::kBF16};
  rc.capacity.max_sequences = 1;
  rc.policy.name = "hip";
  rc.policy.budget_tokens = 256;
  for (const char* key : {"guard", "over"}) {
    rc.policy.params = {{key, std::string(key) == "guard" ? 0.5 : 2.0}};
    auto p = MakeHipPolicy(rc);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_FALSE(detail::SelectsOnDevice(**p)) << key;
  }
}

// fresh 1 (the default): a head the guard finds short is ranked at every step by the step's
// query, with the dense layers' selection (SparCas's 4-bit top-k over every dimension), until its
// next check. guard 1 finds every head short, so every step equals that selection on a query that
// moves from step to step; fresh 0 keeps the ranking of the last rebuild and differs from it.
TEST(HipPolicy, AHeadTheGuardFindsShortIsRankedEveryStep) {
  for (uint32_t seed : {5u, 6u}) {
    Synthetic syn(3001, 3, 64, seed, DType::kBF16, 0.97, 8, 24);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    HipParams hp;
    hp.dense_layers = 0;
    hp.guard = 1.0;
    ASSERT_EQ(hp.fresh, 1);
    HipParams cached_params = hp;
    cached_params.fresh = 0;
    HipPolicy fresh(hp, 1, 1, 1), cached(cached_params, 1, 1, 1);
    SparcasPolicy want_policy(HipDenseRanking(), 1, 1, 1);
    std::vector<float> q(syn.q.size());
    int differs = 0;
    const int steps = 12;
    for (int step = 0; step < steps; ++step) {
      for (size_t i = 0; i < q.size(); ++i) q[i] = syn.q[i] + 0.6f * nd(rng);  // a moving query
      const SelectContext c = Context(syn.kv, q.data(), 3, 4, 64, 4 + 64 + 128);
      std::vector<int32_t> got, want, kept;
      ASSERT_TRUE(fresh.Select(c, got).ok());
      ASSERT_TRUE(want_policy.Select(c, want).ok());
      ASSERT_TRUE(cached.Select(c, kept).ok());
      EXPECT_EQ(got, want) << "seed " << seed << " step " << step;
      differs += kept != want;
    }
    EXPECT_GT(differs, 0) << "seed " << seed;
    EXPECT_EQ(fresh.counters().select_calls, steps);
    EXPECT_EQ(fresh.counters().select_reused, 0);
    EXPECT_EQ(cached.counters().select_calls, 2);  // the masks of steps 0 and 8 (r_m 8)
    EXPECT_EQ(cached.counters().select_reused, steps - 2);
  }
}

TEST(HipPolicy, BadParametersNameTheParameter) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, double>>{
           {"bk", 0}, {"r_m", 0}, {"r_m", 1.5}, {"dense_layers", -2}, {"rep", 4}, {"bits", 8}, {"lag", 2}, {"dense_bits", 8}, {"align", -1}, {"k", 5}, {"over", 0}, {"over", 65}, {"guard", -0.1}, {"guard", 1.5}, {"guard_every", 0}, {"fresh", 2}, {"fresh", -1}, {"drift", -0.1}, {"drift", 1.5}}) {
    auto r = ParseHipParams({{key, value}});
    ASSERT_FALSE(r.ok()) << key << "=" << value;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace kvferry
