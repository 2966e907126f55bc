// Copyright kvferry authors. Apache-2.0.
#pragma once
// The selection-policy interface: the public part (Policy, SelectContext, PrefillContext,
// RegisterPolicy, PolicyNames) is kvferry/policy.h; this header adds what only the library's own
// policies and the runtime use: the types of the device hooks and MakePolicy.

#include <cstdint>
#include <memory>
#include <vector>

#include "base/attn_types.h"
#include "kvferry/config.h"
#include "kvferry/policy.h"
#include "kvferry/status.h"

namespace kvferry {

/// An approximate scan's ranking a device computed for one Select (LFPS's scan, Device::ShadowScan):
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

/// The prompt statistics a device computed for one (sequence, layer, KV head) prefill chunk
/// (Device::PrimeAttention, PrimeArgs): host memory, valid during the OnPrefillPrimed call.
struct PrimedStats {
  const float* ver = nullptr;     ///< [n]: summed causal softmax weight per position
  const float* sla = nullptr;     ///< [n]: summed weight per distance
  const double* stats = nullptr;  ///< PrimeStatsCount(head_dim, group) doubles (see PrimeArgs)
  int32_t rows = 0;               ///< the chunk's last rows they cover
};

/// Builds the policy named in \p config.policy; unknown names or parameters are kInvalidArgument.
Result<std::unique_ptr<Policy>> MakePolicy(const RuntimeConfig& config);

}  // namespace kvferry
