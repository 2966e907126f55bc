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
  /// "fallback" (0/1): when the tables give no candidate, the scan nominates the candidates (scan >
  /// 0) or, without a scan, every offloaded key is scored (exact top-k).
  bool fallback = true;
  bool score_all = false;  ///< "score_all" (0/1): candidates = every offloaded position (ablation)
  /// "fill": when the tables nominate fewer than ceil(fill * k) candidates (k = offloaded tokens
  /// the budget leaves), add the positions with the best table evidence up to that many; 0 = the
  /// paper (C2 = C1 when |C1| <= k, the budget is not used).
  double fill = 1.0;
  /// "rank": how C1 is ranked. 0 = the group's summed softmax over C1 (paper); 1 = each head's
  /// softmax also normalised over the resident sinks and local tokens; 2 = 1 plus the log-normal
  /// estimate of the other positions.
  int rank = 1;
  /// "scan": channels of the approximate scan (0 = off). Each step scores every offloaded key
  /// approximately over the `scan` channels with the largest |q| * key scale, from an int8
  /// channel-major shadow of K kept by the policy, and adds the best ceil(scan_factor * k)
  /// positions outside C1 to the candidates (exact scoring decides).
  int scan = 16;
  double scan_factor = 2.0;  ///< "scan_factor"
  /// "scan_max_period": the scan runs every step while its candidates make >= 1/16 of C2; else its
  /// period doubles up to this many steps (1 = every step).
  int scan_max_period = 8;
  /// "per_head_budget": 0 = every KV head attends ctx.budget. B > 0: the layer's heads attend B on
  /// average (resident tokens included), split by measured need (each head's estimated attention
  /// share on offloaded tokens, an EMA), none above ctx.budget: run with ctx.budget > B to let
  /// needy heads take more.
  int64_t per_head_budget = 0;
  /// "profile" 1: Select's nanoseconds by phase, printed to stderr when the policy is destroyed
  /// (the runtime's step profile, docs/lfps.md).
  bool profile = false;
};

/// Parses config.policy.params; unknown keys and out-of-range values are kInvalidArgument.
Result<LfpsParams> ParseLfpsParams(const std::map<std::string, double>& params);

/// What one Select did, for benchmarks and tests.
struct LfpsStepInfo {
  bool all = false;       ///< budget covered everything: returned [0, n), tables untouched
  bool bypassed = false;  ///< sink-dominated head: returned the resident set only
  bool fallback = false;  ///< tables gave no candidate: scored every offloaded position
  /// Tables gave no candidate and the scan nominated them instead (scan > 0, "fallback" = 1): the
  /// exact work stays O(k); the exact fallback over every offloaded key is for scan = 0.
  bool rescued = false;
  double rho = 0.0;       ///< smallest sink share over the group's heads (0 if not computed)
  int64_t offloaded = 0;  ///< |[sink, n - window)|
  int64_t c0 = 0, c1 = 0, c2 = 0;  ///< candidate set sizes; c1 = keys given an exact q.k
  int64_t filled = 0;   ///< candidates the fill added (included in c1)
  int64_t scanned = 0;  ///< candidates the scan added (included in c1)
  int64_t k = 0;        ///< offloaded picks allowed (per_head_budget), 0 = budget - resident
};

/// Optional detail of one Select for analysis (benchmarks, tests); costs nothing when not asked for.
struct LfpsStepDetail {
  /// In: positions whose table values to report (e.g. the exact top-k).
  std::vector<int32_t> probe;
  /// Out: the candidate sets (ascending positions; empty on bypassed / all / budget-0 steps).
  std::vector<int32_t> c0, c1;
  /// Out: true (decay-applied) table values at the probe positions before this step's update:
  /// vertical at the position, slash at the distance t - position (NaN on steps that never read
  /// the tables).
  std::vector<float> probe_ver, probe_sla;
  /// Out: thresholds and means (true units), NaN when a table has none this step.
  float tau_ver = 0, tau_sla = 0, mean_ver = 0, mean_sla = 0;
};

/// Totals over all Select calls (relaxed counters).
struct LfpsStats {
  int64_t steps = 0, bypassed = 0, fallbacks = 0, all = 0;
  int64_t scored_keys = 0;     ///< sum of c1
  int64_t offloaded_keys = 0;  ///< sum of offloaded
  /// K rows quantised into the scan's shadow inside Select: one per new token once OnPrefill has
  /// made the shadow (it is made at the first scan only for heads that were never primed).
  int64_t shadow_rows_in_select = 0;
  /// Scans answered from the device's ranking (SelectContext::scan), and those where too few of
  /// its picks lay outside C1 (the host scanned instead).
  int64_t device_scans = 0, device_scans_short = 0;
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
  /// Every selection is the sinks, the offloaded picks and the recent positions from n - window.
  bool selection_covers_resident() const override { return true; }
  Status OnPrefill(const PrefillContext& ctx) override;
  /// The last s rows prime the tables; OnPrefillPrimed fills them from the device's sums.
  int prime_rows() const override { return params_.s; }
  Status OnPrefillPrimed(const PrefillContext& ctx, const PrimedStats& primed) override;
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override;
  void OnSequenceRemoved(int slot) override;
  /// The scan's channels (0 when it is off or every key is scored).
  int device_scan_channels() const override {
    return params_.score_all ? 0 : params_.scan;
  }
  /// The scan asks for ceil(scan_factor k) positions outside C1; the device returns three times
  /// as many plus 64 (C1 from the tables is 2-6% of the keys against the scan's 4% at 2% budgets).
  int64_t device_scan_picks(int64_t k) const override;
  bool ScanShadow(int slot, int layer, int kv_head, ScanShadowView* out) const override;
  PolicyCounters counters() const override {
    PolicyCounters c;
    c.scans_device = device_scans_.load(std::memory_order_relaxed);
    c.scans_device_short = device_scans_short_.load(std::memory_order_relaxed);
    return c;
  }

  /// Select, also reporting what it did in \p info and \p detail (each may be null).
  Status SelectWithInfo(const SelectContext& ctx, std::vector<int32_t>& out, LfpsStepInfo* info,
                        LfpsStepDetail* detail = nullptr);
  [[nodiscard]] LfpsStats stats() const;
  [[nodiscard]] const LfpsParams& params() const { return params_; }
  /// The true (decay-applied) sums of the vertical and slash tables of one head; false if the head
  /// has no state yet.
  bool TableSums(int slot, int layer, int kv_head, double* ver, double* sla) const;
  /// What priming learnt of one head, true (decay-applied) values, for tests: the tables over
  /// [0, n) and the bypass test's priors. False if the head has no state yet.
  struct PrimedState {
    std::vector<float> ver, sla, k_bar, v_bar;
    double sigma2_hat = 0.0;
  };
  bool GetPrimedState(int slot, int layer, int kv_head, PrimedState* out) const;

 private:
  struct HeadState;
  Result<HeadState*> State(int slot, int layer, int kv_head, bool create);
  // The state of (slot, layer, kv_head) for the const accessors: null if out of range or none.
  const HeadState* Peek(int slot, int layer, int kv_head) const;
  // OnPrefill's first and last steps, shared with OnPrefillPrimed: empty tables over [0, n), and
  // the sums, bounds and scan shadow of the filled ones.
  void BeginPrime(HeadState* st, int64_t n);
  void FinishPrime(HeadState* st, const PrefillContext& ctx);

  size_t NeedIndex(int slot, int layer, int kv_head) const {
    return (static_cast<size_t>(slot) * num_layers_ + layer) * num_kv_heads_ + kv_head;
  }
  int64_t PerHeadK(int slot, int layer, int kv_head, int64_t k_avg, int64_t k_cap) const;

  // SelectWithInfo's stages, in the order it runs them (lfps.cpp, which has the algorithm's
  // comments). SelectStep, defined there, is one step's geometry, head, scratch, report and the
  // candidate lists built so far; each stage reads it and records what it built.
  struct SelectStep;
  // (1) The bypass test's smallest sink share rho over the group's heads.
  static double MinSinkShare(SelectStep& s);
  // (2)-(3) C1 from the tables: C0 by the thresholds, then the expansion (or every offloaded
  // position with score_all).
  void TableCandidates(SelectStep& s) const;
  // (3a) The scan's picks outside C1 join it: the device's ranking when it has enough of them,
  // else HostScanPicks. Fails only when waiting for the device's ranking does.
  Status ScanCandidates(SelectStep& s);
  int64_t HostScanPicks(SelectStep& s, int r, int64_t want_scan, int32_t* pick);
  // (3b) Tops C1 up with the best table evidence.
  void FillCandidates(SelectStep& s) const;
  // LfpsStepDetail's C1 and probe values.
  static void ReportCandidates(SelectStep& s);
  // (4) Exact scores on C1 (plus the resident rows the rank appends), then the ranking's C2.
  void ScoreCandidates(SelectStep& s, bool glob_row) const;
  void RankCandidates(SelectStep& s, bool glob_row) const;
  // After the ranking: the scan's adaptive period, and this head's need (per_head_budget).
  void AdaptScanPeriod(SelectStep& s) const;
  void UpdateNeed(SelectStep& s);
  // (5) The table update on C2; returns C2 (ascending positions, in the thread's scratch).
  const int32_t* UpdateTables(SelectStep& s) const;

  LfpsParams params_;
  int max_sequences_, num_layers_, num_kv_heads_;
  int64_t max_tokens_;
  std::vector<std::unique_ptr<HeadState>> states_;
  std::unique_ptr<std::atomic<float>[]> need_;  ///< per head: offloaded attention share (EMA), -1 unknown
  std::atomic<int64_t> steps_{0}, bypassed_{0}, fallbacks_{0}, all_{0}, scored_{0},
      offloaded_{0}, shadow_rows_{0}, device_scans_{0}, device_scans_short_{0};
  // Parameter "profile" 1: nanoseconds of Select by phase, printed to stderr by the destructor
  // (a diagnostic for where a step's select time goes; off by default, one branch a phase).
  static constexpr int kPhases = 7;
  bool profile_ = false;
  std::atomic<int64_t> phase_ns_[kPhases] = {};
};

namespace lfps_internal {

/// Options of ScanPicks.
struct ScanPicksOptions {
  int threads = 1;         ///< as SelectContext::threads
  int isa = -1;            ///< the cpu::CpuIsa whose kernel table scans; -1: Select's choice
  bool force_thr = false;  ///< collect with thr instead of the sampled threshold
  uint32_t thr = 0;        ///< a cpu::ScanKey
};

/// Select's scan step (3a) after the channel choice, for tests: approximate logits acc[g][j] =
/// sum_c w[g * r + c] * rows[c][j] over j in [0, len), score_j = (float) max_g (acc[g][j] - max_j
/// acc[g][j]), and the `need` best j (value descending, lower j first on ties) with off_lo + j not
/// in the ascending list excl[0, m), as ascending j in out (all of [0, len) when need >= len);
/// need <= len - m unless need >= len. Returns the count, -1 when opt.isa cannot run here or its
/// SIMD table does not take these arguments. \p retried: the threshold let fewer than need pass.
int64_t ScanPicks(const int8_t* const* rows, const int32_t* w, int r, int group, int64_t len,
                  const int32_t* excl, int64_t m, int64_t off_lo, int64_t need,
                  const ScanPicksOptions& opt, std::vector<int32_t>& out, bool* retried = nullptr);

}  // namespace lfps_internal

/// The registry's factory: params from config.policy.params ("s", "r", "eps", "a", "local",
/// "fallback", "score_all"); state sized from config.capacity and config.model.
Result<std::unique_ptr<Policy>> MakeLfpsPolicy(const RuntimeConfig& config);

}  // namespace kvferry
