// Copyright kvferry authors. Apache-2.0.
// HiP's offload comparison on a decode stream with reuse. A step of a model with `layers` layers:
// for every layer, each (sequence, KV head) selects k rows of a long context; between steps most
// of a selection persists and a fraction (churn) moves to new random positions, so a bank sized
// twice the selection can hold everything that is still relevant and every new row is a
// compulsory miss. Ways to serve the selected rows, all through the same position-list kernel
// (cuda::LaunchAttendBank; the host sends positions only, item descriptors live in device memory):
//   all_gpu      every row in device memory (the ceiling; one kDirect launch per layer),
//   vector_fused cuda::DeviceBank with the vector map, selection made at the layer: one kAll launch
//                per layer (hits from the bank, misses read zero-copy from the pinned host store
//                and staged) and one Admit launch (CLOCK, page table and row copies on the GPU);
//                no host work per row,
//   hash_fused   the same with the hash map (tombstones, in-place rebuilds),
//   vector_prefetch / hash_prefetch   selection known when the step starts (pre-hoc selectors,
//                a cached mask): every layer's misses are gathered into staging on a second
//                stream (LaunchBankGather) while the layers run; layer l attends its bank hits
//                (kHits), waits for its gather, attends the staged misses (kStaged), MergeLse,
//                Admit,
//   vector_host  the host-managed TokenBank of the runtime: kHits and a zero-copy kMisses launch on a
//                second stream, merged by lse; the miss lists go back to the host, which runs CLOCK and the map updates after the
//                step's sync; copies + device map mirror updates on a side stream the next step
//                waits for,
//   none         no bank: every row read zero-copy from the host store.
// The bank modes admit layer l's misses on a side stream after layer l's attention, overlapping the
// later layers. The step's work is captured once into a CUDA graph and replayed (graph = true)
// wherever it has no host work; all_gpu also runs without a graph. One host sync per step.
// Two kinds of rows: attention only (the KV cache's part of a step), and decode_step = true: the
// whole decoder step of Llama-3.1-8B with the attention served each way (bf16 weights through
// cuBLAS, QKV / O / gate+up / down per layer and the LM head; what HiP's "decode throughput"
// comparison measures). Reports the median step time, the ratio to all_gpu (graph) of the same
// kind, hit rate, device page-table bytes, and the largest |o - o_all_gpu| of the last step's last
// layer; table + JSON (argv[1], default bench/results/bank.json).
// Usage: bank_bench [out.json] [--layers L] [--steps N] [--churn F] [--batch B]
//                   [--modes m1,m2 (all_gpu always runs)] [--breakdown (per-launch times)]

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/lib/check.h"
#include "cpu/pool.h"
#include "gpu/cuda_device.h"
#include "gpu/device_bank.h"
#include "offload/host_gather.h"
#include "offload/token_bank.h"

using namespace kvferry;

#define CUBLAS_OK(expr)                                                      \
  do {                                                                       \
    cublasStatus_t e_ = (expr);                                              \
    if (e_ != CUBLAS_STATUS_SUCCESS) {                                       \
      std::fprintf(stderr, "%s:%d: %s: %d\n", __FILE__, __LINE__, #expr, e_); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

namespace {
// Llama-3.1-8B: hidden 4096, 32 query / 8 KV heads of 128, FFN 14336, vocabulary 128256.
constexpr int kDim = 4096, kQkv = 6144, kFfn = 14336, kVocab = 128256;
constexpr size_t kLayerWeightBytes =
    (static_cast<size_t>(kQkv) * kDim + static_cast<size_t>(kDim) * kDim +
     static_cast<size_t>(2 * kFfn) * kDim + static_cast<size_t>(kDim) * kFfn) * 2;
constexpr int kKvHeads = 8, kGroup = 4, kHeadDim = 128;
constexpr size_t kRowBytes = kHeadDim * 2;
constexpr int kMissCap = 512;  // misses recorded (and admitted) per table per step
}  // namespace

int main(int argc, char** argv) {
  std::string out_path = "bench/results/bank.json";
  int layers = 32, steps = 200;
  double churn = 0.05;
  bool breakdown = false;
  std::string only;  // ",mode,mode," to run only those (all_gpu always runs: it is the baseline)
  std::vector<int> batches = {1, 8};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--layers") && i + 1 < argc) {
      layers = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--breakdown")) {
      breakdown = true;
    } else if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--modes") && i + 1 < argc) {
      only = std::string(",") + argv[++i] + ",";
    } else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) {
      batches = {std::atoi(argv[++i])};
    } else if (!std::strcmp(argv[i], "--churn") && i + 1 < argc) {
      churn = std::atof(argv[++i]);
    } else {
      out_path = argv[i];
    }
  }
  auto dev_r = cuda::CudaDevice::Create(0);
  BENCH_CHECK(dev_r.status());
  auto dev = std::move(dev_r).value();
  cudaStream_t s = static_cast<cudaStream_t>(dev->CreateStream().value());
  StreamHandle side = dev->CreateStream().value();
  StreamHandle miss_stream = dev->CreateStream().value();
  EventHandle step_done = dev->CreateEvent().value();
  std::vector<EventHandle> fork(layers), join(layers);
  for (int l = 0; l < layers; ++l) {
    fork[l] = dev->CreateEvent().value();
    join[l] = dev->CreateEvent().value();
  }
  EventHandle side_done = dev->CreateEvent().value();
  // Host-staged modes: miss lists back on d2h, compact staging blocks over on h2d (copy engines).
  StreamHandle d2h = dev->CreateStream().value();
  StreamHandle h2d = dev->CreateStream().value();
  EventHandle resolved_ev = dev->CreateEvent().value();
  std::vector<EventHandle> list_ev(layers), stage_ev(layers);
  for (int l = 0; l < layers; ++l) {
    list_ev[l] = dev->CreateEvent().value();
    stage_ev[l] = dev->CreateEvent().value();
  }
  std::printf("device: %s\n", dev->name().c_str());
  // Dense weights of the model for the decode-step rows (skipped if they do not fit).
  cublasHandle_t cublas;
  CUBLAS_OK(cublasCreate(&cublas));
  CUBLAS_OK(cublasSetStream(cublas, s));
  void* cublas_ws = dev->AllocDevice(size_t{64} << 20).value();
  CUBLAS_OK(cublasSetWorkspace(cublas, cublas_ws, size_t{64} << 20));
  char* weights = nullptr;
  char* head = nullptr;
  char* act = nullptr;
  char* act_out = nullptr;
  {
    auto w = dev->AllocDevice(kLayerWeightBytes * layers);
    auto h = dev->AllocDevice(static_cast<size_t>(kVocab) * kDim * 2);
    if (w.ok() && h.ok()) {
      weights = static_cast<char*>(*w);
      head = static_cast<char*>(*h);
      CUDA_OK(cudaMemset(weights, 0, kLayerWeightBytes * layers));
      CUDA_OK(cudaMemset(head, 0, static_cast<size_t>(kVocab) * kDim * 2));
      act = static_cast<char*>(dev->AllocDevice(size_t{8} * kFfn * 2).value());
      act_out = static_cast<char*>(dev->AllocDevice(size_t{8} * kVocab * 2).value());
      CUDA_OK(cudaMemset(act, 0, size_t{8} * kFfn * 2));
    } else {
      std::printf("model weights (%.1f GB) do not fit: no decode-step rows\n",
                  (kLayerWeightBytes * layers + static_cast<double>(kVocab) * kDim * 2) / 1e9);
      if (w.ok()) dev->FreeDevice(*w);
      if (h.ok()) dev->FreeDevice(*h);
    }
  }

  const int64_t ctx = 131072, k = 2048;
  const int warmup = 30;
  // The CPU pool of the host-staged modes (all cores of the GPU's node).
  auto pool_r = cpu::CpuPool::Create(cpu::CpuPoolOptions{});
  BENCH_CHECK(pool_r.status());
  auto pool = std::move(pool_r).value();
  std::printf("cpu pool: %s\n", pool->description().c_str());
  std::string json = "{\"device\": \"" + dev->name() + "\", \"ctx\": 131072, \"k\": 2048, " +
                     "\"churn\": " + std::to_string(churn) + ", \"slots\": 4096, \"layers\": " +
                     std::to_string(layers) +
                     ", \"kv_heads\": 8, \"group\": 4, \"head_dim\": 128, \"dtype\": \"bf16\", " +
                     "\"steps\": " + std::to_string(steps) + ", \"runs\": [";
  std::printf("layers %d, ctx %lld, k %lld, churn %.2f, slots %lld\n", layers,
              static_cast<long long>(ctx), static_cast<long long>(k), churn,
              static_cast<long long>(2 * k));
  std::printf("\n%-6s %-13s %6s %6s %10s %10s %8s %9s %12s %10s\n", "batch", "mode", "graph",
              "model", "step us", "us/layer", "vs gpu", "hit rate", "map bytes", "max|do|");
  bool first = true;
  for (int batch : batches) {
    const int items = batch * kKvHeads;           // tables per layer
    const int64_t tables = static_cast<int64_t>(items) * layers;
    // Host store and a device copy, as large as a real one where memory allows: every layer has
    // its own region (a real store is per (sequence, layer, KV head)) up to 16 GiB, after which
    // regions are reused (layer l reads region l % regions). Zero-copy reads slow down with the
    // span of host memory they touch (address translation), so a store of one layer's size would
    // flatter them. Row (region, item, pos): K at (((region * items + item) * ctx + pos) * 2) *
    // row, V next.
    const size_t layer_bytes = static_cast<size_t>(items) * ctx * 2 * kRowBytes;
    const int regions =
        std::max(1, std::min(layers, static_cast<int>((size_t{16} << 30) / layer_bytes)));
    const size_t kv_bytes = layer_bytes * regions;
    char* host = static_cast<char*>(dev->AllocHost(kv_bytes).value());
    char* gpu = static_cast<char*>(dev->AllocDevice(kv_bytes).value());
    {
      // A 64 MiB block of bf16 normals repeated over the store, written by 16 threads.
      const size_t block = size_t{64} << 20;
      std::vector<uint16_t> blk(block / 2);
      std::mt19937 rng(1);
      std::normal_distribution<float> nd(0.f, 1.f);
      for (auto& x : blk) {
        const float f = nd(rng);
        uint32_t b;
        std::memcpy(&b, &f, 4);
        x = static_cast<uint16_t>(b >> 16);
      }
      std::vector<std::thread> fill;
      for (int th = 0; th < 16; ++th) {
        fill.emplace_back([&, th] {
          for (size_t off = th * block; off < kv_bytes; off += 16 * block) {
            std::memcpy(host + off, blk.data(), std::min(block, kv_bytes - off));
          }
        });
      }
      for (auto& th : fill) th.join();
      BENCH_CHECK(dev->CopyAsync(gpu, host, kv_bytes, s));
    }
    std::printf("batch %d: store %.1f GiB (%d layer regions)\n", batch, kv_bytes / 1073741824.0,
                regions);
    const size_t q_floats = static_cast<size_t>(items) * kGroup * kHeadDim;
    float* q = static_cast<float*>(dev->AllocDevice(q_floats * 4).value());
    float* o = static_cast<float*>(dev->AllocDevice(q_floats * 4 * layers).value());
    float* lse = static_cast<float*>(dev->AllocDevice(items * kGroup * 4 * layers).value());
    float* o_b = static_cast<float*>(dev->AllocDevice(q_floats * 4 * layers).value());
    float* lse_b = static_cast<float*>(dev->AllocDevice(items * kGroup * 4 * layers).value());
    {
      std::vector<float> qh(q_floats);
      std::mt19937 rng(2);
      std::normal_distribution<float> nd(0.f, 1.f);
      for (auto& x : qh) x = nd(rng);
      BENCH_CHECK(dev->CopyAsync(q, qh.data(), q_floats * 4, s));
      CUDA_OK(cudaStreamSynchronize(s));
    }
    // Per step: positions [layers][items][k] H2D. Per layer: miss lists [items][1 + cap] and
    // staged rows [items][k].
    const size_t pos_bytes = static_cast<size_t>(tables) * k * sizeof(int32_t);
    const size_t miss_ints = static_cast<size_t>(tables) * (1 + kMissCap);
    const size_t stage_rows = static_cast<size_t>(items) * k;  // per layer
    auto* pos_d = static_cast<int32_t*>(dev->AllocDevice(pos_bytes).value());
    auto* pos_h = static_cast<int32_t*>(dev->AllocHost(pos_bytes).value());
    int32_t* miss_d[1];
    int32_t* miss_h[1];
    char* stage[1];
    for (int b = 0; b < 1; ++b) {
      miss_d[b] = static_cast<int32_t*>(dev->AllocDevice(miss_ints * 4).value());
      miss_h[b] = static_cast<int32_t*>(dev->AllocHost(miss_ints * 4).value());
      stage[b] = static_cast<char*>(dev->AllocDevice(stage_rows * layers * 2 * kRowBytes).value());
    }
    auto* items_d = static_cast<cuda::BankAttnItem*>(
        dev->AllocDevice(2 * tables * sizeof(cuda::BankAttnItem)).value());
    auto* admit_d = static_cast<cuda::BankAdmitItem*>(
        dev->AllocDevice(tables * sizeof(cuda::BankAdmitItem)).value());
    // Host-staged modes: per-position resolutions, and per layer a compact staging block (a
    // header of per-item first rows, then the rows) in pinned host memory and in device memory.
    constexpr size_t kHdr = 1024;
    if (static_cast<size_t>(items) * 4 > kHdr) {
      std::fprintf(stderr, "batch %d: staging header too small\n", batch);
      return 1;
    }
    const size_t cstage_bytes = kHdr + static_cast<size_t>(items) * kMissCap * 2 * kRowBytes;
    auto* resolved_d = static_cast<int32_t*>(dev->AllocDevice(tables * k * 4).value());
    char* cstage_d = static_cast<char*>(dev->AllocDevice(cstage_bytes * layers).value());
    char* cstage_h = static_cast<char*>(dev->AllocHost(cstage_bytes * layers).value());
    std::vector<RowCopy> grows(static_cast<size_t>(items) * kMissCap);
    AttnParams p;
    p.group = kGroup;
    p.head_dim = kHeadDim;
    p.kv_dtype = DType::kBF16;
    p.scale = 1.0f / std::sqrt(128.0f);
    double gpu_us = 0;
    std::vector<float> o_ref(q_floats), o_mode(q_floats);
    struct Mode {
      const char* name;
      bool graph;
      bool model;
      bool report = true;  // false: a warm-up pass (clocks, first-touch), not reported
    };
    double gpu_us_model = 0;
    for (const Mode mode :
         {Mode{"all_gpu", true, false, false}, Mode{"all_gpu", true, false},
          Mode{"all_gpu", false, false},
          Mode{"vector_fused", true, false}, Mode{"hash_fused", true, false},
          Mode{"vector_prefetch", true, false}, Mode{"hash_prefetch", true, false},
          Mode{"vector_staged", false, false}, Mode{"hash_staged", false, false},
          Mode{"vector_host", false, false}, Mode{"none", true, false},
          Mode{"all_gpu", true, true}, Mode{"vector_fused", true, true},
          Mode{"hash_fused", true, true}, Mode{"vector_prefetch", true, true},
          Mode{"hash_prefetch", true, true}, Mode{"vector_staged", false, true},
          Mode{"hash_staged", false, true}, Mode{"none", true, true}}) {
      const std::string name = mode.name;
      const bool model = mode.model;
      if (model && weights == nullptr) continue;
      if (!only.empty() && name != "all_gpu" && only.find("," + name + ",") == std::string::npos) {
        continue;
      }
      const bool fused = name == "vector_fused" || name == "hash_fused";
      const bool prefetch = name == "vector_prefetch" || name == "hash_prefetch";
      const bool staged = name == "vector_staged" || name == "hash_staged";
      const bool dbank = fused || prefetch || staged;
      const bool hbank = name == "vector_host";
      const char* store = name == "all_gpu" ? gpu : host;
      std::unique_ptr<cuda::DeviceBank> bank;
      std::unique_ptr<TokenBank> hb;
      if (dbank) {
        cuda::DeviceBankConfig c;
        c.num_tables = static_cast<int>(tables);
        c.slots = static_cast<int>(2 * k);
        c.max_positions = ctx;
        c.head_dim = kHeadDim;
        c.map = name.starts_with("hash") ? BankMapKind::kHash : BankMapKind::kVector;
        c.max_admit_per_table = kMissCap;
        auto r = cuda::DeviceBank::Create(dev.get(), c);
        BENCH_CHECK(r.status());
        bank = std::move(r).value();
      } else if (hbank) {
        TokenBankConfig c;
        c.max_sequences = batch;
        c.num_layers = layers;
        c.num_kv_heads = kKvHeads;
        c.slots = static_cast<int>(2 * k);
        c.max_positions = ctx;
        c.head_dim = kHeadDim;
        c.map = BankMapKind::kVector;
        c.max_admit_per_table = kMissCap;
        c.max_admit_rows = tables * kMissCap;
        c.device_map = true;
        auto r = TokenBank::Create(dev.get(), c);
        BENCH_CHECK(r.status());
        hb = std::move(r).value();
      }
      // Descriptors: [0, tables) the main launch (kDirect / kAll / kHits), [tables, 2 tables) the
      // gather / kStaged / kMisses launches (o_b, lse_b, no reference bits). Table index = l * items + i.
      std::vector<cuda::BankAttnItem> ih(2 * tables);
      std::vector<cuda::BankAdmitItem> ah(tables);
      for (int l = 0; l < layers; ++l) {
        for (int i = 0; i < items; ++i) {
          const int64_t t = static_cast<int64_t>(l) * items + i;
          cuda::BankAttnItem it;
          it.q = q + i * kGroup * kHeadDim;
          it.o = o + (static_cast<size_t>(l) * items + i) * kGroup * kHeadDim;
          it.lse = lse + (static_cast<size_t>(l) * items + i) * kGroup;
          it.positions = pos_d + t * k;
          it.count = static_cast<int32_t>(k);
          it.store = store + (static_cast<size_t>(l % regions) * items + i) * ctx * 2 * kRowBytes;
          it.store_stride = 2 * kRowBytes;
          if (bank) bank->Describe(static_cast<int>(t), &it);
          if (hb) {
            const auto d = hb->device_table(hb->TableIndex(i / kKvHeads, l, i % kKvHeads));
            it.vector_map = d.vector_map;
            it.vector_len = d.vector_len;
            it.bank_rows = d.bank_rows;
            it.ref_bits = d.ref_bits;
          }
          char* st = stage[0] + (static_cast<size_t>(l) * stage_rows + i * k) * 2 * kRowBytes;
          int32_t* ml = miss_d[0] + t * (1 + kMissCap);
          // Host-staged: layer l's compact block; item i's first row in its header.
          char* cst = cstage_d + static_cast<size_t>(l) * cstage_bytes;
          const int32_t* first = reinterpret_cast<const int32_t*>(cst) + i;
          if (fused || staged) {
            it.stage = staged ? cst + kHdr : st;
            it.miss_list = ml;
            it.miss_cap = kMissCap;
          }
          if (staged) {
            it.resolved = resolved_d + t * k;
            it.stage_first = first;
          }
          ih[t] = it;
          it.resolved = nullptr;
          it.stage_first = nullptr;
          it.o = o_b + (static_cast<size_t>(l) * items + i) * kGroup * kHeadDim;
          it.lse = lse_b + (static_cast<size_t>(l) * items + i) * kGroup;
          it.ref_bits = nullptr;
          it.stage = st;
          it.miss_list = ml;
          it.miss_cap = kMissCap;
          ih[tables + t] = it;
          ah[t].table = static_cast<int32_t>(t);
          ah[t].miss_cap = kMissCap;
          ah[t].positions = it.positions;
          ah[t].miss_list = ml;
          ah[t].stage = staged ? cst + kHdr : st;
          ah[t].stage_first = staged ? first : nullptr;
        }
      }
      BENCH_CHECK(dev->CopyAsync(items_d, ih.data(), ih.size() * sizeof(ih[0]), s));
      BENCH_CHECK(dev->CopyAsync(admit_d, ah.data(), ah.size() * sizeof(ah[0]), s));
      CUDA_OK(cudaMemsetAsync(miss_d[0], 0, miss_ints * 4, s));
      CUDA_OK(cudaStreamSynchronize(s));

      // Layer l's admission on the side stream, after layer l's reads of its tables; it overlaps
      // the later layers (the next step's layer l waits for it through side_done).
      auto admit_layer = [&](int l) {
        BENCH_CHECK(dev->RecordEvent(fork[l], s));
        BENCH_CHECK(dev->WaitEvent(side, fork[l]));
        BENCH_CHECK(bank->Admit(admit_d + static_cast<size_t>(l) * items, items, side));
      };
      // The rest of a Llama-3.1-8B decoder layer (bf16 weights, fp32 accumulation): QKV, O, gate +
      // up and down projections for `batch` tokens; the LM head once per step.
      auto gemm = [&](const void* w, int m, int kk, void* out) {
        const float one = 1.0f, zero = 0.0f;
        CUBLAS_OK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, m, batch, kk, &one, w,
                               CUDA_R_16BF, kk, act, CUDA_R_16BF, kk, &zero, out, CUDA_R_16BF, m,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      auto model_pre = [&](int l) {  // before the attention: QKV
        gemm(weights + static_cast<size_t>(l) * kLayerWeightBytes, kQkv, kDim, act_out);
      };
      auto model_post = [&](int l) {  // after it: O, gate + up, down
        const char* w = weights + static_cast<size_t>(l) * kLayerWeightBytes;
        w += static_cast<size_t>(kQkv) * kDim * 2;
        gemm(w, kDim, kDim, act_out);
        w += static_cast<size_t>(kDim) * kDim * 2;
        gemm(w, 2 * kFfn, kDim, act_out);
        w += static_cast<size_t>(2 * kFfn) * kDim * 2;
        gemm(w, kDim, kFfn, act_out);
      };
      auto model_head = [&]() { gemm(head, kVocab, kDim, act_out); };
      // One step's device work (captured into a graph where mode.graph).
      auto enqueue = [&]() {
        BENCH_CHECK(dev->CopyAsync(pos_d, pos_h, pos_bytes, s));
        if (prefetch) {  // every layer's misses, gathered while the layers run
          BENCH_CHECK(dev->RecordEvent(fork[0], s));
          BENCH_CHECK(dev->WaitEvent(miss_stream, fork[0]));
          for (int l = 0; l < layers; ++l) {
            BENCH_CHECK(dev->GatherBank(p, items_d + tables + static_cast<size_t>(l) * items,
                                        items, k, miss_stream));
            BENCH_CHECK(dev->RecordEvent(join[l], miss_stream));
          }
        }
        for (int l = 0; l < layers; ++l) {
          const cuda::BankAttnItem* li = items_d + static_cast<size_t>(l) * items;
          if (model) model_pre(l);
          if (!dbank) {
            BENCH_CHECK(dev->AttendBank(
                p, li, items,
                store == gpu ? cuda::BankPass::kDirect : cuda::BankPass::kDirectZeroCopy, s, k));
          } else if (fused) {
            BENCH_CHECK(dev->AttendBank(p, li, items, cuda::BankPass::kAll, s, k));
            admit_layer(l);
          } else {
            BENCH_CHECK(dev->AttendBank(p, li, items, cuda::BankPass::kHits, s, k));
            BENCH_CHECK(dev->WaitEvent(s, join[l]));
            BENCH_CHECK(dev->AttendBank(p, li + tables, items, cuda::BankPass::kStaged, s, kMissCap));
            const size_t off = static_cast<size_t>(l) * items;
            BENCH_CHECK(dev->MergeLse(o + off * kGroup * kHeadDim, lse + off * kGroup,
                                      o_b + off * kGroup * kHeadDim, lse_b + off * kGroup,
                                      static_cast<int64_t>(items) * kGroup, kHeadDim, nullptr,
                                      DType::kF32, s));
            admit_layer(l);
          }
          if (model) model_post(l);
        }
        if (model) model_head();
        if (dbank) {  // the next step's reads of the bank wait for every admission
          BENCH_CHECK(dev->RecordEvent(side_done, side));
          BENCH_CHECK(dev->WaitEvent(s, side_done));
        }
      };
      cudaGraphExec_t graph_exec = nullptr;

      // Same selection stream for every mode: sel[t][j].
      std::mt19937 rng(7);
      std::vector<std::vector<int32_t>> sel(tables, std::vector<int32_t>(k));
      for (auto& v : sel)
        for (auto& x : v) x = static_cast<int32_t>(rng() % ctx);
      std::vector<double> us;
      std::vector<int32_t> mpos(kMissCap);
      std::vector<const void*> mk(kMissCap), mv(kMissCap);
      int64_t host_lookups = 0, host_misses = 0;
      double host_us[3] = {0, 0, 0};  // staged: wait for lists, build row list, gather
      int64_t host_rows = 0;
      int64_t dev_misses_before = 0;
      for (int step = 0; step < warmup + steps; ++step) {
        for (auto& v : sel) {
          for (int64_t c = 0; c < static_cast<int64_t>(churn * k); ++c) {
            v[rng() % k] = static_cast<int32_t>(rng() % ctx);
          }
        }
        if (step == warmup) {
          if (bank) dev_misses_before = bank->Counters().value().misses;
          if (hb) hb->ResetCounters();
          host_lookups = host_misses = 0;
        }
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t t = 0; t < tables; ++t) std::memcpy(pos_h + t * k, sel[t].data(), k * 4);
        if (hbank) {
          // Runtime-style host-managed bank: the step's misses come back to the host, which runs
          // CLOCK and the map updates after the step's sync; the copies (and the device map
          // mirror) go on a side stream that the next step waits for.
          BENCH_CHECK(hb->WaitReady(s));
          BENCH_CHECK(dev->CopyAsync(pos_d, pos_h, pos_bytes, s));
          CUDA_OK(cudaMemsetAsync(miss_d[0], 0, miss_ints * 4, s));
          for (int l = 0; l < layers; ++l) {
            const cuda::BankAttnItem* li = items_d + static_cast<size_t>(l) * items;
            BENCH_CHECK(dev->RecordEvent(fork[l], s));
            BENCH_CHECK(dev->WaitEvent(miss_stream, fork[l]));
            BENCH_CHECK(
                dev->AttendBank(p, li + tables, items, cuda::BankPass::kMisses, miss_stream, k));
            BENCH_CHECK(dev->RecordEvent(join[l], miss_stream));
            BENCH_CHECK(dev->AttendBank(p, li, items, cuda::BankPass::kHits, s, k));
            BENCH_CHECK(dev->WaitEvent(s, join[l]));
            const size_t off = static_cast<size_t>(l) * items;
            BENCH_CHECK(dev->MergeLse(o + off * kGroup * kHeadDim, lse + off * kGroup,
                                      o_b + off * kGroup * kHeadDim, lse_b + off * kGroup,
                                      static_cast<int64_t>(items) * kGroup, kHeadDim, nullptr,
                                      DType::kF32, s));
          }
          BENCH_CHECK(dev->CopyAsync(miss_h[0], miss_d[0], miss_ints * 4, s));
          BENCH_CHECK(dev->RecordEvent(step_done, s));
          BENCH_CHECK(hb->SnapshotRefs(s));
          CUDA_OK(cudaStreamSynchronize(s));
          BENCH_CHECK(hb->BeginAdmit(side, step_done));
          for (int64_t t = 0; t < tables; ++t) {
            const int32_t* ml = miss_h[0] + t * (1 + kMissCap);
            const int n = std::min(ml[0], kMissCap);
            host_misses += ml[0];
            const int l = static_cast<int>(t / items), i = static_cast<int>(t % items);
            const char* st =
                stage[0] + (static_cast<size_t>(l) * stage_rows + i * k) * 2 * kRowBytes;
            for (int j = 0; j < n; ++j) {
              const int32_t r = ml[1 + j];
              mpos[j] = pos_h[t * k + r];
              mk[j] = st + static_cast<size_t>(r) * 2 * kRowBytes;
              mv[j] = static_cast<const char*>(mk[j]) + kRowBytes;
            }
            hb->Admit(hb->TableIndex(i / kKvHeads, l, i % kKvHeads),
                      std::span<const int32_t>(mpos.data(), n), mk.data(), mv.data());
          }
          host_lookups += tables * k;
          BENCH_CHECK(hb->CommitAdmit());
        } else if (staged) {
          // Host-staged: the step's lookups in one launch; each layer's miss lists come back on
          // d2h while the GPU works; the host gathers that layer's missed rows (CPU pool) into a
          // compact pinned block and one copy on h2d carries it; the layer's kResolved launch
          // waits for it and reads only device memory. No graph: host work sits between launches.
          BENCH_CHECK(dev->CopyAsync(pos_d, pos_h, pos_bytes, s));
          BENCH_CHECK(dev->ResolveBank(items_d, tables, k, s));
          BENCH_CHECK(dev->RecordEvent(resolved_ev, s));
          BENCH_CHECK(dev->WaitEvent(d2h, resolved_ev));
          const size_t layer_ints = static_cast<size_t>(items) * (1 + kMissCap);
          for (int l = 0; l < layers; ++l) {
            BENCH_CHECK(dev->CopyAsync(miss_h[0] + l * layer_ints, miss_d[0] + l * layer_ints,
                                       layer_ints * 4, d2h));
            BENCH_CHECK(dev->RecordEvent(list_ev[l], d2h));
          }
          for (int l = 0; l < layers; ++l) {
            if (model) model_pre(l);
            const auto h0 = std::chrono::steady_clock::now();
            CUDA_OK(cudaEventSynchronize(static_cast<cudaEvent_t>(list_ev[l])));
            const auto h1 = std::chrono::steady_clock::now();
            char* hs = cstage_h + static_cast<size_t>(l) * cstage_bytes;
            auto* first = reinterpret_cast<int32_t*>(hs);
            int64_t run = 0;
            for (int i = 0; i < items; ++i) {
              const int64_t t = static_cast<int64_t>(l) * items + i;
              const int32_t* ml = miss_h[0] + t * (1 + kMissCap);
              const int n = std::min(ml[0], kMissCap);
              first[i] = static_cast<int32_t>(run);
              const char* base =
                  host + (static_cast<size_t>(l % regions) * items + i) * ctx * 2 * kRowBytes;
              for (int e = 0; e < n; ++e) {
                const int64_t pos = pos_h[t * k + ml[1 + e]];
                grows[run + e] = RowCopy{hs + kHdr + (run + e) * 2 * kRowBytes,
                                         base + pos * 2 * kRowBytes};
              }
              run += n;
            }
            const auto h2 = std::chrono::steady_clock::now();
            GatherRowsHost(pool.get(), grows.data(), run, 2 * kRowBytes);
            const auto h3 = std::chrono::steady_clock::now();
            if (step >= warmup) {
              host_us[0] += std::chrono::duration<double, std::micro>(h1 - h0).count();
              host_us[1] += std::chrono::duration<double, std::micro>(h2 - h1).count();
              host_us[2] += std::chrono::duration<double, std::micro>(h3 - h2).count();
              host_rows += run;
            }
            BENCH_CHECK(dev->CopyAsync(cstage_d + static_cast<size_t>(l) * cstage_bytes, hs,
                                       kHdr + run * 2 * kRowBytes, h2d));
            BENCH_CHECK(dev->RecordEvent(stage_ev[l], h2d));
            BENCH_CHECK(dev->WaitEvent(s, stage_ev[l]));
            BENCH_CHECK(dev->AttendBank(p, items_d + static_cast<size_t>(l) * items, items,
                                        cuda::BankPass::kResolved, s, k));
            admit_layer(l);
            if (model) model_post(l);
          }
          if (model) model_head();
          BENCH_CHECK(dev->RecordEvent(side_done, side));
          BENCH_CHECK(dev->WaitEvent(s, side_done));
        } else if (mode.graph) {
          if (graph_exec == nullptr && step == 1) {  // step 0 ran uncaptured (workspaces exist)
            cudaGraph_t graph;
            CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
            enqueue();
            CUDA_OK(cudaStreamEndCapture(s, &graph));
            CUDA_OK(cudaGraphInstantiate(&graph_exec, graph, 0));
            CUDA_OK(cudaGraphDestroy(graph));
          }
          if (graph_exec != nullptr) {
            CUDA_OK(cudaGraphLaunch(graph_exec, s));
          } else {
            enqueue();
          }
        } else {
          enqueue();
        }
        CUDA_OK(cudaStreamSynchronize(s));  // the engine needs o
        const auto t1 = std::chrono::steady_clock::now();
        if (step >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      CUDA_OK(cudaStreamSynchronize(static_cast<cudaStream_t>(side)));
      if (graph_exec != nullptr) CUDA_OK(cudaGraphExecDestroy(graph_exec));
      if (staged) {
        const double per = static_cast<double>(steps) * layers;
        std::printf("  host us per layer: wait %.1f, list %.1f, gather %.1f (%.1f GB/s)\n",
                    host_us[0] / per, host_us[1] / per, host_us[2] / per,
                    host_rows * 2.0 * kRowBytes / (host_us[2] > 0 ? host_us[2] : 1) / 1e3);
      }
      if (breakdown && !model && mode.graph) {
        // Each launch of a layer alone on one stream between events (no overlap): us per layer.
        std::vector<std::pair<std::string, double>> parts;
        cudaEvent_t e0, e1;
        CUDA_OK(cudaEventCreate(&e0));
        CUDA_OK(cudaEventCreate(&e1));
        auto timed = [&](const char* what, auto&& fn) {
          CUDA_OK(cudaEventRecord(e0, s));
          fn();
          CUDA_OK(cudaEventRecord(e1, s));
          CUDA_OK(cudaEventSynchronize(e1));
          float ms = 0;
          CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
          auto it = std::find_if(parts.begin(), parts.end(),
                                 [&](const auto& x) { return x.first == what; });
          if (it == parts.end()) {
            parts.emplace_back(what, 0.0);
            it = parts.end() - 1;
          }
          it->second += ms * 1e3;
        };
        const int bsteps = 10;
        for (int step = 0; step < bsteps; ++step) {
          for (auto& v : sel) {
            for (int64_t c = 0; c < static_cast<int64_t>(churn * k); ++c) {
              v[rng() % k] = static_cast<int32_t>(rng() % ctx);
            }
          }
          for (int64_t t = 0; t < tables; ++t) std::memcpy(pos_h + t * k, sel[t].data(), k * 4);
          BENCH_CHECK(dev->CopyAsync(pos_d, pos_h, pos_bytes, s));
          for (int l = 0; l < layers; ++l) {
            const cuda::BankAttnItem* li = items_d + static_cast<size_t>(l) * items;
            const size_t off = static_cast<size_t>(l) * items;
            if (!dbank) {
              timed("attend", [&] {
                BENCH_CHECK(dev->AttendBank(
                    p, li, items,
                    store == gpu ? cuda::BankPass::kDirect : cuda::BankPass::kDirectZeroCopy, s,
                    k));
              });
              continue;
            }
            if (fused) {
              timed("all", [&] {
                BENCH_CHECK(dev->AttendBank(p, li, items, cuda::BankPass::kAll, s, k));
              });
            } else {
              timed("gather", [&] { BENCH_CHECK(dev->GatherBank(p, li + tables, items, k, s)); });
              timed("hits", [&] {
                BENCH_CHECK(dev->AttendBank(p, li, items, cuda::BankPass::kHits, s, k));
              });
              timed("staged", [&] {
                BENCH_CHECK(dev->AttendBank(p, li + tables, items, cuda::BankPass::kStaged, s, kMissCap));
              });
              timed("merge", [&] {
                BENCH_CHECK(dev->MergeLse(o + off * kGroup * kHeadDim, lse + off * kGroup,
                                          o_b + off * kGroup * kHeadDim, lse_b + off * kGroup,
                                          static_cast<int64_t>(items) * kGroup, kHeadDim,
                                          nullptr, DType::kF32, s));
              });
            }
            timed("admit", [&] { BENCH_CHECK(bank->Admit(admit_d + off, items, s)); });
          }
        }
        std::printf("  breakdown (us per layer, each launch alone):");
        for (const auto& [what, us_sum] : parts) {
          std::printf(" %s %.2f", what.c_str(), us_sum / (bsteps * layers));
        }
        std::printf("\n");
        CUDA_OK(cudaEventDestroy(e0));
        CUDA_OK(cudaEventDestroy(e1));
      }
      // Last layer's o of the last step vs all_gpu.
      const size_t last = static_cast<size_t>(layers - 1) * q_floats;
      BENCH_CHECK(dev->CopyAsync(o_mode.data(), o + last, q_floats * 4, s));
      CUDA_OK(cudaStreamSynchronize(s));
      if (!mode.report) continue;
      if (name == "all_gpu" && mode.graph && !model) o_ref = o_mode;
      double maxdiff = 0;
      for (size_t i = 0; i < q_floats; ++i)
        maxdiff = std::max(maxdiff, std::fabs(double(o_mode[i]) - o_ref[i]));
      std::sort(us.begin(), us.end());
      const double med = us[us.size() / 2];
      if (name == "all_gpu" && mode.graph && !model) gpu_us = med;
      if (name == "all_gpu" && model) gpu_us_model = med;
      const double base = model ? gpu_us_model : gpu_us;
      double hit = 0.0;
      size_t map_bytes = 0, meta_bytes = 0;
      if (bank) {
        const int64_t misses = bank->Counters().value().misses - dev_misses_before;
        hit = 1.0 - static_cast<double>(misses) / (static_cast<double>(steps) * tables * k);
        map_bytes = bank->map_bytes();
        meta_bytes = bank->slot_meta_bytes();
      } else if (hb) {
        hit = host_lookups > 0 ? 1.0 - static_cast<double>(host_misses) / host_lookups : 0.0;
        map_bytes = hb->device_map_bytes();
        meta_bytes = hb->slot_meta_bytes();
      }
      std::printf("%-6d %-13s %6s %6s %10.1f %10.2f %8.3f %9.4f %12zu %10.2e\n", batch,
                  mode.name, mode.graph ? "yes" : "no", model ? "yes" : "no", med, med / layers,
                  base / med, hit, map_bytes, maxdiff);
      char buf[640];
      std::snprintf(buf, sizeof(buf),
                    "%s{\"batch\": %d, \"mode\": \"%s\", \"graph\": %s, \"decode_step\": %s, "
                    "\"step_us\": %.2f, "
                    "\"us_per_layer\": %.3f, \"speed_vs_all_gpu\": %.4f, \"hit_rate\": %.4f, "
                    "\"device_map_bytes\": %zu, \"slot_meta_bytes\": %zu, "
                    "\"max_abs_diff_vs_all_gpu\": %.3e}",
                    first ? "" : ", ", batch, mode.name, mode.graph ? "true" : "false",
                    model ? "true" : "false", med, med / layers, base / med, hit, map_bytes,
                    meta_bytes, maxdiff);
      json += buf;
      first = false;
    }
    for (int b = 0; b < 1; ++b) {
      dev->FreeHost(miss_h[b]);
      dev->FreeDevice(miss_d[b]);
      dev->FreeDevice(stage[b]);
    }
    for (void* ptr : {static_cast<void*>(q), static_cast<void*>(o), static_cast<void*>(lse),
                      static_cast<void*>(o_b), static_cast<void*>(lse_b), static_cast<void*>(pos_d),
                      static_cast<void*>(items_d), static_cast<void*>(admit_d)}) {
      dev->FreeDevice(ptr);
    }
    dev->FreeHost(pos_h);
    dev->FreeHost(cstage_h);
    dev->FreeDevice(cstage_d);
    dev->FreeDevice(resolved_d);
    dev->FreeDevice(gpu);
    dev->FreeHost(host);
  }
  json += "]}\n";
  std::ofstream(out_path) << json;
  std::printf("\nwrote %s\n", out_path.c_str());
  if (weights != nullptr) {
    for (void* ptr : {static_cast<void*>(weights), static_cast<void*>(head),
                      static_cast<void*>(act), static_cast<void*>(act_out)}) {
      dev->FreeDevice(ptr);
    }
  }
  cublasDestroy(cublas);
  dev->FreeDevice(cublas_ws);
  dev->DestroyEvent(side_done);
  dev->DestroyEvent(resolved_ev);
  for (int l = 0; l < layers; ++l) {
    dev->DestroyEvent(list_ev[l]);
    dev->DestroyEvent(stage_ev[l]);
  }
  dev->DestroyStream(d2h);
  dev->DestroyStream(h2d);
  dev->DestroyEvent(step_done);
  for (int l = 0; l < layers; ++l) {
    dev->DestroyEvent(fork[l]);
    dev->DestroyEvent(join[l]);
  }
  dev->DestroyStream(miss_stream);
  dev->DestroyStream(side);
  dev->DestroyStream(s);
  return 0;
}
