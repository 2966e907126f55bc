// Copyright kvferry authors. Apache-2.0.
#pragma once
// The one dispatch switch from run-time head_dim and KV dtype to template parameters.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kvferry/status.h"
#include "base/check.h"

// Converts a run-time head_dim into the compile-time constant HEAD_DIM for the body.
#define DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, ...)                                  \
  [&]() -> ::kvferry::Status {                                                      \
    switch (head_dim) {                                                             \
      case 64: { constexpr int HEAD_DIM = 64; return __VA_ARGS__(); }               \
      case 128: { constexpr int HEAD_DIM = 128; return __VA_ARGS__(); }             \
      case 256: { constexpr int HEAD_DIM = 256; return __VA_ARGS__(); }             \
      default:                                                                      \
        return ::kvferry::InvalidArgument(::kvferry::detail::StrCat(                \
            "CUDA attention: head_dim ", head_dim, " not in {64, 128, 256}"));      \
    }                                                                               \
  }()

#define DISPATCH_KV_DTYPE(dtype, T, ...)                                            \
  [&]() -> ::kvferry::Status {                                                      \
    switch (dtype) {                                                                \
      case ::kvferry::DType::kBF16: { using T = __nv_bfloat16; return __VA_ARGS__(); } \
      case ::kvferry::DType::kF16: { using T = __half; return __VA_ARGS__(); }      \
      default:                                                                      \
        return ::kvferry::InvalidArgument("CUDA attention: kv dtype must be bf16 or f16"); \
    }                                                                               \
  }()

