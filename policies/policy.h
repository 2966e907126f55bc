// Copyright kvferry authors. Apache-2.0.
#pragma once
// The selection-policy interface. A policy decides, each decode step and for each (sequence,
// layer, KV head), which positions the GQA group attends. The runtime resolves those positions
// against the tiers (sink, window, bank, host) and attends them.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/attn_types.h"
#include "kvferry/config.h"
#include "kvferry/status.h"

namespace kvferry {

enum class Placement : uint8_t { kGpu = 0, kCpu = 1 };

/// Counters a policy may keep (the PrHS wrappers: inner Select runs vs reused sets); the runtime
/// reports them in Stats.
struct PolicyCounters {
  int64_t select_calls = 0;   ///< Select calls that ran a (costly) base selection
  int64_t select_reused = 0;  ///< Select calls answered from a kept set
  int64_t scans_device = 0;        ///< scans answered from the device's ranking (SelectContext::scan)
  int64_t scans_device_short = 0;  ///< ... where it held too few picks outside the candidates
};

/// An approximate scan's ranking a device computed for one Select (LFPS's scan, Device::LfpsScan):
/// `count` positions of [off_lo, off_lo + len), every one whose key is at or above a threshold
/// (so a prefix of the order by (key desc, j asc)), as (key << 32 | j) with j relative to
/// off_lo, ascending j; key is the score's order-preserving uint32. Host memory.
struct DeviceScanPicks {
  const uint64_t* picks = nullptr;
  int64_t count = 0;
  int64_t off_lo = 0, len = 0;
  int channels = 0;  ///< channels the scan used
  /// Called (when set) before picks is first read: the ranking may still be on its way from the
  /// device while the policy does its other work. Thread-safe; an error fails the Select.
  Status (*wait)(void* arg) = nullptr;
  void* wait_arg = nullptr;
};

/// The int8 channel-major shadow of K a policy's scan reads, for a device copy (host memory).
struct ScanShadowView {
  const int8_t* k8 = nullptr;    ///< k8[c * cap + i]: row i of channel c, rows [0, n)
  int64_t cap = 0, n = 0;
  const float* scale = nullptr;  ///< [head_dim] per-channel scales
};

/// What a policy sees of one (sequence, layer, KV head) at a decode step. Host memory throughout.
struct SelectContext {
  int slot = 0;          ///< runtime's dense index of the sequence, in [0, max_sequences)
  int layer = 0;
  int kv_head = 0;
  int64_t n = 0;         ///< positions stored, the new token included (it is position n-1)
  int sink = 0;          ///< resident sink tokens (positions [0, sink))
  int window = 0;        ///< resident window (positions [n-window, n))
  int64_t budget = 0;    ///< tokens to attend in total, resident ones included (>= 1)
  const float* q = nullptr;  ///< [group, head_dim] fp32, the new token's queries (post-RoPE)
  AttnParams params;     ///< group, head_dim, kv dtype, scale
  KvPages kv;            ///< every stored row of this (sequence, layer, KV head), host memory
  /// Threads Select may keep busy: > 1 lets a policy split its own O(n) work into TBB tasks of
  /// the calling thread's arena (the runtime's CPU pool inside a pool task). The selection never
  /// depends on it.
  int threads = 1;
  /// The scan's ranking from the device for this step, or null (the policy scans on the host).
  const DeviceScanPicks* scan = nullptr;
};

/// The prompt chunk a policy may learn from at Prefill (e.g. LFPS primes its tables from the
/// last rows' attention). Queries are post-RoPE fp32 in host memory.
struct PrefillContext {
  int slot = 0;
  int layer = 0;
  int kv_head = 0;
  int64_t q_pos0 = 0;    ///< position of the chunk's first query
  int32_t num_q = 0;     ///< queries in the chunk
  int64_t n = 0;         ///< positions stored after this chunk
  int sink = 0;
  int window = 0;
  const float* q = nullptr;  ///< [num_q, group, head_dim]
  AttnParams params;
  KvPages kv;
};

/// The prompt statistics a device computed for one (sequence, layer, KV head) prefill chunk
/// (Device::PrimeAttention, PrimeArgs): host memory, valid during the OnPrefillPrimed call.
struct PrimedStats {
  const float* ver = nullptr;     ///< [n]: summed causal softmax weight per position
  const float* sla = nullptr;     ///< [n]: summed weight per distance
  const double* stats = nullptr;  ///< PrimeStatsCount(head_dim, group) doubles (see PrimeArgs)
  int32_t rows = 0;               ///< the chunk's last rows they cover
};

class Policy {
 public:
  virtual ~Policy() = default;
  [[nodiscard]] virtual std::string_view name() const = 0;
  /// Where Select runs (GPU-side selection runs on the host in the host backend).
  [[nodiscard]] virtual Placement placement() const = 0;
  /// True if Select may return everything (dense); lets the runtime use its paged dense path.
  [[nodiscard]] virtual bool is_dense() const { return false; }
  /// True if the selection is a function of the length alone: the sinks and the most recent
  /// positions up to the budget (StreamingLLM; dense with an unbounded budget). The device then
  /// computes it inside the step's kernels (StepRowMode::kSinksAndRecent), with no Select call,
  /// which makes the step capture-safe.
  [[nodiscard]] virtual bool selects_sinks_and_recent() const { return false; }
  /// True if every Select result contains every resident position (the first ctx.sink positions
  /// and the last ctx.window ones). A CPU-placed policy that says so runs the planned step: the
  /// device attends the resident rows while Select runs on the host, and only the selected
  /// offloaded rows are attended on the CPU (their (o, lse) merged on the device afterwards).
  [[nodiscard]] virtual bool selection_covers_resident() const { return false; }
  /// How the device computes this policy's selection inside a planned step (Device::DecodeSelect
  /// into the step's device list); kNone: Select runs on the host. A policy that declares a
  /// scoring must select exactly what Select would (up to fp32 rounding of near-ties on CUDA).
  [[nodiscard]] virtual SelectScoring device_scoring() const { return SelectScoring::kNone; }
  /// The parameters of the device's selection (see SelectScoring).
  struct DeviceSelectParams {
    int page_tokens = 16;  ///< kQuestPages: tokens per page of the bounds
    int d_b = 16;          ///< kSparcas: dimensions kept
    int u = 64;            ///< kSparcas: refresh interval in ranked steps
    int dense_layers = 2;  ///< kSparcas: first layers ranked over every dimension
    int sparcas_bits = 16; ///< kSparcas: 16 (KV dtype) or 4 (base/sparcas_q4.h) per dimension
    int hip_bk = 2;        ///< kHip (which also takes d_b, u, dense_layers and sparcas_bits)
    int hip_r_m = 8;
    int hip_rep = 0;
    int hip_align = 1;
    int hip_lag = 0;
    int hip_dense_layers = 0;  ///< kHip: DecodeStepArgs::hip_dense_layers
    int kvpop_hidden = 0;      ///< kKvpop: the scorer's hidden width (0: the zero scorer)
  };
  [[nodiscard]] virtual DeviceSelectParams device_select_params(int head_dim) const {
    (void)head_dim;
    return {};
  }
  /// With a device scoring that reads a table (kKvpop: every (layer, KV head)'s scorer in
  /// base/kvpop_score.h's layout): the table for \p model, uploaded once at Create; empty: none.
  /// A model it does not fit is kInvalidArgument.
  [[nodiscard]] virtual Result<std::vector<float>> device_select_table(const ModelShape& model) const {
    (void)model;
    return std::vector<float>{};
  }
  /// With a device scoring: the fraction f of positions hidden at \p layer (PrHS's depth window,
  /// psaw+): the device drops [sink, floor(f n)) from its selection and refills it as
  /// base/psaw.h's PsawFilterList does. 0: nothing hidden.
  [[nodiscard]] virtual double device_hide_fraction(int layer) const {
    (void)layer;
    return 0.0;
  }
  /// With a device scoring: true if \p layer takes the previous layer's device list of the same
  /// step (cross-layer sharing, xl+) instead of its own selection, when the same sequences
  /// selected there at the same length.
  [[nodiscard]] virtual bool device_reuses_previous_layer(int layer) const {
    (void)layer;
    return false;
  }

  /// Channels of an approximate scan over an int8 shadow of K that a device may run for this
  /// policy's Select (Device::LfpsScan, SelectContext::scan); 0: none.
  [[nodiscard]] virtual int device_scan_channels() const { return 0; }
  /// How many of the scan's best positions the device should return when a Select may pick k
  /// offloaded positions (the policy falls back to its own scan when they are too few).
  [[nodiscard]] virtual int64_t device_scan_picks(int64_t k) const {
    (void)k;
    return 0;
  }
  /// The shadow of (slot, layer, kv_head) as it is now; false if there is none.
  virtual bool ScanShadow(int slot, int layer, int kv_head, ScanShadowView* out) const {
    (void)slot;
    (void)layer;
    (void)kv_head;
    (void)out;
    return false;
  }

  /// True if OnPrefill reads the prompt's queries; only then does the runtime bring them to the
  /// host (a copy and a stream synchronisation per prefill chunk).
  [[nodiscard]] virtual bool wants_prefill_queries() const { return false; }
  /// Called once per (sequence, layer, KV head) prefill chunk, after its rows are stored.
  virtual Status OnPrefill(const PrefillContext& ctx) {
    (void)ctx;
    return Status::Ok();
  }
  /// Rows of a chunk's last queries whose causal attention the policy learns from at prefill,
  /// when it can take them as device-computed statistics (OnPrefillPrimed); 0: it cannot. The
  /// runtime then computes them on the device beside the prefill pass (CUDA) and calls
  /// OnPrefillPrimed with min(prime_rows(), chunk) rows instead of OnPrefill.
  [[nodiscard]] virtual int prime_rows() const { return 0; }
  /// OnPrefill from the statistics of the chunk's last primed.rows queries; ctx.q is null (the
  /// queries stay on the device). Must leave the state OnPrefill would, up to fp32 summation order.
  virtual Status OnPrefillPrimed(const PrefillContext& ctx, const PrimedStats& primed) {
    (void)ctx;
    (void)primed;
    return Unimplemented("this policy does not learn from device-computed prompt statistics");
  }
  /// Picks the positions to attend: ascending, unique, each in [0, ctx.n). \p out is cleared by the
  /// caller and has capacity reserved; Select should not allocate in steady state. Calls for
  /// different (slot, layer, kv_head) may run concurrently.
  virtual Status Select(const SelectContext& ctx, std::vector<int32_t>& out) = 0;
  /// The sequence in \p slot is gone: drop its state.
  virtual void OnSequenceRemoved(int slot) { (void)slot; }
  /// A Decode of \p layer that included \p slot failed and was rolled back (its token taken
  /// back), possibly after Select ran for it: forget anything that Select kept for a later call
  /// (xl+'s set for the next layer), as a runtime that never made the call would not have it.
  virtual void OnDecodeRolledBack(int slot, int layer) {
    (void)slot;
    (void)layer;
  }
  /// Cumulative counters (thread-safe to read between steps).
  [[nodiscard]] virtual PolicyCounters counters() const { return {}; }
};

/// Builds a policy from a configuration (its name is config.policy.name); bad parameters are
/// kInvalidArgument.
using PolicyFactory = Result<std::unique_ptr<Policy>> (*)(const RuntimeConfig& config);

/// Adds \p name to the registry (extensions, tests). False if the name is taken or empty.
/// Thread-safe; takes effect for Runtimes created afterwards.
bool RegisterPolicy(std::string name, PolicyFactory factory);

/// Builds the policy named in \p config.policy; unknown names or parameters are kInvalidArgument.
Result<std::unique_ptr<Policy>> MakePolicy(const RuntimeConfig& config);

/// Names MakePolicy accepts.
std::vector<std::string> PolicyNames();

}  // namespace kvferry
