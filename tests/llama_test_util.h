// Copyright kvferry authors. Apache-2.0.
// The engine tests' Runtime for a model: one sequence slot per test step, small tiers, no start-up
// probes (tests/gemma3_engine_test.cpp, tests/llama_smollm2_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "examples/llama/engine.h"
#include "examples/llama/model.h"

namespace kvferry::llama::testing_util {

struct LlamaRuntimeShape {
  int64_t budget = 6;      ///< tokens each step attends (dense: the whole capacity)
  int sinks = 2;
  int window = 4;
  int64_t capacity = 128;  ///< tokens per sequence
  int max_sequences = 2;
};

/// A RuntimeAttention over \p model's layers (its sliding windows included), \p policy on
/// \p backend with KV dtype \p kv; null (and a test failure) when it cannot be made.
inline std::unique_ptr<RuntimeAttention> MakeLlamaRuntime(const ModelConfig& model, const std::string& policy,
                                                          DType kv, Backend backend,
                                                          const LlamaRuntimeShape& shape = {}) {
  RuntimeConfig rc;
  rc.backend = backend;
  rc.policy.name = policy;
  rc.policy.budget_tokens = policy == "dense" ? shape.capacity : shape.budget;
  rc.model.kv_dtype = kv;
  rc.capacity.max_sequences = shape.max_sequences;
  rc.capacity.max_batch = 1;
  rc.capacity.max_tokens_per_sequence = shape.capacity;
  rc.capacity.max_prefill_chunk = 64;
  rc.tiers.sink_tokens = shape.sinks;
  rc.tiers.window_tokens = shape.window;
  rc.cpu_threads = 1;
  rc.probe_at_start = false;
  auto attn = RuntimeAttention::Create(RuntimeConfigFor(model, rc), model);
  EXPECT_TRUE(attn.ok()) << policy << ": " << attn.status().ToString();
  return attn.ok() ? std::move(attn.value()) : nullptr;
}

}  // namespace kvferry::llama::testing_util
