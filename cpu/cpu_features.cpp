// Copyright kvferry authors. Apache-2.0.
#include "cpu/cpu_features.h"

#include <cpuid.h>

#include <cstdlib>
#include <cstring>

namespace kvferry::cpu {
namespace {

// XGETBV through inline assembly: the _xgetbv intrinsic would need -mxsave on this baseline TU.
uint64_t ReadXcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures Detect() {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return f;
  const unsigned max_leaf = eax;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return f;
  const bool osxsave = (ecx >> 27) & 1u;
  f.fma = (ecx >> 12) & 1u;
  f.f16c = (ecx >> 29) & 1u;
  const bool avx = (ecx >> 28) & 1u;
  if (osxsave && avx) {
    const uint64_t xcr0 = ReadXcr0();
    f.os_avx = (xcr0 & 0x6u) == 0x6u;                // SSE + AVX state
    f.os_avx512 = f.os_avx && (xcr0 & 0xe0u) == 0xe0u;  // opmask, ZMM_Hi256, Hi16_ZMM
    f.os_amx = (xcr0 & 0x60000u) == 0x60000u;         // XTILECFG, XTILEDATA
  }
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    f.avx2 = (ebx >> 5) & 1u;
    f.avx512f = (ebx >> 16) & 1u;
    f.avx512dq = (ebx >> 17) & 1u;
    f.avx512bw = (ebx >> 30) & 1u;
    f.avx512vl = (ebx >> 31) & 1u;
    f.amx_bf16 = (edx >> 22) & 1u;
    f.avx512fp16 = (edx >> 23) & 1u;
    f.amx_tile = (edx >> 24) & 1u;
    const unsigned max_sub = eax;
    if (max_sub >= 1) {
      __cpuid_count(7, 1, eax, ebx, ecx, edx);
      f.avx512bf16 = (eax >> 5) & 1u;
    }
  }
  return f;
}

bool Supported(const CpuFeatures& f, CpuIsa isa) {
  const bool avx2 = f.os_avx && f.avx2 && f.fma && f.f16c;
  const bool avx512 = avx2 && f.os_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2: return avx2;
    case CpuIsa::kAvx512F: return avx512;
    // The TU is compiled with -mavx512fp16 as well, so the compiler may use FP16 moves: require
    // both (Zen 4 has AVX512_BF16 without AVX512_FP16 and must take the kAvx512F path).
    case CpuIsa::kAvx512Bf16: return avx512 && f.avx512bf16 && f.avx512fp16;
  }
  return false;
}

}  // namespace

const CpuFeatures& DetectCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

bool CpuSupports(CpuIsa isa) { return Supported(DetectCpuFeatures(), isa); }

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512F: return "avx512f";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
  }
  return "unknown";
}

CpuIsa BestCpuIsa() {
  static const CpuIsa best = [] {
    CpuIsa cap = CpuIsa::kAvx512Bf16;
    if (const char* env = std::getenv("KVFERRY_CPU_ISA"); env != nullptr && *env != '\0') {
      for (int i = 0; i < kNumCpuIsas; ++i) {
        if (std::strcmp(env, CpuIsaName(static_cast<CpuIsa>(i))) == 0) cap = static_cast<CpuIsa>(i);
      }
    }
    for (int i = static_cast<int>(cap); i > 0; --i) {
      if (CpuSupports(static_cast<CpuIsa>(i))) return static_cast<CpuIsa>(i);
    }
    return CpuIsa::kScalar;
  }();
  return best;
}

}  // namespace kvferry::cpu
