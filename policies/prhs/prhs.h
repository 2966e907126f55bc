// Copyright kvferry authors. Apache-2.0.
#pragma once
// The pre-hoc selectors of PrHS/CPE (Gao et al., "Near-Oracle KV Selection via Pre-hoc Sparsity")
// as wrappers around another policy, built by name composition: "cis+oracle", "psaw+lfps",
// "xl+quest", "psaw+cis+oracle" (outermost first). See docs/prhs.md for the decisions taken where
// the paper is ambiguous.
//
//   cis+  temporal query sharing: blocks of s steps per (slot, layer, KV head); the inner policy
//         runs at a block's first step or when no query of the block's retrievals is similar
//         (cos <= tau); otherwise the kept set is reused, widened by +-r around its top m.
//   psaw+ depth window: from layer l_s on, positions [sink, P_l(n)) are hidden.
//   xl+   cross-layer sharing: from a start layer on, layer l reuses layer l-1's selection of the
//         same (slot, KV head, step).
//
// Parameters are namespaced (cis.s, cis.tau, cis.r, cis.m_frac, psaw.phi, psaw.start, xl.start);
// the rest go to the inner policy.

#include <cstdint>
#include <vector>

#include "policies/policy.h"

namespace kvferry {

/// Builds a wrapper stack from config.policy.name ("cis+oracle", "psaw+cis+oracle", ...);
/// kNotFound if the name has no wrapper prefix.
Result<std::unique_ptr<Policy>> MakePrhsPolicy(const RuntimeConfig& config);

/// The wrapper prefixes ("cis+", "psaw+", "xl+").
const std::vector<std::string>& PrhsWrapperPrefixes();

/// PSAW's hidden edge: positions [sink, P) are hidden at \p layer for a head of \p n positions;
/// P = floor((1 - phi^((layer - l_s) / (num_layers - l_s))) * n) for layer >= l_s, else 0.
int64_t PsawHiddenEnd(int layer, int num_layers, int l_s, double phi, int64_t n);

/// CIS's shared set at a step that reuses a retrieval: the sinks [0, sink) and window
/// [n - window, n) re-anchored at n, then, up to \p budget positions in all: the kept positions'
/// top m (\p ranked is the kept non-resident positions, best first), the +-r neighbours of those m,
/// then the rest of \p ranked in rank order. Out of range positions are skipped. Ascending. With
/// \p all_resident every sink and window position is in the set even past the budget (for an
/// inner policy that keeps them all, Policy::selection_covers_resident); otherwise they count
/// against it, the newest first.
void CisShareSet(int64_t n, int sink, int window, int64_t budget,
                 const std::vector<int32_t>& ranked, int64_t m, int r, std::vector<int32_t>& out,
                 bool all_resident = false);

/// The cross-layer wrapper's public face: what layer+1 will select.
class XlPredictor {
 public:
  virtual ~XlPredictor() = default;
  /// The positions layer + 1 of (slot, kv_head) will select at the current step if it reuses
  /// this layer's set (ascending); empty when layer + 1 runs its inner policy (below the start
  /// layer, past the last layer, or nothing kept for this step).
  [[nodiscard]] virtual std::vector<int32_t> PredictNext(int slot, int layer,
                                                         int kv_head) const = 0;
};

}  // namespace kvferry
