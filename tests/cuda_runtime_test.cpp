// Copyright kvferry authors. Apache-2.0.
// The decode step on CUDA equals the host-emulated backend: two Runtimes (Backend::kCuda and
// Backend::kHost) fed the same prefill and decode inputs produce the same outputs to fp32
// rounding, for several policies, both routes and with/without a token bank, and past the
// multi-CTA top-k threshold (CudaRuntimeLong). Skips without a GPU.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gpu/device.h"
#include "kvferry/runtime.h"
#include "policies/basic.h"
#include "tests/policy_test_util.h"
#include "policies/policy.h"

namespace kvferry {
namespace {

struct Case {
  std::string policy;
  Route route;
  int bank_slots;
  std::string bank_map;
  bool device_io = false;  // the CUDA runtime's decode q/k/v/out in device memory
  int sparcas_bits = 0;    // sparcas's or hip's "bits" (0: the default, 4-bit rows)
  int lag = -1;            // >= 0: hip's "lag"; -1: 1 (due rebuilds on a side stream)
  int dense_bits = 0;      // > 0: hip's "dense_bits" (the default 4: SparCas's 4-bit top-k)
  int smooth = 0;          // sparcas's "smooth"; its keys then have channels 16x the others
  double drift = 0.0;      // > 0: hip's "drift" (no interval within the test: r_m 100), the
                           // decode query moving as decoding's does (a cosine of 0.9 a step);
                           // 0: off (the cases' masks rebuilt on the r_m clock alone)
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
  // HiP's first layers take the exact top-k (dense_layers, default 3): from layer 1 on, its masks,
  // rebuilt every 3 steps (drift off, a due rebuild a step late on the side stream unless the case
  // names its lag: the clock the cases check); the drift cases rebuild when the query turns.
  // bits 16: the host selects (its lists uploaded); 4: the device.
  if (c.policy.find("hip") != std::string::npos) {
    cfg.policy.params["dense_layers"] = 1;
    cfg.policy.params["r_m"] = 3;
    if (c.sparcas_bits != 0) cfg.policy.params["bits"] = c.sparcas_bits;
    cfg.policy.params["lag"] = c.lag >= 0 ? c.lag : 1;
    if (c.dense_bits > 0) cfg.policy.params["dense_bits"] = c.dense_bits;
    cfg.policy.params["drift"] = c.drift;
    if (c.drift > 0.0) cfg.policy.params["r_m"] = 100;
  }
  // PrHS's depth window from layer 0 on: layer 1 hides [sink, 0.16 n) (the device filters its own
  // selection for the device-selecting inner policies).
  if (c.policy.find("psaw+") != std::string::npos) cfg.policy.params["psaw.start"] = 0;
  // SparCas re-chooses its dimensions every 4 ranked steps: with a new random q each step the set
  // changes and both backends re-gather the compact rows; the selections must still agree.
  // Layer 1 ranks over the compact keys (dense_layers 1 of 2).
  if (c.policy.find("sparcas") != std::string::npos) {
    cfg.policy.params["u"] = 4;
    cfg.policy.params["dense_layers"] = 1;
    if (c.sparcas_bits != 0) cfg.policy.params["bits"] = c.sparcas_bits;
    cfg.policy.params["smooth"] = c.smooth;  // explicit both ways (the default is 1)
  }
  // KVpop selects on the device unless asked (bits 16 stands for "the host selects" here too);
  // "kvpop_mlp_test" scores with a random MLP (tests/policy_test_util.h).
  if (c.policy.find("kvpop") != std::string::npos) {
    if (c.policy.find("kvpop_mlp") != std::string::npos) testing_util::RegisterKvpopMlpTestPolicy();
    if (c.sparcas_bits == 16) cfg.policy.params["device"] = 0;
  }
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
  // With smoothing, every eighth key channel 16x the others (as QK-norm's weights make them), so
  // that the channel scales decide which dimensions are kept and how the rows quantize.
  auto wide_channels = [&](std::vector<float>& k) {
    if (c.smooth == 0) return;
    for (size_t i = 0; i < k.size(); ++i) {
      if (i % m.head_dim % 8 == 3) k[i] *= 16.0f;
    }
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
      wide_channels(k);
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
  std::vector<std::vector<float>> last_q(m.num_layers);
  for (int step = 0; step < 24; ++step) {
    for (int layer = 0; layer < m.num_layers; ++layer) {
      std::vector<float> q(batch * m.num_q_heads * m.head_dim), k(batch * m.num_kv_heads * m.head_dim),
          v(k.size());
      fill(q);
      fill(k);
      fill(v);
      wide_channels(k);
      if (c.drift > 0.0) {  // carry 0.9 of the layer's last query
        if (step > 0) {
          for (size_t i = 0; i < q.size(); ++i) q[i] = 0.9f * last_q[layer][i] + 0.43589f * q[i];
        }
        last_q[layer] = q;
      }
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
  if (c.policy == "hip" && c.sparcas_bits != 16 && c.bank_slots > 0) {
    // The host backend with a bank selects on the host and counts its lists; CUDA counts HiP's
    // device lists without reading them (RuntimeImpl::DeviceListRows: up to bk - 1 = 1 row
    // more a list, where a mask holds the offloaded range's last block cut short).
    EXPECT_GE(s0.rows_selected, s1.rows_selected);
    EXPECT_LE(s0.rows_selected, s1.rows_selected + s0.decode_steps * 2 * m.num_kv_heads);
  } else {
    EXPECT_EQ(s0.rows_selected, s1.rows_selected);
  }
  // Route gpu with a bank: CUDA keeps it in device memory for every policy but dense (its own
  // admission limits), the host backend its host-managed one: both serve hits, not necessarily
  // the same ones. Hits and misses are offloaded selected rows.
  if (c.bank_slots > 0 && c.route == Route::kGpu && c.policy != "dense") {
    EXPECT_LE(s0.rows_bank_hit + s0.rows_fetched, s0.rows_selected);
    EXPECT_GT(s0.bank_admitted, 0);
    // lfps on fresh random queries may pick other rows every step (hits: CudaStepBank tests).
    if (c.policy != "lfps") {
      EXPECT_GT(s0.rows_bank_hit, 0);
      EXPECT_GT(s1.rows_bank_hit, 0);
    }
    // A host-selecting policy waits for its q once per layer (and the steps are not capturable).
    // The device-selecting ones: oracle, quest, sparcas, hip at 4 bits, also inside psaw+ (which
    // the device applies to their lists); cis+ and xl+ select on the host.
    std::string inner = c.policy;
    for (bool more = true; more;) {  // psaw+ and xl+ keep a device selection
      more = false;
      for (const std::string w : {"psaw+", "xl+"}) {
        if (inner.rfind(w, 0) == 0) inner = inner.substr(w.size()), more = true;
      }
    }
    const bool device_hip = (inner == "hip" || inner.rfind("kvpop", 0) == 0) && c.sparcas_bits != 16;
    if (inner != "oracle" && inner != "quest" && inner != "sparcas" && !device_hip) {
      EXPECT_FALSE(rt[0]->decode_is_capture_safe());
      EXPECT_GT(s0.host_syncs, 0);
    } else {
      EXPECT_TRUE(rt[0]->decode_is_capture_safe());
    }
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
                      // The paper's compact rows (the KV dtype) next to the default 4-bit ones.
                      Case{"sparcas", Route::kGpu, 0, "vector", false, 16},
                      Case{"sparcas", Route::kGpu, 64, "hash", true, 16},
                      // Channel smoothing (4-bit rows), without and with the bank.
                      Case{"sparcas", Route::kGpu, 0, "vector", false, 0, -1, 0, 1},
                      Case{"sparcas", Route::kGpu, 64, "hash", true, 0, -1, 0, 1},
                      // HiP's masks on the device (its 4-bit scores), with and without the bank.
                      Case{"hip", Route::kGpu, 0, "vector"},
                      Case{"hip", Route::kGpu, 64, "vector", true},
                      Case{"psaw+hip", Route::kGpu, 64, "hash"},
                      Case{"hip", Route::kGpu, 64, "hash", true, 0, 0},  // every mask in its step
                      Case{"hip", Route::kGpu, 64, "vector", true, 0, -1, 16},  // exact dense layers
                      // Masks rebuilt when the query drifts: beside the step, and in it.
                      Case{"hip", Route::kGpu, 0, "vector", false, 0, -1, 0, 0, 0.75},
                      Case{"hip", Route::kGpu, 64, "hash", true, 0, 0, 0, 0, 0.75},
                      // KVpop's slots on the device: recency (no weights), and a random MLP
                      // scorer computed on both backends to the bit.
                      Case{"kvpop", Route::kGpu, 0, "vector"},
                      Case{"kvpop", Route::kGpu, 64, "hash", true},
                      Case{"kvpop_mlp_test", Route::kGpu, 0, "vector"},
                      Case{"kvpop_mlp_test", Route::kGpu, 64, "vector", true},
                      Case{"psaw+kvpop_mlp_test", Route::kGpu, 64, "hash"},
                      // lfps: the planned step (resident rows on the device, offloaded picks on
                      // the CPU), with host and device tensors; and the host-selected gpu route.
                      Case{"lfps", Route::kAuto, 0, "vector"},
                      Case{"lfps", Route::kAuto, 0, "vector", true},
                      Case{"lfps", Route::kGpu, 0, "vector"},
                      Case{"streaming", Route::kGpu, 0, "vector", true},
                      // Host-selecting policies with the device bank (route gpu): the host's
                      // lists, the device's step and bank.
                      Case{"hip", Route::kGpu, 64, "vector", false, 16},
                      Case{"hip", Route::kGpu, 64, "hash", true, 16},
                      Case{"kvpop", Route::kGpu, 64, "vector", false, 16},
                      Case{"kvpop", Route::kGpu, 64, "hash", false, 16},
                      Case{"lfps", Route::kGpu, 64, "vector"},
                      Case{"lfps", Route::kGpu, 64, "hash", true},
                      Case{"streaming", Route::kGpu, 64, "vector"},
                      Case{"cis+oracle", Route::kGpu, 64, "hash"},
                      // PrHS's depth window around the device-selecting policies: the device
                      // filters and refills its lists (base/psaw.h), no host selection.
                      Case{"psaw+oracle", Route::kGpu, 0, "vector"},
                      Case{"psaw+quest", Route::kGpu, 64, "vector"},
                      Case{"psaw+sparcas", Route::kGpu, 0, "vector", true},
                      // Cross-layer sharing around them: the device copies layer 0's list
                      // (and at layer 1 keeps quest's bounds and sparcas's compact rows current
                      // without ranking: select_skip_ranking).
                      Case{"xl+quest", Route::kGpu, 64, "vector"},
                      Case{"xl+sparcas", Route::kGpu, 64, "vector", true},
                      Case{"xl+oracle", Route::kGpu, 0, "vector"},
                      Case{"xl+psaw+oracle", Route::kGpu, 0, "vector"}),
    [](const auto& info) {
      const Case& c = info.param;
      std::string policy = c.policy;
      std::replace(policy.begin(), policy.end(), '+', '_');
      return policy + "_" + RouteName(c.route) + "_bank" + std::to_string(c.bank_slots) +
             (c.bank_slots ? "_" + c.bank_map : "") + (c.device_io ? "_device_io" : "") +
             (c.sparcas_bits ? "_bits" + std::to_string(c.sparcas_bits) : "") +
             (c.lag >= 0 ? "_lag" + std::to_string(c.lag) : "") +
             (c.dense_bits > 0 ? "_dense" + std::to_string(c.dense_bits) : "") +
             (c.smooth ? "_smooth" : "") + (c.drift > 0.0 ? "_drift" : "");
    });


// SparCas's channel scales belong to a sequence: taken at its first ranked step, and taken anew
// for the next sequence in its slot (CUDA: zeroed by the selector's Reset, their maxima by
// atomicMax). Two rounds of two sequences on CUDA and host runtimes, the wide key channel moved
// between rounds (3 mod 8, then 5 mod 8): the selections agree in both. Scales that kept the
// first round's maxima would keep channel 3's, choose other dimensions and rows, and differ.
TEST(CudaSparcasSmooth, ScalesStartOverForTheNextSequenceInASlot) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  std::unique_ptr<Runtime> rt[2];
  for (int b = 0; b < 2; ++b) {
    auto r = Runtime::Create(MakeConfig(Case{"sparcas", Route::kGpu, 0, "vector", false, 0, -1, 0, 1},
                                        b == 0 ? Backend::kCuda : Backend::kHost));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    rt[b] = std::move(r).value();
  }
  const auto& m = rt[0]->config().model;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, m.head_dim});
  };
  for (int round = 0; round < 2; ++round) {
    const std::vector<SequenceId> seqs = {SequenceId(20 + 2 * round), SequenceId(21 + 2 * round)};
    const size_t wide = round == 0 ? 3 : 5;
    auto keys = [&](int64_t rows) {
      std::vector<float> k(static_cast<size_t>(rows * m.num_kv_heads * m.head_dim));
      for (size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) * (i % m.head_dim % 8 == wide ? 16.0f : 1.0f);
      return k;
    };
    auto random = [&](int64_t rows, int heads) {
      std::vector<float> x(static_cast<size_t>(rows * heads * m.head_dim));
      for (float& e : x) e = nd(rng);
      return x;
    };
    for (auto& r : rt) {
      for (SequenceId s : seqs) ASSERT_TRUE(r->AddSequence(s).ok());
    }
    for (SequenceId s : seqs) {
      for (int l = 0; l < m.num_layers; ++l) {
        auto k = keys(300), v = random(300, m.num_kv_heads);
        for (auto& r : rt) ASSERT_TRUE(r->Append(s, l, view(k, 300, m.num_kv_heads), view(v, 300, m.num_kv_heads)).ok());
      }
    }
    for (int step = 0; step < 8; ++step) {
      for (int l = 0; l < m.num_layers; ++l) {
        auto q = random(2, m.num_q_heads), k = keys(2), v = random(2, m.num_kv_heads);
        std::vector<float> out[2];
        for (int b = 0; b < 2; ++b) {
          out[b].assign(q.size(), std::nanf(""));
          const Status st = rt[b]->Decode(seqs, l, view(q, 2, m.num_q_heads), view(k, 2, m.num_kv_heads),
                                          view(v, 2, m.num_kv_heads), view(out[b], 2, m.num_q_heads));
          ASSERT_TRUE(st.ok()) << st.ToString();
          ASSERT_TRUE(rt[b]->Synchronize().ok());
        }
        for (size_t i = 0; i < q.size(); ++i) {
          ASSERT_NEAR(out[0][i], out[1][i], 1e-4) << "round " << round << " step " << step << " layer " << l;
        }
        for (SequenceId s : seqs) {
          for (int h = 0; h < m.num_kv_heads; ++h) {
            auto a = rt[0]->LastSelection(s, l, h);
            auto b = rt[1]->LastSelection(s, l, h);
            ASSERT_TRUE(a.ok() && b.ok());
            EXPECT_EQ(a.value(), b.value()) << "round " << round << " step " << step << " layer " << l;
          }
        }
      }
    }
    for (auto& r : rt) {
      for (SequenceId s : seqs) ASSERT_TRUE(r->RemoveSequence(s).ok());
    }
  }
}


// The device token bank changes where a selected row is read from, never what is read: a CUDA
// runtime with the bank gives the outputs of one without it to 1e-4 (the same rows in fp32; with
// the bank the step streams them through the pipelined tensor-core loop, without it through the
// register loop, which sum in another order, as CudaRuntimeTest's CUDA-vs-host bound), the bank serves hits once
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
              ASSERT_NEAR(out[0][i], out[1][i], 1e-4) << "round " << round << " step " << step << " layer " << l << " element " << i;
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


// The scheduler's cross-layer prefetch (xl+, the device bank's two regions): a planned layer whose
// next layer takes its list copies that layer's misses into its stage beside its own step; the
// next step reads them there. Against a twin with xl_prefetch = 0 on the same inputs, for
// device-selecting inner policies x vector and hash maps, 4 layers (layers 2 and 3 share), planned
// and unplanned steps, a plan left after layer 2 and a sequence removed and added again: the
// outputs, selections and bank counters are equal bit for bit, and every planned sharing layer's
// step was prefetched (hip: its side rebuilds keep one region, so none is).
TEST(CudaStepBank, XlPrefetchEqualsNoPrefetch) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  for (const char* policy : {"xl+oracle", "xl+sparcas", "xl+quest", "xl+kvpop", "xl+hip"}) {
    for (const char* map : {"vector", "hash"}) {
      SCOPED_TRACE(std::string(policy) + " " + map);
      std::unique_ptr<Runtime> rt[2];  // 0: prefetch, 1: none
      for (int b = 0; b < 2; ++b) {
        RuntimeConfig cfg = MakeConfig(Case{policy, Route::kGpu, 48, map}, Backend::kCuda);
        cfg.model.num_layers = 4;
        cfg.xl_prefetch = b == 0 ? 1 : 0;
        auto r = Runtime::Create(cfg);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        rt[b] = std::move(r).value();
      }
      const bool prefetches = std::string(policy) != "xl+hip";
      const auto& m = rt[0]->config().model;
      std::mt19937 rng(97);
      std::normal_distribution<float> nd(0.f, 1.f);
      auto random = [&](int64_t n) {
        std::vector<float> x(static_cast<size_t>(n));
        for (float& e : x) e = nd(rng);
        return x;
      };
      auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
        return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, m.head_dim});
      };
      const std::vector<SequenceId> seqs = {3, 4};
      const int64_t batch = 2;
      auto add = [&](SequenceId s, int64_t prompt) {
        for (auto& r : rt) ASSERT_TRUE(r->AddSequence(s).ok());
        for (int l = 0; l < m.num_layers; ++l) {
          auto k = random(prompt * m.num_kv_heads * m.head_dim), v = random(prompt * m.num_kv_heads * m.head_dim);
          for (auto& r : rt) {
            const Status st = r->Append(s, l, view(k, prompt, m.num_kv_heads), view(v, prompt, m.num_kv_heads));
            ASSERT_TRUE(st.ok()) << st.ToString();
          }
        }
      };
      add(seqs[0], 420);
      add(seqs[1], 310);
      // A few fixed queries, so that the selections repeat and the bank serves hits too.
      std::vector<std::vector<float>> queries;
      for (int i = 0; i < 3; ++i) queries.push_back(random(batch * m.num_q_heads * m.head_dim));
      int64_t want = 0;
      int shared = 2;  // layers 2 and 3 take the previous layer's list
      auto layer_call = [&](int step, int l) {
        std::vector<float> q = queries[static_cast<size_t>((step + l) % 3)];
        auto k = random(batch * m.num_kv_heads * m.head_dim), v = random(batch * m.num_kv_heads * m.head_dim);
        std::vector<float> out[2];
        for (int b = 0; b < 2; ++b) {
          out[b].assign(q.size(), std::nanf(""));
          const Status st = rt[b]->Decode(seqs, l, view(q, batch, m.num_q_heads), view(k, batch, m.num_kv_heads),
                                          view(v, batch, m.num_kv_heads), view(out[b], batch, m.num_q_heads));
          ASSERT_TRUE(st.ok()) << st.ToString();
        }
        ASSERT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)))
            << "step " << step << " layer " << l;
        for (SequenceId s : seqs) {
          for (int h = 0; h < m.num_kv_heads; ++h) {
            ASSERT_EQ(rt[0]->LastSelection(s, l, h).value(), rt[1]->LastSelection(s, l, h).value());
          }
        }
      };
      for (int step = 0; step < 14; ++step) {
        const bool planned = step % 4 != 3;
        if (step == 9) {  // out and in again: its tables emptied on both, after the side work
          for (auto& r : rt) ASSERT_TRUE(r->RemoveSequence(seqs[1]).ok());
          add(seqs[1], 260);
        }
        if (step == 5) {  // a plan left after layer 2, whose prefetch for layer 3 is in flight
          for (auto& r : rt) ASSERT_TRUE(r->PlanDecode(seqs).ok());
          for (int l = 0; l < 3; ++l) layer_call(step, l);
          if (prefetches) want += 1;  // layer 2's step; layer 3's prefetch serves nothing
          // The plan gave layer 3's token back: from here sequence 3's layer 3 is a token short
          // of its layer 2, so layer 3 runs the inner policy (xl+ shares at equal lengths) and
          // nothing is prefetched for it.
          shared = 1;
        }
        if (planned) {
          for (auto& r : rt) ASSERT_TRUE(r->PlanDecode(seqs).ok());
        }
        for (int l = 0; l < m.num_layers; ++l) layer_call(step, l);
        if (planned && prefetches) want += shared;  // layers 2 (and 3)
      }
      for (auto& r : rt) ASSERT_TRUE(r->Synchronize().ok());
      const Stats s0 = rt[0]->GetStats(), s1 = rt[1]->GetStats();
      EXPECT_EQ(s0.decode_prefetched, want);
      EXPECT_EQ(s1.decode_prefetched, 0);
      EXPECT_GT(s1.rows_bank_hit, 0);
      EXPECT_GT(s1.rows_fetched, 0);
      EXPECT_EQ(s0.bank_admitted, s1.bank_admitted);
      EXPECT_EQ(s0.bank_evicted, s1.bank_evicted);
      EXPECT_EQ(s0.rows_bank_hit, s1.rows_bank_hit);
      EXPECT_EQ(s0.rows_fetched, s1.rows_fetched);
    }
  }
}

// Policies that select on the host (Policy::Select) with a bank on route gpu run the planned step
// with the device bank (runtime/decode_plan.cpp UploadHostLists): the host's lists go up, the step
// kernel reads each row from the resident tier, the bank or the host store. Against two twins on
// the same inputs, for hip, kvpop and lfps x vector and hash maps, over 12 steps x 3 layers, with
// the sequences removed and added again:
//   * a runtime with a 2-slot bank (other rows from the bank, the same kernels, and self-planned
//     Decodes instead of PlanDecode) gives the same outputs bit for bit;
//   * a runtime without a bank (the host path: AttendRows over the host's row addresses) gives the
//     same selections exactly and the same outputs to 1e-4: the same rows in the same fp32
//     arithmetic, summed in another order (the step kernel's splits and their log-sum-exp
//     combine); 1e-4 is the CUDA-vs-host bound of CudaRuntimeTest for the same reason;
//   * the bank serves hits once the queries repeat (the same q every step, new keys), and hits
//     and misses never exceed the offloaded part of the selection.
TEST(CudaStepBank, HostSelectingPoliciesUseTheDeviceBank) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  for (const char* policy : {"hip", "kvpop", "lfps"}) {
    for (const char* map : {"vector", "hash"}) {
      SCOPED_TRACE(std::string(policy) + " " + map);
      constexpr int kRuntimes = 3;  // 0: bank, planned; 1: 2-slot bank, self-planned; 2: none
      const int slots[kRuntimes] = {128, 2, 0};
      std::unique_ptr<Runtime> rt[kRuntimes];
      for (int b = 0; b < kRuntimes; ++b) {
        // hip at 16 bits: the host selects (at 4 bits the device would).
        RuntimeConfig cfg = MakeConfig(Case{policy, Route::kGpu, slots[b], map, false, 16}, Backend::kCuda);
        cfg.model.num_layers = 3;
        auto r = Runtime::Create(cfg);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        rt[b] = std::move(r).value();
        ASSERT_EQ(rt[b]->backend(), Backend::kCuda);
        EXPECT_FALSE(rt[b]->decode_is_capture_safe());
      }
      const auto& m = rt[0]->config().model;
      std::mt19937 rng(91);
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
      constexpr int kSteps = 12;
      for (int round = 0; round < 2; ++round) {
        for (auto& r : rt) {
          for (SequenceId s : seqs) ASSERT_TRUE(r->AddSequence(s).ok());
        }
        // Prefill (lfps primes its tables from the prompt's queries), 600 tokens a sequence.
        const int64_t prompt = 300;
        for (SequenceId s : seqs) {
          for (int l = 0; l < m.num_layers; ++l) {
            for (int chunk = 0; chunk < 2; ++chunk) {
              auto q = random(prompt * m.num_q_heads * m.head_dim);
              auto k = random(prompt * m.num_kv_heads * m.head_dim), v = random(prompt * m.num_kv_heads * m.head_dim);
              for (auto& r : rt) {
                std::vector<float> out(q.size());
                const Status st = r->Prefill(s, l, view(q, prompt, m.num_q_heads), view(k, prompt, m.num_kv_heads),
                                             view(v, prompt, m.num_kv_heads), view(out, prompt, m.num_q_heads));
                ASSERT_TRUE(st.ok()) << st.ToString();
              }
            }
          }
        }
        std::vector<std::vector<float>> q(static_cast<size_t>(m.num_layers));
        for (auto& x : q) x = random(batch * m.num_q_heads * m.head_dim);
        for (auto& r : rt) r->ResetStats();
        for (int step = 0; step < kSteps; ++step) {
          ASSERT_TRUE(rt[0]->PlanDecode(seqs).ok());
          for (int l = 0; l < m.num_layers; ++l) {
            auto k = random(batch * m.num_kv_heads * m.head_dim), v = random(batch * m.num_kv_heads * m.head_dim);
            std::vector<float> out[kRuntimes];
            for (int b = 0; b < kRuntimes; ++b) {
              out[b].assign(q[l].size(), std::nanf(""));
              const Status st = rt[b]->Decode(seqs, l, view(q[l], batch, m.num_q_heads), view(k, batch, m.num_kv_heads),
                                              view(v, batch, m.num_kv_heads), view(out[b], batch, m.num_q_heads));
              ASSERT_TRUE(st.ok()) << st.ToString();
            }
            double err = 0, norm = 0;
            for (size_t i = 0; i < out[0].size(); ++i) {
              ASSERT_EQ(0, std::memcmp(&out[0][i], &out[1][i], sizeof(float)))
                  << "round " << round << " step " << step << " layer " << l << " element " << i
                  << ": " << out[0][i] << " vs " << out[1][i];
              ASSERT_FALSE(std::isnan(out[2][i]));
              err = std::max(err, static_cast<double>(std::abs(out[0][i] - out[2][i])));
              norm += static_cast<double>(out[0][i]) * out[0][i];
            }
            EXPECT_LT(err, 1e-4) << "round " << round << " step " << step << " layer " << l;
            EXPECT_GT(norm, 0.0);
            for (SequenceId sq : seqs) {
              for (int h = 0; h < m.num_kv_heads; ++h) {
                auto a = rt[0]->LastSelection(sq, l, h), c = rt[2]->LastSelection(sq, l, h);
                ASSERT_TRUE(a.ok() && c.ok());
                ASSERT_FALSE(a.value().empty());
                EXPECT_EQ(a.value(), c.value()) << "round " << round << " step " << step << " layer " << l;
              }
            }
          }
        }
        const Stats s = rt[0]->GetStats(), none = rt[2]->GetStats();
        // The planned step ran every layer (PlanDecode validates only, on the host path).
        EXPECT_EQ(s.decode_planned, kSteps * m.num_layers) << "round " << round;
        EXPECT_EQ(none.decode_planned, 0) << "round " << round;
        EXPECT_EQ(s.rows_selected, none.rows_selected) << "round " << round;
        EXPECT_EQ(s.rows_resident, none.rows_resident) << "round " << round;
        EXPECT_GE(s.host_syncs, kSteps * m.num_layers) << "round " << round;  // q, once a layer
        EXPECT_GT(s.bank_admitted, 0) << "round " << round;
        EXPECT_GT(s.rows_fetched, 0) << "round " << round;  // the first steps miss
        EXPECT_GT(s.rows_bank_hit, 0) << "round " << round;
        // Hits and misses are the offloaded selected rows, each read once.
        EXPECT_EQ(s.rows_bank_hit + s.rows_fetched + s.rows_resident, s.rows_selected) << "round " << round;
        EXPECT_EQ(none.rows_bank_hit, 0);
        for (auto& r : rt) {
          for (SequenceId sq : seqs) ASSERT_TRUE(r->RemoveSequence(sq).ok());
        }
      }
    }
  }
}

// A GPU-placed policy that selects on the host like streaming, and fails while the switch is on.
std::atomic<bool> g_fail_select{false};

class FailingHostSelect final : public Policy {
 public:
  std::string_view name() const override { return "test_failing_host_select"; }
  Placement placement() const override { return Placement::kGpu; }
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    if (g_fail_select.load() && ctx.kv_head == 1) return Internal("test_failing_host_select: injected");
    StreamingSelect(ctx.n, ctx.sink, ctx.budget, out);
    return Status::Ok();
  }
};

// A Select that fails inside the device-bank step rolls the layer back like any failed call: the
// sequences keep their lengths, the ring row the step would have taken is intact, and every later
// step equals a twin's that never saw the call, bit for bit (both with the device bank; whatever
// the failed step left in the bank changes where rows are read from, never what).
TEST(CudaStepBank, FailingHostSelectLeavesEverySequenceAsBefore) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  static const bool registered = RegisterPolicy("test_failing_host_select", [](const RuntimeConfig&) {
    return Result<std::unique_ptr<Policy>>(std::unique_ptr<Policy>(new FailingHostSelect));
  });
  ASSERT_TRUE(registered);
  for (const bool planned : {false, true}) {
    SCOPED_TRACE(planned ? "planned" : "self-planned");
    RuntimeConfig cfg = MakeConfig(Case{"test_failing_host_select", Route::kGpu, 128, "vector"}, Backend::kCuda);
    cfg.model.num_layers = 1;  // a failed planned layer is the step's only one: nothing left half-run
    std::unique_ptr<Runtime> rt[2];  // 0 sees the failure, 1 is its twin
    for (auto& r : rt) {
      auto made = Runtime::Create(cfg);
      ASSERT_TRUE(made.ok()) << made.status().ToString();
      r = std::move(made).value();
    }
    const auto& m = cfg.model;
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto random = [&](int64_t n) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& e : x) e = nd(rng);
      return x;
    };
    auto view = [&](std::vector<float>& x, int64_t rows, int heads) {
      return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, m.head_dim});
    };
    const std::vector<SequenceId> seqs = {1, 2};
    const int64_t batch = 2;
    const int64_t prompt[2] = {200, 150};
    for (size_t i = 0; i < seqs.size(); ++i) {
      auto q = random(prompt[i] * m.num_q_heads * m.head_dim);
      auto k = random(prompt[i] * m.num_kv_heads * m.head_dim), v = random(prompt[i] * m.num_kv_heads * m.head_dim);
      for (auto& r : rt) {
        ASSERT_TRUE(r->AddSequence(seqs[i]).ok());
        std::vector<float> out(q.size());
        ASSERT_TRUE(r->Prefill(seqs[i], 0, view(q, prompt[i], m.num_q_heads), view(k, prompt[i], m.num_kv_heads),
                               view(v, prompt[i], m.num_kv_heads), view(out, prompt[i], m.num_q_heads))
                        .ok());
      }
    }
    auto step = [&](std::vector<float>& q, std::vector<float>& k, std::vector<float>& v, Runtime& r,
                    std::vector<float>& out) {
      if (planned) {
        const Status p = r.PlanDecode(seqs);
        if (!p.ok()) return p;
      }
      out.assign(q.size(), std::nanf(""));
      return r.Decode(seqs, 0, view(q, batch, m.num_q_heads), view(k, batch, m.num_kv_heads),
                      view(v, batch, m.num_kv_heads), view(out, batch, m.num_q_heads));
    };
    auto same_step = [&](const std::string& where) {
      auto q = random(batch * m.num_q_heads * m.head_dim);
      auto k = random(batch * m.num_kv_heads * m.head_dim), v = random(batch * m.num_kv_heads * m.head_dim);
      std::vector<float> out[2];
      for (int b = 0; b < 2; ++b) {
        const Status st = step(q, k, v, *rt[b], out[b]);
        ASSERT_TRUE(st.ok()) << where << ": " << st.ToString();
      }
      for (size_t i = 0; i < out[0].size(); ++i) {
        ASSERT_EQ(0, std::memcmp(&out[0][i], &out[1][i], sizeof(float))) << where << " element " << i;
      }
    };
    for (int t = 0; t < 3; ++t) same_step("before, step " + std::to_string(t));
    // The failing call, on runtime 0 only: its k/v would take a ring row of each sequence.
    {
      auto q = random(batch * m.num_q_heads * m.head_dim);
      auto k = random(batch * m.num_kv_heads * m.head_dim), v = random(batch * m.num_kv_heads * m.head_dim);
      std::vector<float> out;
      g_fail_select = true;
      const Status st = step(q, k, v, *rt[0], out);
      g_fail_select = false;
      EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
      EXPECT_NE(st.message().find("injected"), std::string::npos) << st.ToString();
      EXPECT_EQ(st.message().find("unspecified state"), std::string::npos) << st.ToString();
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_EQ(*rt[0]->SequenceLength(seqs[i], 0), prompt[i] + 3);
      EXPECT_EQ(*rt[1]->SequenceLength(seqs[i], 0), prompt[i] + 3);
    }
    // 40 steps pass the ring (32 rows) round once: every ring row the failed call could have
    // written is read back.
    for (int t = 0; t < 40; ++t) same_step("after, step " + std::to_string(t));
    const Stats s = rt[0]->GetStats();
    EXPECT_GT(s.rows_bank_hit, 0);  // the recent offloaded rows repeat from step to step
  }
}

// A CPU-placed policy that selects like streaming (its selections cover the resident rows, so it
// runs the planned CPU step). While g_cpu_hold is set, kv_head 0's Select waits (20 s at most:
// memcheck makes a first launch take seconds) for the test to clear it; while g_cpu_fail is set,
// kv_head 1's fails.
std::atomic<bool> g_cpu_hold{false}, g_cpu_fail{false}, g_cpu_hold_timed_out{false};

class HeldCpuSelect final : public Policy {
 public:
  std::string_view name() const override { return "test_held_cpu_select"; }
  Placement placement() const override { return Placement::kCpu; }
  bool selection_covers_resident() const override { return true; }
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override {
    if (ctx.kv_head == 0 && g_cpu_hold.load()) {
      const auto t0 = std::chrono::steady_clock::now();
      while (g_cpu_hold.load()) {
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(20)) {
          g_cpu_hold_timed_out = true;
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    if (ctx.kv_head == 1 && g_cpu_fail.load()) return Internal("test_held_cpu_select: injected");
    StreamingSelect(ctx.n, ctx.sink, ctx.budget, out);
    return Status::Ok();
  }
};

// The CPU part of a planned CPU step on the runtime's own thread (RuntimeConfig::async_cpu):
// - with device tensors Decode returns while the CPU part is still running (its Select holds
//   until the test, after Decode returned, lets it go), and the outputs, selections and counters
//   equal the serial part's (async_cpu 0) bit for bit, for lfps (its scan on the device) and the
//   test policy, over planned and self-planned steps of a batch of two lengths;
// - a CPU part that fails is returned by the next call (here Synchronize), which rolls its layer
//   back: every later step equals a twin's that never saw the failed call.
TEST(CudaCpuPart, DecodeReturnsBeforeTheCpuPartAndEqualsTheSerialOne) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  static const bool registered = RegisterPolicy("test_held_cpu_select", [](const RuntimeConfig&) {
    return Result<std::unique_ptr<Policy>>(std::unique_ptr<Policy>(new HeldCpuSelect));
  });
  ASSERT_TRUE(registered);
  auto made_dev = MakeCudaDevice(0);
  ASSERT_TRUE(made_dev.ok()) << made_dev.status().ToString();
  std::unique_ptr<Device> dev = std::move(made_dev).value();
  for (const char* policy : {"test_held_cpu_select", "lfps"}) {
    SCOPED_TRACE(policy);
    RuntimeConfig cfg = MakeConfig(Case{policy, Route::kAuto, 0, "vector"}, Backend::kCuda);
    cfg.probe_at_start = false;
    std::unique_ptr<Runtime> rt[2];  // 0: asynchronous part, 1: serial
    for (int r = 0; r < 2; ++r) {
      RuntimeConfig c = cfg;
      c.async_cpu = r == 0 ? 1 : 0;
      auto made = Runtime::Create(c);
      ASSERT_TRUE(made.ok()) << made.status().ToString();
      rt[r] = std::move(made).value();
      EXPECT_FALSE(rt[r]->decode_is_capture_safe());
    }
    const auto& m = cfg.model;
    std::mt19937 rng(31);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto random = [&](int64_t n) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& e : x) e = nd(rng);
      return x;
    };
    const std::vector<SequenceId> seqs = {1, 2};
    const int64_t batch = 2, prompt[2] = {500, 90};  // one prefill chunk (512) each
    for (size_t i = 0; i < seqs.size(); ++i) {
      for (int l = 0; l < m.num_layers; ++l) {
        auto q = random(prompt[i] * m.num_q_heads * m.head_dim);
        auto k = random(prompt[i] * m.num_kv_heads * m.head_dim), v = random(k.size());
        std::vector<float> out(q.size());
        auto hv = [&](std::vector<float>& x, int heads) {
          return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {prompt[i], heads, m.head_dim});
        };
        for (auto& r : rt) {
          if (l == 0) ASSERT_TRUE(r->AddSequence(seqs[i]).ok());
          const Status st = r->Prefill(seqs[i], l, hv(q, m.num_q_heads), hv(k, m.num_kv_heads),
                                       hv(v, m.num_kv_heads), hv(out, m.num_q_heads));
          ASSERT_TRUE(st.ok()) << st.ToString();
        }
      }
    }
    const size_t q_bytes = static_cast<size_t>(batch * m.num_q_heads * m.head_dim) * 4;
    const size_t kv_bytes = static_cast<size_t>(batch * m.num_kv_heads * m.head_dim) * 4;
    // Per runtime and layer: q, k, v, out (a layer's inputs stay put until the runtime's stream
    // has read them: the layers of a step are enqueued back to back below).
    void* d[2][2][4] = {};
    for (auto& per_rt : d) {
      for (auto& per : per_rt) {
        for (int i = 0; i < 4; ++i) {
          auto a = dev->AllocDevice(i == 1 || i == 2 ? kv_bytes : q_bytes);
          ASSERT_TRUE(a.ok());
          per[i] = a.value();
        }
      }
    }
    ASSERT_EQ(m.num_layers, 2);
    auto dtv = [&](void* p, int heads) {
      return TensorView::Contiguous(p, DType::kF32, MemoryKind::kDevice, {batch, heads, m.head_dim});
    };
    // One layer on runtime r with the given inputs; hold: the test policy's Select waits until
    // Decode returned. Returns Decode's status; out is read after Synchronize.
    auto decode = [&](int r, int layer, std::vector<float>& q, std::vector<float>& k, std::vector<float>& v,
                      bool hold) {
      void** t = d[r][layer];
      EXPECT_TRUE(dev->CopyAsync(t[0], q.data(), q_bytes, dev->default_stream()).ok());
      EXPECT_TRUE(dev->CopyAsync(t[1], k.data(), kv_bytes, dev->default_stream()).ok());
      EXPECT_TRUE(dev->CopyAsync(t[2], v.data(), kv_bytes, dev->default_stream()).ok());
      EXPECT_TRUE(dev->SynchronizeStream(dev->default_stream()).ok());
      g_cpu_hold = hold;
      const Status st = rt[r]->Decode(seqs, layer, dtv(t[0], m.num_q_heads), dtv(t[1], m.num_kv_heads),
                                      dtv(t[2], m.num_kv_heads), dtv(t[3], m.num_q_heads));
      g_cpu_hold = false;  // Decode returned: the held Select may go on
      return st;
    };
    auto read_out = [&](int r, int layer) {
      std::vector<float> out(q_bytes / 4);
      EXPECT_TRUE(dev->CopyAsync(out.data(), d[r][layer][3], q_bytes, dev->default_stream()).ok());
      EXPECT_TRUE(dev->SynchronizeStream(dev->default_stream()).ok());
      return out;
    };
    const bool test_policy = std::string(policy) == "test_held_cpu_select";
    // Under compute-sanitizer a launch returns once its kernel ran, so Decode's launch of the
    // device's wait returns only after the part: KVFERRY_TEST_NO_HOLD=1 (the memcheck runs) drops
    // the hold and keeps the rest.
    const char* no_hold = std::getenv("KVFERRY_TEST_NO_HOLD");
    const bool held = test_policy && (no_hold == nullptr || std::string(no_hold) != "1");
    auto same_step = [&](int step, bool planned) {
      if (planned) {
        for (auto& r : rt) ASSERT_TRUE(r->PlanDecode(seqs).ok());
      }
      for (int layer = 0; layer < m.num_layers; ++layer) {
        auto q = random(q_bytes / 4), k = random(kv_bytes / 4), v = random(kv_bytes / 4);
        g_cpu_hold_timed_out = false;
        ASSERT_TRUE(decode(0, layer, q, k, v, held).ok());
        ASSERT_TRUE(rt[0]->Synchronize().ok());
        ASSERT_FALSE(g_cpu_hold_timed_out.load()) << "Decode waited for the CPU part, step " << step;
        ASSERT_TRUE(decode(1, layer, q, k, v, false).ok());
        ASSERT_TRUE(rt[1]->Synchronize().ok());
        const std::vector<float> a = read_out(0, layer), b = read_out(1, layer);
        for (size_t i = 0; i < a.size(); ++i) {
          ASSERT_FALSE(std::isnan(a[i])) << "unwritten output " << i;
          ASSERT_EQ(0, std::memcmp(&a[i], &b[i], sizeof(float))) << "step " << step << " layer " << layer;
        }
        for (SequenceId s : seqs) {
          for (int h = 0; h < m.num_kv_heads; ++h) {
            EXPECT_EQ(*rt[0]->LastSelection(s, layer, h), *rt[1]->LastSelection(s, layer, h));
          }
        }
      }
    };
    for (int step = 0; step < 12; ++step) ASSERT_NO_FATAL_FAILURE(same_step(step, step % 3 != 2));
    // Back-to-back layers without a wait between them: the second Decode collects the first's
    // part before its own.
    {
      std::vector<float> outs[2][2];
      for (int r = 0; r < 2; ++r) {
        std::mt19937 same(77);
        std::normal_distribution<float> nd2(0.f, 1.f);
        auto rnd = [&](size_t n) {
          std::vector<float> x(n);
          for (float& e : x) e = nd2(same);
          return x;
        };
        ASSERT_TRUE(rt[r]->PlanDecode(seqs).ok());
        for (int layer = 0; layer < m.num_layers; ++layer) {
          auto q = rnd(q_bytes / 4), k = rnd(kv_bytes / 4), v = rnd(kv_bytes / 4);
          ASSERT_TRUE(decode(r, layer, q, k, v, false).ok());
        }
        ASSERT_TRUE(rt[r]->Synchronize().ok());
        for (int layer = 0; layer < 2; ++layer) outs[r][layer] = read_out(r, layer);
      }
      for (int layer = 0; layer < 2; ++layer) {
        ASSERT_EQ(0, std::memcmp(outs[0][layer].data(), outs[1][layer].data(), q_bytes)) << "layer " << layer;
      }
    }
    const Stats sa = rt[0]->GetStats(), sb = rt[1]->GetStats();
    EXPECT_EQ(sa.decode_steps, sb.decode_steps);
    EXPECT_EQ(sa.decode_planned, sb.decode_planned);
    EXPECT_EQ(sa.rows_cpu, sb.rows_cpu);
    EXPECT_EQ(sa.rows_selected, sb.rows_selected);
    EXPECT_EQ(sa.bytes_h2d, sb.bytes_h2d);
    EXPECT_EQ(sa.bytes_d2h, sb.bytes_d2h);
    EXPECT_GT(sa.rows_cpu, 0);
    if (test_policy) {
      // A failing CPU part: Decode returns, Synchronize returns the failure, the layer is as before.
      ASSERT_TRUE(rt[0]->PlanDecode(seqs).ok());
      auto q = random(q_bytes / 4), k = random(kv_bytes / 4), v = random(kv_bytes / 4);
      g_cpu_fail = true;
      const Status st = decode(0, 0, q, k, v, false);
      EXPECT_TRUE(st.ok()) << st.ToString();  // the failure comes later
      const Status later = rt[0]->Synchronize();
      g_cpu_fail = false;
      EXPECT_EQ(later.code(), StatusCode::kInternal) << later.ToString();
      EXPECT_NE(later.message().find("injected"), std::string::npos) << later.ToString();
      EXPECT_TRUE(rt[0]->Synchronize().ok());  // returned once
      // Layer 0 is as before the call (layer 1 of that plan never ran: the next PlanDecode gives
      // it back).
      for (size_t i = 0; i < seqs.size(); ++i) {
        EXPECT_EQ(*rt[0]->SequenceLength(seqs[i], 0), *rt[1]->SequenceLength(seqs[i], 0));
      }
      EXPECT_EQ(rt[0]->GetStats().decode_steps, rt[1]->GetStats().decode_steps);
      // 40 steps pass the ring (32 rows) round once.
      for (int step = 0; step < 40; ++step) ASSERT_NO_FATAL_FAILURE(same_step(100 + step, true));
    }
    for (auto& per_rt : d) {
      for (auto& per : per_rt) {
        for (void* p : per) dev->FreeDevice(p);
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
  // kvpop_mlp_test: 2964 slots (six a thread of its kernel's step path), caught up from 5000 and
  // 4100 stored tokens in the first step.
  const bool kvpop = GetParam() == "kvpop_mlp_test";
  if (kvpop) testing_util::RegisterKvpopMlpTestPolicy();
  // sparcas_ties: every prompt key one of two rows, so that the weights tie exactly at the 160th
  // place (thousands of equal keys: the multi-CTA top-k's ties, lower position first).
  const std::string policy = GetParam().rfind("sparcas", 0) == 0 ? "sparcas" : GetParam();
  const bool ties = GetParam() == "sparcas_ties";
  const int64_t budget = GetParam() == "hip" || kvpop ? 3000 : 160;
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
    cfg.policy.name = policy;
    cfg.policy.budget_tokens = budget;
    if (policy == "sparcas") cfg.policy.params["dense_layers"] = 1;
    if (GetParam() == "hip") {  // one-token blocks: 2964 nodes, 5928 branches an iteration
      cfg.policy.params["dense_layers"] = 1;
      cfg.policy.params["bk"] = 1;
      cfg.policy.params["r_m"] = 2;
    }
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
  std::vector<float> patterns(static_cast<size_t>(m.num_layers) * 2 * m.num_kv_heads * m.head_dim);
  if (ties) fill(patterns);
  for (int i = 0; i < 2; ++i) {
    for (int64_t c0 = 0; c0 < prompt[i]; c0 += 1024) {
      const int64_t t = std::min<int64_t>(1024, prompt[i] - c0);
      for (int layer = 0; layer < m.num_layers; ++layer) {
        std::vector<float> k(t * m.num_kv_heads * m.head_dim), v(k.size());
        fill(k);
        fill(v);
        if (ties) {  // position p's keys: the layer's pattern p % 2
          const size_t row = static_cast<size_t>(m.num_kv_heads) * m.head_dim;
          for (int64_t r = 0; r < t; ++r) {
            std::copy_n(patterns.begin() + (layer * 2 + (c0 + r) % 2) * row, row, k.begin() + r * row);
          }
        }
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
    // The last three steps time the device selection (Runtime::TimeDeviceSelect): the same
    // selections and outputs, and a time in Stats.
    if (step == 3) ASSERT_TRUE(rt[0]->TimeDeviceSelect(true).ok());
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
          EXPECT_EQ(static_cast<int64_t>(a.value().size()), budget);
          EXPECT_EQ(a.value(), b.value()) << "selection differs, seq " << s << " step " << step
                                          << " layer " << layer << " head " << h;
        }
      }
    }
  }
  EXPECT_GT(rt[0]->GetStats().ms_select_device, 0.0);
  EXPECT_EQ(rt[1]->GetStats().ms_select_device, 0.0);  // not turned on there
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaRuntimeLong,
                         ::testing::Values("oracle", "sparcas", "sparcas_ties", "hip", "kvpop_mlp_test"));

}  // namespace
}  // namespace kvferry
