// Copyright kvferry authors. Apache-2.0.
// The smallest complete use of kvferry: create a runtime, add a sequence, prefill a prompt for
// every layer, decode a few steps with random projections, print the stats. Takes no flags
// but --help (tools/common/args.h: anything else is a usage error, exit 2).
#include <cstdio>
#include <random>
#include <vector>

#include "kvferry/kvferry.h"
#include "tools/common/args.h"

int main(int argc, char** argv) {
  kvferry::tools::ArgParser args(
      "kvferry-embed",
      "\nThe smallest complete use of kvferry: a runtime (backend auto: CUDA when a GPU is "
      "there),\none sequence, a 1000-token prompt prefilled into 2 layers, 8 decode steps; "
      "prints the stats.\n");
  if (const int rc = args.ParseAndReport(argc, argv); rc >= 0) return rc;

  kvferry::RuntimeConfig config;
  config.model = {.num_layers = 2, .num_q_heads = 8, .num_kv_heads = 2, .head_dim = 64,
                  .kv_dtype = kvferry::DType::kBF16};
  config.capacity.max_sequences = 1;
  config.capacity.max_batch = 1;
  config.capacity.max_tokens_per_sequence = 4096;
  config.capacity.max_prefill_chunk = 1024;
  config.tiers.sink_tokens = 4;
  config.tiers.window_tokens = 64;
  config.policy.name = "oracle";
  config.policy.budget_tokens = 128;
  config.backend = kvferry::Backend::kAuto;

  auto created = kvferry::Runtime::Create(config);
  if (!created.ok()) {
    std::fprintf(stderr, "Create: %s\n", created.status().ToString().c_str());
    return 1;
  }
  kvferry::Runtime& rt = **created;
  const kvferry::SequenceId seq = 42;
  if (auto s = rt.AddSequence(seq); !s.ok()) {
    std::fprintf(stderr, "AddSequence: %s\n", s.ToString().c_str());
    return 1;
  }

  const int hq = config.model.num_q_heads, hkv = config.model.num_kv_heads;
  const int d = config.model.head_dim;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  auto random_tensor = [&](int64_t rows, int heads, std::vector<float>& buf) {
    buf.resize(static_cast<size_t>(rows * heads * d));
    for (float& x : buf) x = normal(rng);
    return kvferry::TensorView::Contiguous(buf.data(), kvferry::DType::kF32,
                                           kvferry::MemoryKind::kHost, {rows, heads, d});
  };

  std::vector<float> q, k, v, out;
  const int64_t prompt = 1000;
  for (int layer = 0; layer < config.model.num_layers; ++layer) {
    auto tq = random_tensor(prompt, hq, q), tk = random_tensor(prompt, hkv, k);
    auto tv = random_tensor(prompt, hkv, v), to = random_tensor(prompt, hq, out);
    if (auto s = rt.Prefill(seq, layer, tq, tk, tv, to); !s.ok()) {
      std::fprintf(stderr, "Prefill: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  for (int step = 0; step < 8; ++step) {
    for (int layer = 0; layer < config.model.num_layers; ++layer) {
      auto tq = random_tensor(1, hq, q), tk = random_tensor(1, hkv, k);
      auto tv = random_tensor(1, hkv, v), to = random_tensor(1, hq, out);
      if (auto s = rt.Decode({&seq, 1}, layer, tq, tk, tv, to); !s.ok()) {
        std::fprintf(stderr, "Decode: %s\n", s.ToString().c_str());
        return 1;
      }
    }
  }
  std::printf("backend %s, policy %s, out[0] = %.4f\n", kvferry::BackendName(rt.backend()),
              config.policy.name.c_str(), out[0]);
  std::printf("%s\n", rt.GetStats().ToJson().c_str());
  return 0;
}
