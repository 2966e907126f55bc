// Copyright kvferry authors. Apache-2.0.
// Small out-of-line pieces of the public headers: names, Status formatting, TensorView, Stats JSON.
#include <sstream>

#include "kvferry/config.h"
#include "kvferry/stats.h"
#include "kvferry/status.h"
#include "kvferry/tensor.h"

namespace kvferry {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kNotFound: return "not found";
    case StatusCode::kFailedPrecondition: return "failed precondition";
    case StatusCode::kCorruptData: return "corrupt data";
    case StatusCode::kUnimplemented: return "unimplemented";
    case StatusCode::kResourceExhausted: return "resource exhausted";
    case StatusCode::kIoError: return "i/o error";
    case StatusCode::kDeviceError: return "device error";
    case StatusCode::kInternal: return "internal error";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  std::string s(StatusCodeName(code_));
  s += ": ";
  s += message_;
  return s;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

const char* RouteName(Route route) {
  switch (route) {
    case Route::kAuto: return "auto";
    case Route::kGpu: return "gpu";
    case Route::kCpu: return "cpu";
  }
  return "?";
}

const char* BackendName(Backend backend) {
  switch (backend) {
    case Backend::kAuto: return "auto";
    case Backend::kCuda: return "cuda";
    case Backend::kHost: return "host";
  }
  return "?";
}

TensorView TensorView::Contiguous(void* data, DType dtype, MemoryKind where,
                                  std::initializer_list<int64_t> shape) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.where = where;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride_expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != stride_expected) return false;
    stride_expected *= shape[d];
  }
  return true;
}

std::string Stats::ToJson() const {
  std::ostringstream os;
  os << "{\"prefill_tokens\":" << prefill_tokens
     << ",\"prefill_chunks_prefetched\":" << prefill_chunks_prefetched
     << ",\"decode_steps\":" << decode_steps
     << ",\"decode_tokens\":" << decode_tokens << ",\"decode_planned\":" << decode_planned
     << ",\"decode_split\":" << decode_split << ",\"decode_prefetched\":" << decode_prefetched
     << ",\"xl_gap_us\":" << xl_gap_us
     << ",\"decode_plans\":" << decode_plans << ",\"host_syncs\":" << host_syncs
     << ",\"bytes_h2d\":" << bytes_h2d
     << ",\"bytes_d2h\":" << bytes_d2h << ",\"rows_resident\":" << rows_resident
     << ",\"rows_bank_hit\":" << rows_bank_hit << ",\"rows_fetched\":" << rows_fetched
     << ",\"rows_cpu\":" << rows_cpu << ",\"rows_selected\":" << rows_selected
     << ",\"rows_window\":" << rows_window
     << ",\"bank_admitted\":" << bank_admitted << ",\"bank_evicted\":" << bank_evicted
     << ",\"bank_admit_failures\":" << bank_admit_failures
     << ",\"prhs_select_calls\":" << prhs_select_calls
     << ",\"prhs_select_reused\":" << prhs_select_reused
     << ",\"lfps_scans_device\":" << lfps_scans_device
     << ",\"lfps_scans_device_short\":" << lfps_scans_device_short
     << ",\"select_key_bytes\":" << select_key_bytes
     << ",\"ms_append\":" << ms_append << ",\"ms_select\":" << ms_select
     << ",\"ms_select_device\":" << ms_select_device << ",\"ms_attend_device\":" << ms_attend_device
     << ",\"ms_resolve\":" << ms_resolve << ",\"ms_attend_gpu\":" << ms_attend_gpu
     << ",\"ms_attend_cpu\":" << ms_attend_cpu << ",\"ms_merge\":" << ms_merge << ",\"ms_admit\":" << ms_admit
     << ",\"ms_prefill\":" << ms_prefill << ",\"ms_prime\":" << ms_prime
     << ",\"cost_pcie_gbps\":" << cost_pcie_gbps
     << ",\"split_share\":" << split_share
     << ",\"cost_cpu_gbps\":" << cost_cpu_gbps << ",\"ms_cpu_attend_busy\":" << ms_cpu_attend_busy
     << ",\"cost_cpu_gbps_measured\":" << cost_cpu_gbps_measured
     << ",\"cost_h2d_gbps\":" << cost_h2d_gbps << ",\"cost_hbm_gbps\":" << cost_hbm_gbps
     << ",\"cost_select_gbps_measured\":" << cost_select_gbps_measured
     << ",\"cost_attend_gbps_measured\":" << cost_attend_gbps_measured
     << ",\"host_bytes_reserved\":" << host_bytes_reserved
     << ",\"device_bytes_reserved\":" << device_bytes_reserved << "}";
  return os.str();
}

}  // namespace kvferry
