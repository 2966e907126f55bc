// Copyright kvferry authors. Apache-2.0.
// HiP's offload comparison on a decode stream with reuse: each (sequence, KV head) selects k rows
// of a long context; between steps most of the selection persists and a fraction churns to new
// random positions. Ways to serve the selected rows, all through the same position-list kernel
// (cuda::LaunchAttendBank: the host sends positions only; item descriptors in device memory):
//   all_gpu      every row in device memory (the ceiling; one kDirect launch),
//   vector       token bank with the vector map, looked up on the GPU: a kHits launch (bank rows,
//                HBM) and a kMisses launch on a second stream (pinned host store, zero-copy, also
//                staging the rows in device memory), merged by lse. Admission of step t's misses
//                (host bookkeeping, then device-to-device copies + page-table updates on a side
//                stream) overlaps step t + 1's kernels, so rows are banked one step later,
//   hash         the same with the hash map,
//   vector_sync, hash_sync   admission after the step's sync (banked for the next step),
//   none         no bank: every row read zero-copy from the host store (one kDirectZeroCopy
//   launch).
// A step = positions H2D, the launches, the step's sync (the engine needs o), admission. Reports
// the median step time, GPU time (events), host enqueue and admission time, the ratio to all_gpu,
// hit rate and page-table bytes (host tables, device copies + reference bitmaps), plus the largest
// |o - o_all_gpu| of the last step; table + JSON (argv[1], default bench/results/bank.json).

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

#define BENCH_CHECK(expr)                                                             \
  do {                                                                                \
    auto s_ = (expr);                                                                 \
    if (!s_.ok()) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace {
constexpr int kKvHeads = 8, kGroup = 4, kHeadDim = 128;
constexpr size_t kRowBytes = kHeadDim * 2;
constexpr int kMissCap = 256;  // misses reported (and admitted) per table per step
}  // namespace

int main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "bench/results/bank.json";
  auto dev_r = cuda::CudaDevice::Create(0);
  BENCH_CHECK(dev_r.status());
  auto dev = std::move(dev_r).value();
  cudaStream_t s = static_cast<cudaStream_t>(dev->default_stream());
  StreamHandle side = dev->CreateStream().value();
  StreamHandle miss_stream = dev->CreateStream().value();
  EventHandle step_done = dev->CreateEvent().value();
  EventHandle fork = dev->CreateEvent().value();
  EventHandle join = dev->CreateEvent().value();
  cudaEvent_t ga, gb;
  cudaEventCreate(&ga);
  cudaEventCreate(&gb);
  std::printf("device: %s\n", dev->name().c_str());

  const int64_t ctx = 131072, k = 2048;
  const double churn = 0.05;
  const int steps = 200, warmup = 30;
  std::string json = "{\"device\": \"" + dev->name() + "\", \"ctx\": 131072, \"k\": 2048, " +
                     "\"churn\": 0.05, \"slots\": 4096, \"runs\": [";
  std::printf("\n%-6s %-8s %10s %10s %8s %8s %8s %9s %12s %12s %10s\n", "batch", "mode", "step us",
              "gpu us", "enq us", "admit us", "vs gpu", "hit rate", "host map B", "dev map B",
              "max|do|");
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
        for (size_t j = i; j < std::min(i + 97, kv_bytes / 2); ++j)
          h16[j] = static_cast<uint16_t>(b >> 16);
      }
      BENCH_CHECK(dev->CopyAsync(gpu, host, kv_bytes, s));
    }
    const size_t q_floats = static_cast<size_t>(items) * kGroup * kHeadDim;
    float* q = static_cast<float*>(dev->AllocDevice(q_floats * 4).value());
    float* o = static_cast<float*>(dev->AllocDevice(q_floats * 4).value());
    float* lse = static_cast<float*>(dev->AllocDevice(items * kGroup * 4).value());
    float* o_b = static_cast<float*>(dev->AllocDevice(q_floats * 4).value());
    float* lse_b = static_cast<float*>(dev->AllocDevice(items * kGroup * 4).value());
    {
      std::vector<float> qh(q_floats);
      std::mt19937 rng(2);
      std::normal_distribution<float> nd(0.f, 1.f);
      for (auto& x : qh) x = nd(rng);
      BENCH_CHECK(dev->CopyAsync(q, qh.data(), q_floats * 4, s));
      BENCH_CHECK(dev->SynchronizeStream(s));
    }
    // Per step: positions [items][k] H2D; miss lists [items][1 + cap] D2H; staged rows. Positions,
    // miss lists and staging are double-buffered by step parity: admission of step t's misses may
    // run after step t + 1's kernels (overlapped modes).
    const size_t pos_bytes = static_cast<size_t>(items) * k * sizeof(int32_t);
    const size_t miss_bytes = static_cast<size_t>(items) * (1 + kMissCap) * sizeof(int32_t);
    const size_t stage_bytes = static_cast<size_t>(items) * k * 2 * kRowBytes;
    auto* pos_d = static_cast<int32_t*>(dev->AllocDevice(pos_bytes).value());
    int32_t* pos_h[2];
    int32_t* miss_h[2];
    int32_t* miss_d[2];
    char* stage[2];
    cuda::BankAttnItem* miss_items[2];
    for (int b = 0; b < 2; ++b) {
      pos_h[b] = static_cast<int32_t*>(dev->AllocHost(pos_bytes).value());
      miss_h[b] = static_cast<int32_t*>(dev->AllocHost(miss_bytes).value());
      miss_d[b] = static_cast<int32_t*>(dev->AllocDevice(miss_bytes).value());
      stage[b] = static_cast<char*>(dev->AllocDevice(stage_bytes).value());
      miss_items[b] = static_cast<cuda::BankAttnItem*>(
          dev->AllocDevice(items * sizeof(cuda::BankAttnItem)).value());
    }
    // Item descriptors live in device memory (written once per mode).
    auto* hit_items = static_cast<cuda::BankAttnItem*>(
        dev->AllocDevice(items * sizeof(cuda::BankAttnItem)).value());
    std::vector<cuda::BankAttnItem> hit_h(items), miss_hh(items);
    AttnParams p;
    p.group = kGroup;
    p.head_dim = kHeadDim;
    p.kv_dtype = DType::kBF16;
    p.scale = 1.0f / std::sqrt(128.0f);
    double gpu_us = 0;
    std::vector<float> o_ref(q_floats), o_mode(q_floats);
    for (const char* mode : {"all_gpu", "vector", "hash", "vector_sync", "hash_sync", "none"}) {
      const bool vector_map = !std::strncmp(mode, "vector", 6);
      const bool use_bank = vector_map || !std::strncmp(mode, "hash", 4);
      // Overlapped: step t's admission bookkeeping runs on the host while step t + 1's kernels run
      // (its copies are ordered after them on the side stream); _sync: after step t's sync.
      const bool overlap = use_bank && std::strstr(mode, "_sync") == nullptr;
      const char* store = !std::strcmp(mode, "all_gpu") ? gpu : host;
      std::unique_ptr<TokenBank> bank;
      if (use_bank) {
        TokenBankConfig c;
        c.max_sequences = batch;
        c.num_kv_heads = kKvHeads;
        c.slots = 2 * k;
        c.max_positions = ctx;
        c.head_dim = kHeadDim;
        c.map = vector_map ? BankMapKind::kVector : BankMapKind::kHash;
        c.max_admit_per_table = static_cast<int>(k / 2);
        c.max_admit_rows = static_cast<int64_t>(items) * kMissCap;
        c.device_map = true;
        auto r = TokenBank::Create(dev.get(), c);
        BENCH_CHECK(r.status());
        bank = std::move(r).value();
      }
      for (int b = 0; b < 2; ++b) {
        for (int i = 0; i < items; ++i) {
          cuda::BankAttnItem it;
          it.q = q + i * kGroup * kHeadDim;
          it.o = o + i * kGroup * kHeadDim;
          it.lse = lse + i * kGroup;
          it.positions = pos_d + static_cast<size_t>(i) * k;
          it.count = static_cast<int32_t>(k);
          it.store = store + static_cast<size_t>(i) * ctx * 2 * kRowBytes;
          it.store_stride = 2 * kRowBytes;
          if (bank) {
            const auto t = bank->device_table(i);
            it.vector_map = t.vector_map;
            it.vector_len = t.vector_len;
            it.hash_map = t.hash_map;
            it.hash_log2 = t.hash_log2;
            it.bank_rows = t.bank_rows;
            it.ref_bits = t.ref_bits;
          }
          hit_h[i] = it;
          it.o = o_b + i * kGroup * kHeadDim;
          it.lse = lse_b + i * kGroup;
          it.ref_bits = nullptr;
          it.stage = stage[b] + static_cast<size_t>(i) * k * 2 * kRowBytes;
          it.miss_list = miss_d[b] + static_cast<size_t>(i) * (1 + kMissCap);
          it.miss_cap = kMissCap;
          miss_hh[i] = it;
        }
        BENCH_CHECK(
            dev->CopyAsync(miss_items[b], miss_hh.data(), items * sizeof(cuda::BankAttnItem), s));
      }
      BENCH_CHECK(dev->CopyAsync(hit_items, hit_h.data(), items * sizeof(cuda::BankAttnItem), s));
      BENCH_CHECK(dev->SynchronizeStream(s));
      std::vector<int32_t> mpos(kMissCap);
      std::vector<const void*> mk(kMissCap), mv(kMissCap);
      // Admission of the misses step parity b reported: device-to-device from its staging rows,
      // after \p after (the last kernels that read the bank) on the side stream.
      auto admit = [&](int b, EventHandle after) {
        BENCH_CHECK(bank->BeginAdmit(side, after));
        int64_t misses = 0;
        for (int i = 0; i < items; ++i) {
          const int32_t* ml = miss_h[b] + static_cast<size_t>(i) * (1 + kMissCap);
          const int n = std::min(ml[0], kMissCap);
          misses += ml[0];
          const char* st = stage[b] + static_cast<size_t>(i) * k * 2 * kRowBytes;
          const int32_t* pos = pos_h[b] + static_cast<size_t>(i) * k;
          for (int j = 0; j < n; ++j) {
            const int32_t r = ml[1 + j];
            mpos[j] = pos[r];
            mk[j] = st + static_cast<size_t>(r) * 2 * kRowBytes;
            mv[j] = static_cast<const char*>(mk[j]) + kRowBytes;
          }
          bank->Admit(i, std::span<const int32_t>(mpos.data(), n), mk.data(), mv.data());
        }
        bank->CountDeviceLookups(static_cast<int64_t>(items) * k, misses);
        BENCH_CHECK(bank->CommitAdmit());
      };
      // Same selection stream for every mode.
      std::mt19937 rng(7);
      std::vector<std::vector<int32_t>> sel(items, std::vector<int32_t>(k));
      for (auto& v : sel)
        for (auto& x : v) x = static_cast<int32_t>(rng() % ctx);
      std::vector<double> us, gus, enq_us, adm_us;
      for (int step = 0; step < warmup + steps; ++step) {
        for (auto& v : sel) {
          for (int64_t c = 0; c < static_cast<int64_t>(churn * k); ++c) {
            v[rng() % k] = static_cast<int32_t>(rng() % ctx);
          }
        }
        if (step == warmup && bank) bank->ResetCounters();
        const int par = step & 1;
        const auto t0 = std::chrono::steady_clock::now();
        if (bank) BENCH_CHECK(bank->WaitReady(s));
        for (int i = 0; i < items; ++i)
          std::memcpy(pos_h[par] + static_cast<size_t>(i) * k, sel[i].data(), k * 4);
        cudaEventRecord(ga, s);
        BENCH_CHECK(dev->CopyAsync(pos_d, pos_h[par], pos_bytes, s));
        std::chrono::steady_clock::time_point t_adm0, t_adm1;
        if (bank) {
          cudaMemsetAsync(miss_d[par], 0, miss_bytes, s);
          BENCH_CHECK(dev->RecordEvent(fork, s));
          BENCH_CHECK(dev->WaitEvent(miss_stream, fork));
          BENCH_CHECK(
              dev->AttendBank(p, miss_items[par], items, cuda::BankPass::kMisses, miss_stream, k));
          BENCH_CHECK(dev->CopyAsync(miss_h[par], miss_d[par], miss_bytes, miss_stream));
          BENCH_CHECK(dev->RecordEvent(join, miss_stream));
          BENCH_CHECK(dev->AttendBank(p, hit_items, items, cuda::BankPass::kHits, s, k));
          BENCH_CHECK(dev->WaitEvent(s, join));
          BENCH_CHECK(dev->MergeLse(o, lse, o_b, lse_b, static_cast<int64_t>(items) * kGroup,
                                    kHeadDim, nullptr, DType::kF32, s));
          BENCH_CHECK(dev->RecordEvent(step_done, s));  // the step's last reader of the bank
          t_adm0 = std::chrono::steady_clock::now();
          if (overlap && step > 0) admit(par ^ 1, step_done);  // previous step's misses
          t_adm1 = std::chrono::steady_clock::now();
          BENCH_CHECK(bank->SnapshotRefs(s));
        } else {
          BENCH_CHECK(dev->AttendBank(
              p, hit_items, items,
              store == gpu ? cuda::BankPass::kDirect : cuda::BankPass::kDirectZeroCopy, s, k));
        }
        cudaEventRecord(gb, s);
        const auto t_enq = std::chrono::steady_clock::now();
        BENCH_CHECK(dev->SynchronizeStream(s));  // the engine needs o before the next layer
        if (bank && !overlap) {
          t_adm0 = std::chrono::steady_clock::now();
          admit(par, step_done);
          t_adm1 = std::chrono::steady_clock::now();
        }
        const auto t1 = std::chrono::steady_clock::now();
        float gms = 0;
        cudaEventElapsedTime(&gms, ga, gb);
        if (step >= warmup) {
          us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
          gus.push_back(gms * 1e3);
          enq_us.push_back(std::chrono::duration<double, std::micro>(t_enq - t0).count());
          adm_us.push_back(bank ? std::chrono::duration<double, std::micro>(t_adm1 - t_adm0).count()
                                : 0.0);
        }
      }
      BENCH_CHECK(dev->SynchronizeStream(side));
      BENCH_CHECK(dev->CopyAsync(o_mode.data(), o, q_floats * 4, s));
      BENCH_CHECK(dev->SynchronizeStream(s));
      if (!std::strcmp(mode, "all_gpu")) o_ref = o_mode;
      double maxdiff = 0;
      for (size_t i = 0; i < q_floats; ++i)
        maxdiff = std::max(maxdiff, std::fabs(double(o_mode[i]) - o_ref[i]));
      std::sort(us.begin(), us.end());
      std::sort(gus.begin(), gus.end());
      std::sort(enq_us.begin(), enq_us.end());
      std::sort(adm_us.begin(), adm_us.end());
      const double enq = enq_us[enq_us.size() / 2], adm = adm_us[adm_us.size() / 2];
      const double med = us[us.size() / 2];
      const double gmed = gus[gus.size() / 2];
      if (!std::strcmp(mode, "all_gpu")) gpu_us = med;
      const double hit = bank ? bank->counters().hit_rate() : 0.0;
      const size_t map_bytes = bank ? bank->map_bytes() : 0;
      const size_t dmap_bytes = bank ? bank->device_map_bytes() : 0;
      std::printf("%-6d %-8s %10.1f %10.1f %8.1f %8.1f %8.3f %9.3f %12zu %12zu %10.2e\n", batch,
                  mode, med, gmed, enq, adm, gpu_us / med, hit, map_bytes, dmap_bytes, maxdiff);
      char buf[512];
      std::snprintf(
          buf, sizeof(buf),
          "%s{\"batch\": %d, \"mode\": \"%s\", \"step_us\": %.2f, \"gpu_us\": %.2f, "
          "\"host_enqueue_us\": %.2f, \"host_admit_us\": %.2f, "
          "\"speed_vs_all_gpu\": %.4f, \"hit_rate\": %.4f, \"map_bytes\": %zu, "
          "\"device_map_bytes\": %zu, \"slot_meta_bytes\": %zu, \"max_abs_diff_vs_all_gpu\": %.3e}",
          first ? "" : ", ", batch, mode, med, gmed, enq, adm, gpu_us / med, hit, map_bytes,
          dmap_bytes, bank ? bank->slot_meta_bytes() : size_t{0}, maxdiff);
      json += buf;
      first = false;
    }
    for (int b = 0; b < 2; ++b) {
      dev->FreeHost(pos_h[b]);
      dev->FreeHost(miss_h[b]);
      dev->FreeDevice(miss_d[b]);
      dev->FreeDevice(stage[b]);
      dev->FreeDevice(miss_items[b]);
    }
    for (void* ptr : {static_cast<void*>(q), static_cast<void*>(o), static_cast<void*>(lse),
                      static_cast<void*>(o_b), static_cast<void*>(lse_b), static_cast<void*>(pos_d),
                      static_cast<void*>(hit_items)}) {
      dev->FreeDevice(ptr);
    }
    dev->FreeDevice(gpu);
    dev->FreeHost(host);
  }
  json += "]}\n";
  std::ofstream(out_path) << json;
  std::printf("\nwrote %s\n", out_path.c_str());
  cudaEventDestroy(ga);
  cudaEventDestroy(gb);
  for (EventHandle e : {step_done, fork, join}) dev->DestroyEvent(e);
  dev->DestroyStream(miss_stream);
  dev->DestroyStream(side);
  return 0;
}
