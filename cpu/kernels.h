// Copyright kvferry authors. Apache-2.0.
#pragma once
// The table of CPU kernels one instruction set provides. Each SIMD family lives in its own
// translation unit (kernels_avx2.cpp, kernels_avx512.cpp, kernels_avx512bf16.cpp), compiled with
// that ISA's flags and only entered after CPUID said yes; kernels_scalar.cpp is the baseline.
//
// Preconditions the SIMD tables assume (SimdShapeOk checks them; the dispatcher uses the scalar
// table otherwise): kv dtype bf16 or f16, head_dim a multiple of 8 and at most kMaxSimdHeadDim,
// group at most kMaxSimdGroup.

#include <cstdint>

#include "cpu/attention.h"
#include "base/attn_types.h"
#include "cpu/cpu_features.h"

namespace kvferry::cpu {

inline constexpr int kMaxSimdHeadDim = 256;
inline constexpr int kMaxSimdGroup = 16;

struct CpuKernels {
  CpuIsa isa = CpuIsa::kScalar;
  const char* name = "scalar";
  /// One RowAttnItem (see attn_types.h).
  void (*attend_rows)(const AttnParams& p, const RowAttnItem& item) = nullptr;
  /// One PositionAttnItem (see attention.h).
  void (*attend_positions)(const AttnParams& p, const PositionAttnItem& item) = nullptr;
  /// logits[g * count + j] = scale * q_g . k_{positions[j]}.
  void (*score_positions)(const AttnParams& p, const float* q, const KvPages& kv,
                          const int32_t* positions, int32_t count, float* logits) = nullptr;
  /// logits[g * ld + (j - begin)] = scale * q_g . k_j for j in [begin, end).
  void (*score_range)(const AttnParams& p, const float* q, const KvPages& kv, int64_t begin,
                      int64_t end, float* logits, int64_t ld) = nullptr;
  /// Writes base + i for every i in [0, n) with x[i] > thr (NaN never passes), ascending;
  /// returns how many. \p out has room for n.
  int64_t (*filter_greater)(const float* x, int64_t n, float thr, int32_t base,
                            int32_t* out) = nullptr;
  /// acc[j] += weight * softmax(x)[j] for j in [0, n), n >= 1 (x finite or -inf, max finite).
  void (*softmax_accumulate)(const float* x, int64_t n, float weight, float* acc) = nullptr;
  /// FilterGreaterBlocked (attention.h): block-skipping filter of x[lo, hi) with kFilterBlock
  /// block bounds, refreshed for the blocks read in full.
  int64_t (*filter_greater_blocked)(const float* x, float* bound, int64_t lo, int64_t hi,
                                    float thr, int32_t* out) = nullptr;
};

/// Tuning of the row-gather kernels (attention over scattered positions, position scoring): how
/// many rows ahead the K/V rows are prefetched, and into which level (0: L1, 1: L2). Plain ints,
/// read once per item; SetGatherPrefetch (attention.h) writes them, only while no kernel runs.
extern int g_gather_prefetch_rows;
extern int g_gather_prefetch_hint;

/// True if the SIMD tables handle this shape (see the file comment).
inline bool SimdShapeOk(const AttnParams& p) {
  return (p.kv_dtype == DType::kBF16 || p.kv_dtype == DType::kF16) && p.head_dim > 0 &&
         p.head_dim % 8 == 0 && p.head_dim <= kMaxSimdHeadDim && p.group >= 1 &&
         p.group <= kMaxSimdGroup;
}

/// The table for \p isa, or nullptr when this CPU cannot run it.
const CpuKernels* GetCpuKernels(CpuIsa isa);
/// The table for BestCpuIsa().
const CpuKernels& BestCpuKernels();

// One per translation unit; only call after CpuSupports(isa).
const CpuKernels& ScalarKernels();
const CpuKernels& Avx2Kernels();
const CpuKernels& Avx512Kernels();
const CpuKernels& Avx512Bf16Kernels();

}  // namespace kvferry::cpu
