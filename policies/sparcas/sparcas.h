// Copyright kvferry authors. Apache-2.0.
#pragma once
// SparCas (seed 002, notes/sparcas.md): a dimension-first cascade. Per KV group, the d_b key
// dimensions with the largest |q| summed over the group's query heads are chosen every `u` steps;
// a compact copy of those key dimensions is kept for every stored position; each step the partial
// scores q[D] . k[D] of all positions give the token top-k; exact attention runs on those tokens.
//
// Host reference. Decisions on the notes' open questions (section 7):
//  - GQA: one dimension set per KV head from sum_g |q_g,d| (ties: lower d); tokens ranked by the
//    group's summed softmax of the scaled partial logits over all n positions (the oracle's
//    aggregation), so that d_b = head_dim gives exactly the oracle's ranking.
//  - Refresh: dimensions chosen at the first Select of a head and then every `u` Selects; the
//    compact keys are re-gathered on a change of dimensions, and positions stored since the last
//    call are appended with the current dimensions (the GPU port's append).
//  - Sinks and the recent window are always attended (the resident tiers), the top-k runs over
//    the offloaded range [sink, n - window) with k = budget - sink - window.
//  - First `dense_layers` layers (default 2): the runtime gives every item a fixed capacity
//    (budget + resident rows), so a policy cannot return all n positions there; those layers use
//    every dimension (d_b = head_dim), i.e. the exact top-k. The interface change that allows real
//    dense layers (a per-layer "dense" answer the runtime routes to its paged dense path) belongs
//    to runtime/.
//  - Compact rows (kvferry's extension, docs/cuda.md "Stop 23"): "bits" 16 keeps the chosen key
//    dimensions in the KV dtype, as the paper; "bits" 4 keeps them as 4-bit integers with a scale
//    per row (base/sparcas_q4.h), so four times the dimensions fit the same bytes. The default is
//    4 (when head_dim is a multiple of 8): on SmolLM2 / KJV 4K at budget 256, d_b 32 of 64 at 4
//    bits gave perplexity 13.94 against 14.82 for the paper's 8 of 64 at 16 bits (dense 13.39,
//    oracle 13.82), for 20 bytes a row instead of 16. The dense layers keep every dimension in
//    the KV dtype (the exact top-k).
//  - d_b defaults to 16 of 128 scaled to head_dim at 16 bits (8 at head_dim 64) and to half of
//    head_dim (rounded up to a multiple of 8) at 4 bits; "d_b" sets it directly (a multiple of 8
//    at 4 bits).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "policies/policy.h"
#include "policies/sparcas/args.h"
#include "policies/select_util.h"

namespace kvferry {

// ---- numeric core (pure functions; the CUDA port is tested against these) ----------------------

/// The d_b dimensions with the largest importance sum_g |q[g][d]| (q [group][head_dim] fp32,
/// summed over g ascending in fp32), ties broken by the lower dimension; written ascending to
/// out_dims[0, d_b). d_b is clamped to [1, head_dim].
void SparcasChooseDims(const float* q, int group, int head_dim, int d_b, int32_t* out_dims);

/// Copies dims[0, d_b) of one key row (fp32 [head_dim]) into compact[0, d_b).
void SparcasGatherCompact(const float* key, const int32_t* dims, int d_b, float* compact);

/// Partial logits: compact keys [n][d_b] fp32 (row j holds key j's dims[0..d_b)); q [group]
/// [head_dim]; out [group][ld] with out[g * ld + j] = scale * sum_{i < d_b} q[g][dims[i]] *
/// compact[j][i], summed in ascending i in fp32, for j in [0, n).
void SparcasApproxScores(const float* q, int group, int head_dim, const int32_t* dims, int d_b,
                         const float* compact, int64_t n, float scale, float* out, int64_t ld);

/// SparcasApproxScores over 4-bit rows (base/sparcas_q4.h): words [n][d_b / 8], row_scale [n];
/// out[g * ld + j] = scale * SparcasQ4Dot(SparcasQuantizeQuery(q[g][dims]), row j): head g's
/// chosen dimensions as int8 codes, an exact integer dot with the row's nibbles.
void SparcasApproxScoresQ4(const float* q, int group, int head_dim, const int32_t* dims, int d_b,
                           const uint32_t* words, const float* row_scale, int64_t n, float scale,
                           float* out, int64_t ld);

// ---- policy -------------------------------------------------------------------------------------

struct SparcasParams {
  int d_b = 0;           ///< "d_b": dimensions kept (0 = the default of SparcasDb for the bits)
  int u = 256;           ///< "u": dimension refresh interval in ranked steps (docs/policies.md, `sparcas`)
  int dense_layers = 2;  ///< "dense_layers": first layers that use every dimension (exact top-k)
  int bits = 0;          ///< "bits": 4 or 16 per kept dimension (0 = 4 when head_dim % 8 == 0)
  /// "smooth": 1 (the default) divides each key channel by its largest size in the prompt before
  /// the 4-bit rows are quantized and weighs the dimensions by it (base/sparcas_q4.h,
  /// SparcasChannelScales; both backends, docs/policies.md, `sparcas`); 0 quantizes the raw rows.
  int smooth = 1;
};

Result<SparcasParams> ParseSparcasParams(const std::map<std::string, double>& params);

/// Bits per kept dimension in effect for \p head_dim (ScoreBitsFor).
inline int SparcasBits(const SparcasParams& params, int head_dim) {
  return ScoreBitsFor(params.bits, head_dim);
}

/// d_b in effect for \p head_dim (when params.d_b == 0: 16/128 of head_dim at 16 bits, half of it
/// rounded up to a multiple of 8 at 4 bits), clamped to [1, head_dim].
int SparcasDb(const SparcasParams& params, int head_dim);

class SparcasPolicy final : public Policy {
 public:
  SparcasPolicy(const SparcasParams& params, int max_sequences, int num_layers, int num_kv_heads);
  [[nodiscard]] std::string_view name() const override { return "sparcas"; }
  [[nodiscard]] Placement placement() const override { return Placement::kGpu; }
  /// Inside a planned step the device keeps the compact keys and selects (kSparcas).
  [[nodiscard]] std::unique_ptr<detail::DeviceSelector> MakeDeviceSelector(
      const detail::SelectorShape& shape) const override;
  /// The parameters of its device selection at \p head_dim (buffers aside).
  [[nodiscard]] SparcasStepArgs device_args(int head_dim) const {
    SparcasStepArgs d;
    d.db = SparcasDb(params_, head_dim);
    d.u = params_.u;
    d.dense_layers = params_.dense_layers;
    d.bits = SparcasBits(params_, head_dim);
    d.smooth = params_.smooth;
    return d;
  }
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override;
  void OnSequenceRemoved(int slot) override { states_.RemoveSlot(slot); }
  [[nodiscard]] const SparcasParams& params() const { return params_; }

 private:
  struct HeadState {
    int64_t seen = 0;             ///< compact rows [0, seen) are valid
    int64_t since_refresh = 0;
    int d_b = 0;
    int bits = 16;
    std::vector<int32_t> dims;    ///< [d_b] ascending
    std::vector<float> compact;   ///< bits 16: [seen][d_b]
    std::vector<uint32_t> q4;     ///< bits 4: [seen][d_b / 8] words
    std::vector<float> q4_scale;  ///< bits 4: [seen]
    std::vector<float> scales;    ///< smooth: [head_dim] channel scales (empty: not taken yet)
  };
  SparcasParams params_;
  HeadStateTable<HeadState> states_;
};

Result<std::unique_ptr<Policy>> MakeSparcasPolicy(const RuntimeConfig& config);

}  // namespace kvferry
