// Copyright kvferry authors. Apache-2.0.
#pragma once
// SparCas's device selection (DeviceKernel) on the GPU (select.cu, CUDA builds only) and on the
// host (select_host.cpp); HiP's selection reuses its compact rows on both.

#include <cstdint>
#include <cstring>

#include "base/attn_types.h"
#include "policies/sparcas/args.h"
#include "cpu/select_items.h"
#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry::cuda {
/// The selection of a step (args: DecodeStepArgs).
Status SparcasSelectCuda(const void* args, const LaunchInfo& info, void* stream);
}  // namespace kvferry::cuda

namespace kvferry::cpu {

// SparCas's compact rows of item t (kSparcas, and kHip's every-dimension rows) brought up to n
// positions: the dimensions chosen at the first ranked step and every sparcas.u ranked steps (a
// change re-gathers every row), then the rows stored since the last ranked step. With smoothing
// (4-bit layers), the channel scales are taken at the first ranked step (base/sparcas_q4.h).
struct CompactRows {
  char* base = nullptr;
  const int32_t* dims = nullptr;
  const float* scales = nullptr;  ///< smooth: [head_dim] (null: none)
  int d_b = 0;
  bool q4 = false;
  int words = 0;
  const uint32_t* Q4Row(int64_t j) const {
    return reinterpret_cast<const uint32_t*>(base + static_cast<size_t>(j) * (words + 1) * 4);
  }
  static float Q4Scale(const uint32_t* row, int words) {
    float scale;
    std::memcpy(&scale, row + words, sizeof(float));
    return scale;
  }
};

/// Brings item \p t's compact rows up to \p n positions (the host twin's half of SparCas's prep
/// and gather; HiP's twin keeps the same rows).
CompactRows UpdateCompactRows(const DecodeStepArgs& a, int64_t t, const float* q, const KvPages& kv,
                              int64_t n);
/// A ranked list (WriteRankedList) over item t's compact rows, brought up to \p n positions first
/// (SparCas's and HiP's twins): rank(sp, c, rows) appends the k_off picks at out[c] and returns
/// the count.
template <typename Rank>
int64_t CompactRankedList(const DecodeStepArgs& a, int64_t t, const float* q, const KvPages& kv,
                          int64_t n, int32_t* out, const Rank& rank) {
  return WriteRankedList(a, n, out, [&](const OffloadSplit& sp, int64_t c) {
    return rank(sp, c, UpdateCompactRows(a, t, q, kv, n));
  });
}
/// SparCas's list for item \p it of step \p a; returns the count written to it.out.
int64_t SparcasSelect(const DecodeStepArgs& a, const SelectItem& it);

}  // namespace kvferry::cpu

namespace kvferry::detail {
/// The host twin of SparcasSelectCuda.
Status SparcasSelectHost(const void* args);
}  // namespace kvferry::detail
