// Copyright kvferry authors. Apache-2.0.
// Every CPU kernel family (scalar, AVX2, AVX-512F, AVX-512 BF16) against the scalar reference, on
// fresh random bf16/fp16 inputs, odd lengths, GQA ratios 1/3/4/8 and head_dim 64/128 (plus 72 and
// 8, which exercise the masked half-vector tails of the AVX-512 code). Outputs are poisoned with NaN
// first; each comparison also checks a non-zero norm so an all-zero kernel cannot pass.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/attention.h"
#include "cpu/cpu_features.h"
#include "cpu/dtype.h"
#include "cpu/kernels.h"
#include "cpu/reference.h"

namespace kvferry::cpu {
namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// A paged KV head with random rows (the host store's layout, see attn_types.h).
struct PagedKv {
  std::vector<std::vector<uint16_t>> storage;
  std::vector<void*> pages;
  KvPages kv;
  int64_t n = 0;
  int head_dim = 0;
  DType dtype = DType::kBF16;

  PagedKv(int64_t n_tokens, int hd, DType dt, int page_tokens, std::mt19937& rng)
      : n(n_tokens), head_dim(hd), dtype(dt) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    const int64_t num_pages = (n + page_tokens - 1) / page_tokens;
    storage.resize(static_cast<size_t>(num_pages));
    for (auto& page : storage) {
      // uint16 units; an f32 page takes two per element.
      const size_t elems = static_cast<size_t>(2) * page_tokens * hd;
      page.resize(elems * DTypeSize(dt) / 2);
      for (size_t i = 0; i < elems; ++i) StoreFromF32(page.data(), dt, static_cast<int64_t>(i), dist(rng));
      pages.push_back(page.data());
    }
    kv.pages = pages.data();
    kv.page_tokens = page_tokens;
  }
  const void* K(int64_t pos) const { return PagedKRow(kv, pos, head_dim, DTypeSize(dtype)); }
  const void* V(int64_t pos) const { return PagedVRow(kv, pos, head_dim, DTypeSize(dtype)); }
};

std::vector<float> RandomQ(int group, int hd, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> q(static_cast<size_t>(group) * hd);
  for (float& x : q) x = dist(rng);
  return q;
}

double Norm(const std::vector<float>& x) {
  double s = 0.0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}

// Compares element-wise; prints the first mismatches.
void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, double tol,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  int shown = 0;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_inf = std::isinf(want[i]) && got[i] == want[i];
    if (!both_inf && !(std::abs(static_cast<double>(got[i]) - want[i]) <= tol)) {
      ++bad;
      if (shown++ < 5) {
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " want " << want[i];
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " outside " << tol;
}

std::vector<CpuIsa> AllIsas() {
  return {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512F, CpuIsa::kAvx512Bf16};
}

#define KVF_REQUIRE_ISA(isa)                                                            \
  const CpuKernels* kernels = GetCpuKernels(isa);                                        \
  if (kernels == nullptr) {                                                              \
    GTEST_SKIP() << "this CPU lacks " << CpuIsaName(isa) << " (best here: "              \
                 << CpuIsaName(BestCpuIsa()) << "); run on the GPU machine to cover it"; \
  }

using Case = std::tuple<CpuIsa, DType, int /*head_dim*/, int /*group*/, int /*count*/>;

class CpuKernelTest : public ::testing::TestWithParam<Case> {
 protected:
  CpuIsa isa() const { return std::get<0>(GetParam()); }
  AttnParams Params() const {
    AttnParams p;
    p.kv_dtype = std::get<1>(GetParam());
    p.head_dim = std::get<2>(GetParam());
    p.group = std::get<3>(GetParam());
    p.scale = 1.0f / std::sqrt(static_cast<float>(p.head_dim));
    return p;
  }
  int count() const { return std::get<4>(GetParam()); }
  uint32_t Seed() const {
    const auto [i, d, h, g, c] = GetParam();
    return 1000003u * static_cast<uint32_t>(i) + 10007u * static_cast<uint32_t>(d) +
           101u * static_cast<uint32_t>(h) + 7u * static_cast<uint32_t>(g) +
           static_cast<uint32_t>(c);
  }
};

TEST_P(CpuKernelTest, AttendRowsMatchesReference) {
  KVF_REQUIRE_ISA(isa());
  const AttnParams p = Params();
  std::mt19937 rng(Seed());
  PagedKv kv(count() + 40, p.head_dim, p.kv_dtype, 64, rng);
  // Rows in a scattered order, as the CPU route sees them.
  std::vector<int32_t> pos(static_cast<size_t>(kv.n));
  std::iota(pos.begin(), pos.end(), 0);
  std::shuffle(pos.begin(), pos.end(), rng);
  pos.resize(static_cast<size_t>(count()));
  std::vector<const void*> k_rows, v_rows;
  for (int32_t x : pos) {
    k_rows.push_back(kv.K(x));
    v_rows.push_back(kv.V(x));
  }
  const std::vector<float> q = RandomQ(p.group, p.head_dim, 3.0f, rng);
  const size_t out_elems = static_cast<size_t>(p.group) * p.head_dim;
  std::vector<float> o_ref(out_elems, kNan), lse_ref(p.group, kNan);
  std::vector<float> o(out_elems, kNan), lse(p.group, kNan);
  RowAttnItem item{q.data(), o_ref.data(), lse_ref.data(), k_rows.data(), v_rows.data(), count()};
  AttendRowsRef(p, item);
  item.o = o.data();
  item.lse = lse.data();
  kernels->attend_rows(p, item);
  ExpectNear(o, o_ref, 2e-5, "o");
  ExpectNear(lse, lse_ref, 2e-5 * (1.0 + std::abs(lse_ref[0])), "lse");
  EXPECT_GT(Norm(o), 1e-3);
}

TEST_P(CpuKernelTest, AttendPositionsMatchesReference) {
  KVF_REQUIRE_ISA(isa());
  const AttnParams p = Params();
  std::mt19937 rng(Seed() + 1);
  PagedKv kv(2 * count() + 3, p.head_dim, p.kv_dtype, 32, rng);
  std::vector<int32_t> pos(static_cast<size_t>(kv.n));
  std::iota(pos.begin(), pos.end(), 0);
  std::shuffle(pos.begin(), pos.end(), rng);
  pos.resize(static_cast<size_t>(count()));
  std::vector<const void*> k_rows, v_rows;
  for (int32_t x : pos) {
    k_rows.push_back(kv.K(x));
    v_rows.push_back(kv.V(x));
  }
  const std::vector<float> q = RandomQ(p.group, p.head_dim, 2.0f, rng);
  const size_t out_elems = static_cast<size_t>(p.group) * p.head_dim;
  std::vector<float> o_ref(out_elems, kNan), lse_ref(p.group, kNan);
  std::vector<float> o(out_elems, kNan), lse(p.group, kNan);
  AttendRowsRef(p, RowAttnItem{q.data(), o_ref.data(), lse_ref.data(), k_rows.data(),
                               v_rows.data(), count()});
  PositionAttnItem item{q.data(), o.data(), lse.data(), kv.kv, pos.data(), count()};
  kernels->attend_positions(p, item);
  ExpectNear(o, o_ref, 2e-5, "o");
  ExpectNear(lse, lse_ref, 2e-5 * (1.0 + std::abs(lse_ref[0])), "lse");
  EXPECT_GT(Norm(o), 1e-3);
}

TEST_P(CpuKernelTest, ScoresMatchReference) {
  KVF_REQUIRE_ISA(isa());
  const AttnParams p = Params();
  std::mt19937 rng(Seed() + 2);
  PagedKv kv(count() + 5, p.head_dim, p.kv_dtype, 16, rng);
  const std::vector<float> q = RandomQ(p.group, p.head_dim, 1.0f, rng);
  // Range [5, n): crosses page boundaries at odd offsets.
  const int64_t begin = 5, end = kv.n;
  const int32_t cnt = static_cast<int32_t>(end - begin);
  std::vector<const void*> k_rows;
  std::vector<int32_t> pos;
  for (int64_t j = begin; j < end; ++j) {
    k_rows.push_back(kv.K(j));
    pos.push_back(static_cast<int32_t>(j));
  }
  std::vector<float> want(static_cast<size_t>(p.group) * cnt, kNan);
  ScoreRowsRef(p, q.data(), k_rows.data(), cnt, want.data());
  std::vector<float> got(want.size(), kNan);
  kernels->score_range(p, q.data(), kv.kv, begin, end, got.data(), cnt);
  ExpectNear(got, want, 1e-4, "score_range");
  std::reverse(pos.begin(), pos.end());
  std::reverse(k_rows.begin(), k_rows.end());
  ScoreRowsRef(p, q.data(), k_rows.data(), cnt, want.data());
  std::fill(got.begin(), got.end(), kNan);
  kernels->score_positions(p, q.data(), kv.kv, pos.data(), cnt, got.data(), cnt);
  ExpectNear(got, want, 1e-4, "score_positions");
  EXPECT_GT(Norm(got), 1e-3);
  // A slice written into a longer list (row stride ld > count) leaves the rest untouched.
  const int64_t ld = cnt + 5;
  std::vector<float> strided(static_cast<size_t>(p.group) * ld, kNan);
  kernels->score_positions(p, q.data(), kv.kv, pos.data(), cnt, strided.data(), ld);
  for (int g = 0; g < p.group; ++g) {
    for (int64_t j = 0; j < ld; ++j) {
      const float x = strided[static_cast<size_t>(g * ld + j)];
      if (j < cnt) {
        EXPECT_NEAR(x, want[static_cast<size_t>(g * cnt + j)], 1e-4) << "g " << g << " j " << j;
      } else {
        EXPECT_TRUE(std::isnan(x)) << "strided score_positions wrote past count: g " << g;
      }
    }
  }
}

// The partial results merge exactly: attention over A then B, LSE-merged, equals attention over
// A u B (the CPU half and the GPU half of one decode step).
TEST_P(CpuKernelTest, SplitAndLseMergeEqualsWhole) {
  KVF_REQUIRE_ISA(isa());
  if (count() < 2) GTEST_SKIP() << "needs two non-empty halves";
  const AttnParams p = Params();
  std::mt19937 rng(Seed() + 3);
  PagedKv kv(count(), p.head_dim, p.kv_dtype, 64, rng);
  std::vector<int32_t> pos(static_cast<size_t>(count()));
  std::iota(pos.begin(), pos.end(), 0);
  std::shuffle(pos.begin(), pos.end(), rng);
  const std::vector<float> q = RandomQ(p.group, p.head_dim, 3.0f, rng);
  const size_t out_elems = static_cast<size_t>(p.group) * p.head_dim;
  std::vector<float> o_all(out_elems, kNan), lse_all(p.group, kNan);
  std::vector<float> o_a(out_elems, kNan), lse_a(p.group, kNan);
  std::vector<float> o_b(out_elems, kNan), lse_b(p.group, kNan);
  const int32_t half = count() / 2;
  kernels->attend_positions(p, {q.data(), o_all.data(), lse_all.data(), kv.kv, pos.data(),
                                count()});
  kernels->attend_positions(p, {q.data(), o_a.data(), lse_a.data(), kv.kv, pos.data(), half});
  kernels->attend_positions(p, {q.data(), o_b.data(), lse_b.data(), kv.kv, pos.data() + half,
                                count() - half});
  MergeLseRef(o_a.data(), lse_a.data(), o_b.data(), lse_b.data(), p.group, p.head_dim);
  ExpectNear(o_a, o_all, 2e-5, "merged o");
  ExpectNear(lse_a, lse_all, 2e-5 * (1.0 + std::abs(lse_all[0])), "merged lse");
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const auto [isa, dtype, hd, g, c] = info.param;
  return std::string(CpuIsaName(isa)) + "_" + DTypeName(dtype) + "_d" + std::to_string(hd) +
         "_g" + std::to_string(g) + "_n" + std::to_string(c);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuKernelTest,
    ::testing::Combine(::testing::ValuesIn(AllIsas()),
                       ::testing::Values(DType::kBF16, DType::kF16),
                       ::testing::Values(64, 128), ::testing::Values(1, 3, 4, 8),
                       ::testing::Values(1, 17, 97, 4099)),
    CaseName);

// Head dims that are not a multiple of 16 (or 32) take the masked tails of the AVX-512 code.
INSTANTIATE_TEST_SUITE_P(
    OddHeadDims, CpuKernelTest,
    ::testing::Combine(::testing::ValuesIn(AllIsas()),
                       ::testing::Values(DType::kBF16, DType::kF16), ::testing::Values(8, 72, 256),
                       ::testing::Values(1, 5, 16), ::testing::Values(33)),
    CaseName);

TEST(CpuKernelEdgeTest, EmptyListGivesZeroAndNegInf) {
  for (CpuIsa isa : AllIsas()) {
    const CpuKernels* kernels = GetCpuKernels(isa);
    if (kernels == nullptr) continue;
    AttnParams p;
    p.group = 3;
    p.head_dim = 64;
    p.scale = 0.125f;
    std::vector<float> q(3 * 64, 1.0f), o(3 * 64, kNan), lse(3, kNan);
    PositionAttnItem item{q.data(), o.data(), lse.data(), KvPages{}, nullptr, 0};
    kernels->attend_positions(p, item);
    for (float x : o) EXPECT_EQ(x, 0.0f) << kernels->name;
    for (float x : lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity()) << kernels->name;
  }
}

TEST(CpuKernelEdgeTest, FilterGreaterMatchesScalar) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  for (int n : {0, 1, 15, 16, 17, 100, 4099}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = dist(rng);
    if (n > 3) x[2] = kNan;
    std::vector<int32_t> want;
    for (int i = 0; i < n; ++i) {
      if (x[i] > 0.7f) want.push_back(100 + i);
    }
    for (CpuIsa isa : AllIsas()) {
      const CpuKernels* kernels = GetCpuKernels(isa);
      if (kernels == nullptr) continue;
      std::vector<int32_t> got(static_cast<size_t>(n) + 1, -1);
      got.resize(static_cast<size_t>(kernels->filter_greater(x.data(), n, 0.7f, 100, got.data())));
      EXPECT_EQ(got, want) << kernels->name << " n=" << n;
    }
  }
}

// The block-skipping filter must return exactly FilterGreater's hits for any valid (possibly
// loose) bounds, on every ISA, and leave identical bounds: exact maxima for the blocks it read in
// full, the given bound elsewhere.
TEST(CpuKernelEdgeTest, FilterGreaterBlockedEqualsFilterGreater) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::mt19937 rng(23);
  std::normal_distribution<float> dist;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int64_t size : {int64_t{1}, int64_t{17}, kFilterBlock, kFilterBlock + 1, int64_t{1000},
                       int64_t{4099}, 40 * kFilterBlock + 13}) {
    const int64_t blocks = (size + kFilterBlock - 1) / kFilterBlock;
    for (int rep = 0; rep < 12; ++rep) {
      std::vector<float> x(static_cast<size_t>(size));
      // Sparse large values on a low floor, as in the LFPS tables; rep 0 also has NaN and +-inf.
      for (float& v : x) v = unit(rng) < 0.05f ? 3.0f + dist(rng) : 0.1f * dist(rng);
      if (rep == 0 && size > 5) {
        x[1] = kNan;
        x[3] = kInf;
        x[4] = -kInf;
      }
      if (rep == 1 && size >= kFilterBlock) {  // one block all NaN, another all equal
        std::fill_n(x.begin(), kFilterBlock, kNan);
        if (size >= 2 * kFilterBlock) std::fill_n(x.begin() + kFilterBlock, kFilterBlock, 0.5f);
      }
      std::vector<float> bound(static_cast<size_t>(blocks), -kInf);
      for (int64_t i = 0; i < size; ++i) {
        if (x[i] > bound[i / kFilterBlock]) bound[i / kFilterBlock] = x[i];
      }
      for (float& b : bound) {  // some bounds loose (as after table updates), some exact
        if (unit(rng) < 0.5f) b += 2.0f * unit(rng);
      }
      const int64_t lo = std::uniform_int_distribution<int64_t>(0, size)(rng);
      const int64_t hi = std::uniform_int_distribution<int64_t>(lo, size)(rng);
      const float thr = rep == 2 ? 0.5f : (rep == 3 ? -kInf : (rep == 4 ? kNan : 0.2f + unit(rng)));
      std::vector<int32_t> want;
      for (int64_t i = lo; i < hi; ++i) {
        if (x[i] > thr) want.push_back(static_cast<int32_t>(i));
      }
      std::vector<float> want_bound = bound;
      for (int64_t b = lo / kFilterBlock; b * kFilterBlock < hi; ++b) {
        const int64_t b0 = b * kFilterBlock;
        if (!(bound[b] > thr) || b0 < lo || b0 + kFilterBlock > hi) continue;
        float mx = -kInf;
        for (int64_t i = b0; i < b0 + kFilterBlock; ++i) mx = x[i] > mx ? x[i] : mx;
        want_bound[b] = mx;
      }
      for (CpuIsa isa : AllIsas()) {
        const CpuKernels* kernels = GetCpuKernels(isa);
        if (kernels == nullptr) continue;
        std::vector<float> got_bound = bound;
        std::vector<int32_t> got(static_cast<size_t>(hi - lo) + 1, -1);
        got.resize(static_cast<size_t>(
            kernels->filter_greater_blocked(x.data(), got_bound.data(), lo, hi, thr, got.data())));
        EXPECT_EQ(got, want) << kernels->name << " size=" << size << " rep=" << rep << " [" << lo
                             << ", " << hi << ") thr=" << thr;
        for (int64_t b = 0; b < blocks; ++b) {
          // Bitwise equal (-inf for an all-NaN block, never NaN).
          ASSERT_EQ(std::memcmp(&got_bound[b], &want_bound[b], sizeof(float)), 0)
              << kernels->name << " size=" << size << " rep=" << rep << " block " << b << ": "
              << got_bound[b] << " vs " << want_bound[b];
        }
      }
    }
  }
}

TEST(CpuKernelEdgeTest, TopKEqualsReferenceWithTiesAndNan) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> coarse(0, 50);  // many ties
  for (int64_t n : {10, 1000, 5000, 70001}) {
    std::vector<float> s(static_cast<size_t>(n));
    for (float& v : s) v = static_cast<float>(coarse(rng));
    s[3] = kNan;
    s[5] = -std::numeric_limits<float>::infinity();
    for (int64_t k : {int64_t{1}, int64_t{7}, n / 50 + 1, n / 3, n}) {
      std::vector<int32_t> want(static_cast<size_t>(k)), got(static_cast<size_t>(k), -1);
      TopKRef(s.data(), n, k, want.data());
      TopK(s.data(), n, k, got.data());
      EXPECT_EQ(got, want) << "n=" << n << " k=" << k;
    }
  }
}

TEST(CpuDispatchTest, PicksTheBestSupportedIsa) {
  const CpuFeatures& f = DetectCpuFeatures();
  EXPECT_EQ(CpuSupports(CpuIsa::kAvx2), f.avx2 && f.fma && f.f16c && f.os_avx);
  EXPECT_EQ(CpuSupports(CpuIsa::kAvx2), __builtin_cpu_supports("avx2") &&
                                            __builtin_cpu_supports("fma"));
  if (CpuSupports(CpuIsa::kAvx512F)) EXPECT_TRUE(__builtin_cpu_supports("avx512f"));
  EXPECT_STREQ(AttendRowsImplName(), CpuIsaName(BestCpuIsa()));
  EXPECT_TRUE(CpuSupports(BestCpuIsa()));
  ::testing::Test::RecordProperty("cpu_isa", AttendRowsImplName());
}

// ---- dense paged attention -----------------------------------------------------------------------
using DenseCase = std::tuple<DType, int /*group*/, int /*num_q*/, int64_t /*q_pos0*/>;

class CpuDenseTest : public ::testing::TestWithParam<DenseCase> {};

void RunDense(DenseImpl impl, const DenseCase& c, double tol) {
  const auto [dtype, group, num_q, q_pos0] = c;
  AttnParams p;
  p.kv_dtype = dtype;
  p.head_dim = 128;
  p.group = group;
  p.scale = 1.0f / std::sqrt(128.0f);
  std::mt19937 rng(static_cast<uint32_t>(group * 131 + num_q * 7 + q_pos0));
  PagedKv kv(q_pos0 + num_q, p.head_dim, dtype, 64, rng);
  const std::vector<float> q = RandomQ(group * num_q, p.head_dim, 2.0f, rng);
  const size_t rows = static_cast<size_t>(group) * num_q;
  std::vector<float> o_ref(rows * p.head_dim, kNan), lse_ref(rows, kNan);
  std::vector<float> o(rows * p.head_dim, kNan), lse(rows, kNan);
  PagedAttnItem item{q.data(), o_ref.data(), lse_ref.data(), kv.kv, q_pos0, num_q};
  AttendPagedRef(p, item);
  item.o = o.data();
  item.lse = lse.data();
  if (!AttendPagedWith(impl, p, item)) {
    GTEST_SKIP() << "oneDNN has no " << DTypeName(dtype) << " matmul on this CPU";
  }
  ExpectNear(o, o_ref, tol, "o");
  ExpectNear(lse, lse_ref, tol * 10, "lse");
  EXPECT_GT(Norm(o), 1e-3);
}

TEST_P(CpuDenseTest, SimdEqualsReference) {
  if (std::get<0>(GetParam()) == DType::kF32) GTEST_SKIP() << "KV is bf16 or f16 in kvferry";
  RunDense(DenseImpl::kSimd, GetParam(), 2e-5);
}

// oneDNN rounds q and the softmax weights to the KV dtype: bf16 keeps 8 mantissa bits. (f32 KV
// runs the same code with f32 matmuls, so the page loop, causal mask and online softmax are checked
// on CPUs where oneDNN has no bf16 matmul.)
TEST_P(CpuDenseTest, OneDnnEqualsReferenceToDtypePrecision) {
  const DType dt = std::get<0>(GetParam());
  const double tol = dt == DType::kBF16 ? 3e-2 : (dt == DType::kF16 ? 4e-3 : 1e-4);
  RunDense(DenseImpl::kOneDnn, GetParam(), tol);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuDenseTest,
                         ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16,
                                                             DType::kF32),
                                            ::testing::Values(1, 4),
                                            ::testing::Values(1, 37),
                                            ::testing::Values(int64_t{0}, int64_t{200})));

}  // namespace
}  // namespace kvferry::cpu
