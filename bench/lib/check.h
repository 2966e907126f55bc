// Copyright kvferry authors. Apache-2.0.
#pragma once
// Fail-fast checks for benchmark mains: print where and why, exit(1). BENCH_CHECK takes a Status
// or a Result; CUDA_OK a cudaError_t (include <cuda_runtime.h> first).

#include <cstdio>
#include <cstdlib>

#define BENCH_CHECK(expr)                                                             \
  do {                                                                                \
    auto s_ = (expr);                                                                 \
    if (!s_.ok()) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

#define CUDA_OK(expr)                                                                          \
  do {                                                                                         \
    cudaError_t e_ = (expr);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
