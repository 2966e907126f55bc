// Copyright kvferry authors. Apache-2.0.
#pragma once
// Host launchers of the CUDA kernels (CUDA builds only). Each takes a stream, never allocates,
// checks its launch, and returns a Status. Scratch memory is passed in by the caller (the Device
// owns one workspace per stream). Head dim and dtype are run-time values converted to template
// parameters by one dispatch switch (see DISPATCH_HEAD_DIM in attention.cu).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "base/attn_types.h"
#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

/// Scratch for split-KV partial results; bytes may be 0 (then no splitting).
struct AttnWorkspace {
  float* data = nullptr;
  size_t bytes = 0;
};

/// What the launchers need to know about the GPU.
/// Whether the decode kernels are instantiated for this shape (head_dim 64/128/256, bf16/fp16).
Status CheckAttnShape(const AttnParams& p);

/// Sparse attention over row lists (RowAttnItem). Items and row-address lists must be readable by
/// the device; rows may be in device memory or mapped pinned host memory.
Status LaunchAttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items,
                        const LaunchInfo& info, AttnWorkspace ws, cudaStream_t stream);

/// Causal paged attention (dense decode when num_q == 1, prefill when num_q > 1).
Status LaunchAttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items,
                         const LaunchInfo& info, AttnWorkspace ws, cudaStream_t stream);

/// One layer of the Runtime's decode step (see DecodeStepArgs): append, attend, combine; three
/// launches that read the step's slots and positions from device memory (graph-capturable).
Status LaunchDecodeStep(const DecodeStepArgs& args, const LaunchInfo& info, cudaStream_t stream);

/// The scheduler's split of a step's list between the device and the CPU (see SplitListArgs): a
/// CTA per item, a stable partition in list order.
Status LaunchSplitStepList(const DecodeStepArgs& step, const SplitListArgs& split, cudaStream_t stream);

/// The cross-layer prefetch of the next layer's misses into its stage (Device::PrefetchListRows):
/// a warp a list entry, a few CTAs an item.
Status LaunchPrefetchListRows(const DecodeStepArgs& next, const LaunchInfo& info, cudaStream_t stream);

/// The paths of the selection's top-k (LaunchSelectTopK).
enum class SelectTopKPath : int32_t {
  kAuto = 0,      ///< multi-CTA for items ranking >= kSelectMctaMinKeys scores (when
                  ///< select_mcta_ws is set), one CTA per item for the others; outside graph
                  ///< capture with max_len_hint below the threshold, one CTA for all
  kOneCta = 1,    ///< one CTA per item (the kernels before the multi-CTA top-k)
  kMultiCta = 2,  ///< multi-CTA for every item that ranks (needs select_mcta_ws): the fused
                  ///< cooperative kernel where its grid fits the GPU at once, else a launch a pass
  kMultiCtaPerPass = 3,  ///< as kMultiCta, always a launch a pass (never the fused kernel)
};

/// The ranking stage of a selection (args.ranks, see SelectRanks): the logits (log2 domain) or
/// page scores are already in args.select_ws ([item][group][select_ld]); writes
/// args.list/list_count (row 0 of each item's scratch is overwritten). Everything per step is read
/// on the device: graph-capturable. The policies' selections call it after their scoring; tests
/// and benchmarks call it alone for the two top-k paths. stats_parts >
/// 0: the scoring already wrote that many partial (max, sum) pairs a query head into each item's
/// multi-CTA scratch and zeroed its histograms (SparCas's 4-bit scoring can, though the runtime
/// keeps it off), so the multi-CTA path skips its statistics pass.
Status LaunchSelectTopK(const DecodeStepArgs& args, const LaunchInfo& info, SelectTopKPath path,
                        cudaStream_t stream, int32_t stats_parts = 0);

/// The selection's building blocks (gpu/decode_select.cu) the policies' selections call
/// (policies/*/select.cu).
/// The checks every selection makes of its arguments (kInvalidArgument naming what is wrong).
Status CheckSelectArgs(const DecodeStepArgs& args);
/// The power-of-two sort capacity of the one-CTA top-k (page ranking: pages).
int64_t SelectSortCap(const DecodeStepArgs& args);
/// What every scoring's launch sizes its grids by: the items, q's bytes in shared memory, the
/// CTAs an item may take (8 an SM over all items), and the score kernels' gridDim.y (a warp per 8
/// keys).
struct SelectGrid {
  int64_t items = 0;
  size_t q_smem = 0;
  int64_t fill = 1;
  unsigned gy = 1;
};
SelectGrid SelectGridOf(const DecodeStepArgs& args, const LaunchInfo& info);
/// The opening of a policy's select launcher (DeviceKernel::cuda, whose args is the step): the
/// step, checked by CheckSelectArgs and for its page table, its stream and its grid. step is null
/// for a step of no items: nothing to launch.
struct SelectLaunch {
  const DecodeStepArgs* step = nullptr;
  cudaStream_t stream = nullptr;
  SelectGrid grid;
};
Result<SelectLaunch> OpenSelectLaunch(const void* args, const LaunchInfo& info, void* stream);
/// A policy's select launcher (DeviceKernel::cuda) from its body \p Body, which gets the checked
/// step of at least one item, its stream and grid (OpenSelectLaunch).
template <Status (*Body)(const DecodeStepArgs&, const LaunchInfo&, cudaStream_t, const SelectGrid&)>
Status SelectLauncher(const void* args, const LaunchInfo& info, void* stream) {
  Result<SelectLaunch> l = OpenSelectLaunch(args, info, stream);
  if (!l.ok()) return l.status();
  if (l->step == nullptr) return Status::Ok();  // no items
  return Body(*l->step, info, l->stream, l->grid);
}
/// PrHS's depth window on the finished lists (DecodeStepArgs::hide_fraction; nothing at 0).
Status LaunchPsawFilter(const DecodeStepArgs& args, cudaStream_t stream);

/// The prefill priming statistics (PrimeArgs, gpu/prime.cu): zeroes the tables and stats, then
/// three launches; tables, stats, scratch and q in device memory, pages device-readable.
Status LaunchPrimeAttention(const PrimeArgs& args, int num_sms, cudaStream_t stream);

/// LFPS's scan over the device copy of its int8 shadow of K (see ShadowScanArgs, gpu/shadow_scan.cu):
/// four launches, no allocation; cpu::ShadowScanRef is the specification.
Status LaunchShadowScan(const ShadowScanArgs& args, cudaStream_t stream);

/// A prefill chunk's K/V converted to the KV dtype and written to the host store (zero-copy),
/// the resident tier and the staging, then (staging only) positions [history_begin, pos0) read
/// from the host store into the staging (zero-copy), so that the staging holds rows
/// [history_begin, new_len) of each head in its page layout.
Status LaunchPrefillStage(const PrefillStageArgs& args, cudaStream_t stream);

/// Splits history pages [0, history_pages) into the segments a prefill chunk of \p chunk_tokens
/// queries copies and attends one after another (PrefillChunkArgs): segment j is pages
/// [begin[j], begin[j + 1]). The first is about as long as the chunk's own causal block takes to
/// attend (its copy hides under it); each next one 1.5 times the last (a segment's copy takes
/// about 0.7 of its attention for 2K-token chunks of 32 query heads, so it hides under the
/// previous segment's), at most kPrefillSegmentMaxPages; a short rest joins the last segment.
/// Returns the count (at most kPrefillMaxSegments; 0 when history_pages is 0); begin holds
/// count + 1 entries.
constexpr int64_t kPrefillSegmentMinPages = 2;
constexpr int64_t kPrefillSegmentMaxPages = 32;
int PlanPrefillSegments(int64_t history_pages, int64_t chunk_tokens, int64_t page_tokens,
                        int64_t* begin);

/// The copies that bring pages [page_begin, page_end) of heads [0, num_kv_heads) from the host
/// store (host_pages[h * max_pages + p]) into a staging of the same page layout (head h's page p
/// at staging + (h * staging_pages + p) * page_bytes): one copy per run of pages that are
/// consecutive in both. Writes at most num_kv_heads * (page_end - page_begin) entries to dst,
/// src and bytes (three arrays); returns the count.
int64_t ListPageCopies(void* const* host_pages, int64_t max_pages, int num_kv_heads,
                       int64_t page_begin, int64_t page_end, char* staging, int64_t staging_pages,
                       int64_t page_bytes, void** dst, const void** src, size_t* bytes);

/// The write-through of a staged chunk: for every head and every page the chunk's rows
/// [a.pos0, a.new_len) touch, two copies (the page's K rows, then its V rows) from the staging
/// (the layout above) to the host store's page (host_pages[h * max_pages + p]). Writes at most
/// 2 * num_kv_heads * max_pages entries to dst, src and bytes; returns the count.
int64_t ListWriteThroughCopies(const PrefillStageArgs& a, void* const* host_pages, int64_t staging_pages,
                               void** dst, const void** src, size_t* bytes);

/// dst[i] <- convert(src[i]) for n elements.
Status LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                     cudaStream_t stream);

/// rows[i].dst <- convert(rows[i].src), elems elements each; rows[] device-readable.
Status LaunchCopyRows(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                      DType dst_dtype, cudaStream_t stream);

/// Exact merge in place into (o_a, lse_a) (o_b/lse_b may be null), then o_a -> out (out_dtype)
/// when out != null. See cpu::MergeLseRef.
Status LaunchMergeLse(float* o_a, float* lse_a, const float* o_b, const float* lse_b,
                      int64_t rows, int head_dim, void* out, DType out_dtype, cudaStream_t stream);

/// The stream waits until the mapped host word reaches \p value (Device::WaitHostValue): one
/// thread polls it; after \p timeout_s seconds it stops and sets word[1] = 1.
Status LaunchWaitHostValue(const uint32_t* word, uint32_t value, int timeout_s, cudaStream_t stream);

/// Scratch bytes LaunchTopK needs for \p rows rows of top-\p k (0 for k <= 4096).
size_t TopKWorkspaceBytes(int64_t rows, int64_t k);

/// Exact top-k of each of \p rows score rows (row r at scores + r * ld, n valid scores): indices
/// ordered by score descending, ties by lower index, NaN ranks as -inf (see cpu::TopKRef). Radix
/// select on order-preserving keys, then a bitonic sort of the k winners; deterministic.
/// out: [rows, k] (k clamped to n; the row stride of out is k).
Status LaunchTopK(const float* scores, int64_t n, int64_t ld, int64_t rows, int64_t k,
                  int32_t* out, void* workspace, size_t workspace_bytes, cudaStream_t stream);

/// Causal prefill attention of one (sequence, KV head) query block on tensor cores (see
/// gpu/prefill.cuh). The group query heads of a token are rows of the same query tile, so they
/// share every K/V tile load (GQA). All pointers device-readable; q, k, v 16-byte aligned with
/// q_stride_tok and kv_stride multiples of 8 elements (cp.async moves 16-byte chunks); o aligned
/// to two output elements.
///
/// Keys: position p's K row is at k + p * kv_stride elements when kv_page_shift is 0. When it is
/// > 0 (>= 5), the rows are in the host store's page layout: pages of P = 2^kv_page_shift
/// positions, each page's P K rows followed by its P V rows, so that position p's K row is at
/// k + ((p / P) * 2 P + p % P) * kv_stride, and its V row at the same offset from v = k + P
/// kv_stride.
struct PrefillAttnItem {
  const void* q = nullptr;   ///< [num_q, group, head_dim], dtype = kv dtype (bf16 or f16)
  int64_t q_stride_tok = 0;  ///< elements between consecutive tokens of q, of o and of o_in
  void* o = nullptr;         ///< same layout and stride as q; dtype given by the launch
  float* lse = nullptr;      ///< [num_q, group] natural-log lse, may be null
  const void* k = nullptr;   ///< key rows, see above
  const void* v = nullptr;   ///< value rows, same layout
  int64_t kv_stride = 0;     ///< elements between consecutive positions' rows (within a page)
  int32_t kv_page_shift = 0;
  int32_t num_q = 0;
  int64_t q_pos0 = 0;  ///< position of query 0; query t attends positions [0, q_pos0 + t]
  /// > 0: positions from kv_limit on are not attended either (a segment of earlier positions that
  /// every query sees whole: q_pos0 >= kv_limit - 1).
  int64_t kv_limit = 0;
  /// Optional partial result to merge with (both or neither): o_in f32 laid out like o (same
  /// element stride), lse_in like lse. (o, lse) then receive the exact merge of this launch's
  /// attention and (o_in, lse_in); o_in / lse_in may be o / lse themselves (o f32).
  const float* o_in = nullptr;
  const float* lse_in = nullptr;
};
static_assert(sizeof(PrefillAttnItem) <= kPrefillItemBytes, "PrefillChunkArgs::items sizing");

/// Causal prefill attention (FlashAttention-2 style, mma.sync on tensor cores, fp32 accumulation):
/// o normalised and lse (natural log) per (token, query head), mergeable exactly with
/// LaunchMergeLse. head_dim 64/128/256; q_dtype must equal p.kv_dtype (bf16 or f16); out_dtype
/// f32, bf16 or f16 (f32 when an item merges in place, o_in == o). \p max_num_q: the largest
/// num_q of the items (sizes the grid). Reads only positions [0, q_pos0 + num_q) of each item's
/// K/V, and below kv_limit when set. No workspace; never allocates.
Status LaunchPrefillAttention(const AttnParams& p, DType q_dtype, DType out_dtype,
                              const PrefillAttnItem* items, int64_t num_items, int32_t max_num_q,
                              cudaStream_t stream);

}  // namespace kvferry::cuda
