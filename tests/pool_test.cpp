// Copyright kvferry authors. Apache-2.0.
// The CPU worker pool: many concurrent jobs of random sizes give exactly the results of sequential
// execution, threads never exceed cores, and completions carry the job's identity.
#include "cpu/pool.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "cpu/attention.h"
#include "cpu/dtype.h"

namespace kvferry::cpu {
namespace {

struct Head {
  std::vector<std::vector<uint16_t>> storage;
  std::vector<void*> pages;
  KvPages kv;
};

Head MakeHead(int64_t n, int hd, int page_tokens, std::mt19937& rng) {
  std::normal_distribution<float> dist;
  Head h;
  for (int64_t p = 0; p < (n + page_tokens - 1) / page_tokens; ++p) {
    h.storage.emplace_back(static_cast<size_t>(2) * page_tokens * hd);
    for (uint16_t& x : h.storage.back()) x = F32ToBf16(dist(rng));
  }
  for (auto& s : h.storage) h.pages.push_back(s.data());
  h.kv.pages = h.pages.data();
  h.kv.page_tokens = page_tokens;
  return h;
}

TEST(CpuPoolTest, NeverMoreThreadsThanCores) {
  CpuPoolOptions opt;
  opt.threads = 4096;
  auto pool = CpuPool::Create(opt);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_GE((*pool)->num_threads(), 1);
  EXPECT_LE((*pool)->num_threads(), static_cast<int>(std::thread::hardware_concurrency()));
  EXPECT_NE((*pool)->description().find("clamped"), std::string::npos) << (*pool)->description();
  std::set<int> distinct((*pool)->cores().begin(), (*pool)->cores().end());
  EXPECT_EQ(distinct.size(), (*pool)->cores().size());
}

TEST(CpuPoolTest, UnknownGpuFallsBackToAllCores) {
  CpuPoolOptions opt;
  opt.gpu_pci_bus_id = "0000:ff:1f.7";
  auto pool = CpuPool::Create(opt);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_NE((*pool)->description().find("all cores"), std::string::npos)
      << (*pool)->description();
}

TEST(CpuPoolTest, RejectsBadOptions) {
  CpuPoolOptions opt;
  opt.threads = -1;
  EXPECT_EQ(CpuPool::Create(opt).status().code(), StatusCode::kInvalidArgument);
  opt.threads = 0;
  opt.numa_node = 9999;
  EXPECT_EQ(CpuPool::Create(opt).status().code(), StatusCode::kInvalidArgument);
}

// Random (sequence, layer, head) jobs of random sizes, submitted from several threads at once into
// a small queue, equal the same jobs run one after another on this thread, bit for bit.
TEST(CpuPoolTest, ConcurrentJobsEqualSequentialExecution) {
  constexpr int kHeads = 6, kJobs = 600, kHd = 128, kGroup = 4;
  std::mt19937 rng(5);
  std::vector<Head> heads;
  for (int h = 0; h < kHeads; ++h) heads.push_back(MakeHead(3000 + 500 * h, kHd, 256, rng));
  AttnParams p;
  p.group = kGroup;
  p.head_dim = kHd;
  p.kv_dtype = DType::kBF16;
  p.scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  std::normal_distribution<float> dist;
  std::vector<std::vector<int32_t>> positions(kJobs);
  std::vector<float> q(static_cast<size_t>(kJobs) * kGroup * kHd);
  for (float& x : q) x = dist(rng);
  std::vector<CpuJob> jobs(kJobs);
  for (int j = 0; j < kJobs; ++j) {
    const int h = j % kHeads;
    const int64_t n = 3000 + 500 * h;
    std::uniform_int_distribution<int> len(0, 2500);
    positions[j].resize(static_cast<size_t>(len(rng)));
    for (int32_t& x : positions[j]) x = static_cast<int32_t>(rng() % n);
    jobs[j].tag = static_cast<uint64_t>(j);
    jobs[j].slot = j % 3;
    jobs[j].layer = j % 5;
    jobs[j].kv_head = h;
    jobs[j].params = p;
    jobs[j].item.q = q.data() + static_cast<size_t>(j) * kGroup * kHd;
    jobs[j].item.kv = heads[h].kv;
    jobs[j].item.positions = positions[j].data();
    jobs[j].item.count = static_cast<int32_t>(positions[j].size());
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> o_seq(q.size(), nan), lse_seq(static_cast<size_t>(kJobs) * kGroup, nan);
  std::vector<float> o_par(q.size(), nan), lse_par(lse_seq.size(), nan);
  for (int j = 0; j < kJobs; ++j) {
    CpuJob job = jobs[j];
    job.item.o = o_seq.data() + static_cast<size_t>(j) * kGroup * kHd;
    job.item.lse = lse_seq.data() + static_cast<size_t>(j) * kGroup;
    AttendPositions(job.params, &job.item, 1);
  }
  for (int j = 0; j < kJobs; ++j) {
    jobs[j].item.o = o_par.data() + static_cast<size_t>(j) * kGroup * kHd;
    jobs[j].item.lse = lse_par.data() + static_cast<size_t>(j) * kGroup;
  }
  CpuPoolOptions opt;
  opt.queue_capacity = 64;  // small, so producers hit a full queue
  auto pool_or = CpuPool::Create(opt);
  ASSERT_TRUE(pool_or.ok()) << pool_or.status().ToString();
  CpuPool& pool = **pool_or;
  // Three producers submit interleaved thirds; this thread consumes completions meanwhile.
  std::vector<std::thread> producers;
  for (int t = 0; t < 3; ++t) {
    producers.emplace_back([&, t] {
      for (int j = t; j < kJobs; j += 3) {
        while (!pool.Submit(jobs[j]).ok()) std::this_thread::yield();
      }
    });
  }
  std::vector<CpuCompletion> done(kJobs);
  pool.WaitCompletions(kJobs, done.data());
  for (auto& th : producers) th.join();
  EXPECT_EQ(pool.in_flight(), 0);
  std::vector<int> seen(kJobs, 0);
  for (const CpuCompletion& c : done) {
    ASSERT_LT(c.tag, static_cast<uint64_t>(kJobs));
    ++seen[c.tag];
    EXPECT_EQ(c.kv_head, jobs[c.tag].kv_head);
    EXPECT_EQ(c.layer, jobs[c.tag].layer);
    EXPECT_EQ(c.rows, jobs[c.tag].item.count);
    EXPECT_GE(c.worker, 0);
    EXPECT_LT(c.worker, pool.num_threads());
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), kJobs);
  // Same kernel, same inputs: identical bits (NaN-poisoned outputs would compare unequal).
  EXPECT_EQ(0, std::memcmp(o_seq.data(), o_par.data(), o_seq.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(lse_seq.data(), lse_par.data(), lse_seq.size() * sizeof(float)));
  double norm = 0;
  for (float x : o_par) norm += std::abs(x);
  EXPECT_GT(norm, 1.0);
  // Run() is the same thing in one call.
  std::fill(o_par.begin(), o_par.end(), nan);
  std::fill(lse_par.begin(), lse_par.end(), nan);
  ASSERT_TRUE(pool.Run(jobs).ok());
  EXPECT_EQ(0, std::memcmp(o_seq.data(), o_par.data(), o_seq.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(lse_seq.data(), lse_par.data(), lse_seq.size() * sizeof(float)));
}

TEST(CpuPoolTest, ParallelForRunsEveryIndexOnce) {
  auto pool = CpuPool::Create(CpuPoolOptions{});
  ASSERT_TRUE(pool.ok());
  std::vector<std::atomic<int>> hits(1000);
  (*pool)->ParallelFor(1000, [&](int64_t i) { hits[i].fetch_add(1); });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

// ParallelForBeside: every index once, and items that wait for what the calling thread's `first`
// does finish, with one thread (the items then run after it) or several (beside it).
TEST(CpuPoolTest, ParallelForBesideRunsFirstBesideTheItems) {
  for (const int threads : {1, 4}) {
    CpuPoolOptions opt;
    opt.threads = threads;
    opt.pin = false;
    auto pool = CpuPool::Create(opt);
    ASSERT_TRUE(pool.ok());
    for (int round = 0; round < 10; ++round) {
      std::vector<std::atomic<int>> hits(32);
      std::atomic<bool> launched{false};
      std::atomic<int> firsts{0};
      (*pool)->ParallelForBeside(
          32,
          [&](int64_t i) {
            while (!launched.load(std::memory_order_acquire)) std::this_thread::yield();
            hits[i].fetch_add(1);
          },
          [&] {
            firsts.fetch_add(1);
            launched.store(true, std::memory_order_release);
          });
      EXPECT_EQ(firsts.load(), 1);
      for (auto& h : hits) EXPECT_EQ(h.load(), 1) << "threads " << threads;
    }
  }
}

// With a core left to the caller the arena keeps a slot for it: the calling thread runs
// ParallelForBeside's `first` itself (it enters at once, no hand-off to a worker) and keeps its
// own CPU binding there (the observer pins workers only); completions still number the workers
// from 0.
TEST(CpuPoolTest, TheCallerKeepsItsSlotAndItsBinding) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "needs two cores";
  CpuPoolOptions opt;
  opt.threads = 1;  // fewer than the cores: a slot is kept for the caller
  opt.pin = true;
  auto pool = CpuPool::Create(opt);
  ASSERT_TRUE(pool.ok());
  cpu_set_t before;
  CPU_ZERO(&before);
  ASSERT_EQ(sched_getaffinity(0, sizeof(before), &before), 0);
  const std::thread::id caller = std::this_thread::get_id();
  for (int round = 0; round < 5; ++round) {
    std::thread::id ran_first;
    cpu_set_t inside;
    CPU_ZERO(&inside);
    std::vector<std::atomic<int>> hits(16);
    (*pool)->ParallelForBeside(
        16, [&](int64_t i) { hits[i].fetch_add(1); },
        [&] {
          ran_first = std::this_thread::get_id();
          sched_getaffinity(0, sizeof(inside), &inside);
        });
    EXPECT_EQ(ran_first, caller) << "round " << round;
    EXPECT_TRUE(CPU_EQUAL(&inside, &before)) << "the caller was re-pinned, round " << round;
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  }
  cpu_set_t after;
  CPU_ZERO(&after);
  ASSERT_EQ(sched_getaffinity(0, sizeof(after), &after), 0);
  EXPECT_TRUE(CPU_EQUAL(&after, &before));
}

// KeepWarm's spinners leave at the next ParallelFor (every index still runs once, and the fork
// does not wait for their deadline), at their deadline with no fork, and when the pool goes while
// some are still queued or spinning.
TEST(CpuPoolTest, KeepWarmSpinnersYieldToTheNextForkAndThePool) {
  CpuPoolOptions opt;
  opt.threads = 4;
  opt.pin = false;
  auto pool = CpuPool::Create(opt);
  ASSERT_TRUE(pool.ok());
  for (int round = 0; round < 20; ++round) {
    (*pool)->KeepWarm((*pool)->num_threads(), 10'000'000);  // 10 s: only the fork ends them
    std::vector<std::atomic<int>> hits(64);
    const auto t0 = std::chrono::steady_clock::now();
    (*pool)->ParallelFor(64, [&](int64_t i) { hits[i].fetch_add(1); });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << round;
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  }
  (*pool)->KeepWarm((*pool)->num_threads(), 1000);  // ends by its deadline
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  (*pool)->KeepWarm((*pool)->num_threads(), 10'000'000);
  pool->reset();  // spinners see the epoch move and leave; the arena joins them
}

}  // namespace
}  // namespace kvferry::cpu
