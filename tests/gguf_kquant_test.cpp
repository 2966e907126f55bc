// Copyright kvferry authors. Apache-2.0.
// GGUF dequantisation of Q4_K, Q5_K, Q6_K (and Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) against the gguf Python
// package's reference dequantisers: tests/data/gguf_kquant_vectors.bin holds random blocks and
// the floats the reference gives for them (examples/llama/scripts/gen_kquant_vectors.py).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "examples/llama/gguf.h"

namespace kvferry::llama {
namespace {

struct Entry {
  uint32_t type = 0;
  uint32_t elems = 0;
  std::vector<uint8_t> blocks;
  std::vector<float> expected;
};

std::vector<Entry> ReadVectors() {
  auto bytes = ReadFileBytes(std::string(KVFERRY_TEST_DATA_DIR) + "/gguf_kquant_vectors.bin");
  EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
  std::vector<Entry> out;
  if (!bytes.ok()) return out;
  const std::vector<uint8_t>& b = *bytes;
  size_t pos = 0;
  const auto u32 = [&]() {
    uint32_t v = 0;
    std::memcpy(&v, b.data() + pos, 4);
    pos += 4;
    return v;
  };
  EXPECT_EQ(std::string(b.begin(), b.begin() + 4), "KQV1");
  pos = 4;
  const uint32_t n = u32();
  for (uint32_t i = 0; i < n; ++i) {
    Entry e;
    e.type = u32();
    e.elems = u32();
    const uint32_t nbytes = u32();
    e.blocks.assign(b.begin() + pos, b.begin() + pos + nbytes);
    pos += nbytes;
    e.expected.resize(e.elems);
    std::memcpy(e.expected.data(), b.data() + pos, e.elems * sizeof(float));
    pos += e.elems * sizeof(float);
    out.push_back(std::move(e));
  }
  EXPECT_EQ(pos, b.size());
  return out;
}

TEST(GgufKQuant, MatchesReferenceDequantisers) {
  const std::vector<Entry> entries = ReadVectors();
  ASSERT_EQ(entries.size(), 8u);
  std::map<std::string, int> seen;
  for (const Entry& e : entries) {
    const std::string name = GgmlTypeName(e.type);
    auto bytes = GgmlBytes(e.type, e.elems);
    ASSERT_TRUE(bytes.ok()) << name << ": " << bytes.status().ToString();
    ASSERT_EQ(*bytes, e.blocks.size()) << name;
    std::vector<float> got(e.elems);
    Status st = DequantizeRow(e.type, e.blocks, e.elems, got.data());
    ASSERT_TRUE(st.ok()) << name << ": " << st.ToString();
    int exact = 0;
    for (uint32_t i = 0; i < e.elems; ++i) {
      // Exact, or within one ulp of f32 (the reference's numpy may order a product differently).
      const float want = e.expected[i];
      const float ulp = std::nextafter(std::fabs(want), INFINITY) - std::fabs(want);
      ASSERT_LE(std::fabs(got[i] - want), ulp) << name << " element " << i << ": " << got[i]
                                                << " vs reference " << want;
      exact += got[i] == want;
    }
    seen[name] = exact;
    std::printf("%-5s %5u elements, %5d bit-exact\n", name.c_str(), e.elems, exact);
  }
  for (const char* t : {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0", "Q4_0", "Q4_1"}) {
    EXPECT_EQ(seen.count(t), 1u) << t;
  }
}

TEST(GgufKQuant, SizesAndPartialBlocks) {
  EXPECT_EQ(*GgmlBytes(12, 256), 144u);  // Q4_K
  EXPECT_EQ(*GgmlBytes(13, 512), 352u);  // Q5_K
  EXPECT_EQ(*GgmlBytes(14, 256), 210u);  // Q6_K
  EXPECT_EQ(*GgmlBytes(6, 64), 44u);     // Q5_0
  EXPECT_EQ(*GgmlBytes(7, 32), 24u);     // Q5_1
  EXPECT_FALSE(GgmlBytes(12, 128).ok());  // not a whole super-block
  EXPECT_EQ(GgmlTypeName(14), "Q6_K");
  std::vector<uint8_t> short_block(143);
  std::vector<float> out(256);
  EXPECT_FALSE(DequantizeRow(12, short_block, 256, out.data()).ok());
}

}  // namespace
}  // namespace kvferry::llama
