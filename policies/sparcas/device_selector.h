// Copyright kvferry authors. Apache-2.0.
#pragma once
// SparCas's device selection (select.cu), which HiP's extends (its dense layers take
// SparCas's path; its compact rows are SparCas's with every dimension at 4 bits).
#include <string>

#include "policies/device_selector.h"
#include "policies/sparcas/args.h"

namespace kvferry::detail {

/// Per item the d_b key dimensions of largest sum_g |q_g,d| (re-chosen every u ranked steps), a
/// compact copy of those dimensions of every key (at 16 bits or SparcasQuantizeRow's 4), their
/// partial logits ranked; layers below dense_layers rank every dimension.
class SparcasSelector : public DeviceSelector {
 public:
  SparcasSelector(std::string name, const SparcasStepArgs& args, const SelectorShape& shape);
  Status Size(std::vector<SelectorBuffer>& buffers) const override;
  Status Bind(std::span<void* const> buffers, Device& device, StreamHandle stream) override;
  Status Reset(int slot, StreamHandle stream) override;
  void Fill(DecodeStepArgs& a) const override;
  const DeviceKernel& select_kernel() const override;
  int64_t KeyBytes(int64_t n, int64_t budget, int layer) const override;

 protected:
  /// Checks the parameters SparCas's kernels take.
  Status CheckParams() const;
  /// The compact rows [0, n) of \p layer, when the item ranks (0 otherwise).
  int64_t CompactKeyBytes(int64_t n, int layer, bool ranks) const;
  /// The memory plan's part names (HiP's differ).
  virtual const char* keys_part() const { return "sparcas compact keys"; }
  virtual const char* state_part() const { return "sparcas selection state"; }

  std::string name_;
  /// The policy's parameters; Bind adds the buffers, and Fill hands them to each step as they are.
  SparcasStepArgs sp_;
  char* meta_ = nullptr;
};

}  // namespace kvferry::detail
