// Copyright kvferry authors. Apache-2.0.
#pragma once
// The Device interface: everything the runtime asks of the accelerator. Two implementations: the
// CUDA backend (gpu/cuda_device.cu) and the host-emulated device (gpu/host_device.cpp), which runs
// the same plan with the CPU reference kernels so the runtime is testable without a GPU.
//
// Contract: allocation happens only at set-up or when a sequence grows by a page; the per-step
// entry points (Convert*, Attend*, Merge*, CopyAsync) never allocate and are ordered on the stream
// they are given. Work descriptors (item arrays) must live in memory the device can read: device
// memory or mapped pinned host memory from AllocHost. Pointers inside them likewise.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "base/attn_types.h"
#include "kvferry/config.h"
#include "kvferry/runtime.h"
#include "kvferry/status.h"
#include "kvferry/tensor.h"

namespace kvferry {

using EventHandle = void*;

/// One row copy with dtype conversion: \p elems elements from src (src_dtype) to dst (dst_dtype).
struct RowCopy {
  void* dst = nullptr;
  const void* src = nullptr;
};

namespace cuda {
/// What a CUDA launch needs of the device besides the stream.
struct LaunchInfo {
  int num_sms = 132;
  int max_splits = 128;  ///< upper bound on KV splits per item
  int min_chunk = 256;  ///< fewest rows a split handles (shorter lists use fewer CTAs)
};
}  // namespace cuda

/// One kernel of a policy's device work (its selection, the metadata it keeps), in the policy's
/// folder (docs/design.md, "Device selection"): the CUDA launcher, compiled only with CUDA (null
/// without), and the host backend's twin, which computes the same on the CPU. Device::Run calls
/// the one of its backend; neither allocates. \p args is what the kernel's launcher declares
/// (DecodeStepArgs for a selection).
struct DeviceKernel {
  const char* name = "";
  /// \p stream: the cudaStream_t.
  Status (*cuda)(const void* args, const cuda::LaunchInfo& info, void* stream) = nullptr;
  Status (*host)(const void* args) = nullptr;
};

/// A DeviceKernel's CUDA launcher: \p fn in a CUDA build, null without (its .cu is not built).
#ifdef KVFERRY_WITH_CUDA
#define KVF_CUDA_FN(fn) (&(fn))
#else
#define KVF_CUDA_FN(fn) nullptr
#endif

/// Sizes of a device token bank (Device::CreateStepBank).
struct StepBankConfig {
  int num_tables = 0;          ///< max_sequences * num_layers * num_kv_heads
  int slots = 0;               ///< rows per table, in [1, 65534]
  int64_t max_positions = 0;   ///< positions per table
  int head_dim = 128;
  DType kv_dtype = DType::kBF16;
  bool hash_map = false;       ///< hash page tables instead of position -> slot arrays
};

/// Device bytes a device token bank of a StepBankConfig allocates (Device::StepBankSizes): what
/// Device::CreateStepBank then allocates, exactly.
struct StepBankSizes {
  size_t rows = 0;         ///< the K and V rows of every slot
  size_t page_tables = 0;  ///< vector or hash maps
  size_t slot_state = 0;   ///< back-references, CLOCK counts, reference bits, per-table state
  size_t admit_item_bytes = 0;  ///< bytes of one admission item (StepBank::admit_item_bytes)
  int max_admit = 0;            ///< StepBank::max_admit
  [[nodiscard]] size_t total() const { return rows + page_tables + slot_state; }
};

/// Totals of a device token bank since creation.
struct StepBankTotals {
  int64_t hits = 0, misses = 0, admitted = 0, evicted = 0, rejected = 0;
};

/// A token bank that lives in device memory and is managed there (CUDA: cuda::DeviceBank): the
/// planned decode step reads it (DecodeStepArgs::bank) and queues its admission; the host never
/// touches a row or a map entry.
class StepBank {
 public:
  virtual ~StepBank() = default;
  /// The bank's fields of DecodeStepArgs::bank (maps, rows, reference bits, hit counter); the
  /// caller sets stage, miss, miss_cap and admit.
  virtual void View(StepBankView* view) const = 0;
  /// Bytes of one admission item (StepBankView::admit holds one per decode item).
  [[nodiscard]] virtual size_t admit_item_bytes() const = 0;
  /// Most misses one admission considers per table.
  [[nodiscard]] virtual int max_admit() const = 0;
  /// Queues the admission of the step's misses, \p num_items items at \p items (written by the
  /// step kernel), after the step on \p stream.
  virtual Status Admit(const void* items, int num_items, StreamHandle stream) = 0;
  /// Empties tables [first, first + count) on \p stream.
  virtual Status ResetTables(int first, int count, StreamHandle stream) = 0;
  /// Reads the counters back (waits for the device).
  virtual Result<StepBankTotals> Totals() const = 0;
  /// Device bytes held.
  [[nodiscard]] virtual size_t bytes() const = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  [[nodiscard]] virtual Backend backend() const = 0;
  [[nodiscard]] virtual std::string name() const = 0;
  /// PCI bus id of the accelerator ("0000:3b:00.0"), empty for the host device. The CPU worker
  /// pool pins itself to the cores of this device's NUMA node.
  [[nodiscard]] virtual std::string pci_bus_id() const { return {}; }

  // ---- memory (set-up time) ----
  virtual Result<void*> AllocDevice(size_t bytes) = 0;
  virtual void FreeDevice(void* ptr) = 0;
  /// Host memory the device can read and write directly (pinned and mapped on CUDA; 64-byte
  /// aligned and NUMA-placed on the host backend).
  virtual Result<void*> AllocHost(size_t bytes) = 0;
  virtual void FreeHost(void* ptr) = 0;
  /// Device memory held now: the live AllocDevice blocks (as requested) plus the device's own
  /// per-stream scratch (stream_scratch_bytes() per stream it holds one for). What
  /// Stats::device_bytes_reserved reports, and what the GPU memory cap is checked against.
  [[nodiscard]] virtual int64_t device_bytes_held() const = 0;
  /// The device's whole memory in bytes (0 where it has none of its own: the host device).
  [[nodiscard]] virtual int64_t total_device_bytes() const { return 0; }
  /// Device memory the device holds for each of its streams: the default stream's from creation,
  /// CreateStream's at once, a caller's stream's on its first use (CUDA: the split-KV workspace;
  /// 0 on the host).
  [[nodiscard]] virtual size_t stream_scratch_bytes() const = 0;

  // ---- streams and events ----
  /// The runtime's default stream (never the legacy null stream on CUDA).
  [[nodiscard]] virtual StreamHandle default_stream() const = 0;
  virtual Result<StreamHandle> CreateStream() = 0;
  virtual void DestroyStream(StreamHandle stream) = 0;
  virtual Result<EventHandle> CreateEvent() = 0;
  virtual void DestroyEvent(EventHandle event) = 0;
  virtual Status RecordEvent(EventHandle event, StreamHandle stream) = 0;
  virtual Status WaitEvent(StreamHandle stream, EventHandle event) = 0;  ///< stream waits, host doesn't
  virtual Status SynchronizeEvent(EventHandle event) = 0;                 ///< host waits
  virtual Status SynchronizeStream(StreamHandle stream) = 0;
  /// An event that also records when the device reached it, for ElapsedMs (CUDA: an event with
  /// timing; the host device: the host clock at RecordEvent, where its work runs).
  virtual Result<EventHandle> CreateTimingEvent() = 0;
  /// Milliseconds on the device from \p start to \p end, two timing events recorded on one
  /// stream and complete.
  virtual Result<double> ElapsedMs(EventHandle start, EventHandle end) = 0;

  // ---- data movement ----
  /// Any-direction copy (unified addressing).
  virtual Status CopyAsync(void* dst, const void* src, size_t bytes, StreamHandle stream) = 0;
  /// Host -> device copies dst[i] <- src[i] (bytes[i] each) in stream order. CUDA enqueues them
  /// in one batched call (far less host time than a CopyAsync each for thousands of pages); the
  /// arrays may be reused once this returns.
  virtual Status CopyBatchAsync(void** dst, const void** src, size_t* bytes, int64_t count,
                                StreamHandle stream) {
    for (int64_t i = 0; i < count; ++i) {
      Status st = CopyAsync(dst[i], src[i], bytes[i], stream);
      if (!st.ok()) return st;
    }
    return Status::Ok();
  }
  /// Converts and scatters rows: rows[i].dst <- convert(rows[i].src), elems each.
  virtual Status CopyRows(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                          DType dst_dtype, StreamHandle stream) = 0;

  // ---- compute ----
  virtual Status AttendRows(const AttnParams& p, const RowAttnItem* items, int64_t num_items,
                            StreamHandle stream) = 0;
  virtual Status AttendPaged(const AttnParams& p, const PagedAttnItem* items, int64_t num_items,
                             StreamHandle stream) = 0;
  /// One layer of a planned decode step (see DecodeStepArgs): append, attend, combine. Reads the
  /// step's slots and positions from device memory, never allocates and never synchronises, so
  /// it can be captured in a CUDA graph.
  virtual Status DecodeStep(const DecodeStepArgs& args, StreamHandle stream) = 0;
  /// A kernel of a policy's device selection (see DeviceKernel) on \p args: its CUDA launcher
  /// on the CUDA backend, its host twin on the host backend; ordered on \p stream like every other
  /// entry point, and, where the kernel allows it (the selections do), capture-safe.
  virtual Status Run(const DeviceKernel& kernel, const void* args, StreamHandle stream) = 0;
  /// The scheduler's split of a step's selection (see SplitListArgs): on \p stream after the
  /// selection that wrote step.list; never allocates, never synchronises (not in a CUDA graph:
  /// the runtime's CPU share of the split is host work).
  virtual Status SplitStepList(const DecodeStepArgs& step, const SplitListArgs& split,
                               StreamHandle stream) = 0;
  /// The scheduler's cross-layer prefetch (xl+): \p next is the next layer's step as it will run
  /// (layer, bank table, stage region) over the list it will take (this layer's, which xl+ copies).
  /// Every list entry that is neither resident nor in next.bank's table of (slot, next.layer, head)
  /// is a miss of that step; its K and V rows are copied from the host store (zero-copy) into
  /// next.bank.stage at its list index, where the step then reads them (StepBankView::staged).
  /// Writes nothing else; never allocates, never synchronises (capture-safe).
  virtual Status PrefetchListRows(const DecodeStepArgs& next, StreamHandle stream) = 0;
  /// One prefill chunk on tensor cores (see PrefillChunkArgs). Only the CUDA device has the
  /// kernel; the runtime calls this only there (the host device prefills with AttendPaged), so
  /// the base class reports the call as a misuse.
  virtual Status PrefillChunk(const PrefillChunkArgs& args, StreamHandle stream) {
    (void)args;
    (void)stream;
    return Internal("PrefillChunk called on a device without the tensor-core prefill kernel");
  }
  /// The prefill priming statistics of a (sequence, layer)'s KV heads (see PrimeArgs), on
  /// \p stream after the work that wrote the rows and queries it reads; never allocates. The
  /// host device computes them with cpu::PrimeAttentionRef, CUDA with gpu/prime.cu; a device
  /// without either reports kUnimplemented.
  virtual Status PrimeAttention(const PrimeArgs& args, StreamHandle stream) {
    (void)args;
    (void)stream;
    return Unimplemented("this device cannot compute the prefill priming statistics");
  }
  /// LFPS's scan over the device's copy of the policy's int8 shadow of K (see ShadowScanArgs), on
  /// \p stream after the work that wrote q and k; never allocates. The host device runs
  /// cpu::ShadowScanRef, CUDA gpu/shadow_scan.cu.
  virtual Status ShadowScan(const ShadowScanArgs& args, StreamHandle stream) {
    (void)args;
    (void)stream;
    return Unimplemented("this device cannot run LFPS's scan");
  }
  /// A token bank in device memory for the planned step, or kUnimplemented where the device has
  /// none (the host device: the runtime keeps its host-managed TokenBank there).
  virtual Result<std::unique_ptr<StepBank>> CreateStepBank(const StepBankConfig& config) {
    (void)config;
    return Unimplemented("this device has no device-managed token bank");
  }
  /// The device bytes CreateStepBank(\p config) would allocate, or kUnimplemented where
  /// CreateStepBank is (the two share one formula on CUDA).
  virtual Result<StepBankSizes> StepBankSizesFor(const StepBankConfig& config) const {
    (void)config;
    return Unimplemented("this device has no device-managed token bank");
  }
  /// Whether \p stream is being captured into a CUDA graph (always false on the host).
  [[nodiscard]] virtual bool IsCapturing(StreamHandle stream) const {
    (void)stream;
    return false;
  }
  /// True if the event's work is complete (the host does not wait).
  [[nodiscard]] virtual bool EventDone(EventHandle event) const {
    (void)event;
    return true;
  }

  /// The stream waits, the host does not, until the 32-bit word at \p word (pinned host memory,
  /// which another host thread writes) reaches \p value: until (int32_t)(*word - value) >= 0, so a
  /// ticket that wraps around still compares. Work enqueued after it runs once the word is
  /// written. On the host backend (synchronous streams) the calling thread spins until then. A
  /// wait that lasts kHostValueTimeoutS gives up and sets word[1] to 1 (the writer is gone).
  virtual Status WaitHostValue(const uint32_t* word, uint32_t value, StreamHandle stream);
  static constexpr int kHostValueTimeoutS = 60;

  /// In-place exact merge (see cpu::MergeLseRef); o_b/lse_b may be null (nothing to merge), then
  /// writes out only. Finally converts o_a to \p out (rows x head_dim, out_dtype) if out != null.
  virtual Status MergeLse(float* o_a, float* lse_a, const float* o_b, const float* lse_b,
                          int64_t rows, int head_dim, void* out, DType out_dtype,
                          StreamHandle stream) = 0;
};

/// Checks a PrimeArgs' sizes and pointers (both devices call it first): kInvalidArgument with the
/// reason.
Status CheckPrimeArgs(const PrimeArgs& args);

/// Host-emulated device: plain (aligned) host memory, synchronous "streams", reference kernels.
std::unique_ptr<Device> MakeHostDevice();

// CudaAvailable() is public (kvferry/runtime.h).
/// The CUDA device \p device_id, or kUnimplemented when built without CUDA.
Result<std::unique_ptr<Device>> MakeCudaDevice(int device_id);

}  // namespace kvferry
