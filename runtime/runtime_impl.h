// Copyright kvferry authors. Apache-2.0.
#pragma once
// Runtime internals: sequence slots, tiers, plan buffers and the decode step of docs/design.md.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <atomic>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cpu/pool.h"
#include "gpu/device.h"
#include "kvferry/runtime.h"
#include "offload/host_store.h"
#include "offload/token_bank.h"
#include "runtime/trace.h"
#include "policies/device_selector.h"
#include "policies/policy.h"
#include "runtime/scheduler.h"

namespace kvferry::detail {

/// Tokens per host-store page.
inline constexpr int kPageTokens = 256;

/// A buffer from the Device, freed with it.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  bool host = false;
};

/// Every device buffer Runtime::Create allocates, in bytes (0: not allocated), with the layout
/// choices the sizes follow. RuntimeImpl::SizeDeviceBuffers computes it, once; Init allocates
/// exactly these sizes and Runtime::device_memory reports them, so the plan the GPU memory cap is
/// checked against and the allocations cannot drift apart (the tests compare the plan with the
/// device's own count, Stats::device_bytes_reserved).
/// The positions the device's scan list of an item may hold when it asks for \p picks: every key
/// in the threshold's 16-bit bin comes too (LfpsScanArgs), so twice the picks and some.
constexpr int64_t ScanListCap(int64_t picks) { return 2 * picks + 512; }

struct DeviceBufferSizes {
  // ---- layout ----
  int bank_slots = 0;
  bool device_bank = false;  // StepBank in device memory (CUDA, device-selecting policy)
  bool host_bank = false;    // host-managed TokenBank (rows in device memory, maps on the host)
  bool host_lists = false;   // host-selected lists uploaded into the planned step (device bank)
  size_t bank_admit_item_bytes = 0;
  int bank_max_admit = 0;
  // The planned step (see the members of RuntimeImpl of the same names).
  bool fast_path = false;
  bool cpu_step = false;
  bool step_all_resident = false;
  SelectScoring scoring = SelectScoring::kNone;
  int64_t list_cap = 0;
  int64_t select_ld = 0;
  // The device selector's buffers (DeviceSelector::Size), allocated in order and handed to its
  // Bind; `selector` once they are sized (the planned step selects on the device).
  bool selector = false;
  std::vector<SelectorBuffer> selector_buffers;
  int32_t bank_miss_cap = 0;
  // The step's miss staging, miss lists and admission items, one set a region; layer l takes
  // region l % bank_regions. Two (CUDA; not beside a selector's own stream): layer l's admission
  // runs on its own stream beside layer l + 1 (RuntimeImpl::admit_stream_).
  int bank_regions = 1;
  int64_t step_ws_floats = 0;
  // CUDA prefill: pages of one layer staged in device memory; the tensor-core kernel and its
  // copy stream unless KVFERRY_CUDA_PREFILL=paged asks for the CUDA-core kernel.
  int64_t max_pages = 0;
  bool prefill_tensor_cores = false;
  bool prefill_copy_stream = false;
  bool prefill_write_stream = false;
  /// A second staging (and its page table) that a chunk-major prefill fills with the next call's
  /// history while the current call computes (PrefetchNextHistory).
  bool prefill_prefetch = false;
  int streams = 0;  // streams the device keeps scratch for: its default one and those Init creates
  // LFPS-style priming on the device (Policy::prime_rows() > 0; on CUDA unless KVFERRY_PRIME=host,
  // on the host backend with KVFERRY_PRIME=device): rows primed per chunk, table stride per head.
  int prime_rows = 0;
  int64_t prime_table_stride = 0;
  // LFPS's scan on the device (Policy::device_scan_channels() > 0, a host-selecting planned step;
  // on CUDA unless KVFERRY_LFPS_SCAN=host, on the host backend with KVFERRY_LFPS_SCAN=device;
  // dropped when a GPU cap leaves no room for it): picks per item (the row stride of scan_out).
  bool device_scan = false;
  int64_t scan_picks = 0;  // the most picks an item asks for
  int64_t scan_list_cap = 0;  // the most positions an item's list holds (row stride of scan_out)

  // The scheduler's split of a device selection's misses with the CPU (route auto, a planned
  // step without a token bank, RuntimeConfig::async_cpu not 0).
  bool split = false;
  // ---- bytes ----
  size_t resident = 0;
  size_t q_in = 0, k_in = 0, v_in = 0, out_stage = 0;
  size_t q_f32 = 0, o_gpu = 0, lse_gpu = 0, o_cpu = 0, lse_cpu = 0;
  size_t store_table = 0;
  size_t bank_rows = 0, bank_page_tables = 0, bank_slot_state = 0;
  size_t bank_stage = 0, bank_miss = 0, bank_admit = 0;
  size_t prefill_scratch = 0, prefill_pages = 0;
  size_t prefill_next = 0, prefill_next_pages = 0;
  size_t step_list = 0, step_list_count = 0, select_ws = 0, topk_ws = 0, select_mcta = 0;
  size_t step_slots = 0, step_pos = 0, step_ws = 0, step_counters = 0;
  size_t prime_tables = 0, prime_stats = 0, prime_scratch = 0;
  size_t scan_shadow = 0, scan_scale = 0, scan_keys = 0, scan_ints = 0, scan_hist = 0,
         scan_blocks = 0, scan_items = 0;
  size_t split_list = 0, split_count = 0;  // the scheduler's split: the device's share of a list
  size_t scan_out = 0, scan_counts = 0;  // mapped host memory (the scan writes its ranking there)
  size_t stream_scratch = 0;
  // Sliding-window layers (RuntimeImpl::SizeWindowBuffers): the rings' rows beyond the resident
  // tier's, and one chunk's window staging.
  size_t window_rings = 0, window_stage = 0;
  /// Per layer, the device bytes of its K and V rows (DeviceMemoryPlan::layer_bytes).
  std::vector<int64_t> layer_bytes;

  /// The parts (named groups of the buffers above), largest first, and their total.
  [[nodiscard]] DeviceMemoryPlan Plan(int64_t cap_bytes) const;
  /// Leaves LFPS's device scan out (the policy scans on the host).
  void DropScan() {
    device_scan = false;
    scan_picks = scan_list_cap = 0;
    scan_shadow = scan_scale = scan_keys = scan_ints = scan_hist = scan_blocks = 0;
    scan_items = scan_out = scan_counts = 0;
  }
};

/// Test seam: while one is alive on a thread, every Runtime::Create on that thread hands the Device
/// it made (host or CUDA) to the decorator and runs on what it returns. Tests wrap the device in
/// one that fails chosen calls (tests/fault_device.h). The run path pays nothing for it: the
/// decorator is looked up once, at Create.
using DeviceDecorator = std::function<std::unique_ptr<Device>(std::unique_ptr<Device>)>;
class ScopedDeviceDecorator {
 public:
  explicit ScopedDeviceDecorator(DeviceDecorator decorator);
  ~ScopedDeviceDecorator();
  ScopedDeviceDecorator(const ScopedDeviceDecorator&) = delete;
  ScopedDeviceDecorator& operator=(const ScopedDeviceDecorator&) = delete;
  /// The innermost live decorator of this thread, or null.
  static const DeviceDecorator* Current();

 private:
  DeviceDecorator decorator_;
  const DeviceDecorator* previous_;
};

/// \p failure, with a note when the rollback after it (\p restored) failed as well.
Status WithRestore(Status failure, const Status& restored);

class RuntimeImpl {
 public:
  static Result<std::unique_ptr<RuntimeImpl>> Create(const RuntimeConfig& config);
  ~RuntimeImpl();

  Status AddSequence(SequenceId seq);
  Status RemoveSequence(SequenceId seq);
  Result<int64_t> SequenceLength(SequenceId seq, int layer) const;
  Status Prefill(SequenceId seq, int layer, const TensorView& q, const TensorView& k,
                 const TensorView& v, const TensorView& out, StreamHandle stream);
  Status Decode(std::span<const SequenceId> seqs, int layer, const TensorView& q,
                const TensorView& k, const TensorView& v, const TensorView& out,
                StreamHandle stream);
  Status PlanDecode(std::span<const SequenceId> seqs, StreamHandle stream);
  Status Append(SequenceId seq, int layer, const TensorView& k, const TensorView& v,
                StreamHandle stream);
  // A sliding-window layer's decode is described by the host at each step: not in a graph.
  bool decode_is_capture_safe() const { return fast_path_ && window_max_ == 0; }
  Result<std::vector<int32_t>> LastSelection(SequenceId seq, int layer, int kv_head) const;
  Status Synchronize() { return device_->SynchronizeStream(stream_); }

  Stats stats() const;
  Status StartTrace(int64_t max_events) { return trace_.Start(max_events); }
  Status TimeDeviceSelect(bool on);
  Status WriteTrace(const std::string& path) { return trace_.Write(path); }
  cpu::CpuPool& pool() { return *pool_; }
  void ResetStats() {
    stats_ = Stats{};
    cpu_attend_ns_.store(0, std::memory_order_relaxed);
    bank_step_selected_ = 0;
    if (bank_ != nullptr) bank_->ResetCounters();
    if (step_bank_ != nullptr) {
      Result<StepBankTotals> t = step_bank_->Totals();
      if (t.ok()) bank_totals_at_reset_ = t.value();
    }
    if (policy_ != nullptr) policy_counters_at_reset_ = policy_->counters();
    for (TimingRing* r : {&select_timing_, &attend_timing_}) {
      for (TimingPair& t : r->pairs) t.pending = false;
    }
    timed_select_key_bytes_ = 0;
    timed_attend_bytes_ = 0;
  }
  const RuntimeConfig& config() const { return config_; }
  const DeviceMemoryPlan& device_memory() const { return device_plan_; }
  Backend backend() const { return device_->backend(); }
  /// Serialises the public calls (see the contract on Runtime): each takes it once.
  std::mutex& mutex() const { return mu_; }
  /// Every public call first collects the CPU part an asynchronous Decode left running
  /// (RuntimeConfig::async_cpu): waits for it and, when it failed, rolls its layer back and
  /// returns its failure (once). Ok when none is outstanding.
  Status CollectCpuPart();
  /// Waits for an outstanding CPU part without taking its status (calls that return no Status).
  void WaitCpuPart();

 private:
  explicit RuntimeImpl(const RuntimeConfig& config) : config_(config) {}
  Status Init();
  // Measures the scheduler's rates (CPU sparse attention, PCIe zero-copy gather) into cost_.
  Status ProbeCosts();
  Result<void*> Alloc(size_t bytes, bool host);
  // ---- device memory (runtime/device_memory.cpp) ----
  // Bytes Alloc takes for a request of \p bytes (the one rounding rule the sizing shares).
  static size_t AllocBytes(size_t bytes);
  /// True if the environment variable \p name is set to exactly \p value (the runtime's switches,
  /// read at Create).
  static bool EnvIs(const char* name, std::string_view value);
  // The host store's shape, and the banks' configurations for \p bank_slots.
  HostStoreShape StoreShape() const;
  StepBankConfig StepBankConfigFor(int bank_slots) const;
  TokenBankConfig TokenBankConfigFor(int bank_slots) const;
  // Sizes every device buffer Init allocates with \p bank_slots slots in the bank, and the
  // layout they follow. Needs device_, policy_ and the scalars Init derives before it.
  Status SizeDeviceBuffers(int bank_slots, DeviceBufferSizes& sizes) const;
  // The bank slots of Tiers::bank_slots = -1: the largest count whose plan fits
  // Capacity::gpu_bytes (at most max_tokens_per_sequence and 65534), 0 if none does.
  Result<int> ChooseBankSlots() const;
  // kResourceExhausted, naming the cap, the total and the parts, when \p plan exceeds the cap
  // (\p auto_bank: the bank was sized by ChooseBankSlots).
  Status CheckDeviceCap(const DeviceMemoryPlan& plan, bool auto_bank) const;
  Result<int> SlotOf(SequenceId seq) const;
  Status CheckLayer(int layer) const;
  Status CheckTensor(const TensorView& t, const char* name, int64_t rows, int heads) const;
  int64_t BudgetFor(int64_t n) const;

  // Resident tier addressing: rows [0, sink) hold the sinks, rows [sink, sink+window) the ring.
  char* ResidentK(int slot, int layer, int h, int64_t row) const;
  char* ResidentV(int slot, int layer, int h, int64_t row) const;
  // Resident row of position pos in a sequence of n tokens, or -1 if host-only.
  int64_t ResidentRow(int64_t pos, int64_t n) const;
  // Plans the writes of rows [src_row0, src_row0 + count) of k/v (input layout [rows, Hkv, D],
  // element sizes k_elem/v_elem) to positions pos0.. of one slot: the store (write-through) and
  // the resident tier. Fills k_copies and v_copies alike; returns how many each got.
  int64_t PlanAppend(int slot, int layer, int64_t pos0, int64_t count, int64_t new_len,
                     const void* k_src, size_t k_elem, const void* v_src, size_t v_elem,
                     int64_t src_row0, RowCopy* k_copies, RowCopy* v_copies);
  // Where the device reads an input from: the caller's memory when the device can read it,
  // else a staging copy (pageable host memory on CUDA).
  Result<const void*> StageInput(const TensorView& t, void* staging, StreamHandle stream);
  // Prefill after validation and ReserveChunk: appends the chunk and attends it; leaves the
  // length to the caller.
  Status PrefillReserved(int slot, int layer, const TensorView& q, const TensorView& k,
                         const TensorView& v, const TensorView& out, StreamHandle stream,
                         int64_t pos0, int64_t new_len);
  // Decode after the batch's new rows are appended and counted: selection, attention, merge,
  // output and bank admission (host-side selection and the dense path).
  Status AttendAppended(std::span<const SequenceId> seqs, std::span<const int> slot_of, int layer,
                        const TensorView& out, StreamHandle stream);
  // Waits until the previous call's work no longer reads the descriptor buffers.
  Status BeginCall();
  // Device::CopyRows, except on the host backend, where the rows are converted by the worker pool
  // (a prefill chunk's q, K/V and output copies would otherwise run on one core while the rest
  // wait for the attention).
  Status CopyRowsWide(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                      DType dst_dtype, StreamHandle stream);
  Status EndCall(StreamHandle stream);
  // ---- the planned decode step (runtime/decode_plan.cpp) ----
  // A planned step: which sequences, where each layer's new token goes, which layers ran.
  struct StepPlan {
    bool active = false;
    std::vector<SequenceId> seqs;
    std::vector<int> slots;
    std::vector<int64_t> positions;  // [b * num_layers + layer]
    std::vector<uint8_t> layer_run;  // [layer]: Decode ran (or failed) for it
  };
  Status InitStepBuffers();
  // Checks that a chunk ending at new_len fits, retires a pending plan and reserves its pages.
  // Priming a policy that learns from the prompt (Policy::prime_rows > 0) is deferred: a prefill
  // chunk only keeps its last rows of q (DeferPrime, one asynchronous copy, no wait), and the first
  // Decode of that (sequence, layer) primes from them (FlushPrime: OnPrefill, or with prime_rows_
  // Device::PrimeAttention over the store then OnPrefillPrimed; Stats::ms_prime). A policy primes
  // from the prompt's last chunk only (each chunk re-primes from scratch), so priming once from
  // the last chunk's rows gives what priming after every chunk gave, at one pass over the
  // history per layer instead of one per chunk. KVFERRY_PRIME_EAGER=1 primes at each chunk (the
  // earlier behaviour, for comparison).
  Status DeferPrime(int slot, int layer, int64_t new_len, int64_t tokens, const void* q_src,
                    DType q_dtype, StreamHandle stream);
  // \p same_call: the rows were copied by the call still under way (KVFERRY_PRIME_EAGER): wait
  // for \p stream instead of the last call.
  Status FlushPrime(int slot, int layer, StreamHandle stream, bool same_call);
  // Primes (slot, layer) at length new_len from the f32 queries in q_f32_, [Hkv][rows][G][D]: the
  // last `rows` query rows of the prompt.
  Status PrimePolicy(int slot, int layer, int64_t new_len, int rows, StreamHandle stream);
  // CUDA: copies the layer's rows [0, n) of one sequence into the prefill staging (one PCIe pass)
  // and points prefill_pages_dev_ at them.
  Status StageLayerPages(int slot, int layer, int64_t n, StreamHandle stream);
  Status ReserveChunk(SequenceId seq, int slot, int layer, int64_t new_len);
  // Checks that every sequence of a batch can take one more token at \p layer (prefilled, not
  // full), and reserves its page.
  Status CheckNextToken(std::span<const SequenceId> seqs, std::span<const int> slot_of,
                        int layer) const;
  Status ReserveNextToken(std::span<const int> slot_of, int layer);
  // Checks seqs and resolves their slots into \p slot_of (no state changes).
  Status CheckBatch(std::span<const SequenceId> seqs, std::vector<int>& slot_of) const;
  // Writes slots and positions to a pinned staging entry and copies them to device region
  // \p region (0: explicit plans, 1: a Decode's own plan) on \p stream.
  Status UploadPlan(int region, std::span<const int> slots, std::span<const int64_t> positions,
                    StreamHandle stream);
  // Rolls back the layers of plan_ that did not run, when some did (see PlanDecode).
  void RetirePlan();
  // Rows a device selection's list holds for a sequence of n positions, as the host can tell: how
  // a layer's lists are counted (once a layer), then each item's (HiP's may hold fewer).
  struct ListRowsRule {
    int64_t blocks = 0;         // > 0: whole blocks of this many tokens (DeviceSelector::ListBlock)
    double hide_fraction = 0;   // psaw+'s hidden fraction there
  };
  ListRowsRule DeviceListRowsRule(int layer) const;
  int64_t DeviceListRows(const ListRowsRule& rule, int64_t n, int64_t budget) const;
  // xl+: whether this layer's device list is the previous layer's of this step (the same
  // sequences selected there at the same length).
  [[nodiscard]] bool XlReusesPrevious(std::span<const int> slot_of, std::span<const int64_t> pos,
                                      int layer) const;
  // The run: one layer of the step on the device.
  Status RunDecodeStep(std::span<const SequenceId> seqs, int layer, const TensorView& q,
                       const TensorView& k, const TensorView& v, const TensorView& out,
                       StreamHandle stream);
  // The CPU half of a planned step for a CPU-placed policy (runtime/cpu_step.cpp): waits for q to
  // reach the host, then per (sequence, KV head), on the pool, selects and attends the selected
  // offloaded rows from the host store into o_cpu_host_ / lse_cpu_host_ (-inf where none). On
  // a policy failure returns its Status with nothing on the device changed by this function.
  // Runs the policy's Select for (slot, layer, kv_head) with n positions and the group's fp32
  // queries q into selections_[item]; a selection over item_cap_ is kInternal.
  /// \p threads: SelectContext::threads (pool threads per item of the step, at least 1);
  /// \p scan: SelectContext::scan (the device's scan ranking for this item, or null).
  Status SelectItem(int64_t item, int slot, int layer, int kv_head, int64_t n, const float* q,
                    int threads, const DeviceScanPicks* scan = nullptr);
  /// Pool threads per item when \p items run at once (SelectContext::threads).
  int SelectThreads(int64_t items) const;
  // How long the pool's workers spin after a step's CPU items for the next layer's
  // (CpuPool::KeepWarm): RuntimeConfig::cpu_spin_us, 0 (off) by default (runtime.cpp says why).
  int64_t pool_warm_us_ = 0;

  // First writes the new tokens' K/V rows to the host store (the step's kernels write only their
  // resident rows: DecodeStepArgs::host_writes_store). q/k/v: the caller's inputs in host memory.
  // With \p lists (host_lists_), the selections are not attended here: item i's positions go to
  // lists[i * list_cap_ ..] and its count to counts[i] (pinned memory the step's list is copied
  // from), and the device step attends them all. \p launch (when set) runs on the calling thread
  // while the pool's threads start on the items (CpuPool::ParallelForBeside): device launches the
  // items need not wait behind (the deferred scan, the step kernel), their host time hidden.
  Status SelectOnHost(std::span<const int> slot_of, int layer, std::span<const int64_t> positions,
                      const TensorView& q, const TensorView& k, const TensorView& v,
                      int32_t* lists = nullptr, int32_t* counts = nullptr,
                      const std::function<Status()>* launch = nullptr);
  // host_lists_: waits for q_ready_ (q on the host, unless \p inputs_on_host: the caller's
  // tensors are there already; and the store rows Select reads written), runs SelectOnHost into
  // layer \p layer's pinned list staging and copies the lists into the layer's device list region
  // on \p stream. Returns the most positions an item got.
  Result<int64_t> UploadHostLists(std::span<const int> slot_of, int layer,
                                  std::span<const int64_t> positions, const TensorView& q,
                                  const TensorView& k, const TensorView& v, bool inputs_on_host,
                                  StreamHandle stream);
  // Zeroes the step bank's miss lists (a step that failed after its kernel listed misses that no
  // admission consumed) and waits for \p stream.
  Status ClearBankMisses(StreamHandle stream);
  // The route the step plans with: auto is cpu for a CPU-placed policy (its q is on the host
  // already), else as configured.
  Route PlannedRoute() const;
  // Positions [pos0, new_len) of (slot, layer) were stored: the device selector extends what it
  // derives from the keys (DeviceSelector::OnStored; Quest's page bounds); a no-op otherwise.
  Status SelectorStored(int slot, int layer, int64_t pos0, int64_t new_len, StreamHandle stream);
  // Zeroes the device selection state of \p slot (all slots for -1) for a new sequence; waits.
  Status ResetSelectState(int slot);
  // Rewrites the window ring rows of \p slots at \p layer from the host store for their current
  // lengths: after a failed call, puts back the rows its append overwrote (the store's rows below
  // the length are never written by an append, so they are the truth). Waits for the stream
  // first, since the descriptors it writes may still be read by the failed call's launches.
  Status RestoreWindow(std::span<const int> slots, int layer, StreamHandle stream);
  // Takes back the token a failed Decode appended at \p layer (lengths already counted it) and
  // restores the ring. Returns \p failure, or the restore's error if that failed too.
  Status RollBackDecode(std::span<const int> slot_of, int layer, StreamHandle stream,
                        Status failure);
  // Thread-nanoseconds of the CPU route's attention kernels (Stats::ms_cpu_attend_busy), added
  // by the pool's threads: AttendTimed(fn) runs fn and counts its time.
  std::atomic<int64_t> cpu_attend_ns_{0};
  template <typename Fn>
  void AttendTimed(Fn&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    cpu_attend_ns_.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
        std::memory_order_relaxed);
  }
  // Host waits inside Decode and PlanDecode, counted in Stats::host_syncs.
  Status HostWaitStream(StreamHandle stream);
  Status HostWaitEvent(EventHandle event);

  // ---- sliding-window layers (ModelShape::layer_window; runtime/window.cpp) ----
  // A sliding layer of window w keeps its rows in a ring of w rows per (slot, layer, KV head),
  // position p in row p % w: the first sink + window rows are the resident tier's own rows at that
  // layer (which a sliding layer does not use otherwise), the rest in window_rings_. It has no
  // host-store page, no policy and no PCIe traffic. Decode appends to the ring and attends every
  // row of it (Device::AttendRows); a prefill or append chunk copies the window's earlier rows and
  // the chunk into window_stage_, attends each query over its own window there, and writes the
  // chunk's last w rows to the ring last (a failure puts the earlier rows back from the staging).
  // Every step goes through Device calls both backends implement (CopyRows, AttendRows, MergeLse).
  [[nodiscard]] int WindowOf(int layer) const {
    return window_.empty() ? 0 : window_[static_cast<size_t>(layer)];
  }
  char* RingK(int slot, int layer, int h, int64_t row) const;
  char* RingV(int slot, int layer, int h, int64_t row) const;
  // The layout from the configuration (Init, before the sizing): window_, window_max_, ring_off_,
  // ring_slot_rows_, window_stage_rows_.
  void InitWindowLayout();
  // The rings' and the staging's bytes and every layer's (SizeDeviceBuffers); the allocation of
  // those and of the pinned descriptors (Init).
  void SizeWindowBuffers(DeviceBufferSizes& z) const;
  Status InitWindowBuffers();
  // Decode at a sliding layer (after Decode's checks): honours a plan of PlanDecode like
  // RunDecodeStep; a failure takes the token back (the ring row it took held position n - 1 - w,
  // which no later call attends).
  Status WindowDecode(std::span<const SequenceId> seqs, std::span<const int> slot_of, int layer,
                      const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, StreamHandle stream);
  // A chunk of positions [pos0, new_len) at a sliding layer: Prefill (q and out set; windowed
  // causal attention) or Append (null). Leaves the length to the caller.
  Status WindowChunk(int slot, int layer, const TensorView* q, const TensorView& k,
                     const TensorView& v, const TensorView* out, StreamHandle stream,
                     int64_t pos0, int64_t new_len);
  // WindowChunk's attention: each query of the chunk (q staged, out the caller's) over the rows
  // [max(base, p - w + 1), p] of the staging, whose row j holds position base + j.
  Status WindowChunkAttend(const TensorView& q, const void* q_src, const TensorView& out,
                           int64_t w, int64_t base, int64_t pos0, int64_t tokens,
                           RowCopy* copies, StreamHandle stream);
  std::vector<int> window_;        // per layer: 0 global, w sliding (empty: every layer global)
  int window_max_ = 0;             // the widest window (0: none)
  std::vector<int64_t> ring_off_;  // per layer: its rings' first row in a slot's window_rings_
  int64_t ring_slot_rows_ = 0;     // rows of window_rings_ per slot
  char* window_rings_ = nullptr;   // device: [slot][layer's part: [h][K rows, V rows beyond the tier]]
  char* window_stage_ = nullptr;   // device: [h][K rows, then V rows], window_stage_rows_ each
  int64_t window_stage_rows_ = 0;  // w_max - 1 + max_prefill_chunk
  RowCopy* window_copies_ = nullptr;     // pinned descriptors, window_copy_cap_ of them
  int64_t window_copy_cap_ = 0;
  RowAttnItem* window_items_ = nullptr;  // pinned: [max_rows * Hkv]
  const void** window_k_rows_ = nullptr;  // pinned row lists, window_row_cap_ each
  const void** window_v_rows_ = nullptr;
  int64_t window_row_cap_ = 0;

  // Merges the CPU part (if any) into the GPU part and writes \p out in its dtype.
  Status WriteOutput(const float* o_b, const float* lse_b, int64_t rows, const TensorView& out,
                     StreamHandle stream);

  RuntimeConfig config_;
  DeviceBufferSizes sizes_;       // what Init allocates (SizeDeviceBuffers)
  DeviceMemoryPlan device_plan_;  // sizes_ by part, for device_memory()
  mutable std::mutex mu_;
  std::unique_ptr<Device> device_;
  StreamHandle stream_ = nullptr;
  std::unique_ptr<HostStore> store_;
  std::unique_ptr<Policy> policy_;
  // The policy's device selection state (policies/device_selector.h): null unless the planned step
  // selects on the device (DeviceBufferSizes::selector).
  std::unique_ptr<DeviceSelector> selector_;
  [[nodiscard]] SelectorShape SelectorShapeOf() const;
  // Joins the selector's work beside the step (all of it) into \p stream; Ok without a selector.
  Status JoinSelectorSide(StreamHandle stream);
  std::unique_ptr<cpu::CpuPool> pool_;
  // Adds the time since t0 to a stage's Stats field and, while a trace records, a span.
  void Stage(double& ms, const char* name, TraceRecorder::Clock::time_point t0) {
    const auto t1 = TraceRecorder::Clock::now();
    ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    trace_.Span(name, "stage", t0, t1);
  }
  TraceRecorder trace_;
  // The host-managed bank: the host backend's, and on CUDA only for route auto with a GPU-placed
  // policy that selects on the host (its misses are split between the routes per row on the
  // host). Null without bank_slots (see Init for the rule).
  std::unique_ptr<TokenBank> bank_;
  // CUDA, bank_slots > 0, a policy that selects on the device (route gpu or auto) or on the host
  // (route gpu: host_lists_): the bank lives in device memory and the planned step reads and admits
  // it (bank_ stays null). Staging of the step's misses (list
  // index j of item i at bank_stage_ + (i * list_cap_ + j) * 2 * row_bytes_), the miss lists
  // ([items][1 + bank_miss_cap_]) and the admission items the step kernel writes.
  std::unique_ptr<StepBank> step_bank_;
  char* bank_stage_ = nullptr;
  int32_t* bank_miss_ = nullptr;
  void* bank_admit_ = nullptr;
  int32_t bank_miss_cap_ = 0;
  // bank_regions_ sets of the three above (DeviceBufferSizes::bank_regions), region r at
  // r * the *_region_ strides; layer l uses region l % bank_regions_.
  int bank_regions_ = 1;
  size_t bank_stage_region_ = 0, bank_miss_region_ = 0, bank_admit_region_ = 0;  // bytes
  // Two regions: layer l's admission runs on admit_stream_, forked after its step
  // (admit_fork_[r]); layer l + 2's step, which rewrites region r, waits for admit_done_[r]. The
  // stream joins back into the caller's at the step's last layer and before anything else reads
  // or writes the bank (JoinSide: PlanDecode, ResetSelectState, a call for a layer at or below
  // one still outstanding, a sequence's removal, a failure). A captured graph holds whole steps,
  // as with HiP's side rebuilds.
  StreamHandle admit_stream_ = nullptr;
  EventHandle admit_fork_[2] = {nullptr, nullptr}, admit_done_[2] = {nullptr, nullptr};
  EventHandle admit_join_ = nullptr;
  bool admit_pending_[2] = {false, false};
  int admit_side_layer_ = -1;  // the last layer admitted beside the stream, -1 when joined
  Status JoinAdmitSide(StreamHandle stream);
  // The scheduler's cross-layer prefetch (xl+, the device bank with two regions): layer l + 1
  // will take layer l's list, so once layer l's list is final (after its selection and xl+'s
  // copy) PrefetchListRows copies layer l + 1's misses of it into region (l + 1) % 2's stage, on
  // admit_stream_ after layer l - 1's admission (the last reader of that region) and beside layer
  // l's step. Layer l + 1's planned step then waits for prefetch_done_ and reads its misses there
  // (StepBankView::staged). Any other call waits for it before its step too; JoinAdmitSide joins
  // it with the admissions (RuntimeConfig::xl_prefetch).
  bool xl_prefetch_ = false;
  // Auto (xl_prefetch -1): prefetch while xl_gap_us_, the running average of the stream time
  // from the end of a planned layer's Decode to the start of the next layer's (where the next
  // layer takes the previous one's list), is at least xl_gap_min_us_ or not measured yet. The
  // prefetch overlaps the step beside it and that gap; with no gap, it races the step for PCIe
  // and the next step waits for it (stop 43: 0.78-0.88x of no prefetch in an attention-only loop,
  // 1.07-1.12x with 150-300 us of engine GPU work a layer). Timed by a ring of timing-event pairs
  // a layer (xl_gap_timing_, read kTimingRing steps later, so never waited for), on eager steps.
  bool xl_prefetch_auto_ = false;
  double xl_gap_min_us_ = 100.0;
  double xl_gap_us_ = -1.0;
  bool XlPrefetchWanted() const { return !xl_prefetch_auto_ || xl_gap_us_ < 0 || xl_gap_us_ >= xl_gap_min_us_; }
  EventHandle prefetch_fork_ = nullptr, prefetch_done_ = nullptr;
  int prefetch_layer_ = -1;  // the layer whose misses a prefetch in flight stages, -1: none
  StepBankTotals bank_totals_at_reset_;
  int64_t bank_step_selected_ = 0;  // rows of device selections read through the device bank
  StreamHandle side_stream_ = nullptr;  // bank admissions
  EventHandle bank_step_done_ = nullptr;  // CPU route and host-side selection
  CostModel cost_;

  int group_ = 1;
  float scale_ = 1.0f;
  size_t kv_elem_ = 2;
  size_t row_bytes_ = 0;  // one K (or V) row
  int64_t max_rows_ = 0;  // most tokens in one call (prefill chunk or batch)
  int64_t item_cap_ = 0;
  int64_t budget_max_ = 0;  // the largest budget any step gets (0: dense)  // most positions one (sequence, KV head) attends per step (0: dense)

  std::unordered_map<SequenceId, int> slots_;
  std::vector<int> free_slots_;
  std::vector<int64_t> lengths_;  // [slot][layer]

  std::vector<DeviceBuffer> buffers_;
  char* resident_ = nullptr;  // device: [slot][layer][kv_head][K rows (S+W), V rows (S+W)]
  // device staging
  void* q_in_ = nullptr;
  void* k_in_ = nullptr;
  void* v_in_ = nullptr;
  void* out_stage_ = nullptr;
  float* q_f32_ = nullptr;   // device, decode: [B, Hq, D]; prefill: [Hkv, T, G, D]
  float* o_gpu_ = nullptr;   // device, like q_f32_
  float* lse_gpu_ = nullptr;
  float* o_cpu_dev_ = nullptr;
  float* lse_cpu_dev_ = nullptr;
  // pinned host
  float* q_host_ = nullptr;
  float* o_cpu_host_ = nullptr;
  float* lse_cpu_host_ = nullptr;
  // Row-copy descriptors, one region per use in a call so that no region is rewritten while an
  // earlier asynchronous launch of the same call may still read it.
  RowCopy* k_copies_ = nullptr;  // [max_rows * Hkv * 2]
  RowCopy* v_copies_ = nullptr;  // [max_rows * Hkv * 2]
  RowCopy* q_copies_ = nullptr;  // [max_rows * Hq]
  RowCopy* o_copies_ = nullptr;  // [max_rows * Hkv]
  EventHandle call_done_ = nullptr;
  // CUDA only: prefill stages one layer's pages of the sequence in device memory.
  int64_t max_pages_ = 0;
  char* prefill_scratch_ = nullptr;     // device: [Hkv][max_pages] pages
  void** prefill_pages_host_ = nullptr;  // pinned: page table being built
  void** prefill_pages_dev_ = nullptr;   // device copy the kernel reads
  // A policy that primes from device-computed statistics (Policy::prime_rows): on CUDA (unless
  // KVFERRY_PRIME=host) and on the host backend with KVFERRY_PRIME=device, Device::PrimeAttention
  // computes them after each prefill chunk and OnPrefillPrimed finishes on the host. 0: off.
  int prime_rows_ = 0;
  struct PendingPrime {
    int64_t n = 0;     // the (sequence, layer)'s length after the chunk; 0: nothing pending
    int32_t rows = 0;  // query rows kept: the chunk's last min(prime rows, chunk tokens)
    DType dtype = DType::kF32;
  };
  std::vector<PendingPrime> pending_prime_;  // [slot * num_layers + layer]
  std::vector<char*> pending_q_;             // per slot, pinned: [layer][rows][Hq][D] in q's dtype
  int pending_rows_ = 0;                     // rows kept at most (Policy::prime_rows)
  // Room for one layer's kept rows (f32, the widest q dtype) and where (slot, layer)'s start.
  size_t PendingQBytes() const {
    return static_cast<size_t>(pending_rows_) * config_.model.num_q_heads * config_.model.head_dim * 4;
  }
  char* PendingQ(int slot, int layer) const {
    return pending_q_[static_cast<size_t>(slot)] + static_cast<size_t>(layer) * PendingQBytes();
  }
  bool prime_eager_ = false;                 // KVFERRY_PRIME_EAGER=1
  // What the prefill staging holds: rows [0, rows) of (slot, layer), or nothing (slot -1).
  struct Staged {
    int slot = -1, layer = -1;
    int64_t rows = 0;
  };
  Staged staged_;
  // Chunk-major prefill (chunk c of every layer before chunk c + 1, as an engine runs a model):
  // each call copies the history of the call it predicts next into the second staging on the copy
  // stream while it computes (PrefetchNextHistory); the next call swaps the stagings when it is
  // that call. prefill_next_ / prefill_next_pages_dev_ are the second staging and its page table,
  // next_staged_ what it holds or is being filled with, prefill_next_ready_ the copies' event.
  Status PrefetchNextHistory(int slot, int layer, int64_t pos0, int64_t new_len);
  // Copies the layer's rows [0, n) of one sequence into \p staging on \p stream (one copy per run
  // of pages adjacent in the host store).
  Status CopyLayerPages(int slot, int layer, int64_t n, char* staging, StreamHandle stream);
  std::vector<void*> page_copy_dst_;  // CopyLayerPages' copy lists (reserved at Create)
  std::vector<const void*> page_copy_src_;
  std::vector<size_t> page_copy_bytes_;
  char* prefill_next_ = nullptr;
  void** prefill_next_pages_dev_ = nullptr;
  Staged next_staged_;
  EventHandle prefill_next_ready_ = nullptr;
  EventHandle prefill_call_start_ = nullptr;
  struct LastPrefill {
    int slot = -1, layer = -1;
    int64_t pos0 = -1, new_len = -1;
  };
  LastPrefill last_prefill_;
  int64_t prime_table_stride_ = 0;      // floats per head: ver [n] then sla [n]
  float* prime_tables_dev_ = nullptr;   // device: [Hkv][prime_table_stride_]
  float* prime_tables_host_ = nullptr;  // pinned copy the policy reads
  double* prime_stats_dev_ = nullptr;   // device: [Hkv][PrimeStatsCount]
  double* prime_stats_host_ = nullptr;
  void* prime_scratch_ = nullptr;       // device: softmax partials
  size_t prime_scratch_bytes_ = 0;
  void* prefill_items_ = nullptr;  // pinned: tensor-core prefill descriptors (null: paged path)
  size_t prefill_items_bytes_ = 0;
  // The tensor-core prefill's descriptors are double-buffered (prefill_items_ holds two sets of
  // prefill_items_bytes_): a chunk waits only for the chunk two back to have read its set, so
  // consecutive chunks on one stream run back to back on the device.
  EventHandle prefill_items_done_[2] = {nullptr, nullptr};
  int prefill_parity_ = 0;
  StreamHandle last_call_stream_ = nullptr;  // the stream of the last EndCall
  // Tensor-core prefill with the history copied by the copy engines while the chunk is attended
  // (PrefillChunkArgs::copy_stream); null stream (the CUDA-core prefill): the one-pass staging.
  StreamHandle prefill_copy_stream_ = nullptr;
  EventHandle prefill_fork_ = nullptr;
  std::vector<EventHandle> prefill_segment_done_;
  std::vector<void*> prefill_copy_scratch_;  // host: the copy lists
  // The chunk's write-through from the staging on the copy engines (PrefillChunkArgs::write_stream).
  StreamHandle prefill_write_stream_ = nullptr;
  EventHandle prefill_write_ready_ = nullptr, prefill_write_done_ = nullptr;
  std::vector<void*> prefill_write_scratch_;  // host: its copy lists
  RowAttnItem* gpu_items_ = nullptr;
  RowAttnItem* cpu_items_ = nullptr;
  PagedAttnItem* paged_items_ = nullptr;
  const void** gpu_k_rows_ = nullptr;
  const void** gpu_v_rows_ = nullptr;
  const void** cpu_k_rows_ = nullptr;
  const void** cpu_v_rows_ = nullptr;

  std::vector<std::vector<int32_t>> selections_;       // per decode item
  std::vector<std::vector<int32_t>> last_selection_;   // per (slot, layer, kv head)
  std::vector<Status> item_status_;
  std::vector<std::vector<int32_t>> offloaded_;  // per decode item: selected, not resident
  std::vector<std::vector<int32_t>> misses_;     // per decode item: bank misses, then fetched
  std::vector<int> batch_slots_;
  Stats stats_;
  PolicyCounters policy_counters_at_reset_;  // the policy's counters at the last ResetStats

  // Planned decode step state.
  bool fast_path_ = false;  // policy selects on the device, no host-managed bank, route gpu/auto
  // A CPU-placed policy whose selections cover the resident rows, route cpu (auto), no bank: the
  // planned step attends the resident rows on the device while the host selects, and merges the
  // CPU's part after (SelectOnHost). Not capture-safe (the host is inside the step).
  bool cpu_step_ = false;
  void* q_raw_host_ = nullptr;       // pinned: q, k, v of a step as the caller gave them
  EventHandle q_ready_ = nullptr;    // q_raw_host_ holds this call's q, k, v
  // Runtime::TimeDeviceSelect: kTimingRing (start, end) timing-event pairs a layer, used in
  // turn. A pair is pending from its end's record until its time is added to
  // stats_.ms_select_device, when the pair comes round again (stats() adds the pending ones to
  // its copy), so no step waits for its own selection.
  static constexpr int kTimingRing = 4;
  struct TimingPair {
    EventHandle start = nullptr, end = nullptr;
    bool pending = false;
  };
  // The same rings time the device step's attention (Stats::ms_attend_device): the planned
  // step of a policy whose rows are all attended on the device (neither a CPU step nor host
  // lists).
  struct TimingRing {
    std::vector<TimingPair> pairs;  // [layer][kTimingRing], created when turned on
    std::vector<int> next;            // per layer: the pair it takes next
  };
  bool time_select_ = false;
  TimingRing select_timing_, attend_timing_;
  // The cross-layer prefetch's gap timing (xl_prefetch_auto_): pairs of layers l >= 1, started at
  // the end of layer l - 1's Decode, ended at the start of layer l's.
  TimingRing xl_gap_timing_;
  TimingPair* xl_gap_open_ = nullptr;  // started, its end not recorded yet
  int xl_gap_layer_ = -1;               // the layer whose Decode ends xl_gap_open_
  StreamHandle xl_gap_stream_ = nullptr;
  // CloseXlGap: ends the open gap pair at the start of \p layer's Decode (or drops it); starts
  // the next one at the end of \p layer's (OpenXlGap). Neither fails a call.
  void CloseXlGap(int layer, StreamHandle stream, bool capturing);
  void OpenXlGap(int layer, StreamHandle stream, bool capturing);
  // What the timed calls read, for the measured rates in Stats: the selections' key bytes and
  // the K/V bytes of the rows the timed steps attended (TimedLaunch counts them).
  int64_t timed_select_key_bytes_ = 0;
  int64_t timed_attend_bytes_ = 0;
  // The layer's next pair of \p ring, its previous time added to \p ms first.
  TimingPair* NextTiming(TimingRing& ring, int layer, double& ms);
  // \p launch on \p stream, between the two events of \p ring's next pair at \p layer when
  // \p timed (the pair's time goes to \p ms, \p bytes to \p timed_bytes once it is recorded).
  template <typename Launch>
  Status TimedLaunch(bool timed, TimingRing& ring, int layer, double& ms, int64_t bytes,
                     int64_t& timed_bytes, StreamHandle stream, Launch&& launch) {
    if (!timed) return launch();
    TimingPair* t = NextTiming(ring, layer, ms);
    KVF_RETURN_IF_ERROR(device_->RecordEvent(t->start, stream));
    KVF_RETURN_IF_ERROR(launch());
    KVF_RETURN_IF_ERROR(device_->RecordEvent(t->end, stream));
    t->pending = true;
    timed_bytes += bytes;
    return Status::Ok();
  }
  // The time of a pending pair (0 when not pending or not readable).
  double TimingMs(const TimingPair& t) const;
  void DestroyTimings(bool with_gap = true);  // false: the TimeDeviceSelect rings only
  EventHandle cpu_part_up_ = nullptr;  // the last CPU part left o_cpu_host_ / lse_cpu_host_
  // ---- the CPU part on the runtime's own thread (RuntimeConfig::async_cpu; cpu_step.cpp) ----
  // The caller's Decode enqueues the device's whole layer (the resident rows' attention, then a
  // wait for cpu_word_[0] to reach the job's ticket, the (o, lse) upload and the merge), counts
  // the step, hands the job over and returns; cpu_thread_ waits for q on the host, runs
  // SelectOnHost and writes the ticket. One job at a time: every public call collects it first
  // (CollectCpuPart), so while it runs the caller touches neither the state it reads (the
  // policy, the pool, the batch's slots and positions, stats_) nor the pinned buffers it fills.
  struct CpuPartJob {
    int layer = 0;
    bool inputs_on_host = false;
    StreamHandle stream = nullptr;
    TensorView q, k, v;  // on the host: q_raw_host_, or the caller's (host backend)
    int64_t batch = 0;
    bool planned = false;
    uint32_t ticket = 0;
    int32_t q10 = 0;  // > 0: a split step's CPU share (RunSplitPart) of q10 / 1024 of the misses
    bool balance = false;  // RunSplitPart moves split_q10_ by what it finds (CUDA, no override)
  };
  bool cpu_async_ = false;
  uint32_t* cpu_word_ = nullptr;  // pinned: [0] the ticket of the last part done, [1] a wait timed out
  uint32_t cpu_ticket_ = 0;
  StreamHandle cpu_last_stream_ = nullptr;  // the stream of the last asynchronous part
  CpuPartJob cpu_job_;
  bool cpu_job_out_ = false;  // handed over and not collected (the caller's side)
  std::thread cpu_thread_;
  std::mutex cpu_mu_;
  std::condition_variable cpu_cv_;
  std::atomic<uint64_t> cpu_go_{0}, cpu_done_{0};  // jobs handed over / finished
  bool cpu_sleeping_ = false, cpu_quit_ = false;   // under cpu_mu_
  Status cpu_job_status_;                           // the finished job's, read after cpu_done_
  void CpuThreadMain();
  void HandOverCpuPart(const CpuPartJob& job);
  // The worker's side of a job: q on the host, then SelectOnHost.
  Status RunCpuPart(const CpuPartJob& job);
  // ---- the scheduler's split of a device selection's misses (DeviceBufferSizes::split) ----
  // RunDecodeStep, route auto: after the layer's DecodeSelect, q goes down to q_raw_host_ and
  // SplitStepList partitions each item's list: its last SplitCpuRows(misses, q10) misses to the
  // CPU (split_cpu_list_, pinned, written by the device), the rest to the device's list
  // (split_gpu_list_), which the step attends into (o_gpu_, lse_gpu_); split_ready_ follows. The
  // CPU share goes to cpu_thread_ as a CpuPartJob with split set (RunSplitPart: waits for
  // split_ready_, attends its rows from the host store on the pool into o_cpu_host_ /
  // lse_cpu_host_, writes the ticket) and the stream merges the two as for a CPU step.
  bool split_ = false;
  int32_t* split_gpu_list_ = nullptr;   // device: [max_batch * Hkv][list_cap_]
  int32_t* split_gpu_count_ = nullptr;  // device: [max_batch * Hkv]
  int32_t* split_cpu_list_ = nullptr;   // pinned, mapped: [max_batch * Hkv][list_cap_]
  int32_t* split_cpu_count_ = nullptr;  // pinned, mapped: [max_batch * Hkv]
  EventHandle split_ready_ = nullptr;
  // The balance of the two branches, measured (CUDA, the model's share): after the step over the
  // device's share the stream records split_step_done_ (split_recorded_ = the job's ticket once
  // it is enqueued); the CPU part, done, asks whether it completed: yes moves the share
  // (split_q10_) kSplitShareStep down, no moves it up. -1: not moved yet (the model's).
  EventHandle split_step_done_ = nullptr;
  std::atomic<uint32_t> split_recorded_{0};
  std::atomic<int32_t> split_q10_{-1};
  int32_t split_last_q10_ = 0;  // the share of the last split step (Stats::split_share)
  static constexpr int32_t kSplitShareStep = 16;
  // RuntimeConfig::split_share in [0, 1]: every split step gives the CPU that share of its misses;
  // -1: the cost model's, when the CPU's share holds RuntimeConfig::split_min_us of its work.
  // The CPU's share of this layer's misses in 1024ths (0: no split), from the rows the step's
  // items select beyond the resident ones (\p offloaded, all items).
  int32_t SplitShare(int64_t offloaded) const;
  Status RunSplitPart(const CpuPartJob& job);
  // Takes back a counted layer whose CPU part (or the enqueue after its hand-over) failed.
  Status RollBackCpuPart(const CpuPartJob& job, Status failure);
  void StopCpuThread();
  // A layer of the step done: the planned layer marked run (or, self-planned, the token counted
  // at the layer), the write-through and the step's counters in stats_.
  void CommitDecodeStep(int layer, bool planned);
  // RunDecodeStep's end when the CPU part runs on cpu_thread_: counts the step, hands the part
  // over, then enqueues LFPS's deferred scan (\p scan_deferred), the step \p a over the resident
  // rows, the device's wait for the part, the upload and the merge.
  Status HandOverDecodeCpuPart(const DecodeStepArgs& a, bool scan_deferred, int layer, bool planned,
                               bool inputs_on_host, const TensorView& q_host,
                               const TensorView& k_host, const TensorView& v_host,
                               const TensorView& out, bool out_direct, StreamHandle stream,
                               int32_t split_q10 = 0);
  // CUDA, bank_slots > 0, a policy that selects on the host (Select: hip, kvpop, lfps, streaming,
  // the PrHS wrappers), route gpu: the planned step with the device bank. Per layer q, k and v go
  // to the host (q_raw_host_, q_ready_), the host writes the new token's store rows and selects
  // per (sequence, KV head) on the pool (SelectOnHost) into list_stage_, the lists go up into the
  // layer's step_list_ region and the step kernel attends them in kList mode with the bank as a
  // row source, then StepBank::Admit. One host wait per layer: not capture-safe.
  bool host_lists_ = false;
  // pinned: [layer][max_batch * Hkv][list_cap_] positions, then [layer][max_batch * Hkv] counts;
  // a layer's part is rewritten only after list_up_[layer] (its last upload) completed.
  int32_t* list_stage_ = nullptr;
  std::vector<EventHandle> list_up_;
  // LFPS's scan on the device (DeviceBufferSizes::device_scan; runtime/cpu_step.cpp): a copy of
  // the policy's int8 shadow of K per (slot, layer, KV head), [head_dim][max_tokens] channel-major,
  // made from the policy's at priming (CopyScanShadow) and extended by each step's new row on the
  // device; the step ranks the offloaded keys there (Device::LfpsScan) and the host's Select takes
  // the ranking (SelectContext::scan) instead of scanning.
  bool device_scan_ = false;
  int64_t scan_picks_cap_ = 0;
  int64_t scan_list_cap_ = 0;
  int scan_channels_ = 0;
  int8_t* scan_shadow_ = nullptr;
  float* scan_scale_ = nullptr;
  uint32_t* scan_keys_ = nullptr;
  int32_t* scan_ints_ = nullptr;
  uint32_t* scan_hist_ = nullptr;
  int32_t* scan_blocks_ = nullptr;
  int32_t* scan_counts_host_ = nullptr;  // pinned, mapped: the scan writes it
  LfpsScanItem* scan_items_dev_ = nullptr;
  LfpsScanItem* scan_items_host_ = nullptr;  // pinned, mapped: the scan's first pass reads it
  uint64_t* scan_out_host_ = nullptr;  // pinned, mapped: the scan writes it
  EventHandle scan_ready_ = nullptr;   // this step's ranking reached scan_out_host_
  bool scan_live_ = false;             // scan_view_ belongs to the step being selected
  // The first Select that needs the ranking waits for scan_ready_ (WaitScanRanking, under
  // scan_wait_mu_), after its own table work.
  std::atomic<bool> scan_arrived_{false};
  std::mutex scan_wait_mu_;
  // A scan was enqueued and nobody waited for it (it only wrote rows, or the step failed): the
  // next one waits before it rewrites the pinned item table the scan reads.
  bool scan_unwaited_ = false;
  // An item's CPU attention split into up to kAttendMaxParts ranges of >= kAttendMinRows picks
  // (runtime/cpu_step.cpp): parts 1.. write [item][part - 1] of attend_parts_ (o: group x
  // head_dim, then lse: group), merged into part 0's in order.
  static constexpr int kAttendMaxParts = 4;
  static constexpr int32_t kAttendMinRows = 128;
  std::vector<float> attend_parts_;
  // Attends \p n rows (\p ck, \p cv) of item \p item for q32 into (o, lse), in up to
  // min(threads, kAttendMaxParts) ranges as above: a CPU step's picks, a split step's CPU share.
  void AttendInParts(int64_t item, const float* q32, float* o, float* lse, const void** ck,
                     const void** cv, int32_t n, int threads);
  Status WaitScanRanking();
  // The lists' lengths from the device's counts, into scan_view_ (once they arrived).
  void TakeScanCounts();
  int64_t scan_step_items_ = 0;
  std::vector<int64_t> scan_rows_;     // per (slot, layer): shadow rows on the device, 0: none
  std::vector<DeviceScanPicks> scan_view_;  // per item of the step; count 0: host scan
  // The policy's shadow of (slot, layer) copied to the device (after priming), or marked absent.
  Status CopyScanShadow(int slot, int layer, StreamHandle stream);
  // Prepares the step's scan (q, k: the staged inputs, device-readable; the item table, the
  // ranking and its counts in mapped host memory) and, unless \p defer (CUDA: SelectOnHost's
  // launch enqueues it beside the Selects), enqueues it on \p stream (EnqueueDeviceScan) and
  // records scan_ready_. Items without a device shadow only skip it.
  Status LaunchDeviceScan(std::span<const int> slot_of, int layer,
                          std::span<const int64_t> positions, const void* q, DType q_dtype,
                          const void* k, DType k_dtype, StreamHandle stream, bool defer = false);
  Status EnqueueDeviceScan();
  LfpsScanArgs scan_args_;
  StreamHandle scan_stream_ = nullptr;
  bool scan_pending_ = false;           // prepared, not enqueued
  std::atomic<int> scan_launched_{1};  // 0: being enqueued, 1: enqueued, 2: failed
  Status scan_launch_status_ = Status::Ok();
  int64_t scan_bytes_d2h_ = 0;
  bool step_all_resident_ = false; // every row such a step attends is resident
  StepPlan plan_;
  int32_t* step_slots_dev_ = nullptr;  // device: [2 regions][max_batch]
  int64_t* step_pos_dev_ = nullptr;    // device: [2 regions][max_batch * num_layers]
  char* plan_stage_ = nullptr;         // pinned: [kPlanRing][plan_stage_bytes_]
  size_t plan_stage_bytes_ = 0;
  std::vector<EventHandle> plan_events_;
  int plan_next_ = 0;
  float* step_ws_ = nullptr;           // device: split partials of the step kernels
  int64_t step_ws_floats_ = 0;
  int32_t* step_counters_ = nullptr;   // device: zeroed split counters of the step kernel
  std::vector<int64_t> step_pos_scratch_;     // [batch]: new token's position at the layer
  std::vector<int64_t> implicit_pos_scratch_; // [batch * layers]: a Decode's own plan
  std::vector<int> plan_slots_scratch_;       // [batch]: PlanDecode's slots
  // Device selection (Policy::device_scoring != kNone).
  SelectScoring scoring_ = SelectScoring::kNone;
  int64_t list_cap_ = 0;
  int32_t* step_list_ = nullptr;        // device: [layer][max_batch * Hkv][list_cap_]
  int32_t* step_list_count_ = nullptr;  // device: [layer][max_batch * Hkv]
  float* select_ws_ = nullptr;          // device: [max_batch * Hkv][group][select_ld_]
  int64_t select_ld_ = 0;
  unsigned long long* topk_ws_ = nullptr;  // device, when the list capacity exceeds 4096
  uint32_t* select_mcta_ws_ = nullptr;     // device (CUDA), the multi-CTA top-k's scratch
  std::vector<std::vector<int>> list_slots_;  // [layer]: slots of the last step's batch
  // [layer]: each batch item's n at that layer's last selection (xl+ reuses the previous layer's
  // list only when the same slots selected there at the same n)
  std::vector<std::vector<int64_t>> list_n_;
};

}  // namespace kvferry::detail
