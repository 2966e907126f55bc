// Copyright kvferry authors. Apache-2.0.
// The scalar references themselves: dtype round trips, LSE merge exactness, top-k ordering.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/reference.h"

namespace kvferry::cpu {
namespace {

TEST(Dtype, RoundTripsAndRounding) {
  for (float x : {0.0f, 1.0f, -2.5f, 3.14159f, 65504.0f, 1e-6f, -1e-8f}) {
    EXPECT_NEAR(Bf16ToF32(F32ToBf16(x)), x, std::fabs(x) * 4e-3 + 1e-40);
    EXPECT_NEAR(F16ToF32(F32ToF16(x)), x, std::fabs(x) * 1e-3 + 6e-8);
  }
  EXPECT_TRUE(std::isinf(F16ToF32(F32ToF16(1e6f))));
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(NAN))));
  // Exhaustive f16 -> f32 -> f16 identity on finite values.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (((h >> 10) & 0x1f) == 0x1f) continue;
    ASSERT_EQ(F32ToF16(F16ToF32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(MergeLse, SplitEqualsWhole) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const int d = 64, n = 97;
  for (int split : {0, 1, 50, 97}) {
    std::vector<uint16_t> k(n * d), v(n * d);
    for (auto& x : k) x = F32ToBf16(normal(rng));
    for (auto& x : v) x = F32ToBf16(normal(rng));
    std::vector<float> q(d);
    for (float& x : q) x = normal(rng);
    std::vector<const void*> kr(n), vr(n);
    for (int j = 0; j < n; ++j) { kr[j] = &k[j * d]; vr[j] = &v[j * d]; }
    AttnParams p{1, d, DType::kBF16, 0.125f};
    std::vector<float> o_all(d), o_a(d), o_b(d);
    float lse_all, lse_a, lse_b;
    AttendRowsRef(p, {q.data(), o_all.data(), &lse_all, kr.data(), vr.data(), n});
    AttendRowsRef(p, {q.data(), o_a.data(), &lse_a, kr.data(), vr.data(), split});
    AttendRowsRef(p, {q.data(), o_b.data(), &lse_b, kr.data() + split, vr.data() + split, n - split});
    MergeLseRef(o_a.data(), &lse_a, o_b.data(), &lse_b, 1, d);
    EXPECT_NEAR(lse_a, lse_all, 1e-5);
    for (int e = 0; e < d; ++e) EXPECT_NEAR(o_a[e], o_all[e], 1e-5) << split;
  }
}

TEST(TopK, OrderAndTies) {
  std::vector<float> s = {1, 5, 5, NAN, 3, 5, -1};
  std::vector<int32_t> idx(4);
  TopKRef(s.data(), 7, 4, idx.data());
  EXPECT_EQ(idx, (std::vector<int32_t>{1, 2, 5, 4}));
  idx.resize(7);
  TopKRef(s.data(), 7, 10, idx.data());
  EXPECT_EQ(idx.back(), 3);  // NaN ranks last
}

}  // namespace
}  // namespace kvferry::cpu
