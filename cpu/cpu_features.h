// Copyright kvferry authors. Apache-2.0.
#pragma once
// What the CPU we run on supports, read once with CPUID and XGETBV (the OS must have enabled the
// AVX / AVX-512 register state, not only the CPU). Used to pick the CPU kernels at run time.

#include <cstdint>

namespace kvferry::cpu {

/// Instruction sets a CPU kernel family is compiled for, slowest first.
enum class CpuIsa : uint8_t {
  kScalar = 0,      ///< baseline x86-64: the reference kernels
  kAvx2 = 1,        ///< AVX2 + FMA + F16C
  kAvx512F = 2,     ///< AVX-512 F/BW/VL/DQ (+FMA, F16C)
  kAvx512Bf16 = 3,  ///< kAvx512F plus AVX512_BF16 and AVX512_FP16 (Sapphire Rapids and later)
};
inline constexpr int kNumCpuIsas = 4;

struct CpuFeatures {
  bool fma = false, f16c = false, avx2 = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false, avx512fp16 = false, amx_bf16 = false, amx_tile = false;
  bool os_avx = false;     ///< XCR0 enables YMM state
  bool os_avx512 = false;  ///< XCR0 enables opmask + ZMM state
  bool os_amx = false;     ///< XCR0 enables tile state (Linux also needs arch_prctl per process)
};

/// Detected once, thread-safe.
const CpuFeatures& DetectCpuFeatures();

/// True if kernels compiled for \p isa may run on this CPU and OS.
bool CpuSupports(CpuIsa isa);

/// "scalar", "avx2", "avx512f", "avx512_bf16".
const char* CpuIsaName(CpuIsa isa);

/// The best ISA this CPU supports, capped by the environment variable KVFERRY_CPU_ISA (one of the
/// names above) when it is set, so a user can force a slower path (e.g. to measure it).
CpuIsa BestCpuIsa();

}  // namespace kvferry::cpu
