// Copyright kvferry authors. Apache-2.0.
// CPU kernels for Avx512F (compiled with its -m flags by kvferry_simd_flags; entered only after
// CpuSupports(CpuIsa::kAvx512F) said yes). The kernels themselves are in simd_kernels.inc.
#include "cpu/kernels.h"

#define KVF_SIMD_ISA 2
#include "cpu/simd_kernels.inc"

namespace kvferry::cpu {

const CpuKernels& Avx512Kernels() {
  // Aggregate initialisation on purpose: a constructor call would be an inline function emitted
  // in this ISA's code that the linker could also hand to baseline callers.
  static const CpuKernels kernels{CpuIsa::kAvx512F, "avx512f", &AttendRowsSimd, &AttendPositionsSimd,
                                  &ScorePositionsSimd, &ScoreRangeSimd, &FilterGreaterImpl,
                                  &SoftmaxAccumulateImpl, &FilterGreaterBlockedImpl,
                                  &PrefillSoftmaxImpl, &ConvertImpl, &ScanInt8Impl,
                                  &ScanCollectImpl};
  return kernels;
}

}  // namespace kvferry::cpu
