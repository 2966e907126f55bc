// Copyright kvferry authors. Apache-2.0.
#pragma once
// LFPS ("Learn From the Past for Sparse Indexing", seed 001): per (layer, KV head) decayed vertical
// (fixed position) and slash (fixed distance) history tables predict which offloaded tokens the
// query needs; only those candidates get an exact q.k on the CPU. docs/lfps.md has the algorithm,
// every decision on the paper's open questions and the reasons.
//
// Runs on the CPU over the offloaded positions [sink, n - window); the resident sinks and window are
// always part of the returned set (attended on the GPU side and LSE-merged by the runtime).
// State is per (slot, layer, kv_head), created at the first OnPrefill or Select of that head and
// independent of every other head: Select for different heads may run concurrently.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvferry/config.h"
#include "kvferry/status.h"
#include "policies/policy.h"

namespace kvferry {

/// LFPS hyper-parameters; names are the keys of config.policy.params.
struct LfpsParams {
  int s = 32;            ///< "s": last prefill rows that prime the tables
  double r = 0.95;       ///< "r": table decay per step, in (0, 1)
  double eps = 0.85;     ///< "eps": bypass a head when its sink share rho exceeds this (>= 1: never)
  double a = 0.2;        ///< "a": threshold scale, tau = a * mean / kurtosis
  int local = 6;         ///< "local": recent tokens in the bypass test's w_loc
  bool fallback = true;  ///< "fallback" (0/1): exact top-k when the tables give no candidate
  bool score_all = false;  ///< "score_all" (0/1): candidates = every offloaded position (ablation)
};

/// Parses config.policy.params; unknown keys and out-of-range values are kInvalidArgument.
Result<LfpsParams> ParseLfpsParams(const std::map<std::string, double>& params);

/// What one Select did, for benchmarks and tests.
struct LfpsStepInfo {
  bool all = false;       ///< budget covered everything: returned [0, n), tables untouched
  bool bypassed = false;  ///< sink-dominated head: returned the resident set only
  bool fallback = false;  ///< tables gave no candidate: scored every offloaded position
  double rho = 0.0;       ///< smallest sink share over the group's heads (0 if not computed)
  int64_t offloaded = 0;  ///< |[sink, n - window)|
  int64_t c0 = 0, c1 = 0, c2 = 0;  ///< candidate set sizes; c1 = keys given an exact q.k
};

/// Totals over all Select calls (relaxed counters).
struct LfpsStats {
  int64_t steps = 0, bypassed = 0, fallbacks = 0, all = 0;
  int64_t scored_keys = 0;     ///< sum of c1
  int64_t offloaded_keys = 0;  ///< sum of offloaded
};

class LfpsPolicy final : public Policy {
 public:
  /// State slots for max_sequences x num_layers x num_kv_heads heads; tables reserve
  /// max_tokens entries lazily (virtual memory until touched).
  LfpsPolicy(const LfpsParams& params, int max_sequences, int num_layers, int num_kv_heads,
             int64_t max_tokens);
  ~LfpsPolicy() override;

  [[nodiscard]] std::string_view name() const override { return "lfps"; }
  [[nodiscard]] Placement placement() const override { return Placement::kCpu; }
  bool wants_prefill_queries() const override { return true; }
  Status OnPrefill(const PrefillContext& ctx) override;
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override;
  void OnSequenceRemoved(int slot) override;

  /// Select, also reporting what it did in \p info (may be null).
  Status SelectWithInfo(const SelectContext& ctx, std::vector<int32_t>& out, LfpsStepInfo* info);
  [[nodiscard]] LfpsStats stats() const;
  [[nodiscard]] const LfpsParams& params() const { return params_; }
  /// The true (decay-applied) sums of the vertical and slash tables of one head; false if the head
  /// has no state yet.
  bool TableSums(int slot, int layer, int kv_head, double* ver, double* sla) const;

 private:
  struct HeadState;
  Result<HeadState*> State(int slot, int layer, int kv_head, bool create);

  LfpsParams params_;
  int max_sequences_, num_layers_, num_kv_heads_;
  int64_t max_tokens_;
  std::vector<std::unique_ptr<HeadState>> states_;
  std::atomic<int64_t> steps_{0}, bypassed_{0}, fallbacks_{0}, all_{0}, scored_{0},
      offloaded_{0};
};

/// The registry's factory: params from config.policy.params ("s", "r", "eps", "a", "local",
/// "fallback", "score_all"); state sized from config.capacity and config.model.
Result<std::unique_ptr<Policy>> MakeLfpsPolicy(const RuntimeConfig& config);

}  // namespace kvferry
