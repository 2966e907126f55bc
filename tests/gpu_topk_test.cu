// Copyright kvferry authors. Apache-2.0.
// CUDA-only kernel APIs against the scalar reference. Exact top-k against cpu::TopKRef: ties
// (quantised scores), NaN and -inf, odd sizes, the shared-memory (k <= 4096) and workspace sort
// paths, several rows per launch.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cpu/reference.h"
#include "gpu/cuda_device.h"
#include "gpu/cuda_kernels.h"
#include "gpu/device.h"

namespace kvferry {
namespace {

class GpuTopKTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, bool>> {};

TEST_P(GpuTopKTest, MatchesReferenceWithDeterministicTies) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU";
  const auto [n, k, ties] = GetParam();
  const int64_t rows = 3;
  std::mt19937 rng(static_cast<uint32_t>(n * 31 + k + ties));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> scores(rows * n);
  for (auto& x : scores) x = ties ? std::round(nd(rng) * 4.f) / 4.f : nd(rng);
  for (int64_t i = 0; i < rows * n; i += 13) scores[i] = std::numeric_limits<float>::quiet_NaN();
  for (int64_t i = 5; i < rows * n; i += 17) scores[i] = -std::numeric_limits<float>::infinity();
  const int64_t kk = std::min(k, n);
  float* d_scores = nullptr;
  int32_t* d_out = nullptr;
  void* ws = nullptr;
  const size_t ws_bytes = cuda::TopKWorkspaceBytes(rows, k);
  ASSERT_EQ(cudaMalloc(&d_scores, scores.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, rows * kk * 4 + 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&ws, ws_bytes + 16), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_scores, scores.data(), scores.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemset(d_out, 0xff, rows * kk * 4 + 4), cudaSuccess);  // poison
  const Status st = cuda::LaunchTopK(d_scores, n, n, rows, k, d_out, ws, ws_bytes, nullptr);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<int32_t> got(rows * kk);
  ASSERT_EQ(cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> want(kk);
    cpu::TopKRef(scores.data() + r * n, n, k, want.data());
    int bad = 0;
    for (int64_t i = 0; i < kk; ++i) {
      if (got[r * kk + i] != want[i] && bad++ < 5) {
        ADD_FAILURE() << "row " << r << " rank " << i << ": got " << got[r * kk + i] << " want "
                      << want[i];
      }
    }
    EXPECT_EQ(bad, 0);
  }
  cudaFree(d_scores);
  cudaFree(d_out);
  cudaFree(ws);
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuTopKTest,
                         ::testing::Combine(::testing::Values(1, 17, 97, 4099, 131072),
                                            ::testing::Values(1, 17, 1000, 5000),
                                            ::testing::Bool()));

}  // namespace
}  // namespace kvferry
