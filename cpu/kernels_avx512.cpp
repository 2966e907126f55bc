// Copyright kvferry authors. Apache-2.0.
// CPU kernels for Avx512F (compiled with its -m flags by kvferry_simd_flags; entered only after
// CpuSupports(CpuIsa::kAvx512F) said yes). The kernels and their table's getter are in
// simd_kernels.inc, named by the macros below.
#include "cpu/kernels.h"

#define KVF_SIMD_ISA 2
#define KVF_SIMD_KERNELS Avx512Kernels
#define KVF_SIMD_ISA_ID CpuIsa::kAvx512F
#define KVF_SIMD_ISA_NAME "avx512f"
#include "cpu/simd_kernels.inc"
