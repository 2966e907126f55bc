// Copyright kvferry authors. Apache-2.0.
// Launchers of the row kernels (rows.cuh) and the exact top-k (topk.cuh).

#include <algorithm>

#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "gpu/rows.cuh"
#include "gpu/topk.cuh"
#include "base/check.h"

namespace kvferry::cuda {
namespace {

unsigned RowGrid(int64_t rows) {
  const int64_t warps_per_block = kRowThreads / 32;
  return static_cast<unsigned>(std::clamp<int64_t>((rows + warps_per_block - 1) / warps_per_block,
                                                   1, 65535));
}

int64_t NextPow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

}  // namespace

Status LaunchCopyRows(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                      DType dst_dtype, cudaStream_t stream) {
  KVF_CHECK_ARG(num_rows >= 0 && elems >= 0, "CopyRows: negative size (", num_rows, " rows of ",
                elems, ")");
  if (num_rows == 0 || elems == 0) return Status::Ok();
  KVF_CHECK_ARG(rows != nullptr, "CopyRows: null row list");
  CopyRowsKernel<<<RowGrid(num_rows), kRowThreads, 0, stream>>>(rows, num_rows, elems, src_dtype,
                                                                dst_dtype);
  KVF_CUDA_CHECK_LAUNCH(CopyRowsKernel);
  return Status::Ok();
}

Status LaunchMergeLse(float* o_a, float* lse_a, const float* o_b, const float* lse_b,
                      int64_t rows, int head_dim, void* out, DType out_dtype,
                      cudaStream_t stream) {
  KVF_CHECK_ARG(rows >= 0 && head_dim > 0, "MergeLse: bad shape ", rows, " x ", head_dim);
  if (rows == 0) return Status::Ok();
  KVF_CHECK_ARG(o_a != nullptr && lse_a != nullptr, "MergeLse: null o_a/lse_a");
  MergeLseKernel<<<RowGrid(rows), kRowThreads, 0, stream>>>(o_a, lse_a, o_b, lse_b, rows, head_dim,
                                                            out, out_dtype);
  KVF_CUDA_CHECK_LAUNCH(MergeLseKernel);
  return Status::Ok();
}

namespace {

// One thread polls the word over PCIe (a volatile load each time, a microsecond apart) until it
// reaches value, or the timeout passes (globaltimer, ns): then word[1] = 1 for the host to find.
__global__ void WaitHostValueKernel(volatile uint32_t* word, uint32_t value, uint64_t timeout_ns) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (static_cast<int32_t>(word[0] - value) < 0) {
    __nanosleep(1000);
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > timeout_ns) {
      word[1] = 1;
      return;
    }
  }
  __threadfence_system();
}

}  // namespace

Status LaunchWaitHostValue(const uint32_t* word, uint32_t value, int timeout_s, cudaStream_t stream) {
  KVF_CHECK_ARG(word != nullptr, "WaitHostValue: null word");
  WaitHostValueKernel<<<1, 1, 0, stream>>>(const_cast<uint32_t*>(word), value,
                                           static_cast<uint64_t>(timeout_s) * 1000000000ull);
  KVF_CUDA_CHECK_LAUNCH(WaitHostValueKernel);
  return Status::Ok();
}

namespace {

/// scores row r at scores + r * ld (n valid); out row r at out + r * k; ws: [rows, sort_n] when
/// sort_n > kTopKSmemItems. sort_n = pow2 >= k.
__global__ void __launch_bounds__(kTopKThreads) TopKKernel(const float* __restrict__ scores,
                                                           int64_t n, int64_t ld, int k,
                                                           int sort_n, int32_t* __restrict__ out,
                                                           unsigned long long* ws) {
  extern __shared__ unsigned long long sort_smem[];
  unsigned long long* sel =
      sort_n <= kTopKSmemItems ? sort_smem : ws + static_cast<int64_t>(blockIdx.x) * sort_n;
  TopKSelect(scores + static_cast<int64_t>(blockIdx.x) * ld, n, k, sort_n, sel);
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    out[static_cast<int64_t>(blockIdx.x) * k + i] = static_cast<int32_t>(sel[i] & 0xffffffffu);
  }
}

}  // namespace

size_t TopKWorkspaceBytes(int64_t rows, int64_t k) {
  const int64_t sort_n = NextPow2(std::max<int64_t>(k, 1));
  if (sort_n <= kTopKSmemItems) return 0;
  return static_cast<size_t>(rows) * sort_n * sizeof(unsigned long long);
}

Status LaunchTopK(const float* scores, int64_t n, int64_t ld, int64_t rows, int64_t k,
                  int32_t* out, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  KVF_CHECK_ARG(n >= 0 && rows >= 0 && k >= 0 && ld >= n, "TopK: bad shape n=", n, " ld=", ld,
                " rows=", rows, " k=", k);
  KVF_CHECK_ARG(n < (int64_t{1} << 31), "TopK: n=", n, " exceeds int32 indices");
  k = std::min(k, n);
  if (rows == 0 || k == 0) return Status::Ok();
  KVF_CHECK_ARG(rows <= 0x7fffffff, "TopK: too many rows ", rows);
  const int64_t sort_n = NextPow2(k);
  const size_t need = TopKWorkspaceBytes(rows, k);
  KVF_CHECK_ARG(workspace_bytes >= need, "TopK: workspace of ", workspace_bytes, " bytes < ", need,
                " needed for k=", k);
  const size_t smem = sort_n <= kTopKSmemItems ? sort_n * sizeof(unsigned long long) : 0;
  TopKKernel<<<static_cast<unsigned>(rows), kTopKThreads, smem, stream>>>(
      scores, n, ld, static_cast<int>(k), static_cast<int>(sort_n), out,
      static_cast<unsigned long long*>(workspace));
  KVF_CUDA_CHECK_LAUNCH(TopKKernel);
  return Status::Ok();
}

}  // namespace kvferry::cuda
