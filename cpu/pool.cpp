// Copyright kvferry authors. Apache-2.0.
#include "cpu/pool.h"

#include <hwloc.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>

#include <boost/lockfree/queue.hpp>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_group.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include "cpu/cpu_features.h"
#include "base/check.h"
#include "base/hwloc_lock.h"

namespace kvferry::cpu {
namespace {

// Waits politely: a short spin (completions usually arrive within microseconds), then yields.
class Backoff {
 public:
  void Pause() {
    if (spins_ < 256) {
      ++spins_;
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
  void Reset() { spins_ = 0; }

 private:
  int spins_ = 0;
};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// Pins every thread that enters the arena to the core of its arena slot, and restores its previous
// binding when it leaves (TBB workers are shared between arenas).
class PinningObserver final : public tbb::task_scheduler_observer {
 public:
  // master_slots: the arena's slots reserved for callers (before the workers' slots); a caller
  // that enters through one stays where it runs.
  PinningObserver(tbb::task_arena& arena, hwloc_topology_t topo,
                  const std::vector<hwloc_bitmap_t>& core_sets, bool pin, int master_slots)
      : tbb::task_scheduler_observer(arena), topo_(topo), core_sets_(core_sets), pin_(pin),
        master_slots_(master_slots) {
    observe(true);
  }
  ~PinningObserver() override { observe(false); }

  void on_scheduler_entry(bool is_worker) override {
    LimitOneDnnThreadsOnThisThread();
    if (!pin_ || (!is_worker && master_slots_ > 0)) return;
    const int idx = tbb::this_task_arena::current_thread_index() - (is_worker ? master_slots_ : 0);
    if (idx < 0 || idx >= static_cast<int>(core_sets_.size())) return;
    Saved& saved = SavedBinding();
    if (saved.set == nullptr) saved.set = hwloc_bitmap_alloc();
    saved.valid = hwloc_get_cpubind(topo_, saved.set, HWLOC_CPUBIND_THREAD) == 0;
    hwloc_set_cpubind(topo_, core_sets_[idx], HWLOC_CPUBIND_THREAD);
  }
  void on_scheduler_exit(bool is_worker) override {
    if (!pin_ || (!is_worker && master_slots_ > 0)) return;
    Saved& saved = SavedBinding();
    if (saved.valid) hwloc_set_cpubind(topo_, saved.set, HWLOC_CPUBIND_THREAD);
    saved.valid = false;
  }

 private:
  struct Saved {
    hwloc_bitmap_t set = nullptr;
    bool valid = false;
    ~Saved() {
      if (set != nullptr) hwloc_bitmap_free(set);
    }
  };
  static Saved& SavedBinding() {
    thread_local Saved saved;
    return saved;
  }

  hwloc_topology_t topo_;
  const std::vector<hwloc_bitmap_t>& core_sets_;
  bool pin_;
  int master_slots_ = 0;
};

struct CpuPool::Impl {
  hwloc_topology_t topo = nullptr;
  std::vector<hwloc_bitmap_t> core_sets;
  std::unique_ptr<tbb::global_control> parallelism;
  std::unique_ptr<tbb::task_arena> arena;
  int master_slots = 0;  // the arena's slots kept for callers, before the workers'
  std::unique_ptr<PinningObserver> observer;
  std::unique_ptr<boost::lockfree::queue<CpuJob>> jobs;
  std::unique_ptr<boost::lockfree::queue<CpuCompletion>> done;
  // KeepWarm's spinners stop when this changes (every ParallelFor and the destructor bump it);
  // shared with them, so that one still queued when the pool goes reads live memory.
  std::shared_ptr<std::atomic<uint64_t>> warm_epoch = std::make_shared<std::atomic<uint64_t>>(0);

  ~Impl() {
    warm_epoch->fetch_add(1, std::memory_order_release);
    observer.reset();
    arena.reset();
    for (hwloc_bitmap_t s : core_sets) hwloc_bitmap_free(s);
    if (topo != nullptr) hwloc_topology_destroy(topo);
  }
};

Result<std::unique_ptr<CpuPool>> CpuPool::Create(const CpuPoolOptions& options) {
  KVF_CHECK_ARG(options.threads >= 0, "cpu threads ", options.threads, " must be >= 0");
  KVF_CHECK_ARG(options.queue_capacity >= 1 && options.queue_capacity <= 65534,
                "cpu queue capacity ", options.queue_capacity, " out of range [1, 65534]");
  std::unique_ptr<CpuPool> pool(new CpuPool());
  pool->impl_ = std::make_unique<Impl>();
  Impl& impl = *pool->impl_;
  {
    std::lock_guard<std::mutex> lock(detail::HwlocLoadMutex());  // see base/hwloc_lock.h
    KVF_CHECK_CODE(hwloc_topology_init(&impl.topo) == 0, StatusCode::kInternal,
                   "hwloc_topology_init failed");
    hwloc_topology_set_io_types_filter(impl.topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    KVF_CHECK_CODE(hwloc_topology_load(impl.topo) == 0, StatusCode::kInternal,
                   "hwloc_topology_load failed");
  }

  hwloc_const_cpuset_t allowed = hwloc_topology_get_allowed_cpuset(impl.topo);
  hwloc_obj_t scope = hwloc_get_root_obj(impl.topo);
  std::string how = "all cores (no GPU given)";
  if (options.numa_node >= 0) {
    hwloc_obj_t node = nullptr;
    while ((node = hwloc_get_next_obj_by_type(impl.topo, HWLOC_OBJ_NUMANODE, node)) != nullptr) {
      if (static_cast<int>(node->os_index) == options.numa_node) break;
    }
    KVF_CHECK_ARG(node != nullptr, "NUMA node ", options.numa_node, " not found");
    scope = node;
    pool->numa_node_ = options.numa_node;
    how = detail::StrCat("NUMA node ", options.numa_node, " (requested)");
  } else if (!options.gpu_pci_bus_id.empty()) {
    hwloc_obj_t dev = hwloc_get_pcidev_by_busidstring(impl.topo, options.gpu_pci_bus_id.c_str());
    hwloc_obj_t anc = dev != nullptr ? hwloc_get_non_io_ancestor_obj(impl.topo, dev) : nullptr;
    if (anc != nullptr && anc->cpuset != nullptr &&
        hwloc_bitmap_intersects(anc->cpuset, allowed)) {
      scope = anc;
      pool->numa_node_ = anc->nodeset != nullptr ? hwloc_bitmap_first(anc->nodeset) : -1;
      how = detail::StrCat("cores near GPU ", options.gpu_pci_bus_id, " (NUMA node ",
                           pool->numa_node_, ")");
    } else {
      how = detail::StrCat("all cores (GPU ", options.gpu_pci_bus_id,
                           dev == nullptr ? " not in the hwloc topology)"
                                          : " has no allowed cores nearby)");
    }
  }

  // One worker per core (never per hyperthread), in topology order, restricted to allowed PUs.
  const int num_cores =
      hwloc_get_nbobjs_inside_cpuset_by_type(impl.topo, scope->cpuset, HWLOC_OBJ_CORE);
  for (int i = 0; i < num_cores; ++i) {
    hwloc_obj_t core =
        hwloc_get_obj_inside_cpuset_by_type(impl.topo, scope->cpuset, HWLOC_OBJ_CORE, i);
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    hwloc_bitmap_and(set, core->cpuset, allowed);
    if (hwloc_bitmap_iszero(set)) {
      hwloc_bitmap_free(set);
      continue;
    }
    impl.core_sets.push_back(set);
  }
  if (impl.core_sets.empty()) {  // topology without core objects: one "core" per allowed PU
    int pu = -1;
    while ((pu = hwloc_bitmap_next(allowed, pu)) != -1) {
      hwloc_bitmap_t set = hwloc_bitmap_alloc();
      hwloc_bitmap_only(set, static_cast<unsigned>(pu));
      impl.core_sets.push_back(set);
    }
  }
  KVF_CHECK_CODE(!impl.core_sets.empty(), StatusCode::kInternal, "hwloc found no usable core");
  const int cores_available = static_cast<int>(impl.core_sets.size());
  // By default, above two cores, one core is left to the caller's thread: it enqueues the GPU's
  // work and joins the arena's loops, and with a worker spinning on every core it lost its core
  // to them (32-layer lfps step at 32K on the GPU machine's 16 cores: 25-27 ms with 16 workers,
  // 17-19 ms with 15). On two cores a one-worker arena would halve the CPU route (and TBB gives
  // every arena a second slot, which its worker may take unpinned).
  const int threads = options.threads > 0   ? std::min(options.threads, cores_available)
                      : cores_available > 2 ? cores_available - 1
                                            : cores_available;
  for (size_t i = static_cast<size_t>(threads); i < impl.core_sets.size(); ++i) {
    hwloc_bitmap_free(impl.core_sets[i]);
  }
  impl.core_sets.resize(static_cast<size_t>(threads));
  for (hwloc_bitmap_t s : impl.core_sets) pool->cores_.push_back(hwloc_bitmap_first(s));

  // TBB keeps hardware_concurrency - 1 workers by default; the arena needs `threads` of them.
  const size_t want = static_cast<size_t>(threads) + 1;
  if (tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism) < want) {
    impl.parallelism = std::make_unique<tbb::global_control>(
        tbb::global_control::max_allowed_parallelism, want);
  }
  // When a core is left to the caller, so is a slot of its own: it enters the arena at once (with
  // every slot taken by a worker it would hand its work to one, which may be asleep) and is never
  // re-pinned (moving the thread that enqueues the GPU's work to a worker's core on each entry
  // cost it a migration and cold caches; docs/cpu.md has the measurement).
  const int master_slots = threads < cores_available ? 1 : 0;
  impl.master_slots = master_slots;
  impl.arena = std::make_unique<tbb::task_arena>(threads + master_slots, master_slots);
  impl.arena->initialize();
  impl.observer = std::make_unique<PinningObserver>(*impl.arena, impl.topo, impl.core_sets,
                                                    options.pin, master_slots);
  impl.jobs = std::make_unique<boost::lockfree::queue<CpuJob>>(options.queue_capacity);
  impl.done = std::make_unique<boost::lockfree::queue<CpuCompletion>>(options.queue_capacity);

  std::string core_list;
  for (size_t i = 0; i < pool->cores_.size(); ++i) {
    if (i > 0) core_list += ',';
    core_list += std::to_string(pool->cores_[i]);
  }
  pool->description_ = detail::StrCat(threads, " threads on ", how, ", pinned=",
                                      options.pin ? "yes" : "no", ", PUs [", core_list,
                                      "], kernels ", AttendRowsImplName());
  if (options.threads > cores_available) {
    pool->description_ += detail::StrCat(" (asked for ", options.threads, ", clamped to cores)");
  }
  return pool;
}

CpuPool::~CpuPool() {
  if (impl_ == nullptr) return;
  // Let queued jobs finish (they write into caller memory), then drop unread completions.
  Backoff backoff;
  CpuCompletion c;
  while (in_flight_.load(std::memory_order_acquire) > 0) {
    if (TryPopCompletion(&c)) {
      backoff.Reset();
    } else {
      backoff.Pause();
    }
  }
}

Status CpuPool::Submit(const CpuJob& job) {
  if (!impl_->jobs->bounded_push(job)) {
    return ResourceExhausted(detail::StrCat("CPU job queue full (", in_flight(), " in flight)"));
  }
  in_flight_.fetch_add(1, std::memory_order_acq_rel);
  // One task per job; whichever worker runs it takes the oldest queued job.
  impl_->arena->enqueue([this] { RunOneJob(); });
  return Status::Ok();
}

void CpuPool::RunOneJob() {
  CpuJob job;
  if (!impl_->jobs->pop(job)) return;  // cannot happen: one task is enqueued per pushed job
  const int64_t t0 = NowNs();
  AttendPositions(job.params, &job.item, 1);
  CpuCompletion c;
  c.tag = job.tag;
  c.slot = job.slot;
  c.layer = job.layer;
  c.kv_head = job.kv_head;
  c.worker = tbb::this_task_arena::current_thread_index() - impl_->master_slots;
  c.rows = job.item.count;
  c.ns = NowNs() - t0;
  Backoff backoff;
  while (!impl_->done->bounded_push(c)) backoff.Pause();  // consumer is behind: wait for room
}

bool CpuPool::TryPopCompletion(CpuCompletion* out) {
  CpuCompletion c;
  if (!impl_->done->pop(c)) return false;
  in_flight_.fetch_sub(1, std::memory_order_acq_rel);
  if (out != nullptr) *out = c;
  return true;
}

void CpuPool::WaitCompletions(int64_t count, CpuCompletion* out) {
  Backoff backoff;
  for (int64_t got = 0; got < count;) {
    if (TryPopCompletion(out != nullptr ? out + got : nullptr)) {
      ++got;
      backoff.Reset();
    } else {
      backoff.Pause();
    }
  }
}

Status CpuPool::Run(std::span<const CpuJob> jobs) {
  int64_t submitted = 0, completed = 0;
  Backoff backoff;
  while (completed < static_cast<int64_t>(jobs.size())) {
    bool progress = false;
    while (submitted < static_cast<int64_t>(jobs.size())) {
      const Status s = Submit(jobs[static_cast<size_t>(submitted)]);
      if (!s.ok()) {
        if (s.code() != StatusCode::kResourceExhausted) return s;
        break;  // queue full: drain completions first
      }
      ++submitted;
      progress = true;
    }
    while (TryPopCompletion(nullptr)) {
      ++completed;
      progress = true;
    }
    if (progress) {
      backoff.Reset();
    } else {
      backoff.Pause();
    }
  }
  return Status::Ok();
}

void CpuPool::KeepWarm(int threads, int64_t max_us) {
  if (threads <= 0 || max_us <= 0) return;
  std::shared_ptr<std::atomic<uint64_t>> epoch = impl_->warm_epoch;
  const uint64_t e = epoch->load(std::memory_order_acquire);
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(max_us);
  for (int i = 0; i < std::min(threads, num_threads()); ++i) {
    impl_->arena->enqueue([epoch, e, until] {
      for (int spins = 0; epoch->load(std::memory_order_acquire) == e; ++spins) {
        _mm_pause();
        if ((spins & 63) == 63 && std::chrono::steady_clock::now() >= until) return;
      }
    });
  }
}

void CpuPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  impl_->warm_epoch->fetch_add(1, std::memory_order_release);
  impl_->arena->execute([&] {
    tbb::parallel_for(int64_t{0}, n, [&](int64_t i) { fn(i); });
  });
}

void CpuPool::ParallelForBeside(int64_t n, const std::function<void(int64_t)>& fn,
                                const std::function<void()>& first) {
  impl_->warm_epoch->fetch_add(1, std::memory_order_release);
  impl_->arena->execute([&] {
    tbb::task_group items;
    items.run([&] { tbb::parallel_for(int64_t{0}, n, [&](int64_t i) { fn(i); }); });
    first();
    items.wait();
  });
}

}  // namespace kvferry::cpu
