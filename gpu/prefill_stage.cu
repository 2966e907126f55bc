// Copyright kvferry authors. Apache-2.0.
// Staging for the CUDA prefill (PrefillStageArgs): one kernel writes a chunk's K/V through to the
// host store, into the resident tier and into the device staging the tensor-core prefill kernel
// reads (the host store's page layout, so that the runtime can also copy whole pages into it);
// another brings earlier positions from the host store into the same staging (zero-copy reads
// through the device page table). Nothing is built on the host per row.

#include <algorithm>

#include "gpu/convert.cuh"
#include "gpu/cuda_check.h"
#include "gpu/cuda_kernels.h"
#include "base/check.h"

namespace kvferry::cuda {
namespace {

constexpr int kStageThreads = 256;

// One thread per 8 elements of a row: (token t, head h, K or V, 8-element chunk c).
__global__ void __launch_bounds__(kStageThreads) StageChunkKernel(PrefillStageArgs a) {
  const int d = a.head_dim;
  const int chunks = d / 8;
  const int64_t units = a.tokens * a.num_kv_heads * 2 * chunks;
  const size_t elem = DTypeSize(a.kv_dtype);
  const size_t row_bytes = static_cast<size_t>(d) * elem;
  const int64_t rows_per_slot = static_cast<int64_t>(a.sink) + a.window;
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < units;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(u % chunks);
    int64_t r = u / chunks;
    const int which = static_cast<int>(r % 2);  // 0: K, 1: V
    r /= 2;
    const int h = static_cast<int>(r % a.num_kv_heads);
    const int64_t t = r / a.num_kv_heads;
    const int64_t pos = a.pos0 + t;
    const void* src = which == 0 ? a.k : a.v;
    const DType src_dtype = which == 0 ? a.k_dtype : a.v_dtype;
    const int64_t src_off = (t * a.num_kv_heads + h) * d + c * 8;
    alignas(16) char packed[16];
#pragma unroll
    for (int i = 0; i < 8; ++i) StoreElem(packed, a.kv_dtype, i, LoadElem(src, src_dtype, src_off + i));
    const uint4 val = *reinterpret_cast<const uint4*>(packed);
    const size_t col = static_cast<size_t>(c) * 8 * elem;
    // Host store (write-through), unless the caller's copy engines take it from the staging.
    const uint32_t pt = static_cast<uint32_t>(a.store.page_tokens);
    const size_t page_row = static_cast<size_t>(which) * pt + pos % pt;
    if (a.write_through) {
      const char* page = reinterpret_cast<const char*>(
          reinterpret_cast<const unsigned long long*>(a.store.pages)[h * a.store.max_pages + pos / pt]);
      *reinterpret_cast<uint4*>(const_cast<char*>(page) + page_row * row_bytes + col) = val;
    }
    // Resident tier: the sinks and the rows that end in the window.
    const int64_t row = ResidentRowOf(pos, a.new_len, a.sink, a.window);
    if (row >= 0) {
      char* res = a.resident + static_cast<size_t>(h * 2 + which) * rows_per_slot * row_bytes;
      *reinterpret_cast<uint4*>(res + row * row_bytes + col) = val;
    }
    // Staging for the prefill kernel: the same page layout.
    if (a.staging != nullptr) {
      const size_t staging_page = static_cast<size_t>(h) * (a.staging_cap / pt) + pos / pt;
      char* st = a.staging + (staging_page * 2 * pt + page_row) * row_bytes;
      *reinterpret_cast<uint4*>(st + col) = val;
    }
  }
}

// Earlier positions [history_begin, pos0) from the host store into the staging: 16-byte copies.
__global__ void __launch_bounds__(kStageThreads) StageHistoryKernel(PrefillStageArgs a) {
  const size_t row_bytes = static_cast<size_t>(a.head_dim) * DTypeSize(a.kv_dtype);
  const int chunks = static_cast<int>(row_bytes / 16);
  const int64_t n = a.pos0 - a.history_begin;
  const int64_t units = n * a.num_kv_heads * 2 * chunks;
  const uint32_t pt = static_cast<uint32_t>(a.store.page_tokens);
  const int64_t staging_pages = a.staging_cap / pt;
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < units;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(u % chunks);
    int64_t r = u / chunks;
    const int64_t pos = a.history_begin + r % n;  // consecutive threads walk positions
    r /= n;
    const int which = static_cast<int>(r % 2);
    const int h = static_cast<int>(r / 2);
    const size_t page_row = static_cast<size_t>(which) * pt + pos % pt;
    const char* page = reinterpret_cast<const char*>(
        reinterpret_cast<const unsigned long long*>(a.store.pages)[h * a.store.max_pages + pos / pt]);
    const uint4 val =
        *reinterpret_cast<const uint4*>(page + page_row * row_bytes + static_cast<size_t>(c) * 16);
    const size_t staging_page = static_cast<size_t>(h * staging_pages + pos / pt);
    char* st = a.staging + (staging_page * 2 * pt + page_row) * row_bytes;
    *reinterpret_cast<uint4*>(st + static_cast<size_t>(c) * 16) = val;
  }
}

__global__ void __launch_bounds__(kStageThreads) ConvertKernel(const void* src, DType src_dtype,
                                                               void* dst, DType dst_dtype, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    StoreElem(dst, dst_dtype, i, LoadElem(src, src_dtype, i));
  }
}

unsigned GridFor(int64_t units, int per_sm_blocks = 132 * 8) {
  const int64_t blocks = (units + kStageThreads - 1) / kStageThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, per_sm_blocks)));
}

}  // namespace

Status LaunchConvert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                     cudaStream_t stream) {
  if (n <= 0) return Status::Ok();
  ConvertKernel<<<GridFor(n), kStageThreads, 0, stream>>>(src, src_dtype, dst, dst_dtype, n);
  KVF_CUDA_CHECK_LAUNCH(ConvertKernel);
  return Status::Ok();
}

int PlanPrefillSegments(int64_t history_pages, int64_t chunk_tokens, int64_t page_tokens,
                        int64_t* begin) {
  // The chunk's causal block is chunk_tokens^2 / 2 query-key pairs: about as much attention as
  // chunk_tokens / 2 earlier positions.
  int64_t size = std::clamp<int64_t>(chunk_tokens / (2 * std::max<int64_t>(page_tokens, 1)),
                                     kPrefillSegmentMinPages, kPrefillSegmentMaxPages);
  int n = 0;
  int64_t b = 0;
  while (b < history_pages) {
    const int64_t next = std::min<int64_t>(kPrefillSegmentMaxPages, (size * 3 + 1) / 2);
    int64_t len = std::min(size, history_pages - b);
    const int64_t rest = history_pages - b - len;
    if (n == kPrefillMaxSegments - 1 || 2 * rest < next) len += rest;
    begin[n++] = b;
    b += len;
    size = next;
  }
  begin[n] = history_pages;
  return n;
}

int64_t ListPageCopies(void* const* host_pages, int64_t max_pages, int num_kv_heads,
                       int64_t page_begin, int64_t page_end, char* staging, int64_t staging_pages,
                       int64_t page_bytes, void** dst, const void** src, size_t* bytes) {
  int64_t n = 0;
  for (int h = 0; h < num_kv_heads; ++h) {
    for (int64_t p = page_begin; p < page_end; ++p) {
      const char* from = static_cast<const char*>(host_pages[h * max_pages + p]);
      char* to = staging + (h * staging_pages + p) * page_bytes;
      if (p > page_begin && static_cast<const char*>(src[n - 1]) + bytes[n - 1] == from &&
          static_cast<char*>(dst[n - 1]) + bytes[n - 1] == to) {
        bytes[n - 1] += static_cast<size_t>(page_bytes);
        continue;
      }
      dst[n] = to;
      src[n] = from;
      bytes[n] = static_cast<size_t>(page_bytes);
      ++n;
    }
  }
  return n;
}

int64_t ListWriteThroughCopies(const PrefillStageArgs& a, void* const* host_pages, int64_t staging_pages,
                               void** dst, const void** src, size_t* bytes) {
  const int64_t pt = a.store.page_tokens;
  const size_t row_b = static_cast<size_t>(a.head_dim) * DTypeSize(a.kv_dtype);
  int64_t n = 0;
  for (int h = 0; h < a.num_kv_heads; ++h) {
    for (int64_t p = a.pos0 / pt; p * pt < a.new_len; ++p) {
      const int64_t r0 = std::max(a.pos0, p * pt) - p * pt;
      const int64_t r1 = std::min(a.new_len, (p + 1) * pt) - p * pt;
      char* host = static_cast<char*>(host_pages[h * a.store.max_pages + p]);
      const char* dev = a.staging + static_cast<size_t>((h * staging_pages + p) * 2 * pt) * row_b;
      for (int kv = 0; kv < 2; ++kv) {  // the page's K rows, then its V rows
        dst[n] = host + static_cast<size_t>(kv * pt + r0) * row_b;
        src[n] = dev + static_cast<size_t>(kv * pt + r0) * row_b;
        bytes[n] = static_cast<size_t>(r1 - r0) * row_b;
        ++n;
      }
    }
  }
  return n;
}

Status LaunchPrefillStage(const PrefillStageArgs& a, cudaStream_t stream) {
  KVF_CHECK_ARG(a.head_dim % 8 == 0 && a.tokens >= 0 && a.pos0 >= 0 && a.history_begin >= 0 &&
                    a.history_begin <= a.pos0,
                "prefill stage: head_dim ", a.head_dim, " or sizes out of range");
  KVF_CHECK_ARG(a.staging == nullptr || (a.store.page_tokens > 0 && a.staging_cap % a.store.page_tokens == 0),
                "prefill stage: staging of ", a.staging_cap, " rows is not whole pages of ",
                a.store.page_tokens);
  KVF_CHECK_ARG(a.store.pages != nullptr && a.resident != nullptr, "prefill stage: null page table or tier");
  KVF_CHECK_ARG(a.write_through || a.staging != nullptr,
                "prefill stage: the write-through left to the caller needs the staging");
  if (a.tokens > 0) {
    const int64_t units = a.tokens * a.num_kv_heads * 2 * (a.head_dim / 8);
    StageChunkKernel<<<GridFor(units), kStageThreads, 0, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(StageChunkKernel);
  }
  if (a.staging != nullptr && a.pos0 > a.history_begin) {
    const int64_t units = (a.pos0 - a.history_begin) * a.num_kv_heads * 2 *
                          (a.head_dim * static_cast<int64_t>(DTypeSize(a.kv_dtype)) / 16);
    StageHistoryKernel<<<GridFor(units), kStageThreads, 0, stream>>>(a);
    KVF_CUDA_CHECK_LAUNCH(StageHistoryKernel);
  }
  return Status::Ok();
}

}  // namespace kvferry::cuda
