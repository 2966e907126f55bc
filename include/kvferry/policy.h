// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file policy.h
/// \brief The selection-policy interface and its registry: how to add a policy to kvferry
/// without changing the library (docs/policies.md, "Writing a policy"; examples/custom_policy).
///
/// A policy decides, each decode step and for each (sequence, layer, KV head), which positions
/// the GQA group attends. The runtime resolves those positions against the tiers (sink, window,
/// bank, host) and attends them, on whichever backend it runs. A policy written against this
/// header selects on the host (Select); the library's own policies may also select on the device
/// through hooks whose types are internal (below, "library-internal hooks").

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/config.h"
#include "kvferry/kv_pages.h"
#include "kvferry/status.h"

namespace kvferry {

/// Where a policy's selection runs. In the host backend everything runs on the host. On CUDA, a
/// kGpu policy's selected rows are attended on the device (a policy without a device scoring,
/// every policy written against this header, still runs Select on the host); a kCpu policy
/// prefers attending its offloaded rows on the CPU under Route::kAuto.
enum class Placement : uint8_t { kGpu = 0, kCpu = 1 };

/// Counters a policy may keep (the PrHS wrappers: inner Select runs vs reused sets); the runtime
/// reports them in Stats.
struct PolicyCounters {
  int64_t select_calls = 0;   ///< Select calls that ran a (costly) base selection
  int64_t select_reused = 0;  ///< Select calls answered from a kept set
  int64_t scans_device = 0;        ///< scans answered from the device's ranking (SelectContext::scan)
  int64_t scans_device_short = 0;  ///< ... where it held too few picks outside the candidates
};

// Types of the library-internal hooks, defined in the library (policies/policy.h,
// base/attn_types.h). A policy written against this header never needs them.
namespace detail {
class DeviceSelector;
struct SelectorShape;
}  // namespace detail
struct DeviceScanPicks;
struct ScanShadowView;
struct PrimedStats;

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
  /// Library-internal: the scan's ranking from the device for this step, or null (the policy
  /// scans on the host). Always null for a policy that declares no device scan.
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

/// Row \p pos of K (or of V when \p value) of \p kv as fp32 into dst[0, params.head_dim): the
/// stored rows are bf16 or f16 (params.kv_dtype).
void LoadKvRowF32(const KvPages& kv, const AttnParams& params, int64_t pos, bool value,
                  float* dst);

class Policy {
 public:
  virtual ~Policy() = default;

  // ---- What a host policy implements ---------------------------------------------------------

  [[nodiscard]] virtual std::string_view name() const = 0;
  /// Where Select runs (GPU-side selection runs on the host in the host backend).
  [[nodiscard]] virtual Placement placement() const = 0;
  /// Picks the positions to attend: ascending, unique, each in [0, ctx.n), position ctx.n - 1
  /// (the new token) included. At most ctx.budget positions, or the budget plus the resident
  /// sinks and window for a policy that always returns them (the runtime's lists hold that
  /// many). \p out is cleared by the caller and has capacity reserved; Select should not
  /// allocate in steady state. Calls for different (slot, layer, kv_head) may run concurrently.
  ///
  /// Exception: the built-in "oracle" (and a PrHS wrapper around it): an exact top-k,
  /// it returns the min(ctx.budget, ctx.n) positions of [0, ctx.n) with the largest summed
  /// softmax weight of the group, none reserved, so the new token and the resident sinks and
  /// window compete like any other position and any of them may be left out (its device
  /// selection alike). The runtime does not rely on n - 1 or on the resident positions being
  /// listed: it attends exactly the listed positions (and every resident row, listed or not, in
  /// the planned CPU step of a policy that declares selection_covers_resident()). It relies on
  /// the list being ascending, unique and in [0, ctx.n), and within its capacity: a longer list
  /// fails the Decode with kInternal (every host Select), and so does one out of order or out of
  /// range where the host's lists go to the device's step; elsewhere such a position would be
  /// read from a wrong row, unchecked.
  virtual Status Select(const SelectContext& ctx, std::vector<int32_t>& out) = 0;

  // ---- Optional: properties and hooks with defaults ------------------------------------------

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
  /// True if OnPrefill reads the prompt's queries; only then does the runtime bring them to the
  /// host (a copy and a stream synchronisation per prefill chunk).
  [[nodiscard]] virtual bool wants_prefill_queries() const { return false; }
  /// Called once per (sequence, layer, KV head) prefill chunk, after its rows are stored
  /// (ctx.q is null unless wants_prefill_queries()).
  virtual Status OnPrefill(const PrefillContext& ctx) {
    (void)ctx;
    return Status::Ok();
  }
  /// The sequence in \p slot is gone: drop its state.
  virtual void OnSequenceRemoved(int slot) { (void)slot; }
  /// A Decode of \p layer that included \p slot failed and was rolled back (its token taken
  /// back), possibly after Select ran for it, possibly before: leave the state a runtime that never
  /// made the call would have, so that the retried call selects as it would have. Forget what
  /// that Select kept for a later call and bring back what it replaced (xl+: the layer's set goes,
  /// the previous layer's set it overwrote comes back for the retried call to reuse).
  virtual void OnDecodeRolledBack(int slot, int layer) {
    (void)slot;
    (void)layer;
  }
  /// Cumulative counters (thread-safe to read between steps).
  [[nodiscard]] virtual PolicyCounters counters() const { return {}; }

  // ---- Library-internal hooks ------------------------------------------------------------------
  // Device-side selection, device scans and device-computed prompt statistics of the library's
  // own policies. Their types are defined in the library's internal headers (policies/policy.h);
  // the defaults (no device work) are what a policy written against this header gets.

  /// The selector that computes this policy's selection on the device inside a planned step
  /// (policies/<name>/device_selector.cpp, docs/design.md "Device selection"); the default, null:
  /// Select runs on the host. A policy that has one must select exactly what Select would (up to
  /// fp32 rounding of near-ties on CUDA). The policy outlives it.
  [[nodiscard]] virtual std::unique_ptr<detail::DeviceSelector> MakeDeviceSelector(
      const detail::SelectorShape& shape) const;
  /// With a device scoring: the fraction f of positions hidden at \p layer (PrHS's depth window,
  /// psaw+): the device drops [sink, floor(f n)) from its selection and refills it as
  /// base/psaw.h's PsawFilterList does. 0: nothing hidden.
  [[nodiscard]] virtual double device_hide_fraction(int layer) const;
  /// With a device scoring: true if \p layer takes the previous layer's device list of the same
  /// step (cross-layer sharing, xl+) instead of its own selection, when the same sequences
  /// selected there at the same length.
  [[nodiscard]] virtual bool device_reuses_previous_layer(int layer) const;
  /// Channels of an approximate scan over an int8 shadow of K that a device may run for this
  /// policy's Select (SelectContext::scan); 0: none.
  [[nodiscard]] virtual int device_scan_channels() const;
  /// How many of the scan's best positions the device should return when a Select may pick k
  /// offloaded positions (the policy falls back to its own scan when they are too few).
  [[nodiscard]] virtual int64_t device_scan_picks(int64_t k) const;
  /// The shadow of (slot, layer, kv_head) as it is now; false if there is none.
  virtual bool ScanShadow(int slot, int layer, int kv_head, ScanShadowView* out) const;
  /// Rows of a chunk's last queries whose causal attention the policy learns from at prefill,
  /// when it can take them as device-computed statistics (OnPrefillPrimed); 0: it cannot. The
  /// runtime then computes them on the device beside the prefill pass (CUDA) and calls
  /// OnPrefillPrimed with min(prime_rows(), chunk) rows instead of OnPrefill.
  [[nodiscard]] virtual int prime_rows() const;
  /// OnPrefill from the statistics of the chunk's last primed.rows queries; ctx.q is null (the
  /// queries stay on the device). Must leave the state OnPrefill would, up to fp32 summation order.
  virtual Status OnPrefillPrimed(const PrefillContext& ctx, const PrimedStats& primed);
};

/// Builds a policy from a configuration (its name is config.policy.name, its parameters
/// config.policy.params: a name it does not know should be kInvalidArgument naming it).
using PolicyFactory = std::function<Result<std::unique_ptr<Policy>>(const RuntimeConfig& config)>;

/// Adds \p name to the registry, so that Runtime::Create (and Python's kvferry.Runtime, in the
/// process whose kvferry library registered it) accepts PolicyConfig::name == \p name and
/// PolicyNames() lists it. False if the name is taken (a built-in or an earlier registration),
/// empty, starts with a wrapper's prefix ("cis+", "psaw+", "xl+"), or the factory is empty.
/// Thread-safe; takes effect for Runtimes created afterwards. May be called during static
/// initialisation.
bool RegisterPolicy(std::string name, PolicyFactory factory);

/// Names of the selection policies Runtime::Create accepts in PolicyConfig::name: the built-in
/// ones, those registered, and examples of the composed wrappers ("cis+oracle").
std::vector<std::string> PolicyNames();

}  // namespace kvferry
