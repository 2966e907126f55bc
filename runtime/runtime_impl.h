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
#include "runtime/runtime_state.h"
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
/// in the threshold's 16-bit bin comes too (ShadowScanArgs), so twice the picks and some.
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
  bool device_select = false;
  int64_t list_cap = 0;
  int64_t select_ld = 0;
  // The device selector's buffers (DeviceSelector::Size), allocated in order and handed to its
  // Bind; `selector` once they are sized (the planned step selects on the device).
  bool selector = false;
  std::vector<SelectorBuffer> selector_buffers;
  int32_t bank_miss_cap = 0;
  // The step's miss staging, miss lists and admission items, one set a region; layer l takes
  // region l % bank_regions. Two (CUDA; not beside a selector's own stream): layer l's admission
  // runs on its own stream beside layer l + 1 (RuntimeImpl::dbank_.admit_stream).
  int bank_regions = 1;
  int64_t step_ws_floats = 0;
  // CUDA prefill: pages of one layer staged in device memory; the tensor-core kernel and its
  // copy stream unless ReferencePaths::cuda_prefill_paged asks for the CUDA-core kernel.
  int64_t max_pages = 0;
  bool prefill_tensor_cores = false;
  bool prefill_copy_stream = false;
  bool prefill_write_stream = false;
  /// A second staging (and its page table) that a chunk-major prefill fills with the next call's
  /// history while the current call computes (PrefetchNextHistory).
  bool prefill_prefetch = false;
  int streams = 0;  // streams the device keeps scratch for: its default one and those Init creates
  // Priming on the device (Policy::prime_rows() > 0; on CUDA unless paths.prime is kHost,
  // on the host backend with kDevice): rows primed per chunk, table stride per head.
  int prime_rows = 0;
  int64_t prime_table_stride = 0;
  // The shadow scan on the device (Policy::device_scan_channels() > 0, a host-selecting planned step;
  // on CUDA unless paths.shadow_scan is kHost, on the host backend with kDevice;
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
  /// Leaves the device's shadow scan out (the policy scans on the host).
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
  bool decode_is_capture_safe() const { return step_.fast_path && win_.max == 0; }
  bool prefill_reads_queries() const {
    return policy_->wants_prefill_queries() || policy_->prime_rows() > 0;
  }
  Result<std::vector<int32_t>> LastSelection(SequenceId seq, int layer, int kv_head) const;
  Status Synchronize() { return device_->SynchronizeStream(stream_); }

  Stats stats() const;
  Status StartTrace(int64_t max_events) { return trace_.Start(max_events); }
  Status TimeDeviceSelect(bool on);
  Status WriteTrace(const std::string& path) { return trace_.Write(path); }
  cpu::CpuPool& pool() { return *pool_; }
  void ResetStats() {
    stats_ = Stats{};
    stats_aux_.cpu_attend_ns.store(0, std::memory_order_relaxed);
    stats_aux_.bank_step_selected = 0;
    if (bank_ != nullptr) bank_->ResetCounters();
    if (step_bank_ != nullptr) {
      Result<StepBankTotals> t = step_bank_->Totals();
      if (t.ok()) stats_aux_.bank_totals_at_reset = t.value();
    }
    if (policy_ != nullptr) stats_aux_.policy_at_reset = policy_->counters();
    for (TimingRing* r : {&timing_.select, &timing_.attend}) {
      for (TimingPair& t : r->pairs) t.pending = false;
    }
    timing_.select_key_bytes = 0;
    timing_.attend_bytes = 0;
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
  // Makes the device, the policy and the pool, sizes every buffer against the GPU cap, then
  // allocates: the call's buffers (InitCallBuffers), the rings, the bank (InitBanks), the
  // prefill staging (InitPrefillStaging, CUDA), priming's (InitPrimeBuffers), the shadow scan
  // (InitDeviceScan) and the planned step's (InitStepBuffers).
  Status Init();
  Status CreateDevice();  // the backend's device (through a test's decorator) and its stream
  void DeriveDims();         // dims_ from the configuration and the policy
  void InitDeferredPrime();  // priming deferred to the first Decode: prime_'s pending rows
  Status InitCallBuffers();
  Status InitBanks();
  Status InitPrefillStaging();
  Status InitPrimeBuffers();
  Status InitDeviceScan();
  // Measures the scheduler's rates (CPU sparse attention, PCIe zero-copy gather) into cost_.
  Status ProbeCosts();
  Result<void*> Alloc(size_t bytes, bool host);
  /// Alloc, typed: a buffer of \p bytes as T*.
  template <typename T>
  Result<T*> AllocAs(size_t bytes, bool host) {
    KVF_ASSIGN_OR_RETURN(void* p, Alloc(bytes, host));
    return static_cast<T*>(p);
  }
  // ---- device memory (runtime/device_memory.cpp) ----
  // Bytes Alloc takes for a request of \p bytes (the one rounding rule the sizing shares).
  static size_t AllocBytes(size_t bytes);
  /// True if the environment variable \p name is set to exactly \p value (the runtime's switches,
  /// read at Create).
  // Whether a ReferencePaths choice takes the device path on this backend.
  bool OnDevicePath(PathChoice choice) const;
  // The host store's shape, and the banks' configurations for \p bank_slots.
  HostStoreShape StoreShape() const;
  StepBankConfig StepBankConfigFor(int bank_slots) const;
  TokenBankConfig TokenBankConfigFor(int bank_slots) const;
  // Sizes every device buffer Init allocates with \p bank_slots slots in the bank, and the
  // layout they follow. Needs device_, policy_ and the scalars Init derives before it.
  Status SizeDeviceBuffers(int bank_slots, DeviceBufferSizes& sizes) const;
  // SizeDeviceBuffers' parts, in its order: which bank and its sizes, the CUDA prefill staging,
  // priming on the device, the planned step (its mode, SizeStepLists: its lists, the selector's
  // and the device bank's staging), the shadow scan (last: it gives way under the cap).
  Status SizeBank(int bank_slots, DeviceBufferSizes& z) const;
  void SizePrefillStaging(const HostStoreShape& store, DeviceBufferSizes& z) const;
  void SizePriming(DeviceBufferSizes& z) const;
  Status SizePlannedStep(DeviceBufferSizes& z) const;
  Status SizeStepLists(DeviceBufferSizes& z) const;
  void SizeDeviceScan(DeviceBufferSizes& z) const;
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
  // PrefillReserved's parts over one PrefillCall: the chunk on CUDA's tensor cores (its stage and
  // kernel arguments filled by FillPrefillStageArgs and FillPrefillChunkArgs) or the paged kernel
  // (PrefillPaged), and q to f32 per KV head (TransposePrefillQ).
  struct PrefillCall;
  Status PrefillTensorCores(const PrefillCall& c);
  void FillPrefillStageArgs(const PrefillCall& c, PrefillStageArgs& st) const;
  void FillPrefillChunkArgs(const PrefillCall& c, PrefillChunkArgs& a);
  Status PrefillPaged(const PrefillCall& c);
  Status TransposePrefillQ(const PrefillCall& c);
  // Decode after the batch's new rows are appended and counted: selection, attention, merge,
  // output and bank admission (host-side selection and the dense path).
  Status AttendAppended(std::span<const SequenceId> seqs, std::span<const int> slot_of, int layer,
                        const TensorView& out, StreamHandle stream);
  // AttendAppended's stages over one HostLayer: the dense path (HostDense), or select (HostSelect:
  // the policy on the pool), resolve and route (HostResolve, HostResolveItem: resident rows, the
  // token bank, the misses split between the routes), attend (HostAttend: the GPU part, then the
  // CPU part), the merge, admit (HostAdmit: the fetched rows into the token bank).
  struct HostLayer;
  Status HostDense(const HostLayer& s);
  Status HostSelect(const HostLayer& s);
  Status HostResolve(HostLayer& s);
  void HostResolveItem(HostLayer& s, int64_t i);
  Status HostAttend(const HostLayer& s);
  void HostAdmit(const HostLayer& s);
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
  // The planned step's state and buffers (InitStepBuffers): the CPU part's and the split's
  // (InitCpuPartBuffers), the selection lists (InitSelectLists) with the device bank's staging
  // (InitBankStaging), the plan's (InitPlanBuffers).
  Status InitStepBuffers();
  Status InitCpuPartBuffers();
  Status InitSelectLists();
  Status InitBankStaging();
  Status InitPlanBuffers();
  // Checks that a chunk ending at new_len fits, retires a pending plan and reserves its pages.
  // Priming a policy that learns from the prompt (Policy::prime_rows > 0) is deferred: a prefill
  // chunk only keeps its last rows of q (DeferPrime, one asynchronous copy, no wait), and the first
  // Decode of that (sequence, layer) primes from them (FlushPrime: OnPrefill, or with prime_.rows
  // Device::PrimeAttention over the store then OnPrefillPrimed; Stats::ms_prime). A policy primes
  // from the prompt's last chunk only (each chunk re-primes from scratch), so priming once from
  // the last chunk's rows gives what priming after every chunk gave, at one pass over the
  // history per layer instead of one per chunk. ReferencePaths::prime_eager primes at each chunk (the
  // earlier behaviour, for comparison).
  Status DeferPrime(int slot, int layer, int64_t new_len, int64_t tokens, const void* q_src,
                    DType q_dtype, StreamHandle stream);
  // \p same_call: the rows were copied by the call still under way (ReferencePaths::prime_eager): wait
  // for \p stream instead of the last call.
  Status FlushPrime(int slot, int layer, StreamHandle stream, bool same_call);
  // Primes (slot, layer) at length new_len from the f32 queries in io_.q_f32, [Hkv][rows][G][D]: the
  // last `rows` query rows of the prompt.
  Status PrimePolicy(int slot, int layer, int64_t new_len, int rows, StreamHandle stream);
  // CUDA: copies the layer's rows [0, n) of one sequence into the prefill staging (one PCIe pass)
  // and points prefill_.pages_dev at them.
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
  // a layer's lists are counted (once a layer), then each item's (a blockwise selector's may hold fewer).
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
  // The run: one layer of the step on the device, as its stages over one DecodeLayer (the call
  // and what each stage hands on): plan, select, resolve, route, attend, admit, merge.
  Status RunDecodeStep(std::span<const SequenceId> seqs, int layer, const TensorView& q,
                       const TensorView& k, const TensorView& v, const TensorView& out,
                       StreamHandle stream);
  struct DecodeLayer;
  // plan: checks the call against a capture, joins the side work the layer reads, takes the
  // plan's positions (or checks, reserves and uploads the token's own), stages the inputs and
  // fills the step's arguments (FillStepArgs) and row counts (CountStepRows). Its failures before
  // the inputs are staged leave the token as it was; after, the token is taken back.
  Status PlanLayer(DecodeLayer& s);
  // A planned layer's token taken back (a self-planned one was not counted yet).
  void UncommitLayer(const DecodeLayer& s);
  void FillStepArgs(DecodeLayer& s);
  void FillListArgs(DecodeLayer& s);  // kList mode's part and the device bank's view
  void CountStepRows(DecodeLayer& s);
  // select: q, k and v to the host where the host selects (InputsToHost), the shadow scan, the
  // device's selection (SelectOnDevice: the selector's kernel, xl+'s copy of the previous layer's list) or
  // the host's lists (UploadHostLists).
  Status SelectLayer(DecodeLayer& s);
  Status InputsToHost(DecodeLayer& s);
  Status SelectOnDevice(DecodeLayer& s);
  // resolve: waits for a cross-layer prefetch in flight (its stage holds this layer's misses when
  // it was this layer's) and starts the next layer's beside this one's step.
  Status ResolveLayer(DecodeLayer& s);
  // route: the scheduler's split (SplitState) of the layer's misses; when it splits, hands the
  // CPU's share over (DecodeLayer::handed_over) and returns the hand-over's status.
  Status RouteLayer(DecodeLayer& s);
  // attend: the device's step (after the admission that last read its staging region).
  Status AttendLayer(DecodeLayer& s);
  // admit: the device bank admits the step's misses (beside the stream with two regions).
  Status AdmitLayer(DecodeLayer& s);
  // merge: a CPU step's part, handed over to the runtime's thread (DecodeLayer::handed_over), or
  // selected and attended here (RunCpuStepPart), uploaded and merged with the device's part.
  Status MergeLayer(DecodeLayer& s);
  Status RunCpuStepPart(DecodeLayer& s);
  // The output copied out, the step's side work joined at its last layer, the call recorded.
  Status FinishLayer(DecodeLayer& s);
  // A failed layer: the token taken back, the policy told, the ring and the bank's miss lists
  // restored; returns \p failure (with the restore's error, if any).
  Status FailLayer(const DecodeLayer& s, Status failure);
  // A layer done: counted (CommitDecodeStep), the gap's timing started, the step's row counters.
  void CommitLayer(const DecodeLayer& s);
  // The CPU half of a planned step for a CPU-placed policy (runtime/cpu_step.cpp): waits for q to
  // reach the host, then per (sequence, KV head), on the pool, selects and attends the selected
  // offloaded rows from the host store into io_.o_cpu_host / io_.lse_cpu_host (-inf where none). On
  // a policy failure returns its Status with nothing on the device changed by this function.
  // Runs the policy's Select for (slot, layer, kv_head) with n positions and the group's fp32
  // queries q into scratch_.selections[item]; a selection over dims_.item_cap is kInternal.
  /// \p threads: SelectContext::threads (pool threads per item of the step, at least 1);
  /// \p scan: SelectContext::scan (the device's scan ranking for this item, or null).
  Status SelectItem(int64_t item, int slot, int layer, int kv_head, int64_t n, const float* q,
                    int threads, const DeviceScanPicks* scan = nullptr);
  /// Pool threads per item when \p items run at once (SelectContext::threads).
  int SelectThreads(int64_t items) const;

  // First writes the new tokens' K/V rows to the host store (the step's kernels write only their
  // resident rows: DecodeStepArgs::host_writes_store). q/k/v: the caller's inputs in host memory.
  // With \p lists (step_.host_lists), the selections are not attended here: item i's positions go to
  // lists[i * lists_.cap ..] and its count to counts[i] (pinned memory the step's list is copied
  // from), and the device step attends them all. \p launch (when set) runs on the calling thread
  // while the pool's threads start on the items (CpuPool::ParallelForBeside): device launches the
  // items need not wait behind (the deferred scan, the step kernel), their host time hidden.
  Status SelectOnHost(std::span<const int> slot_of, int layer, std::span<const int64_t> positions,
                      const TensorView& q, const TensorView& k, const TensorView& v,
                      int32_t* lists = nullptr, int32_t* counts = nullptr,
                      const std::function<Status()>* launch = nullptr);
  // step_.host_lists: waits for io_.q_ready (q on the host, unless \p inputs_on_host: the caller's
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
  // derives from the keys (DeviceSelector::OnStored; page bounds, say); a no-op otherwise.
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
  // Runs fn and adds its thread time to stats_aux_.cpu_attend_ns (Stats::ms_cpu_attend_busy):
  // the CPU route's attention kernels, on the pool's threads.
  template <typename Fn>
  void AttendTimed(Fn&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    stats_aux_.cpu_attend_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
        std::memory_order_relaxed);
  }
  // Host waits inside Decode and PlanDecode, counted in Stats::host_syncs.
  Status HostWaitStream(StreamHandle stream);
  Status HostWaitEvent(EventHandle event);

  // ---- sliding-window layers (ModelShape::layer_window; runtime/window.cpp) ----
  // A sliding layer of window w keeps its rows in a ring of w rows per (slot, layer, KV head),
  // position p in row p % w: the first sink + window rows are the resident tier's own rows at that
  // layer (which a sliding layer does not use otherwise), the rest in win_.rings. It has no
  // host-store page, no policy and no PCIe traffic. Decode appends to the ring and attends every
  // row of it (Device::AttendRows); a prefill or append chunk copies the window's earlier rows and
  // the chunk into win_.stage, attends each query over its own window there, and writes the
  // chunk's last w rows to the ring last (a failure puts the earlier rows back from the staging).
  // Every step goes through Device calls both backends implement (CopyRows, AttendRows, MergeLse).
  [[nodiscard]] int WindowOf(int layer) const {
    return win_.widths.empty() ? 0 : win_.widths[static_cast<size_t>(layer)];
  }
  char* RingK(int slot, int layer, int h, int64_t row) const;
  char* RingV(int slot, int layer, int h, int64_t row) const;
  // The layout from the configuration (Init, before the sizing): win_.widths, win_.max, win_.ring_off,
  // win_.ring_slot_rows, win_.stage_rows.
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

  // Merges the CPU part (if any) into the GPU part and writes \p out in its dtype.
  Status WriteOutput(const float* o_b, const float* lse_b, int64_t rows, const TensorView& out,
                     StreamHandle stream);
  [[nodiscard]] SelectorShape SelectorShapeOf() const;
  // Joins the selector's work beside the step (all of it) into \p stream; Ok without a selector.
  Status JoinSelectorSide(StreamHandle stream);
  // Adds the time since t0 to a stage's Stats field and, while a trace records, a span.
  void Stage(double& ms, const char* name, TraceRecorder::Clock::time_point t0) {
    const auto t1 = TraceRecorder::Clock::now();
    ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    trace_.Span(name, "stage", t0, t1);
  }
  // Joins the device bank's admissions beside the stream (dbank_) and a cross-layer prefetch in
  // flight (xl_) into \p stream.
  Status JoinAdmitSide(StreamHandle stream);
  bool XlPrefetchWanted() const { return !xl_.automatic || xl_.gap_us < 0 || xl_.gap_us >= xl_.gap_min_us; }

  // ---- prefill staging and priming (runtime.cpp) ----
  // Room for one layer's kept rows (f32, the widest q dtype) and where (slot, layer)'s start.
  size_t PendingQBytes() const {
    return static_cast<size_t>(prime_.pending_rows) * config_.model.num_q_heads * config_.model.head_dim * 4;
  }
  char* PendingQ(int slot, int layer) const {
    return prime_.pending_q[static_cast<size_t>(slot)] + static_cast<size_t>(layer) * PendingQBytes();
  }
  // Chunk-major prefill (PrefillStaging::next): copies the history of the call this one predicts
  // next into the second staging on the copy stream while this call computes.
  Status PrefetchNextHistory(int slot, int layer, int64_t pos0, int64_t new_len);
  // Copies the layer's rows [0, n) of one sequence into \p staging on \p stream (one copy per run
  // of pages adjacent in the host store).
  Status CopyLayerPages(int slot, int layer, int64_t n, char* staging, StreamHandle stream);

  // ---- timing (Runtime::TimeDeviceSelect, the cross-layer prefetch's gap) ----
  static constexpr int kTimingRing = 4;  // timing pairs a layer (TimingRing)
  // CloseXlGap: ends the open gap pair at the start of \p layer's Decode (or drops it); starts
  // the next one at the end of \p layer's (OpenXlGap). Neither fails a call.
  void CloseXlGap(int layer, StreamHandle stream, bool capturing);
  void OpenXlGap(int layer, StreamHandle stream, bool capturing);
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

  // ---- the CPU part on the runtime's own thread (CpuPart; cpu_step.cpp) ----
  void CpuThreadMain();
  void HandOverCpuPart(const CpuPartJob& job);
  // The worker's side of a job: q on the host, then SelectOnHost.
  Status RunCpuPart(const CpuPartJob& job);
  // ---- the scheduler's split of a device selection's misses (SplitState) ----
  static constexpr int32_t kSplitShareStep = 16;  // SplitState::q10's move a measured step
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
  // RunDecodeStep's end when the CPU part runs on cpu_.thread: counts the step, hands the part
  // over, then enqueues the deferred shadow scan (\p scan_deferred), the step \p a over the resident
  // rows, the device's wait for the part, the upload and the merge.
  Status HandOverDecodeCpuPart(const DecodeStepArgs& a, bool scan_deferred, int layer, bool planned,
                               bool inputs_on_host, const TensorView& q_host,
                               const TensorView& k_host, const TensorView& v_host,
                               const TensorView& out, bool out_direct, StreamHandle stream,
                               int32_t split_q10 = 0);
  // An item's CPU attention split into up to kAttendMaxParts ranges of >= kAttendMinRows picks
  // (runtime/cpu_step.cpp): parts 1.. write [item][part - 1] of scratch_.attend_parts (o: group x
  // head_dim, then lse: group), merged into part 0's in order.
  static constexpr int kAttendMaxParts = 4;
  static constexpr int32_t kAttendMinRows = 128;
  // Attends \p n rows (\p ck, \p cv) of item \p item for q32 into (o, lse), in up to
  // min(threads, kAttendMaxParts) ranges as above: a CPU step's picks, a split step's CPU share.
  void AttendInParts(int64_t item, const float* q32, float* o, float* lse, const void** ck,
                     const void** cv, int32_t n, int threads);

  // ---- The shadow scan on the device (DeviceScan; cpu_step.cpp) ----
  Status WaitScanRanking();
  // The lists' lengths from the device's counts, into scan_.view (once they arrived).
  void TakeScanCounts();
  // The policy's shadow of (slot, layer) copied to the device (after priming), or marked absent.
  Status CopyScanShadow(int slot, int layer, StreamHandle stream);
  // Prepares the step's scan (q, k: the staged inputs, device-readable; the item table, the
  // ranking and its counts in mapped host memory) and, unless \p defer (CUDA: SelectOnHost's
  // launch enqueues it beside the Selects), enqueues it on \p stream (EnqueueDeviceScan) and
  // records scan_.ready. Items without a device shadow only skip it.
  Status LaunchDeviceScan(std::span<const int> slot_of, int layer,
                          std::span<const int64_t> positions, const void* q, DType q_dtype,
                          const void* k, DType k_dtype, StreamHandle stream, bool defer = false);
  Status EnqueueDeviceScan();

  // ==== state ====================================================================================
  // The components Init makes (in this order; the destructor tears them down explicitly).
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
  std::unique_ptr<cpu::CpuPool> pool_;
  // How long the pool's workers spin after a step's CPU items for the next layer's
  // (CpuPool::KeepWarm): RuntimeConfig::cpu_spin_us, 0 (off) by default (runtime.cpp says why).
  int64_t pool_warm_us_ = 0;
  TraceRecorder trace_;
  // The host-managed bank: the host backend's, and on CUDA only for route auto with a GPU-placed
  // policy that selects on the host (its misses are split between the routes per row on the
  // host). Null without bank_slots (see Init for the rule).
  std::unique_ptr<TokenBank> bank_;
  // CUDA, bank_slots > 0, a policy that selects on the device (route gpu or auto) or on the host
  // (route gpu: step_.host_lists): the bank lives in device memory and the planned step reads and
  // admits it (bank_ stays null); its step buffers are dbank_.
  std::unique_ptr<StepBank> step_bank_;
  StreamHandle side_stream_ = nullptr;    // bank_'s admissions
  EventHandle bank_step_done_ = nullptr;  // bank_: the step's reads of it done (CPU route and
                                          // host-side selection)
  CostModel cost_;
  Dims dims_;

  // Sequences: slots, lengths, the last selections.
  std::unordered_map<SequenceId, int> slots_;
  std::vector<int> free_slots_;
  std::vector<int64_t> lengths_;  // [slot][layer]
  std::vector<std::vector<int32_t>> last_selection_;  // per (slot, layer, kv head)

  // Device memory: every buffer Alloc made (freed at destruction), the resident tier, the call's
  // staging and descriptors.
  std::vector<DeviceBuffer> buffers_;
  char* resident_ = nullptr;  // device: [slot][layer][kv_head][K rows (S+W), V rows (S+W)]
  CallBuffers io_;
  Descriptors desc_;
  EventHandle call_done_ = nullptr;          // the last call's work (BeginCall waits for it)
  StreamHandle last_call_stream_ = nullptr;  // the stream of the last EndCall

  PrefillStaging prefill_;
  Priming prime_;
  WindowLayers win_;

  // The decode step: the plan, the step's mode and buffers, its lists, the device bank's
  // staging, the cross-layer prefetch, the CPU part, the split, the shadow scan and the
  // host-side scratch.
  StepPlan plan_;
  PlannedStep step_;
  SelectLists lists_;
  DeviceBankStep dbank_;
  XlPrefetch xl_;
  CpuPart cpu_;
  SplitState split_;
  DeviceScan scan_;
  StepScratch scratch_;

  Stats stats_;
  StatsAux stats_aux_;
  DeviceTiming timing_;
};

}  // namespace kvferry::detail
