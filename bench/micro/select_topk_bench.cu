// Copyright kvferry authors. Apache-2.0.
// The ranking stage of the device selection (cuda::LaunchSelectTopK), one CTA per item against the
// multi-CTA radix select, on the Llama-3.1-8B attention shape (8 KV heads, GQA 4) at batch 1 and 4:
//   oracle    top 2% of every position's group-summed softmax weight (n = the context);
//   sparcas   the same over the offloaded range (4 sinks, 64-token window);
//   quest     the best pages of 16 tokens (n = context / 16).
// Each timed launch starts from the same logits (a device copy, not timed). The lists of the
// paths are compared: equal unless two weights at the k-th place are within fp32 rounding (the
// two paths add the softmax sums in different orders; the logits are random normals).
// Prints one JSON object (also written to argv[1] when given).
// Usage: select_topk_bench [out.json] [--reps N (default 20)]

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "base/attn_types.h"
#include "bench/lib/check.h"
#include "gpu/cuda_kernels.h"

using namespace kvferry;

namespace {

struct Run {
  const char* name;
  SelectRanks ranks;
  int batch;
  int64_t n;  // context tokens
};

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      out_path = argv[i];
    }
  }
  constexpr int kHeads = 8, kGroup = 4, kSink = 4, kWindow = 64, kPage = 16;
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  cuda::LaunchInfo info;
  info.num_sms = prop.multiProcessorCount;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));

  std::vector<Run> runs;
  for (const char* name : {"oracle", "sparcas", "quest"}) {
    const SelectRanks s = !std::strcmp(name, "oracle")    ? SelectRanks::kPositions
                            : !std::strcmp(name, "sparcas") ? SelectRanks::kOffloaded
                                                            : SelectRanks::kPages;
    for (int batch : {1, 4}) {
      for (int64_t n : {4096, 8192, 16384, 32768, 65536, 131072}) runs.push_back({name, s, batch, n});
    }
  }
  std::string json = std::string("{\"device\": \"") + prop.name + "\", \"sms\": " +
                     std::to_string(prop.multiProcessorCount) + ", \"heads\": 8, \"group\": 4, " +
                     "\"budget\": \"2%\", \"reps\": " + std::to_string(reps) + ", \"runs\": [";
  std::printf("%-8s %5s %7s %7s %7s %12s %12s %12s %12s %8s %s\n", "policy", "batch", "n", "ranked",
              "k", "one_cta_us", "per_pass_us", "multi_cta_us", "auto_us", "speedup", "lists_equal");
  bool first = true;
  for (const Run& r : runs) {
    const bool quest = r.ranks == SelectRanks::kPages;
    const int64_t items = int64_t{r.batch} * kHeads;
    const int64_t ld = r.n;
    const int64_t budget = (r.n * 2 + 99) / 100;  // 2%
    const int64_t ranked = quest ? (r.n - kWindow - 1) / kPage + 1
                                 : (r.ranks == SelectRanks::kOffloaded ? r.n - kSink - kWindow : r.n);
    const int64_t k = quest ? (budget - kSink - kWindow) / kPage + 3
                            : (r.ranks == SelectRanks::kOffloaded ? budget - kSink - kWindow : budget);
    std::vector<float> logits(static_cast<size_t>(items * kGroup * ld));
    std::mt19937 rng(static_cast<uint32_t>(r.n + r.batch));
    std::normal_distribution<float> nd(0.f, 3.f);
    for (auto& x : logits) x = nd(rng);
    std::vector<int64_t> pos(static_cast<size_t>(r.batch), r.n - 1);
    std::vector<int32_t> slots(static_cast<size_t>(r.batch));
    for (int b = 0; b < r.batch; ++b) slots[b] = b;
    int64_t sort_cap = 1;
    while (sort_cap < budget) sort_cap <<= 1;
    float *d_src, *d_ws;
    int64_t* d_pos;
    int32_t *d_slots, *d_list, *d_count;
    unsigned long long* d_topk;
    uint32_t* d_mcta;
    const size_t ws_bytes = logits.size() * 4;
    const int64_t list_cap = budget + 8;
    CUDA_OK(cudaMalloc(&d_src, ws_bytes));
    CUDA_OK(cudaMalloc(&d_ws, ws_bytes));
    CUDA_OK(cudaMalloc(&d_pos, pos.size() * 8));
    CUDA_OK(cudaMalloc(&d_slots, slots.size() * 4));
    CUDA_OK(cudaMalloc(&d_list, static_cast<size_t>(items * list_cap) * 4));
    CUDA_OK(cudaMalloc(&d_count, static_cast<size_t>(items) * 4));
    CUDA_OK(cudaMalloc(&d_topk, static_cast<size_t>(items * sort_cap) * 8));
    CUDA_OK(cudaMalloc(&d_mcta, static_cast<size_t>(items * SelectMctaItemWords(kGroup)) * 4));
    CUDA_OK(cudaMemcpy(d_src, logits.data(), ws_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_pos, pos.data(), pos.size() * 8, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_slots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice));
    DecodeStepArgs a;
    a.params = AttnParams{kGroup, 128, DType::kBF16, 1.0f};
    a.batch = r.batch;
    a.num_kv_heads = kHeads;
    a.num_layers = 1;
    a.sink = kSink;
    a.window = kWindow;
    a.mode = StepRowMode::kList;
    a.budget_tokens = budget;
    a.budget_cap = budget;
    a.slots = d_slots;
    a.positions = d_pos;
    a.ranks = r.ranks;
    a.list = d_list;
    a.list_count = d_count;
    a.list_cap = list_cap;
    a.select_ws = d_ws;
    a.select_ld = ld;
    a.topk_ws = d_topk;
    a.select_mcta_ws = d_mcta;
    a.meta_page = kPage;
    // multi_cta: the fused cooperative kernel where it fits; per_pass: a launch a pass.
    double us[4] = {0, 0, 0, 0};
    std::vector<int32_t> lists[4];
    const cuda::SelectTopKPath paths[4] = {cuda::SelectTopKPath::kOneCta,
                                           cuda::SelectTopKPath::kMultiCtaPerPass,
                                           cuda::SelectTopKPath::kMultiCta,
                                           cuda::SelectTopKPath::kAuto};
    for (int p = 0; p < 4; ++p) {
      for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up
        CUDA_OK(cudaMemcpyAsync(d_ws, d_src, ws_bytes, cudaMemcpyDeviceToDevice, stream));
        CUDA_OK(cudaEventRecord(e0, stream));
        BENCH_CHECK(cuda::LaunchSelectTopK(a, info, paths[p], stream));
        CUDA_OK(cudaEventRecord(e1, stream));
        CUDA_OK(cudaEventSynchronize(e1));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        if (rep > 0) us[p] += ms * 1e3 / reps;
      }
      lists[p].resize(static_cast<size_t>(items * list_cap));
      std::vector<int32_t> count(static_cast<size_t>(items));
      CUDA_OK(cudaMemcpy(count.data(), d_count, count.size() * 4, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(lists[p].data(), d_list, lists[p].size() * 4, cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < items; ++i) {  // only the written part is compared
        for (int64_t j = count[i]; j < list_cap; ++j) lists[p][i * list_cap + j] = -1;
      }
    }
    const bool equal = lists[0] == lists[1] && lists[0] == lists[2] && lists[0] == lists[3];
    std::printf("%-8s %5d %7lld %7lld %7lld %12.1f %12.1f %12.1f %12.1f %7.1fx %s\n", r.name,
                r.batch, static_cast<long long>(r.n), static_cast<long long>(ranked),
                static_cast<long long>(k), us[0], us[1], us[2], us[3], us[0] / us[2],
                equal ? "yes" : "NO");
    char row[512];
    std::snprintf(row, sizeof(row),
                  "%s{\"policy\": \"%s\", \"batch\": %d, \"n\": %lld, \"ranked\": %lld, \"k\": %lld, "
                  "\"one_cta_us\": %.2f, \"per_pass_us\": %.2f, \"multi_cta_us\": %.2f, "
                  "\"auto_us\": %.2f, "
                  "\"speedup\": %.2f, \"lists_equal\": %s}",
                  first ? "" : ", ", r.name, r.batch, static_cast<long long>(r.n),
                  static_cast<long long>(ranked), static_cast<long long>(k), us[0], us[1], us[2],
                  us[3], us[0] / us[2], equal ? "true" : "false");
    json += row;
    first = false;
    for (void* p : {static_cast<void*>(d_src), static_cast<void*>(d_ws), static_cast<void*>(d_pos),
                    static_cast<void*>(d_slots), static_cast<void*>(d_list),
                    static_cast<void*>(d_count), static_cast<void*>(d_topk),
                    static_cast<void*>(d_mcta)}) {
      CUDA_OK(cudaFree(p));
    }
  }
  json += "]}";
  std::printf("%s\n", json.c_str());
  if (!out_path.empty()) std::ofstream(out_path) << json << "\n";
  return 0;
}
