// Copyright kvferry authors. Apache-2.0.
// The GGUF reader: dequantisation of every supported type against hand-computed values, a small
// synthetic Llama file loaded end to end, and fuzzing (random truncations and byte flips) of the
// synthetic file and, when fetched, of the real SmolLM2 file: always an error, never a crash.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "examples/llama/gguf.h"
#include "examples/llama/model.h"
#include "examples/llama/tokenizer.h"

namespace kvferry::llama {
namespace {

// Writes GGUF v3 images for tests.
class GgufBuilder {
 public:
  void KvU32(const std::string& key, uint32_t v) { Key(key, 4); Put(v); ++num_kv_; }
  void KvF32(const std::string& key, float v) { Key(key, 6); Put(v); ++num_kv_; }
  void KvStr(const std::string& key, const std::string& v) { Key(key, 8); Str(v); ++num_kv_; }
  void KvStrArray(const std::string& key, const std::vector<std::string>& v) {
    Key(key, 9);
    Put<uint32_t>(8);
    Put<uint64_t>(v.size());
    for (const auto& s : v) Str(s);
    ++num_kv_;
  }
  void KvI32Array(const std::string& key, const std::vector<int32_t>& v) {
    Key(key, 9);
    Put<uint32_t>(5);
    Put<uint64_t>(v.size());
    for (int32_t x : v) Put(x);
    ++num_kv_;
  }
  // dims innermost first; data already encoded in \p type.
  void Tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type,
              std::vector<uint8_t> data) {
    tensors_.push_back({name, std::move(dims), type, std::move(data)});
  }
  std::vector<uint8_t> Build() const {
    std::vector<uint8_t> out;
    const auto put = [&out](const void* p, size_t n) {
      out.insert(out.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    };
    const uint32_t magic = 0x46554747, version = 3;
    const uint64_t nt = tensors_.size();
    put(&magic, 4);
    put(&version, 4);
    put(&nt, 8);
    put(&num_kv_, 8);
    out.insert(out.end(), kv_.begin(), kv_.end());
    uint64_t offset = 0;
    for (const auto& t : tensors_) {
      const uint64_t len = t.name.size();
      put(&len, 8);
      put(t.name.data(), len);
      const uint32_t nd = static_cast<uint32_t>(t.dims.size());
      put(&nd, 4);
      put(t.dims.data(), 8 * nd);
      put(&t.type, 4);
      put(&offset, 8);
      offset += (t.data.size() + 31) / 32 * 32;
    }
    out.resize((out.size() + 31) / 32 * 32);
    for (const auto& t : tensors_) {
      out.insert(out.end(), t.data.begin(), t.data.end());
      out.resize((out.size() + 31) / 32 * 32);
    }
    return out;
  }

 private:
  template <typename T>
  void Put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    kv_.insert(kv_.end(), p, p + sizeof(T));
  }
  void Str(const std::string& s) {
    Put<uint64_t>(s.size());
    kv_.insert(kv_.end(), s.begin(), s.end());
  }
  void Key(const std::string& key, uint32_t type) {
    Str(key);
    Put(type);
  }
  struct T {
    std::string name;
    std::vector<uint64_t> dims;
    uint32_t type;
    std::vector<uint8_t> data;
  };
  std::vector<uint8_t> kv_;
  uint64_t num_kv_ = 0;
  std::vector<T> tensors_;
};

uint16_t ToHalf(float f) {
  // Exact for the small integers and powers of two used below.
  if (f == 0.0f) return 0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000;
  const int exp = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
  return static_cast<uint16_t>(sign | (exp << 10) | ((u >> 13) & 0x3ff));
}

std::vector<uint8_t> F32Bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

TEST(LlamaGguf, HalfAndBf16) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7c00)));
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xc040), -3.0f);
}

TEST(LlamaGguf, DequantizesEveryBlockType) {
  // One 32-element block each; nibble/int8 codes q[j] = j (mod 16 for 4-bit), scale 0.5, min -2.
  std::vector<uint8_t> q4_0(18), q4_1(20), q8_0(34);
  const uint16_t half_scale = ToHalf(0.5f), half_min = ToHalf(-2.0f);
  std::memcpy(q4_0.data(), &half_scale, 2);
  std::memcpy(q4_1.data(), &half_scale, 2);
  std::memcpy(q4_1.data() + 2, &half_min, 2);
  std::memcpy(q8_0.data(), &half_scale, 2);
  for (int j = 0; j < 16; ++j) {
    q4_0[2 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
    q4_1[4 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  }
  for (int j = 0; j < 32; ++j) q8_0[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(j - 16));
  std::vector<float> out(32);
  ASSERT_TRUE(DequantizeRow(static_cast<uint32_t>(GgmlType::kQ4_0), q4_0, 32, out.data()).ok());
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[j], (j - 8) * 0.5f);
    EXPECT_EQ(out[j + 16], (15 - j - 8) * 0.5f);
  }
  ASSERT_TRUE(DequantizeRow(static_cast<uint32_t>(GgmlType::kQ4_1), q4_1, 32, out.data()).ok());
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[j], j * 0.5f - 2.0f);
    EXPECT_EQ(out[j + 16], (15 - j) * 0.5f - 2.0f);
  }
  ASSERT_TRUE(DequantizeRow(static_cast<uint32_t>(GgmlType::kQ8_0), q8_0, 32, out.data()).ok());
  for (int j = 0; j < 32; ++j) EXPECT_EQ(out[j], (j - 16) * 0.5f);
  const std::vector<uint8_t> f16{0x00, 0x3c, 0x00, 0xc0};  // 1, -2
  ASSERT_TRUE(DequantizeRow(static_cast<uint32_t>(GgmlType::kF16), f16, 2, out.data()).ok());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  const std::vector<uint8_t> bf16{0x80, 0x3f, 0x40, 0xc0};  // 1, -3
  ASSERT_TRUE(DequantizeRow(static_cast<uint32_t>(GgmlType::kBF16), bf16, 2, out.data()).ok());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -3.0f);
  // Wrong sizes and unknown types are errors.
  EXPECT_FALSE(DequantizeRow(static_cast<uint32_t>(GgmlType::kQ4_0), q4_0, 31, out.data()).ok());
  EXPECT_FALSE(DequantizeRow(12 /* Q4_K */, q4_0, 32, out.data()).ok());
}

// A two-layer Llama of dim 32 (2 heads of 16, 1 KV head), hidden 32, vocab 8; the weights mix
// F32, F16, Q8_0, Q4_0 and Q4_1, plus a 3-token BPE vocabulary.
std::vector<uint8_t> SyntheticLlama() {
  GgufBuilder b;
  b.KvStr("general.architecture", "llama");
  b.KvStr("general.name", "synthetic");
  b.KvU32("llama.embedding_length", 32);
  b.KvU32("llama.feed_forward_length", 32);
  b.KvU32("llama.block_count", 2);
  b.KvU32("llama.attention.head_count", 2);
  b.KvU32("llama.attention.head_count_kv", 1);
  b.KvU32("llama.context_length", 64);
  b.KvF32("llama.rope.freq_base", 10000.0f);
  b.KvF32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  b.KvStr("tokenizer.ggml.model", "gpt2");
  b.KvStrArray("tokenizer.ggml.tokens", {"<s>", "a", "b", "ab", "\xc4\xa0", "\xc4\xa0" "a", "c", "d"});
  b.KvI32Array("tokenizer.ggml.token_type", {3, 1, 1, 1, 1, 1, 1, 1});
  b.KvStrArray("tokenizer.ggml.merges", {"a b", "\xc4\xa0 a"});
  std::mt19937 rng(5);
  const auto block_data = [&rng](uint32_t type, int64_t numel) {
    std::vector<uint8_t> data;
    const uint64_t bytes = GgmlBytes(type, static_cast<uint64_t>(numel)).value();
    data.resize(bytes);
    for (auto& x : data) x = static_cast<uint8_t>(rng());
    // Keep every f16 scale small and finite: rewrite the block headers.
    const int block = type == 0 ? 0 : (type == 1 ? 0 : (type == 2 ? 18 : (type == 3 ? 20 : 34)));
    if (block > 0) {
      for (uint64_t off = 0; off < bytes; off += block) {
        const uint16_t d = ToHalf(0.0625f);
        std::memcpy(&data[off], &d, 2);
        if (type == 3) {
          const uint16_t m = ToHalf(-0.5f);
          std::memcpy(&data[off + 2], &m, 2);
        }
      }
    } else if (type == 1) {
      for (uint64_t i = 0; i < bytes; i += 2) {
        const uint16_t h = ToHalf(0.125f * static_cast<float>(static_cast<int>(rng() % 9) - 4));
        std::memcpy(&data[i], &h, 2);
      }
    }
    return data;
  };
  std::vector<float> ones(32, 1.0f);
  std::vector<float> emb(8 * 32);
  for (auto& x : emb) x = static_cast<float>(static_cast<int>(rng() % 17) - 8) / 8.0f;
  b.Tensor("token_embd.weight", {32, 8}, 0, F32Bytes(emb));
  for (int l = 0; l < 2; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    b.Tensor(p + "attn_norm.weight", {32}, 0, F32Bytes(ones));
    b.Tensor(p + "ffn_norm.weight", {32}, 0, F32Bytes(ones));
    b.Tensor(p + "attn_q.weight", {32, 32}, 8, block_data(8, 32 * 32));
    b.Tensor(p + "attn_k.weight", {32, 16}, 2, block_data(2, 32 * 16));
    b.Tensor(p + "attn_v.weight", {32, 16}, 3, block_data(3, 32 * 16));
    b.Tensor(p + "attn_output.weight", {32, 32}, 1, block_data(1, 32 * 32));
    b.Tensor(p + "ffn_gate.weight", {32, 32}, 3, block_data(3, 32 * 32));
    b.Tensor(p + "ffn_up.weight", {32, 32}, 8, block_data(8, 32 * 32));
    b.Tensor(p + "ffn_down.weight", {32, 32}, 2, block_data(2, 32 * 32));
  }
  b.Tensor("output_norm.weight", {32}, 0, F32Bytes(ones));
  return b.Build();
}

TEST(LlamaGguf, SyntheticModelLoadsAndRuns) {
  const std::vector<uint8_t> bytes = SyntheticLlama();
  auto file = GgufFile::Parse(bytes);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->version(), 3u);
  EXPECT_EQ(file->tensors().size(), 20u);
  auto model = LoadGgufModelFromBytes(bytes);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ(model->config.head_dim, 16);
  EXPECT_EQ(model->config.num_kv_heads, 1);
  EXPECT_EQ(model->config.vocab_size, 8);
  EXPECT_TRUE(model->output.data.empty());  // tied classifier
  // The GGUF Q rows are un-permuted to Hugging Face's order: row 2i+s of a head moves to
  // s*8 + i. Compare with a direct dequantisation.
  auto raw = file->Dequantize("blk.0.attn_q.weight");
  ASSERT_TRUE(raw.ok());
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 8; ++i) {
      for (int s = 0; s < 2; ++s) {
        const size_t from = static_cast<size_t>(h * 16 + 2 * i + s) * 32;
        const size_t to = static_cast<size_t>(h * 16 + s * 8 + i) * 32;
        EXPECT_EQ(model->layers[0].wq.data[to], (*raw)[from]);
      }
    }
  }
  auto tok = LoadGgufTokenizer(*file);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->Encode("ab a", false), (std::vector<int32_t>{3, 5}));
  EXPECT_EQ((*tok)->Encode("<s>ab", true), (std::vector<int32_t>{0, 3}));
  EXPECT_EQ((*tok)->DecodeAll({3, 5}), "ab a");
}

// Every prefix and many single-byte corruptions of \p bytes must give an error or a model, never
// a crash or a read out of bounds (run under ASan to check the latter).
void Fuzz(std::vector<uint8_t> bytes, size_t flip_region, int truncations, int flips,
          bool full_load) {
  std::mt19937_64 rng(11);
  const auto try_load = [&](std::span<const uint8_t> b) {
    auto file = GgufFile::Parse(b);
    if (!file.ok()) {
      EXPECT_FALSE(file.status().message().empty());
      return;
    }
    auto tok = LoadGgufTokenizer(*file);
    if (tok.ok()) (void)(*tok)->Encode("In the beginning 123", true);
    for (const auto& t : file->tensors()) {
      if (t.num_bytes < (1u << 16)) (void)file->Dequantize(t.name);
    }
    if (full_load) (void)LoadGgufModelFromBytes(b);
  };
  for (int i = 0; i < truncations; ++i) {
    const size_t len = i < 64 ? static_cast<size_t>(i) : rng() % bytes.size();
    auto model = LoadGgufModelFromBytes(std::span<const uint8_t>(bytes.data(), len));
    EXPECT_FALSE(model.ok()) << "truncated to " << len << " bytes";
    try_load(std::span<const uint8_t>(bytes.data(), std::min(len, flip_region)));
  }
  for (int i = 0; i < flips; ++i) {
    const size_t at = rng() % std::min(flip_region, bytes.size());
    const uint8_t saved = bytes[at];
    bytes[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
    if (i % 4 == 0) bytes[at] = static_cast<uint8_t>(rng());
    try_load(bytes);
    bytes[at] = saved;
  }
}

TEST(LlamaGguf, FuzzSyntheticFile) {
  const std::vector<uint8_t> bytes = SyntheticLlama();
  Fuzz(bytes, bytes.size(), 300, 2000, /*full_load=*/true);
}

TEST(LlamaGguf, FuzzRealFile) {
  const char* env = std::getenv("KVFERRY_DATA_DIR");
  const std::string path = (env != nullptr ? std::string(env)
                                           : std::string(KVFERRY_TEST_DATA_DIR) + "/../../data") +
                           "/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(path)) {
    GTEST_SKIP() << path << " not fetched; run scripts/fetch-data.sh --model-only";
  }
  auto bytes = ReadFileBytes(path);
  ASSERT_TRUE(bytes.ok());
  // Metadata and directory take the first ~1.8 MB: flip bytes there; truncate anywhere.
  Fuzz(std::move(bytes.value()), 1800000, 40, 60, /*full_load=*/false);
}

}  // namespace
}  // namespace kvferry::llama
