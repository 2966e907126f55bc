// Copyright kvferry authors. Apache-2.0.
// The host prefill path (AttendPagedDense: oneDNN matmuls over multi-page key blocks, the kernel
// table's vectorised online softmax and dtype conversion) against the scalar reference, with every
// kernel table this CPU has: fresh random bf16/fp16 KV, odd context lengths (1, 17, 97, 4099),
// GQA ratios 1/3/4, head_dim 64 and 128, prompts cut into chunks at odd boundaries. Outputs are
// poisoned with NaN first; every comparison also checks a non-zero norm.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::vector<const CpuKernels*> SupportedTables() {
  std::vector<const CpuKernels*> out;
  for (int i = 0; i < kNumCpuIsas; ++i) {
    if (const CpuKernels* k = GetCpuKernels(static_cast<CpuIsa>(i)); k != nullptr) out.push_back(k);
  }
  return out;
}

// A paged KV head of random N(0, 1) rows in the host store's layout (attn_types.h).
struct PagedKv {
  std::vector<std::vector<uint16_t>> storage;
  std::vector<void*> pages;
  KvPages kv;

  PagedKv(int64_t n, int hd, DType dt, int page_tokens, std::mt19937& rng) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    const int64_t num_pages = (n + page_tokens - 1) / page_tokens;
    storage.resize(static_cast<size_t>(num_pages));
    for (auto& page : storage) {
      const size_t elems = static_cast<size_t>(2) * page_tokens * hd;
      page.resize(elems);
      for (size_t i = 0; i < elems; ++i) StoreFromF32(page.data(), dt, static_cast<int64_t>(i), dist(rng));
      pages.push_back(page.data());
    }
    kv.pages = pages.data();
    kv.page_tokens = page_tokens;
  }
};

double Norm(const std::vector<float>& x) {
  double s = 0.0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}

// |got - want| <= tol (both -inf allowed); prints the first mismatches.
void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, double tol,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_inf = std::isinf(want[i]) && got[i] == want[i];
    if (!both_inf && !(std::abs(static_cast<double>(got[i]) - want[i]) <= tol)) {
      if (bad++ < 5) ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " outside " << tol;
}

// ---- the dense path end to end --------------------------------------------------------------------
using DenseCase = std::tuple<DType, int /*group*/, int /*head_dim*/, int64_t /*context*/>;

class CpuPrefillDenseTest : public ::testing::TestWithParam<DenseCase> {};

// The prompt [0, context) is attended chunk by chunk, as Runtime::Prefill hands it over: chunks of
// 37 tokens (boundaries inside pages and key blocks) for short prompts; for 4099 tokens, two
// chunks (one across the 2048 mark, one that ends the prompt) so the reference stays cheap. Pages
// of 48 tokens (not a power of two, so key blocks start mid-page) for head_dim 64, the store's 256
// for head_dim 128.
TEST_P(CpuPrefillDenseTest, EqualsReferenceToDtypePrecision) {
  const auto [dtype, group, head_dim, context] = GetParam();
  AttnParams p;
  p.kv_dtype = dtype;
  p.head_dim = head_dim;
  p.group = group;
  p.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::mt19937 rng(static_cast<uint32_t>(7919 * group + 131 * head_dim + context) +
                   (dtype == DType::kF16 ? 1000003u : 0u));
  const int page_tokens = head_dim == 64 ? 48 : 256;
  PagedKv kv(context, head_dim, dtype, page_tokens, rng);
  std::vector<std::pair<int64_t, int32_t>> chunks;  // (q_pos0, num_q)
  if (context <= 97) {
    for (int64_t c0 = 0; c0 < context; c0 += 37) {
      chunks.emplace_back(c0, static_cast<int32_t>(std::min<int64_t>(37, context - c0)));
    }
  } else {
    chunks.emplace_back(2011, 75);
    chunks.emplace_back(context - 61, 61);
  }
  // The q spread of real prompts (logits of several units) and the dtype's rounding of q and P.
  const double tol = dtype == DType::kBF16 ? 3e-2 : 4e-3;
  std::normal_distribution<float> qdist(0.0f, 2.0f);
  for (const CpuKernels* k : SupportedTables()) {
    for (const auto& [q_pos0, num_q] : chunks) {
      const size_t rows = static_cast<size_t>(num_q) * group;
      std::vector<float> q(rows * head_dim);
      for (float& x : q) x = qdist(rng);
      std::vector<float> o_ref(rows * head_dim, kNan), lse_ref(rows, kNan);
      std::vector<float> o(rows * head_dim, kNan), lse(rows, kNan);
      PagedAttnItem item{q.data(), o_ref.data(), lse_ref.data(), kv.kv, q_pos0, num_q};
      AttendPagedRef(p, item);
      item.o = o.data();
      item.lse = lse.data();
      ASSERT_TRUE(AttendPagedDense(*k, p, item)) << "no oneDNN matmul for " << DTypeName(dtype);
      const std::string what = std::string(k->name) + " chunk [" + std::to_string(q_pos0) + ", " +
                               std::to_string(q_pos0 + num_q) + ")";
      ExpectNear(o, o_ref, tol, what + " o");
      ExpectNear(lse, lse_ref, tol * 10, what + " lse");
      EXPECT_GT(Norm(o), 1e-3) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuPrefillDenseTest,
                         ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16),
                                            ::testing::Values(1, 3, 4), ::testing::Values(64, 128),
                                            ::testing::Values(int64_t{1}, int64_t{17},
                                                              int64_t{97}, int64_t{4099})));

// The runtime's unit split gives every query exactly one block and keeps the blocks large where
// there is enough work for the threads.
TEST(CpuPrefillTest, QueryBlockKeepsThreadsBusy) {
  EXPECT_EQ(PrefillQueryBlock(2048, 8, 2), 64);
  EXPECT_EQ(PrefillQueryBlock(2048, 8, 16), 64);
  EXPECT_EQ(PrefillQueryBlock(512, 3, 16), 16);  // 96 units rather than 24
  EXPECT_EQ(PrefillQueryBlock(1, 1, 64), 16);
  for (int threads : {1, 2, 16, 128}) {
    for (int64_t tokens : {1, 17, 512, 8192}) {
      const int64_t b = PrefillQueryBlock(tokens, 3, threads);
      EXPECT_TRUE(b == 16 || b == 32 || b == 64) << b;
    }
  }
}

// ---- the softmax step, table by table against the scalar one --------------------------------------
// Random blocks with odd row and column counts, rows entering with and without state (finite
// running max below and above the block's, -inf), allowed counts 0, 1, partial and full, weights
// in f32, bf16 and f16. Weights, running max and sum, and the rescaled accumulator must match.
TEST(CpuPrefillTest, SoftmaxStepEqualsScalar) {
  std::mt19937 rng(97);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const CpuKernels& ref = ScalarKernels();
  for (DType pt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t cols : {1, 7, 17, 64, 97, 512}) {
      const int64_t rows = 13;
      const int hd = 24;
      const size_t elem = DTypeSize(pt);
      std::vector<float> s(static_cast<size_t>(rows * cols));
      for (float& x : s) x = dist(rng);
      std::vector<int32_t> allowed(static_cast<size_t>(rows));
      std::vector<float> max0(static_cast<size_t>(rows));
      std::vector<double> sum0(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t choice[] = {0, 1, cols / 2, cols, cols - 1, cols + 5};
        allowed[r] = static_cast<int32_t>(choice[r % 6]);
        max0[r] = r % 3 == 0 ? kNegInf : (r % 3 == 1 ? -5.0f : 12.0f);
        sum0[r] = max0[r] == kNegInf ? 0.0 : 3.5;
      }
      std::vector<float> o0(static_cast<size_t>(rows * hd));
      for (float& x : o0) x = dist(rng);
      auto run = [&](const CpuKernels& k, std::vector<char>& p, std::vector<float>& mx,
                     std::vector<double>& sum, std::vector<float>& o) {
        p.assign(static_cast<size_t>(rows * cols) * elem, static_cast<char>(0xff));  // NaN
        mx = max0;
        sum = sum0;
        o = o0;
        PrefillSoftmaxArgs a;
        a.s = s.data();
        a.ld_s = cols;
        a.p = p.data();
        a.ld_p = cols;
        a.p_dtype = pt;
        a.rows = rows;
        a.cols = cols;
        a.allowed = allowed.data();
        a.scale = 0.37f;
        a.row_max = mx.data();
        a.row_sum = sum.data();
        a.o = o.data();
        a.ld_o = hd;
        a.head_dim = hd;
        k.prefill_softmax(a);
      };
      std::vector<char> p_ref;
      std::vector<float> mx_ref, o_ref;
      std::vector<double> sum_ref;
      run(ref, p_ref, mx_ref, sum_ref, o_ref);
      for (const CpuKernels* k : SupportedTables()) {
        std::vector<char> p_got;
        std::vector<float> mx_got, o_got;
        std::vector<double> sum_got;
        run(*k, p_got, mx_got, sum_got, o_got);
        const std::string what = std::string(k->name) + " " + DTypeName(pt) + " cols=" +
                                 std::to_string(cols);
        std::vector<float> w_got(static_cast<size_t>(rows * cols)), w_ref(w_got.size());
        for (size_t i = 0; i < w_got.size(); ++i) {
          w_got[i] = LoadAsF32(p_got.data(), pt, static_cast<int64_t>(i));
          w_ref[i] = LoadAsF32(p_ref.data(), pt, static_cast<int64_t>(i));
        }
        // exp to ~1e-7 relative; the rounding to bf16 / f16 may then land one step apart.
        ExpectNear(w_got, w_ref, pt == DType::kBF16 ? 8e-3 : (pt == DType::kF16 ? 1e-3 : 1e-6),
                   what + " weights");
        EXPECT_GT(Norm(w_got), 0.5) << what;
        ExpectNear(mx_got, mx_ref, 0.0, what + " row_max");
        for (int64_t r = 0; r < rows; ++r) {
          EXPECT_NEAR(sum_got[r], sum_ref[r], 1e-5 * std::max(1.0, sum_ref[r]) +
                                                  (pt == DType::kF32 ? 0.0 : 4e-3 * cols))
              << what << " row_sum[" << r << "]";
        }
        ExpectNear(o_got, o_ref, 1e-5, what + " o");
      }
    }
  }
}

// ---- conversion, bit for bit ----------------------------------------------------------------------
// Normal, subnormal (in f32, bf16 and f16), halfway and overflowing values and infinities: every
// table's convert equals ConvertSpan exactly (NaN payloads are not part of the contract).
TEST(CpuPrefillTest, ConvertEqualsConvertSpanBitForBit) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t n : {1, 17, 97, 4099}) {
    std::vector<float> src(static_cast<size_t>(n));
    for (size_t i = 0; i < src.size(); ++i) {
      switch (i % 6) {
        case 0: src[i] = dist(rng); break;
        case 1: src[i] = dist(rng) * 1e-6f; break;    // f16 subnormal range
        case 2: src[i] = dist(rng) * 1e-39f; break;   // f32 subnormal
        case 3: src[i] = dist(rng) * 70000.0f; break;  // f16 overflow
        case 4: {  // arbitrary finite bit patterns, halfway cases included
          uint32_t b = bits(rng);
          if ((b & 0x7f800000u) == 0x7f800000u) b &= 0xbfffffffu;
          std::memcpy(&src[i], &b, 4);
          break;
        }
        default: src[i] = (i / 6) % 2 ? std::numeric_limits<float>::infinity() : -1.5f; break;
      }
    }
    const DType all[] = {DType::kF32, DType::kBF16, DType::kF16};
    for (DType from : all) {
      std::vector<uint8_t> in(static_cast<size_t>(n) * DTypeSize(from));
      ConvertSpan(in.data(), from, src.data(), DType::kF32, n);
      for (DType to : all) {
        std::vector<uint8_t> want(static_cast<size_t>(n) * DTypeSize(to), 0xab);
        ConvertSpan(want.data(), to, in.data(), from, n);
        for (const CpuKernels* k : SupportedTables()) {
          std::vector<uint8_t> got(want.size() + 8, 0xcd);
          k->convert(got.data(), to, in.data(), from, n);
          int bad = 0;
          for (size_t i = 0; i < want.size(); ++i) {
            if (got[i] != want[i] && bad++ < 3) {
              ADD_FAILURE() << k->name << " " << DTypeName(from) << "->" << DTypeName(to)
                            << " n=" << n << " byte " << i;
            }
          }
          EXPECT_EQ(bad, 0);
          for (size_t i = want.size(); i < got.size(); ++i) {
            EXPECT_EQ(got[i], 0xcd) << k->name << " wrote past the end, n=" << n;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvferry::cpu
