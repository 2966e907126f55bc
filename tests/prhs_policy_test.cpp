// Copyright kvferry authors. Apache-2.0.
// The PrHS wrappers (cis+, psaw+, xl+): through the Runtime (host backend) where the behaviour is
// visible there (rho in Stats, equality with the base policy and with dense, PSAW's hidden range,
// state dropped on removal, a retried call after a roll-back, a dense inner refused), directly on
// the policy for the cross-layer prediction, its roll-back and the dilation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "base/psaw.h"
#include "fault_device.h"
#include "kvferry/kvferry.h"
#include "policies/basic.h"
#include "policies/policy.h"
#include "policies/prhs/prhs.h"
#include "policy_test_util.h"

namespace kvferry {
namespace {

constexpr int kHeadDim = 32;

RuntimeConfig Config(const std::string& policy, int layers, int group, int64_t budget,
                     std::map<std::string, double> params = {}) {
  RuntimeConfig c;
  c.model.num_layers = layers;
  c.model.num_kv_heads = 2;
  c.model.num_q_heads = 2 * group;
  c.model.head_dim = kHeadDim;
  c.model.kv_dtype = DType::kBF16;
  c.capacity.max_sequences = 2;
  c.capacity.max_batch = 1;
  c.capacity.max_tokens_per_sequence = 2048;
  c.capacity.max_prefill_chunk = 1024;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 16;
  c.policy.name = policy;
  c.policy.budget_tokens = budget;
  c.policy.params = std::move(params);
  c.backend = Backend::kHost;
  return c;
}

// A run's decode outputs and selections, [step][layer][kv_head].
struct Trace {
  std::vector<std::vector<float>> out;  // [step * layers + layer] -> o
  std::vector<std::vector<std::vector<int32_t>>> sel;  // [step * layers + layer][kv_head]
  Stats stats;
};

// Prefill \p context tokens, then \p steps decode steps of one sequence. Queries drift slowly
// around a per-head direction (so adjacent queries are similar, as in real decoding) when
// \p drift < 1; keys and values are random.
Trace RunSteps(const RuntimeConfig& c, int64_t context, int steps, float drift, uint32_t seed,
          Runtime* reuse = nullptr, SequenceId seq = 7) {
  Trace t;
  std::unique_ptr<Runtime> owned;
  if (reuse == nullptr) {
    auto r = Runtime::Create(c);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return t;
    owned = std::move(r).value();
    reuse = owned.get();
  }
  Runtime& rt = *reuse;
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
  EXPECT_TRUE(rt.AddSequence(seq).ok());
  std::vector<std::vector<float>> qbase;
  for (int layer = 0; layer < c.model.num_layers; ++layer) {
    auto q = random(context * hq * d), k = random(context * hkv * d), v = random(context * hkv * d);
    std::vector<float> o(q.size());
    EXPECT_TRUE(rt.Prefill(seq, layer, view(q, context, hq), view(k, context, hkv),
                           view(v, context, hkv), view(o, context, hq)).ok());
    qbase.push_back(random(hq * d));
  }
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < c.model.num_layers; ++layer) {
      std::vector<float> q = random(hq * d);
      for (size_t i = 0; i < q.size(); ++i) q[i] = qbase[layer][i] + drift * q[i];
      auto k = random(hkv * d), v = random(hkv * d);
      std::vector<float> o(q.size(), NAN);
      const std::vector<SequenceId> seqs = {seq};
      Status s = rt.Decode(seqs, layer, view(q, 1, hq), view(k, 1, hkv), view(v, 1, hkv),
                           view(o, 1, hq));
      EXPECT_TRUE(s.ok()) << s.ToString();
      t.out.push_back(o);
      std::vector<std::vector<int32_t>> per_head;
      for (int h = 0; h < hkv; ++h) {
        auto sel = rt.LastSelection(seq, layer, h);
        EXPECT_TRUE(sel.ok());
        per_head.push_back(sel.ok() ? sel.value() : std::vector<int32_t>{});
        const std::vector<int32_t>& p = per_head.back();
        const int64_t n = context + step + 1;
        EXPECT_TRUE(std::is_sorted(p.begin(), p.end()));
        EXPECT_TRUE(std::adjacent_find(p.begin(), p.end()) == p.end());
        EXPECT_LE(static_cast<int64_t>(p.size()), std::min<int64_t>(n, c.policy.budget_tokens));
        if (!p.empty()) {
          EXPECT_GE(p.front(), 0);
          EXPECT_LT(p.back(), n);
        }
      }
      t.sel.push_back(per_head);
    }
  }
  t.stats = rt.GetStats();
  return t;
}

double MaxRelErr(const Trace& a, const Trace& b) {
  double worst = 0;
  EXPECT_EQ(a.out.size(), b.out.size());
  for (size_t i = 0; i < std::min(a.out.size(), b.out.size()); ++i) {
    double num = 0, den = 0;
    for (size_t j = 0; j < a.out[i].size(); ++j) {
      num += (a.out[i][j] - b.out[i][j]) * (a.out[i][j] - b.out[i][j]);
      den += b.out[i][j] * b.out[i][j];
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

TEST(PrhsCis, RhoAtLeastOneOverS) {
  for (int s : {4, 8, 16}) {
    for (double tau : {-1.0, 0.8, 0.95}) {
      const int steps = 32;
      Trace t = RunSteps(Config("cis+oracle", 2, 4, 64, {{"cis.s", s}, {"cis.tau", tau}}), 300,
                         steps, 0.3f, 11u + s);
      const int64_t calls = t.stats.select_calls, reused = t.stats.select_reused;
      ASSERT_EQ(calls + reused, int64_t{steps} * 2 * 2) << "every (step, layer, head) counted";
      const double rho = static_cast<double>(calls) / static_cast<double>(calls + reused);
      EXPECT_GE(rho, 1.0 / s - 1e-12) << "s " << s << " tau " << tau;
      if (tau == -1.0) EXPECT_DOUBLE_EQ(rho, 1.0 / s) << "tau = -1 shares every non-first step";
      EXPECT_NE(t.stats.ToJson().find("\"select_calls\":" + std::to_string(calls)),
                std::string::npos);
    }
  }
}

TEST(PrhsCis, GroupMeanSharesAtLeastAsOftenAsGroupMin) {
  // The group's mean cosine is >= its minimum, so against the same refs the mean gate shares
  // whenever the min gate does; on this seeded run it retrieves far less often.
  const auto cfg = [](double mean) {
    return Config("cis+oracle", 2, 4, 64,
                  {{"cis.s", 16}, {"cis.tau", 0.8}, {"cis.group_mean", mean}});
  };
  Trace a = RunSteps(cfg(0), 300, 32, 0.45f, 13u), b = RunSteps(cfg(1), 300, 32, 0.45f, 13u);
  EXPECT_LT(b.stats.select_calls, a.stats.select_calls);
  EXPECT_GT(a.stats.select_calls, 2 * 2 * 2) << "the min gate retrieves inside blocks";
  std::printf("[ info ] min gate calls %lld, mean gate calls %lld of %d\n",
              static_cast<long long>(a.stats.select_calls),
              static_cast<long long>(b.stats.select_calls), 32 * 2 * 2);
}

TEST(PrhsCis, TauAboveOneIsTheBasePolicy) {
  for (const std::string base : {"oracle", "quest"}) {
    Trace w = RunSteps(Config("cis+" + base, 2, 3, 48, {{"cis.tau", 1.5}}), 200, 6, 0.2f, 5u);
    Trace b = RunSteps(Config(base, 2, 3, 48), 200, 6, 0.2f, 5u);
    ASSERT_EQ(w.sel.size(), b.sel.size());
    for (size_t i = 0; i < w.sel.size(); ++i) EXPECT_EQ(w.sel[i], b.sel[i]) << base << " " << i;
    // Same selections; the outputs agree to fp32 rounding only: the base policies declare a device
    // scoring and run the planned step, the wrappers (kNone) the host-select path, which sums in
    // another order. Two runs of the base are bitwise equal.
    Trace b2 = RunSteps(Config(base, 2, 3, 48), 200, 6, 0.2f, 5u);
    EXPECT_LT(MaxRelErr(w, b), 1e-6) << base;
    EXPECT_EQ(MaxRelErr(b2, b), 0.0) << base;
    std::printf("[ info ] %s: wrapped vs base %.3g, base vs base %.3g\n", base.c_str(),
                MaxRelErr(w, b), MaxRelErr(b2, b));
    EXPECT_EQ(w.stats.select_reused, 0);
    EXPECT_EQ(b.stats.select_calls, 0) << "an unwrapped policy counts nothing";
  }
}

TEST(PrhsCis, SharedStepsReuseTheKeptSet) {
  // tau = -1: steps 2..s of a block reuse. The shared set keeps sinks and window re-anchored.
  Trace t =
      RunSteps(Config("cis+oracle", 1, 2, 64, {{"cis.tau", -1.0}, {"cis.s", 8}}), 300, 8, 0.3f, 9u);
  for (size_t step = 1; step < t.sel.size(); ++step) {
    const int64_t n = 300 + static_cast<int64_t>(step) + 1;
    for (const auto& p : t.sel[step]) {
      std::set<int32_t> set(p.begin(), p.end());
      for (int i = 0; i < 4; ++i) EXPECT_TRUE(set.count(i));
      for (int64_t i = n - 16; i < n; ++i) EXPECT_TRUE(set.count(static_cast<int32_t>(i))) << i;
      EXPECT_EQ(static_cast<int64_t>(p.size()), 64);
    }
  }
}

TEST(PrhsCis, DilatedSetContainsTheBaseSet) {
  const std::vector<int32_t> ranked = {100, 40, 41, 70, 10, 200};  // best first
  std::vector<int32_t> out;
  // Room for everything: sinks 4 + window 8 + 6 kept + 2 * r * m neighbours.
  CisShareSet(250, 4, 8, 4 + 8 + 6 + 2 * 2 * 3, ranked, 3, 2, out);
  std::set<int32_t> set(out.begin(), out.end());
  ASSERT_TRUE(std::is_sorted(out.begin(), out.end()));
  for (int32_t p : ranked) EXPECT_TRUE(set.count(p)) << p;
  for (int32_t p : {98, 99, 101, 102, 38, 39, 42, 43}) EXPECT_TRUE(set.count(p)) << p;
  for (int32_t p : {69, 71, 9, 11}) EXPECT_FALSE(set.count(p)) << "not in the top m: " << p;
  for (int32_t p = 0; p < 4; ++p) EXPECT_TRUE(set.count(p));
  for (int32_t p = 242; p < 250; ++p) EXPECT_TRUE(set.count(p));
  // Short budget: top m and their neighbours come before the rest of the kept set.
  CisShareSet(250, 4, 8, 4 + 8 + 3 + 4, ranked, 3, 1, out);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2, 3, 39, 40, 41, 42, 99, 100, 101, 242, 243, 244,
                                       245, 246, 247, 248, 249}));
  // Clipped to [0, n): a kept position at the edge.
  CisShareSet(50, 0, 0, 10, {0, 49}, 2, 1, out);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 48, 49}));
  // A budget below the resident rows: the sinks and the newest window rows fill it, or (for an
  // inner policy that keeps them all) every resident row and nothing else.
  CisShareSet(250, 4, 8, 6, ranked, 3, 1, out);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2, 3, 248, 249}));
  CisShareSet(250, 4, 8, 6, ranked, 3, 1, out, /*all_resident=*/true);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2, 3, 242, 243, 244, 245, 246, 247, 248, 249}));
  CisShareSet(250, 4, 8, 4 + 8 + 2, ranked, 3, 1, out, /*all_resident=*/true);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2, 3, 40, 100, 242, 243, 244, 245, 246, 247, 248, 249}));
}

TEST(PrhsWrappers, FullBudgetEqualsDense) {
  for (const std::string p : {"cis+oracle", "xl+oracle", "cis+quest", "xl+cis+oracle"}) {
    std::map<std::string, double> params;
    if (p.find("cis+") != std::string::npos) params["cis.tau"] = -1.0;  // sharing on every step
    Trace w = RunSteps(Config(p, 3, 4, 1024, params), 200, 5, 0.3f, 3u);
    Trace d = RunSteps(Config("dense", 3, 4, 1024), 200, 5, 0.3f, 3u);
    EXPECT_LT(MaxRelErr(w, d), 1e-5) << p;
  }
}

TEST(PrhsPsaw, IdentityBelowStartAndHidesTheFormulasRange) {
  const int layers = 8;  // l_s = 6; layer 6 has exponent 0 (nothing hidden), layer 7 hides.
  for (int64_t budget : {int64_t{64}, int64_t{4096}}) {
    Trace w = RunSteps(Config("psaw+oracle", layers, 2, budget), 400, 3, 0.3f, 21u);
    Trace b = RunSteps(Config("oracle", layers, 2, budget), 400, 3, 0.3f, 21u);
    for (int step = 0; step < 3; ++step) {
      const int64_t n = 400 + step + 1;
      for (int layer = 0; layer < layers; ++layer) {
        const size_t i = static_cast<size_t>(step) * layers + layer;
        const int64_t hide = PsawHiddenEnd(layer, layers, 6, 0.7, n);
        if (layer < 7) {
          EXPECT_EQ(hide, 0);
          EXPECT_EQ(w.sel[i], b.sel[i]) << "layer " << layer;
          continue;
        }
        EXPECT_EQ(hide, static_cast<int64_t>(std::floor((1 - std::pow(0.7, 0.5)) * n)));
        const int64_t visible = 4 + (n - hide);
        for (const auto& p : w.sel[i]) {
          for (int32_t pos : p) EXPECT_TRUE(pos < 4 || pos >= hide) << pos << " hidden to " << hide;
          EXPECT_EQ(static_cast<int64_t>(p.size()), std::min(budget, visible));
        }
      }
    }
    if (budget >= 4096) {
      // At full budget every visible position is attended: exactly the complement of the range.
      const auto& p = w.sel[7][0];
      const int64_t n = 401, hide = PsawHiddenEnd(7, layers, 6, 0.7, n);
      std::vector<int32_t> expect = {0, 1, 2, 3};
      for (int64_t i = hide; i < n; ++i) expect.push_back(static_cast<int32_t>(i));
      EXPECT_EQ(p, expect);
    }
  }
}

// base/psaw.h's PsawFilterList (the host Select, the host reference of the device selection and,
// in parallel form, the CUDA kernel use it) against the plain definition: drop [sink, hide_end),
// add the most recent unselected visible positions, then the unselected sinks, sort. Random
// ascending lists of every density, with and without the sinks, budgets below and above what is
// visible, hide_end at the edges.
TEST(PrhsPsaw, FilterListEqualsThePlainDefinition) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 4000; ++trial) {
    const int64_t n = std::uniform_int_distribution<int64_t>(1, 600)(rng);
    const int64_t sink = std::uniform_int_distribution<int64_t>(0, 8)(rng);
    const int64_t budget = std::uniform_int_distribution<int64_t>(1, n + 5)(rng);
    const int64_t hide_end = std::uniform_int_distribution<int64_t>(0, n)(rng);
    const double density = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    std::vector<int32_t> in;
    for (int64_t p = 0; p < n && static_cast<int64_t>(in.size()) < budget; ++p) {
      if (std::uniform_real_distribution<double>(0.0, 1.0)(rng) < density) in.push_back(static_cast<int32_t>(p));
    }
    // The plain definition.
    const int64_t s = std::min(sink, n);
    std::vector<int32_t> want;
    for (int32_t p : in) {
      if (hide_end <= s || p < s || p >= hide_end) want.push_back(p);
    }
    if (hide_end > s) {
      const int64_t target = std::min(budget, s + (n - hide_end));
      std::set<int32_t> have(want.begin(), want.end());
      for (int64_t p = n - 1; p >= hide_end && static_cast<int64_t>(have.size()) < target; --p) {
        have.insert(static_cast<int32_t>(p));
      }
      for (int64_t p = 0; p < s && static_cast<int64_t>(have.size()) < target; ++p) {
        have.insert(static_cast<int32_t>(p));
      }
      want.assign(have.begin(), have.end());
    }
    std::vector<int32_t> got = in;
    got.resize(static_cast<size_t>(std::max<int64_t>(static_cast<int64_t>(in.size()), budget)) + 8, -1);
    got.resize(static_cast<size_t>(
        PsawFilterList(got.data(), static_cast<int64_t>(in.size()), n, sink, budget, hide_end)));
    ASSERT_EQ(got, want) << "trial " << trial << " n " << n << " sink " << sink << " budget "
                         << budget << " hide_end " << hide_end << " selected " << in.size();
  }
}

TEST(PrhsPsaw, StackWithCis) {
  Trace t = RunSteps(Config("psaw+cis+oracle", 8, 2, 64, {{"cis.s", 4}, {"psaw.phi", 0.5}}), 300, 8,
                0.2f, 4u);
  const int64_t calls = t.stats.select_calls, reused = t.stats.select_reused;
  EXPECT_EQ(calls + reused, 8 * 8 * 2);
  EXPECT_GE(calls * 4, calls + reused);
  const int64_t n = 301, hide = PsawHiddenEnd(7, 8, 6, 0.5, n);
  for (const auto& p : t.sel[7]) {
    for (int32_t pos : p) EXPECT_TRUE(pos < 4 || pos >= hide);
  }
}

TEST(PrhsXl, PredictionEqualsWhatTheNextLayerSelects) {
  const int layers = 6, group = 2, sink = 4, window = 8;
  RuntimeConfig c = Config("xl+oracle", layers, group, 40, {{"xl.start", 0.5}});
  c.model.num_kv_heads = 1;
  auto made = MakePolicy(c);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  Policy& pol = *made.value();
  auto* xl = dynamic_cast<XlPredictor*>(&pol);
  ASSERT_NE(xl, nullptr);
  testing_util::Synthetic syn(300, group, kHeadDim, 77u);
  int predicted = 0;
  for (int step = 0; step < 2; ++step) {
    std::vector<int32_t> prediction;
    for (int layer = 0; layer < layers; ++layer) {
      std::vector<float> q = syn.q;
      for (float& x : q) x *= 1.0f + 0.1f * static_cast<float>(layer);  // layers differ
      SelectContext ctx = testing_util::Context(syn.kv, q.data(), group, sink, window, 40, layer);
      ctx.slot = 1;
      std::vector<int32_t> out;
      ASSERT_TRUE(pol.Select(ctx, out).ok());
      if (!prediction.empty()) {
        EXPECT_EQ(prediction, out) << "layer " << layer;
        ++predicted;
      } else {
        EXPECT_LT(layer, 3) << "from the start layer on the prediction is known";
      }
      std::vector<int32_t> oracle;
      OracleSelect(ctx, oracle);
      if (layer < 3) EXPECT_EQ(out, oracle) << "below the start layer xl runs the inner";
      prediction = xl->PredictNext(1, layer, 0);
      if (layer + 1 >= 3 && layer + 1 < layers) EXPECT_FALSE(prediction.empty()) << layer;
      if (layer + 1 < 3 || layer + 1 == layers) EXPECT_TRUE(prediction.empty()) << layer;
    }
    std::vector<float> k(kHeadDim, 0.1f), v(kHeadDim, 0.2f);
    syn.kv.Append(k.data(), v.data());  // next step: n grows, layer 0 does not reuse
  }
  EXPECT_EQ(predicted, 2 * 3);
  EXPECT_EQ(pol.counters().select_calls, 2 * 3);
  EXPECT_EQ(pol.counters().select_reused, 2 * 3);
  // The last layer's set is kept, and nothing follows it; a layer in the middle predicts.
  EXPECT_TRUE(xl->PredictNext(1, layers - 1, 0).empty());
  for (int layer = 0; layer < 4; ++layer) {
    SelectContext ctx = testing_util::Context(syn.kv, syn.q.data(), group, sink, window, 40, layer);
    ctx.slot = 1;
    std::vector<int32_t> out;
    ASSERT_TRUE(pol.Select(ctx, out).ok());
  }
  EXPECT_FALSE(xl->PredictNext(1, 3, 0).empty());
  pol.OnSequenceRemoved(1);
  EXPECT_TRUE(xl->PredictNext(1, 3, 0).empty()) << "removal drops the kept sets";
}

// Policy::OnDecodeRolledBack on xl+: after a rolled-back call the wrapper's state is the state of a
// twin that never made the call, whatever the call did: a sharing layer that reused the previous
// layer's set (its retry must reuse it again, as the twin does: forgetting the layer used to throw
// that set away too, so the retry ran the inner), a layer below the start (ran the inner), the last
// layer, a call rolled back twice, and a call rolled back before it selected (nothing to undo).
// The twin B makes only the calls that stand; every selection and prediction must be equal.
TEST(PrhsXl, RollBackLeavesTheStateOfATwinThatNeverMadeTheCall) {
  const int layers = 3, group = 2, sink = 4, window = 8;
  const int64_t budget = 40;
  RuntimeConfig c = Config("xl+oracle", layers, group, budget, {{"xl.start", 0.34}});  // layers 1, 2 share
  c.model.num_kv_heads = 1;
  auto made_a = MakePolicy(c), made_b = MakePolicy(c);
  ASSERT_TRUE(made_a.ok() && made_b.ok()) << made_a.status().ToString();
  Policy& a = *made_a.value();
  Policy& b = *made_b.value();
  const XlPredictor& pa = dynamic_cast<const XlPredictor&>(a);
  const XlPredictor& pb = dynamic_cast<const XlPredictor&>(b);
  testing_util::Synthetic syn(300, group, kHeadDim, 91u);
  std::mt19937 rng(17);
  std::normal_distribution<float> nd;
  enum Fault { kNone, kAfterSelect, kTwiceAfterSelect, kBeforeSelect };
  // [step][layer]: what A's call meets before the call that stands.
  const Fault script[5][layers] = {{kNone, kNone, kNone},
                                   {kNone, kAfterSelect, kNone},
                                   {kAfterSelect, kNone, kAfterSelect},
                                   {kBeforeSelect, kTwiceAfterSelect, kBeforeSelect},
                                   {kNone, kNone, kNone}};
  int64_t failed_selects = 0;
  int differs_from_inner = 0;  // retried sharing layers whose set is not what their inner selects
  for (int step = 0; step < 5; ++step) {
    for (int layer = 0; layer < layers; ++layer) {
      std::vector<float> q(static_cast<size_t>(group) * kHeadDim);
      for (float& x : q) x = nd(rng);  // every layer its own query: its inner picks differ
      SelectContext ctx = testing_util::Context(syn.kv, q.data(), group, sink, window, budget, layer);
      ctx.slot = 1;
      const std::string at = "step " + std::to_string(step) + " layer " + std::to_string(layer);
      std::vector<int32_t> out_a, out_b;
      const Fault f = script[step][layer];
      for (int tries = f == kAfterSelect ? 1 : (f == kTwiceAfterSelect ? 2 : 0); tries > 0; --tries) {
        ASSERT_TRUE(a.Select(ctx, out_a).ok());
        ++failed_selects;
        a.OnDecodeRolledBack(1, layer);
        EXPECT_EQ(pa.PredictNext(1, layer, 0), pb.PredictNext(1, layer, 0)) << at << ": rolled back";
        if (layer > 0) {
          EXPECT_EQ(pa.PredictNext(1, layer - 1, 0), pb.PredictNext(1, layer - 1, 0)) << at;
        }
      }
      if (f == kBeforeSelect) a.OnDecodeRolledBack(1, layer);
      out_a.clear();
      ASSERT_TRUE(a.Select(ctx, out_a).ok());
      ASSERT_TRUE(b.Select(ctx, out_b).ok());
      EXPECT_EQ(out_a, out_b) << at;
      EXPECT_EQ(pa.PredictNext(1, layer, 0), pb.PredictNext(1, layer, 0)) << at;
      if (f != kNone && layer >= 1) {
        std::vector<int32_t> inner;
        OracleSelect(ctx, inner);
        differs_from_inner += inner != out_b ? 1 : 0;
      }
    }
    std::vector<float> k(kHeadDim), v(kHeadDim);
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    syn.kv.Append(k.data(), v.data());  // the next step: n grows
  }
  // The retried sharing layers reused a set their inner would not have chosen, so a retry that ran
  // the inner instead would have been seen.
  EXPECT_GE(differs_from_inner, 2);
  // A counts its rolled-back Selects too: one call or reuse each.
  const PolicyCounters ca = a.counters(), cb = b.counters();
  EXPECT_EQ(ca.select_calls + ca.select_reused, cb.select_calls + cb.select_reused + failed_selects);
  EXPECT_EQ(cb.select_calls, 5);        // layer 0 of each step
  EXPECT_EQ(cb.select_reused, 5 * 2);   // layers 1 and 2
}

// Policy::OnDecodeRolledBack on cis+: the same against a twin, through blocks of 3 steps whose
// queries either stay near the block's (shared) or jump (a retrieval): a rolled-back call at a
// block's first step (it overwrote the last block's first ref), at a mid-block retrieval, at a
// shared step, twice, and before it selected (its last Select, the step before at the same layer,
// stood and must stay). The retried call must select what the twin selects; before the fix the
// rolled-back call's step count and ref stayed, so the retry shared its own ref.
TEST(PrhsCis, RollBackLeavesTheStateOfATwinThatNeverMadeTheCall) {
  const int group = 2, sink = 4, window = 8;
  const int64_t budget = 40;
  RuntimeConfig c = Config("cis+oracle", 1, group, budget, {{"cis.s", 3}, {"cis.tau", 0.5}});
  c.model.num_kv_heads = 1;
  auto made_a = MakePolicy(c), made_b = MakePolicy(c);
  ASSERT_TRUE(made_a.ok() && made_b.ok()) << made_a.status().ToString();
  Policy& a = *made_a.value();
  Policy& b = *made_b.value();
  testing_util::Synthetic syn(300, group, kHeadDim, 29u);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  enum Fault { kNone, kAfterSelect, kTwiceAfterSelect, kBeforeSelect };
  struct Step {
    bool jump;  // a new query direction (a retrieval) or near the last one (shared)
    Fault fault;
  };
  const Step script[] = {{true, kNone},         {false, kNone},        {false, kNone},
                         {true, kAfterSelect},  {false, kBeforeSelect}, {true, kTwiceAfterSelect},
                         {true, kNone},         {true, kAfterSelect},  {false, kAfterSelect},
                         {true, kAfterSelect},  {false, kNone},        {false, kNone}};
  std::vector<float> base(static_cast<size_t>(group) * kHeadDim);
  int64_t failed_selects = 0;
  int shared = 0, retrieved = 0;
  for (size_t step = 0; step < std::size(script); ++step) {
    if (script[step].jump) {
      for (float& x : base) x = nd(rng);
    }
    std::vector<float> q = base;
    for (float& x : q) x += 0.1f * nd(rng);
    SelectContext ctx = testing_util::Context(syn.kv, q.data(), group, sink, window, budget, 0);
    ctx.slot = 1;
    const std::string at = "step " + std::to_string(step);
    std::vector<int32_t> out_a, out_b;
    const Fault f = script[step].fault;
    for (int tries = f == kAfterSelect ? 1 : (f == kTwiceAfterSelect ? 2 : 0); tries > 0; --tries) {
      ASSERT_TRUE(a.Select(ctx, out_a).ok());
      out_a.clear();
      ++failed_selects;
      a.OnDecodeRolledBack(1, 0);
    }
    if (f == kBeforeSelect) a.OnDecodeRolledBack(1, 0);
    const int64_t reused_before = b.counters().select_reused;
    ASSERT_TRUE(a.Select(ctx, out_a).ok());
    ASSERT_TRUE(b.Select(ctx, out_b).ok());
    EXPECT_EQ(out_a, out_b) << at;
    (b.counters().select_reused > reused_before ? shared : retrieved) += 1;
    std::vector<float> k(kHeadDim), v(kHeadDim);
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    syn.kv.Append(k.data(), v.data());  // the next step: n grows
  }
  EXPECT_GE(shared, 3);  // both kinds of step met the faults
  EXPECT_GE(retrieved, 5);
  const PolicyCounters ca = a.counters(), cb = b.counters();
  EXPECT_EQ(ca.select_calls + ca.select_reused, cb.select_calls + cb.select_reused + failed_selects);
}

// The same through a Runtime on the host path (route cpu: the policy's own Select, the wrapper's
// included, runs on the host): A's Decode fails with a device fault injected into the last call of
// its latest device entry point, after the append, the selection and the attention ran
// (tests/fault_device.h, as the conformance harness's ConfRollBack), is rolled back, then retried
// as an engine would. From then on every output and selection of A equals, bit for bit, a twin's
// that never made the failed calls: for xl+ at a sharing layer (1), at a layer that runs the inner
// (0), and at both in one step; for cis+ at block starts (s 2) and shared steps. (hip and sparcas
// would need their refresh outside the test, lfps keeps its exception: include/kvferry/runtime.h,
// "Errors".)
TEST(PrhsWrappers, RetriedDecodeAfterAFaultEqualsTheTwin) {
  using testing::FaultMode;
  using testing::FaultPoint;
  constexpr FaultPoint kLate[] = {FaultPoint::kMergeLse, FaultPoint::kDecodeStep,
                                  FaultPoint::kAttendRows, FaultPoint::kAttendPaged,
                                  FaultPoint::kCopyAsync};
  constexpr int kPoints = static_cast<int>(FaultPoint::kCount);
  const std::vector<std::pair<std::string, std::map<std::string, double>>> policies = {
      {"xl+oracle", {}},
      {"xl+quest", {}},
      {"xl+sparcas", {}},
      {"cis+oracle", {{"cis.s", 2}, {"cis.tau", -1}}},
      {"cis+quest", {{"cis.s", 3}, {"cis.tau", 0.5}}},
      {"xl+cis+oracle", {{"cis.s", 2}, {"cis.tau", -1}}}};
  for (const auto& [policy, params] : policies) {
    SCOPED_TRACE(policy);
    RuntimeConfig c = Config(policy, 2, 4, 48, params);
    c.route = Route::kCpu;
    c.cpu_threads = 1;  // the twins split their work alike
    c.probe_at_start = false;
    auto made_b = Runtime::Create(c);  // the twin, on the plain device
    ASSERT_TRUE(made_b.ok()) << made_b.status().ToString();
    testing::ScopedFaults scope;
    auto made_a = Runtime::Create(c);
    ASSERT_TRUE(made_a.ok()) << made_a.status().ToString();
    Runtime& a = *made_a.value();
    Runtime& b = *made_b.value();
    testing::FaultInjector& faults = scope.faults();
    const int hq = c.model.num_q_heads, hkv = c.model.num_kv_heads, d = c.model.head_dim;
    const SequenceId seq = 7;
    const std::vector<SequenceId> seqs = {seq};
    std::mt19937 rng(23);
    std::normal_distribution<float> nd;
    auto random = [&](int64_t count) {
      std::vector<float> x(static_cast<size_t>(count));
      for (float& e : x) e = nd(rng);
      return x;
    };
    auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
      return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, d});
    };
    const int64_t context = 200;
    for (Runtime* rt : {&a, &b}) ASSERT_TRUE(rt->AddSequence(seq).ok());
    for (int layer = 0; layer < 2; ++layer) {
      auto q = random(context * hq * d), k = random(context * hkv * d), v = random(context * hkv * d);
      std::vector<float> o(q.size());
      for (Runtime* rt : {&a, &b}) {
        ASSERT_TRUE(rt->Prefill(seq, layer, view(q, context, hq), view(k, context, hkv),
                                view(v, context, hkv), view(o, context, hq)).ok());
      }
    }
    // [layer][point]: the device calls of each entry point in A's call of the layer at step 1.
    std::vector<std::vector<int64_t>> calls(2, std::vector<int64_t>(kPoints, 0));
    auto fails_at = [](int step, int layer) {
      return (step == 2 && layer == 1) || (step == 3 && layer == 0) || step == 4;
    };
    int failed = 0;
    for (int step = 0; step < 6; ++step) {
      for (int layer = 0; layer < 2; ++layer) {
        const std::string at = "step " + std::to_string(step) + " layer " + std::to_string(layer);
        auto q = random(hq * d), k = random(hkv * d), v = random(hkv * d);
        std::vector<float> oa(q.size(), NAN), ob(q.size(), NAN);
        auto decode = [&](Runtime& rt, std::vector<float>& o) {
          return rt.Decode(seqs, layer, view(q, 1, hq), view(k, 1, hkv), view(v, 1, hkv),
                           view(o, 1, hq));
        };
        if (fails_at(step, layer)) {
          FaultPoint point = FaultPoint::kCount;
          for (FaultPoint p : kLate) {
            if (point == FaultPoint::kCount && calls[layer][static_cast<int>(p)] > 0) point = p;
          }
          ASSERT_NE(point, FaultPoint::kCount) << at;
          const int64_t fired = faults.fired();
          faults.FailNth(point, calls[layer][static_cast<int>(point)], FaultMode::kAfter);
          const Status st = decode(a, oa);
          faults.Disarm();
          ASSERT_GT(faults.fired(), fired) << at << ": the fault did not fire";
          EXPECT_EQ(st.code(), StatusCode::kDeviceError) << at << ": " << st.ToString();
          EXPECT_EQ(a.SequenceLength(seq, layer).value(), b.SequenceLength(seq, layer).value())
              << at << ": the failed call kept its token";
          ++failed;
        }
        std::vector<int64_t> before(kPoints);
        for (int p = 0; p < kPoints; ++p) before[p] = faults.calls(static_cast<FaultPoint>(p));
        const Status sa = decode(a, oa);  // the call, or its retry
        ASSERT_TRUE(sa.ok()) << at << ": " << sa.ToString();
        if (step == 1) {
          for (int p = 0; p < kPoints; ++p) {
            calls[layer][p] = faults.calls(static_cast<FaultPoint>(p)) - before[p];
          }
        }
        ASSERT_TRUE(decode(b, ob).ok()) << at;
        EXPECT_EQ(std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)), 0)
            << at << ": the outputs differ in their bits";
        for (int h = 0; h < hkv; ++h) {
          EXPECT_EQ(a.LastSelection(seq, layer, h).value(), b.LastSelection(seq, layer, h).value())
              << at << " head " << h;
        }
        if (layer == 1 && policy.rfind("xl+", 0) == 0) {
          for (int h = 0; h < hkv; ++h) {
            EXPECT_EQ(a.LastSelection(seq, 1, h).value(), a.LastSelection(seq, 0, h).value())
                << at << ": layer 1 shares layer 0's set";
          }
        }
      }
    }
    EXPECT_EQ(failed, 4);
  }
}

// A wrapper over a dense policy (Policy::is_dense()) is refused at Create: a pre-hoc selector over
// a policy that attends every token has nothing to select, and no wrapper is dense itself, so the
// runtime would size the step's lists by the budget while the inner returns every position (every
// Decode past budget + sinks + window tokens used to fail with "internal error: policy 'cis+dense'
// selected 251 positions, over its capacity 100"). Stacks are refused by their innermost wrapper.
TEST(PrhsWrappers, ADenseInnerIsRefused) {
  const std::vector<std::pair<std::string, std::string>> names = {
      {"cis+dense", "cis+"}, {"psaw+dense", "psaw+"}, {"xl+dense", "xl+"},
      {"psaw+cis+dense", "cis+"}, {"xl+psaw+dense", "psaw+"}};
  for (const auto& [p, innermost] : names) {
    SCOPED_TRACE(p);
    auto r = Runtime::Create(Config(p, 2, 2, 64));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    const std::string want = "the " + innermost +
                             " wrapper cannot wrap 'dense', a dense policy (it attends every token "
                             "at every step): a pre-hoc selector over it has nothing to select; "
                             "use 'dense' itself";
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
    EXPECT_FALSE(MakePolicy(Config(p, 2, 2, 64)).ok());
  }
  // Around a sparse policy at a budget covering the context, the wrappers are dense attention
  // (FullBudgetEqualsDense); PSAW over dense attention is psaw+oracle at such a budget.
  EXPECT_TRUE(Runtime::Create(Config("psaw+oracle", 2, 2, 2048)).ok());
}

TEST(PrhsCis, RemovedSequenceStartsFresh) {
  RuntimeConfig c = Config("cis+oracle", 1, 2, 64, {{"cis.tau", -1.0}, {"cis.s", 16}});
  auto r = Runtime::Create(c);
  ASSERT_TRUE(r.ok());
  Runtime& rt = *r.value();
  RunSteps(c, 200, 3, 0.3f, 1u, &rt, 5);  // 1 retrieval + 2 reuses per head
  EXPECT_EQ(rt.GetStats().select_calls, 2);
  EXPECT_EQ(rt.GetStats().select_reused, 4);
  ASSERT_TRUE(rt.RemoveSequence(5).ok());
  rt.ResetStats();
  // The same id again: a block start, not step 4 of the old block.
  RunSteps(c, 200, 1, 0.3f, 2u, &rt, 5);
  EXPECT_EQ(rt.GetStats().select_calls, 2);
  EXPECT_EQ(rt.GetStats().select_reused, 0);
}

TEST(PrhsWrappers, BadParametersAndNames) {
  const std::vector<std::tuple<std::string, std::string, double>> bad = {
      {"cis+oracle", "cis.s", 0},
      {"cis+oracle", "cis.tau", std::numeric_limits<double>::quiet_NaN()},
      {"cis+oracle", "cis.r", -1},
      {"cis+oracle", "cis.m_frac", 0},
      {"cis+oracle", "cis.group_mean", 2},
      {"cis+oracle", "cis.x", 1},
      {"psaw+oracle", "psaw.phi", 1.0},
      {"psaw+oracle", "psaw.phi", 0.0},
      {"psaw+oracle", "psaw.start", 1.0},
      {"xl+oracle", "xl.start", 2},
      {"cis+oracle", "xl.start", 0.5},   // a wrapper the stack lacks
      {"cis+oracle", "no_such_knob", 1},  // reaches the inner policy, which refuses it
      {"psaw+lfps", "no_such_knob", 1},
  };
  for (const auto& [p, key, value] : bad) {
    auto r = Runtime::Create(Config(p, 2, 2, 64, {{key, value}}));
    ASSERT_FALSE(r.ok()) << p << " " << key;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << key;
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().message();
  }
  for (const std::string p : {"foo+oracle", "cis+", "cis+nope"}) {
    auto r = Runtime::Create(Config(p, 2, 2, 64));
    ASSERT_FALSE(r.ok()) << p;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << p;
  }
  auto r = Runtime::Create(Config("foo+oracle", 2, 2, 64));
  EXPECT_NE(r.status().message().find("wrappers: cis+, psaw+, xl+"), std::string::npos)
      << r.status().message();
  const std::vector<std::string> names = PolicyNames();
  for (const std::string p : {"cis+oracle", "psaw+lfps", "xl+quest", "psaw+cis+oracle"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), p), names.end()) << p;
    auto made = Runtime::Create(Config(p, 2, 2, 64));
    EXPECT_TRUE(made.ok()) << p << ": " << made.status().ToString();
  }
  // Namespaced parameters reach their wrapper through a stack; the rest reach the base.
  auto stack = Runtime::Create(Config("psaw+cis+quest", 2, 2, 64,
                                      {{"psaw.phi", 0.5}, {"cis.s", 8}, {"page", 8}}));
  EXPECT_TRUE(stack.ok()) << stack.status().ToString();
}

}  // namespace
}  // namespace kvferry
