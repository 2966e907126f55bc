// Copyright kvferry authors. Apache-2.0.
#pragma once
// CPU attention entry points used by the runtime. Each picks its implementation once at run time
// from an ordered list (fastest first, scalar reference last) by what the CPU supports:
// AVX-512 BF16/FP16, AVX-512F, AVX2, scalar (see cpu_features.h; KVFERRY_CPU_ISA caps it).
// All of them are single-threaded; the worker pool (pool.h) parallelises over items.

#include <cstdint>
#include <vector>

#include "base/attn_types.h"

namespace kvferry::cpu {

/// Attends every item of the batch (single-threaded; the worker pool parallelises over items).
void AttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items);

/// Causal paged attention (prefill and dense decode) on the CPU. Items with num_q * group >= 32
/// (prefill chunks) go through the flash-style dense path: oneDNN matmuls over key blocks of
/// several pages with a vectorised online softmax between them. The matmuls run in the KV dtype
/// where oneDNN has a native kernel for it (AMX / AVX-512 BF16); q and the softmax weights are then
/// rounded to the KV dtype (as GPU flash attention does), so the result matches the reference to
/// the dtype's precision. Elsewhere they run in f32 (K/V converted as they are gathered) and match
/// it to fp32 rounding. Decode-sized items use the SIMD kernels and match the reference to fp32
/// rounding.
void AttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items);

/// Queries per unit of work when a host prefill chunk of \p tokens tokens is spread over
/// \p threads workers as (KV head, query block) units: 64 (what the dense path is tuned for),
/// halved down to 16 while there would be fewer than about 4 units per thread.
int64_t PrefillQueryBlock(int64_t tokens, int num_kv_heads, int threads);

/// ConvertSpan (dtype.h) through the vectorised kernels: \p n elements between f32, bf16 and f16,
/// bit-identical to ConvertSpan except for NaN payloads.
void Convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n);

/// Scaled logits of a GQA group over all positions [0, n) of a paged KV head:
/// logits[g * n + j]. Used by the oracle policy and LFPS candidate scoring.
void ScorePaged(const AttnParams& p, const float* q, const KvPages& kv, int64_t n, float* logits);

/// Exact top-k indices (see TopKRef for the ordering contract). Vectorised threshold filter plus
/// partial selection; equals TopKRef exactly.
void TopK(const float* scores, int64_t n, int64_t k, int32_t* out_indices);

/// Name of the implementation AttendRows uses on this CPU ("avx512_bf16", "avx512f", "avx2",
/// "scalar").
const char* AttendRowsImplName();

// ---- additions for the CPU route, LFPS and the benchmarks ----------------------------------------

/// Attention of one GQA group over a list of positions of a paged KV head (the CPU route's unit of
/// work: only positions cross from the planner, rows are read where they lie). Same output
/// contract as RowAttnItem: normalised o, natural-log lse, count == 0 gives o = 0, lse = -inf.
struct PositionAttnItem {
  const float* q = nullptr;  ///< [group, head_dim] fp32
  float* o = nullptr;        ///< [group, head_dim] fp32
  float* lse = nullptr;      ///< [group]
  KvPages kv;
  const int32_t* positions = nullptr;  ///< [count], any order, each < stored length
  int32_t count = 0;
};

/// Attends every item (single-threaded).
void AttendPositions(const AttnParams& p, const PositionAttnItem* items, int64_t num_items);

/// Scaled logits over a position list: logits[g * count + j] = scale * q_g . k_{positions[j]}.
void ScorePositions(const AttnParams& p, const float* q, const KvPages& kv,
                    const int32_t* positions, int32_t count, float* logits);
/// The same with a row stride: logits[g * ld + j], ld >= count (a slice of a longer list).
void ScorePositions(const AttnParams& p, const float* q, const KvPages& kv,
                    const int32_t* positions, int32_t count, float* logits, int64_t ld);

/// Scaled logits over [begin, end): logits[g * ld + (j - begin)].
void ScoreRange(const AttnParams& p, const float* q, const KvPages& kv, int64_t begin,
                int64_t end, float* logits, int64_t ld);

/// Indices i in [0, n) with x[i] > thr, ascending, offset by \p base; returns the count. \p out has
/// room for n. (The vectorised scan behind TopK and the LFPS candidate tables.)
int64_t FilterGreater(const float* x, int64_t n, float thr, int32_t base, int32_t* out);

/// Entries per block of FilterGreaterBlocked's block bounds.
inline constexpr int64_t kFilterBlock = 64;

/// FilterGreater over x[lo, hi) that skips whole blocks: block b = x[b kFilterBlock, (b + 1)
/// kFilterBlock) is read only if bound[b] > thr. On entry every bound[b] must be >= each non-NaN
/// entry of its block (an upper bound: then the result equals FilterGreater exactly). Writes i (not
/// i - lo) for every i in [lo, hi) with x[i] > thr, ascending; returns the count; \p out has room
/// for hi - lo. Every block read in full (lying inside [lo, hi)) gets its exact bound back (max of
/// its non-NaN entries, -inf if none), so stale bounds tighten where they are looked at.
int64_t FilterGreaterBlocked(const float* x, float* bound, int64_t lo, int64_t hi, float thr,
                             int32_t* out);

/// acc[j] += weight * softmax(x)[j] for j in [0, n) (vectorised exp; n >= 1, max(x) finite).
void SoftmaxAccumulate(const float* x, int64_t n, float weight, float* acc);

/// Tunes the row-gather kernels (AttendPositions, AttendRows, ScorePositions): K/V rows are
/// prefetched \p rows rows ahead (0..256) into L1 (\p hint 0) or L2 (1). Only for benchmarks and
/// tuning; call while no kernel runs. Defaults: 16 rows, L1.
void SetGatherPrefetch(int rows, int hint);

/// Which dense implementation AttendPagedWith uses.
enum class DenseImpl : uint8_t { kAuto = 0, kOneDnn = 1, kSimd = 2 };

/// Dense causal paged attention through \p impl. Returns false (and writes nothing) when \p impl
/// cannot run this shape here (oneDNN has no primitive for the dtype on this CPU).
bool AttendPagedWith(DenseImpl impl, const AttnParams& p, const PagedAttnItem& item);

/// oneDNN's implementation name for the bf16/f16 QK^T matmul of this shape ("brg:avx512_core_amx",
/// "gemm:jit", ...), or "unavailable".
const char* OneDnnMatmulImplName(const AttnParams& p);

/// Makes oneDNN's OpenMP runtime use one thread on the calling thread (a no-op if oneDNN's
/// runtime is not OpenMP). The pool calls it on every worker so oneDNN never oversubscribes it.
void LimitOneDnnThreadsOnThisThread();

}  // namespace kvferry::cpu

namespace kvferry::cpu {

/// The host implementation of one layer of a planned decode step (see DecodeStepArgs): append,
/// attend and combine, serially, with the kernels above. The host-emulated device runs it, and it
/// is the reference the CUDA DecodeStep is tested against.
void DecodeStep(const DecodeStepArgs& args);

/// The host implementation of Device::SplitStepList (see SplitListArgs) over the items of
/// \p step (its batch, slots, positions, list and list_count), and the reference of the CUDA one.
void SplitStepList(const DecodeStepArgs& step, const SplitListArgs& split);

/// The host implementation of Device::PrefetchListRows over \p next's items (its layer, list,
/// bank view and stage), and the reference of the CUDA one. A view with neither map holds nothing:
/// every non-resident entry is a miss.
void PrefetchListRows(const DecodeStepArgs& next);

/// The oracle's selection over positions [0, n) of a paged KV head: the k positions of largest
/// softmax weight summed over the GQA group (q: [group, head_dim] fp32), ascending; ties to the
/// lower position. \p logits and \p weights are scratch (resized).
void ExactTopKSelect(const AttnParams& p, const float* q, const KvPages& kv, int64_t n, int64_t k,
                     std::vector<float>& logits, std::vector<float>& weights, int32_t* out);

}  // namespace kvferry::cpu
