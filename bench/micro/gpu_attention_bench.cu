// Copyright kvferry authors. Apache-2.0.
// Kernel micro-benchmark on the GPU: dense decode attention (AttendPaged, num_q = 1) at the
// Llama-3.1-8B shape (32 q / 8 KV heads, head_dim 128, bf16) for 8K-128K tokens and batch 1 / 8;
// sparse attention over 2048 selected rows per KV head read from device memory vs zero-copy from
// pinned host memory; and the transfer probe (H2D/D2H/D2D, zero-copy and batched gathers).
// Prints a table and writes JSON (argv[1], default bench/results/gpu_attention.json). Compare
// the dense rows with scripts/device/torch_sdpa.py on the same shapes.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "bench/lib/check.h"
#include "gpu/cuda_device.h"
#include "offload/transfer.h"

using namespace kvferry;

namespace {

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kGroup = kQHeads / kKvHeads;
constexpr int kPageTokens = 256;

template <typename Fn>
float MedianMs(cudaStream_t s, int reps, Fn&& fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int r = 0; r < reps + 3; ++r) {
    cudaEventRecord(a, s);
    fn(r);
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float t;
    cudaEventElapsedTime(&t, a, b);
    if (r >= 3) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void FillRandomBf16(void* dst, size_t elems, uint64_t seed, cudaStream_t s) {
  std::vector<uint16_t> h(std::min<size_t>(elems, size_t{1} << 24));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : h) {
    float f = nd(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x = static_cast<uint16_t>(bits >> 16);
  }
  for (size_t off = 0; off < elems; off += h.size()) {
    const size_t n = std::min(h.size(), elems - off);
    cudaMemcpyAsync(static_cast<uint16_t*>(dst) + off, h.data(), n * 2, cudaMemcpyDefault, s);
    cudaStreamSynchronize(s);
  }
}

void FillRandomF32(float* dst, size_t n, uint64_t seed, cudaStream_t s) {
  std::vector<float> h(n);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : h) x = nd(rng);
  cudaMemcpyAsync(dst, h.data(), n * 4, cudaMemcpyDefault, s);
  cudaStreamSynchronize(s);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "bench/results/gpu_attention.json";
  auto dev_r = cuda::CudaDevice::Create(0);
  BENCH_CHECK(dev_r.status());
  auto dev = std::move(dev_r).value();
  cudaStream_t s = static_cast<cudaStream_t>(dev->default_stream());
  std::printf("device: %s\n", dev->name().c_str());
  std::string json = "{\"device\": \"" + dev->name() + "\", \"dense\": [";

  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHeadDim;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(128.0f);
  const size_t row_bytes = kHeadDim * 2;
  const size_t page_bytes = 2 * kPageTokens * row_bytes;

  // ---- dense decode ----
  std::printf("\n%-6s %-8s %10s %10s\n", "batch", "ctx", "us", "HBM GB/s");
  bool first = true;
  for (int batch : {1, 8}) {
    for (int64_t ctx : {8192, 16384, 32768, 65536, 131072}) {
      const int64_t pages_per_head = ctx / kPageTokens;
      const int64_t items = static_cast<int64_t>(batch) * kKvHeads;
      const size_t kv_bytes = items * pages_per_head * page_bytes;
      // Rotate between copies so that the working set exceeds L2 (50 MB) for small shapes.
      const int copies = static_cast<int>(std::clamp<size_t>((size_t{256} << 20) / kv_bytes, 1, 8));
      void* kv = dev->AllocDevice(kv_bytes * copies).value();
      FillRandomBf16(kv, kv_bytes * copies / 2, ctx + batch, s);
      std::vector<void*> page_ptrs(copies * items * pages_per_head);
      for (size_t i = 0; i < page_ptrs.size(); ++i) page_ptrs[i] = static_cast<char*>(kv) + i * page_bytes;
      void* pt = dev->AllocDevice(page_ptrs.size() * 8).value();
      BENCH_CHECK(dev->CopyAsync(pt, page_ptrs.data(), page_ptrs.size() * 8, s));
      const size_t q_floats = items * kGroup * kHeadDim;
      float* q = static_cast<float*>(dev->AllocDevice(q_floats * 4).value());
      float* o = static_cast<float*>(dev->AllocDevice(q_floats * 4).value());
      float* lse = static_cast<float*>(dev->AllocDevice(items * kGroup * 4).value());
      FillRandomF32(q, q_floats, 5, s);
      std::vector<PagedAttnItem> h_items(copies * items);
      for (int c = 0; c < copies; ++c) {
        for (int64_t i = 0; i < items; ++i) {
          auto& it = h_items[c * items + i];
          it.q = q + i * kGroup * kHeadDim;
          it.o = o + i * kGroup * kHeadDim;
          it.lse = lse + i * kGroup;
          it.kv = KvPages{static_cast<void* const*>(pt) + (c * items + i) * pages_per_head, kPageTokens};
          it.q_pos0 = ctx - 1;
          it.num_q = 1;
        }
      }
      auto* d_items = static_cast<PagedAttnItem*>(dev->AllocDevice(h_items.size() * sizeof(PagedAttnItem)).value());
      BENCH_CHECK(dev->CopyAsync(d_items, h_items.data(), h_items.size() * sizeof(PagedAttnItem), s));
      BENCH_CHECK(dev->SynchronizeStream(s));
      const float ms = MedianMs(s, 50, [&](int r) {
        BENCH_CHECK(dev->AttendPaged(p, d_items + (r % copies) * items, items, s));
      });
      const double gbps = static_cast<double>(kv_bytes) / (ms * 1e-3) / 1e9;
      std::printf("%-6d %-8lld %10.1f %10.0f\n", batch, static_cast<long long>(ctx), ms * 1e3, gbps);
      char buf[256];
      std::snprintf(buf, sizeof(buf), "%s{\"batch\": %d, \"ctx\": %lld, \"us\": %.2f, \"hbm_gbps\": %.1f}",
                    first ? "" : ", ", batch, static_cast<long long>(ctx), ms * 1e3, gbps);
      json += buf;
      first = false;
      for (void* ptr : {static_cast<void*>(d_items), static_cast<void*>(q), static_cast<void*>(o),
                        static_cast<void*>(lse), pt, kv}) {
        dev->FreeDevice(ptr);
      }
    }
  }
  json += "], \"sparse\": [";

  // ---- sparse rows: 2048 random rows of a 128K context per KV head, device vs host ----
  std::printf("\n%-6s %-6s %10s %10s\n", "batch", "rows", "dev GB/s", "zc GB/s");
  first = true;
  for (int batch : {1, 8}) {
    const int64_t ctx = 131072, sel = 2048, items = static_cast<int64_t>(batch) * kKvHeads;
    const size_t bytes = items * ctx * 2 * row_bytes;
    double gbps[2];
    for (int host = 0; host < 2; ++host) {
      void* kv = host ? dev->AllocHost(bytes).value() : dev->AllocDevice(bytes).value();
      FillRandomBf16(kv, bytes / 2, 9, s);
      std::mt19937 rng(1);
      std::vector<const void*> rows(items * sel * 2);
      for (int64_t i = 0; i < items; ++i) {
        for (int64_t j = 0; j < sel; ++j) {
          const int64_t pos = rng() % ctx;
          const char* base = static_cast<char*>(kv) + (i * ctx + pos) * 2 * row_bytes;
          rows[(i * 2) * sel + j] = base;
          rows[(i * 2 + 1) * sel + j] = base + row_bytes;
        }
      }
      void* d_rows = dev->AllocDevice(rows.size() * 8).value();
      BENCH_CHECK(dev->CopyAsync(d_rows, rows.data(), rows.size() * 8, s));
      const size_t q_floats = items * kGroup * kHeadDim;
      float* q = static_cast<float*>(dev->AllocDevice(q_floats * 4).value());
      float* o = static_cast<float*>(dev->AllocDevice(q_floats * 4).value());
      float* lse = static_cast<float*>(dev->AllocDevice(items * kGroup * 4).value());
      FillRandomF32(q, q_floats, 5, s);
      std::vector<RowAttnItem> h_items(items);
      for (int64_t i = 0; i < items; ++i) {
        h_items[i] = RowAttnItem{q + i * kGroup * kHeadDim, o + i * kGroup * kHeadDim, lse + i * kGroup,
                                 static_cast<const void* const*>(d_rows) + (i * 2) * sel,
                                 static_cast<const void* const*>(d_rows) + (i * 2 + 1) * sel,
                                 static_cast<int32_t>(sel)};
      }
      auto* d_items = static_cast<RowAttnItem*>(dev->AllocDevice(items * sizeof(RowAttnItem)).value());
      BENCH_CHECK(dev->CopyAsync(d_items, h_items.data(), items * sizeof(RowAttnItem), s));
      BENCH_CHECK(dev->SynchronizeStream(s));
      const float ms = MedianMs(s, 50, [&](int) { BENCH_CHECK(dev->AttendRows(p, d_items, items, s)); });
      gbps[host] = static_cast<double>(items * sel * 2 * row_bytes) / (ms * 1e-3) / 1e9;
      for (void* ptr : {static_cast<void*>(d_items), static_cast<void*>(q), static_cast<void*>(o),
                        static_cast<void*>(lse), d_rows}) {
        dev->FreeDevice(ptr);
      }
      host ? dev->FreeHost(kv) : dev->FreeDevice(kv);
    }
    std::printf("%-6d %-6d %10.0f %10.1f\n", batch, 2048, gbps[0], gbps[1]);
    char buf[256];
    std::snprintf(buf, sizeof(buf), "%s{\"batch\": %d, \"rows_per_head\": 2048, \"device_gbps\": %.1f, \"zero_copy_gbps\": %.1f}",
                  first ? "" : ", ", batch, gbps[0], gbps[1]);
    json += buf;
    first = false;
  }
  json += "]";

  // ---- transfer probe ----
  auto te = TransferEngine::Create(dev.get(), 1 << 20);
  BENCH_CHECK(te.status());
  for (int row : {64, 256, 1024}) {
    auto pr = te.value()->Probe(size_t{256} << 20, row);
    BENCH_CHECK(pr.status());
    std::printf("\nprobe row %4d B: H2D %.1f D2H %.1f D2D %.0f GB/s | zero-copy gather %.1f, batched %.1f GB/s (vs 52)\n",
                row, pr->h2d_gbps, pr->d2h_gbps, pr->d2d_gbps, pr->zero_copy_gather_gbps,
                pr->batched_copy_gbps);
    json += ", \"probe_row" + std::to_string(row) + "\": " + pr->ToJson();
  }
  json += "}\n";
  std::ofstream(out_path) << json;
  std::printf("\nwrote %s\n", out_path.c_str());
  return 0;
}
