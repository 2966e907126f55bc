// Copyright kvferry authors. Apache-2.0.
// Kernel micro-benchmark: causal prefill attention of one layer, one chunk, at the Llama-3.1-8B
// shape (32 q / 8 KV heads, head_dim 128, bf16) for 8K and 32K tokens. The tensor-core kernel
// (LaunchPrefillAttention) reads q/o in the engine's [T, Hq, D] layout and K/V as [T, Hkv, D]
// rows; reported as ms and TFLOP/s (causal FLOPs = 4 * T^2 / 2 * head_dim * q_heads). Baseline in
// the same run: the decode kernel's prefill path (LaunchAttendPaged with num_q = T over 256-token
// pages, fp32 q/o, what the runtime ran before), at 8K only (it is ~1000x slower). Compare with
// torch SDPA on the same shape (scripts/device/torch_sdpa.py). Writes JSON to argv[1] (default
// bench/results/prefill.json).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

#include "bench/lib/check.h"
#include "gpu/cuda_kernels.h"

using namespace kvferry;

namespace {

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kGroup = kQHeads / kKvHeads;
constexpr int kPageTokens = 256;

// Deterministic pseudo-random values in [-2, 2) (a hash of the index), written on the device so
// that 32K-token inputs take no host time.
template <typename T>
__global__ void FillKernel(T* dst, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b9u ^ seed ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    const float f = (static_cast<float>(h >> 8) * (1.0f / 16777216.0f)) * 4.0f - 2.0f;
    if constexpr (std::is_same_v<T, float>) {
      dst[i] = f;
    } else {
      dst[i] = __float2bfloat16_rn(f);
    }
  }
}

template <typename T>
void Fill(T* dst, size_t n, uint32_t seed, cudaStream_t s) {
  FillKernel<T><<<1024, 256, 0, s>>>(dst, n, seed);
  CUDA_OK(cudaPeekAtLastError());
}

template <typename Fn>
float MedianMs(cudaStream_t s, int warmup, int reps, Fn&& fn) {
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  for (int r = 0; r < warmup; ++r) fn();
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    CUDA_OK(cudaEventRecord(a, s));
    fn();
    CUDA_OK(cudaEventRecord(b, s));
    CUDA_OK(cudaEventSynchronize(b));
    float t = 0.0f;
    CUDA_OK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CUDA_OK(cudaEventDestroy(a));
  CUDA_OK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void* Alloc(size_t bytes) {
  void* p = nullptr;
  CUDA_OK(cudaMalloc(&p, bytes));
  return p;
}

// The decode kernel's prefill path (the runtime's path before this kernel): fp32 q/o per item,
// K/V in 256-token pages.
float BaselineMs(int64_t tokens, const AttnParams& p, const cuda::LaunchInfo& info,
                 cudaStream_t s) {
  const int64_t pages = tokens / kPageTokens;
  const size_t page_bytes = 2 * kPageTokens * kHeadDim * 2;
  char* kv = static_cast<char*>(Alloc(kKvHeads * pages * page_bytes));
  Fill(reinterpret_cast<__nv_bfloat16*>(kv), kKvHeads * pages * page_bytes / 2, 11, s);
  std::vector<void*> page_ptrs(kKvHeads * pages);
  for (size_t i = 0; i < page_ptrs.size(); ++i) page_ptrs[i] = kv + i * page_bytes;
  void** d_pages = static_cast<void**>(Alloc(page_ptrs.size() * sizeof(void*)));
  CUDA_OK(cudaMemcpy(d_pages, page_ptrs.data(), page_ptrs.size() * sizeof(void*),
                     cudaMemcpyHostToDevice));
  const size_t q_floats = static_cast<size_t>(tokens) * kQHeads * kHeadDim;
  float* q = static_cast<float*>(Alloc(q_floats * 4));
  float* o = static_cast<float*>(Alloc(q_floats * 4));
  float* lse = static_cast<float*>(Alloc(static_cast<size_t>(tokens) * kQHeads * 4));
  Fill(q, q_floats, 12, s);
  std::vector<PagedAttnItem> items(kKvHeads);
  for (int h = 0; h < kKvHeads; ++h) {
    const size_t off = static_cast<size_t>(h) * tokens * kGroup;
    items[h].q = q + off * kHeadDim;
    items[h].o = o + off * kHeadDim;
    items[h].lse = lse + off;
    items[h].kv = KvPages{d_pages + h * pages, kPageTokens};
    items[h].q_pos0 = 0;
    items[h].num_q = static_cast<int32_t>(tokens);
  }
  auto* d_items = static_cast<PagedAttnItem*>(Alloc(items.size() * sizeof(PagedAttnItem)));
  CUDA_OK(cudaMemcpy(d_items, items.data(), items.size() * sizeof(PagedAttnItem),
                     cudaMemcpyHostToDevice));
  cuda::AttnWorkspace ws;  // 32 MiB, like CudaDevice's per-stream workspace
  ws.bytes = size_t{32} << 20;
  ws.data = static_cast<float*>(Alloc(ws.bytes));
  const float ms = MedianMs(
      s, 0, 1, [&] { BENCH_CHECK(cuda::LaunchAttendPaged(p, d_items, kKvHeads, info, ws, s)); });
  for (void* ptr : {static_cast<void*>(kv), static_cast<void*>(d_pages), static_cast<void*>(q),
                    static_cast<void*>(o), static_cast<void*>(lse), static_cast<void*>(d_items),
                    static_cast<void*>(ws.data)}) {
    CUDA_OK(cudaFree(ptr));
  }
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string out_path = argc > 1 ? argv[1] : "bench/results/prefill.json";
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("device: %s\n", prop.name);
  cuda::LaunchInfo info;
  info.num_sms = prop.multiProcessorCount;

  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHeadDim;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));

  std::string json = std::string("{\"device\": \"") + prop.name +
                     "\", \"q_heads\": 32, \"kv_heads\": 8, \"head_dim\": 128, \"dtype\": "
                     "\"bf16\", \"out_dtype\": \"bf16\", \"rows\": [";
  std::printf("\n%-8s %10s %10s %14s %10s\n", "tokens", "ms", "TFLOP/s", "baseline ms", "speedup");
  bool first = true;
  for (int64_t tokens : {8192, 32768}) {
    const size_t q_elems = static_cast<size_t>(tokens) * kQHeads * kHeadDim;
    const size_t kv_elems = static_cast<size_t>(tokens) * kKvHeads * kHeadDim;
    auto* q = static_cast<__nv_bfloat16*>(Alloc(q_elems * 2));
    auto* o = static_cast<__nv_bfloat16*>(Alloc(q_elems * 2));
    auto* k = static_cast<__nv_bfloat16*>(Alloc(kv_elems * 2));
    auto* v = static_cast<__nv_bfloat16*>(Alloc(kv_elems * 2));
    float* lse = static_cast<float*>(Alloc(static_cast<size_t>(tokens) * kQHeads * 4));
    Fill(q, q_elems, 1, s);
    Fill(k, kv_elems, 2, s);
    Fill(v, kv_elems, 3, s);
    // One item per KV head: q/o of head h's group inside the [T, 32, 128] tensors, K/V rows of
    // head h inside [T, 8, 128].
    std::vector<cuda::PrefillAttnItem> items(kKvHeads);
    for (int h = 0; h < kKvHeads; ++h) {
      items[h].q = q + h * kGroup * kHeadDim;
      items[h].q_stride_tok = kQHeads * kHeadDim;
      items[h].o = o + h * kGroup * kHeadDim;
      items[h].lse = lse + static_cast<size_t>(h) * tokens * kGroup;
      items[h].k = k + h * kHeadDim;
      items[h].v = v + h * kHeadDim;
      items[h].kv_stride = kKvHeads * kHeadDim;
      items[h].q_pos0 = 0;
      items[h].num_q = static_cast<int32_t>(tokens);
    }
    auto* d_items = static_cast<cuda::PrefillAttnItem*>(Alloc(items.size() * sizeof(items[0])));
    CUDA_OK(
        cudaMemcpy(d_items, items.data(), items.size() * sizeof(items[0]), cudaMemcpyHostToDevice));
    const int reps = tokens <= 8192 ? 30 : 10;
    const float ms = MedianMs(s, 2, reps, [&] {
      BENCH_CHECK(cuda::LaunchPrefillAttention(p, DType::kBF16, DType::kBF16, d_items, kKvHeads,
                                               static_cast<int32_t>(tokens), s));
    });
    const double flops = 4.0 * (static_cast<double>(tokens) * tokens / 2) * kHeadDim * kQHeads;
    const double tflops = flops / (ms * 1e-3) / 1e12;
    const float base_ms = tokens <= 8192 ? BaselineMs(tokens, p, info, s) : -1.0f;
    std::printf("%-8lld %10.3f %10.1f %14.1f %10.0f\n", static_cast<long long>(tokens), ms, tflops,
                base_ms, base_ms > 0 ? base_ms / ms : 0.0);
    char buf[320];
    std::snprintf(buf, sizeof(buf),
                  "%s{\"tokens\": %lld, \"ms\": %.4f, \"tflops\": %.1f, \"baseline_ms\": %s, "
                  "\"speedup_over_baseline\": %s}",
                  first ? "" : ", ", static_cast<long long>(tokens), ms, tflops,
                  base_ms > 0 ? std::to_string(base_ms).c_str() : "null",
                  base_ms > 0 ? std::to_string(base_ms / ms).c_str() : "null");
    json += buf;
    first = false;
    for (void* ptr :
         {static_cast<void*>(q), static_cast<void*>(o), static_cast<void*>(k),
          static_cast<void*>(v), static_cast<void*>(lse), static_cast<void*>(d_items)}) {
      CUDA_OK(cudaFree(ptr));
    }
  }
  json += "]}\n";
  std::ofstream(out_path) << json;
  std::printf("\nwrote %s\n", out_path.c_str());
  CUDA_OK(cudaStreamDestroy(s));
  return 0;
}
