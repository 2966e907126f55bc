// Copyright kvferry authors. Apache-2.0.
// Parts of the transfer engine that do not need CUDA: the probe's JSON, and Create in builds
// without CUDA.
#include "offload/transfer.h"

#include <sstream>

namespace kvferry {

std::string TransferProbe::ToJson() const {
  std::ostringstream os;
  os << "{\"h2d_gbps\": " << h2d_gbps << ", \"d2h_gbps\": " << d2h_gbps
     << ", \"d2d_gbps\": " << d2d_gbps << ", \"zero_copy_gather_gbps\": " << zero_copy_gather_gbps
     << ", \"batched_copy_gbps\": " << batched_copy_gbps << ", \"probe_bytes\": " << probe_bytes
     << ", \"gather_row_bytes\": " << gather_row_bytes << ", \"gather_rows\": " << gather_rows
     << "}";
  return os.str();
}

#ifndef KVFERRY_WITH_CUDA
Result<std::unique_ptr<TransferEngine>> TransferEngine::Create(Device* device, int64_t max_rows) {
  (void)device;
  (void)max_rows;
  return Unimplemented("TransferEngine: built without CUDA");
}
#endif

}  // namespace kvferry
