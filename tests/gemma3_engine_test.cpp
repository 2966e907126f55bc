// Copyright kvferry authors. Apache-2.0.
// Gemma 3 in the engine, on tests/data/gemma3_tiny.gguf: a random Gemma-3-shaped model (6 layers,
// layer 5 global and the others sliding-window of 8 tokens, 4 query heads and 1 KV head of 64
// dims, QK-norm, sandwich norms, GeGLU, tied embeddings; tensors in F32/F16/Q8_0/Q4_0/Q4_1/Q5_0/
// Q5_1/Q4_K/Q5_K/Q6_K) whose file also holds a prompt and the logits of an independent numpy
// forward pass over the same (dequantised) weights (examples/llama/scripts/gen_gemma3_tiny.py;
// that reference agrees with Hugging Face transformers loading the same file to 5e-6).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "examples/llama/engine.h"
#include "examples/llama/eval.h"
#include "examples/llama/gguf.h"
#include "examples/llama/model.h"
#include "kvferry/status_macros.h"
#include "tests/llama_test_util.h"

namespace kvferry::llama {
namespace {

std::string TinyPath() { return std::string(KVFERRY_TEST_DATA_DIR) + "/gemma3_tiny.gguf"; }

struct Fixture {
  Model model;
  std::vector<int32_t> tokens;
  std::vector<float> logits;  // [tokens, vocab]
};

const Fixture& Tiny() {
  static const Fixture* fx = [] {
    auto* f = new Fixture();
    auto model = LoadModel(TinyPath());
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    if (model.ok()) f->model = std::move(model.value());
    auto bytes = ReadFileBytes(TinyPath());
    EXPECT_TRUE(bytes.ok());
    auto file = GgufFile::Parse(*bytes);
    EXPECT_TRUE(file.ok()) << file.status().ToString();
    auto toks = file->Find("kvferry.test.tokens");
    auto logits = file->Find("kvferry.test.logits");
    EXPECT_TRUE(toks.ok() && logits.ok());
    for (double t : (*toks)->nums) f->tokens.push_back(static_cast<int32_t>(t));
    for (double x : (*logits)->nums) f->logits.push_back(static_cast<float>(x));
    return f;
  }();
  return *fx;
}

// max |got - want| over rows [r0, r0 + rows) of the expected logits, relative to their max |.|.
double RelErr(const std::vector<float>& got, int64_t r0, int64_t rows) {
  const Fixture& fx = Tiny();
  const int64_t vocab = fx.model.config.vocab_size;
  double err = 0, mx = 0;
  for (int64_t i = 0; i < rows * vocab; ++i) {
    const double want = fx.logits[r0 * vocab + i];
    err = std::max(err, std::fabs(got[i] - want));
    mx = std::max(mx, std::fabs(want));
  }
  return err / mx;
}

TEST(Gemma3Engine, ConfigFromMetadata) {
  const ModelConfig& c = Tiny().model.config;
  EXPECT_EQ(c.arch, Arch::kGemma3);
  EXPECT_EQ(c.num_layers, 6);
  EXPECT_EQ(c.dim, 32);
  EXPECT_EQ(c.hidden_dim, 256);
  EXPECT_EQ(c.num_q_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 1);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 300);
  EXPECT_EQ(c.max_context, 128);
  EXPECT_FLOAT_EQ(c.rope_theta, 1e6f);
  EXPECT_FLOAT_EQ(c.rope_theta_sliding, 1e4f);
  EXPECT_FLOAT_EQ(c.attn_scale, 0.125f);
  EXPECT_FLOAT_EQ(c.embed_scale, std::sqrt(32.0f));
  EXPECT_EQ(c.activation, Activation::kGeluTanh);
  EXPECT_EQ(c.layer_window, (std::vector<int>{8, 8, 8, 8, 8, 0}));
  EXPECT_TRUE(Tiny().model.output.data.empty());  // tied classifier
  EXPECT_EQ(Tiny().tokens.size(), 24u);
  EXPECT_EQ(Tiny().logits.size(), 24u * 300u);
}

TEST(Gemma3Engine, ExactReferenceMatchesNumpyLogits) {
  const Fixture& fx = Tiny();
  Engine engine(fx.model);
  auto attn = MakeReferenceAttention(fx.model.config);
  Attention* attns[1] = {attn.get()};
  std::vector<float> logits;
  ASSERT_TRUE(engine.Prefill(fx.tokens, 0, attns, &logits, /*all_logits=*/true).ok());
  const double err = RelErr(logits, 0, static_cast<int64_t>(fx.tokens.size()));
  std::printf("reference attention: max |dlogit| / max |logit| = %.3g\n", err);
  EXPECT_LT(err, 1e-4);
  // The check sees the sliding windows: the same model with windows wider than the prompt (the
  // sliding layers' RoPE base kept) is far off.
  Model all_global = fx.model;
  for (int& w : all_global.config.layer_window) w = w > 0 ? 1 << 20 : 0;
  Engine dense(all_global);
  auto dense_attn = MakeReferenceAttention(all_global.config);
  Attention* dense_attns[1] = {dense_attn.get()};
  ASSERT_TRUE(dense.Prefill(fx.tokens, 0, dense_attns, &logits, true).ok());
  const double err_dense = RelErr(logits, 0, static_cast<int64_t>(fx.tokens.size()));
  std::printf("windows of 2^20 instead: max |dlogit| / max |logit| = %.3g\n", err_dense);
  EXPECT_GT(err_dense, 1e-2);
}

std::unique_ptr<RuntimeAttention> MakeRuntime(const std::string& policy, DType kv,
                                              Backend backend = Backend::kHost) {
  return testing_util::MakeLlamaRuntime(Tiny().model.config, policy, kv, backend);
}

TEST(Gemma3Engine, RuntimeTakesTheModelsLayerWindows) {
  auto attn = MakeRuntime("dense", DType::kF16);
  ASSERT_NE(attn, nullptr);
  const RuntimeConfig& c = attn->runtime().config();
  EXPECT_EQ(c.model.num_layers, 6);  // one Runtime: layer 5 global, the others windows of 8
  EXPECT_EQ(c.model.layer_window, (std::vector<int>{8, 8, 8, 8, 8, 0}));
  EXPECT_EQ(c.policy.name, "dense");
  EXPECT_EQ(c.tiers.sink_tokens, 2);
  EXPECT_FLOAT_EQ(c.model.softmax_scale, 0.125f);
  // A window wider than the capacity is the whole sequence: clamped to it.
  ModelConfig wide = Tiny().model.config;
  for (int& w : wide.layer_window) w = w > 0 ? 1000 : 0;
  RuntimeConfig rc;
  rc.backend = Backend::kHost;
  rc.policy.name = "dense";
  rc.capacity.max_tokens_per_sequence = 128;
  rc.probe_at_start = false;
  auto clamped = RuntimeAttention::Create(RuntimeConfigFor(wide, rc), wide);
  ASSERT_TRUE(clamped.ok()) << clamped.status().ToString();
  EXPECT_EQ(clamped.value()->runtime().config().model.layer_window[0], 128);
}

// Prefill of the whole prompt and prefill of a part, in chunks, then decode, through the Runtime
// (its sliding layers: windowed prefill and decode); f16 and bf16 KV.
TEST(Gemma3Engine, RuntimeMatchesNumpyLogits) {
  const Fixture& fx = Tiny();
  const int64_t n = static_cast<int64_t>(fx.tokens.size());
  const int64_t vocab = fx.model.config.vocab_size;
  for (DType kv : {DType::kF16, DType::kBF16}) {
    const double tol = kv == DType::kF16 ? 1e-3 : 1e-2;
    const char* kv_name = kv == DType::kF16 ? "f16" : "bf16";
    Engine engine(fx.model);
    auto attn = MakeRuntime("dense", kv);
    ASSERT_NE(attn, nullptr);
    Attention* attns[1] = {attn.get()};
    std::vector<float> logits;
    ASSERT_TRUE(engine.Prefill(fx.tokens, 0, attns, &logits, true).ok());
    const double err_prefill = RelErr(logits, 0, n);
    // Prompt of 11 in chunks of 3 (chunks past the window of 8 attend rows of the one before),
    // then 13 decode steps; each step's logits against the reference's row.
    ASSERT_TRUE(attn->Reset().ok());
    Engine engine2(fx.model);
    const int64_t prompt = 11;
    std::vector<float> step;
    ASSERT_TRUE(engine2
                    .Prefill(std::span<const int32_t>(fx.tokens.data(), prompt), 0, attns, &step,
                             false, /*chunk=*/3)
                    .ok());
    double err_decode = RelErr(step, prompt - 1, 1);
    for (int64_t t = prompt; t < n; ++t) {
      Status st = engine2.Decode(fx.tokens[t], t, *attn, &step);
      ASSERT_TRUE(st.ok()) << st.ToString();
      ASSERT_EQ(static_cast<int64_t>(step.size()), vocab);
      err_decode = std::max(err_decode, RelErr(step, t, 1));
    }
    std::printf("runtime (dense global, window-8 sliding), KV %s: max |dlogit| / max |logit| "
                "prefill %.3g, prefill+decode %.3g\n", kv_name, err_prefill, err_decode);
    EXPECT_LT(err_prefill, tol) << kv_name;
    EXPECT_LT(err_decode, tol) << kv_name;
  }
}

// Prefills the tiny model's first \p prompt tokens (in chunks of \p chunk) into \p attn and
// decodes the rest token by token; \p logits gets the prefill's last row, then every step's.
Status RunTiny(Engine& engine, Attention& attn, int64_t prompt, int64_t chunk,
               std::vector<std::vector<float>>* logits) {
  const Fixture& fx = Tiny();
  Attention* attns[1] = {&attn};
  std::vector<float> step;
  KVF_RETURN_IF_ERROR(engine.Prefill(std::span<const int32_t>(fx.tokens.data(), prompt), 0, attns, &step,
                                     false, chunk));
  logits->push_back(step);
  for (int64_t t = prompt; t < static_cast<int64_t>(fx.tokens.size()); ++t) {
    KVF_RETURN_IF_ERROR(engine.Decode(fx.tokens[t], t, attn, &step));
    logits->push_back(step);
  }
  return Status::Ok();
}

// max |got - want| / max |want| over every step's logits; infinity where got is not finite.
double MaxRelDiff(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want) {
  double diff = 0, mx = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    for (size_t j = 0; j < want[i].size(); ++j) {
      if (!std::isfinite(got[i][j])) return std::numeric_limits<double>::infinity();
      diff = std::max(diff, static_cast<double>(std::fabs(got[i][j] - want[i][j])));
      mx = std::max(mx, static_cast<double>(std::fabs(want[i][j])));
    }
  }
  return diff / mx;
}

// The engine on the CUDA backend: the same prompt (in chunks of 3) and decode steps as the host
// backend, for dense and every policy with a device path (the sliding layers' rings and windowed
// prefill, the global layer's selection on the GPU); dense also against the numpy logits. The
// two backends sum in other orders, so they agree to rounding, not bit for bit. Skips without a GPU.
TEST(Gemma3Engine, CudaBackendMatchesTheHostBackend) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  const Fixture& fx = Tiny();
  const int64_t n = static_cast<int64_t>(fx.tokens.size()), prompt = 11;
  for (const char* policy : {"dense", "streaming", "oracle", "quest", "sparcas", "hip", "kvpop", "lfps"}) {
    std::vector<std::vector<float>> logits[2];  // [backend][step]
    for (int b = 0; b < 2; ++b) {
      auto attn = MakeRuntime(policy, DType::kF16, b == 0 ? Backend::kCuda : Backend::kHost);
      ASSERT_NE(attn, nullptr) << policy;
      Engine engine(fx.model);
      const Status st = RunTiny(engine, *attn, prompt, /*chunk=*/3, &logits[b]);
      ASSERT_TRUE(st.ok()) << policy << ": " << st.ToString();
    }
    const double rel = MaxRelDiff(logits[0], logits[1]);
    std::printf("%s: CUDA vs host backend, max |dlogit| / max |logit| = %.3g\n", policy, rel);
    EXPECT_LT(rel, 1e-3) << policy;
    if (std::string(policy) == "dense") {
      double err = RelErr(logits[0][0], prompt - 1, 1);
      for (int64_t t = prompt; t < n; ++t) err = std::max(err, RelErr(logits[0][t - prompt + 1], t, 1));
      EXPECT_LT(err, 1e-3) << "CUDA dense against the numpy logits";
    }
  }
}

// Three lanes (dense, sparcas, quest) of \p model decoded together on the device, interleaved
// with each decoded alone on the same engine: equal logits at every step. Returns the engine's
// (graph captures, graph steps).
std::pair<int64_t, int64_t> ExpectLanesTogetherEqualAlone(const Model& model, int64_t prompt) {
  const Fixture& fx = Tiny();
  const int64_t n = static_cast<int64_t>(fx.tokens.size());
  const char* lane_policies[3] = {"dense", "sparcas", "quest"};
  std::vector<std::unique_ptr<RuntimeAttention>> together, alone;
  for (const char* p : lane_policies) {
    together.push_back(testing_util::MakeLlamaRuntime(model.config, p, DType::kF16, Backend::kCuda));
    alone.push_back(testing_util::MakeLlamaRuntime(model.config, p, DType::kF16, Backend::kCuda));
    if (together.back() == nullptr || alone.back() == nullptr) return {-1, -1};
  }
  Engine engine(model);
  EXPECT_TRUE(engine.UseGpuMatmul().ok());
  EXPECT_TRUE(engine.UseGpuDecode().ok());
  std::vector<Attention*> lanes;
  for (auto& a : together) lanes.push_back(a.get());
  std::vector<float> step, one;
  EXPECT_TRUE(engine.Prefill(std::span<const int32_t>(fx.tokens.data(), prompt), 0, lanes, &step).ok());
  for (auto& a : alone) {
    Attention* attns[1] = {a.get()};
    EXPECT_TRUE(engine.Prefill(std::span<const int32_t>(fx.tokens.data(), prompt), 0, attns, &step).ok());
  }
  const size_t vocab = static_cast<size_t>(model.config.vocab_size);
  for (int64_t t = prompt; t < n; ++t) {
    const std::vector<int32_t> toks(3, fx.tokens[t]);
    const Status st = engine.DecodeLanes(toks, t, lanes, &step);
    EXPECT_TRUE(st.ok()) << st.ToString();
    if (!st.ok()) break;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_TRUE(engine.Decode(fx.tokens[t], t, *alone[i], &one).ok());
      double diff = 0, mx = 0;
      for (size_t j = 0; j < vocab; ++j) {
        diff = std::max(diff, static_cast<double>(std::fabs(step[i * vocab + j] - one[j])));
        mx = std::max(mx, static_cast<double>(std::fabs(one[j])));
      }
      EXPECT_LT(diff / mx, 1e-4) << lane_policies[i] << " at position " << t;
    }
  }
  return {engine.decode_graph_captures(), engine.decode_graph_steps()};
}

// Engine::UseGpuDecode: the decode step with its activations on the GPU (the products on cuBLAS,
// the norms, RoPE, GELU and residuals as kernels, attention through the Runtime with device
// tensors, its step planned once a token) gives the logits of the host path over the same CUDA
// Runtime, for dense and each device policy; three lanes decoded together equal each alone.
TEST(Gemma3Engine, GpuDecodeMatchesTheHostPath) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  const Fixture& fx = Tiny();
  const int64_t n = static_cast<int64_t>(fx.tokens.size()), prompt = 11;
  for (const char* policy : {"dense", "streaming", "oracle", "quest", "sparcas", "hip", "kvpop", "lfps"}) {
    std::vector<std::vector<float>> logits[2];  // [0]: host path, [1]: on the device; [step]
    for (int b = 0; b < 2; ++b) {
      auto attn = MakeRuntime(policy, DType::kF16, Backend::kCuda);
      ASSERT_NE(attn, nullptr) << policy;
      Engine engine(fx.model);
      ASSERT_TRUE(engine.UseGpuMatmul().ok());
      if (b == 1) ASSERT_TRUE(engine.UseGpuDecode().ok());
      const Status st = RunTiny(engine, *attn, prompt, /*chunk=*/512, &logits[b]);
      ASSERT_TRUE(st.ok()) << policy << ": " << st.ToString();
    }
    const double rel = MaxRelDiff(logits[1], logits[0]);
    std::printf("%s: decode on the device vs the host path, max |dlogit| / max |logit| = %.3g\n", policy, rel);
    EXPECT_LT(rel, 1e-4) << policy;
  }
  // Three lanes (dense, sparcas, quest) decoded together on the device equal each decoded alone.
  ExpectLanesTogetherEqualAlone(fx.model, prompt);
}

// CUDA graphs of the decode step: the tiny model with every layer global (no sliding window, so
// that a device-selecting policy's step is capture-safe) decodes on the device with graphs and
// gives the host path's logits; the graphs were captured and replayed for every capture-safe
// policy (not for LFPS, which selects on the host); three lanes decoded together and each alone,
// interleaved on one engine, keep a graph per lane set and equal each other.
TEST(Gemma3Engine, GpuDecodeGraphsMatchTheHostPath) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA GPU (or built without CUDA)";
  const Fixture& fx = Tiny();
  Model global = fx.model;
  for (int& w : global.config.layer_window) w = 0;
  const int64_t n = static_cast<int64_t>(fx.tokens.size()), prompt = 11;
  auto make = [&](const char* policy) {
    return testing_util::MakeLlamaRuntime(global.config, policy, DType::kF16, Backend::kCuda);
  };
  for (const char* policy : {"dense", "streaming", "quest", "sparcas", "hip", "kvpop", "lfps"}) {
    std::vector<std::vector<float>> logits[2];  // [0]: host path, [1]: on the device with graphs
    int64_t graph_steps = 0;
    bool capture_safe = false;
    for (int b = 0; b < 2; ++b) {
      auto attn = make(policy);
      ASSERT_NE(attn, nullptr) << policy;
      Engine engine(global);
      ASSERT_TRUE(engine.UseGpuMatmul().ok());
      if (b == 1) ASSERT_TRUE(engine.UseGpuDecode().ok());
      Attention* attns[1] = {attn.get()};
      std::vector<float> step;
      ASSERT_TRUE(engine.Prefill(std::span<const int32_t>(fx.tokens.data(), prompt), 0, attns, &step).ok());
      for (int64_t t = prompt; t < n; ++t) {
        const Status st = engine.Decode(fx.tokens[t], t, *attn, &step);
        ASSERT_TRUE(st.ok()) << policy << ": " << st.ToString();
        logits[b].push_back(step);
      }
      if (b == 1) {
        graph_steps = engine.decode_graph_steps();
        capture_safe = attn->decode_capture_safe();
      }
    }
    const double rel = MaxRelDiff(logits[1], logits[0]);
    std::printf("%s: graphs %lld of %lld steps, vs the host path max |dlogit| / max |logit| = %.3g\n", policy,
                static_cast<long long>(graph_steps), static_cast<long long>(n - prompt), rel);
    EXPECT_LT(rel, 1e-4) << policy;
    if (std::string(policy) == "lfps") {
      EXPECT_FALSE(capture_safe);
      EXPECT_EQ(graph_steps, 0);
    } else {
      EXPECT_TRUE(capture_safe) << policy;
      EXPECT_EQ(graph_steps, n - prompt - 1) << policy;  // the first step plain, then captured and replayed
    }
  }
  const auto [captures, graph_steps] = ExpectLanesTogetherEqualAlone(global, prompt);
  EXPECT_EQ(captures, 4);  // the three lanes together, and each alone
  EXPECT_EQ(graph_steps, 4 * (n - prompt - 1));
}

// A sparse policy on the global layer: the sliding layers are unchanged, the global layer attends
// a budget; the logits move away from dense but stay finite, and the sliding layers are still
// exact for a prompt inside the window.
TEST(Gemma3Engine, SparseGlobalPolicyRuns) {
  const Fixture& fx = Tiny();
  Engine engine(fx.model);
  auto attn = MakeRuntime("streaming", DType::kF16);
  ASSERT_NE(attn, nullptr);
  Attention* attns[1] = {attn.get()};
  std::vector<float> logits;
  ASSERT_TRUE(engine.Prefill(std::span<const int32_t>(fx.tokens.data(), 6), 0, attns, &logits).ok());
  EXPECT_LT(RelErr(logits, 5, 1), 1e-3);  // 6 tokens: within every budget, still exact
  for (int64_t t = 6; t < static_cast<int64_t>(fx.tokens.size()); ++t) {
    ASSERT_TRUE(engine.Decode(fx.tokens[t], t, *attn, &logits).ok());
    for (float x : logits) ASSERT_TRUE(std::isfinite(x));
  }
}

// n token ids drawn uniformly from the tiny model's vocabulary (id 0 left out).
std::vector<int32_t> RandomTokens(size_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> tok(1, Tiny().model.config.vocab_size - 1);
  std::vector<int32_t> out(n);
  for (int32_t& t : out) t = tok(rng);
  return out;
}

// Lanes decoded together (Engine::DecodeLanes: one pass a step, the lanes as the products' rows)
// score as each lane decoded alone, on a fresh random window, for lanes that differ (dense and
// three sparse policies on the global layer), and generate the same tokens.
TEST(Gemma3Engine, LanesDecodedTogetherEqualEachLaneAlone) {
  const Fixture& fx = Tiny();
  Engine engine(fx.model);
  const char* policies[] = {"dense", "oracle", "streaming", "sparcas"};
  std::vector<std::unique_ptr<RuntimeAttention>> owned;
  std::vector<Attention*> lanes;
  for (const char* p : policies) {
    owned.push_back(MakeRuntime(p, DType::kF16));
    ASSERT_NE(owned.back(), nullptr) << p;
    lanes.push_back(owned.back().get());
  }
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  const std::vector<int32_t> window = RandomTokens(48, rng);
  auto alone = EvalPerplexity(engine, window, 24, lanes, 16, nullptr, {}, false);
  auto together = EvalPerplexity(engine, window, 24, lanes, 16, nullptr, {}, true);
  ASSERT_TRUE(alone.ok()) << alone.status().ToString();
  ASSERT_TRUE(together.ok()) << together.status().ToString();
  for (size_t l = 0; l < lanes.size(); ++l) {
    SCOPED_TRACE(std::string(policies[l]) + ", seed " + std::to_string(seed));
    EXPECT_EQ((*together)[l].scored, 24);
    EXPECT_NEAR((*together)[l].nll_sum, (*alone)[l].nll_sum, 1e-4 * std::fabs((*alone)[l].nll_sum));
    EXPECT_EQ((*together)[l].argmax_agree, (*alone)[l].argmax_agree);
  }
  // The lanes are really apart: a 6-token budget over 47 tokens moves the sparse lanes off dense.
  EXPECT_GT(std::fabs((*alone)[2].nll_sum - (*alone)[0].nll_sum), 1e-3);
  auto gen_alone = GenerateGreedy(engine, window, 6, lanes, 16, -1, false);
  auto gen_together = GenerateGreedy(engine, window, 6, lanes, 16, -1, true);
  ASSERT_TRUE(gen_alone.ok() && gen_together.ok());
  EXPECT_EQ(*gen_together, *gen_alone) << "seed " << seed;
  // One token a lane.
  std::vector<float> logits;
  const int32_t two[2] = {1, 2};
  EXPECT_EQ(engine.DecodeLanes(std::span<const int32_t>(two, 1), 0, lanes, &logits).code(),
            StatusCode::kInvalidArgument);
}

// Engine::Prefill stores the rows into every attention but the first with Append where the
// policy reads no prompt queries: the state it leaves decodes as a Prefill's does (the same
// policy prefilled as the first attention), on a fresh random prompt. lfps reads them (primed from
// the prompt's last queries) and keeps its Prefill.
TEST(Gemma3Engine, PrefillAppendsWhereThePolicyReadsNoQueries) {
  const Fixture& fx = Tiny();
  Engine engine(fx.model);
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  const std::vector<int32_t> prompt = RandomTokens(40, rng);
  auto dense = MakeRuntime("dense", DType::kF16);
  ASSERT_NE(dense, nullptr);
  EXPECT_FALSE(dense->prefill_reads_queries());
  for (const char* p : {"oracle", "streaming", "sparcas", "quest", "lfps"}) {
    SCOPED_TRACE(std::string(p) + ", seed " + std::to_string(seed));
    auto first = MakeRuntime(p, DType::kF16);
    auto second = MakeRuntime(p, DType::kF16);
    ASSERT_TRUE(first != nullptr && second != nullptr);
    EXPECT_EQ(first->prefill_reads_queries(), std::string(p) == "lfps");
    Attention* alone[1] = {first.get()};
    Attention* behind[2] = {dense.get(), second.get()};
    for (Attention* a : {static_cast<Attention*>(first.get()), static_cast<Attention*>(second.get()),
                         static_cast<Attention*>(dense.get())}) {
      ASSERT_TRUE(a->Reset().ok());
    }
    ASSERT_TRUE(engine.Prefill(prompt, 0, alone, nullptr).ok());
    ASSERT_TRUE(engine.Prefill(prompt, 0, behind, nullptr).ok());
    std::vector<float> want, got;
    for (int i = 0; i < 8; ++i) {
      const int32_t t = RandomTokens(1, rng)[0];
      const int64_t pos = static_cast<int64_t>(prompt.size()) + i;
      ASSERT_TRUE(engine.Decode(t, pos, *first, &want).ok());
      ASSERT_TRUE(engine.Decode(t, pos, *second, &got).ok());
      ASSERT_EQ(got, want) << "step " << i;
    }
  }
}

// A damaged Gemma 3 file fails cleanly: truncations, and single bytes of the header, metadata and
// tensor directory overwritten (what the gemma3 loader reads: keys, the pattern, shapes).
TEST(Gemma3Engine, DamagedFilesFailCleanly) {
  auto bytes = ReadFileBytes(TinyPath());
  ASSERT_TRUE(bytes.ok());
  auto file = GgufFile::Parse(*bytes);
  ASSERT_TRUE(file.ok());
  const size_t data_start = bytes->size() - [&] {
    uint64_t end = 0;
    for (const GgufTensorInfo& t : file->tensors()) end = std::max(end, t.offset + t.num_bytes);
    return end;
  }();
  for (size_t cut : {size_t{0}, size_t{3}, size_t{24}, data_start / 2, data_start - 1,
                     bytes->size() - 1}) {
    std::vector<uint8_t> b(bytes->begin(), bytes->begin() + static_cast<std::ptrdiff_t>(cut));
    EXPECT_FALSE(LoadGgufModelFromBytes(b).ok()) << "truncated to " << cut;
  }
  uint64_t state = 51;
  int failed = 0;
  for (int i = 0; i < 400; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    std::vector<uint8_t> b = *bytes;
    const size_t at = static_cast<size_t>((state >> 20) % data_start);
    b[at] = static_cast<uint8_t>(state >> 56);
    auto m = LoadGgufModelFromBytes(b);  // must not crash; ok or an error
    failed += !m.ok();
  }
  std::printf("400 one-byte corruptions of the header/metadata/directory: %d refused\n", failed);
}

}  // namespace
}  // namespace kvferry::llama
