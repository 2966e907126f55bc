// Copyright kvferry authors. Apache-2.0.
#pragma once
// PrHS's depth window (PSAW) applied to a finished selection: shared by the psaw+ wrapper's host
// Select (policies/prhs/prhs.cpp), the host twins of the device's selection (cpu::ForEachSelectItem) and
// the CUDA kernel after it (gpu/decode_select.cu), so that the three select the same positions.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "base/attn_types.h"  // KVF_HOST_DEVICE

namespace kvferry {

/// The fraction f of a head's positions that PSAW hides at \p layer: positions [sink, floor(f *
/// n)) are hidden for a head of n positions (0 below and at the start layer l_s).
inline double PsawHiddenFraction(int layer, int num_layers, int l_s, double phi) {
  if (layer < l_s || num_layers <= l_s) return 0.0;
  const double e = static_cast<double>(layer - l_s) / static_cast<double>(num_layers - l_s);
  return 1.0 - std::pow(phi, e);
}

/// floor(f * n): the end of the hidden range (one double multiply, the same on every backend).
inline int64_t PsawHiddenEndOf(double fraction, int64_t n) {
  return fraction > 0.0 ? static_cast<int64_t>(std::floor(fraction * static_cast<double>(n))) : 0;
}

/// PsawFilterList's last step, also run by one thread of the CUDA kernel: list[0, out) is
/// ascending and its prefix [0, i0) holds the selected sinks (positions below \p sink); adds the
/// sinks not selected, ascending, while the count is below \p target. Returns the new count.
KVF_HOST_DEVICE inline int64_t PsawAddSinks(int32_t* list, int64_t i0, int64_t out, int64_t sink,
                                            int64_t target) {
  int64_t add = 0, p_add = -1;  // how many, and the last one added
  for (int64_t p = 0, j = 0; p < sink && out + add < target; ++p) {
    while (j < i0 && list[j] < p) ++j;
    if (!(j < i0 && list[j] == p)) ++add, p_add = p;
  }
  if (add == 0) return out;
  for (int64_t j = out - 1; j >= i0; --j) list[j + add] = list[j];  // the rest moves up by add
  // The new prefix, filled from its end: selected sinks and the unselected ones <= p_add.
  int64_t w = i0 + add, j = i0 - 1;
  for (int64_t p = sink - 1; p >= 0 && w > 0; --p) {
    const bool sel = j >= 0 && list[j] == p;
    if (sel) --j;
    if (sel || p <= p_add) list[--w] = static_cast<int32_t>(p);
  }
  return out + add;
}

/// Filters the ascending selection list[0, count) of a head of n positions: drops the hidden
/// positions [sink, hide_end), then refills up to min(budget, sink + n - hide_end) positions with
/// the most recent visible positions not selected (descending from n - 1), then with the sinks not
/// selected (ascending from 0). Returns the new count; list stays ascending and unique and must
/// have room for that many. Identity when hide_end <= sink.
inline int64_t PsawFilterList(int32_t* list, int64_t count, int64_t n, int64_t sink, int64_t budget,
                              int64_t hide_end) {
  sink = std::clamp<int64_t>(sink, 0, n);
  if (hide_end <= sink) return count;
  // Kept: the entries below sink (a prefix) and those at or above hide_end (a suffix).
  const int64_t i0 = std::lower_bound(list, list + count, static_cast<int32_t>(sink)) - list;
  const int64_t i1 =
      std::lower_bound(list + i0, list + count, static_cast<int32_t>(std::min(hide_end, n))) - list;
  std::copy(list + i1, list + count, list + i0);
  const int64_t kept = i0 + (count - i1);
  const int64_t target = std::min(budget, sink + (n - hide_end));
  if (kept >= target) return kept;
  // The most recent unselected visible positions: every position of [p_star, n) ends up selected,
  // p_star the largest with at least `take` unselected positions in [p_star, n).
  const int32_t* s_begin = list + i0;  // the kept suffix, ascending, all >= hide_end
  const int64_t s = kept - i0;
  const int64_t available = (n - hide_end) - s;
  const int64_t take = std::min(target - kept, available);
  int64_t out = kept;
  if (take > 0) {
    auto unselected_from = [&](int64_t p) {  // unselected positions in [p, n)
      const int64_t sel = s - (std::lower_bound(s_begin, s_begin + s, static_cast<int32_t>(p)) - s_begin);
      return (n - p) - sel;
    };
    int64_t lo = hide_end, hi = n - 1;  // unselected_from is non-increasing in p
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (unselected_from(mid) >= take) lo = mid; else hi = mid - 1;
    }
    const int64_t p_star = lo;
    const int64_t j0 = std::lower_bound(list, list + kept, static_cast<int32_t>(p_star)) - list;
    for (int64_t p = p_star; p < n; ++p) list[j0 + (p - p_star)] = static_cast<int32_t>(p);
    out = j0 + (n - p_star);
  }
  // Then the sinks not selected, ascending, while short.
  if (out < target) out = PsawAddSinks(list, i0, out, sink, target);
  return out;
}

}  // namespace kvferry
