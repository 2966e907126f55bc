// Copyright kvferry authors. Apache-2.0.
// A selection policy written outside the library (kvferry/policy.h only) and run through the
// Runtime: "keynorm" attends the resident sinks and window plus, of the offloaded positions
// between them, the ones whose keys have the largest L2 norm. The program registers it by name,
// prefills a random prompt, decodes a few steps, and checks every output against attention over
// the set it computes by hand (fp64, from the rows as stored in bf16): prints the largest absolute
// error and exits 1 above 1e-4. Backend auto: CUDA when a GPU is there, else the host backend.
// Takes no flags but --help.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/kvferry.h"
#include "kvferry/policy.h"
#include "tools/common/args.h"

namespace {

// ---- The policy: everything a host policy needs is in kvferry/policy.h -----------------------

class KeyNormPolicy final : public kvferry::Policy {
 public:
  std::string_view name() const override { return "keynorm"; }
  kvferry::Placement placement() const override { return kvferry::Placement::kGpu; }
  bool selection_covers_resident() const override { return true; }

  kvferry::Status Select(const kvferry::SelectContext& ctx, std::vector<int32_t>& out) override {
    // Resident: sinks [0, sink) and window [off_hi, n); offloaded: [sink, off_hi).
    const int64_t n = ctx.n;
    const int64_t sink = std::clamp<int64_t>(ctx.sink, 0, n);
    const int64_t off_hi = std::max(sink, n - ctx.window);
    const int64_t k_off = ctx.budget - (sink + (n - off_hi));  // offloaded picks the budget leaves
    out.clear();
    if (k_off >= off_hi - sink) {  // the budget covers everything: dense
      for (int64_t i = 0; i < n; ++i) out.push_back(static_cast<int32_t>(i));
      return kvferry::Status::Ok();
    }
    // Calls for different heads run concurrently: per-thread scratch.
    thread_local std::vector<float> row, norm;
    thread_local std::vector<int32_t> order;
    row.resize(static_cast<size_t>(ctx.params.head_dim));
    norm.resize(static_cast<size_t>(off_hi - sink));
    for (int64_t j = sink; j < off_hi; ++j) {
      kvferry::LoadKvRowF32(ctx.kv, ctx.params, j, /*value=*/false, row.data());
      double s = 0;
      for (float x : row) s += static_cast<double>(x) * x;
      norm[j - sink] = static_cast<float>(s);
    }
    for (int64_t i = 0; i < sink; ++i) out.push_back(static_cast<int32_t>(i));
    if (k_off > 0) {
      order.resize(norm.size());
      std::iota(order.begin(), order.end(), 0);
      // The k_off largest norms (ties: lower position), then ascending.
      std::partial_sort(order.begin(), order.begin() + k_off, order.end(), [](int32_t a, int32_t b) {
        return norm[a] > norm[b] || (norm[a] == norm[b] && a < b);
      });
      std::sort(order.begin(), order.begin() + k_off);
      for (int64_t i = 0; i < k_off; ++i) out.push_back(static_cast<int32_t>(sink + order[i]));
    }
    for (int64_t i = off_hi; i < n; ++i) out.push_back(static_cast<int32_t>(i));
    return kvferry::Status::Ok();
  }
};

kvferry::Result<std::unique_ptr<kvferry::Policy>> MakeKeyNorm(const kvferry::RuntimeConfig& c) {
  if (!c.policy.params.empty()) {
    return kvferry::InvalidArgument("policy 'keynorm' takes no parameters, got '" +
                                    c.policy.params.begin()->first + "'");
  }
  return std::unique_ptr<kvferry::Policy>(new KeyNormPolicy());
}

// ---- The check: attention over the hand-computed set, from the rows as stored -----------------

float RoundBf16(float f) {  // round to nearest even, as the store does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  kvferry::tools::ArgParser args(
      "kvferry-custom-policy",
      "\nRegisters the policy 'keynorm' (the offloaded positions whose keys have the largest L2\n"
      "norm) from outside the library, decodes through the Runtime (backend auto: CUDA when a\n"
      "GPU is there) and checks every output against attention over the set computed by hand;\n"
      "exit 1 when the largest error is above 1e-4 or a selection differs.\n");
  if (const int rc = args.ParseAndReport(argc, argv); rc >= 0) return rc;
  if (!kvferry::RegisterPolicy("keynorm", MakeKeyNorm)) {
    std::fprintf(stderr, "RegisterPolicy: 'keynorm' was refused\n");
    return 1;
  }

  kvferry::RuntimeConfig config;
  config.model = {.num_layers = 2, .num_q_heads = 8, .num_kv_heads = 2, .head_dim = 64,
                  .kv_dtype = kvferry::DType::kBF16};
  config.capacity.max_sequences = 1;
  config.capacity.max_batch = 1;
  config.capacity.max_tokens_per_sequence = 2048;
  config.capacity.max_prefill_chunk = 1024;
  config.tiers.sink_tokens = 4;
  config.tiers.window_tokens = 32;
  config.policy.name = "keynorm";
  config.policy.budget_tokens = 100;  // 4 sinks + 32 window + 64 picks
  config.route = kvferry::Route::kGpu;
  config.backend = kvferry::Backend::kAuto;
  auto created = kvferry::Runtime::Create(config);
  if (!created.ok()) {
    std::fprintf(stderr, "Create: %s\n", created.status().ToString().c_str());
    return 1;
  }
  kvferry::Runtime& rt = **created;
  const kvferry::SequenceId seq = 7;
  if (auto s = rt.AddSequence(seq); !s.ok()) {
    std::fprintf(stderr, "AddSequence: %s\n", s.ToString().c_str());
    return 1;
  }

  const int layers = config.model.num_layers, hq = config.model.num_q_heads;
  const int hkv = config.model.num_kv_heads, d = config.model.head_dim, group = hq / hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const int64_t sink = config.tiers.sink_tokens, window = config.tiers.window_tokens;
  const int64_t budget = config.policy.budget_tokens;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  auto random = [&](int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = normal(rng);
    return x;
  };
  auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
    return kvferry::TensorView::Contiguous(x.data(), kvferry::DType::kF32,
                                           kvferry::MemoryKind::kHost, {rows, heads, d});
  };
  // What the runtime stores, per layer: [position][kv head][d], rounded to bf16.
  std::vector<std::vector<float>> keys(layers), values(layers);
  auto keep = [&](int layer, const std::vector<float>& k, const std::vector<float>& v) {
    for (float x : k) keys[layer].push_back(RoundBf16(x));
    for (float x : v) values[layer].push_back(RoundBf16(x));
  };

  const int64_t prompt = 700;
  for (int layer = 0; layer < layers; ++layer) {
    auto q = random(prompt * hq * d), k = random(prompt * hkv * d), v = random(prompt * hkv * d);
    // Keys of very different lengths, so that the picks are far from the recent ones.
    for (int64_t t = 0; t < prompt; ++t) {
      const float f = 0.5f + static_cast<float>((t * 37) % 101) / 50.0f;
      for (int64_t i = 0; i < hkv * d; ++i) k[t * hkv * d + i] *= f;
    }
    std::vector<float> o(q.size());
    if (auto s = rt.Prefill(seq, layer, view(q, prompt, hq), view(k, prompt, hkv),
                            view(v, prompt, hkv), view(o, prompt, hq));
        !s.ok()) {
      std::fprintf(stderr, "Prefill: %s\n", s.ToString().c_str());
      return 1;
    }
    keep(layer, k, v);
  }

  double worst = 0;
  int64_t selection_mismatches = 0;
  const int steps = 6;
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < layers; ++layer) {
      auto q = random(hq * d), k = random(hkv * d), v = random(hkv * d);
      std::vector<float> o(q.size(), NAN);
      const kvferry::SequenceId seqs[1] = {seq};
      if (auto s = rt.Decode(seqs, layer, view(q, 1, hq), view(k, 1, hkv), view(v, 1, hkv),
                             view(o, 1, hq));
          !s.ok()) {
        std::fprintf(stderr, "Decode: %s\n", s.ToString().c_str());
        return 1;
      }
      if (auto s = rt.Synchronize(); !s.ok()) {
        std::fprintf(stderr, "Synchronize: %s\n", s.ToString().c_str());
        return 1;
      }
      keep(layer, k, v);
      const int64_t n = prompt + step + 1;
      const std::vector<float>& K = keys[layer];
      const std::vector<float>& V = values[layer];
      for (int h = 0; h < hkv; ++h) {
        // The set by hand: sinks, the top (budget - resident) offloaded keys by norm, the window.
        const int64_t off_hi = n - window, k_off = budget - sink - window;
        std::vector<std::pair<double, int64_t>> by_norm;
        for (int64_t j = sink; j < off_hi; ++j) {
          double s = 0;
          for (int i = 0; i < d; ++i) s += double{K[(j * hkv + h) * d + i]} * K[(j * hkv + h) * d + i];
          by_norm.emplace_back(-s, j);
        }
        std::sort(by_norm.begin(), by_norm.end());
        std::vector<int32_t> set;
        for (int64_t j = 0; j < sink; ++j) set.push_back(static_cast<int32_t>(j));
        for (int64_t i = 0; i < k_off; ++i) set.push_back(static_cast<int32_t>(by_norm[i].second));
        for (int64_t j = off_hi; j < n; ++j) set.push_back(static_cast<int32_t>(j));
        std::sort(set.begin(), set.end());
        auto seen = rt.LastSelection(seq, layer, h);
        if (!seen.ok() || *seen != set) ++selection_mismatches;
        // Attention of each query head of the group over the set, in fp64.
        for (int g = 0; g < group; ++g) {
          const int qh = h * group + g;
          std::vector<double> logit(set.size());
          double mx = -INFINITY;
          for (size_t r = 0; r < set.size(); ++r) {
            double s = 0;
            for (int i = 0; i < d; ++i) s += double{q[qh * d + i]} * K[(set[r] * hkv + h) * d + i];
            logit[r] = s * scale;
            mx = std::max(mx, logit[r]);
          }
          double den = 0;
          std::vector<double> acc(d, 0.0);
          for (size_t r = 0; r < set.size(); ++r) {
            const double w = std::exp(logit[r] - mx);
            den += w;
            for (int i = 0; i < d; ++i) acc[i] += w * V[(set[r] * hkv + h) * d + i];
          }
          for (int i = 0; i < d; ++i) {
            worst = std::max(worst, std::abs(acc[i] / den - double{o[qh * d + i]}));
          }
        }
      }
    }
  }
  const bool cuda = rt.backend() == kvferry::Backend::kCuda;
  std::printf("keynorm on the %s backend: %d layers x %d decode steps over a %lld-token prompt, "
              "budget %lld (4 sinks + 32 window + 64 picks)\n",
              cuda ? "CUDA" : "host", layers, steps, static_cast<long long>(prompt),
              static_cast<long long>(budget));
  std::printf("selections that differ from the hand-computed set: %lld\n",
              static_cast<long long>(selection_mismatches));
  std::printf("max abs error vs attention over the hand-computed set: %.3g\n", worst);
  if (!(worst <= 1e-4) || selection_mismatches != 0) {
    std::fprintf(stderr, "FAIL: above 1e-4, or a selection differs\n");
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
