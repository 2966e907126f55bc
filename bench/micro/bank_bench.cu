// Copyright kvferry authors. Apache-2.0.
// HiP's offload comparison on a decode stream with reuse: each (sequence, KV head) selects k rows
// of a long context; between steps most of the selection persists and a fraction churns to new
// random positions. Four ways to serve the selected rows to the sparse attention kernel:
//   all_gpu  every row in device memory (the ceiling),
//   vector   token bank with the vector map; misses read zero-copy from the pinned host store,
//   hash     the same with the hash map,
//   none     no bank: every row read zero-copy from the host store.
// A step = plan on the host (build row-address lists; resolve through the bank), one H2D copy of
// the lists, the attention kernel, then (bank modes) admission of the misses on a side stream.
// Reports the median step time, ratio to all_gpu, bank hit rate and page-table bytes, as a table
// and JSON (argv[1], default bench/results/bank.json).

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gpu/cuda_device.h"
#include "offload/token_bank.h"

using namespace kvferry;

#define BENCH_CHECK(expr)                                                                 \
  do {                                                                                    \
    auto s_ = (expr);                                                                     \
    if (!s_.ok()) {                                                                       \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.ToString().c_str());    \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

namespace {
constexpr int kKvHeads = 8, kGroup = 4, kHeadDim = 128;
constexpr size_t kRowBytes = kHeadDim * 2;
}  // namespace

int main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "bench/results/bank.json";
  auto dev_r = cuda::CudaDevice::Create(0);
  BENCH_CHECK(dev_r.status());
  auto dev = std::move(dev_r).value();
  cudaStream_t s = static_cast<cudaStream_t>(dev->default_stream());
  StreamHandle side = dev->CreateStream().value();
  EventHandle step_done = dev->CreateEvent().value();
  std::printf("device: %s\n", dev->name().c_str());

  const int64_t ctx = 131072, k = 2048;
  const double churn = 0.05;
  const int steps = 200, warmup = 30;
  std::string json = "{\"device\": \"" + dev->name() + "\", \"ctx\": 131072, \"k\": 2048, " +
                     "\"churn\": 0.05, \"runs\": [";
  std::printf("\n%-6s %-8s %10s %8s %9s %12s\n", "batch", "mode", "step us", "vs gpu", "hit rate",
              "map bytes");
  bool first = true;
  for (int batch : {1, 8}) {
    const int items = batch * kKvHeads;
    const size_t kv_bytes = static_cast<size_t>(items) * ctx * 2 * kRowBytes;
    // Host store and a device copy: row (item, pos) K at ((item * ctx + pos) * 2) * row, V next.
    char* host = static_cast<char*>(dev->AllocHost(kv_bytes).value());
    char* gpu = static_cast<char*>(dev->AllocDevice(kv_bytes).value());
    {
      std::mt19937 rng(1);
      std::normal_distribution<float> nd(0.f, 1.f);
      auto* h16 = reinterpret_cast<uint16_t*>(host);
      for (size_t i = 0; i < kv_bytes / 2; i += 97) {  // sparse fill is enough for timing
        float f = nd(rng);
        uint32_t b;
        std::memcpy(&b, &f, 4);
        for (size_t j = i; j < std::min(i + 97, kv_bytes / 2); ++j) h16[j] = static_cast<uint16_t>(b >> 16);
      }
      BENCH_CHECK(dev->CopyAsync(gpu, host, kv_bytes, s));
    }
    const size_t q_floats = static_cast<size_t>(items) * kGroup * kHeadDim;
    float* q = static_cast<float*>(dev->AllocDevice(q_floats * 4).value());
    float* o = static_cast<float*>(dev->AllocDevice(q_floats * 4).value());
    float* lse = static_cast<float*>(dev->AllocDevice(items * kGroup * 4).value());
    {
      std::vector<float> qh(q_floats);
      std::mt19937 rng(2);
      std::normal_distribution<float> nd(0.f, 1.f);
      for (auto& x : qh) x = nd(rng);
      BENCH_CHECK(dev->CopyAsync(q, qh.data(), q_floats * 4, s));
      BENCH_CHECK(dev->SynchronizeStream(s));
    }
    // Plan buffers: row lists [items][2][k] in pinned memory, copied to device each step.
    const size_t list_bytes = static_cast<size_t>(items) * 2 * k * sizeof(void*);
    auto** rows_h = static_cast<const void**>(dev->AllocHost(list_bytes).value());
    auto** rows_d = static_cast<const void**>(dev->AllocDevice(list_bytes).value());
    auto* items_h = static_cast<RowAttnItem*>(dev->AllocHost(items * sizeof(RowAttnItem)).value());
    AttnParams p;
    p.group = kGroup;
    p.head_dim = kHeadDim;
    p.kv_dtype = DType::kBF16;
    p.scale = 1.0f / std::sqrt(128.0f);
    for (int i = 0; i < items; ++i) {
      items_h[i] = RowAttnItem{q + i * kGroup * kHeadDim, o + i * kGroup * kHeadDim, lse + i * kGroup,
                               rows_d + (i * 2) * k, rows_d + (i * 2 + 1) * k, static_cast<int32_t>(k)};
    }
    double gpu_us = 0;
    for (const char* mode : {"all_gpu", "vector", "hash", "none"}) {
      const bool use_bank = !std::strcmp(mode, "vector") || !std::strcmp(mode, "hash");
      const char* base = !std::strcmp(mode, "all_gpu") ? gpu : host;
      std::unique_ptr<TokenBank> bank;
      if (use_bank) {
        TokenBankConfig c;
        c.max_sequences = batch;
        c.num_kv_heads = kKvHeads;
        c.slots = 2 * k;
        c.max_positions = ctx;
        c.head_dim = kHeadDim;
        c.map = !std::strcmp(mode, "vector") ? BankMapKind::kVector : BankMapKind::kHash;
        c.max_admit_per_table = static_cast<int>(k / 2);
        c.max_admit_rows = static_cast<int64_t>(items) * k / 2;
        auto r = TokenBank::Create(dev.get(), c);
        BENCH_CHECK(r.status());
        bank = std::move(r).value();
      }
      // Same selection stream for every mode.
      std::mt19937 rng(7);
      std::vector<std::vector<int32_t>> sel(items, std::vector<int32_t>(k));
      for (auto& v : sel) for (auto& x : v) x = static_cast<int32_t>(rng() % ctx);
      std::vector<int32_t> hits(k), misses(k);
      std::vector<const void*> mk(k), mv(k);
      std::vector<double> us;
      for (int step = 0; step < warmup + steps; ++step) {
        for (auto& v : sel) {
          for (int64_t c = 0; c < static_cast<int64_t>(churn * k); ++c) {
            v[rng() % k] = static_cast<int32_t>(rng() % ctx);
          }
        }
        if (step == warmup && bank) bank->ResetCounters();
        const auto t0 = std::chrono::steady_clock::now();
        if (bank) BENCH_CHECK(bank->WaitReady(s));
        std::vector<std::vector<int32_t>> step_misses(items);
        for (int i = 0; i < items; ++i) {
          const void** kl = rows_h + (i * 2) * k;
          const void** vl = rows_h + (i * 2 + 1) * k;
          const size_t item_base = static_cast<size_t>(i) * ctx * 2 * kRowBytes;
          if (bank) {
            const auto c = bank->Resolve(i, sel[i], kl, vl, nullptr, misses.data());
            for (int64_t j = 0; j < c.misses; ++j) {
              const char* r = base + item_base + static_cast<size_t>(misses[j]) * 2 * kRowBytes;
              kl[c.hits + j] = r;
              vl[c.hits + j] = r + kRowBytes;
            }
            step_misses[i].assign(misses.begin(), misses.begin() + c.misses);
          } else {
            for (int64_t j = 0; j < k; ++j) {
              const char* r = base + item_base + static_cast<size_t>(sel[i][j]) * 2 * kRowBytes;
              kl[j] = r;
              vl[j] = r + kRowBytes;
            }
          }
        }
        BENCH_CHECK(dev->CopyAsync(rows_d, rows_h, list_bytes, s));
        BENCH_CHECK(dev->AttendRows(p, items_h, items, s));
        if (bank) {
          BENCH_CHECK(dev->RecordEvent(step_done, s));
          BENCH_CHECK(bank->BeginAdmit(side, step_done));
          for (int i = 0; i < items; ++i) {
            const size_t item_base = static_cast<size_t>(i) * ctx * 2 * kRowBytes;
            const auto& m = step_misses[i];
            for (size_t j = 0; j < m.size(); ++j) {
              mk[j] = host + item_base + static_cast<size_t>(m[j]) * 2 * kRowBytes;
              mv[j] = static_cast<const char*>(mk[j]) + kRowBytes;
            }
            bank->Admit(i, m, mk.data(), mv.data());
          }
          BENCH_CHECK(bank->CommitAdmit());
        }
        BENCH_CHECK(dev->SynchronizeStream(s));  // the engine needs o before the next layer
        const auto t1 = std::chrono::steady_clock::now();
        if (step >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      BENCH_CHECK(dev->SynchronizeStream(side));
      std::sort(us.begin(), us.end());
      const double med = us[us.size() / 2];
      if (!std::strcmp(mode, "all_gpu")) gpu_us = med;
      const double hit = bank ? bank->counters().hit_rate() : 0.0;
      const size_t map_bytes = bank ? bank->map_bytes() : 0;
      std::printf("%-6d %-8s %10.1f %8.3f %9.3f %12zu\n", batch, mode, med, gpu_us / med, hit, map_bytes);
      char buf[320];
      std::snprintf(buf, sizeof(buf),
                    "%s{\"batch\": %d, \"mode\": \"%s\", \"step_us\": %.2f, \"speed_vs_all_gpu\": %.4f, "
                    "\"hit_rate\": %.4f, \"map_bytes\": %zu, \"slot_meta_bytes\": %zu}",
                    first ? "" : ", ", batch, mode, med, gpu_us / med, hit, map_bytes,
                    bank ? bank->slot_meta_bytes() : size_t{0});
      json += buf;
      first = false;
    }
    dev->FreeHost(items_h);
    dev->FreeDevice(rows_d);
    dev->FreeHost(rows_h);
    for (void* ptr : {static_cast<void*>(q), static_cast<void*>(o), static_cast<void*>(lse)}) dev->FreeDevice(ptr);
    dev->FreeDevice(gpu);
    dev->FreeHost(host);
  }
  json += "]}\n";
  std::ofstream(out_path) << json;
  std::printf("\nwrote %s\n", out_path.c_str());
  dev->DestroyEvent(step_done);
  dev->DestroyStream(side);
  return 0;
}
