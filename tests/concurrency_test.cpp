// Copyright kvferry authors. Apache-2.0.
// Runtimes on several threads at once share the process's TBB workers, oneDNN's engine and the
// CPU kernels' thread-local buffers; each must give exactly what it gives alone. Part of the
// ThreadSanitizer stage's binary (tests/CMakeLists.txt, kvferry_tsan_tests), where this is where
// two pools' arenas, observers and parallel_for bodies run side by side.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvferry/kvferry.h"

namespace kvferry {
namespace {

struct Lane {
  std::string policy;
  Route route;
  uint32_t seed;
};

RuntimeConfig LaneConfig(const Lane& lane) {
  RuntimeConfig c;
  c.model.num_layers = 2;
  c.model.num_kv_heads = 2;
  c.model.num_q_heads = 8;
  c.model.head_dim = 64;
  c.model.kv_dtype = DType::kBF16;
  c.capacity.max_sequences = 3;
  c.capacity.max_batch = 3;
  c.capacity.max_tokens_per_sequence = 2048;
  c.capacity.max_prefill_chunk = 512;
  c.tiers.sink_tokens = 4;
  c.tiers.window_tokens = 32;
  c.policy.name = lane.policy;
  if (lane.policy != "dense") c.policy.budget_tokens = 96;
  c.route = lane.route;
  c.backend = Backend::kHost;
  c.cpu_threads = 2;
  c.probe_at_start = false;
  return c;
}

// Prefills three sequences of different lengths and decodes them as one batch; returns every
// output (prefill and decode, all layers) in order.
std::vector<float> RunLane(const Lane& lane) {
  const RuntimeConfig config = LaneConfig(lane);
  auto rt_or = Runtime::Create(config);
  EXPECT_TRUE(rt_or.ok()) << rt_or.status().ToString();
  if (!rt_or.ok()) return {};
  Runtime& rt = **rt_or;
  const int hq = config.model.num_q_heads, hkv = config.model.num_kv_heads;
  const int d = config.model.head_dim;
  std::mt19937 rng(lane.seed);
  std::normal_distribution<float> normal;
  auto random = [&](int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = normal(rng);
    return x;
  };
  auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, d});
  };
  std::vector<float> all;
  const std::vector<SequenceId> seqs = {11, 12, 13};
  const int64_t lengths[] = {300, 130, 520};
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_TRUE(rt.AddSequence(seqs[i]).ok());
    for (int layer = 0; layer < config.model.num_layers; ++layer) {
      for (int64_t t0 = 0; t0 < lengths[i]; t0 += config.capacity.max_prefill_chunk) {
        const int64_t t = std::min<int64_t>(config.capacity.max_prefill_chunk, lengths[i] - t0);
        auto q = random(t * hq * d), k = random(t * hkv * d), v = random(t * hkv * d);
        std::vector<float> out(q.size(), NAN);
        const Status st = rt.Prefill(seqs[i], layer, view(q, t, hq), view(k, t, hkv),
                                     view(v, t, hkv), view(out, t, hq));
        EXPECT_TRUE(st.ok()) << st.ToString();
        all.insert(all.end(), out.begin(), out.end());
      }
    }
  }
  const int64_t b = static_cast<int64_t>(seqs.size());
  for (int step = 0; step < 8; ++step) {
    for (int layer = 0; layer < config.model.num_layers; ++layer) {
      auto q = random(b * hq * d), k = random(b * hkv * d), v = random(b * hkv * d);
      std::vector<float> out(q.size(), NAN);
      const Status st = rt.Decode(seqs, layer, view(q, b, hq), view(k, b, hkv), view(v, b, hkv),
                                  view(out, b, hq));
      EXPECT_TRUE(st.ok()) << lane.policy << " step " << step << ": " << st.ToString();
      all.insert(all.end(), out.begin(), out.end());
    }
  }
  return all;
}

// Two runtimes (two pools, two arenas) decoding at once on two threads, with policies that select
// on the pool's threads (lfps, oracle) and the CPU route, equal each lane run alone, bit for bit.
TEST(Concurrency, RuntimesOnSeveralThreadsEqualEachAlone) {
  const std::vector<Lane> lanes = {{"lfps", Route::kCpu, 3}, {"oracle", Route::kAuto, 4},
                                   {"streaming", Route::kGpu, 5}, {"dense", Route::kCpu, 6}};
  std::vector<std::vector<float>> alone;
  for (const Lane& lane : lanes) alone.push_back(RunLane(lane));
  std::vector<std::vector<float>> together(lanes.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < lanes.size(); ++i) {
    threads.emplace_back([&, i] { together[i] = RunLane(lanes[i]); });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < lanes.size(); ++i) {
    ASSERT_EQ(alone[i].size(), together[i].size()) << lanes[i].policy;
    ASSERT_FALSE(alone[i].empty()) << lanes[i].policy;
    double norm = 0;
    for (float x : alone[i]) norm += std::abs(x);
    EXPECT_GT(norm, 1.0) << lanes[i].policy;
    EXPECT_EQ(0, std::memcmp(alone[i].data(), together[i].data(), alone[i].size() * sizeof(float)))
        << lanes[i].policy << ": outputs differ when another runtime runs beside it";
  }
}

}  // namespace
}  // namespace kvferry
