// Copyright kvferry authors. Apache-2.0.
#pragma once
// The live AllocDevice blocks of a Device (bytes as requested), for Device::device_bytes_held():
// the CUDA device's cudaMalloc blocks, and the host-emulated device's "device" blocks counted
// alike. Not synchronised: the owning device's lock guards it.

#include <cstddef>
#include <cstdint>
#include <unordered_map>

namespace kvferry {

class DeviceBlocks {
 public:
  void Add(void* p, size_t bytes) {
    blocks_[p] = bytes;
    bytes_ += static_cast<int64_t>(bytes);
  }
  /// Forgets block \p p (nothing if it holds no such block).
  void Remove(void* p) {
    auto it = blocks_.find(p);
    if (it == blocks_.end()) return;
    bytes_ -= static_cast<int64_t>(it->second);
    blocks_.erase(it);
  }
  [[nodiscard]] int64_t bytes() const { return bytes_; }

 private:
  std::unordered_map<void*, size_t> blocks_;
  int64_t bytes_ = 0;
};

}  // namespace kvferry
