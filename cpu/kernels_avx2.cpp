// Copyright kvferry authors. Apache-2.0.
// CPU kernels for Avx2 (compiled with its -m flags by kvferry_simd_flags; entered only after
// CpuSupports(CpuIsa::kAvx2) said yes). The kernels and their table's getter are in
// simd_kernels.inc, named by the macros below.
#include "cpu/kernels.h"

#define KVF_SIMD_ISA 1
#define KVF_SIMD_KERNELS Avx2Kernels
#define KVF_SIMD_ISA_ID CpuIsa::kAvx2
#define KVF_SIMD_ISA_NAME "avx2"
#include "cpu/simd_kernels.inc"
