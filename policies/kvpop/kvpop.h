// Copyright kvferry authors. Apache-2.0.
#pragma once
// KVpop (seed 004, notes/kvpop.md): learned eviction. Each (slot, layer, KV head) keeps its sinks,
// its window and k long-range slots. When a token u leaves the window it is scored once by a
// per-KV-head scorer on [k_u; v_u] and gets the static priority p_u = r_u - u log(gamma_h)
// (log gamma < 0, so newer tokens get a bonus); it enters the slots if there is room or if it
// beats the slot with the lowest priority (argmin eviction), else it is evicted at once. p is
// static and the eligible set only grows, so this online rule equals "top-k of the eligible set by
// p" at every step, and an evicted token never comes back. Evicted rows stay in the host store
// (kvferry never deletes rows), so evicted + retained + resident = every position (a test).
//
// Host reference. Decisions on the notes' gaps (section 8):
//  - Budget: sink + window + k with the runtime's sink and window (ctx.sink, ctx.window) and
//    k = budget - sink - window, so the zero scorer (r = 0) keeps the most recent eligible tokens
//    and equals streaming exactly. A budget that shrinks evicts the lowest priorities; one that
//    grows does not bring evicted tokens back.
//  - Scorer input: the stored (post-RoPE) key and the value, fp32.
//  - Scorer: the MLP variant ("scorer" = 1): r = w2 . SiLU(W1 x + b1) + b2 per (layer, KV head),
//    log gamma_h = log gamma_min + sigmoid(alpha_h) (log gamma_max - log gamma_min), weights from
//    a safetensors file (scripts/kvpop_train.py writes it). The zero scorer ("scorer" = 0) uses
//    alpha = 0. The mLSTM (delayed) variant is not implemented here.
//  - The notes' untrained delayed scorer (section 9 (b), "scorer" = 2, KvpopMassScore): r_u is
//    the attention u received while it was in the window, log(eps + max_g A_g(u) / window), where
//    A_g(u) sums head g's softmax weight of u over the queries [u, u + window) and the softmax is
//    taken over the sinks and the window (the rows every step attends; a query's full
//    normaliser is not the policy's to see). Decode queries come from Select, prompt queries from
//    OnPrefill (wants_prefill_queries); a position stored without its query (Runtime::Append)
//    adds nothing. A head keeps group floats a window token, plus one float a prompt token
//    from its prefill until the first step admits it. Its decay is "gamma" (default 0.998: of
//    0.999999, 0.9999, 0.9995, 0.999, 0.998 and 0.995 it gave SmolLM2 on KJV 8K the lowest
//    perplexity at budget 256; on a second text it loses to plain recency:
//    bench/results/kvpop_mass_smollm2.json). It reads the step's
//    query, so it selects on the host ("device" = 0, its default).
//  - Ties: a priority equal to the lowest retained one does not evict it (the lower position
//    stays); among equal lowest priorities the highest position is evicted.
//  - Weights file: PolicyConfig::weights_path (read at MakeKvpopPolicy), or loaded weights given
//    to KvpopPolicy::Create (tests, embedders).
//  - Where it selects: on the device by default ("device" = 1: policies/kvpop/select.cu; the slots,
//    priorities and the scorer's table in device memory, updated by the planned step's kernels,
//    no host work, capture-safe); "device" = 0 keeps this host Select in the step. Both compute
//    policies/kvpop/score.h's priorities, so they keep the same tokens.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "policies/kvpop/score.h"
#include "policies/policy.h"
#include "policies/select_util.h"

namespace kvferry {

/// The trained scorers of every (layer, KV head), fp32.
struct KvpopScorerWeights {
  int num_layers = 0;
  int num_kv_heads = 0;
  int in_dim = 0;   ///< 2 * head_dim: [k; v]
  int hidden = 0;
  std::vector<float> w1;     ///< [layers][kv_heads][hidden][in_dim]
  std::vector<float> b1;     ///< [layers][kv_heads][hidden]
  std::vector<float> w2;     ///< [layers][kv_heads][hidden]
  std::vector<float> b2;     ///< [layers][kv_heads]
  std::vector<float> alpha;  ///< [layers][kv_heads]: decay logit
  float gamma_min = 0.999f;
  float gamma_max = 0.999999f;
};

/// Reads a scorer file: safetensors with F32 tensors "w1", "b1", "w2", "b2", "alpha" of the
/// shapes above and metadata "gamma_min", "gamma_max" (optional). Errors name the file and tensor.
Result<KvpopScorerWeights> LoadKvpopWeights(const std::string& path);

// ---- numeric core (pure functions; the CUDA port is tested against these) ----------------------

// The scorer (KvpopMlp), the static priority (KvpopPriorityOf) and the ranking
// (KvpopRanksAbove) are policies/kvpop/score.h's, shared with the device selection.

/// log gamma = log(gamma_min) + sigmoid(alpha) (log(gamma_max) - log(gamma_min)), fp32.
float KvpopLogGamma(float alpha, float gamma_min, float gamma_max);

/// One online admission into k slots: slot_pos / slot_prio [k] hold *count live entries. If
/// *count < k the token is appended; else if (prio, -pos) beats the worst entry (lowest priority,
/// then highest position) it replaces it. Returns the evicted position (the worst entry or the
/// token itself), or -1 if nothing was evicted. k == 0 evicts the token.
int64_t KvpopAdmit(int32_t* slot_pos, float* slot_prio, int64_t* count, int64_t k, int32_t pos,
                   float prio);

// ---- policy -------------------------------------------------------------------------------------

struct KvpopParams {
  /// "scorer": 0 zero (recency), 1 MLP (needs weights), 2 attention mass while in the window
  /// (delayed, untrained), -1 MLP if weights
  int scorer = -1;
  double gamma_min = 0.999;     ///< "gamma_min" (used when the weights file sets none)
  double gamma_max = 0.999999;  ///< "gamma_max"
  double gamma = 0.998;         ///< "gamma": scorer 2's decay, log gamma a position
  /// "device": 1 select on the device (policies/kvpop/select.cu), 0 on the host; -1 (unset): 1,
  /// except 0 for scorer 2 and decay 1 (which select on the host only)
  int device = -1;
  /// "decay": 0 the scorer's decay (the weights' per-head alpha, or "gamma"); 1 each (sequence,
  /// layer, KV head) chooses its own from the prompt: of kKvpopDecayGrid and the scorer's, the
  /// decay whose kept set draws the most attention from the prompt's last kKvpopCalibrationQueries
  /// queries (host selection only)
  int decay = 0;
};

/// decay 1: the prompt queries a head keeps to choose its decay, and the decays it chooses among
/// (besides the scorer's own): from pure recency (0.5: a position's age outweighs any score) to
/// nearly pure score (0.99999).
constexpr int kKvpopCalibrationQueries = 128;
constexpr double kKvpopDecayGrid[] = {0.5, 0.9, 0.99, 0.995, 0.998, 0.999, 0.9995, 0.9999, 0.99999};

/// decay 1's choice: of the log decays \p grid (the first wins ties), the one whose top-k by
/// KvpopPriorityOf(r[u - lo], u, log_gamma) over positions [lo, hi) holds the most of \p mass
/// (mass[u - lo]: the attention the calibration queries paid position u). Returns its index.
int KvpopChooseDecay(const float* r, const float* mass, int64_t lo, int64_t hi, int64_t k,
                     const std::vector<float>& grid);

/// Scorer 2's floor inside the log: r = log(kKvpopMassEps + mass).
constexpr float kKvpopMassEps = 1e-6f;

/// Scorer 2's score of a token from its summed window attention: log(eps + max_g mass[g] /
/// window), fp32.
float KvpopMassScore(const float* mass, int group, int window);

Result<KvpopParams> ParseKvpopParams(const std::map<std::string, double>& params);

class KvpopPolicy final : public Policy {
 public:
  /// \p weights may be null (zero scorer only); a shape that does not match the model fails at
  /// Select (naming both shapes).
  static Result<std::unique_ptr<KvpopPolicy>> Create(
      const KvpopParams& params, std::shared_ptr<const KvpopScorerWeights> weights,
      const RuntimeConfig& config);

  [[nodiscard]] std::string_view name() const override { return "kvpop"; }
  [[nodiscard]] Placement placement() const override { return Placement::kGpu; }
  [[nodiscard]] std::unique_ptr<detail::DeviceSelector> MakeDeviceSelector(
      const detail::SelectorShape& shape) const override;
  [[nodiscard]] bool wants_prefill_queries() const override {
    return params_.scorer == 2 || params_.decay == 1;
  }
  Status OnPrefill(const PrefillContext& ctx) override;
  /// The scorer of every (layer, KV head) in policies/kvpop/score.h's table layout (hidden 0 for the
  /// zero scorer); a model the weights do not fit is kInvalidArgument naming both shapes.
  [[nodiscard]] Result<std::vector<float>> device_select_table(const ModelShape& model) const;
  /// The scorer's hidden width on the device (0: the zero scorer).
  [[nodiscard]] int32_t device_hidden() const;
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override;
  void OnSequenceRemoved(int slot) override { states_.RemoveSlot(slot); }

  /// True if the trained MLP scores tokens (false: the zero scorer, pure recency).
  [[nodiscard]] bool trained() const { return use_mlp_; }
  /// The long-range slots (ascending positions) and the evicted positions (ascending) of a head;
  /// empty if it has no state.
  [[nodiscard]] std::vector<int32_t> Retained(int slot, int layer, int kv_head) const;
  [[nodiscard]] std::vector<int32_t> Evicted(int slot, int layer, int kv_head) const;

 private:
  KvpopPolicy(const KvpopParams& params, std::shared_ptr<const KvpopScorerWeights> weights,
              const RuntimeConfig& config);
  struct HeadState {
    int64_t next_u = 0;             ///< positions below this have left the window (were scored)
    int64_t count = 0;
    std::vector<int32_t> slot_pos;  ///< [count] (unordered)
    std::vector<float> slot_prio;
    std::vector<int32_t> evicted;   ///< in eviction order
    // Scorer 2: queries [0, mass_next) are counted; mass[(t % window) * group + g] is A_g(t) of
    // the window's tokens; scores[i] is r of position score_base + i (left the window, not yet
    // admitted).
    int64_t mass_next = 0;
    std::vector<float> mass;
    std::vector<float> scores;
    int64_t score_base = 0;
    // decay 1: the last prompt queries ([cal_pos0, cal_pos0 + rows), group x head_dim each) until
    // the first step chooses the head's decay (log_gamma, calibrated from then on).
    std::vector<float> cal_q;
    int64_t cal_pos0 = 0;
    bool calibrated = false;
    float log_gamma = 0.0f;
  };
  // decay 1: the head's log decay chosen from its stored prompt queries over the scores \p r of
  // positions [lo, lo + r.size()) (falls back to \p own when there is nothing to choose).
  float CalibrateDecay(const SelectContext& ctx, HeadState* st, const std::vector<float>& r, int64_t lo,
                       int64_t k, float own) const;
  float LogGamma(int layer, int kv_head) const;
  // Scorer 2: counts the queries [st->mass_next, d] (q of query d at q_d, null for one not seen:
  // it adds nothing), scoring every token that leaves the window on the way.
  static void CountQueries(HeadState* st, const KvPages& kv, const AttnParams& p, int sink,
                           int window, int64_t d, const float* q_d);
  KvpopParams params_;
  std::shared_ptr<const KvpopScorerWeights> weights_;
  bool use_mlp_ = false;
  HeadStateTable<HeadState> states_;
};

/// The registry's factory: params from config.policy.params ("scorer", "gamma_min",
/// "gamma_max"); weights from config.policy.weights_path when set (unless "scorer" is 0).
Result<std::unique_ptr<Policy>> MakeKvpopPolicy(const RuntimeConfig& config);

}  // namespace kvferry
