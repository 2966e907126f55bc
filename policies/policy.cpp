// Copyright kvferry authors. Apache-2.0.
// The defaults of Policy's library-internal hooks (kvferry/policy.h declares them; their types are
// in policies/policy.h) and the public row loader.
#include "policies/policy.h"

#include "policies/device_selector.h"

#include "cpu/dtype.h"

namespace kvferry {

std::unique_ptr<detail::DeviceSelector> Policy::MakeDeviceSelector(const detail::SelectorShape&) const {
  return nullptr;
}

double Policy::device_hide_fraction(int layer) const {
  (void)layer;
  return 0.0;
}

bool Policy::device_reuses_previous_layer(int layer) const {
  (void)layer;
  return false;
}

int Policy::device_scan_channels() const { return 0; }

int64_t Policy::device_scan_picks(int64_t k) const {
  (void)k;
  return 0;
}

bool Policy::ScanShadow(int slot, int layer, int kv_head, ScanShadowView* out) const {
  (void)slot;
  (void)layer;
  (void)kv_head;
  (void)out;
  return false;
}

int Policy::prime_rows() const { return 0; }

Status Policy::OnPrefillPrimed(const PrefillContext& ctx, const PrimedStats& primed) {
  (void)ctx;
  (void)primed;
  return Unimplemented("this policy does not learn from device-computed prompt statistics");
}

void LoadKvRowF32(const KvPages& kv, const AttnParams& params, int64_t pos, bool value,
                  float* dst) {
  const size_t elem = DTypeSize(params.kv_dtype);
  const void* row = value ? PagedVRow(kv, pos, params.head_dim, elem)
                          : PagedKRow(kv, pos, params.head_dim, elem);
  cpu::ConvertSpan(dst, DType::kF32, row, params.kv_dtype, params.head_dim);
}

}  // namespace kvferry
