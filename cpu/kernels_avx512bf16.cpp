// Copyright kvferry authors. Apache-2.0.
// CPU kernels for Avx512Bf16 (compiled with its -m flags by kvferry_simd_flags; entered only after
// CpuSupports(CpuIsa::kAvx512Bf16) said yes). The kernels and their table's getter are in
// simd_kernels.inc, named by the macros below.
#include "cpu/kernels.h"

#define KVF_SIMD_ISA 3
#define KVF_SIMD_KERNELS Avx512Bf16Kernels
#define KVF_SIMD_ISA_ID CpuIsa::kAvx512Bf16
#define KVF_SIMD_ISA_NAME "avx512_bf16"
#include "cpu/simd_kernels.inc"
