// Copyright kvferry authors. Apache-2.0.
#pragma once
// CPU attention entry points used by the runtime. Each picks its implementation once at run time
// from an ordered list (fastest first, scalar reference last) by what the CPU supports.

#include <cstdint>
#include <vector>

#include "cpu/attn_types.h"

namespace kvferry::cpu {

/// Attends every item of the batch (single-threaded; the worker pool parallelises over items).
void AttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items);

/// Causal paged attention (prefill and dense decode) on the CPU.
void AttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items);

/// Scaled logits of a GQA group over all positions [0, n) of a paged KV head:
/// logits[g * n + j]. Used by the oracle policy and LFPS candidate scoring.
void ScorePaged(const AttnParams& p, const float* q, const KvPages& kv, int64_t n, float* logits);

/// Exact top-k indices (see TopKRef for the ordering contract).
void TopK(const float* scores, int64_t n, int64_t k, int32_t* out_indices);

/// Name of the implementation AttendRows uses on this CPU ("avx512_bf16", "avx512f", "avx2",
/// "scalar").
const char* AttendRowsImplName();

}  // namespace kvferry::cpu
