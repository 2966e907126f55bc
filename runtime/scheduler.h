// Copyright kvferry authors. Apache-2.0.
#pragma once
// The PCIe-aware split of host-only rows between the GPU route (rows cross PCIe and are attended
// on the device) and the CPU route (rows are attended where they live; q and (o, lse) cross).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvferry/config.h"

namespace kvferry {

/// Rates the split is planned with. Defaults are the GPU test machine's measured limits; the
/// runtime overwrites them with what it measures at start.
struct CostModel {
  double pcie_gbps = 52.0;  ///< zero-copy gather rate of host rows into the GPU
  double cpu_gbps = 20.0;   ///< CPU sparse-attention rate over host rows (all pool threads)
  double h2d_gbps = 52.0;   ///< contiguous copies of pinned host memory to the GPU
  /// Device-memory rate (a device-to-device copy, read plus write): the rate a device selection
  /// reads its keys at and the GPU route attends resident and bank rows at, in the model.
  double hbm_gbps = 3000.0;
};

/// The fraction of the misses the CPU attends so both branches finish together: the GPU branch
/// moves (misses - c) rows over PCIe, the CPU branch reads c rows from DRAM, so
/// c = misses * cpu / (cpu + pcie).
inline double CpuFraction(const CostModel& model) {
  return model.cpu_gbps / (model.cpu_gbps + model.pcie_gbps);
}

/// Rows of \p misses to attend on the CPU on \p route (CpuFraction's share with auto).
inline int64_t CpuShare(Route route, const CostModel& model, int64_t misses) {
  switch (route) {
    case Route::kGpu: return 0;
    case Route::kCpu: return misses;
    case Route::kAuto: break;
  }
  return std::clamp<int64_t>(std::llround(static_cast<double>(misses) * CpuFraction(model)), 0, misses);
}

}  // namespace kvferry
