// Copyright kvferry authors. Apache-2.0.
// The decode step on CUDA equals the host-emulated backend: two Runtimes (Backend::kCuda and
// Backend::kHost) fed the same prefill and decode inputs produce the same outputs to fp32
// rounding, for several policies, both routes and with/without a token bank, and past the
// multi-CTA top-k threshold (CudaRuntimeLong). Skips without a GPU.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gpu/device.h"
#include "kvferry/runtime.h"

namespace kvferry {
namespace {

struct Case {
  std::string policy;
  Route route;
  int bank_slots;
  std::string bank_map;
  bool device_io = false;  // the CUDA runtime's decode q/k/v/out in device memory
};

class CudaRuntimeTest : public ::testing::TestWithParam<Case> {};

RuntimeConfig MakeConfig(const Case& c, Backend backend) {
  RuntimeConfig cfg;
  cfg.model.num_layers = 2;
  cfg.model.num_q_heads = 8;
  cfg.model.num_kv_heads = 2;
  cfg.model.head_dim = 64;
  cfg.model.kv_dtype = DType::kBF16;
  cfg.capacity.max_sequences = 2;
  cfg.capacity.max_tokens_per_sequence = 2048;
  cfg.capacity.max_batch = 2;
  cfg.capacity.max_prefill_chunk = 512;
  cfg.tiers.sink_tokens = 4;
  cfg.tiers.window_tokens = 32;
  cfg.tiers.bank_slots = c.bank_slots;
  cfg.tiers.bank_map = c.bank_map;
  cfg.policy.name = c.policy;
  cfg.policy.budget_tokens = 96;
  cfg.route = c.route;
  cfg.backend = backend;
  cfg.cpu_threads = 2;
  return cfg;
}

TEST_P(CudaRuntimeTest, CudaEqualsHost) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  const Case c = GetParam();
  std::unique_ptr<Runtime> rt[2];
  for (int b = 0; b < 2; ++b) {
    auto r = Runtime::Create(MakeConfig(c, b == 0 ? Backend::kCuda : Backend::kHost));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    rt[b] = std::move(r).value();
  }
  ASSERT_EQ(rt[0]->backend(), Backend::kCuda);
  ASSERT_EQ(rt[1]->backend(), Backend::kHost);
  const auto& m = rt[0]->config().model;
  const std::vector<SequenceId> seqs = {11, 12};
  for (int b = 0; b < 2; ++b) {
    for (SequenceId s : seqs) ASSERT_TRUE(rt[b]->AddSequence(s).ok());
  }
  std::mt19937 rng(2024);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto fill = [&](std::vector<float>& v) {
    for (auto& x : v) x = nd(rng);
  };
  const int64_t prompt = 300;
  // Prefill each sequence (one chunk per layer).
  for (SequenceId s : seqs) {
    for (int layer = 0; layer < m.num_layers; ++layer) {
      std::vector<float> q(prompt * m.num_q_heads * m.head_dim), k(prompt * m.num_kv_heads * m.head_dim),
          v(k.size());
      fill(q);
      fill(k);
      fill(v);
      std::vector<float> out[2];
      for (int b = 0; b < 2; ++b) {
        out[b].assign(q.size(), std::nanf(""));
        auto tv = [&](std::vector<float>& x, int heads) {
          return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost,
                                        {prompt, heads, m.head_dim});
        };
        const Status st = rt[b]->Prefill(s, layer, tv(q, m.num_q_heads), tv(k, m.num_kv_heads),
                                         tv(v, m.num_kv_heads), tv(out[b], m.num_q_heads));
        ASSERT_TRUE(st.ok()) << st.ToString();
        ASSERT_TRUE(rt[b]->Synchronize().ok());
      }
      double err = 0, norm = 0;
      for (size_t i = 0; i < q.size(); ++i) {
        err = std::max(err, static_cast<double>(std::abs(out[0][i] - out[1][i])));
        norm += out[1][i] * out[1][i];
      }
      // The host backend may run prefill through oneDNN with dtype-rounded operands.
      EXPECT_LT(err, 2e-2) << "prefill seq " << s << " layer " << layer;
      EXPECT_GT(norm, 0.0);
    }
  }
  // Decode steps, batch of both sequences.
  const int64_t batch = static_cast<int64_t>(seqs.size());
  // Device copies of the decode tensors, for the device_io cases.
  std::unique_ptr<Device> dev;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* dout = nullptr;
  const size_t q_bytes = static_cast<size_t>(batch * m.num_q_heads * m.head_dim) * 4;
  const size_t kv_bytes = static_cast<size_t>(batch * m.num_kv_heads * m.head_dim) * 4;
  if (c.device_io) {
    auto made = MakeCudaDevice(0);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    dev = std::move(made).value();
    for (auto [p, bytes] : {std::pair{&dq, q_bytes}, std::pair{&dk, kv_bytes},
                            std::pair{&dv, kv_bytes}, std::pair{&dout, q_bytes}}) {
      auto a = dev->AllocDevice(bytes);
      ASSERT_TRUE(a.ok());
      *p = a.value();
    }
  }
  for (int step = 0; step < 24; ++step) {
    for (int layer = 0; layer < m.num_layers; ++layer) {
      std::vector<float> q(batch * m.num_q_heads * m.head_dim), k(batch * m.num_kv_heads * m.head_dim),
          v(k.size());
      fill(q);
      fill(k);
      fill(v);
      std::vector<float> out[2];
      for (int b = 0; b < 2; ++b) {
        out[b].assign(q.size(), std::nanf(""));
        auto tv = [&](std::vector<float>& x, int heads) {
          return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost,
                                        {batch, heads, m.head_dim});
        };
        if (b == 0 && c.device_io) {
          auto dtv = [&](void* p, int heads) {
            return TensorView::Contiguous(p, DType::kF32, MemoryKind::kDevice,
                                          {batch, heads, m.head_dim});
          };
          ASSERT_TRUE(dev->CopyAsync(dq, q.data(), q_bytes, dev->default_stream()).ok());
          ASSERT_TRUE(dev->CopyAsync(dk, k.data(), kv_bytes, dev->default_stream()).ok());
          ASSERT_TRUE(dev->CopyAsync(dv, v.data(), kv_bytes, dev->default_stream()).ok());
          ASSERT_TRUE(dev->CopyAsync(dout, out[b].data(), q_bytes, dev->default_stream()).ok());
          ASSERT_TRUE(dev->SynchronizeStream(dev->default_stream()).ok());
          const Status st = rt[b]->Decode(seqs, layer, dtv(dq, m.num_q_heads), dtv(dk, m.num_kv_heads),
                                          dtv(dv, m.num_kv_heads), dtv(dout, m.num_q_heads));
          ASSERT_TRUE(st.ok()) << st.ToString();
          ASSERT_TRUE(rt[b]->Synchronize().ok());
          ASSERT_TRUE(dev->CopyAsync(out[b].data(), dout, q_bytes, dev->default_stream()).ok());
          ASSERT_TRUE(dev->SynchronizeStream(dev->default_stream()).ok());
          continue;
        }
        const Status st = rt[b]->Decode(seqs, layer, tv(q, m.num_q_heads), tv(k, m.num_kv_heads),
                                        tv(v, m.num_kv_heads), tv(out[b], m.num_q_heads));
        ASSERT_TRUE(st.ok()) << st.ToString();
        ASSERT_TRUE(rt[b]->Synchronize().ok());
      }
      double err = 0;
      for (size_t i = 0; i < q.size(); ++i) {
        ASSERT_FALSE(std::isnan(out[0][i])) << "unwritten output " << i;
        err = std::max(err, static_cast<double>(std::abs(out[0][i] - out[1][i])));
      }
      EXPECT_LT(err, 1e-4) << "decode step " << step << " layer " << layer;
      for (SequenceId s : seqs) {
        for (int h = 0; h < m.num_kv_heads; ++h) {
          auto a = rt[0]->LastSelection(s, layer, h);
          auto b = rt[1]->LastSelection(s, layer, h);
          ASSERT_TRUE(a.ok() && b.ok());
          EXPECT_EQ(a.value(), b.value()) << "selection differs, step " << step;
        }
      }
    }
  }
  const Stats s0 = rt[0]->GetStats(), s1 = rt[1]->GetStats();
  EXPECT_EQ(s0.rows_selected, s1.rows_selected);
  if (c.bank_slots > 0 && s0.bank_admitted > 0 && c.policy != "lfps" && c.route != Route::kCpu &&
      c.policy != "streaming" && c.policy != "dense") {
    // CUDA keeps a device-selecting policy's bank in device memory (its own admission limits),
    // the host backend its host-managed one: both serve hits, not necessarily the same ones.
    EXPECT_GT(s0.rows_bank_hit, 0);
    EXPECT_GT(s1.rows_bank_hit, 0);
  } else {
    EXPECT_EQ(s0.rows_bank_hit, s1.rows_bank_hit);
  }
  EXPECT_EQ(s0.rows_cpu, s1.rows_cpu);
  if (dev != nullptr) {
    for (void* p : {dq, dk, dv, dout}) dev->FreeDevice(p);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaRuntimeTest,
    ::testing::Values(Case{"dense", Route::kGpu, 0, "vector"},
                      Case{"streaming", Route::kGpu, 0, "vector"},
                      Case{"oracle", Route::kGpu, 0, "vector"},
                      Case{"oracle", Route::kCpu, 0, "vector"},
                      Case{"quest", Route::kGpu, 0, "vector"},
                      Case{"quest", Route::kCpu, 0, "vector"},
                      Case{"sparcas", Route::kGpu, 0, "vector"},
                      Case{"oracle", Route::kGpu, 64, "vector"},
                      Case{"oracle", Route::kGpu, 64, "hash"},
                      Case{"oracle", Route::kGpu, 64, "vector", true},
                      Case{"quest", Route::kGpu, 64, "vector"},
                      Case{"quest", Route::kGpu, 64, "hash", true},
                      Case{"sparcas", Route::kGpu, 64, "vector"},
                      Case{"sparcas", Route::kGpu, 64, "hash"},
                      // lfps: the planned step (resident rows on the device, offloaded picks on
                      // the CPU), with host and device tensors; and the host-selected gpu route.
                      Case{"lfps", Route::kAuto, 0, "vector"},
                      Case{"lfps", Route::kAuto, 0, "vector", true},
                      Case{"lfps", Route::kGpu, 0, "vector"},
                      Case{"streaming", Route::kGpu, 0, "vector", true}),
    [](const auto& info) {
      const Case& c = info.param;
      return c.policy + "_" + RouteName(c.route) + "_bank" + std::to_string(c.bank_slots) +
             (c.bank_slots ? "_" + c.bank_map : "") + (c.device_io ? "_device_io" : "");
    });


// The device token bank changes where a selected row is read from, never what is read: a CUDA
// runtime with the bank gives bit for bit the outputs of one without it, the bank serves hits once
// the selection repeats (the same queries every step here, new keys), and a sequence removed and
// added again starts with empty tables.
TEST(CudaStepBank, SameOutputsAsWithoutTheBankAndServesHits) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  for (const char* policy : {"oracle", "quest", "sparcas"}) {
    for (const char* map : {"vector", "hash"}) {
      SCOPED_TRACE(std::string(policy) + " " + map);
      std::unique_ptr<Runtime> rt[2];  // 0: bank, 1: none
      for (int b = 0; b < 2; ++b) {
        RuntimeConfig cfg = MakeConfig(Case{policy, Route::kGpu, b == 0 ? 128 : 0, map}, Backend::kCuda);
        cfg.model.num_layers = 3;  // sparcas's first two layers score exactly: one sparse layer
        auto r = Runtime::Create(cfg);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        rt[b] = std::move(r).value();
      }
      const auto& m = rt[0]->config().model;
      std::mt19937 rng(77);
      std::normal_distribution<float> nd(0.f, 1.f);
      auto random = [&](int64_t n) {
        std::vector<float> x(static_cast<size_t>(n));
        for (float& e : x) e = nd(rng);
        return x;
      };
      const std::vector<SequenceId> seqs = {5, 6};
      const int64_t batch = 2;
      auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
        return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, m.head_dim});
      };
      for (int round = 0; round < 2; ++round) {
        for (auto& r : rt) {
          for (SequenceId s : seqs) ASSERT_TRUE(r->AddSequence(s).ok());
        }
        const int64_t prompt = 350;  // two chunks of max_prefill_chunk (512) or less: 700 tokens
        for (SequenceId s : seqs) {
          for (int l = 0; l < m.num_layers; ++l) {
            for (int chunk = 0; chunk < 2; ++chunk) {
              auto k = random(prompt * m.num_kv_heads * m.head_dim), v = random(prompt * m.num_kv_heads * m.head_dim);
              for (auto& r : rt) {
                const Status st = r->Append(s, l, view(k, prompt, m.num_kv_heads), view(v, prompt, m.num_kv_heads));
                ASSERT_TRUE(st.ok()) << st.ToString();
              }
            }
          }
        }
        std::vector<std::vector<float>> q(static_cast<size_t>(m.num_layers));
        for (auto& x : q) x = random(batch * m.num_q_heads * m.head_dim);
        for (auto& r : rt) r->ResetStats();
        for (int step = 0; step < 12; ++step) {
          for (int l = 0; l < m.num_layers; ++l) {
            auto k = random(batch * m.num_kv_heads * m.head_dim), v = random(batch * m.num_kv_heads * m.head_dim);
            std::vector<float> out[2];
            for (int b = 0; b < 2; ++b) {
              out[b].assign(q[l].size(), std::nanf(""));
              const Status st = rt[b]->Decode(seqs, l, view(q[l], batch, m.num_q_heads), view(k, batch, m.num_kv_heads),
                                              view(v, batch, m.num_kv_heads), view(out[b], batch, m.num_q_heads));
              ASSERT_TRUE(st.ok()) << st.ToString();
            }
            for (size_t i = 0; i < out[0].size(); ++i) {
              ASSERT_EQ(out[0][i], out[1][i]) << "round " << round << " step " << step << " layer " << l << " element " << i;
            }
          }
        }
        const Stats s = rt[0]->GetStats();
        EXPECT_GT(s.bank_admitted, 0) << "round " << round;
        EXPECT_GT(s.rows_bank_hit, 0) << "round " << round;
        EXPECT_GT(s.rows_fetched, 0) << "round " << round;  // the first steps miss
        // Hits and misses are offloaded selected rows: never more than the selection.
        EXPECT_LE(s.rows_bank_hit + s.rows_fetched, s.rows_selected) << "round " << round;
        // Repeating queries: after the first steps most offloaded rows come from the bank.
        EXPECT_GT(s.rows_bank_hit, s.rows_fetched) << "round " << round;
        for (auto& r : rt) {
          for (SequenceId sq : seqs) ASSERT_TRUE(r->RemoveSequence(sq).ok());
        }
      }
    }
  }
}

// Past kSelectMctaMinKeys ranked keys the CUDA runtime's device selection takes the multi-CTA
// top-k (its scratch allocated at Create): selections and outputs still equal the host backend's.
// Two sequences of different lengths (one above, one near the threshold), GQA 4, the prompt
// stored with Append; sparcas's layer 1 ranks over its compact keys, layer 0 over every dimension.
class CudaRuntimeLong : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaRuntimeLong, MultiCtaSelectionEqualsHost) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  std::unique_ptr<Runtime> rt[2];
  for (int b = 0; b < 2; ++b) {
    RuntimeConfig cfg;
    cfg.model.num_layers = 2;
    cfg.model.num_q_heads = 8;
    cfg.model.num_kv_heads = 2;
    cfg.model.head_dim = 64;
    cfg.model.kv_dtype = DType::kBF16;
    cfg.capacity.max_sequences = 2;
    cfg.capacity.max_tokens_per_sequence = 6144;
    cfg.capacity.max_batch = 2;
    cfg.capacity.max_prefill_chunk = 1024;
    cfg.tiers.sink_tokens = 4;
    cfg.tiers.window_tokens = 32;
    cfg.policy.name = GetParam();
    cfg.policy.budget_tokens = 160;
    if (GetParam() == "sparcas") cfg.policy.params["dense_layers"] = 1;
    cfg.route = Route::kGpu;
    cfg.backend = b == 0 ? Backend::kCuda : Backend::kHost;
    cfg.cpu_threads = 2;
    auto r = Runtime::Create(cfg);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    rt[b] = std::move(r).value();
  }
  const auto& m = rt[0]->config().model;
  const std::vector<SequenceId> seqs = {21, 22};
  const int64_t prompt[2] = {5000, 4100};
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto fill = [&](std::vector<float>& v) {
    for (auto& x : v) x = nd(rng);
  };
  for (int b = 0; b < 2; ++b) {
    for (SequenceId s : seqs) ASSERT_TRUE(rt[b]->AddSequence(s).ok());
  }
  for (int i = 0; i < 2; ++i) {
    for (int64_t c0 = 0; c0 < prompt[i]; c0 += 1024) {
      const int64_t t = std::min<int64_t>(1024, prompt[i] - c0);
      for (int layer = 0; layer < m.num_layers; ++layer) {
        std::vector<float> k(t * m.num_kv_heads * m.head_dim), v(k.size());
        fill(k);
        fill(v);
        for (int b = 0; b < 2; ++b) {
          auto tv = [&](std::vector<float>& x) {
            return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost,
                                          {t, m.num_kv_heads, m.head_dim});
          };
          const Status st = rt[b]->Append(seqs[i], layer, tv(k), tv(v));
          ASSERT_TRUE(st.ok()) << st.ToString();
        }
      }
    }
  }
  for (int b = 0; b < 2; ++b) ASSERT_TRUE(rt[b]->Synchronize().ok());
  const int64_t batch = 2;
  for (int step = 0; step < 6; ++step) {
    for (int layer = 0; layer < m.num_layers; ++layer) {
      std::vector<float> q(batch * m.num_q_heads * m.head_dim), k(batch * m.num_kv_heads * m.head_dim),
          v(k.size());
      fill(q);
      fill(k);
      fill(v);
      // Sharpen the queries so that the selection matters (a few keys dominate).
      for (auto& x : q) x *= 3.0f;
      std::vector<float> out[2];
      for (int b = 0; b < 2; ++b) {
        out[b].assign(q.size(), std::nanf(""));
        auto tv = [&](std::vector<float>& x, int heads) {
          return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost,
                                        {batch, heads, m.head_dim});
        };
        const Status st = rt[b]->Decode(seqs, layer, tv(q, m.num_q_heads), tv(k, m.num_kv_heads),
                                        tv(v, m.num_kv_heads), tv(out[b], m.num_q_heads));
        ASSERT_TRUE(st.ok()) << st.ToString();
        ASSERT_TRUE(rt[b]->Synchronize().ok());
      }
      double err = 0, norm = 0;
      for (size_t i = 0; i < q.size(); ++i) {
        ASSERT_FALSE(std::isnan(out[0][i])) << "unwritten output " << i;
        err = std::max(err, static_cast<double>(std::abs(out[0][i] - out[1][i])));
        norm += out[1][i] * out[1][i];
      }
      EXPECT_LT(err, 1e-4) << "decode step " << step << " layer " << layer;
      EXPECT_GT(norm, 0.0);
      for (SequenceId s : seqs) {
        for (int h = 0; h < m.num_kv_heads; ++h) {
          auto a = rt[0]->LastSelection(s, layer, h);
          auto b = rt[1]->LastSelection(s, layer, h);
          ASSERT_TRUE(a.ok() && b.ok());
          EXPECT_EQ(a.value().size(), 160u);
          EXPECT_EQ(a.value(), b.value()) << "selection differs, seq " << s << " step " << step
                                          << " layer " << layer << " head " << h;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaRuntimeLong, ::testing::Values("oracle", "sparcas"));

}  // namespace
}  // namespace kvferry
