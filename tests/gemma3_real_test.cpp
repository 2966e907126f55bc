// Copyright kvferry authors. Apache-2.0.
// Gemma 3 270M (the real model, opt-in): the engine's logits against Hugging Face transformers'
// on a short prompt. Needs data/gemma-3-270m-q4_k_m.gguf (scripts/fetch-data.sh --gemma3) and
// data/gemma3_hf_logits.bin (examples/llama/scripts/gemma3_hf_logits.py, transformers on CPU
// loading the same GGUF); skipped when either is missing, as in CI.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "examples/llama/engine.h"
#include "examples/llama/gguf.h"
#include "examples/llama/model.h"
#include "examples/llama/tokenizer.h"

namespace kvferry::llama {
namespace {

std::string DataDir() {
  const char* env = std::getenv("KVFERRY_DATA_DIR");
  return env != nullptr ? std::string(env) : std::string(KVFERRY_TEST_DATA_DIR) + "/../../data";
}

struct HfLogits {
  std::string text;
  std::vector<int32_t> tokens;
  int64_t vocab = 0;
  std::vector<uint32_t> kept;  // positions whose logits the file holds
  std::vector<float> logits;   // [kept, vocab]
};

bool ReadHf(const std::string& path, HfLogits* out) {
  auto bytes = ReadFileBytes(path);
  if (!bytes.ok() || bytes->size() < 20 || std::memcmp(bytes->data(), "G3H2", 4) != 0) return false;
  uint32_t h[4];  // n, vocab, text bytes, kept
  std::memcpy(h, bytes->data() + 4, 16);
  const size_t need = 20 + h[2] + 4ull * h[0] + 4ull * h[3] + 4ull * h[3] * h[1];
  if (bytes->size() != need) return false;
  const uint8_t* p = bytes->data() + 20;
  out->text.assign(reinterpret_cast<const char*>(p), h[2]);
  p += h[2];
  out->tokens.resize(h[0]);
  std::memcpy(out->tokens.data(), p, 4ull * h[0]);
  p += 4ull * h[0];
  out->kept.resize(h[3]);
  std::memcpy(out->kept.data(), p, 4ull * h[3]);
  p += 4ull * h[3];
  out->vocab = h[1];
  out->logits.resize(static_cast<size_t>(h[3]) * h[1]);
  std::memcpy(out->logits.data(), p, out->logits.size() * 4);
  for (uint32_t k : out->kept) {
    if (k >= h[0]) return false;
  }
  return true;
}

// got: [tokens, vocab] (every position).
void Compare(const char* label, const std::vector<float>& got, const HfLogits& hf) {
  const int64_t kept = static_cast<int64_t>(hf.kept.size());
  double max_all = 0, max_first = 0, max_logit = 0;
  int argmax_agree = 0;
  for (int64_t k = 0; k < kept; ++k) {
    const float* g = got.data() + static_cast<int64_t>(hf.kept[k]) * hf.vocab;
    const float* w = hf.logits.data() + k * hf.vocab;
    for (int64_t i = 0; i < hf.vocab; ++i) {
      const double d = std::fabs(static_cast<double>(g[i]) - w[i]);
      max_all = std::max(max_all, d);
      if (hf.kept[k] == 0) max_first = std::max(max_first, d);
      max_logit = std::max(max_logit, std::fabs(static_cast<double>(w[i])));
    }
    argmax_agree += std::max_element(g, g + hf.vocab) - g == std::max_element(w, w + hf.vocab) - w;
  }
  std::printf("%s: max |dlogit| first position %.4g, %lld compared positions of %zu (last %u) "
              "%.4g (max |logit| %.3g); argmax agrees at %d of %lld\n", label, max_first,
              static_cast<long long>(kept), hf.tokens.size(), hf.kept.back(), max_all, max_logit,
              argmax_agree, static_cast<long long>(kept));
  EXPECT_LT(max_all, 0.02 * max_logit) << label;
  EXPECT_GE(argmax_agree, kept - 1) << label;
}

TEST(Gemma3Real, LogitsMatchTransformers) {
  const std::string gguf = DataDir() + "/gemma-3-270m-q4_k_m.gguf";
  const std::string ref = DataDir() + "/gemma3_hf_logits.bin";
  if (!std::filesystem::exists(gguf) || !std::filesystem::exists(ref)) {
    GTEST_SKIP() << "needs " << gguf << " (scripts/fetch-data.sh --gemma3) and " << ref
                 << " (examples/llama/scripts/gemma3_hf_logits.py)";
  }
  HfLogits hf;
  ASSERT_TRUE(ReadHf(ref, &hf)) << ref << " is not a G3HF file";
  const auto t0 = std::chrono::steady_clock::now();
  auto model = LoadModel(gguf);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const ModelConfig& c = model->config;
  std::printf("loaded in %.1f s: %d layers, dim %d, %d/%d heads of %d, vocab %d, windows",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              c.num_layers, c.dim, c.num_q_heads, c.num_kv_heads, c.head_dim, c.vocab_size);
  for (int w : c.layer_window) std::printf(" %d", w);
  std::printf("\n");
  ASSERT_EQ(c.vocab_size, hf.vocab);
  auto tok = LoadGgufTokenizer(gguf);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  std::vector<int32_t> ours;
  if ((*tok)->add_bos()) ours.push_back((*tok)->bos_id());
  for (int32_t id : (*tok)->Encode(hf.text, false)) ours.push_back(id);
  EXPECT_EQ(ours, hf.tokens) << "the engine's tokenizer and transformers' differ on '" << hf.text
                             << "'";
  const int64_t n = static_cast<int64_t>(hf.tokens.size());
  {
    Engine engine(*model);
    auto attn = MakeReferenceAttention(c);
    Attention* attns[1] = {attn.get()};
    std::vector<float> logits;
    ASSERT_TRUE(engine.Prefill(hf.tokens, 0, attns, &logits, true).ok());
    Compare("engine, exact f32 attention", logits, hf);
  }
  for (DType kv : {DType::kF16, DType::kBF16}) {
    RuntimeConfig rc;
    rc.backend = Backend::kHost;
    rc.policy.name = "dense";
    rc.policy.budget_tokens = 4096;
    rc.model.kv_dtype = kv;
    rc.capacity.max_sequences = 1;
    rc.capacity.max_batch = 1;
    rc.capacity.max_tokens_per_sequence = 4096;
    rc.capacity.max_prefill_chunk = 256;
    rc.probe_at_start = false;
    auto attn = RuntimeAttention::Create(RuntimeConfigFor(c, rc), c);
    ASSERT_TRUE(attn.ok()) << attn.status().ToString();
    Engine engine(*model);
    Attention* attns[1] = {attn->get()};
    std::vector<float> logits;
    // Chunks of 256: a sliding layer's rows past 512 go through Decode.
    ASSERT_TRUE(engine.Prefill(hf.tokens, 0, attns, &logits, true, 256).ok());
    Compare(kv == DType::kF16 ? "engine through kvferry (dense global, window-512 sliding), f16 KV"
                              : "engine through kvferry (dense global, window-512 sliding), bf16 KV",
            logits, hf);
  }
  (void)n;
}

}  // namespace
}  // namespace kvferry::llama
