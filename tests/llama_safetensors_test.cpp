// Copyright kvferry authors. Apache-2.0.
// bench/lib/safetensors: round trips, the trace layout, corrupt files, and a trace dumped from
// the tiny real model through the engine's Q/K/V observer.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <random>

#include "bench/lib/safetensors.h"
#include "examples/llama/engine.h"
#include "examples/llama/model.h"

namespace kvferry::bench {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvferry_" + name)).string();
}

TEST(LlamaSafetensors, RoundTripKeepsDtypesShapesAndMetadata) {
  SafetensorsFile f;
  f.metadata["model"] = "test \"quoted\"\n";
  std::vector<float> a{1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 7.0f};
  AddFloatTensor(f, "a", {2, 3}, a.data(), false);
  AddFloatTensor(f, "b", {6}, a.data(), true);
  const std::string path = TempPath("roundtrip.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, f).ok());
  auto r = ReadSafetensors(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->metadata.at("model"), "test \"quoted\"\n");
  EXPECT_EQ(r->tensors.at("a").dtype, "F32");
  EXPECT_EQ(r->tensors.at("a").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r->GetFloat("a").value(), a);
  EXPECT_EQ(r->tensors.at("b").dtype, "BF16");
  const auto b = r->GetFloat("b").value();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], std::abs(a[i]) * 4e-3);
  EXPECT_FALSE(r->GetFloat("missing").ok());
  std::remove(path.c_str());
}

TEST(LlamaSafetensors, CorruptFilesAreErrors) {
  SafetensorsFile f;
  std::vector<float> a(64, 1.0f);
  AddFloatTensor(f, "layer.0.q", {4, 2, 8}, a.data(), false);
  auto bytes = SerializeSafetensors(f);
  ASSERT_TRUE(bytes.ok());
  std::mt19937_64 rng(2);
  for (size_t len = 0; len < bytes->size(); len += 1 + rng() % 7) {
    std::vector<uint8_t> cut(bytes->begin(), bytes->begin() + static_cast<std::ptrdiff_t>(len));
    EXPECT_FALSE(ParseSafetensors(cut).ok()) << len;
  }
  for (int i = 0; i < 3000; ++i) {
    std::vector<uint8_t> bad = *bytes;
    bad[rng() % std::min<size_t>(bad.size(), 120)] = static_cast<uint8_t>(rng());
    (void)ParseSafetensors(bad);  // either outcome; must not crash
  }
}

TEST(LlamaSafetensors, TraceFromTinyModelLoadsBack) {
  auto model = kvferry::llama::LoadModel(std::string(KVFERRY_TEST_DATA_DIR) + "/stories260K.bin");
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const auto& c = model->config;
  kvferry::llama::Engine engine(*model);
  std::map<int, std::vector<float>> q, k, v;
  engine.set_observer([&](int layer, int64_t, int64_t n, const float* qp, const float* kp,
                          const float* vp) {
    q[layer].insert(q[layer].end(), qp, qp + n * c.num_q_heads * c.head_dim);
    k[layer].insert(k[layer].end(), kp, kp + n * c.num_kv_heads * c.head_dim);
    v[layer].insert(v[layer].end(), vp, vp + n * c.num_kv_heads * c.head_dim);
  });
  auto attn = kvferry::llama::MakeReferenceAttention(c);
  std::vector<kvferry::llama::Attention*> lanes{attn.get()};
  const std::vector<int32_t> tokens{1, 403, 407, 261, 378, 30, 40};
  ASSERT_TRUE(engine.Prefill(tokens, 0, lanes, nullptr).ok());
  ASSERT_TRUE(engine.Decode(50, 7, *attn, nullptr).ok());
  SafetensorsFile f;
  f.metadata["model"] = "stories260K";
  const int64_t t = 8;
  for (int l : {0, 3}) {
    AddFloatTensor(f, "layer." + std::to_string(l) + ".q", {t, c.num_q_heads, c.head_dim},
                   q[l].data(), false);
    AddFloatTensor(f, "layer." + std::to_string(l) + ".k", {t, c.num_kv_heads, c.head_dim},
                   k[l].data(), false);
    AddFloatTensor(f, "layer." + std::to_string(l) + ".v", {t, c.num_kv_heads, c.head_dim},
                   v[l].data(), true);
  }
  const std::string path = TempPath("trace.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, f).ok());
  auto trace = LoadTrace(path);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_EQ(trace->layers.size(), 2u);
  EXPECT_EQ(trace->layers[1].layer, 3);
  EXPECT_EQ(trace->layers[1].num_tokens, t);
  EXPECT_EQ(trace->layers[1].num_q_heads, 8);
  EXPECT_EQ(trace->layers[1].num_kv_heads, 4);
  EXPECT_EQ(trace->layers[1].head_dim, 8);
  EXPECT_EQ(trace->layers[1].q, q[3]);
  EXPECT_EQ(trace->layers[1].k, k[3]);
  double norm = 0;
  for (float x : trace->layers[0].v) norm += static_cast<double>(x) * x;
  EXPECT_GT(norm, 0.0);
  EXPECT_EQ(trace->metadata.at("model"), "stories260K");
  // A trace missing v is rejected with a message naming the layer.
  f.tensors.erase("layer.3.v");
  ASSERT_TRUE(WriteSafetensors(path, f).ok());
  auto bad = LoadTrace(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("layer 3"), std::string::npos);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvferry::bench
