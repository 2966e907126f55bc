// Copyright kvferry authors. Apache-2.0.
// Fuzzes the safetensors reader (JSON header, offsets, dtypes) and the attention-trace loader on
// top of it. A file that parses serialises and parses again to the same tensors.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "bench/lib/safetensors.h"

using namespace kvferry::bench;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<uint8_t> bytes(data, data + size);
  auto file = ParseSafetensors(bytes);
  if (!file.ok()) {
    if (file.status().message().empty()) std::abort();
    return 0;
  }
  for (const auto& [name, t] : file->tensors) {
    if (t.bytes.size() != static_cast<size_t>(t.numel()) * SafetensorsDTypeSize(t.dtype)) std::abort();
    if (t.bytes.size() > (1u << 20)) continue;
    (void)file->GetFloat(name);
    (void)file->GetInt32(name);
  }
  (void)LoadTraceFromBytes(bytes);
  auto again = SerializeSafetensors(*file);
  if (!again.ok()) std::abort();
  auto reparsed = ParseSafetensors(*again);
  if (!reparsed.ok() || reparsed->metadata != file->metadata ||
      reparsed->tensors.size() != file->tensors.size()) {
    std::abort();
  }
  for (const auto& [name, t] : file->tensors) {
    const SafetensorsTensor& u = reparsed->tensors.at(name);
    if (u.dtype != t.dtype || u.shape != t.shape || u.bytes != t.bytes) std::abort();
  }
  return 0;
}
