// Copyright kvferry authors. Apache-2.0.
#pragma once
// The CPU worker pool of the CPU route: a TBB arena whose threads are pinned (hwloc) one per core
// to the cores of the GPU's NUMA node (all cores when there is no GPU), never more threads than
// cores. Attention jobs and their completions pass through bounded Boost.Lockfree queues; results
// are written straight into the caller's (pinned) o/lse buffers. oneDNN's OpenMP runtime is held to
// one thread on every worker so it cannot oversubscribe the pool.
//
// Thread safety: Submit may be called from any number of threads; completions are popped by one
// consumer at a time (TryPopCompletion / WaitCompletions from the thread that owns the step). The
// pool owns no job memory: q, o, lse, the pages and the position list of a job must stay valid
// until its completion has been popped.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cpu/attention.h"
#include "base/attn_types.h"
#include "kvferry/status.h"

namespace kvferry::cpu {

struct CpuPoolOptions {
  /// Worker threads; 0 = one per core of the chosen cpuset (but one above two cores: it is left to
  /// the calling thread).
  /// Clamped to the number of cores there.
  int threads = 0;
  /// PCI bus id of the GPU ("0000:65:00.0", as cudaDeviceGetPCIBusId writes it): the pool uses the
  /// cores of its NUMA node. Empty = no GPU: all cores of the machine.
  std::string gpu_pci_bus_id;
  /// Explicit NUMA node (OS index); overrides gpu_pci_bus_id when >= 0.
  int numa_node = -1;
  /// Pin each worker to one core; off leaves placement to the OS.
  bool pin = true;
  /// Capacity of each lock-free queue (jobs in flight at once).
  int queue_capacity = 4096;
};

/// One unit of CPU attention: a GQA group of one (sequence, layer, KV head) over a position list.
struct CpuJob {
  uint64_t tag = 0;  ///< returned in the completion
  int32_t slot = 0;
  int32_t layer = 0;
  int32_t kv_head = 0;
  AttnParams params;
  PositionAttnItem item;  ///< q in, o and lse out (caller's buffers)
};

struct CpuCompletion {
  uint64_t tag = 0;
  int32_t slot = 0;
  int32_t layer = 0;
  int32_t kv_head = 0;
  int32_t worker = -1;  ///< the worker that ran it, in [0, num_threads()) (below: a caller)
  int64_t rows = 0;     ///< K/V rows read
  int64_t ns = 0;       ///< time in the kernel
};

class CpuPool {
 public:
  /// Discovers the topology, picks the cores and starts the arena.
  static Result<std::unique_ptr<CpuPool>> Create(const CpuPoolOptions& options);
  ~CpuPool();
  CpuPool(const CpuPool&) = delete;
  CpuPool& operator=(const CpuPool&) = delete;

  [[nodiscard]] int num_threads() const { return static_cast<int>(cores_.size()); }
  /// OS index of the first PU of each worker's core, by arena slot.
  [[nodiscard]] const std::vector<int>& cores() const { return cores_; }
  /// NUMA node the cores belong to (-1 if unknown / all machine).
  [[nodiscard]] int numa_node() const { return numa_node_; }
  /// One line for logs and stats: cores, node, how they were chosen, kernel ISA.
  [[nodiscard]] const std::string& description() const { return description_; }

  /// Queues \p job; kResourceExhausted when the job queue is full (nothing queued then).
  [[nodiscard]] Status Submit(const CpuJob& job);
  /// Pops one completion if there is one.
  bool TryPopCompletion(CpuCompletion* out);
  /// Blocks until \p count completions have been popped; writes them to \p out if non-null.
  void WaitCompletions(int64_t count, CpuCompletion* out = nullptr);
  /// Submits every job (waiting for queue room as needed) and waits for all of them.
  [[nodiscard]] Status Run(std::span<const CpuJob> jobs);

  /// Runs fn(i), i in [0, n), on the pool's pinned threads; returns when all are done. For work
  /// that is not a CpuJob (dense attention, scoring); do not call from inside a pool task.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);
  /// ParallelFor, with the calling thread running \p first while the pool's threads start on fn,
  /// then joining them: for work the items may wait on that must not wait behind them (a decode
  /// step's device launches). With no other thread the items run after \p first.
  void ParallelForBeside(int64_t n, const std::function<void(int64_t)>& fn,
                         const std::function<void()>& first);

  /// Keeps up to \p threads workers spinning (pause loop) until the next ParallelFor starts or
  /// \p max_us microseconds pass, whichever comes first, so that its items start on threads that
  /// are awake (a sleeping TBB worker takes tens of microseconds to wake). For a caller about to
  /// wait briefly (a decode step waiting for q) and then fork; returns at once.
  void KeepWarm(int threads, int64_t max_us);

  /// Jobs submitted and not yet popped as completions.
  [[nodiscard]] int64_t in_flight() const { return in_flight_.load(std::memory_order_acquire); }

 private:
  struct Impl;
  CpuPool() = default;
  void RunOneJob();

  std::unique_ptr<Impl> impl_;
  std::vector<int> cores_;
  int numa_node_ = -1;
  std::string description_;
  std::atomic<int64_t> in_flight_{0};
};

}  // namespace kvferry::cpu
