// Copyright kvferry authors. Apache-2.0.
#pragma once
/// \file knorm.h
/// \brief "knorm": of the offloaded positions, the ones whose keys have the smallest L2 norm
/// (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
/// Compression": keys of low norm draw high attention). It reads no query. It is also the
/// smallest complete device-selecting policy in the library: this folder and one entry in
/// policies/registry.cpp are all it takes (docs/policies.md, "Selecting on the device").

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "kvferry/config.h"
#include "kvferry/kv_pages.h"
#include "kvferry/policy.h"
#include "kvferry/status.h"

namespace kvferry {

/// The ranking both the host Select and the device selection's host twin use: of positions
/// [lo, hi) of \p kv, the \p k whose keys have the smallest L2 norm (fp32, dimensions summed in
/// order; ties: the lower position), appended to \p out in ascending order.
void KnormPicks(const KvPages& kv, const AttnParams& params, int64_t lo, int64_t hi, int64_t k,
                  int32_t* out);

class KnormPolicy final : public Policy {
 public:
  [[nodiscard]] std::string_view name() const override { return "knorm"; }
  [[nodiscard]] Placement placement() const override { return Placement::kGpu; }
  [[nodiscard]] bool selection_covers_resident() const override { return true; }
  /// Inside a planned step the device ranks the keys' norms (select.cu).
  [[nodiscard]] std::unique_ptr<detail::DeviceSelector> MakeDeviceSelector(
      const detail::SelectorShape& shape) const override;
  Status Select(const SelectContext& ctx, std::vector<int32_t>& out) override;
};

/// The factory the registry calls: "knorm" takes no parameters.
Result<std::unique_ptr<Policy>> MakeKnormPolicy(const RuntimeConfig& config);

}  // namespace kvferry
