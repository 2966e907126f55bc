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

/// One key block of the host prefill's online softmax (AttendPagedDense, attention.cpp), for
/// \p rows rows (query t, head g, t-major) of a [rows, cols] block of raw dot products q . k:
///  - row r attends its first allowed[r] columns (0..cols; the causal mask and the block's tail);
///  - m = max(row_max[r], max_{j < allowed[r]} scale * s[r][j]); when m rises above a finite
///    row_max[r], row_sum[r] and o[r][0..head_dim) are multiplied by e^(row_max[r] - m);
///  - p[r][j] = e^(scale * s[r][j] - m) rounded to p_dtype for j < allowed[r], 0 for the rest of
///    [0, cols); row_sum[r] += the sum of the rounded weights (what multiplies V);
///  - a row with allowed[r] == 0, or whose every logit so far is -inf, gets p = 0 and keeps its
///    state.
struct PrefillSoftmaxArgs {
  const float* s = nullptr;  ///< [rows, ld_s]
  int64_t ld_s = 0;
  void* p = nullptr;  ///< [rows, ld_p] of p_dtype (f32, bf16 or f16)
  int64_t ld_p = 0;
  DType p_dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  const int32_t* allowed = nullptr;  ///< [rows]
  float scale = 1.0f;
  float* row_max = nullptr;   ///< [rows], -inf before the first block
  double* row_sum = nullptr;  ///< [rows], 0 before the first block
  float* o = nullptr;         ///< [rows, ld_o] fp32 accumulator (P V so far)
  int64_t ld_o = 0;
  int head_dim = 0;
};

/// LFPS's approximate scan (policies/lfps/lfps.cpp) over an int8 channel-major shadow of K, in exact
/// int32 arithmetic so that every table gives the same bits: for j in [begin, end) and g < group,
/// acc[g * ld + j] = sum_{c < r} w[g * r + c] * rows[c][j], and head_max[g] = the max of those
/// (INT32_MIN for an empty range). The SIMD tables multiply int16 pairs: they need
/// ScanArgsFitSimd (|w| <= kScanMaxSimdWeight, r <= 256, group <= kMaxSimdGroup); the scalar table
/// takes any arguments whose sums fit int32.
struct ScanInt8Args {
  const int8_t* const* rows = nullptr;  ///< [r] channel rows, token j at rows[c][j]
  const int32_t* w = nullptr;           ///< [group, r]
  int r = 0;
  int group = 0;
  int64_t begin = 0, end = 0;  ///< tokens
  int32_t* acc = nullptr;      ///< [group, ld]
  int64_t ld = 0;
  int32_t* head_max = nullptr;  ///< [group]
};

/// Keys of the scan's scores: for j in [begin, end), s_j = max_g (acc[g * ld + j] - mx[g]) (no
/// overflow: the caller's mx[g] is the max of acc[g]) and key_j = ScanKey(s_j); every j with
/// key_j >= thr is written to idx and its key to key, ascending j. Returns how many.
struct ScanCollectArgs {
  const int32_t* acc = nullptr;  ///< [group, ld]
  int64_t ld = 0;
  int group = 0;                ///< <= kMaxSimdGroup
  const int32_t* mx = nullptr;  ///< [group]
  int64_t begin = 0, end = 0;
  uint32_t thr = 0;
  int32_t* idx = nullptr;   ///< room for end - begin
  uint32_t* key = nullptr;  ///< room for end - begin
};

inline constexpr int32_t kScanMaxSimdWeight = 32767;

/// The scan's order key of an integer score: the unsigned key with the order of the float
/// (float)s (round to nearest; so distinct scores can tie, as their floats do). Equals
/// LFPS's OrderedKey((float)s): no NaN or -0 arises from an int.
inline uint32_t ScanKey(int32_t s) {
  const float f = static_cast<float>(s);
  uint32_t b;
  __builtin_memcpy(&b, &f, sizeof(b));
  return b ^ (static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) | 0x80000000u);
}

/// True if the SIMD tables' scan_int8 takes these arguments (see ScanInt8Args).
inline bool ScanArgsFitSimd(const ScanInt8Args& a) {
  if (a.r < 1 || a.r > 256 || a.group < 1 || a.group > kMaxSimdGroup) return false;
  for (int64_t i = 0; i < static_cast<int64_t>(a.group) * a.r; ++i) {
    if (a.w[i] > kScanMaxSimdWeight || a.w[i] < -kScanMaxSimdWeight) return false;
  }
  return true;
}

struct CpuKernels {
  CpuIsa isa = CpuIsa::kScalar;
  const char* name = "scalar";
  /// One RowAttnItem (see attn_types.h).
  void (*attend_rows)(const AttnParams& p, const RowAttnItem& item) = nullptr;
  /// One PositionAttnItem (see attention.h).
  void (*attend_positions)(const AttnParams& p, const PositionAttnItem& item) = nullptr;
  /// logits[g * ld + j] = scale * q_g . k_{positions[j]} for j in [0, count); ld >= count.
  void (*score_positions)(const AttnParams& p, const float* q, const KvPages& kv,
                          const int32_t* positions, int32_t count, float* logits,
                          int64_t ld) = nullptr;
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
  /// PrefillSoftmaxArgs above (any head_dim, any p_dtype; no shape preconditions).
  void (*prefill_softmax)(const PrefillSoftmaxArgs& args) = nullptr;
  /// ConvertSpan (dtype.h) between f32, bf16 and f16, bit-identical to it except NaN payloads
  /// (round to nearest even; f16 overflow gives inf).
  void (*convert)(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                  int64_t n) = nullptr;
  /// ScanInt8Args above (SIMD tables: only when ScanArgsFitSimd).
  void (*scan_int8)(const ScanInt8Args& args) = nullptr;
  /// ScanCollectArgs above.
  int64_t (*scan_collect)(const ScanCollectArgs& args) = nullptr;
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

/// The dense (prefill) path of AttendPaged with the softmax and conversion kernels of \p kernels
/// (tests run it with every table this CPU has). False, with nothing written, when oneDNN has no
/// matmul for the shape.
bool AttendPagedDense(const CpuKernels& kernels, const AttnParams& p, const PagedAttnItem& item);

// One per translation unit; only call after CpuSupports(isa).
const CpuKernels& ScalarKernels();
const CpuKernels& Avx2Kernels();
const CpuKernels& Avx512Kernels();
const CpuKernels& Avx512Bf16Kernels();

}  // namespace kvferry::cpu
