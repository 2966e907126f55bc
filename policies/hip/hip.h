// Copyright kvferry authors. Apache-2.0.
#pragma once
// HiP (seed 003, notes/hip.md): a hierarchical top-k mask for decode. The offloaded range is cut
// into blocks of bk tokens and into K' = k / bk nodes of about equal length; each iteration splits
// every node of more than one block into two halves, scores each half by one representative block
// (the centre one by default) and keeps the best K' branches, until every node is one block.
// The mask is cached per (slot, layer, KV head) and rebuilt every r_m steps; tokens that leave the
// window between rebuilds wait for the next one (as in the paper's decode).
//
// Host reference. Decisions on the notes' open questions (section 8):
//  - Scores (`bits`): 4 (the default for head_dim % 8 == 0) scores a representative token from
//    its key as SparCas's 4-bit row over every dimension and the int8 query (policies/hip/mask.h):
//    exact integer dots, so the GPU computes the same mask from compact rows it keeps in device
//    memory (policies/hip/select.cu, 68 bytes a token and KV head at head_dim 128) and the step
//    stays on the device; 16 scores from the stored keys in fp32 (the paper's; host selection).
//  - First nodes (`align`): 1 (the default) runs of a power of two blocks at its multiples, as
//    the public code aligns them: the tree stays put as n grows, so a rebuilt mask changes only
//    where the scores do (the bank keeps serving it); 0 the paper's K' even nodes, whose bounds
//    all shift with n (policies/hip/mask.h).
//  - Rebuilds: every r_m ranked steps, and whenever k_off shrinks or n falls (a k_off that grows
//    waits for the interval); a layer's first (or forced) mask lives r_m - layer % r_m steps
//    (policies/hip/mask.h's HipSinceAfterBuild), so that each step rebuilds about 1 / r_m of the
//    layers instead of all of them every r_m steps.
//  - `drift` (0.7, the default; beyond the paper): a mask is also due, before its r_m steps, at a
//    ranked step whose query has turned from the one it was built from (the cosine of their int8
//    codes below `drift` in any head of the group: policies/hip/mask.h's HipDriftedHead), so that a
//    mask is rebuilt when its query changed rather than on the clock alone; 0 the paper's r_m
//    cadence. Chosen by perplexity at equal GPU step time (docs/policies.md, "hip").
//  - `lag` (0, the default): a due rebuild is built from the step's query and used from that step
//    (the step whose query turned is the one that needs the new mask); 1 (the paper's decode with
//    a side stream) uses it from the next ranked step on, and only a step without a usable mask
//    (the first, k_off shrank, n fell) builds and uses its own (policies/hip/mask.h's HipStepAction).
//    On CUDA a lag-1 rebuild runs on a side stream beside the rest of the step instead of on its
//    critical path (a rebuild is about 214 us a layer at 128K).
//  - Iterations: until every node is one block (about log2(NB / K')); a one-block node is one
//    branch and competes unsplit. Split of [f, l) at m = floor((f + l) / 2).
//  - Branch score: the largest scaled q_g . k over the group's query heads and the representative
//    block's tokens (the paper's max over the query block, bsk = 1).
//  - GQA: one mask per KV head for the group. Sinks and the window are resident and excluded
//    from the search (as the public code). Ties: the lower block.
//  - First `dense_layers` (default 3, the notes' l_d for 7B models), at `dense_bits` 4 (the default
//    when the scores are 4-bit): SparCas's 4-bit top-k over every dimension (policies/sparcas/sparcas.h
//    with d_b = head_dim, the same compact rows the mask scores; the device's SparCas kernels),
//    a quarter of the exact path's key bytes; 16: the exact top-k. Not dense attention either way:
//    the runtime's per-item capacity forbids it (see sparcas.h).
//  - k = budget - sink - window tokens; K' = floor(k / bk) blocks (the remainder is unused).

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "policies/hip/mask.h"
#include "base/sparcas_q4.h"
#include "policies/policy.h"
#include "policies/select_util.h"
#include "policies/sparcas/sparcas.h"

namespace kvferry {

struct HipMaskOptions {
  int bk = 2;  ///< tokens per block
  HipRepresentative rep = HipRepresentative::kCentre;
  uint64_t seed = 0;  ///< kRandom: the pseudo-random choice is a hash of (seed, f, l)
  int bits = 16;      ///< 16: fp32 scores of the stored keys; 4: policies/hip/mask.h's 4-bit scores
  bool align = true;  ///< the first nodes aligned (policies/hip/mask.h's HipFirstNodes)
};

// ---- numeric core (pure functions; the CUDA port is tested against these) ----------------------

/// The representative block of branch [f, l) (l > f).
int64_t HipRepresentativeBlock(int64_t f, int64_t l, const HipMaskOptions& opt);

/// Score of block b of [begin, end): max over g < group and tokens t in [begin + b bk,
/// min(begin + (b + 1) bk, end)) of scale * sum_d q[g][d] k_t[d] (fp32, ascending d). Keys are
/// rows of \p kv in p.kv_dtype; q is [group][head_dim] fp32.
float HipBlockScore(const AttnParams& p, const float* q, const KvPages& kv, int64_t begin,
                    int64_t end, int64_t block, int bk);

/// HipBlockScore at 4 bits: each token's key quantized as a 4-bit row over every dimension,
/// SparcasQ4MaxLogit against the group's query of every dimension (QuantizeQueryHeads;
/// head_dim % 8 == 0).
float HipBlockScoreQ4(const AttnParams& p, const Q8Query& q, const KvPages& kv, int64_t begin,
                      int64_t end, int64_t block, int bk);

/// The mask over positions [begin, end) for k tokens: writes the chosen block indices (block b
/// = positions [begin + b bk, min(begin + (b + 1) bk, end))) ascending to out_blocks, at most
/// max(k / bk, 0) of them, and returns the count. Every block when ceil((end - begin) / bk) <=
/// k / bk.
int64_t HipMask(const AttnParams& p, const float* q, const KvPages& kv, int64_t begin,
                int64_t end, int64_t k, const HipMaskOptions& opt, std::vector<int32_t>& out_blocks);

// ---- policy -------------------------------------------------------------------------------------

struct HipParams {
  int bk = 2;            ///< "bk": tokens per block
  int r_m = 8;           ///< "r_m": mask refresh interval in steps
  int dense_layers = 3;  ///< "dense_layers": first layers with the exact top-k
  int rep = 0;           ///< "rep": representative, 0 centre, 1 first, 2 last, 3 random
  int bits = 0;          ///< "bits": 4 or 16 (see above); 0: 4 when head_dim % 8 == 0, else 16
  int align = 1;         ///< "align": 1 the first nodes aligned to a power of two blocks, 0 the paper's even ones
  int lag = 0;           ///< "lag": 0 a due rebuild serves from its own step, 1 from the next (built beside the step)
  int dense_bits = 4;    ///< "dense_bits": the dense layers' top-k over 4-bit keys of every dimension (4) or exact (16)
  /// "over": 1 the mask is the selection (the paper); c > 1 the mask holds c k candidate tokens
  /// and every step attends the k of them the step's query scores highest (at `bits`); host
  /// selection only (the device mask does not rank candidates)
  int over = 1;
  /// "guard": 0 off; g in (0, 1] a recall guard: every `guard_every`-th mask rebuild of a (layer, KV
  /// head) also ranks every offloaded key by its 4-bit score; where the tree's mask holds less
  /// than g of the softmax weight of that ranking's top k (the scores' softmax over those k) the
  /// head is taken as non-local and its masks, until the next check, are that ranking's top
  /// (over k) instead of the tree's. Host selection only.
  double guard = 0.0;
  int guard_every = 8;  ///< "guard_every": rebuilds between two checks of a head
  /// "fresh": 1 (default) a head the guard finds short takes the dense layers' selection at every
  /// step until its next check (SparCas's 4-bit top-k over every dimension, ranked by the step's
  /// query); 0 the ranking of its last rebuild, cached as the tree's mask would be (over k
  /// candidates). Host selection only.
  int fresh = 1;
  /// "drift": d in (0, 1] (default 0.7) a mask is also due, before its r_m steps, at a ranked
  /// step whose query has moved from the one it was built from: the cosine of their int8 codes
  /// below d in any head of the group (policies/hip/mask.h's HipDriftedHead); r_m stays the longest
  /// a mask lives. 0: off (the paper's cadence, every r_m steps).
  double drift = 0.7;
};

/// The bits HiP scores with at \p head_dim (ScoreBitsFor).
inline int HipBits(const HipParams& params, int head_dim) { return ScoreBitsFor(params.bits, head_dim); }

/// The SparCas selection HiP's dense layers (and its guarded heads) take: a 4-bit top-k over every
/// dimension of the raw rows (no channel smoothing, as HiP's device selection ranks them), never
/// re-chosen.
SparcasParams HipDenseRanking();

Result<HipParams> ParseHipParams(const std::map<std::string, double>& params);

class HipPolicy final : public Policy {
 public:
  /// \p device: the runtime's planned step may select on the device (policies/hip/select.cu): the
  /// scores are 4-bit and the budget's nodes fit kHipMaxNodes (MakeHipPolicy decides).
  HipPolicy(const HipParams& params, int max_sequences, int num_layers, int num_kv_heads,
            bool device = false);
  [[nodiscard]] std::string_view name() const override { return "hip"; }
  [[nodiscard]] Placement placement() const override { return Placement::kGpu; }
  [[nodiscard]] std::unique_ptr<detail::DeviceSelector> MakeDeviceSelector(
      const detail::SelectorShape& shape) const override;
  /// Whether the planned step may select on the device (MakeHipPolicy decides).
  [[nodiscard]] bool device() const { return device_; }
  /// SparCas's compact rows with every dimension at 4 bits (the dense layers': the KV dtype),
  /// dimensions never re-chosen; the mask's block size, interval and representative.
  [[nodiscard]] HipSelectArgs device_args(int head_dim) const;
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override;
  /// select_calls: head-steps ranked afresh (the dense layers, heads the guard moved to the
  /// ranking with fresh 1) or whose mask was built or requested; select_reused: head-steps that
  /// kept their cached mask.
  [[nodiscard]] PolicyCounters counters() const override {
    PolicyCounters c;
    c.select_calls = ranked_.load(std::memory_order_relaxed);
    c.select_reused = cached_.load(std::memory_order_relaxed);
    return c;
  }
  void OnSequenceRemoved(int slot) override {
    states_.RemoveSlot(slot);
    if (dense_ != nullptr) dense_->OnSequenceRemoved(slot);
  }
  [[nodiscard]] const HipParams& params() const { return params_; }
  /// Whether the dense layers take SparCas's 4-bit top-k at \p head_dim (dense_bits 4 and 4-bit
  /// scores).
  [[nodiscard]] bool DenseQ4(int head_dim) const;
  /// Whether a head the guard finds short is ranked at every step (guard > 0, fresh 1).
  [[nodiscard]] bool Fresh() const;

 private:
  struct HeadState {
    HipState st;  ///< the device's mask state (policies/hip/mask.h's HipPromote / HipRecordStep)
    std::vector<int32_t> masks[2];  ///< its two masks as offloaded positions, ascending (st.cur in use)
    int64_t rebuilds = 0;           ///< masks built (the recall guard checks every guard_every-th)
    bool scan = false;              ///< the guard found the tree's recall short: masks come from the scan
    std::vector<int8_t> built_q;    ///< drift: the int8 codes of the query the mask was built from
  };
  // The recall guard's ranking: the k offloaded positions with the best 4-bit (bits 16: fp32)
  // max-logit scores, best first (ties: the lower position).
  // The share of the scores' softmax over \p best (the ranking's top k) that \p mask (ascending)
  // holds: the guard's measure of the tree's recall, weighted as attention would weight it.
  double MaskShare(const SelectContext& ctx, const std::vector<int32_t>& best,
                   const std::vector<int32_t>& mask) const;
  void ScanTopK(const SelectContext& ctx, const OffloadSplit& s, int64_t k,
                std::vector<int32_t>& picked) const;
  // over > 1: the k of the candidate positions \p cand the step's query scores highest, ascending
  // by position (\p ascending false: best first).
  void RankCandidates(const SelectContext& ctx, const std::vector<int32_t>& cand, int64_t k,
                      std::vector<int32_t>& picked, bool ascending = true) const;
  HipParams params_;
  bool device_ = false;
  HeadStateTable<HeadState> states_;
  std::unique_ptr<SparcasPolicy> dense_;  ///< dense_bits 4 or fresh: the dense layers' selection
  std::atomic<int64_t> ranked_{0}, cached_{0};  ///< counters()
};

Result<std::unique_ptr<Policy>> MakeHipPolicy(const RuntimeConfig& config);

}  // namespace kvferry
