// Copyright kvferry authors. Apache-2.0.
// RuntimeConfig's tuning fields (xl_prefetch_gap_us, split_share, split_min_us, cpu_spin_us) and
// PolicyConfig::weights_path: a bad value of each is refused at Create with kInvalidArgument
// naming the field; good values, the bounds included, make a runtime.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <set>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kvferry/runtime.h"
#include "kvferry/stats.h"

namespace kvferry {
namespace {

RuntimeConfig Small(const std::string& policy = "oracle") {
  RuntimeConfig c;
  c.model = {.num_layers = 2, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 8,
             .kv_dtype = DType::kBF16};
  c.capacity.max_sequences = 1;
  c.capacity.max_tokens_per_sequence = 256;
  c.capacity.max_batch = 1;
  c.capacity.max_prefill_chunk = 64;
  c.tiers.sink_tokens = 2;
  c.tiers.window_tokens = 8;
  c.policy.name = policy;
  c.policy.budget_tokens = 20;
  c.backend = Backend::kHost;
  c.cpu_threads = 1;
  c.probe_at_start = false;
  return c;
}

// Create refuses \p c with kInvalidArgument and a message holding \p field.
void ExpectRefused(const RuntimeConfig& c, const std::string& field, const std::string& what) {
  SCOPED_TRACE(what);
  auto rt = Runtime::Create(c);
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), StatusCode::kInvalidArgument) << rt.status().ToString();
  EXPECT_NE(rt.status().message().find(field), std::string::npos) << rt.status().ToString();
}

// Stats::ForEachField (what ToJson and the Python binding's stats() write) visits every field
// once: the fields it visits tile the struct (each 8 bytes, no gaps), under distinct names, and
// ToJson holds each name with its value.
TEST(ConfigFields, StatsForEachFieldVisitsEveryField) {
  Stats s;
  int64_t i = 0;
  std::set<std::string> names;
  std::vector<const char*> at;
  s.ForEachField([&](const char* name, auto& field) {
    field = static_cast<std::remove_reference_t<decltype(field)>>(++i);
    names.insert(name);
    at.push_back(reinterpret_cast<const char*>(&field));
  });
  ASSERT_GT(i, 0);
  EXPECT_EQ(names.size(), static_cast<size_t>(i)) << "a name visited twice";
  EXPECT_EQ(sizeof(Stats), static_cast<size_t>(i) * 8) << "a field ForEachField does not visit";
  std::sort(at.begin(), at.end());
  for (size_t k = 0; k < at.size(); ++k) {
    EXPECT_EQ(at[k], reinterpret_cast<const char*>(&s) + 8 * k) << "field " << k;
  }
  const std::string json = s.ToJson();
  int64_t v = 0;
  s.ForEachField([&](const char* name, const auto&) {
    ++v;
    EXPECT_NE(json.find("\"" + std::string(name) + "\":" + std::to_string(v)), std::string::npos)
        << name << " in " << json;
  });
}

TEST(ConfigFields, BadTuningValuesAreRefusedNamingTheField) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Bad {
    std::string field;
    std::function<void(RuntimeConfig&)> set;
    std::string what;
  };
  const std::vector<Bad> bad = {
      {"xl_prefetch_gap_us", [](RuntimeConfig& c) { c.xl_prefetch_gap_us = -1.0; }, "gap -1"},
      {"xl_prefetch_gap_us", [&](RuntimeConfig& c) { c.xl_prefetch_gap_us = nan; }, "gap nan"},
      {"xl_prefetch_gap_us", [&](RuntimeConfig& c) { c.xl_prefetch_gap_us = inf; }, "gap inf"},
      {"split_share", [](RuntimeConfig& c) { c.split_share = 1.5; }, "share 1.5"},
      {"split_share", [](RuntimeConfig& c) { c.split_share = -0.5; }, "share -0.5"},
      {"split_share", [&](RuntimeConfig& c) { c.split_share = nan; }, "share nan"},
      {"split_min_us", [](RuntimeConfig& c) { c.split_min_us = -1.0; }, "min -1"},
      {"split_min_us", [&](RuntimeConfig& c) { c.split_min_us = nan; }, "min nan"},
      {"cpu_spin_us", [](RuntimeConfig& c) { c.cpu_spin_us = -1; }, "spin -1"},
      {"cpu_spin_us", [](RuntimeConfig& c) { c.cpu_spin_us = 1000001; }, "spin 1000001"},
  };
  for (const Bad& b : bad) {
    RuntimeConfig c = Small();
    b.set(c);
    ExpectRefused(c, b.field, b.what);
  }
}

TEST(ConfigFields, GoodTuningValuesMakeARuntime) {
  for (const double share : {-1.0, 0.0, 0.5, 1.0}) {
    RuntimeConfig c = Small();
    c.split_share = share;
    c.split_min_us = 0.0;
    c.xl_prefetch_gap_us = 0.0;
    c.cpu_spin_us = share < 0 ? 0 : 1000000;
    auto rt = Runtime::Create(c);
    EXPECT_TRUE(rt.ok()) << "split_share " << share << ": " << rt.status().ToString();
  }
}

// A weights path that is no weights file: refused naming policy.weights_path (a missing file, and
// a file that is not safetensors). With "scorer" 0 kvpop reads no weights, so the path is not
// opened; other policies take none and ignore it.
TEST(ConfigFields, BadWeightsPathIsRefusedNamingTheField) {
  RuntimeConfig c = Small("kvpop");
  c.policy.weights_path = ::testing::TempDir() + "config_fields_no_such_file.safetensors";
  std::remove(c.policy.weights_path.c_str());
  ExpectRefused(c, "policy.weights_path", "missing file");
  const std::string junk = ::testing::TempDir() + "config_fields_junk.safetensors";
  {
    std::ofstream f(junk, std::ios::binary);
    f << "not a safetensors file";
  }
  c.policy.weights_path = junk;
  ExpectRefused(c, "policy.weights_path", "not safetensors");
  c.policy.params["scorer"] = 0;
  EXPECT_TRUE(Runtime::Create(c).ok());
  RuntimeConfig o = Small();
  o.policy.weights_path = junk;
  EXPECT_TRUE(Runtime::Create(o).ok());
  std::remove(junk.c_str());
}

}  // namespace
}  // namespace kvferry
