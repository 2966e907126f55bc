// Copyright kvferry authors. Apache-2.0.
#pragma once
// Device-side lookups in the token bank's hash page tables, shared by the planned step's kernels
// (gpu/decode_step.cu, read-only through the texture path) and the device-resident bank's
// admission (gpu/device_bank.cu, plain loads of a table it is writing). The layout is
// HashPageMap's: packed (pos << 32 | slot) entries, ~0 = empty, linear probing from
// HashPageMap::Bucket; DeviceBank's tombstones (pos field -2) match no position and are skipped.

#include <cstdint>

#include "base/bank_map.h"

namespace kvferry::cuda {

constexpr unsigned long long kBankHashEmpty = ~0ull;
constexpr unsigned long long kBankHashTomb = 0xFFFFFFFEFFFFFFFFull;

/// Entry index of \p pos in a table of 2^log2 entries, or -1; *slot (when given) = its slot.
/// kReadOnly: loads through __ldg (the table does not change during the kernel).
template <bool kReadOnly>
__device__ __forceinline__ int64_t BankHashFind(const unsigned long long* table, int log2,
                                                int32_t pos, int32_t* slot = nullptr) {
  const uint32_t mask = (1u << log2) - 1;
  uint32_t i = HashPageMap::Bucket(pos, log2);
  for (uint32_t n = 0; n <= mask; ++n, i = (i + 1) & mask) {
    const unsigned long long e = kReadOnly ? __ldg(table + i) : table[i];
    if (e == kBankHashEmpty) return -1;
    if (static_cast<int32_t>(e >> 32) == pos) {
      if (slot != nullptr) *slot = static_cast<int32_t>(e & 0xffffffffu);
      return i;
    }
  }
  return -1;
}

}  // namespace kvferry::cuda
