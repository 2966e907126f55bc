// Copyright kvferry authors. Apache-2.0.
// The llama engine's GPU matrix products (cuBLAS) against oneDNN, and a real model's logits with
// them. Skips where there is no GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "examples/llama/engine.h"
#include "examples/llama/matmul.h"
#include "examples/llama/model.h"
#include "gpu/device.h"

namespace kvferry::llama {
namespace {

TEST(LlamaGpuMatmul, CublasEqualsOneDnn) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  Matmul cpu, gpu;
  ASSERT_TRUE(gpu.EnableCuda(0).ok());
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  // Every matrix stays alive: the GPU side caches device copies by host address, as the engine's
  // weights do (a freed matrix's address may be reused by the next allocation).
  std::vector<Matrix> keep;
  keep.reserve(3);
  for (auto [m, k, n] : {std::tuple{1, 576, 1536}, std::tuple{17, 64, 97}, std::tuple{512, 576, 192}}) {
    Matrix& w = keep.emplace_back();
    w.rows = n;
    w.cols = k;
    w.data.resize(static_cast<size_t>(n) * k);
    for (float& x : w.data) x = normal(rng);
    std::vector<float> x(static_cast<size_t>(m) * k), y0(static_cast<size_t>(m) * n),
        y1(y0.size(), NAN);
    for (float& v : x) v = normal(rng);
    ASSERT_TRUE(cpu.Run(x.data(), m, w, y0.data()).ok());
    ASSERT_TRUE(gpu.Run(x.data(), m, w, y1.data()).ok());
    double num = 0, den = 0;
    for (size_t i = 0; i < y0.size(); ++i) {
      num += (y1[i] - y0[i]) * (y1[i] - y0[i]);
      den += y0[i] * y0[i];
    }
    EXPECT_GT(den, 0.0);
    EXPECT_LT(std::sqrt(num / den), 1e-5) << m << "x" << k << "x" << n;
  }
}

}  // namespace
}  // namespace kvferry::llama
