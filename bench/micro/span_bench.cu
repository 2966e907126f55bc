// Copyright kvferry authors. Apache-2.0.
// How the rate of token-granular gathers from pinned host memory depends on the span of host
// memory the rows lie in. For each span (a prefix of one 16 GiB pinned block) and each gather size
// (rows per call, as one layer's bank misses at batch 1 and batch 8), random 512 B rows (one K|V
// row pair at head_dim 128, bf16) are moved to the GPU:
//   zero_copy   the row-copy kernel (CudaDevice::CopyRows, TransferEngine::GatherZeroCopy's path)
//               reads them straight from pinned memory over PCIe;
//   h2d         one copy-engine copy of a compact pinned block of the same bytes (cudaMemcpyAsync);
// and the contiguous H2D copy of the same bytes out of the span is the PCIe ceiling. Table + JSON
// (argv[1], default bench/results/transfer_span.json).
// Usage: span_bench [out.json] [--max-gib G (default 16)] [--reps N (default 100)]

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/lib/check.h"
#include "gpu/cuda_device.h"

using namespace kvferry;

int main(int argc, char** argv) {
  std::string out_path = "bench/results/transfer_span.json";
  int max_gib = 16, reps = 100;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--max-gib") && i + 1 < argc) {
      max_gib = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      out_path = argv[i];
    }
  }
  auto dev = cuda::CudaDevice::Create(0).value();
  StreamHandle s = dev->CreateStream().value();
  constexpr size_t kRow = 512;
  const size_t total = static_cast<size_t>(max_gib) << 30;
  char* host = static_cast<char*>(dev->AllocHost(total).value());
  {
    std::vector<std::thread> fill;
    for (int t = 0; t < 16; ++t) {
      fill.emplace_back([&, t] { std::memset(host + total / 16 * t, t + 1, total / 16); });
    }
    for (auto& t : fill) t.join();
  }
  const int64_t max_rows = 12800;
  char* stage_h = static_cast<char*>(dev->AllocHost(max_rows * kRow).value());
  char* dst = static_cast<char*>(dev->AllocDevice(max_rows * kRow).value());
  auto* rows_d = static_cast<RowCopy*>(dev->AllocDevice(max_rows * reps * sizeof(RowCopy)).value());
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  auto gpu_us = [&](auto&& fn) {
    CUDA_OK(cudaEventRecord(e0, static_cast<cudaStream_t>(s)));
    for (int r = 0; r < reps; ++r) fn(r);
    CUDA_OK(cudaEventRecord(e1, static_cast<cudaStream_t>(s)));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    return ms * 1e3 / reps;
  };
  std::printf("device: %s\n", dev->name().c_str());
  std::printf("%10s %8s %14s %14s %14s\n", "span MiB", "rows", "zero_copy GB/s", "h2d GB/s",
              "contig GB/s");
  std::string json = "{\"device\": \"" + dev->name() + "\", \"row_bytes\": 512, \"runs\": [";
  bool first = true;
  std::mt19937_64 rng(1);
  for (size_t span = size_t{256} << 20; span <= total; span *= 4) {
    for (int64_t n : {int64_t{1600}, max_rows}) {
      std::vector<RowCopy> rows_h(static_cast<size_t>(n) * reps);
      for (int r = 0; r < reps; ++r) {
        for (int64_t i = 0; i < n; ++i) {
          rows_h[r * n + i] = RowCopy{dst + i * kRow, host + (rng() % (span / kRow)) * kRow};
        }
      }
      BENCH_CHECK(dev->CopyAsync(rows_d, rows_h.data(), rows_h.size() * sizeof(RowCopy), s));
      BENCH_CHECK(dev->CopyRows(rows_d, n, kRow / 2, DType::kBF16, DType::kBF16, s));  // warm
      const double zc = gpu_us([&](int r) {
        BENCH_CHECK(dev->CopyRows(rows_d + static_cast<size_t>(r) * n, n, kRow / 2, DType::kBF16,
                                  DType::kBF16, s));
      });
      const double h2d = gpu_us([&](int) { BENCH_CHECK(dev->CopyAsync(dst, stage_h, n * kRow, s)); });
      const double contig = gpu_us([&](int r) {
        BENCH_CHECK(dev->CopyAsync(dst, host + (static_cast<size_t>(r) * n * kRow) % (span - n * kRow),
                                   n * kRow, s));
      });
      const double mb = n * kRow / 1e3;  // bytes / 1e3 / us = GB/s
      std::printf("%10zu %8lld %14.1f %14.1f %14.1f\n", span >> 20, static_cast<long long>(n),
                  mb / zc, mb / h2d, mb / contig);
      char buf[512];
      std::snprintf(buf, sizeof(buf),
                    "%s{\"span_bytes\": %zu, \"rows\": %lld, \"zero_copy_us\": %.2f, "
                    "\"zero_copy_gbps\": %.2f, \"h2d_compact_us\": %.2f, \"h2d_compact_gbps\": %.2f, "
                    "\"h2d_contig_gbps\": %.2f}",
                    first ? "" : ", ", span, static_cast<long long>(n), zc, mb / zc, h2d, mb / h2d,
                    mb / contig);
      json += buf;
      first = false;
    }
  }
  json += "]}\n";
  std::ofstream(out_path) << json;
  std::printf("wrote %s\n", out_path.c_str());
  CUDA_OK(cudaEventDestroy(e0));
  CUDA_OK(cudaEventDestroy(e1));
  dev->FreeDevice(rows_d);
  dev->FreeDevice(dst);
  dev->FreeHost(stage_h);
  dev->FreeHost(host);
  dev->DestroyStream(s);
  return 0;
}
