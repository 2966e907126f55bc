// Copyright kvferry authors. Apache-2.0.
// LFPS's approximate scan (Select's step 3a): the register-blocked int16-pair kernels, the sampled
// threshold and the split over threads against the scan path as it was before them, kept here as
// a frozen reference (ScanChannels, MaxOfInt, CombineHeads, C1 at -inf, TopKAscending, verbatim
// but for the ISA clones). The picks must be the same positions for every kernel table, thread
// count and collection threshold, on inputs made to tie (few key values, periodic rows, tiny or
// zero weights) and to fool the sample (C1 holding the best scores); and Select's whole output must
// not depend on SelectContext::threads, when heads select concurrently inside one TBB arena as in
// the runtime's CPU step, nor through the runtime when its pool lends each Select several threads.
#include <gtest/gtest.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/kernels.h"
#include "cpu/reference.h"
#include "kvferry/kvferry.h"
#include "policies/lfps/lfps.h"
#include "tests/policy_test_util.h"

namespace kvferry {
namespace {

// ---- the frozen reference: the scan path before the fused kernels -------------------------------
namespace frozen {

void ScanChannels(const int8_t* const* rows, const int32_t* w, int r, int group, int64_t len,
                  int32_t* acc, int64_t ld) {
  constexpr int64_t kChunk = 512;
  for (int64_t j0 = 0; j0 < len; j0 += kChunk) {
    const int64_t cnt = std::min(kChunk, len - j0);
    for (int g = 0; g < group; ++g) std::fill_n(acc + g * ld + j0, cnt, 0);
    for (int c = 0; c < r; ++c) {
      const int8_t* kc = rows[c] + j0;
      for (int g = 0; g < group; ++g) {
        const int32_t wg = w[g * r + c];
        int32_t* a = acc + g * ld + j0;
        for (int64_t j = 0; j < cnt; ++j) a[j] += wg * static_cast<int32_t>(kc[j]);
      }
    }
  }
}

void CombineHeads(const int32_t* acc, int64_t ld, int group, const int32_t* mx, int64_t len,
                  float* score) {
  for (int64_t j = 0; j < len; ++j) {
    int32_t best = acc[j] - mx[0];
    for (int g = 1; g < group; ++g) best = std::max(best, acc[g * ld + j] - mx[g]);
    score[j] = static_cast<float>(best);
  }
}

int32_t MaxOfInt(const int32_t* x, int64_t n) {
  int32_t m = std::numeric_limits<int32_t>::min();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

inline uint32_t OrderedKey(float f) {
  f = f != f ? -std::numeric_limits<float>::infinity() : f + 0.0f;
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}

int64_t TopKAscending(const float* w, int64_t m, int64_t k, int32_t* out) {
  constexpr int64_t kRadixMin = 1536;
  constexpr int kShift = 21, kBins = 1 << (32 - kShift);
  std::vector<uint32_t> key_v(static_cast<size_t>(m)), cand_v(static_cast<size_t>(m));
  uint32_t* key = key_v.data();
  uint32_t* cand = cand_v.data();
  for (int64_t j = 0; j < m; ++j) key[j] = OrderedKey(w[j]);
  int64_t nc = m, need = k;
  if (m < kRadixMin) {
    std::copy_n(key, m, cand);
  } else {
    std::vector<uint32_t> hist_v(2 * kBins, 0);
    uint32_t(*hist)[kBins] = reinterpret_cast<uint32_t(*)[kBins]>(hist_v.data());
    int64_t j = 0;
    for (; j + 2 <= m; j += 2) {
      ++hist[0][key[j] >> kShift];
      ++hist[1][key[j + 1] >> kShift];
    }
    if (j < m) ++hist[0][key[j] >> kShift];
    uint32_t bin = kBins - 1;
    for (;; --bin) {
      const int64_t h = static_cast<int64_t>(hist[0][bin]) + hist[1][bin];
      if (h >= need) break;
      need -= h;
    }
    nc = 0;
    for (j = 0; j < m; ++j) {
      cand[nc] = key[j];
      nc += (key[j] >> kShift) == bin;
    }
  }
  std::nth_element(cand, cand + (need - 1), cand + nc, std::greater<uint32_t>());
  const uint32_t v = cand[need - 1];
  int64_t ties = need;
  for (int64_t i = 0; i < need - 1; ++i) ties -= cand[i] > v;
  int64_t c = 0;
  for (int64_t j = 0; j < m; ++j) {
    const bool eq = key[j] == v;
    const bool take = key[j] > v || (eq && ties > 0);
    out[c] = static_cast<int32_t>(j);
    c += take;
    ties -= eq && take;
  }
  return c;
}

// Select's step (3a) as it was, from the rows and weights on.
std::vector<int32_t> ScanPicks(const int8_t* const* rows, const int32_t* w, int r, int group,
                               int64_t len, const std::vector<int32_t>& excl, int64_t off_lo,
                               int64_t need, std::vector<float>* score_out = nullptr) {
  std::vector<int32_t> acc(static_cast<size_t>(group) * len);
  ScanChannels(rows, w, r, group, len, acc.data(), len);
  std::vector<int32_t> mx(static_cast<size_t>(group));
  for (int g = 0; g < group; ++g) mx[g] = MaxOfInt(acc.data() + g * len, len);
  std::vector<float> score(static_cast<size_t>(len));
  CombineHeads(acc.data(), len, group, mx.data(), len, score.data());
  if (score_out != nullptr) *score_out = score;
  for (const int32_t p : excl) score[p - off_lo] = -std::numeric_limits<float>::infinity();
  std::vector<int32_t> pick(static_cast<size_t>(need) + 1);
  int64_t got = need;
  if (need < len) {
    got = TopKAscending(score.data(), len, need, pick.data());
  } else {
    std::iota(pick.begin(), pick.begin() + len, 0);
  }
  pick.resize(static_cast<size_t>(got));
  return pick;
}

}  // namespace frozen

// ---- inputs -------------------------------------------------------------------------------------
enum class Keys { kUniform, kFew, kPeriodic, kZero };
enum class Weights { kScaled, kTiny, kZero, kWide };

struct ScanInput {
  int r = 0, group = 0;
  int64_t len = 0;
  std::vector<std::vector<int8_t>> chan;  // [r][len]
  std::vector<const int8_t*> rows;
  std::vector<int32_t> w;  // [group][r]
};

ScanInput MakeInput(std::mt19937& rng, int r, int group, int64_t len, Keys keys, Weights weights) {
  ScanInput in;
  in.r = r;
  in.group = group;
  in.len = len;
  std::uniform_int_distribution<int> full(-127, 127), few(-1, 1);
  const int64_t period = 37 + static_cast<int64_t>(rng() % 4096);
  in.chan.resize(static_cast<size_t>(r));
  for (auto& c : in.chan) {
    c.resize(static_cast<size_t>(len));
    for (int64_t j = 0; j < len; ++j) {
      switch (keys) {
        case Keys::kUniform:
          c[j] = static_cast<int8_t>(full(rng));
          break;
        case Keys::kFew:
          c[j] = static_cast<int8_t>(few(rng));
          break;
        case Keys::kPeriodic:
          c[j] = j < period ? static_cast<int8_t>(full(rng)) : c[j - period];
          break;
        case Keys::kZero:
          c[j] = 0;
          break;
      }
    }
    in.rows.push_back(c.data());
  }
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  in.w.resize(static_cast<size_t>(group) * r);
  for (auto& x : in.w) {
    switch (weights) {
      case Weights::kScaled:
        x = static_cast<int32_t>(std::lrint(16384.0f * u(rng)));
        break;
      case Weights::kTiny:
        x = static_cast<int32_t>(rng() % 7) - 3;
        break;
      case Weights::kZero:
        x = 0;
        break;
      case Weights::kWide:
        x = static_cast<int32_t>(std::lrint(32767.0f * u(rng)));
        break;
    }
  }
  // As Select's weights: one at the scale's full +-16384.
  if (weights == Weights::kScaled) in.w[rng() % in.w.size()] = rng() % 2 ? 16384 : -16384;
  return in;
}

// A random ascending subset of [off_lo, off_lo + len) of about frac * len positions; with
// `best` the positions with the highest frozen scores instead (C1 then hides the top of the
// distribution from the sample).
std::vector<int32_t> MakeExcl(std::mt19937& rng, const ScanInput& in, int64_t off_lo, double frac,
                              bool best) {
  std::vector<int32_t> excl;
  const int64_t want = static_cast<int64_t>(frac * static_cast<double>(in.len));
  if (best) {
    std::vector<float> score;
    frozen::ScanPicks(in.rows.data(), in.w.data(), in.r, in.group, in.len, {}, off_lo, in.len,
                      &score);
    std::vector<int32_t> order(static_cast<size_t>(in.len));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return score[a] > score[b]; });
    for (int64_t i = 0; i < want; ++i) excl.push_back(static_cast<int32_t>(off_lo + order[i]));
    std::sort(excl.begin(), excl.end());
    return excl;
  }
  for (int64_t j = 0; j < in.len; ++j) {
    if (static_cast<double>(rng() % 100000) < frac * 100000.0) {
      excl.push_back(static_cast<int32_t>(off_lo + j));
    }
  }
  return excl;
}

std::vector<const cpu::CpuKernels*> Tables() {
  std::vector<const cpu::CpuKernels*> out;
  for (int i = 0; i < cpu::kNumCpuIsas; ++i) {
    if (const cpu::CpuKernels* k = cpu::GetCpuKernels(static_cast<cpu::CpuIsa>(i))) {
      out.push_back(k);
    }
  }
  return out;
}

// First mismatching index of two pick lists, for the failure message.
std::string FirstDiff(const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  std::ostringstream os;
  os << "sizes " << got.size() << " / " << want.size() << ", first difference at " << i;
  if (i < got.size()) os << " got " << got[i];
  if (i < want.size()) os << " want " << want[i];
  return os.str();
}

// ---- the kernels: every table against the scalar reference, and the scalar one against frozen --
TEST(ShadowScanTest, KernelsMatchTheReference) {
  std::mt19937 rng(11);
  const cpu::CpuKernels& ref = cpu::ScalarKernels();
  int checked = 0;
  for (const int64_t len : {1, 17, 31, 32, 33, 97, 1000, 4099}) {
    for (const int group : {1, 3, 4, 5, 8, 9, 16}) {
      for (const int r : {1, 2, 4, 15, 16, 64, 255, 256}) {
        const Keys keys = static_cast<Keys>(rng() % 3);
        const ScanInput in =
            MakeInput(rng, r, group, len, keys, rng() % 4 == 0 ? Weights::kWide : Weights::kScaled);
        std::vector<int32_t> frozen_acc(static_cast<size_t>(group) * len);
        frozen::ScanChannels(in.rows.data(), in.w.data(), r, group, len, frozen_acc.data(), len);
        // A sub-range with odd ends, so that the SIMD blocks and the scalar tails both run.
        const int64_t begin = len > 40 ? static_cast<int64_t>(rng() % 9) : 0;
        const int64_t end = len > 40 ? len - static_cast<int64_t>(rng() % 9) : len;
        std::vector<int32_t> want_acc(frozen_acc.size(), -7), want_max(static_cast<size_t>(group));
        cpu::ScanInt8Args a;
        a.rows = in.rows.data();
        a.w = in.w.data();
        a.r = r;
        a.group = group;
        a.begin = begin;
        a.end = end;
        a.acc = want_acc.data();
        a.ld = len;
        a.head_max = want_max.data();
        ref.scan_int8(a);
        for (int g = 0; g < group; ++g) {
          for (int64_t j = begin; j < end; ++j) {
            ASSERT_EQ(want_acc[g * len + j], frozen_acc[g * len + j]) << "g " << g << " j " << j;
          }
        }
        ASSERT_TRUE(cpu::ScanArgsFitSimd(a));
        for (const cpu::CpuKernels* k : Tables()) {
          SCOPED_TRACE(testing::Message() << k->name << " len " << len << " group " << group
                                          << " r " << r << " [" << begin << ", " << end << ")");
          std::vector<int32_t> acc(frozen_acc.size(), -7), mx(static_cast<size_t>(group));
          cpu::ScanInt8Args b = a;
          b.acc = acc.data();
          b.head_max = mx.data();
          k->scan_int8(b);
          ASSERT_EQ(acc, want_acc);
          ASSERT_EQ(mx, want_max);
          // Collect at a threshold some pass: the key of a random position's score.
          std::vector<int32_t> full_max(static_cast<size_t>(group));
          for (int g = 0; g < group; ++g) {
            full_max[g] =
                *std::max_element(frozen_acc.begin() + g * len, frozen_acc.begin() + (g + 1) * len);
          }
          for (int t = 0; t < 3; ++t) {
            cpu::ScanCollectArgs c;
            c.acc = frozen_acc.data();
            c.ld = len;
            c.group = group;
            c.mx = full_max.data();
            c.begin = begin;
            c.end = end;
            const int64_t at = static_cast<int64_t>(rng() % static_cast<uint32_t>(len));
            int32_t s = frozen_acc[at] - full_max[0];
            for (int g = 1; g < group; ++g) s = std::max(s, frozen_acc[g * len + at] - full_max[g]);
            c.thr = t == 0 ? 0u : t == 1 ? cpu::ScanKey(s) : 0xffffffffu;
            std::vector<int32_t> gi(static_cast<size_t>(len)), wi(static_cast<size_t>(len));
            std::vector<uint32_t> gk(static_cast<size_t>(len)), wk(static_cast<size_t>(len));
            c.idx = wi.data();
            c.key = wk.data();
            const int64_t nw = ref.scan_collect(c);
            c.idx = gi.data();
            c.key = gk.data();
            const int64_t ng = k->scan_collect(c);
            ASSERT_EQ(ng, nw) << "thr " << c.thr;
            for (int64_t i = 0; i < nw; ++i) {
              ASSERT_EQ(gi[i], wi[i]) << i;
              ASSERT_EQ(gk[i], wk[i]) << i;
              // The key orders as the frozen path's float score does.
              int32_t si = frozen_acc[wi[i]] - full_max[0];
              for (int g = 1; g < group; ++g) {
                si = std::max(si, frozen_acc[g * len + wi[i]] - full_max[g]);
              }
              ASSERT_EQ(wk[i], frozen::OrderedKey(static_cast<float>(si)));
            }
            if (t == 0) EXPECT_EQ(nw, end - begin);
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 400);
}

// ---- the picks: the frozen path against the new one, every table, thread count, threshold -------
struct PickCase {
  int64_t len;
  int group, r;
  Keys keys;
  Weights weights;
  double excl_frac;
  bool excl_best;
  double need_frac;  // need = ceil(need_frac * len), clamped to len - m (>= len - m: everything)
};

void RunPickCase(const PickCase& pc, uint32_t seed, int* retries) {
  SCOPED_TRACE(testing::Message() << "seed " << seed << " len " << pc.len << " group " << pc.group
                                  << " r " << pc.r << " keys " << static_cast<int>(pc.keys)
                                  << " weights " << static_cast<int>(pc.weights) << " excl "
                                  << pc.excl_frac << (pc.excl_best ? " (best)" : "") << " need "
                                  << pc.need_frac);
  std::mt19937 rng(seed);
  const ScanInput in = MakeInput(rng, pc.r, pc.group, pc.len, pc.keys, pc.weights);
  const int64_t off_lo = static_cast<int64_t>(rng() % 9);
  const std::vector<int32_t> excl = MakeExcl(rng, in, off_lo, pc.excl_frac, pc.excl_best);
  const int64_t m = static_cast<int64_t>(excl.size());
  int64_t need = static_cast<int64_t>(std::ceil(pc.need_frac * static_cast<double>(pc.len)));
  need = std::max<int64_t>(1, std::min(need, pc.len - m));
  if (m == 0 && pc.need_frac >= 1.0) need = pc.len;  // Select's "every position" case
  if (pc.len - m <= 0) return;
  const std::vector<int32_t> want =
      frozen::ScanPicks(in.rows.data(), in.w.data(), pc.r, pc.group, pc.len, excl, off_lo, need);
  ASSERT_EQ(static_cast<int64_t>(want.size()), std::min(need, pc.len));
  tbb::task_arena arena(4);
  for (const cpu::CpuKernels* k : Tables()) {
    for (const int threads : {1, 2, 3, 8}) {
      for (int thr_mode = 0; thr_mode < 3; ++thr_mode) {
        SCOPED_TRACE(testing::Message()
                     << k->name << " threads " << threads << " thr_mode " << thr_mode);
        lfps_internal::ScanPicksOptions opt;
        opt.threads = threads;
        opt.isa = static_cast<int>(k->isa);
        // 0: the sampled threshold; 1: one that lets everything pass; 2: one that lets too few
        // pass (the retry).
        opt.force_thr = thr_mode != 0;
        opt.thr = thr_mode == 1 ? 0u : 0xffffffffu;
        std::vector<int32_t> got;
        bool retried = false;
        int64_t n = 0;
        arena.execute([&] {
          n = lfps_internal::ScanPicks(in.rows.data(), in.w.data(), pc.r, pc.group, pc.len,
                                       excl.data(), m, off_lo, need, opt, got, &retried);
        });
        if (n < 0) continue;  // this table does not take the weights (kWide is in range)
        ASSERT_EQ(got, want) << FirstDiff(got, want);
        if (thr_mode == 0) *retries += retried;
        if (thr_mode == 2 && need < pc.len) EXPECT_TRUE(retried);
      }
    }
  }
}

TEST(ShadowScanTest, PicksMatchTheFrozenScan) {
  // len, group, r, keys, weights, excl_frac, excl_best, need_frac
  const PickCase cases[] = {
      {1, 1, 1, Keys::kUniform, Weights::kScaled, 0.0, false, 1.0},
      {17, 3, 4, Keys::kUniform, Weights::kScaled, 0.2, false, 0.1},
      {97, 4, 16, Keys::kFew, Weights::kTiny, 0.1, false, 0.3},
      {1000, 8, 16, Keys::kUniform, Weights::kScaled, 0.05, false, 0.05},
      {1537, 1, 64, Keys::kPeriodic, Weights::kScaled, 0.0, false, 0.02},
      {4095, 4, 16, Keys::kUniform, Weights::kScaled, 0.03, false, 0.04},
      {4099, 3, 16, Keys::kFew, Weights::kTiny, 0.03, false, 0.05},
      {5000, 4, 1, Keys::kUniform, Weights::kScaled, 0.02, true, 0.05},
      {9001, 8, 4, Keys::kPeriodic, Weights::kScaled, 0.01, false, 0.04},
      {12289, 4, 16, Keys::kUniform, Weights::kScaled, 0.03, true, 0.05},
      {16411, 4, 16, Keys::kUniform, Weights::kScaled, 0.02, false, 0.025},
      {20011, 3, 64, Keys::kFew, Weights::kScaled, 0.02, false, 0.025},
      {32737, 4, 16, Keys::kPeriodic, Weights::kScaled, 0.015, false, 0.025},
      {33000, 1, 4, Keys::kUniform, Weights::kTiny, 0.0, false, 0.01},
      {40000, 8, 16, Keys::kUniform, Weights::kWide, 0.03, true, 0.04},
      {24000, 4, 16, Keys::kZero, Weights::kScaled, 0.01, false, 0.02},   // every score 0: ties
      {24000, 4, 16, Keys::kUniform, Weights::kZero, 0.01, false, 0.02},  // the same
      {30000, 4, 16, Keys::kUniform, Weights::kScaled, 0.5, false, 0.6},  // need = len - m
      {18000, 4, 16, Keys::kUniform, Weights::kScaled, 0.0, false, 1.0},  // everything
  };
  uint32_t seed = 500;
  int retries = 0;
  for (const PickCase& pc : cases) {
    RunPickCase(pc, seed++, &retries);
    if (HasFatalFailure()) return;
  }
  // The sampled threshold almost never needs the second pass (it may on the tie-heavy inputs).
  EXPECT_LE(retries, 12);
}

// ---- Select: the same output with 1 and several threads -----------------------------------------
constexpr int kHd = 128, kPage = 256;
using testing_util::PagedHead;

TEST(ShadowScanTest, SelectDoesNotDependOnThreads) {
  constexpr int kHeads = 4, kGroup = 4, kSteps = 12, kSink = 4, kWindow = 64;
  constexpr int64_t kN0 = 40000;
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t total = kN0 + kSteps;
  std::vector<PagedHead> heads;
  std::vector<std::vector<float>> dirs;
  std::vector<float> k(kHd), v(kHd);
  for (int h = 0; h < kHeads; ++h) {
    heads.emplace_back(kHd, DType::kBF16, kPage);
    std::vector<float> dir(kHd);
    for (float& x : dir) x = nd(rng);
    for (int64_t i = 0; i < total; ++i) {
      const bool hot = rng() % 50 == 0;
      for (int d = 0; d < kHd; ++d) {
        k[d] = nd(rng) + (hot ? 2.0f * dir[d] : 0.0f);
        v[d] = nd(rng);
      }
      if (i % 997 == 5) std::fill(k.begin(), k.end(), 0.0f);  // ties at logit 0
      heads.back().Append(k.data(), v.data());
    }
    dirs.push_back(dir);
  }
  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  // One policy per thread setting, all fed the same steps.
  const int settings[] = {1, 2, 4, 16};
  LfpsParams lp;  // the defaults, but no bypass (the random sinks would dominate)
  lp.eps = 2.0;
  std::vector<std::unique_ptr<LfpsPolicy>> pols;
  for (size_t s = 0; s < std::size(settings); ++s) {
    pols.emplace_back(new LfpsPolicy(lp, 1, 1, kHeads, total));
  }
  const int rows = 16;
  for (int h = 0; h < kHeads; ++h) {
    std::vector<float> q(static_cast<size_t>(rows) * kGroup * kHd);
    for (size_t i = 0; i < q.size(); ++i) q[i] = nd(rng) + 1.5f * dirs[h][i % kHd];
    PrefillContext pc;
    pc.kv_head = h;
    pc.q_pos0 = kN0 - 1 - rows;
    pc.num_q = rows;
    pc.n = kN0 - 1;
    pc.sink = kSink;
    pc.window = kWindow;
    pc.q = q.data();
    pc.params = p;
    pc.kv = heads[h].pages();
    for (auto& pol : pols) ASSERT_TRUE(pol->OnPrefill(pc).ok());
  }
  tbb::task_arena arena(4);
  int64_t scanned_steps = 0;
  for (int step = 0; step < kSteps; ++step) {
    const int64_t n = kN0 + step;
    std::vector<std::vector<float>> q(kHeads, std::vector<float>(kGroup * kHd));
    for (int h = 0; h < kHeads; ++h) {
      for (size_t i = 0; i < q[h].size(); ++i) {
        q[h][i] = 1.5f * nd(rng) + (step % 3 == 0 ? 0.0f : 2.0f) * dirs[h][i % kHd];
      }
    }
    // [setting][head]
    std::vector<std::vector<std::vector<int32_t>>> out(std::size(settings),
                                                       std::vector<std::vector<int32_t>>(kHeads));
    std::vector<std::vector<LfpsStepInfo>> info(std::size(settings),
                                                std::vector<LfpsStepInfo>(kHeads));
    std::vector<Status> st(std::size(settings) * kHeads, Status::Ok());
    for (size_t s = 0; s < std::size(settings); ++s) {
      auto select = [&](int h) {
        SelectContext ctx;
        ctx.kv_head = h;
        ctx.n = n;
        ctx.sink = kSink;
        ctx.window = kWindow;
        ctx.budget = static_cast<int64_t>(std::ceil(0.02 * n));
        ctx.q = q[h].data();
        ctx.params = p;
        ctx.kv = heads[h].pages();
        ctx.threads = settings[s];
        st[s * kHeads + h] = pols[s]->SelectWithInfo(ctx, out[s][h], &info[s][h]);
      };
      if (settings[s] == 1) {
        for (int h = 0; h < kHeads; ++h) select(h);  // serial, outside any arena
      } else {
        // Heads concurrently in one arena, each Select splitting its scan: the runtime's shape.
        arena.execute([&] { tbb::parallel_for(0, kHeads, [&](int h) { select(h); }); });
      }
    }
    for (const Status& x : st) ASSERT_TRUE(x.ok()) << x.ToString();
    for (int h = 0; h < kHeads; ++h) {
      scanned_steps += info[0][h].scanned > 0;
      EXPECT_GT(out[0][h].size(), static_cast<size_t>(kSink + kWindow))
          << "bypassed " << info[0][h].bypassed << " all " << info[0][h].all << " c1 "
          << info[0][h].c1 << " rho " << info[0][h].rho;
      for (size_t s = 1; s < std::size(settings); ++s) {
        ASSERT_EQ(out[s][h], out[0][h]) << "step " << step << " head " << h << " threads "
                                        << settings[s] << ": " << FirstDiff(out[s][h], out[0][h]);
        ASSERT_EQ(info[s][h].c1, info[0][h].c1);
        ASSERT_EQ(info[s][h].c2, info[0][h].c2);
        ASSERT_EQ(info[s][h].scanned, info[0][h].scanned);
        ASSERT_EQ(info[s][h].filled, info[0][h].filled);
      }
    }
  }
  EXPECT_GT(scanned_steps, kSteps);  // the scan ran (over 40K tokens: split into ranges)
  for (int h = 0; h < kHeads; ++h) {
    double v0 = 0, s0 = 0;
    ASSERT_TRUE(pols[0]->TableSums(0, 0, h, &v0, &s0));
    for (size_t s = 1; s < std::size(settings); ++s) {
      double vs = 0, ss = 0;
      ASSERT_TRUE(pols[s]->TableSums(0, 0, h, &vs, &ss));
      EXPECT_EQ(vs, v0);
      EXPECT_EQ(ss, s0);
    }
  }
}

// ---- the scan's ranking from a device (Device::ShadowScan, SelectContext::scan) --------------------
// A policy that takes its scan's picks from cpu::ShadowScanRef, run over a copy of its shadow that is
// extended by each step's new row (as the runtime's device copy is), selects what a policy that
// scans on the host selects, every step: with the usual number of picks, and with so few that they
// run short of C1's overlap (the policy then scans on the host, its own shadow rows behind).
TEST(ShadowScanTest, DeviceRankingGivesTheHostPicks) {
  // A window shorter than the steps: rows the "device" wrote (new_pos) get ranked too.
  constexpr int kSteps = 14, kSink = 4, kWindow = 6;
  for (const int group : {4, 3}) {
    for (const int64_t n0 : {int64_t{3000}, int64_t{20000}}) {
      SCOPED_TRACE(testing::Message() << "group " << group << " n0 " << n0);
      const int hd = group == 4 ? 128 : 64, heads = 2;
      std::mt19937 rng(static_cast<uint32_t>(31 + group + n0));
      std::normal_distribution<float> nd(0.0f, 1.0f);
      const int64_t total = n0 + kSteps;
      std::vector<PagedHead> kv;
      std::vector<std::vector<float>> dirs;
      std::vector<float> k(static_cast<size_t>(hd)), v(static_cast<size_t>(hd));
      for (int h = 0; h < heads; ++h) {
        kv.emplace_back(hd, DType::kBF16, kPage);
        std::vector<float> dir(static_cast<size_t>(hd));
        for (float& x : dir) x = nd(rng);
        for (int64_t i = 0; i < total; ++i) {
          const bool hot = rng() % 40 == 0;
          for (int d = 0; d < hd; ++d) k[d] = nd(rng) + (hot ? 2.0f * dir[d] : 0.0f), v[d] = nd(rng);
          kv.back().Append(k.data(), v.data());
        }
        dirs.push_back(dir);
      }
      const AttnParams p = testing_util::Params(group, hd, DType::kBF16);
      LfpsParams lp;
      lp.eps = 2.0;
      // 0: scans on the host; 1: the device's usual picks; 2: 8 picks (short when C1 takes any).
      std::vector<std::unique_ptr<LfpsPolicy>> pols;
      for (int i = 0; i < 3; ++i) pols.emplace_back(new LfpsPolicy(lp, 1, 1, heads, total));
      const int rows = 16;
      for (int h = 0; h < heads; ++h) {
        std::vector<float> q(static_cast<size_t>(rows) * group * hd);
        for (size_t i = 0; i < q.size(); ++i) q[i] = nd(rng) + 1.5f * dirs[h][i % hd];
        PrefillContext pc;
        pc.kv_head = h;
        pc.q_pos0 = n0 - 1 - rows;
        pc.num_q = rows;
        pc.n = n0 - 1;
        pc.sink = kSink;
        pc.window = kWindow;
        pc.q = q.data();
        pc.params = p;
        pc.kv = kv[h].pages();
        for (auto& pol : pols) ASSERT_TRUE(pol->OnPrefill(pc).ok());
      }
      // The "device" copies of policies 1 and 2: [head][channel][total] and the scales.
      std::vector<std::vector<int8_t>> shadow(3, std::vector<int8_t>(static_cast<size_t>(heads * hd * total)));
      std::vector<std::vector<float>> scale(3, std::vector<float>(static_cast<size_t>(heads * hd)));
      for (int i = 1; i < 3; ++i) {
        for (int h = 0; h < heads; ++h) {
          ScanShadowView view;
          ASSERT_TRUE(pols[i]->ScanShadow(0, 0, h, &view));
          ASSERT_EQ(view.n, n0 - 1);
          for (int c = 0; c < hd; ++c) {
            std::memcpy(&shadow[i][(h * hd + c) * total], view.k8 + c * view.cap, view.n);
          }
          std::memcpy(&scale[i][h * hd], view.scale, hd * sizeof(float));
        }
      }
      int64_t scanned = 0;
      for (int step = 0; step < kSteps; ++step) {
        const int64_t n = n0 + step;
        std::vector<float> q(static_cast<size_t>(heads) * group * hd), knew(static_cast<size_t>(heads) * hd);
        for (int h = 0; h < heads; ++h) {
          for (int64_t i = 0; i < group * hd; ++i) {
            q[h * group * hd + i] = 1.5f * nd(rng) + (step % 3 == 0 ? 0.0f : 2.0f) * dirs[h][i % hd];
          }
          const std::vector<float> key = kv[h].Key(n - 1);
          std::copy(key.begin(), key.end(), knew.begin() + h * hd);
        }
        SelectContext base;
        base.n = n;
        base.sink = kSink;
        base.window = kWindow;
        base.budget = static_cast<int64_t>(std::ceil(0.02 * n)) + 100;
        base.params = p;
        const int64_t len = n - kWindow - kSink;
        const int64_t k_off = base.budget - kSink - kWindow;
        std::vector<std::vector<int32_t>> out(3);
        for (int h = 0; h < heads; ++h) {
          SelectContext ctx = base;
          ctx.kv_head = h;
          ctx.q = q.data() + h * group * hd;
          ctx.kv = kv[h].pages();
          LfpsStepInfo info;
          ASSERT_TRUE(pols[0]->SelectWithInfo(ctx, out[0], &info).ok());
          scanned += info.scanned > 0;
          for (int i = 1; i < 3; ++i) {
            const int64_t picks = i == 1 ? pols[i]->device_scan_picks(k_off) : 8;
            ASSERT_GT(picks, 0);
            ShadowScanItem item;
            item.shadow = static_cast<int64_t>(h) * hd * total;
            item.scale = static_cast<int64_t>(h) * hd;
            item.off_lo = kSink;
            item.len = len;
            item.new_pos = n - 1;
            item.picks = std::min(picks, len);
            std::vector<uint32_t> keys(static_cast<size_t>(len));
            std::vector<int32_t> ints(static_cast<size_t>(ShadowScanInts(1, group, lp.scan)));
            const int64_t list_cap = 2 * item.picks + 512;
            std::vector<uint64_t> ranked(static_cast<size_t>(list_cap));
            int32_t count = 0;
            ShadowScanArgs a;
            a.items = 1;
            a.item = &item;
            a.group = group;
            a.head_dim = hd;
            a.channels = lp.scan;
            a.cap = total;
            a.shadow = shadow[i].data();
            a.scale = scale[i].data();
            a.q = ctx.q;
            a.k = knew.data() + h * hd;
            a.kv_dtype = DType::kBF16;
            a.max_len = len;
            a.max_picks = list_cap;
            a.keys = keys.data();
            a.ints = ints.data();
            a.out = ranked.data();
            a.counts = &count;
            cpu::ShadowScanRef(a);
            ASSERT_TRUE(count == -1 || count >= item.picks) << count;
            DeviceScanPicks dp;
            dp.picks = ranked.data();
            dp.count = std::max(count, 0);
            dp.off_lo = kSink;
            dp.len = len;
            dp.channels = lp.scan;
            ctx.scan = &dp;
            ASSERT_TRUE(pols[i]->Select(ctx, out[i]).ok());
            ASSERT_EQ(out[i], out[0]) << "step " << step << " head " << h << " policy " << i
                                      << ": " << FirstDiff(out[i], out[0]);
          }
        }
      }
      EXPECT_GT(scanned, 0);
      EXPECT_GT(pols[1]->stats().device_scans, 0);
      EXPECT_EQ(pols[1]->stats().device_scans_short, 0);
      EXPECT_GT(pols[2]->stats().device_scans_short, 0);
      EXPECT_EQ(pols[0]->stats().device_scans + pols[0]->stats().device_scans_short, 0);
    }
  }
}

// The runtime's decode step with one KV head (so each Select gets every pool thread,
// SelectContext::threads > 1, and its scan splits into tasks of the pool's arena) selects what a
// one-thread runtime selects, and its CPU attention split over the threads gives its output.
TEST(ShadowScanTest, RuntimeSelectsTheSameWithMorePoolThreads) {
  constexpr int kHd = 64, kGroup = 4, kPrime = 32, kSteps = 8;
  constexpr int64_t kCtx = 24000;
  std::vector<std::unique_ptr<Runtime>> rts;
  for (const int threads : {1, 2}) {
    RuntimeConfig c;
    c.model = {.num_layers = 1,
               .num_q_heads = kGroup,
               .num_kv_heads = 1,
               .head_dim = kHd,
               .kv_dtype = DType::kBF16};
    c.capacity.max_sequences = 1;
    c.capacity.max_batch = 1;
    c.capacity.max_tokens_per_sequence = kCtx + kSteps + 8;
    c.capacity.max_prefill_chunk = 4096;
    c.tiers.sink_tokens = 4;
    c.tiers.window_tokens = 64;
    c.backend = Backend::kHost;
    c.probe_at_start = false;
    c.cpu_threads = threads;
    c.policy.name = "lfps";
    c.policy.budget_tokens = 0;
    c.policy.budget_fraction = 0.02;
    c.policy.params = {{"eps", 2.0}};
    auto made = Runtime::Create(c);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    rts.push_back(std::move(made).value());
    ASSERT_TRUE(rts.back()->AddSequence(7).ok());
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto random = [&](int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = nd(rng);
    return x;
  };
  auto view = [](std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, kHd});
  };
  for (int64_t pos = 0; pos < kCtx - kPrime; pos += 4096) {
    const int64_t n = std::min<int64_t>(4096, kCtx - kPrime - pos);
    auto k = random(n * kHd), v = random(n * kHd);
    for (auto& rt : rts) ASSERT_TRUE(rt->Append(7, 0, view(k, n, 1), view(v, n, 1)).ok());
  }
  {
    auto q = random(kPrime * kGroup * kHd), k = random(kPrime * kHd), v = random(kPrime * kHd);
    std::vector<float> out(q.size());
    for (auto& rt : rts) {
      ASSERT_TRUE(rt->Prefill(7, 0, view(q, kPrime, kGroup), view(k, kPrime, 1),
                              view(v, kPrime, 1), view(out, kPrime, kGroup))
                      .ok());
    }
  }
  const SequenceId seqs[1] = {7};
  for (int step = 0; step < kSteps; ++step) {
    auto q = random(kGroup * kHd), k = random(kHd), v = random(kHd);
    std::vector<std::vector<float>> out(rts.size(), std::vector<float>(q.size()));
    for (size_t i = 0; i < rts.size(); ++i) {
      ASSERT_TRUE(rts[i]->Decode(seqs, 0, view(q, 1, kGroup), view(k, 1, 1), view(v, 1, 1),
                                 view(out[i], 1, kGroup))
                      .ok());
    }
    auto a = rts[0]->LastSelection(7, 0, 0), b = rts[1]->LastSelection(7, 0, 0);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_GT(a->size(), 68u + 400u) << "step " << step;  // the budget's offloaded picks
    ASSERT_EQ(*a, *b) << "step " << step << ": " << FirstDiff(*b, *a);
    double norm = 0.0;
    for (float x : out[1]) norm += x * double{x};
    EXPECT_GT(norm, 0.0);
    // The two-thread runtime splits the CPU attention over the ~412 picks in two ranges whose
    // (o, lse) it merges: the same output up to fp32 rounding.
    for (size_t j = 0; j < q.size(); ++j) {
      ASSERT_NEAR(out[1][j], out[0][j], 1e-5) << "step " << step << " element " << j;
    }
  }
}

}  // namespace
}  // namespace kvferry
