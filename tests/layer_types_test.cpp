// Copyright kvferry authors. Apache-2.0.
// Per-layer attention types (ModelShape::layer_window): a sliding-window layer equals dense
// attention over its window (decode) and windowed causal attention (prefill, append), against the
// scalar reference on fresh random inputs; the global layers of a mixed model give exactly what an
// all-global runtime gives; bad configurations and calls fail clearly and leave the other
// sequences intact; the accounting holds per layer (device bytes, no host pages, no PCIe bytes).
// Host backend, and the CUDA backend where a GPU is present (skipped otherwise).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "fault_device.h"
#include "kvferry/kvferry.h"

namespace kvferry {
namespace {

constexpr int kKvHeads = 2, kGroup = 2, kHeadDim = 64;
constexpr int kQHeads = kKvHeads * kGroup;
// The resident tier of these tests: 2 sinks and a window of 6, 8 rows a (slot, layer, KV head).
// A sliding window of 5 fits in it; one of 13 takes 5 more rows in the sliding-window rings.
constexpr int kSink = 2, kTierWindow = 6, kTier = kSink + kTierWindow;

RuntimeConfig Config(Backend backend, std::vector<int> windows, const std::string& policy = "dense",
                     int num_layers = -1) {
  RuntimeConfig c;
  c.model.num_layers = num_layers > 0 ? num_layers : static_cast<int>(windows.size());
  c.model.num_kv_heads = kKvHeads;
  c.model.num_q_heads = kQHeads;
  c.model.head_dim = kHeadDim;
  c.model.kv_dtype = DType::kBF16;
  c.model.layer_window = std::move(windows);
  c.capacity.max_sequences = 3;
  c.capacity.max_batch = 2;
  c.capacity.max_tokens_per_sequence = 256;
  c.capacity.max_prefill_chunk = 32;
  c.tiers.sink_tokens = kSink;
  c.tiers.window_tokens = kTierWindow;
  c.policy.name = policy;
  c.policy.budget_tokens = 12;
  c.backend = backend;
  c.cpu_threads = 2;
  c.probe_at_start = false;  // twins split work alike
  return c;
}

#define SKIP_WITHOUT(backend) \
  if ((backend) == Backend::kCuda && !CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)"

// A runtime and what the test knows of its sequences: every stored K/V row in bf16, per layer.
class Model {
 public:
  Model(const RuntimeConfig& config, uint32_t seed) : config_(config), rng_(seed) {
    auto r = Runtime::Create(config);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (r.ok()) rt_ = std::move(r).value();
  }
  bool ok() const { return rt_ != nullptr; }
  Runtime& rt() { return *rt_; }
  int layers() const { return config_.model.num_layers; }
  int window(int layer) const {
    return config_.model.layer_window.empty() ? 0 : config_.model.layer_window[layer];
  }

  std::vector<float> Random(int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = normal_(rng_);
    return x;
  }
  static TensorView View(std::vector<float>& x, int64_t rows, int heads) {
    return TensorView::Contiguous(x.data(), DType::kF32, MemoryKind::kHost, {rows, heads, kHeadDim});
  }
  void Add(SequenceId s) {
    ASSERT_TRUE(rt_->AddSequence(s).ok());
    k_[s].assign(static_cast<size_t>(layers()), {});
    v_[s].assign(static_cast<size_t>(layers()), {});
  }
  int64_t Length(SequenceId s, int layer) const {
    return static_cast<int64_t>(k_.at(s)[layer].size()) / (kKvHeads * kHeadDim);
  }
  void Record(SequenceId s, int layer, const std::vector<float>& k, const std::vector<float>& v,
              int64_t row0, int64_t rows) {
    for (int64_t i = row0 * kKvHeads * kHeadDim; i < (row0 + rows) * kKvHeads * kHeadDim; ++i) {
      k_[s][layer].push_back(cpu::F32ToBf16(k[i]));
      v_[s][layer].push_back(cpu::F32ToBf16(v[i]));
    }
  }
  // The scalar reference (cpu::AttendRowsRef) of one token's q [Hq, D] over positions
  // [first, last] of (s, layer): [Hq, D].
  std::vector<float> Reference(SequenceId s, int layer, const float* q, int64_t first,
                               int64_t last) const {
    std::vector<float> o(static_cast<size_t>(kQHeads * kHeadDim)), lse(kQHeads);
    const AttnParams params{kGroup, kHeadDim, DType::kBF16, 1.0f / std::sqrt(float{kHeadDim})};
    std::vector<const void*> kr, vr;
    for (int h = 0; h < kKvHeads; ++h) {
      kr.clear();
      vr.clear();
      for (int64_t p = first; p <= last; ++p) {
        kr.push_back(&k_.at(s)[layer][(p * kKvHeads + h) * kHeadDim]);
        vr.push_back(&v_.at(s)[layer][(p * kKvHeads + h) * kHeadDim]);
      }
      const RowAttnItem item{q + h * kGroup * kHeadDim, o.data() + h * kGroup * kHeadDim,
                             lse.data() + h * kGroup, kr.data(), vr.data(),
                             static_cast<int32_t>(kr.size())};
      cpu::AttendRowsRef(params, item);
    }
    return o;
  }
  // The positions a query at p attends: its window at a sliding layer, [0, p] at a global one.
  int64_t First(int layer, int64_t p) const {
    return window(layer) > 0 ? std::max<int64_t>(0, p - window(layer) + 1) : 0;
  }

  // A prefill (or, with append, an Append) chunk of T fresh tokens of s at layer; returns the
  // largest relative L2 error of a row of the output against the reference (0 for an append).
  Result<double> Chunk(SequenceId s, int layer, int64_t tokens, bool append = false) {
    std::vector<float> q = Random(tokens * kQHeads * kHeadDim), k = Random(tokens * kKvHeads * kHeadDim),
                       v = Random(tokens * kKvHeads * kHeadDim), out(q.size(), NAN);
    const int64_t pos0 = Length(s, layer);
    Status st = append ? rt_->Append(s, layer, View(k, tokens, kKvHeads), View(v, tokens, kKvHeads))
                       : rt_->Prefill(s, layer, View(q, tokens, kQHeads), View(k, tokens, kKvHeads),
                                      View(v, tokens, kKvHeads), View(out, tokens, kQHeads));
    if (!st.ok()) return st;
    Record(s, layer, k, v, 0, tokens);
    double worst = 0;
    for (int64_t t = 0; !append && t < tokens; ++t) {
      const int64_t p = pos0 + t;
      const std::vector<float> ref = Reference(s, layer, &q[t * kQHeads * kHeadDim], First(layer, p), p);
      worst = std::max(worst, RelErr(&out[t * kQHeads * kHeadDim], ref));
    }
    return worst;
  }
  // One decode step of \p seqs at layer: outputs into \p out_all (if set) and the largest relative
  // error against the reference.
  Result<double> Step(const std::vector<SequenceId>& seqs, int layer,
                      std::vector<float>* out_all = nullptr) {
    const int64_t b = static_cast<int64_t>(seqs.size());
    std::vector<float> q = Random(b * kQHeads * kHeadDim), k = Random(b * kKvHeads * kHeadDim),
                       v = Random(b * kKvHeads * kHeadDim), out(q.size(), NAN);
    Status st = rt_->Decode(seqs, layer, View(q, b, kQHeads), View(k, b, kKvHeads),
                            View(v, b, kKvHeads), View(out, b, kQHeads));
    if (!st.ok()) return st;
    double worst = 0;
    for (int64_t i = 0; i < b; ++i) {
      Record(seqs[i], layer, k, v, i, 1);
      const int64_t p = Length(seqs[i], layer) - 1;
      const std::vector<float> ref =
          Reference(seqs[i], layer, &q[i * kQHeads * kHeadDim], First(layer, p), p);
      worst = std::max(worst, RelErr(&out[i * kQHeads * kHeadDim], ref));
    }
    if (out_all != nullptr) *out_all = out;
    return worst;
  }
  static double RelErr(const float* out, const std::vector<float>& ref) {
    double num = 0, den = 0;
    for (size_t e = 0; e < ref.size(); ++e) {
      const double diff = static_cast<double>(out[e]) - ref[e];
      num += diff * diff;
      den += static_cast<double>(ref[e]) * ref[e];
    }
    return den > 0 ? std::sqrt(num / den) : INFINITY;
  }

 private:
  RuntimeConfig config_;
  std::unique_ptr<Runtime> rt_;
  std::mt19937 rng_;
  std::normal_distribution<float> normal_;
  std::map<SequenceId, std::vector<std::vector<uint16_t>>> k_, v_;
};

double Tolerance(Backend b) { return b == Backend::kCuda ? 2e-3 : 1e-4; }

class LayerTypes : public ::testing::TestWithParam<Backend> {};

// Windows of 1 (the token alone), 5 (inside the tier's rows), 13 (beyond them) and a global
// layer (dense): every prefill row and every decode against the reference, over prompts shorter
// and longer than the windows, in chunks of every size (1, shorter and longer than a window, the
// largest), an Append among them (its rows in the next chunk's windows), batches of two.
TEST_P(LayerTypes, SlidingLayersEqualDenseAttentionOverTheirWindow) {
  SKIP_WITHOUT(GetParam());
  Model m(Config(GetParam(), {1, 5, 0, 13}), 11);
  ASSERT_TRUE(m.ok());
  const double tol = Tolerance(GetParam());
  m.Add(1);
  m.Add(2);
  const std::vector<std::pair<int64_t, bool>> chunks = {{3, false}, {1, false}, {20, false}, {7, true},
                                                        {32, false}, {2, false}};
  // The global layer's dense prefill rounds q and the weights to the KV dtype (docs/runtime.md,
  // "Prefill precision"); a sliding layer's prefill attends in f32, as a decode does.
  auto prefill_tol = [&](int layer) { return m.window(layer) > 0 ? tol : 3e-2; };
  for (int layer = 0; layer < m.layers(); ++layer) {
    for (auto [tokens, append] : chunks) {
      Result<double> err = m.Chunk(1, layer, tokens, append);
      ASSERT_TRUE(err.ok()) << err.status().ToString();
      EXPECT_LT(err.value(), prefill_tol(layer)) << "layer " << layer << " chunk of " << tokens;
    }
    Result<double> err = m.Chunk(2, layer, 4);  // shorter than the widest window
    ASSERT_TRUE(err.ok()) << err.status().ToString();
    EXPECT_LT(err.value(), prefill_tol(layer)) << "layer " << layer;
  }
  for (int step = 0; step < 24; ++step) {
    for (int layer = 0; layer < m.layers(); ++layer) {
      Result<double> err = m.Step({2, 1}, layer);
      ASSERT_TRUE(err.ok()) << err.status().ToString();
      EXPECT_LT(err.value(), tol) << "step " << step << " layer " << layer;
    }
  }
  // A prompt continued after decodes, then decodes again (the ring's rows in a chunk's windows).
  for (int layer = 0; layer < m.layers(); ++layer) {
    Result<double> err = m.Chunk(2, layer, 9);
    ASSERT_TRUE(err.ok()) << err.status().ToString();
    EXPECT_LT(err.value(), prefill_tol(layer)) << "layer " << layer;
    err = m.Step({1, 2}, layer);
    ASSERT_TRUE(err.ok()) << err.status().ToString();
    EXPECT_LT(err.value(), tol) << "layer " << layer;
  }
  EXPECT_EQ(m.rt().SequenceLength(1, 3).value(), 65 + 25);
  Result<std::vector<int32_t>> sel = m.rt().LastSelection(1, 3, 1);
  ASSERT_TRUE(sel.ok());
  std::vector<int32_t> want(13);
  std::iota(want.begin(), want.end(), 90 - 13);
  EXPECT_EQ(sel.value(), want);
  EXPECT_FALSE(m.rt().decode_is_capture_safe());
}

// The global layers of a model with sliding layers compute exactly what they compute in an
// all-global runtime of the same configuration (same inputs at every global layer), for policies
// of every kind (dense, the device-selecting ones in the planned step, host selections, a CPU
// placement, a token bank, a PrHS wrapper), with and without PlanDecode. (xl+ is left out: its layers take the
// previous layer's list, which a sliding layer does not have.)
TEST_P(LayerTypes, GlobalLayersAreUnchangedBesideSlidingOnes) {
  SKIP_WITHOUT(GetParam());
  struct Case {
    std::string policy;
    int bank_slots;
  };
  const std::vector<Case> cases = {{"dense", 0}, {"streaming", 0}, {"oracle", 0}, {"oracle", 16},
                                   {"quest", 0}, {"sparcas", 0},   {"lfps", 0},   {"hip", 0},
                                   {"kvpop", 0}, {"cis+oracle", 0}};
  const std::vector<int> windows = {0, 7, 0, 13, 0};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.policy + " bank " + std::to_string(c.bank_slots));
    RuntimeConfig mixed_config = Config(GetParam(), windows, c.policy);
    mixed_config.tiers.bank_slots = c.bank_slots;
    mixed_config.capacity.max_tokens_per_sequence = 512;
    mixed_config.capacity.max_prefill_chunk = 64;
    RuntimeConfig global_config = mixed_config;
    global_config.model.layer_window.clear();
    Model mixed(mixed_config, 5), global(global_config, 5);
    ASSERT_TRUE(mixed.ok() && global.ok());
    for (SequenceId s : {1, 2}) {
      mixed.Add(s);
      global.Add(s);
    }
    for (int layer = 0; layer < 5; ++layer) {
      for (SequenceId s : {1, 2}) {
        for (int64_t tokens : {int64_t{64}, 40 + 10 * static_cast<int64_t>(s)}) {
          // The same random stream in both: equal inputs at every layer.
          ASSERT_TRUE(mixed.Chunk(s, layer, tokens).ok());
          ASSERT_TRUE(global.Chunk(s, layer, tokens).ok());
        }
      }
    }
    for (int step = 0; step < 12; ++step) {
      if (step % 2 == 1) {
        const SequenceId batch[] = {1, 2};
        ASSERT_TRUE(mixed.rt().PlanDecode(batch).ok());
        ASSERT_TRUE(global.rt().PlanDecode(batch).ok());
      }
      for (int layer = 0; layer < 5; ++layer) {
        std::vector<float> a, b;
        Result<double> ea = mixed.Step({1, 2}, layer, &a);
        Result<double> eb = global.Step({1, 2}, layer, &b);
        ASSERT_TRUE(ea.ok()) << ea.status().ToString();
        ASSERT_TRUE(eb.ok()) << eb.status().ToString();
        if (windows[layer] > 0) {
          EXPECT_LT(ea.value(), Tolerance(GetParam())) << "sliding layer " << layer;
          continue;
        }
        ASSERT_EQ(a, b) << "global layer " << layer << " step " << step;
        for (SequenceId s : {1, 2}) {
          EXPECT_EQ(mixed.rt().LastSelection(s, layer, 1).value(),
                    global.rt().LastSelection(s, layer, 1).value());
        }
      }
    }
  }
}

// Create refuses a bad window list with kInvalidArgument and a message that names the field.
TEST(LayerTypesConfig, BadWindowsAreRefusedClearly) {
  struct Bad {
    std::vector<int> windows;
    const char* says;
  };
  const std::vector<Bad> bad = {
      {{0, 8}, "layer_window has 2 entries; expected num_layers=3"},
      {{0, 8, 0, 8}, "layer_window has 4 entries; expected num_layers=3"},
      {{0, -4, 0}, "layer_window[1] = -4 must be >= 0"},
      {{0, 0, 257}, "layer_window[2] = 257 exceeds max_tokens_per_sequence 256"},
  };
  for (const Bad& b : bad) {
    auto r = Runtime::Create(Config(Backend::kHost, b.windows, "dense", 3));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(b.says), std::string::npos) << r.status().ToString();
  }
  // Zeros only (or none) is an all-global model; a window of the whole capacity is allowed.
  for (const std::vector<int>& ok : {std::vector<int>{0, 0, 0}, std::vector<int>{},
                                     std::vector<int>{256, 1, 0}}) {
    auto r = Runtime::Create(Config(Backend::kHost, ok, "dense", 3));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
  }
}

// Bad calls at a sliding layer fail with the usual codes and change nothing: the other sequence
// of the batch, and the failing sequence itself, go on as if the call had not been made. Device
// failures (injected) after the ring was written roll the layer back: the retried call is exact.
TEST_P(LayerTypes, FailedCallsLeaveSequencesIntact) {
  SKIP_WITHOUT(GetParam());
  ::kvferry::testing::ScopedFaults faults;
  Model m(Config(GetParam(), {9, 0}), 3);
  ASSERT_TRUE(m.ok());
  const double tol = Tolerance(GetParam());
  m.Add(1);
  m.Add(2);
  ASSERT_TRUE(m.Chunk(1, 0, 20).ok());
  // Sequence 2 has no prompt: the batch is refused before anything happens.
  Result<double> err = m.Step({1, 2}, 0);
  EXPECT_EQ(err.status().code(), StatusCode::kFailedPrecondition) << err.status().ToString();
  EXPECT_EQ(m.rt().SequenceLength(1, 0).value(), 20);
  std::vector<float> q = m.Random(40 * kQHeads * kHeadDim), k = m.Random(40 * kKvHeads * kHeadDim);
  std::vector<float> out(q.size());
  Status st = m.rt().Prefill(1, 0, Model::View(q, 40, kQHeads), Model::View(k, 40, kKvHeads),
                             Model::View(k, 40, kKvHeads), Model::View(out, 40, kQHeads));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();  // over max_prefill_chunk
  st = m.rt().Decode(std::vector<SequenceId>{1, 7}, 0, Model::View(q, 2, kQHeads),
                     Model::View(k, 2, kKvHeads), Model::View(k, 2, kKvHeads), Model::View(out, 2, kQHeads));
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
  EXPECT_EQ(m.rt().SequenceLength(1, 0).value(), 20);
  // Injected: the prefill's last wait fails after its ring write, and the decode's attention.
  faults.faults().FailNth(::kvferry::testing::FaultPoint::kSynchronizeStream, 1);
  err = m.Chunk(1, 0, 6);
  EXPECT_EQ(err.status().code(), StatusCode::kDeviceError) << err.status().ToString();
  EXPECT_EQ(faults.faults().fired(), 1);
  EXPECT_EQ(m.rt().SequenceLength(1, 0).value(), 20);
  faults.faults().FailNth(::kvferry::testing::FaultPoint::kAttendRows, 1);
  err = m.Step({1}, 0);
  EXPECT_EQ(err.status().code(), StatusCode::kDeviceError) << err.status().ToString();
  EXPECT_EQ(faults.faults().fired(), 2);
  EXPECT_EQ(m.rt().SequenceLength(1, 0).value(), 20);
  // Retried, and on: exact over the windows.
  for (int64_t tokens : {6, 3}) {
    err = m.Chunk(1, 0, tokens);
    ASSERT_TRUE(err.ok()) << err.status().ToString();
    EXPECT_LT(err.value(), tol);
  }
  ASSERT_TRUE(m.Chunk(2, 0, 5).ok());
  ASSERT_TRUE(m.Chunk(2, 1, 5).ok());
  ASSERT_TRUE(m.Chunk(1, 1, 29).ok());
  for (int step = 0; step < 12; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      err = m.Step({1, 2}, layer);
      ASSERT_TRUE(err.ok()) << err.status().ToString();
      EXPECT_LT(err.value(), tol) << "step " << step << " layer " << layer;
    }
  }
}

// A planned step (PlanDecode) runs the sliding layers too, in any order; a sliding layer left out
// of the step is rolled back with the others at the next PlanDecode.
TEST_P(LayerTypes, PlannedStepsRunSlidingLayers) {
  SKIP_WITHOUT(GetParam());
  Model m(Config(GetParam(), {0, 5, 13}, "streaming"), 9);
  ASSERT_TRUE(m.ok());
  m.Add(1);
  for (int layer = 0; layer < 3; ++layer) ASSERT_TRUE(m.Chunk(1, layer, 30).ok());
  const SequenceId batch[] = {1};
  for (int step = 0; step < 6; ++step) {
    ASSERT_TRUE(m.rt().PlanDecode(batch).ok());
    for (int layer : {2, 0, 1}) {
      Result<double> err = m.Step({1}, layer);
      ASSERT_TRUE(err.ok()) << err.status().ToString();
      if (layer > 0) EXPECT_LT(err.value(), Tolerance(GetParam())) << "layer " << layer;
    }
  }
  ASSERT_TRUE(m.rt().PlanDecode(batch).ok());
  Result<double> err = m.Step({1}, 0);  // the step's other layers never run
  ASSERT_TRUE(err.ok());
  Result<double> more = m.Chunk(1, 0, 2);  // retires the plan: layers 1 and 2 take it back
  ASSERT_TRUE(more.ok());
  EXPECT_EQ(m.rt().SequenceLength(1, 1).value(), 36);
  EXPECT_EQ(m.rt().SequenceLength(1, 2).value(), 36);
  for (int layer : {1, 2}) {
    err = m.Step({1}, layer);
    ASSERT_TRUE(err.ok()) << err.status().ToString();
    EXPECT_LT(err.value(), Tolerance(GetParam()));
  }
}

// Device memory per layer, the rings as a part of their own, no host-store pages and no PCIe
// bytes for sliding layers, their decode rows in rows_window.
TEST_P(LayerTypes, AccountingIsPerLayer) {
  SKIP_WITHOUT(GetParam());
  Model m(Config(GetParam(), {5, 0, 13}), 4);
  ASSERT_TRUE(m.ok());
  const int64_t row = kHeadDim * 2;  // bf16
  const int64_t seqs = 3, tier_share = seqs * kKvHeads * 2 * kTier * row;
  const DeviceMemoryPlan& plan = m.rt().device_memory();
  ASSERT_EQ(plan.layer_bytes.size(), 3u);
  EXPECT_EQ(plan.layer_bytes[0], tier_share);  // the window of 5 lives in the tier's 8 rows
  EXPECT_EQ(plan.layer_bytes[1], tier_share);
  EXPECT_EQ(plan.layer_bytes[2], tier_share + seqs * kKvHeads * 2 * (13 - kTier) * row);
  std::map<std::string, int64_t> parts;
  for (const auto& p : plan.parts) parts[p.name] = p.bytes;
  EXPECT_EQ(parts["sliding-window rings"], seqs * kKvHeads * 2 * (13 - kTier) * row);
  EXPECT_EQ(parts["sliding-window prefill staging"], kKvHeads * 2 * (13 - 1 + 32) * row);
  EXPECT_EQ(parts["resident tier"], 3 * tier_share);
  EXPECT_EQ(m.rt().GetStats().device_bytes_reserved, plan.total_bytes) << plan.ToString();

  const int64_t host_at_create = m.rt().GetStats().host_bytes_reserved;
  m.Add(1);
  m.Add(2);
  for (int layer : {0, 2}) {
    for (SequenceId s : {1, 2}) ASSERT_TRUE(m.Chunk(s, layer, 30).ok());
    ASSERT_TRUE(m.Chunk(1, layer, 4, /*append=*/true).ok());
  }
  for (int step = 0; step < 5; ++step) {
    for (int layer : {0, 2}) ASSERT_TRUE(m.Step({1, 2}, layer).ok());
  }
  Stats s = m.rt().GetStats();
  EXPECT_EQ(s.bytes_h2d, 0);
  EXPECT_EQ(s.bytes_d2h, 0);
  EXPECT_EQ(s.host_bytes_reserved, host_at_create) << "a sliding layer holds no host-store page";
  EXPECT_EQ(s.rows_selected, 0);
  EXPECT_EQ(s.rows_window, 5 * kKvHeads * 2 * (5 + 13));
  EXPECT_EQ(s.decode_tokens, 5 * 2 * 2);
  EXPECT_EQ(s.prefill_tokens, 2 * (30 + 30 + 4));
  // The global layer: pages and PCIe bytes as before.
  for (SequenceId sq : {1, 2}) ASSERT_TRUE(m.Chunk(sq, 1, 30).ok());
  ASSERT_TRUE(m.Step({1, 2}, 1).ok());
  s = m.rt().GetStats();
  EXPECT_GT(s.host_bytes_reserved, host_at_create);
  EXPECT_GT(s.bytes_d2h, 0);
  EXPECT_EQ(s.rows_selected, 2 * kKvHeads * 31);
  EXPECT_TRUE(s.ToJson().find("\"rows_window\":") != std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Backends, LayerTypes, ::testing::Values(Backend::kHost, Backend::kCuda),
                         [](const ::testing::TestParamInfo<Backend>& info) {
                           return std::string(info.param == Backend::kCuda ? "Cuda" : "Host");
                         });

}  // namespace
}  // namespace kvferry
