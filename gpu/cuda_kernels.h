// Copyright kvferry authors. Apache-2.0.
#pragma once
// Host launchers of the CUDA kernels (CUDA builds only). Each takes a stream, never allocates,
// checks its launch, and returns a Status. Scratch memory is passed in by the caller (the Device
// owns one workspace per stream). Head dim and dtype are run-time values converted to template
// parameters by one dispatch switch (see DISPATCH_HEAD_DIM in attention.cu).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cpu/attn_types.h"
#include "gpu/device.h"
#include "kvferry/status.h"

namespace kvferry::cuda {

/// Scratch for split-KV partial results; bytes may be 0 (then no splitting).
struct AttnWorkspace {
  float* data = nullptr;
  size_t bytes = 0;
};

/// What the launchers need to know about the GPU.
struct LaunchInfo {
  int num_sms = 132;
  int max_splits = 128;  ///< upper bound on KV splits per item
  int min_chunk = 256;  ///< fewest rows a split handles (shorter lists use fewer CTAs)
};

/// Whether the decode kernels are instantiated for this shape (head_dim 64/128/256, bf16/fp16).
Status CheckAttnShape(const AttnParams& p);

/// Sparse attention over row lists (RowAttnItem). Items and row-address lists must be readable by
/// the device; rows may be in device memory or mapped pinned host memory.
Status LaunchAttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items,
                        const LaunchInfo& info, AttnWorkspace ws, cudaStream_t stream);

/// Causal paged attention (dense decode when num_q == 1, prefill when num_q > 1).
Status LaunchAttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items,
                         const LaunchInfo& info, AttnWorkspace ws, cudaStream_t stream);

/// rows[i].dst <- convert(rows[i].src), elems elements each; rows[] device-readable.
Status LaunchCopyRows(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                      DType dst_dtype, cudaStream_t stream);

/// Exact merge in place into (o_a, lse_a) (o_b/lse_b may be null), then o_a -> out (out_dtype)
/// when out != null. See cpu::MergeLseRef.
Status LaunchMergeLse(float* o_a, float* lse_a, const float* o_b, const float* lse_b,
                      int64_t rows, int head_dim, void* out, DType out_dtype, cudaStream_t stream);

/// Scratch bytes LaunchTopK needs for \p rows rows of top-\p k (0 for k <= 4096).
size_t TopKWorkspaceBytes(int64_t rows, int64_t k);

/// Exact top-k of each of \p rows score rows (row r at scores + r * ld, n valid scores): indices
/// ordered by score descending, ties by lower index, NaN ranks as -inf (see cpu::TopKRef). Radix
/// select on order-preserving keys, then a bitonic sort of the k winners; deterministic.
/// out: [rows, k] (k clamped to n; the row stride of out is k).
Status LaunchTopK(const float* scores, int64_t n, int64_t ld, int64_t rows, int64_t k,
                  int32_t* out, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvferry::cuda
