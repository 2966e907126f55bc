// Copyright kvferry authors. Apache-2.0.
#pragma once
// dense, streaming and oracle, plus helpers other policies and the benchmarks reuse.

#include <cstdint>
#include <vector>

#include "policies/policy.h"

namespace kvferry {

/// StreamingLLM's set: the first min(sink, budget) positions and the most recent ones, budget in
/// total (ascending).
void StreamingSelect(int64_t n, int sink, int64_t budget, std::vector<int32_t>& out);

/// Softmax weight of every position [0, ctx.n) summed over the GQA group's query heads
/// (weights[j] in [0, group]). \p logits is scratch.
void GroupAttentionWeights(const SelectContext& ctx, std::vector<float>& logits,
                           std::vector<float>& weights);

/// Exact top-budget positions by the group's summed softmax weight, ascending.
void OracleSelect(const SelectContext& ctx, std::vector<int32_t>& out);

/// "dense", "streaming" or "oracle"; kNotFound for other names.
Result<std::unique_ptr<Policy>> MakeBasicPolicy(const RuntimeConfig& config);

}  // namespace kvferry
