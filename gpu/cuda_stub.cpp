// Copyright kvferry authors. Apache-2.0.
// The CUDA entry points of a build without CUDA: no GPU, and every request says why.
#ifndef KVFERRY_WITH_CUDA

#include <memory>

#include "gpu/device.h"

namespace kvferry {

bool CudaAvailable() { return false; }

Result<std::unique_ptr<Device>> MakeCudaDevice(int device_id) {
  (void)device_id;
  return Unimplemented("built without CUDA (configure with -DKVFERRY_WITH_CUDA=ON and nvcc)");
}

}  // namespace kvferry

#endif  // KVFERRY_WITH_CUDA
