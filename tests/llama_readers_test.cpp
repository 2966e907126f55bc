// Copyright kvferry authors. Apache-2.0.
// Regression tests for what fuzzing and review of the readers of outside input found
// (docs/reliability.md): each case once crashed, read out of bounds, hung or accepted nonsense.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "bench/lib/safetensors.h"
#include "examples/llama/gguf.h"
#include "examples/llama/model.h"
#include "examples/llama/tokenizer.h"

namespace kvferry::llama {
namespace {

std::string Data(const std::string& name) { return std::string(KVFERRY_TEST_DATA_DIR) + "/" + name; }

// llama2.c tokenizer.bin image: max length, then (score, length, bytes) per token.
std::vector<uint8_t> Llama2cTokenizerBytes(const std::vector<std::pair<std::string, float>>& vocab) {
  std::vector<uint8_t> out(4, 0);
  for (const auto& [piece, score] : vocab) {
    const int32_t len = static_cast<int32_t>(piece.size());
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(&score),
               reinterpret_cast<const uint8_t*>(&score) + 4);
    out.insert(out.end(), reinterpret_cast<const uint8_t*>(&len),
               reinterpret_cast<const uint8_t*>(&len) + 4);
    out.insert(out.end(), piece.begin(), piece.end());
  }
  return out;
}

TEST(LlamaReaders, Llama2cByteFallbackOutsideASmallVocabularyIsUnknown) {
  // Bytes missing from the vocabulary fall back to <0xXX> = byte + 3, which a vocabulary of 8
  // does not have: it used to index the pieces out of bounds.
  const auto bytes = Llama2cTokenizerBytes(
      {{"<unk>", 0}, {"<s>", 0}, {"</s>", 0}, {" ", -1}, {"a", -2}, {"b", -3}, {"ab", -1}, {" ab", -1}});
  auto tok = LoadLlama2cTokenizerFromBytes(bytes, 8);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const std::vector<int32_t> ids = (*tok)->Encode("ab z\xff", false);
  for (int32_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 8);
  }
  EXPECT_EQ(ids, (std::vector<int32_t>{7, 3, 0, 0}));  // " ab", " ", <unk> for 'z', <unk> for 0xff
  // A file too short for its vocabulary is refused before anything is allocated for it.
  auto short_file = LoadLlama2cTokenizerFromBytes(bytes, 1 << 20);
  ASSERT_FALSE(short_file.ok());
  EXPECT_EQ(short_file.status().code(), StatusCode::kCorruptData);
  EXPECT_NE(short_file.status().message().find("cannot hold"), std::string::npos);
}

TEST(LlamaReaders, Llama2cMergesAreTheNaiveGreedyOnes) {
  auto tok = LoadLlama2cTokenizer(Data("tok512.bin"), 512);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  // Ids from the O(n^2) rescanning encoder this one replaced.
  EXPECT_EQ((*tok)->Encode("Once upon a time", false),
            (std::vector<int32_t>{403, 407, 261, 378}));
  EXPECT_EQ((*tok)->DecodeAll((*tok)->Encode("Lily and Ben played in the park.", false)),
            " Lily and Ben played in the park.");
}

TEST(LlamaReaders, LongTextsEncodeInNLogNTime) {
  // llama2.c merges over the whole text: 20,000 characters of story took 14.6 s with the former
  // rescan of every pair after each merge (O(n^2)); 200,000 now take about 0.2 s in Release.
  auto tok = LoadLlama2cTokenizer(Data("tok512.bin"), 512);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  std::string text;
  while (text.size() < 200000) text += "Once upon a time there was a girl. ";
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = (*tok)->Encode(text, false);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 20.0);  // generous for sanitizer builds on a busy machine
  EXPECT_LT(ids.size(), text.size() / 2);  // it did merge
  EXPECT_EQ((*tok)->DecodeAll(ids), " " + text);
}

TEST(LlamaReaders, SafetensorsRejectsFractionalOffsetsAndBadSurrogates) {
  const auto image = [](const std::string& header, size_t payload) {
    std::string h = header;
    while (h.size() % 8 != 0) h += ' ';
    std::vector<uint8_t> out(8 + h.size() + payload, 0);
    const uint64_t n = h.size();
    std::memcpy(out.data(), &n, 8);
    std::memcpy(out.data() + 8, h.data(), h.size());
    return out;
  };
  EXPECT_TRUE(bench::ParseSafetensors(
                  image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8))
                  .ok());
  auto bad = bench::ParseSafetensors(
      image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0.5,4.5]}})", 8));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruptData);
  bad = bench::ParseSafetensors(image(R"({"__metadata__":{"k":"\ud83d\u0041"}})", 0));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("surrogate"), std::string::npos) << bad.status().message();
}

TEST(LlamaReaders, SafetensorsEmptyTensorsReadAsEmpty) {
  // Found by fuzz_safetensors: a zero-element I32/F32 tensor passed a null pointer to memcpy.
  bench::SafetensorsFile f;
  for (const char* dtype : {"I32", "F32", "I64", "BF16"}) {
    bench::SafetensorsTensor t;
    t.dtype = dtype;
    t.shape = {0};
    f.tensors[std::string("empty_") + dtype] = t;
  }
  auto parsed = bench::ParseSafetensors(bench::SerializeSafetensors(f).value());
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  for (const char* dtype : {"I32", "F32", "I64", "BF16"}) {
    auto floats = parsed->GetFloat(std::string("empty_") + dtype);
    ASSERT_TRUE(floats.ok()) << dtype;
    EXPECT_TRUE(floats->empty());
  }
  auto ints = parsed->GetInt32("empty_I32");
  ASSERT_TRUE(ints.ok());
  EXPECT_TRUE(ints->empty());
}

TEST(LlamaReaders, TraceWithAbsurdHeadCountsIsCorrupt) {
  bench::SafetensorsFile f;
  std::vector<float> x(16, 1.0f);
  bench::AddFloatTensor(f, "layer.0.q", {1, 2, 8}, x.data(), false);
  bench::AddFloatTensor(f, "layer.0.k", {1, 2, 8}, x.data(), false);
  bench::AddFloatTensor(f, "layer.0.v", {1, 2, 8}, x.data(), false);
  auto ok = bench::LoadTraceFromBytes(bench::SerializeSafetensors(f).value());
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->layers[0].num_kv_heads, 2);
  // Zero tokens, 2^31 heads: used to wrap the head count to a negative int.
  bench::SafetensorsTensor empty;
  empty.dtype = "F32";
  empty.shape = {0, int64_t{1} << 31, 8};
  f.tensors["layer.0.k"] = empty;
  auto bad = bench::LoadTraceFromBytes(bench::SerializeSafetensors(f).value());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruptData);
  // v with other heads than k.
  bench::AddFloatTensor(f, "layer.0.k", {1, 2, 8}, x.data(), false);
  bench::AddFloatTensor(f, "layer.0.v", {2, 1, 8}, x.data(), false);
  EXPECT_FALSE(bench::LoadTraceFromBytes(bench::SerializeSafetensors(f).value()).ok());
}

// GGUF v3 with metadata and at most one F32 tensor.
class MetaGguf {
 public:
  void U32(const std::string& k, uint32_t v) { Key(k, 4); Put(v); }
  void I64(const std::string& k, int64_t v) { Key(k, 11); Put(v); }
  void F32(const std::string& k, float v) { Key(k, 6); Put(v); }
  void Str(const std::string& k, const std::string& v) { Key(k, 8); Bytes(v); }
  void Strs(const std::string& k, const std::vector<std::string>& v) {
    Key(k, 9);
    Put<uint32_t>(8);
    Put<uint64_t>(v.size());
    for (const auto& s : v) Bytes(s);
  }
  void F32Tensor(const std::string& name, uint64_t cols, uint64_t rows) {
    tensor_name_ = name;
    dims_ = {cols, rows};
  }
  std::vector<uint8_t> Build() const {
    std::vector<uint8_t> out = {'G', 'G', 'U', 'F', 3, 0, 0, 0};
    const uint64_t num_tensors = tensor_name_.empty() ? 0 : 1;
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(num_tensors >> (8 * i)));
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(n_ >> (8 * i)));
    out.insert(out.end(), body_.begin(), body_.end());
    if (num_tensors == 0) return out;
    const auto put = [&out](const void* p, size_t n) {
      out.insert(out.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    };
    const uint64_t len = tensor_name_.size();
    const uint32_t ndim = 2, type = 0;
    const uint64_t offset = 0;
    put(&len, 8);
    put(tensor_name_.data(), len);
    put(&ndim, 4);
    put(dims_.data(), 16);
    put(&type, 4);
    put(&offset, 8);
    out.resize((out.size() + 31) / 32 * 32 + dims_[0] * dims_[1] * 4, 0);
    return out;
  }

 private:
  template <typename T>
  void Put(T v) {
    body_.insert(body_.end(), reinterpret_cast<uint8_t*>(&v), reinterpret_cast<uint8_t*>(&v) + sizeof(T));
  }
  void Bytes(const std::string& s) {
    Put<uint64_t>(s.size());
    body_.insert(body_.end(), s.begin(), s.end());
  }
  void Key(const std::string& k, uint32_t type) {
    Bytes(k);
    Put(type);
    ++n_;
  }
  std::vector<uint8_t> body_;
  uint64_t n_ = 0;
  std::string tensor_name_;
  std::vector<uint64_t> dims_;
};

TEST(LlamaReaders, GgufTokenizerIdsBelowMinusOneAreCorrupt) {
  for (int64_t bos : {int64_t{-1}, int64_t{-2}, -(int64_t{1} << 32) + 1}) {
    MetaGguf g;
    g.Str("tokenizer.ggml.model", "gpt2");
    g.Strs("tokenizer.ggml.tokens", {"a", "b"});
    g.Strs("tokenizer.ggml.merges", {});
    g.I64("tokenizer.ggml.bos_token_id", bos);
    const std::vector<uint8_t> bytes = g.Build();
    auto file = GgufFile::Parse(bytes);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    auto tok = LoadGgufTokenizer(*file);
    // -2^32 + 1 used to become bos id 1 through an int cast.
    EXPECT_EQ(tok.ok(), bos == -1) << bos;
  }
}

TEST(LlamaReaders, GgufModelWithNonFiniteRopeThetaIsCorrupt) {
  for (float theta : {10000.0f, std::numeric_limits<float>::quiet_NaN(), -1.0f,
                      std::numeric_limits<float>::infinity()}) {
    MetaGguf g;
    g.Str("general.architecture", "llama");
    g.U32("llama.embedding_length", 32);
    g.U32("llama.feed_forward_length", 32);
    g.U32("llama.block_count", 1);
    g.U32("llama.attention.head_count", 2);
    g.F32("llama.rope.freq_base", theta);
    g.F32Tensor("token_embd.weight", 32, 4);
    const std::vector<uint8_t> bytes = g.Build();
    auto model = LoadGgufModelFromBytes(bytes);
    ASSERT_FALSE(model.ok());
    if (theta == 10000.0f) {
      // A plausible file gets as far as its missing layer tensors.
      EXPECT_EQ(model.status().code(), StatusCode::kNotFound) << model.status().ToString();
    } else {
      EXPECT_EQ(model.status().code(), StatusCode::kCorruptData) << model.status().ToString();
      EXPECT_NE(model.status().message().find("freq_base"), std::string::npos);
    }
  }
}

}  // namespace
}  // namespace kvferry::llama
