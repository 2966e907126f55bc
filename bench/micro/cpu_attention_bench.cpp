// Copyright kvferry authors. Apache-2.0.
// CPU attention throughput, written as JSON (own main; no Google Benchmark fixtures):
//  - sparse attention over 2048 random positions per KV head (GQA 4, head_dim 128, bf16) through
//    the pinned worker pool at 1..16 threads, as GB/s of K/V rows read, against the 16-thread
//    host DRAM limit (89 GB/s measured on the GPU machine; docs/cpu.md);
//  - the same at 1 thread for every kernel family this CPU has (scalar vs SIMD ratio);
//  - dense decode attention (oneDNN matmul, and the SIMD kernels) at 32K and 128K tokens.
// Usage: cpu_attention_bench [out.json] [--quick]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>

#include "cpu/attention.h"
#include "cpu/cpu_features.h"
#include "cpu/dtype.h"
#include "cpu/kernels.h"
#include "cpu/pool.h"

namespace kvferry::cpu {
namespace {

constexpr double kDramLimitGBs = 89.0;  // 16-thread host DRAM read bandwidth, GPU machine
constexpr int kHd = 128, kGroup = 4, kPageTokens = 256;

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// KV heads of n tokens each in the host store's page layout, filled with small random bf16.
// One 2 MiB-aligned arena with transparent huge pages requested (a 4 KiB-page TLB cannot map a
// 1 GiB random-row working set: every row would add a page walk), first-touched page by page by
// the pinned pool threads so the memory spreads over the node(s) the workers run on, as a host
// store filled by many threads would be.
struct Heads {
  char* arena = nullptr;
  size_t arena_bytes = 0;
  std::vector<std::vector<void*>> ptrs;
  std::vector<KvPages> kv;
  Heads(int num_heads, int64_t n, CpuPool* toucher) {
    const int64_t num_pages = (n + kPageTokens - 1) / kPageTokens;
    const size_t page_elems = static_cast<size_t>(2) * kPageTokens * kHd;
    const size_t page_bytes = page_elems * sizeof(uint16_t);
    const size_t total_pages = static_cast<size_t>(num_heads) * num_pages;
    constexpr size_t kHuge = size_t{2} << 20;
    arena_bytes = (total_pages * page_bytes + kHuge - 1) / kHuge * kHuge;
    void* mem = mmap(nullptr, arena_bytes + kHuge, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) std::abort();
    arena = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(mem) + kHuge - 1) / kHuge * kHuge);
    madvise(arena, arena_bytes, MADV_HUGEPAGE);
    auto fill = [&](int64_t pi) {
      uint64_t state = 0x9e3779b97f4a7c15ull ^ (static_cast<uint64_t>(pi + 1) * 0xbf58476d1ce4e5b9ull);
      uint16_t* dst = reinterpret_cast<uint16_t*>(arena + static_cast<size_t>(pi) * page_bytes);
      for (size_t i = 0; i < page_elems; ++i) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // bf16 in about [-1, 1]: sign, exponent 121..127, random mantissa
        dst[i] = static_cast<uint16_t>(((state >> 8) & 0x8000u) | ((121u + (state >> 20) % 7u) << 7) |
                                       (state & 0x7fu));
      }
    };
    if (toucher != nullptr) {
      toucher->ParallelFor(static_cast<int64_t>(total_pages), fill);
    } else {
      for (size_t pi = 0; pi < total_pages; ++pi) fill(static_cast<int64_t>(pi));
    }
    ptrs.resize(static_cast<size_t>(num_heads));
    for (int h = 0; h < num_heads; ++h) {
      for (int64_t p = 0; p < num_pages; ++p) {
        ptrs[h].push_back(arena + (static_cast<size_t>(h) * num_pages + p) * page_bytes);
      }
    }
    for (auto& p : ptrs) kv.push_back(KvPages{p.data(), kPageTokens});
  }
  ~Heads() {
    // The mapping began up to 2 MiB before the arena; unmapping the arena part is enough here.
    munmap(arena, arena_bytes);
  }
  Heads(const Heads&) = delete;
  Heads& operator=(const Heads&) = delete;
};

std::string ReadFirstLine(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

struct Jobs {
  std::vector<std::vector<int32_t>> positions;
  std::vector<float> q, o, lse;
  std::vector<CpuJob> jobs;
};

Jobs MakeJobs(const Heads& heads, int64_t n, int positions_per_head, int num_jobs) {
  Jobs j;
  std::mt19937 rng(42);
  std::normal_distribution<float> dist;
  j.q.resize(static_cast<size_t>(num_jobs) * kGroup * kHd);
  for (float& x : j.q) x = dist(rng);
  j.o.resize(j.q.size());
  j.lse.resize(static_cast<size_t>(num_jobs) * kGroup);
  j.positions.resize(static_cast<size_t>(num_jobs));
  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  for (int i = 0; i < num_jobs; ++i) {
    auto& pos = j.positions[i];
    pos.resize(static_cast<size_t>(positions_per_head));
    for (int32_t& x : pos) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(n));
    std::sort(pos.begin(), pos.end());  // the runtime hands ascending positions
    CpuJob job;
    job.tag = static_cast<uint64_t>(i);
    job.kv_head = i % static_cast<int>(heads.kv.size());
    job.params = p;
    job.item.q = j.q.data() + static_cast<size_t>(i) * kGroup * kHd;
    job.item.o = j.o.data() + static_cast<size_t>(i) * kGroup * kHd;
    job.item.lse = j.lse.data() + static_cast<size_t>(i) * kGroup;
    job.item.kv = heads.kv[job.kv_head];
    job.item.positions = pos.data();
    job.item.count = positions_per_head;
    j.jobs.push_back(job);
  }
  return j;
}

double BytesPerJob(int positions) { return 2.0 * positions * kHd * 2.0; }  // K and V rows

std::string Fmt(double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.4g", x);
  return buf;
}

}  // namespace
}  // namespace kvferry::cpu

int main(int argc, char** argv) {
  using namespace kvferry::cpu;  // NOLINT
  std::string out_path = "bench/results/cpu_attention.json";
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      out_path = argv[i];
    }
  }
  const int positions = 2048;
  // Enough distinct KV that the rows come from DRAM, not the LLC: 64 heads x 32K tokens = 1 GiB.
  const int num_heads = quick ? 8 : 64;
  const int64_t n = quick ? 8192 : 32768;
  const int num_jobs = quick ? 64 : 1024;
  std::fprintf(stderr, "allocating %d heads x %lld tokens\n", num_heads, static_cast<long long>(n));
  std::unique_ptr<CpuPool> toucher;
  {
    CpuPoolOptions opt;
    opt.threads = 16;
    auto pool_or = CpuPool::Create(opt);
    if (pool_or.ok()) toucher = std::move(*pool_or);
  }
  Heads heads(num_heads, n, toucher.get());
  toucher.reset();
  Jobs jobs = MakeJobs(heads, n, positions, num_jobs);
  std::string json = "{\n  \"bench\": \"cpu_attention\",\n";
  json += "  \"cpu_isa\": \"" + std::string(AttendRowsImplName()) + "\",\n";
  json += "  \"dram_limit_gbs\": " + Fmt(kDramLimitGBs) + ",\n";
  json += "  \"shape\": {\"head_dim\": 128, \"group\": 4, \"dtype\": \"bf16\", \"positions\": " +
          std::to_string(positions) + ", \"tokens_per_head\": " + std::to_string(n) +
          ", \"heads\": " + std::to_string(num_heads) + "},\n";
  json += "  \"thp\": \"" + ReadFirstLine("/sys/kernel/mm/transparent_hugepage/enabled") + "\",\n";
  json += "  \"memory\": \"one 2 MiB-aligned MADV_HUGEPAGE arena, first-touched by 16 pinned pool threads\",\n";
  json += "  \"gather_prefetch\": {\"rows\": " + std::to_string(g_gather_prefetch_rows) +
          ", \"hint\": " + std::to_string(g_gather_prefetch_hint) + "},\n";

  // Sparse attention through the pool, 1..16 threads.
  json += "  \"sparse_pool\": [\n";
  double gbs_16 = 0.0;
  bool first = true;
  for (int threads : {1, 2, 4, 8, 12, 16}) {
    CpuPoolOptions opt;
    opt.threads = threads;
    auto pool_or = CpuPool::Create(opt);
    if (!pool_or.ok()) {
      std::fprintf(stderr, "pool: %s\n", pool_or.status().ToString().c_str());
      return 1;
    }
    CpuPool& pool = **pool_or;
    if (pool.num_threads() < threads && threads > 1) break;  // no more cores
    (void)pool.Run(std::span<const CpuJob>(jobs.jobs.data(), std::min<size_t>(64, jobs.jobs.size())));
    const int reps = quick ? 2 : 3;
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      const double t0 = Seconds();
      if (!pool.Run(jobs.jobs).ok()) return 1;
      best = std::min(best, Seconds() - t0);
    }
    const double gbs = BytesPerJob(positions) * num_jobs / best / 1e9;
    if (threads == 16) gbs_16 = gbs;
    json += std::string(first ? "" : ",\n") + "    {\"threads\": " + std::to_string(threads) +
            ", \"gbs\": " + Fmt(gbs) + ", \"frac_of_dram_limit\": " + Fmt(gbs / kDramLimitGBs) +
            ", \"us_per_head\": " + Fmt(best / num_jobs * 1e6 * pool.num_threads()) +
            ", \"pool\": \"" + pool.description() + "\"}";
    first = false;
    std::fprintf(stderr, "sparse %2d threads: %.2f GB/s\n", threads, gbs);
  }
  json += "\n  ],\n";
  json += "  \"sparse_16_threads_gbs\": " + Fmt(gbs_16) + ",\n";
  json += "  \"target_frac_at_16_threads\": 0.7,\n";

  // Prefetch distance / level sweep of the gather kernel (tuning record; the default is above).
  json += "  \"prefetch_sweep\": [\n";
  first = true;
  {
    const int def_rows = g_gather_prefetch_rows, def_hint = g_gather_prefetch_hint;
    for (int threads : {16, 1}) {
      CpuPoolOptions opt;
      opt.threads = threads;
      auto pool_or = CpuPool::Create(opt);
      if (!pool_or.ok()) break;
      CpuPool& pool = **pool_or;
      const size_t njobs = threads == 1 ? std::min<size_t>(256, jobs.jobs.size()) : jobs.jobs.size();
      std::span<const CpuJob> js(jobs.jobs.data(), njobs);
      for (auto [rows, hint] : {std::pair{4, 0}, std::pair{8, 0}, std::pair{16, 0}, std::pair{24, 0},
                                std::pair{32, 0}, std::pair{64, 0}, std::pair{16, 1},
                                std::pair{32, 1}}) {
        SetGatherPrefetch(rows, hint);
        (void)pool.Run(std::span<const CpuJob>(jobs.jobs.data(), std::min<size_t>(64, njobs)));
        double best = 1e30;
        for (int r = 0; r < (quick ? 1 : 3); ++r) {
          const double t0 = Seconds();
          if (!pool.Run(js).ok()) return 1;
          best = std::min(best, Seconds() - t0);
        }
        const double gbs = BytesPerJob(positions) * static_cast<double>(njobs) / best / 1e9;
        json += std::string(first ? "" : ",\n") + "    {\"threads\": " + std::to_string(threads) +
                ", \"rows\": " + std::to_string(rows) + ", \"hint\": " + std::to_string(hint) +
                ", \"gbs\": " + Fmt(gbs) + "}";
        first = false;
        std::fprintf(stderr, "sweep %2d threads prefetch %2d rows hint %d: %.2f GB/s\n", threads, rows,
                     hint, gbs);
      }
    }
    SetGatherPrefetch(def_rows, def_hint);
  }
  json += "\n  ],\n";

  // Every kernel family at one thread.
  json += "  \"sparse_single_thread_by_isa\": {";
  double scalar_gbs = 0.0, best_gbs = 0.0;
  first = true;
  for (int i = 0; i < kNumCpuIsas; ++i) {
    const CpuKernels* k = GetCpuKernels(static_cast<CpuIsa>(i));
    if (k == nullptr) continue;
    const int count = static_cast<CpuIsa>(i) == CpuIsa::kScalar ? std::min(num_jobs, 32)
                                                                 : std::min(num_jobs, 256);
    double best = 1e30;
    for (int r = 0; r < 2; ++r) {
      const double t0 = Seconds();
      for (int j = 0; j < count; ++j) k->attend_positions(jobs.jobs[j].params, jobs.jobs[j].item);
      best = std::min(best, Seconds() - t0);
    }
    const double gbs = BytesPerJob(positions) * count / best / 1e9;
    if (i == 0) scalar_gbs = gbs;
    best_gbs = gbs;
    json += std::string(first ? "" : ", ") + "\"" + k->name + "\": " + Fmt(gbs);
    first = false;
    std::fprintf(stderr, "single thread %s: %.2f GB/s\n", k->name, gbs);
  }
  json += "},\n  \"simd_over_scalar_single_thread\": " + Fmt(best_gbs / scalar_gbs) + ",\n";

  // Dense decode attention (the dense-CPU baseline): one GQA group over n tokens.
  json += "  \"dense_decode\": [\n";
  first = true;
  for (int64_t dn : {int64_t{32768}, int64_t{131072}}) {
    const int64_t tokens = quick ? dn / 8 : dn;
    Heads dense(1, tokens, nullptr);
    kvferry::AttnParams p = jobs.jobs[0].params;
    std::vector<float> q(kGroup * kHd, 0.1f), o(kGroup * kHd), lse(kGroup);
    kvferry::PagedAttnItem item{q.data(), o.data(), lse.data(), dense.kv[0], tokens - 1, 1};
    for (DenseImpl impl : {DenseImpl::kOneDnn, DenseImpl::kSimd}) {
      if (!AttendPagedWith(impl, p, item)) continue;  // warm-up; false = unavailable
      double best = 1e30;
      for (int r = 0; r < 3; ++r) {
        const double t0 = Seconds();
        AttendPagedWith(impl, p, item);
        best = std::min(best, Seconds() - t0);
      }
      const double gbs = 2.0 * tokens * kHd * 2.0 / best / 1e9;
      const char* name = impl == DenseImpl::kOneDnn ? "onednn" : "simd";
      json += std::string(first ? "" : ",\n") + "    {\"tokens\": " + std::to_string(tokens) +
              ", \"impl\": \"" + name + "\", \"threads\": 1, \"ms\": " + Fmt(best * 1e3) +
              ", \"gbs\": " + Fmt(gbs) + ", \"onednn_impl\": \"" + OneDnnMatmulImplName(p) +
              "\"}";
      first = false;
      std::fprintf(stderr, "dense %lld %s: %.3f ms\n", static_cast<long long>(tokens), name,
                   best * 1e3);
    }
  }
  json += "\n  ]\n}\n";
  std::ofstream(out_path) << json;
  std::fprintf(stderr, "wrote %s\n", out_path.c_str());
  return 0;
}
