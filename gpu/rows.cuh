// Copyright kvferry authors. Apache-2.0.
#pragma once
// Row-wise kernels: converting row scatter/gather (CopyRows) and the exact log-sum-exp merge.
// One warp per row, grid-stride over rows.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gpu/convert.cuh"
#include "gpu/device.h"

namespace kvferry::cuda {

constexpr int kRowThreads = 256;

/// rows: [num_rows] {dst, src}; each row elems elements.
__global__ void __launch_bounds__(kRowThreads) CopyRowsKernel(const RowCopy* __restrict__ rows,
                                                              int64_t num_rows, int elems,
                                                              DType src_dtype, DType dst_dtype) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kRowThreads / 32);
  for (int64_t r = blockIdx.x * (kRowThreads / 32) + (threadIdx.x >> 5); r < num_rows;
       r += warps) {
    const RowCopy rc = rows[r];
    const size_t src_bytes = static_cast<size_t>(elems) * (src_dtype == DType::kF32 ? 4 : 2);
    const bool vec = src_dtype == dst_dtype && src_bytes % 16 == 0 &&
                     (reinterpret_cast<uintptr_t>(rc.src) % 16) == 0 &&
                     (reinterpret_cast<uintptr_t>(rc.dst) % 16) == 0;
    if (vec) {
      const uint4* s = static_cast<const uint4*>(rc.src);
      uint4* d = static_cast<uint4*>(rc.dst);
      for (size_t i = lane; i < src_bytes / 16; i += 32) d[i] = s[i];
    } else if (src_dtype == dst_dtype) {
      // Same dtype: a bit-exact copy (as the host backend's memcpy), so rows may carry ids and
      // packed integers (the token bank's device page tables) as well as values, NaNs included.
      const uint16_t* s = static_cast<const uint16_t*>(rc.src);
      uint16_t* d = static_cast<uint16_t*>(rc.dst);
      for (size_t i = lane; i < src_bytes / 2; i += 32) d[i] = s[i];
    } else {
      for (int i = lane; i < elems; i += 32) {
        StoreElem(rc.dst, dst_dtype, i, LoadElem(rc.src, src_dtype, i));
      }
    }
  }
}

/// Merges (o_b, lse_b) into (o_a, lse_a) per row, then writes o_a as out_dtype to out.
__global__ void __launch_bounds__(kRowThreads) MergeLseKernel(float* o_a, float* lse_a,
                                                              const float* o_b,
                                                              const float* lse_b, int64_t rows,
                                                              int head_dim, void* out,
                                                              DType out_dtype) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kRowThreads / 32);
  for (int64_t r = blockIdx.x * (kRowThreads / 32) + (threadIdx.x >> 5); r < rows; r += warps) {
    float* oa = o_a + r * head_dim;
    if (o_b != nullptr && lse_b != nullptr) {
      const float la = lse_a[r], lb = lse_b[r];
      const float* ob = o_b + r * head_dim;
      if (lb != -INFINITY) {
        float wa = 0.0f, wb = 1.0f, lse = lb;
        if (la != -INFINITY) {
          const float m = fmaxf(la, lb);
          const float ea = expf(la - m), eb = expf(lb - m);
          wa = ea / (ea + eb);
          wb = eb / (ea + eb);
          lse = m + logf(ea + eb);
        }
        for (int d = lane; d < head_dim; d += 32) oa[d] = wa * oa[d] + wb * ob[d];
        __syncwarp();
        if (lane == 0) lse_a[r] = lse;
      }
    }
    if (out != nullptr) {
      for (int d = lane; d < head_dim; d += 32) StoreElem(out, out_dtype, r * head_dim + d, oa[d]);
    }
  }
}

}  // namespace kvferry::cuda
