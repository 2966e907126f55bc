// Copyright kvferry authors. Apache-2.0.
#pragma once
// Plain work descriptors shared by the scalar reference, the CPU fast paths and the CUDA kernels.
// Every pointer is valid for the memory space of whoever executes the work (host pointers for the
// CPU, device or mapped pinned-host pointers for CUDA). Nothing here owns memory.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvferry/kv_pages.h"
#include "kvferry/tensor.h"

namespace kvferry {

// AttnParams, KvPages, PagedKRow and PagedVRow: kvferry/kv_pages.h (public: a policy reads them).

/// Attention of one GQA group (group query heads sharing a KV head) over an explicit list of KV
/// rows, in any order. Output o is normalised; lse[g] = log(sum_j exp(scale * q_g . k_j)) in
/// natural log. With count == 0: o = 0 and lse = -inf.
struct RowAttnItem {
  const float* q = nullptr;       ///< [group, head_dim] fp32
  float* o = nullptr;             ///< [group, head_dim] fp32
  float* lse = nullptr;           ///< [group]
  const void* const* k_rows = nullptr;  ///< [count] row addresses
  const void* const* v_rows = nullptr;  ///< [count]
  int32_t count = 0;
};

/// Causal attention of num_q consecutive queries (positions q_pos0 .. q_pos0+num_q-1) of one GQA
/// group over the paged rows of one KV head: query t attends positions [0, q_pos0 + t].
/// Decode over everything is num_q = 1, q_pos0 = n - 1.
struct PagedAttnItem {
  const float* q = nullptr;  ///< [num_q, group, head_dim] fp32
  float* o = nullptr;        ///< [num_q, group, head_dim] fp32
  float* lse = nullptr;      ///< [num_q, group]
  KvPages kv;
  int64_t q_pos0 = 0;
  int32_t num_q = 1;
};

}  // namespace kvferry

namespace kvferry {

/// How a decode step's rows are chosen on the device (DecodeStepArgs::mode).
enum class StepRowMode : int32_t {
  /// The first min(sink, budget, n) positions and the most recent ones up to budget in all
  /// (StreamingLLM); budget >= n is dense attention over every position.
  kSinksAndRecent = 0,
  /// The positions in list[item * list_cap ..], list_count[item] of them (a GPU selection).
  kList = 1,
};

/// What the top-k of a step's selection ranks (gpu/decode_select.cu's building blocks; each
/// policy's selector sets it in DeviceSelector::Fill, and its kernels write the scores).
enum class SelectRanks : int32_t {
  kNone = 0,
  /// Every position [0, n): the group's summed softmax weight of each (select_ws), its top
  /// min(budget, n), ascending.
  kPositions = 1,
  /// Pages of meta_page positions of the offloaded range [sink, n - window) by the score the
  /// scoring wrote a page (the group's max of bound - max bound); the best pages until budget -
  /// resident positions are taken (the last page contributes its first positions; ties to the
  /// lower page), plus sinks and window.
  kPages = 2,
  /// Positions of the offloaded range by the group's summed softmax weight over all n scores: its
  /// top budget - resident positions, plus sinks and window.
  kOffloaded = 3,
};

/// A host-store page table as the kernels read it (device-readable): table t's page p at pages[t *
/// max_pages + p], each page page_tokens K rows then as many V rows (see KvPages). Which tables a
/// struct holding it covers (all the store's, or one (slot, layer)'s heads) its field says.
struct StoreTable {
  void* const* pages = nullptr;
  int64_t max_pages = 0;
  int32_t page_tokens = 256;
};

/// Page bounds of a KV head (Quest, policies/quest/select.cu): page p's element-wise min row then max
/// row, head_dim elements each in the KV dtype, at meta + (t * meta_pages + p) * 2 * row_bytes for
/// t = (slot * num_layers + layer) * num_kv_heads + h.
struct PageBoundsArgs {
  AttnParams params;
  int32_t num_kv_heads = 0;
  int32_t num_layers = 0;
  int32_t layer = 0;
  int32_t slot = 0;
  int64_t pos0 = 0;     ///< first position written by the chunk
  int64_t new_len = 0;  ///< positions stored after it: pages [pos0 / page, (new_len-1) / page]
  StoreTable store;  ///< the whole store's, as in DecodeStepArgs
  char* meta = nullptr;
  int64_t meta_pages = 0;
  int32_t meta_page = 16;
};

/// The prompt statistics a history-table policy (LFPS) learns from at prefill, computed by the
/// device beside the prefill pass (Device::PrimeAttention) so that no host loop scores the prompt.
/// For each KV head h of one (sequence, layer), over the keys [0, n) of that head:
///  - the causal softmax of each of the `rows` query rows r (position t_first + r) and head g of
///    the group over the scored keys [sink, off_hi) with position <= t_first + r (rows with none
///    visible add nothing); with p_{r,g}(i) its weight of key i:
///      ver[i] = sum_{r,g} p_{r,g}(i) for i in [sink, off_hi) (0 elsewhere in [0, n)),
///      sla[d] = sum_{r,g} p_{r,g}(t_first + r - d) for d in [0, n) (by distance);
///  - stats (double): k_sum[hd], v_sum[hd] = column sums of K and V over [sink, n); then for the
///    last row (r = rows - 1) and each head g, over the logits l_j = scale q.k_j, j in [sink, n):
///    l_sum[g] = sum l_j, l_sq[g] = sum (l_j - l_sum[g] / (n - sink))^2, and q_sq[g] = |q|^2.
/// fp32 logits and weights, fp32 sums per key (double for stats); the order of summation is the
/// implementation's. ver and sla cover [0, n) only; the caller reads n entries of each.
struct PrimeArgs {
  AttnParams params;
  int32_t num_kv_heads = 0;
  /// Head h's rows: q + h * q_head_stride, [rows, group, head_dim] fp32 (device-readable).
  const float* q = nullptr;
  int64_t q_head_stride = 0;
  int32_t rows = 0;     ///< >= 1
  int64_t t_first = 0;  ///< position of the first row, < n; rows end at <= n
  int64_t n = 0;        ///< keys stored (>= 1)
  int64_t sink = 0;     ///< scored keys [sink, off_hi), sink <= off_hi <= n
  int64_t off_hi = 0;
  StoreTable store;  ///< the (slot, layer)'s: head h's table is t = h
  /// Head h's tables: ver at tables + h * table_stride, sla n floats after it; table_stride >= 2 n.
  float* tables = nullptr;
  int64_t table_stride = 0;
  /// Head h's stats (PrimeStatsCount doubles) at stats + h * PrimeStatsCount(...).
  double* stats = nullptr;
  /// Device scratch for the per-row softmax partials (CUDA); PrimeScratchBytes gives a size that
  /// allows splitting the keys over the GPU, fewer bytes only means fewer splits.
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
};

/// Doubles of one head's PrimeArgs::stats: k_sum, v_sum (head_dim each), l_sum, l_sq, q_sq
/// (group each).
constexpr int64_t PrimeStatsCount(int head_dim, int group) {
  return 2 * int64_t{head_dim} + 3 * group;
}

/// Scratch bytes for PrimeArgs::scratch: per head, per key split, per query vector a (max, sum)
/// pair, and a final pair per vector.
constexpr size_t PrimeScratchBytes(int num_kv_heads, int max_rows, int group, int splits) {
  return static_cast<size_t>(num_kv_heads) * max_rows * group * (splits + 1) * 2 * sizeof(float);
}

/// A token bank in device memory (cuda::DeviceBank) read by the planned step as a row source
/// (DecodeStepArgs::bank, kList mode, CUDA only). Table t = (slot * num_layers + layer) *
/// num_kv_heads + h, the resident tier's index. An offloaded position found in t's page table is
/// read from its bank slot (and the slot's reference bit set); a miss is read from the host store
/// zero-copy, its K and V rows staged at stage + (item * list_cap + j) * 2 * row_bytes for list
/// index j, and j appended to the item's miss list; the step then queues the bank's admission of
/// those misses (Device::StepBank::Admit) on the same stream.
struct StepBankView {
  const uint16_t* vmap = nullptr;  ///< vector map: [tables][max_positions], 0xffff = none
  int64_t max_positions = 0;
  const unsigned long long* hmap = nullptr;  ///< hash map: [tables][2^hash_log2] (else null)
  int32_t hash_log2 = 0;
  const char* rows = nullptr;  ///< slot s of table t: K at rows + (t * slots + s) * 2 * row_bytes
  int32_t slots = 0;
  uint32_t* refs = nullptr;  ///< reference bits, ref_words words per table
  int64_t ref_words = 0;
  char* stage = nullptr;        ///< [batch * num_kv_heads][list_cap] K, V row pairs
  int32_t* miss = nullptr;      ///< [batch * num_kv_heads][1 + miss_cap]: count, list indices
  int32_t miss_cap = 0;
  void* admit = nullptr;        ///< [batch * num_kv_heads] admission items, written by the step
  unsigned long long* hits = nullptr;  ///< rows read from the bank (device counter)
  /// 1: every miss's K and V rows are already at its list index in stage (Device::PrefetchListRows
  /// ran over this list and table before the step); the step reads them there instead of the host
  /// store, and still lists them for the admission. 0: the step reads and stages them itself.
  int32_t staged = 0;
};

/// A device selector's own arguments (policies/<name>/select.h: SparCas's compact-key state,
/// HiP's masks, KVpop's slots): a trivially copyable struct of at most kSelectorArgsBytes that the
/// selector's Fill stores (SetSelectorArgs) and its kernels and host twin read (SelectorArgsOf).
/// The step carries it as bytes, so no type of a policy appears here; it travels by value with the
/// step, as a kernel parameter, and is read into registers (a memcpy the compiler turns into
/// parameter loads), never through a pointer to the parameter.
constexpr size_t kSelectorArgsBytes = 128;
struct alignas(16) SelectorArgs {
  unsigned char bytes[kSelectorArgsBytes] = {};
};

/// One layer of a planned decode step for a batch (the Runtime's run path), executed by
/// Device::DecodeStep. Everything that changes from step to step (the sequences' slots and the new
/// token's position at every layer) is read from device memory, so the same arguments serve every
/// step of a batch and the launches can be captured in a CUDA graph. Item i = b * num_kv_heads + h.
///
/// Stages, in order on the stream: (1) append: k/v of token b are converted to the KV dtype and
/// written to the host store (write-through) and to its resident row (sink or window ring); q is
/// converted to fp32 (into q_f32 on the host; inside the attention kernel on CUDA, which also
/// appends and reads the new token from k/v when they are in the KV dtype: one launch a layer). (2) attend: each item attends its rows (resident rows from device
/// memory, the others from the host store read zero-copy) split over CTAs. (3) combine: the splits
/// and the optional CPU part (o_cpu, lse_cpu) merge exactly into out (out_dtype) and lse.
struct DecodeStepArgs {
  AttnParams params;
  int32_t batch = 0;
  int32_t num_kv_heads = 0;
  int32_t num_layers = 0;
  int32_t layer = 0;
  int32_t sink = 0;
  int32_t window = 1;
  StepRowMode mode = StepRowMode::kSinksAndRecent;
  /// Tokens attended per item (resident ones included) when mode is kSinksAndRecent:
  /// budget_tokens if > 0, else ceil(budget_fraction * n); clamped to [1, budget_cap].
  int64_t budget_tokens = 0;
  double budget_fraction = 0.0;
  int64_t budget_cap = 0;
  /// Every attended row is resident (lets the CUDA kernel stream rows through shared memory).
  bool all_resident = false;
  /// The host writes the new token's host-store rows itself (a CPU-placed policy reads them while
  /// the step's kernels run); the append writes only the resident row.
  bool host_writes_store = false;

  const int32_t* slots = nullptr;      ///< [batch] sequence slots (device)
  const int64_t* positions = nullptr;  ///< [batch * num_layers]: new token's position (device)

  const void* q = nullptr;  ///< [batch, num_q_heads, head_dim], q_dtype
  const void* k = nullptr;  ///< [batch, num_kv_heads, head_dim], k_dtype
  const void* v = nullptr;  ///< [batch, num_kv_heads, head_dim], v_dtype
  void* out = nullptr;      ///< [batch, num_q_heads, head_dim], out_dtype
  DType q_dtype = DType::kF32;
  DType k_dtype = DType::kF32;
  DType v_dtype = DType::kF32;
  DType out_dtype = DType::kF32;

  /// Resident tier: item (slot, layer, h) owns rows_per_slot = sink + window K rows followed by as
  /// many V rows at resident + ((slot * num_layers + layer) * num_kv_heads + h) * 2 *
  /// rows_per_slot * row_bytes. Rows as ResidentRowOf places them.
  char* resident = nullptr;
  /// The whole host store: item (slot, layer, h)'s table is t = (slot * num_layers + layer) *
  /// num_kv_heads + h.
  StoreTable store;

  /// kList: [batch * num_kv_heads, list_cap] positions and [batch * num_kv_heads] counts (device
  /// memory), written by the selection (DeviceSelector::Select), read by DecodeStep.
  int32_t* list = nullptr;
  int32_t* list_count = nullptr;
  int64_t list_cap = 0;

  /// The selection: what its top-k ranks, the item budget (budget_tokens / budget_fraction / budget_cap as
  /// above: an item selects min(StepBudget(n), n) positions; list_cap >= budget_cap), and its
  /// device scratch: select_ws holds [batch * num_kv_heads, group, select_ld] floats
  /// (select_ld >= every n), topk_ws [batch * num_kv_heads, pow2 >= budget_cap] 8-byte keys when
  /// budget_cap > 4096 (else unused). Nothing the host computes per step is read: capture-safe.
  SelectRanks ranks = SelectRanks::kNone;
  /// After the scoring: positions [sink, floor(hide_fraction * n)) are dropped from each item's
  /// list and the list refilled (PrHS's depth window; base/psaw.h's PsawFilterList); 0: none.
  double hide_fraction = 0.0;
  /// The selection keeps the scoring's device metadata current (SparCas's dimensions and compact
  /// rows, Quest's page bounds) but ranks nothing and leaves list and list_count as they are, for a
  /// caller that overwrites them (xl+'s copy of the previous layer's list). Only for a selector whose
  /// ranking advances no state (DeviceSelector::ranking_skippable; HiP's mask and KVpop's slots
  /// are state their selection advances). The CUDA kernels honour it; the host twins still rank, and their
  /// list is overwritten the same way, so the two backends' lists and outputs stay equal.
  bool select_skip_ranking = false;
  /// Quest: the page bounds (see PageBoundsArgs) and tokens per page.
  /// kSparcas: item (slot, layer, h)'s compact keys (KV dtype) at element SparcasCompactOffset of
  /// meta, meta_pages positions of SparcasDimsOf elements each (row j holds key j's chosen
  /// dimensions, ascending); its chosen dimensions at sparcas.dims + t * head_dim.
  char* meta = nullptr;
  int64_t meta_pages = 0;
  int32_t meta_page = 16;
  SelectorArgs selector;  ///< the selector's own arguments (SelectorArgsOf)
  float* select_ws = nullptr;
  int64_t select_ld = 0;
  unsigned long long* topk_ws = nullptr;
  /// CUDA: the multi-CTA top-k's scratch, SelectMctaWorkspaceBytes(batch * num_kv_heads, group,
  /// select_ld) bytes (device memory; null when that is 0: every item then takes the one-CTA
  /// top-k). Unused on the host.
  uint32_t* select_mcta_ws = nullptr;

  float* q_f32 = nullptr;  ///< host scratch [batch, num_q_heads, head_dim]
  float* lse = nullptr;    ///< [batch, num_q_heads] natural-log lse of the result (may be null)
  const float* o_cpu = nullptr;    ///< optional CPU part [batch, num_q_heads, head_dim]
  const float* lse_cpu = nullptr;  ///< its lse [batch, num_q_heads]; -inf where empty

  /// CUDA: scratch for the split partial results, ws_floats floats (device memory owned by the
  /// caller, so nothing is allocated while a graph is captured). Unused on the host.
  float* ws = nullptr;
  int64_t ws_floats = 0;
  /// CUDA: zeroed counters, batch * num_kv_heads * group of them (device memory); the kernels
  /// leave them zeroed.
  int32_t* counters = nullptr;
  /// CUDA, kList mode: the device token bank (rows == null: none).
  StepBankView bank;
  /// CUDA: the most rows an item attends in this call (sizes the split count; the kernels read
  /// the true counts on the device). 0: unknown.
  int64_t max_rows_hint = 0;
  /// CUDA: the longest item's length (positions[...] + 1) in this call when the caller knows it,
  /// else 0. Outside CUDA-graph capture, a selection none of whose items can reach the multi-CTA
  /// threshold skips those launches; a captured one launches them (they return at once for short
  /// items), so that the graph serves any later length.
  int64_t max_len_hint = 0;
};

#if defined(__CUDACC__)
#define KVF_HOST_DEVICE __host__ __device__
#else
#define KVF_HOST_DEVICE
#endif

/// The selector's own arguments of step \p a as \p T (see SelectorArgs); T may be a prefix of what
/// the selector stored (HiP's arguments begin with SparCas's).
template <typename T>
KVF_HOST_DEVICE inline T SelectorArgsOf(const DecodeStepArgs& a) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= kSelectorArgsBytes);
  T t;
  memcpy(&t, a.selector.bytes, sizeof(T));
  return t;
}
/// Stores \p t as step \p a's selector arguments.
template <typename T>
inline void SetSelectorArgs(DecodeStepArgs& a, const T& t) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= kSelectorArgsBytes);
  a.selector = SelectorArgs{};
  std::memcpy(a.selector.bytes, &t, sizeof(T));
}

/// Rows attended by an item with n positions under kSinksAndRecent: positions [0, sinks) and
/// [recent_begin, n). Shared by the host reference, the runtime's stats and the CUDA kernels.
struct StepRange {
  int64_t sinks = 0;
  int64_t recent_begin = 0;
  int64_t count = 0;
};

/// Tokens an item with \p n positions attends (see DecodeStepArgs::budget_tokens).
KVF_HOST_DEVICE inline int64_t StepBudget(int64_t budget_tokens, double budget_fraction,
                                          int64_t budget_cap, int64_t n) {
  int64_t b = budget_tokens;
  if (b <= 0) {
    const double x = budget_fraction * static_cast<double>(n);
    b = static_cast<int64_t>(x);
    if (static_cast<double>(b) < x) ++b;  // ceil
  }
  const int64_t hi = budget_cap > 1 ? budget_cap : 1;
  return b < 1 ? 1 : (b > hi ? hi : b);
}

/// StreamingLLM's rows: the first min(sink, budget, n) positions and the most recent ones.
KVF_HOST_DEVICE inline StepRange SinksAndRecent(int64_t n, int64_t sink, int64_t budget) {
  StepRange r;
  r.sinks = sink < budget ? sink : budget;
  if (n < r.sinks) r.sinks = n;
  const int64_t rest = n - (budget - r.sinks);
  r.recent_begin = rest > r.sinks ? rest : r.sinks;
  r.count = r.sinks + (n - r.recent_begin);
  return r;
}

/// Resident row of position \p pos when n positions are stored: row pos for a sink, row
/// sink + (pos - sink) % window in the window ring, -1 when the row is only in the host store.
/// Counting the ring from the first non-sink position makes the resident rows of a sequence
/// that fits (n <= sink + window) exactly rows [0, n), in position order.
KVF_HOST_DEVICE inline int64_t ResidentRowOf(int64_t pos, int64_t n, int32_t sink,
                                             int32_t window) {
  if (pos < sink) return pos;
  if (pos >= n - window) {
    return sink + static_cast<int64_t>(static_cast<uint32_t>(pos - sink) %
                                       static_cast<uint32_t>(window));
  }
  return -1;
}

/// The scheduler's split of a planned step's device selection between the two routes (issue 14;
/// Device::SplitStepList). Of item t's list (DecodeStepArgs::list + t * list_cap, list_count[t]
/// positions) the misses are the positions with no resident row (ResidentRowOf < 0; the step has
/// no token bank). The last SplitCpuRows(misses, cpu_q10) misses in list order go to the CPU:
/// cpu_list + t * list_cap, cpu_count[t] (host memory the device writes, mapped). Every other
/// entry, in list order, goes to the device: gpu_list + t * list_cap, gpu_count[t], which the
/// step then attends in kList mode. The two lists' union is the selection, each entry once.
struct SplitListArgs {
  int32_t cpu_q10 = 0;  ///< 1024ths of an item's misses the CPU attends, in [0, 1024]
  int32_t* gpu_list = nullptr;
  int32_t* gpu_count = nullptr;
  int32_t* cpu_list = nullptr;
  int32_t* cpu_count = nullptr;
};

/// Misses of \p misses an item's CPU share takes at cpu_q10 / 1024 (floor; integer, so that the
/// host and the device agree).
KVF_HOST_DEVICE inline int64_t SplitCpuRows(int64_t misses, int32_t cpu_q10) {
  return (misses * static_cast<int64_t>(cpu_q10)) >> 10;
}

/// SparCas: dimensions kept by layer \p layer, and the element offset of item (slot, layer, h)'s
/// compact keys in DecodeStepArgs::meta: per slot, the dense layers' rows (head_dim elements)
/// then the others' (SparcasRowElems elements), meta_pages positions per item. Elements are the KV
/// dtype's (2 bytes).
KVF_HOST_DEVICE inline int32_t SparcasDimsOf(int32_t layer, int32_t dense_layers, int32_t d_b,
                                             int32_t head_dim) {
  const int32_t k = d_b < 1 ? 1 : (d_b > head_dim ? head_dim : d_b);
  return layer < dense_layers ? head_dim : k;
}
/// Bits a dimension of layer \p layer's compact rows: the dense layers keep the KV dtype (16),
/// the others \p bits.
KVF_HOST_DEVICE inline int32_t SparcasBitsOf(int32_t layer, int32_t dense_layers, int32_t bits) {
  return layer < dense_layers ? 16 : bits;
}
/// SparCas 4-bit rows: d_b / 8 32-bit words (dimension i in bits [4 (i % 8), 4 (i % 8) + 4) of
/// word i / 8 as n + 8, n in [-7, 7]: offset binary, so the GPU turns a nibble into a float with
/// an OR and a subtraction instead of an integer conversion) then the row's scale as an f32.
constexpr int32_t kSparcasQ4Levels = 7;
KVF_HOST_DEVICE inline int32_t SparcasQ4Words(int32_t d_b) { return d_b / 8; }
/// A sparse layer's compact row in 2-byte elements: d_b at 16 bits, (d_b / 8 + 1) words at 4.
KVF_HOST_DEVICE inline int32_t SparcasRowElems(int32_t d_b, int32_t bits) {
  return bits == 4 ? 2 * (SparcasQ4Words(d_b) + 1) : d_b;
}
/// Symmetric quantization to integers in [-levels, levels] given the max |x| of the values
/// (SparCas's 4-bit rows: 7; its int8 query: 127): inv = levels / amax and step = amax / levels,
/// both 0 when amax is 0 or not finite; a value's code rint(clamp(x * inv, -levels, levels)).
KVF_HOST_DEVICE inline float SymQuantInv(float amax, int32_t levels) {
  return amax > 0.0f && amax <= 3.0e38f ? static_cast<float>(levels) / amax : 0.0f;
}
KVF_HOST_DEVICE inline float SymQuantStep(float amax, int32_t levels) {
  return amax > 0.0f && amax <= 3.0e38f ? amax / static_cast<float>(levels) : 0.0f;
}
KVF_HOST_DEVICE inline int32_t SymQuantCode(float x, float inv, int32_t levels) {
  const float lv = static_cast<float>(levels);
  return static_cast<int32_t>(rintf(fminf(fmaxf(x * inv, -lv), lv)));
}
/// The 4-bit code of x given the row's max |x| (fmaxf over the row, which skips NaN): inv =
/// 7 / amax (0 when amax is 0 or not finite: every n 0), n = rint(clamp(x * inv, -7, 7))
/// (NaN: -7), as the nibble n + 8. The row's scale is amax / 7 (0 likewise). Host and device
/// quantize with these.
KVF_HOST_DEVICE inline float SparcasQ4Inv(float amax) { return SymQuantInv(amax, kSparcasQ4Levels); }
KVF_HOST_DEVICE inline float SparcasQ4Scale(float amax) { return SymQuantStep(amax, kSparcasQ4Levels); }
KVF_HOST_DEVICE inline uint32_t SparcasQ4Code(float x, float inv) {
  if (inv == 0.0f) return 8u;  // a zero or non-finite row: every n 0
  return static_cast<uint32_t>(SymQuantCode(x, inv, kSparcasQ4Levels) + 8);
}
/// Dimension e (0..7) of a word as stored: the nibble n + 8 (what the integer dot sums).
KVF_HOST_DEVICE inline int32_t SparcasQ4Nibble(uint32_t word, int e) {
  return static_cast<int32_t>((word >> (4 * e)) & 0xFu);
}
/// Dimension e (0..7) of a word: n.
KVF_HOST_DEVICE inline int32_t SparcasQ4Value(uint32_t word, int e) { return SparcasQ4Nibble(word, e) - 8; }
/// The query side of the 4-bit scores: one head's chosen dimensions of q as int8 codes c_i =
/// rint(clamp(x_i * inv, -127, 127)), inv = 127 / amax over the head's d_b values (NaN: -127),
/// with step amax / 127 (inv and step 0 when amax is 0 or not finite: the head scores 0). A row's
/// partial logit is then (float(sum_i c_i n_i) * step) * row scale: the sum is an exact integer
/// (__dp4a on the GPU, on the offset nibbles n_i + 8 less 8 sum_i c_i), so host and device agree
/// to the bit. Quantized from q as given, before the softmax scale.
constexpr int32_t kSparcasQ8Levels = 127;
KVF_HOST_DEVICE inline float SparcasQ8Inv(float amax) { return SymQuantInv(amax, kSparcasQ8Levels); }
KVF_HOST_DEVICE inline float SparcasQ8Step(float amax) { return SymQuantStep(amax, kSparcasQ8Levels); }
KVF_HOST_DEVICE inline int32_t SparcasQ8Code(float x, float inv) {
  return inv == 0.0f ? 0 : SymQuantCode(x, inv, kSparcasQ8Levels);
}
KVF_HOST_DEVICE inline int64_t SparcasCompactOffset(int64_t slot, int32_t layer, int32_t h,
                                                    int32_t num_layers, int32_t num_kv_heads,
                                                    int64_t positions, int32_t head_dim,
                                                    int32_t d_b, int32_t dense_layers,
                                                    int32_t bits) {
  const int32_t dl = dense_layers < 0 ? 0 : (dense_layers > num_layers ? num_layers : dense_layers);
  // the sparse layers' row elements
  const int32_t k = SparcasRowElems(SparcasDimsOf(num_layers, dl, d_b, head_dim), bits);
  const int64_t item = positions;
  const int64_t per_slot = (static_cast<int64_t>(dl) * head_dim + static_cast<int64_t>(num_layers - dl) * k) *
                           num_kv_heads * item;
  int64_t off = slot * per_slot;
  if (layer < dl) return off + (static_cast<int64_t>(layer) * num_kv_heads + h) * item * head_dim;
  off += static_cast<int64_t>(dl) * num_kv_heads * item * head_dim;
  return off + (static_cast<int64_t>(layer - dl) * num_kv_heads + h) * item * k;
}

/// The multi-CTA top-k of a device selection (gpu/decode_select.cu): an item whose top-k runs over
/// at least kSelectMctaMinKeys scores splits them over up to kSelectMctaMaxCtas CTAs (a radix
/// select with global histograms) instead of one CTA. The threshold is an estimate from the
/// one-CTA kernels' H100 times (755 us at 128K keys, 81 us at 8K pages: about 4096 scores cost what
/// the multi-CTA path's eight launches cost); bench/micro/select_topk_bench measures both paths.
constexpr int64_t kSelectMctaMinKeys = 4096;
/// Quest ranks pages, and its one-CTA kernel stays ahead longer. Measured through the Runtime
/// (quest_bank, 2%, 32 layers, batch 1, H100) once the multi-CTA passes became one fused launch
/// (stop 21): from 2048 pages, 3.30 ms per token step at 32K (2048 pages) against 3.16 with one
/// CTA, and 4.01-4.10 at 128K (8192 pages) against 4.56-4.63; from 4096 pages, 4.07 at 128K.
constexpr int64_t kSelectMctaMinPages = 4096;
/// The pages from which a Quest item takes the multi-CTA top-k (kSelectMctaMinPages). The runtime
/// sizes the scratch and LaunchSelectTopK picks the path with it.
inline int64_t SelectMctaMinPages() { return kSelectMctaMinPages; }
constexpr int32_t kSelectMctaMaxCtas = 64;
/// Fewest scores a CTA of the multi-CTA top-k handles (fewer CTAs for shorter capacities).
constexpr int64_t kSelectMctaMinChunk = 2048;
/// Most pages the multi-CTA Quest top-k keeps per item (its winners are sorted in one CTA).
constexpr int64_t kSelectMctaMaxPicks = 4096;
/// Partial softmax statistics an item's scratch holds per query head: one (max, sum) pair per
/// multi-CTA top-k CTA, or per CTA of a scoring kernel that folds them in (opt-in: SparCas's 4-bit
/// scoring: then the top-k skips its statistics pass), whichever wrote them.
constexpr int32_t kSelectMctaStatsSlots = 512;
/// The fused multi-CTA top-k's first digit: the top kSelectMctaBucketBits bits of the keys, one
/// histogram of 2^12 bins built while the weights are written. When the bucket holding the k-th
/// largest key has at most kSelectMctaCandCap keys, they are listed (key, position) and every CTA
/// finishes the select from the list; otherwise the 8-bit radix passes run on from the bucket.
constexpr int kSelectMctaBucketBits = 12;
constexpr int32_t kSelectMctaCandCap = 2048;
/// 32-bit words of one item's multi-CTA scratch: 4 radix histograms of 256 bins, per CTA the
/// (greater, equal) counts, per query head kSelectMctaStatsSlots (max, sum) pairs, the Quest
/// picks, the 12-bit histogram, the candidate count (and a word of padding), the candidates (two
/// words each), and the fused kernel's barrier counter (and a word of padding: items stay 8-byte
/// aligned).
KVF_HOST_DEVICE inline int64_t SelectMctaItemWords(int32_t group) {
  return 4 * 256 + 2 * int64_t{kSelectMctaMaxCtas} + 2 * int64_t{group} * kSelectMctaStatsSlots +
         kSelectMctaMaxPicks + (int64_t{1} << kSelectMctaBucketBits) + 2 + 2 * int64_t{kSelectMctaCandCap} +
         2;
}
/// Bytes of DecodeStepArgs::select_mcta_ws for \p items items: 0 when no item can reach the
/// threshold (select_ld < kSelectMctaMinKeys).
inline size_t SelectMctaWorkspaceBytes(int64_t items, int32_t group, int64_t select_ld,
                                       int64_t min_keys = kSelectMctaMinKeys) {
  if (items <= 0 || group <= 0 || select_ld < min_keys) return 0;
  return static_cast<size_t>(items) * static_cast<size_t>(SelectMctaItemWords(group)) * 4;
}
/// CTAs per item of the multi-CTA top-k for \p items items of up to \p select_ld scores on a GPU
/// of \p num_sms SMs: about \p per_sm 512-thread CTAs per SM in all, at least kSelectMctaMinChunk
/// scores each, in [1, kSelectMctaMaxCtas]. Two per SM: the passes use up to 64 registers a thread,
/// so more than two 512-thread CTAs an SM run in two waves; measured through the Runtime (stop 20,
/// sparcas_bank at 128K, 32 layers): 4 per SM 6.15 ms per token step, 3 5.95, 2 5.24.
inline int32_t SelectMctaCtas(int64_t items, int64_t select_ld, int32_t num_sms, int32_t per_sm = 2) {
  if (items <= 0) return 1;
  // Rounded down: the CTAs of all items fit one wave.
  const int64_t fill = int64_t{num_sms > 0 ? num_sms : 1} * (per_sm > 0 ? per_sm : 1) / items;
  const int64_t by_len = (select_ld + kSelectMctaMinChunk - 1) / kSelectMctaMinChunk;
  int64_t c = fill < by_len ? fill : by_len;
  if (c > kSelectMctaMaxCtas) c = kSelectMctaMaxCtas;
  return static_cast<int32_t>(c < 1 ? 1 : c);
}

/// One prefill chunk of one (sequence, layer): what LaunchPrefillStage reads and writes.
struct PrefillStageArgs {
  const void* k = nullptr;  ///< [tokens, num_kv_heads, head_dim], k_dtype (device-readable)
  const void* v = nullptr;
  DType k_dtype = DType::kF32;
  DType v_dtype = DType::kF32;
  int64_t pos0 = 0;     ///< position of the chunk's first token
  int64_t tokens = 0;
  int64_t new_len = 0;  ///< pos0 + tokens
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  DType kv_dtype = DType::kBF16;
  StoreTable store;  ///< the (slot, layer)'s: head h's table is t = h
  /// Resident tier of the (slot, layer): head h's K rows at resident + h * 2 * (sink + window)
  /// rows, its V rows after them, placed by ResidentRowOf.
  char* resident = nullptr;
  int32_t sink = 0;
  int32_t window = 1;
  /// Device staging in the host store's page layout, or null: head h's page p (K rows of
  /// positions [p * page_tokens, (p + 1) * page_tokens), then their V rows) at staging +
  /// (h * staging_cap / page_tokens + p) * 2 * page_tokens rows, in the KV dtype; so whole
  /// host-store pages can be copied into it as they are. staging_cap: a multiple of page_tokens.
  char* staging = nullptr;
  int64_t staging_cap = 0;
  /// Earlier positions [history_begin, pos0) are read into the staging from the host store
  /// (zero-copy); [0, history_begin) are the caller's (PrefillChunkArgs copies them by page).
  int64_t history_begin = 0;
  /// [0, pos0) are in the staging already (the previous chunk of the same sequence and layer left
  /// them there): PrefillChunk copies no history.
  bool history_staged = false;
  /// The chunk's rows go to the host store from this kernel (zero-copy); false: only to the
  /// resident tier and the staging, and the caller copies them to the host store
  /// (PrefillChunkArgs::write_stream).
  bool write_through = true;
};

/// Most history segments one PrefillChunk call copies and attends one after another.
constexpr int kPrefillMaxSegments = 16;
/// Bytes a PrefillAttnItem (gpu/cuda_kernels.h) may take in PrefillChunkArgs::items.
constexpr size_t kPrefillItemBytes = 128;
/// Host scratch PrefillChunkArgs::copy_scratch needs: three pointer-sized words per page copy.
inline size_t PrefillCopyScratchBytes(int64_t num_kv_heads, int64_t max_pages) {
  return static_cast<size_t>(num_kv_heads * max_pages) * 3 * sizeof(void*);
}

/// One prefill chunk on the device's tensor-core path (Device::PrefillChunk): staging as above,
/// then causal attention of the chunk's queries over rows [0, new_len) of the staging.
struct PrefillChunkArgs {
  PrefillStageArgs stage;
  AttnParams params;
  int32_t num_q_heads = 0;
  const void* q = nullptr;  ///< [tokens, num_q_heads, head_dim], q_dtype (device-readable)
  DType q_dtype = DType::kF32;
  void* out = nullptr;      ///< [tokens, num_q_heads, head_dim], out_dtype
  DType out_dtype = DType::kF32;
  /// Scratch for q in the KV dtype when q_dtype differs: tokens * num_q_heads * head_dim elements.
  void* q_scratch = nullptr;
  /// Device-readable memory (pinned host or device) for attention descriptors, items_bytes of
  /// it: num_kv_heads * kPrefillItemBytes for one launch, (1 + kPrefillMaxSegments) times that
  /// for the overlapped history (below). The device fills it; the host must not rewrite it before
  /// the call's work ran.
  void* items = nullptr;
  size_t items_bytes = 0;

  /// Overlapped history (all set, or copy_stream null for the one-pass staging). Whole pages of
  /// [0, pos0) are copied from the host store into the staging by the copy engines on
  /// copy_stream, in segments of pages, while the tensor-core kernel attends the chunk's own
  /// causal block and then each segment after its copy landed (segment_done[j] recorded on
  /// copy_stream, waited for on the caller's stream); the partial results merge exactly in the
  /// kernel through o_acc / lse_acc. copy_stream starts after the caller's earlier work (an
  /// event, fork_done) and ends before the call's last launch, so everything stays ordered on
  /// the caller's stream. Nothing is allocated and the host never waits.
  StreamHandle copy_stream = nullptr;
  void* fork_done = nullptr;            ///< event (EventHandle)
  void* const* segment_done = nullptr;  ///< kPrefillMaxSegments events
  /// Host page table of the (slot, layer): head h's page p at host_pages[h * max_pages + p].
  void* const* host_pages = nullptr;
  /// Host memory for the copy lists, PrefillCopyScratchBytes(num_kv_heads, max_pages) bytes.
  void* copy_scratch = nullptr;
  /// f32 device scratch: tokens * num_q_heads * head_dim elements, and tokens * num_q_heads.
  float* o_acc = nullptr;
  float* lse_acc = nullptr;

  /// Write-through on the copy engines (all set, or write_stream null for the stage kernel's
  /// zero-copy stores): after the stage kernel put the chunk's rows in the staging (write_ready,
  /// recorded on the caller's stream), write_stream copies them page by page to the host store
  /// while the chunk is attended, and the caller's stream waits for write_done after the call's
  /// last launch. write_scratch: host memory for the copy lists, 2 * PrefillCopyScratchBytes
  /// bytes.
  StreamHandle write_stream = nullptr;
  void* write_ready = nullptr;  ///< event
  void* write_done = nullptr;   ///< event
  void* write_scratch = nullptr;
};

/// One (sequence, KV head) item of LFPS's approximate scan on a device (ShadowScanArgs).
struct ShadowScanItem {
  int64_t shadow = 0;    ///< offset of the item's int8 shadow [head_dim][cap] in ShadowScanArgs::shadow
  int64_t scale = 0;     ///< offset of its head_dim channel scales in ShadowScanArgs::scale
  int64_t off_lo = 0;    ///< the ranked positions are [off_lo, off_lo + len)
  int64_t len = 0;       ///< 0: the item only writes its new row
  int64_t new_pos = -1;  ///< shadow row written from the item's k (the new token); -1: none
  int64_t picks = 0;     ///< the threshold's rank (step 4), <= len and < max_picks
};

/// LFPS's scan (policies/lfps/lfps.cpp, step 3a) for a batch of items, on the device that holds a copy
/// of the policy's int8 channel-major shadow of K. Per item, in this order:
///  1. row new_pos of the shadow = quantised k: x = (float) (k rounded to kv_dtype), c-th byte
///     nearbyint(clamp(x * (127 / scale[c]), -127, 127)) (NaN -> 0), as the host quantises;
///  2. the `channels` channels with the largest sum_g |q_g,c| * scale[c] (ties: lower c), weights
///     w[g][c] = lrint(q_g,c * scale[c] * 16384 / wmax), wmax = max |q_g,c * scale[c]| over them;
///  3. logits acc_g(j) = sum_c w[g][c] * shadow[c][off_lo + j] (exact int32), score_j = (float)
///     max_g (acc_g(j) - max_j acc_g(j)), key_j = its order-preserving uint32 (cpu::ScanKey);
///  4. T = the picks-th largest key with its low 16 bits cleared (the 16-bit bin that holds it);
///     counts[item] = #{j : key_j >= T} (>= picks), and out[item * max_picks + i] for i below it
///     the (key_j << 32 | j) of those j in ascending j; counts[item] = -1 when they are more than
///     max_picks (nothing written). Every key >= T is there, so the list is a prefix of the order
///     by (key desc, j asc) (what a Select needs to take its best picks from it exactly).
/// The host reference is cpu::ShadowScanRef; CUDA runs gpu/shadow_scan.cu (a histogram of the keys'
/// top 16 bits finds T without sorting). group <= kShadowScanMaxGroup, head_dim <= 256.
struct ShadowScanArgs {
  int64_t items = 0;
  /// [items], device-readable. With item_host set, the first pass copies item_host there first
  /// (the table then needs no copy of its own before the launch).
  ShadowScanItem* item = nullptr;
  const ShadowScanItem* item_host = nullptr;  ///< [items] in mapped host memory (AllocHost), or null
  int32_t group = 1, head_dim = 128, channels = 16;
  int64_t cap = 0;  ///< rows of each shadow channel
  int8_t* shadow = nullptr;
  const float* scale = nullptr;
  const void* q = nullptr;  ///< [items, group, head_dim]
  DType q_dtype = DType::kF32;
  const void* k = nullptr;  ///< [items, head_dim], the new token's keys
  DType k_dtype = DType::kF32;
  DType kv_dtype = DType::kBF16;  ///< the store's dtype (k is rounded to it first)
  int64_t max_len = 0;    ///< >= every item's len: row stride of scores
  int64_t max_picks = 0;  ///< > every item's picks: row stride of out, the most it takes
  uint32_t* keys = nullptr;  ///< workspace [items, max_len]
  int32_t* ints = nullptr;   ///< workspace ShadowScanInts(items, group, channels)
  /// Workspace of ShadowScanHistWords(items) words, all zero before the first launch (each launch
  /// leaves it zero again).
  uint32_t* hist = nullptr;
  int32_t* block_counts = nullptr;  ///< workspace [items, ceil(max_len / kShadowScanBlockKeys)]
  /// [items, max_picks] and [items]: device memory, or mapped host memory (AllocHost), which the
  /// passes write straight into (coalesced), so that the host reads the ranking with no copy.
  uint64_t* out = nullptr;
  int32_t* counts = nullptr;
};

constexpr int kShadowScanMaxGroup = 8;
/// int32 of ShadowScanArgs::ints: per item the group's maxima, the channels, the weights.
constexpr int64_t ShadowScanInts(int64_t items, int group, int channels) {
  return items * (group + channels + int64_t{group} * channels);
}
/// Keys a CUDA block of the scan's passes covers (ShadowScanArgs::block_counts).
constexpr int64_t kShadowScanBlockKeys = 1024;
/// uint32 of ShadowScanArgs::hist: per item 65536 bins of the keys' top 16 bits, then 256 of the top 8.
constexpr int64_t kShadowScanHistStride = 65536 + 256;
constexpr int64_t ShadowScanHistWords(int64_t items) { return items * kShadowScanHistStride; }

}  // namespace kvferry
