# Finds every dependency kvferry uses (all from the distribution's packages).
set(THREADS_PREFER_PTHREAD_FLAG ON)
find_package(Threads REQUIRED)
find_package(TBB REQUIRED)
find_package(dnnl REQUIRED)
find_package(Boost 1.74 REQUIRED)   # headers: Boost.Lockfree
find_package(PkgConfig REQUIRED)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
if(KVFERRY_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(KVFERRY_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

# CPU fast paths live in their own translation units, compiled for their ISA and chosen at run
# time by CPUID, so the library still runs on CPUs without them:
#   *_avx512bf16.cpp  AVX-512 with BF16 and FP16 instructions (Sapphire Rapids)
#   *_avx512.cpp      AVX-512F/BW/VL
#   *_avx2.cpp        AVX2 + FMA + F16C
function(kvferry_simd_flags sources)
  foreach(src IN LISTS sources)
    if(src MATCHES "_avx512bf16\\.cpp$")
      set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS
        "-mavx512f;-mavx512bw;-mavx512vl;-mavx512dq;-mavx512bf16;-mavx512fp16;-mfma;-mf16c")
    elseif(src MATCHES "_avx512\\.cpp$")
      set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS
        "-mavx512f;-mavx512bw;-mavx512vl;-mavx512dq;-mfma;-mf16c")
    elseif(src MATCHES "_avx2\\.cpp$")
      set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c")
    endif()
  endforeach()
endfunction()
