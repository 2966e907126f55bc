// Copyright kvferry authors. Apache-2.0.
// SparCas: dimension choice, partial scores, d_b = head_dim gives exactly the oracle's ranking,
// recall of the exact top-k monotone in d_b, refresh every u steps, parameters; the 4-bit compact
// rows (quantization bounds, scores against the dequantized dot product, recall).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "base/sparcas_q4.h"
#include "policies/sparcas/sparcas.h"
#include "tests/policy_test_util.h"

namespace kvferry {
namespace {

using testing_util::Context;
using testing_util::PagedHead;
using testing_util::ExpectValidSelection;
using testing_util::SelectedRecall;
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
        sp.bits = 16;  // the paper's rows: exact
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

// Mean recall of the exact top-k over 12 synthetic workloads (2049 keys, head_dim 64, GQA 3,
// seeds seed0 + t; sinks 4, window 32, 128 picks), SparCas ranking every layer with d_b at bits.
double MeanRecall(int d_b, int bits, uint32_t seed0, int smooth = SparcasParams{}.smooth) {
  const int trials = 12;
  double r = 0.0;
  for (int t = 0; t < trials; ++t) {
    Synthetic syn(2049, 3, 64, seed0 + t);
    SparcasParams sp;
    sp.d_b = d_b;
    sp.bits = bits;
    sp.dense_layers = 0;
    sp.smooth = smooth;
    SparcasPolicy policy(sp, 1, 1, 1);
    r += SelectedRecall(policy, Context(syn.kv, syn.q.data(), 3, 4, 32, 4 + 32 + 128)) / trials;
  }
  return r;
}

TEST(SparcasPolicy, RecallMonotoneInDb) {
  std::vector<int> dbs = {1, 2, 4, 8, 16, 32, 64};
  std::vector<double> recall(dbs.size(), 0.0);
  for (size_t i = 0; i < dbs.size(); ++i) recall[i] = MeanRecall(dbs[i], 16, 500);
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
  for (double bits : {0.0, 8.0, 2.0}) {
    auto r = ParseSparcasParams({{"bits", bits}});
    ASSERT_FALSE(r.ok()) << bits;
    EXPECT_NE(r.status().message().find("bits"), std::string::npos) << r.status().message();
  }
  // Defaults: 4-bit rows of half the dimensions; the paper's 16 of 128 at 16 bits.
  EXPECT_EQ(SparcasBits(SparcasParams{}, 128), 4);
  EXPECT_EQ(SparcasDb(SparcasParams{}, 128), 64);
  EXPECT_EQ(SparcasDb(SparcasParams{}, 64), 32);
  EXPECT_EQ(SparcasDb(SparcasParams{}, 24), 16);  // 12 rounded up to a multiple of 8
  EXPECT_EQ(SparcasBits(SparcasParams{}, 17), 16);
  SparcasParams paper;
  paper.bits = 16;
  EXPECT_EQ(SparcasDb(paper, 128), 16);
  EXPECT_EQ(SparcasDb(paper, 64), 8);
}

TEST(SparcasQ4, CodesAreRoundedWithinHalfAStepAndOddRowsGiveZero) {
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  for (int d_b : {8, 16, 32, 64, 128}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> x(d_b);
      for (float& v : x) v = nd(rng) * (trial + 1);
      if (trial % 5 == 0) x[trial % d_b] *= 30.0f;  // an outlier channel
      std::vector<uint32_t> w(d_b / 8);
      const float scale = SparcasQuantizeRow(x.data(), d_b, w.data());
      float amax = 0.0f;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      EXPECT_FLOAT_EQ(scale, amax / 7.0f);
      for (int i = 0; i < d_b; ++i) {
        const int code = SparcasQ4Value(w[i / 8], i % 8);
        ASSERT_GE(code, -7);
        ASSERT_LE(code, 7);
        EXPECT_EQ(code, static_cast<int>(std::nearbyint(x[i] / amax * 7.0f)))
            << "d_b " << d_b << " i " << i;
        EXPECT_LE(std::fabs(code * scale - x[i]), 0.5f * scale * (1.0f + 1e-5f));
      }
    }
  }
  // Zero, infinite and NaN rows: scale 0 (the row scores 0); a NaN among finite values codes -7.
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float bad : {0.0f, inf}) {
    std::vector<float> x(8, 1.0f);
    if (bad == 0.0f) std::fill(x.begin(), x.end(), 0.0f);
    x[3] = bad;
    uint32_t w = 0xFFFFFFFFu;
    EXPECT_EQ(SparcasQuantizeRow(x.data(), 8, &w), 0.0f);
    for (int e = 0; e < 8; ++e) EXPECT_EQ(SparcasQ4Value(w, e), 0) << e;
  }
  std::vector<float> x = {1, 2, nan, -4, 0, 0, 0, 7};
  uint32_t w = 0;
  EXPECT_FLOAT_EQ(SparcasQuantizeRow(x.data(), 8, &w), 1.0f);
  EXPECT_EQ(SparcasQ4Value(w, 2), -7);
  EXPECT_EQ(SparcasQ4Value(w, 3), -4);
  EXPECT_EQ(SparcasQ4Value(w, 7), 7);
}

TEST(SparcasQ4, ScoresAreTheDequantizedDotProducts) {
  const int hd = 64, group = 3, d_b = 24;
  const int64_t n = 131;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> q(group * hd), keys(n * hd);
  for (float& v : q) v = nd(rng);
  for (float& v : keys) v = nd(rng);
  std::vector<int32_t> dims(d_b);
  SparcasChooseDims(q.data(), group, hd, d_b, dims.data());
  std::vector<uint32_t> words(n * (d_b / 8));
  std::vector<float> scales(n), kept(d_b), out(group * n);
  for (int64_t j = 0; j < n; ++j) {
    SparcasGatherCompact(keys.data() + j * hd, dims.data(), d_b, kept.data());
    scales[j] = SparcasQuantizeRow(kept.data(), d_b, words.data() + j * (d_b / 8));
  }
  SparcasApproxScoresQ4(q.data(), group, hd, dims.data(), d_b, words.data(), scales.data(), n,
                        0.25f, out.data(), n);
  for (int g = 0; g < group; ++g) {
    // The query's int8 codes: within half a step of q, step = max |q| / 127.
    std::vector<float> qd(d_b);
    std::vector<int8_t> codes(d_b);
    float amax = 0.0f;
    for (int i = 0; i < d_b; ++i) {
      qd[i] = q[g * hd + dims[i]];
      amax = std::max(amax, std::fabs(qd[i]));
    }
    int32_t code_sum = 0;
    const float step = SparcasQuantizeQuery(qd.data(), d_b, codes.data(), &code_sum);
    EXPECT_FLOAT_EQ(step, amax / 127.0f);
    int32_t sum = 0;
    for (int i = 0; i < d_b; ++i) {
      EXPECT_EQ(codes[i], static_cast<int>(std::nearbyint(qd[i] / amax * 127.0f))) << i;
      EXPECT_LE(std::fabs(codes[i] * step - qd[i]), 0.5f * step * (1.0f + 1e-5f));
      sum += codes[i];
    }
    EXPECT_EQ(code_sum, sum);
    for (int64_t j = 0; j < n; ++j) {
      int64_t idot = 0;
      double exact = 0.0, bound = 0.0;
      for (int i = 0; i < d_b; ++i) {
        const int code = SparcasQ4Value(words[j * (d_b / 8) + i / 8], i % 8);
        idot += int64_t{codes[i]} * code;
        exact += static_cast<double>(qd[i]) * keys[j * hd + dims[i]];
        // half a key step against |q|, half a query step against the dequantized key
        bound += std::fabs(qd[i]) * 0.5 * scales[j] + 0.5 * step * std::abs(code) * scales[j];
      }
      // The integer dot is exact; then two fp32 products in a fixed order.
      const float want = static_cast<float>(idot) * step * scales[j];
      EXPECT_EQ(out[g * n + j], 0.25f * want) << "g " << g << " j " << j;
      EXPECT_LE(std::fabs(static_cast<double>(want) - exact), bound + 1e-4);
    }
  }
  // A zero or non-finite query head scores 0.
  std::vector<float> zq(8, 0.0f);
  std::vector<int8_t> zc(8, 1);
  int32_t zs = -1;
  EXPECT_EQ(SparcasQuantizeQuery(zq.data(), 8, zc.data(), &zs), 0.0f);
  EXPECT_EQ(zs, 0);
  for (int8_t c : zc) EXPECT_EQ(c, 0);
  zq[3] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(SparcasQuantizeQuery(zq.data(), 8, zc.data(), &zs), 0.0f);
  EXPECT_EQ(SparcasQ4Dot(zc.data(), zs, 0.0f, words.data(), 8, scales[0]), 0.0f);
}

// The 4-bit rows rank nearly as the 16-bit ones of the same dimensions, and more dimensions at 4
// bits beat fewer at 16 in the same bytes (d_b 32 at 4 bits is 20 bytes a row, d_b 8 at 16 is 16).
TEST(SparcasQ4, RecallNearTheSixteenBitRowsAndMonotoneInDb) {
  const auto recall_of = [](int d_b, int bits) { return MeanRecall(d_b, bits, 900, 0); };
  std::vector<double> q4;
  for (int d_b : {8, 16, 32, 64}) {
    q4.push_back(recall_of(d_b, 4));
    const double full = recall_of(d_b, 16);
    std::printf("d_b %d recall 4-bit %.4f (smoothed %.4f) 16-bit %.4f\n", d_b, q4.back(),
                MeanRecall(d_b, 4, 900, 1), full);
    EXPECT_GT(q4.back(), full - 0.08) << "d_b " << d_b;
  }
  for (size_t i = 0; i + 1 < q4.size(); ++i) EXPECT_GE(q4[i + 1], q4[i] - 0.005) << i;
  EXPECT_GT(q4[2], recall_of(8, 16)) << "d_b 32 at 4 bits vs d_b 8 at 16 bits";
}

// Multiplying key channels by c and the query's by 1 / c leaves every logit, and so the exact
// top-k, as it was; 4-bit rows with one scale a row then lose the channels far below the scaled
// ones (what QK-norm's learned channel weights do to Gemma 3's keys). Smoothing divides the
// channels back before quantizing: its recall on the rescaled keys is the plain rows' on the
// original ones, and far above the plain rows' on the rescaled ones.
TEST(SparcasQ4, SmoothingUndoesAChannelRescaling) {
  const int hd = 64, group = 3, trials = 8;
  const float c = 64.0f;  // a power of two: the rescaled bf16 keys are exact
  const auto recall = [&](const PagedHead& kv, const std::vector<float>& q, int smooth) {
    SparcasParams sp;
    sp.d_b = hd;  // every dimension: the scaled ones share each 4-bit row with the others
    sp.bits = 4;
    sp.dense_layers = 0;
    sp.smooth = smooth;
    SparcasPolicy policy(sp, 1, 1, 1);
    return SelectedRecall(policy, Context(kv, q.data(), group, 4, 32, 4 + 32 + 128));
  };
  double plain = 0, plain_smoothed = 0, rescaled = 0, rescaled_smoothed = 0;
  for (int t = 0; t < trials; ++t) {
    Synthetic syn(2049, group, hd, 700 + t);
    PagedHead big(hd, syn.kv.dtype());
    const std::vector<float> zero(hd, 0.0f);
    for (int64_t pos = 0; pos < syn.kv.n(); ++pos) {
      std::vector<float> k = syn.kv.Key(pos);
      for (int d = 0; d < 8; ++d) k[d] *= c;
      big.Append(k.data(), zero.data());
    }
    std::vector<float> q = syn.q;
    for (int g = 0; g < group; ++g) {
      for (int d = 0; d < 8; ++d) q[g * hd + d] /= c;
    }
    plain += recall(syn.kv, syn.q, 0) / trials;
    plain_smoothed += recall(syn.kv, syn.q, 1) / trials;
    rescaled += recall(big, q, 0) / trials;
    rescaled_smoothed += recall(big, q, 1) / trials;
  }
  std::printf("recall: plain %.4f smoothed %.4f; channels 0-7 x%g: plain %.4f smoothed %.4f\n", plain,
              plain_smoothed, c, rescaled, rescaled_smoothed);
  EXPECT_GT(rescaled_smoothed, plain - 0.03);
  EXPECT_GT(plain_smoothed, plain - 0.03);
  EXPECT_LT(rescaled, rescaled_smoothed - 0.1);
}

// A small model for MakeSparcasPolicy's parameter checks.
RuntimeConfig SparcasConfig() {
  RuntimeConfig c;
  c.model.num_layers = 2;
  c.model.num_q_heads = 4;
  c.model.num_kv_heads = 2;
  c.model.head_dim = 64;
  c.policy.name = "sparcas";
  return c;
}

// smooth is 0 or 1 (the CUDA backend refuses 1 until its kernels smooth).
TEST(SparcasQ4, SmoothIsZeroOrOne) {
  RuntimeConfig c = SparcasConfig();
  c.policy.params["smooth"] = 2;
  auto r = MakeSparcasPolicy(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("smooth"), std::string::npos) << r.status().message();
  c.policy.params["smooth"] = 1;
  EXPECT_TRUE(MakeSparcasPolicy(c).ok());
}

TEST(SparcasQ4, FourBitsNeedDbAMultipleOfEight) {
  RuntimeConfig c = SparcasConfig();
  c.policy.params["d_b"] = 12;
  auto r = MakeSparcasPolicy(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("d_b"), std::string::npos) << r.status().message();
  c.policy.params["bits"] = 16;
  EXPECT_TRUE(MakeSparcasPolicy(c).ok());
  c.policy.params["d_b"] = 16;
  c.policy.params.erase("bits");
  EXPECT_TRUE(MakeSparcasPolicy(c).ok());
}

}  // namespace
}  // namespace kvferry
