// Copyright kvferry authors. Apache-2.0.
#pragma once
// Where a KV head's positions lie at one step: the resident sinks and window, and the offloaded
// range between them from which a sparse policy picks. The policies (policies/select_util.h), the
// host backend's device-selection twin (cpu/decode_step.cpp) and the runtime's row counts share it;
// gpu/select_kernels.cuh's ItemSplitOf is its CUDA form.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvferry/config.h"

namespace kvferry {

/// Where a head's positions lie at one step.
struct OffloadSplit {
  int64_t n = 0;
  int64_t sink = 0;    ///< resident sinks [0, sink)
  int64_t off_lo = 0;  ///< offloaded range [off_lo, off_hi)
  int64_t off_hi = 0;
  int64_t k_off = 0;   ///< offloaded positions to pick (may be <= 0)
  bool all = false;    ///< the budget covers every offloaded position: select [0, n)
  int64_t n_off() const { return off_hi - off_lo; }
};

inline OffloadSplit SplitPositions(int64_t n, int sink, int window, int64_t budget) {
  OffloadSplit s;
  s.n = n;
  s.sink = std::clamp<int64_t>(sink, 0, n);
  s.off_lo = s.sink;
  s.off_hi = std::max(s.sink, n - std::max(window, 0));
  s.k_off = budget - (s.sink + (n - s.off_hi));
  s.all = s.k_off >= s.n_off();
  return s;
}

/// The largest budget a step of \p config can give an item (tokens; 0 for a dense policy's
/// unbounded one is the caller's business), and the most positions an item's list can hold: the
/// budget plus the resident sinks and window (a policy that always attends them may return more
/// than a smaller budget). The runtime sizes its lists and scratch with these.
inline int64_t ItemBudgetMax(const RuntimeConfig& config) {
  const int64_t cap = config.capacity.max_tokens_per_sequence;
  const auto by_fraction =
      static_cast<int64_t>(std::ceil(config.policy.budget_fraction * static_cast<double>(cap)));
  return std::min(cap, std::max(config.policy.budget_tokens, by_fraction));
}
inline int64_t ItemListCap(const RuntimeConfig& config) {
  const int64_t resident = int64_t{config.tiers.sink_tokens} + config.tiers.window_tokens;
  return std::min(config.capacity.max_tokens_per_sequence, ItemBudgetMax(config) + resident);
}

}  // namespace kvferry
