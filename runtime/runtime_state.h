// Copyright kvferry authors. Apache-2.0.
#pragma once
// RuntimeImpl's state, grouped by purpose (runtime/runtime_impl.h holds the class): one struct per
// concern, each saying what it holds and which code writes it. Plain aggregates: the runtime's
// member functions read and write their fields directly (`prefill_.staged`, `scan_.ready`).

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "gpu/device.h"
#include "policies/policy.h"

namespace kvferry::detail {

// ---- types the groups hold ---------------------------------------------------------------------

/// A (start, end) pair of timing events (Runtime::TimeDeviceSelect, the cross-layer prefetch's gap
/// timing). Pending from its end's record until its time is read, when the pair comes round again.
struct TimingPair {
  EventHandle start = nullptr, end = nullptr;
  bool pending = false;
};

/// RuntimeImpl::kTimingRing timing pairs a layer, used in turn.
struct TimingRing {
  std::vector<TimingPair> pairs;  // [layer][kTimingRing], created when turned on
  std::vector<int> next;          // per layer: the pair it takes next
};

/// A CPU part handed to the runtime's thread (CpuPart; RuntimeConfig::async_cpu).
struct CpuPartJob {
  int layer = 0;
  bool inputs_on_host = false;
  StreamHandle stream = nullptr;
  TensorView q, k, v;  // on the host: io_.q_raw_host, or the caller's (host backend)
  int64_t batch = 0;
  bool planned = false;
  uint32_t ticket = 0;
  int32_t q10 = 0;  // > 0: a split step's CPU share (RunSplitPart) of q10 / 1024 of the misses
  bool balance = false;  // RunSplitPart moves split_.q10 by what it finds (CUDA, no override)
};

/// A (sequence, layer)'s priming deferred to its first Decode (RuntimeImpl::DeferPrime).
struct PendingPrime {
  int64_t n = 0;     // the (sequence, layer)'s length after the chunk; 0: nothing pending
  int32_t rows = 0;  // query rows kept: the chunk's last min(prime rows, chunk tokens)
  DType dtype = DType::kF32;
};

/// What a prefill staging holds: rows [0, rows) of (slot, layer), or nothing (slot -1).
struct StagedRows {
  int slot = -1, layer = -1;
  int64_t rows = 0;
};

/// The last prefill chunk (PrefetchNextHistory predicts the next call from it).
struct LastPrefill {
  int slot = -1, layer = -1;
  int64_t pos0 = -1, new_len = -1;
};

// ---- the groups --------------------------------------------------------------------------------

/// Scalars derived from the configuration. Written once by DeriveDims (Init, before the sizing),
/// read-only after.
struct Dims {
  int group = 1;        // query heads per KV head
  float scale = 1.0f;   // the softmax scale
  size_t kv_elem = 2;   // bytes of a K/V element
  size_t row_bytes = 0;  // one K (or V) row
  int64_t max_rows = 0;  // most tokens in one call (prefill chunk or batch)
  int64_t item_cap = 0;  // most positions one (sequence, KV head) attends per step (0: dense)
  int64_t budget_max = 0;  // the largest budget any step gets (0: dense)
};

/// A call's activations staged for the device and the attention's partial results, in device and
/// pinned host memory. Allocated by InitCallBuffers (q_raw_host and q_ready by
/// InitCpuPartBuffers); rewritten by every Prefill, Append and Decode.
struct CallBuffers {
  // device staging
  void* q_in = nullptr;
  void* k_in = nullptr;
  void* v_in = nullptr;
  void* out_stage = nullptr;
  float* q_f32 = nullptr;  // device, decode: [B, Hq, D]; prefill: [Hkv, T, G, D]
  float* o_gpu = nullptr;  // device, like q_f32
  float* lse_gpu = nullptr;
  float* o_cpu_dev = nullptr;
  float* lse_cpu_dev = nullptr;
  // pinned host
  float* q_host = nullptr;
  float* o_cpu_host = nullptr;
  float* lse_cpu_host = nullptr;
  // The planned step's CPU step, host lists and split: q, k, v of a step as the caller gave them
  // (pinned), and the event after which q_raw_host holds this call's q, k, v.
  void* q_raw_host = nullptr;
  EventHandle q_ready = nullptr;
};

/// Pinned descriptors the device reads: row copies, attention items and their row lists. One
/// region per use in a call, so that no region is rewritten while an earlier asynchronous launch
/// of the same call may still read it (BeginCall waits for the last call's). Allocated by
/// InitCallBuffers.
struct Descriptors {
  RowCopy* k_copies = nullptr;  // [max_rows * Hkv * 2]
  RowCopy* v_copies = nullptr;  // [max_rows * Hkv * 2]
  RowCopy* q_copies = nullptr;  // [max_rows * Hq]
  RowCopy* o_copies = nullptr;  // [max_rows * Hkv]
  RowAttnItem* gpu_items = nullptr;  // [max_batch * Hkv]
  RowAttnItem* cpu_items = nullptr;  // [max_batch * Hkv]
  PagedAttnItem* paged_items = nullptr;
  const void** gpu_k_rows = nullptr;  // [item][item_cap] row addresses
  const void** gpu_v_rows = nullptr;
  const void** cpu_k_rows = nullptr;
  const void** cpu_v_rows = nullptr;
};

/// Host-side scratch of a decode call, reserved at Create so that the decode path does not
/// allocate. Written by Decode, PlanDecode, RunDecodeStep and the CPU part (which reads
/// batch_slots and step_pos of the job it was handed).
struct StepScratch {
  std::vector<int> batch_slots;   // [batch]: the call's slots (read by the worker threads too)
  std::vector<int64_t> step_pos;  // [batch]: new token's position at the layer
  std::vector<int64_t> implicit_pos;  // [batch * layers]: a Decode's own plan
  std::vector<int> plan_slots;        // [batch]: PlanDecode's slots
  std::vector<std::vector<int32_t>> selections;  // per decode item
  std::vector<Status> item_status;               // per decode item
  std::vector<std::vector<int32_t>> offloaded;   // per decode item: selected, not resident
  std::vector<std::vector<int32_t>> misses;      // per decode item: bank misses, then fetched
  // An item's CPU attention split into up to RuntimeImpl::kAttendMaxParts ranges (AttendInParts):
  // parts 1.. write [item][part - 1] (o: group x head_dim, then lse: group), merged into part 0's.
  std::vector<float> attend_parts;
};

/// Which planned decode step this runtime runs (runtime/decode_plan.cpp), and the step's device
/// buffers. InitStepBuffers sets them from sizes_ (host_lists: InitBanks, with the bank) and
/// InitPlanBuffers allocates the buffers.
struct PlannedStep {
  bool fast_path = false;  // policy selects on the device, no host-managed bank, route gpu/auto
  // A CPU-placed policy whose selections cover the resident rows, route cpu (auto), no bank: the
  // planned step attends the resident rows on the device while the host selects, and merges the
  // CPU's part after (SelectOnHost). Not capture-safe (the host is inside the step).
  bool cpu_step = false;
  // CUDA, bank_slots > 0, a policy that selects on the host (Select: a policy without a device
  // selector, a selection wrapper), route gpu: the planned step with the device bank. Per layer q, k and v go
  // to the host (io_.q_raw_host, io_.q_ready), the host writes the new token's store rows and
  // selects per (sequence, KV head) on the pool (SelectOnHost) into lists_.stage, the lists go up
  // into the layer's lists_.positions region and the step kernel attends them in kList mode with
  // the bank as a row source, then StepBank::Admit. One host wait per layer: not capture-safe.
  bool host_lists = false;
  bool all_resident = false;  // every row such a step attends is resident
  int32_t* slots_dev = nullptr;  // device: [2 regions][max_batch]
  int64_t* pos_dev = nullptr;    // device: [2 regions][max_batch * num_layers]
  char* plan_stage = nullptr;    // pinned: [kPlanRing][plan_stage_bytes]
  size_t plan_stage_bytes = 0;
  std::vector<EventHandle> plan_events;  // [kPlanRing]: the copies that read an entry ran
  int plan_next = 0;                     // the entry UploadPlan takes next
  float* ws = nullptr;  // device: split partials of the step kernels
  int64_t ws_floats = 0;
  int32_t* counters = nullptr;  // device: zeroed split counters of the step kernel
};

/// The lists the planned step attends in kList mode: a device selection's (the policy has a
/// DeviceSelector, whose select_kernel writes them) or the host's (step_.host_lists, UploadHostLists), and the
/// device selection's scratch. Allocated by InitSelectLists; slots and n written by
/// SelectOnDevice (RunDecodeStep's select stage).
struct SelectLists {
  bool device_select = false;  // the policy selects on the device
  int64_t cap = 0;                // positions a list holds
  int32_t* positions = nullptr;   // device: [layer][max_batch * Hkv][cap]
  int32_t* counts = nullptr;      // device: [layer][max_batch * Hkv]
  float* select_ws = nullptr;     // device: [max_batch * Hkv][group][select_ld]
  int64_t select_ld = 0;
  unsigned long long* topk_ws = nullptr;  // device, when the list capacity exceeds 4096
  uint32_t* select_mcta_ws = nullptr;     // device (CUDA), the multi-CTA top-k's scratch
  std::vector<std::vector<int>> slots;    // [layer]: slots of the last step's batch
  // [layer]: each batch item's n at that layer's last selection (xl+ reuses the previous layer's
  // list only when the same slots selected there at the same n)
  std::vector<std::vector<int64_t>> n;
  // Host lists: pinned [layer][max_batch * Hkv][cap] positions, then [layer][max_batch * Hkv]
  // counts; a layer's part is rewritten only after up[layer] (its last upload) completed.
  int32_t* stage = nullptr;
  std::vector<EventHandle> up;
};

/// The device bank's step buffers (step_bank_: CUDA, bank_slots > 0, the planned step reads and
/// admits it). Staging of the step's misses (list index j of item i at stage + (i * lists_.cap +
/// j) * 2 * row_bytes), the miss lists ([items][1 + miss_cap]) and the admission items the step
/// kernel writes; regions sets of the three, region r at r * the *_region strides, layer l using
/// region l % regions. Allocated by InitBankStaging; the admission state written by AttendLayer,
/// AdmitLayer, ResolveLayer (RunDecodeStep's stages) and JoinAdmitSide.
struct DeviceBankStep {
  char* stage = nullptr;
  int32_t* miss = nullptr;
  void* admit = nullptr;
  int32_t miss_cap = 0;
  int regions = 1;
  size_t stage_region = 0, miss_region = 0, admit_region = 0;  // bytes
  // Two regions: layer l's admission runs on admit_stream, forked after its step (admit_fork[r]);
  // layer l + 2's step, which rewrites region r, waits for admit_done[r]. The stream joins back
  // into the caller's at the step's last layer and before anything else reads or writes the bank
  // (JoinAdmitSide: PlanDecode, ResetSelectState, a call for a layer at or below one still
  // outstanding, a sequence's removal, a failure). A captured graph holds whole steps, as with
  // a selector's side rebuilds.
  StreamHandle admit_stream = nullptr;
  EventHandle admit_fork[2] = {nullptr, nullptr}, admit_done[2] = {nullptr, nullptr};
  EventHandle admit_join = nullptr;
  bool admit_pending[2] = {false, false};
  int side_layer = -1;  // the last layer admitted beside the stream, -1 when joined
};

/// What Stats takes from beyond stats_: counters kept apart from it and the baselines ResetStats
/// records. Written by the steps (cpu_attend_ns by the pool's threads), read by stats().
struct StatsAux {
  // Thread-nanoseconds of the CPU route's attention kernels (Stats::ms_cpu_attend_busy), added by
  // the pool's threads (AttendTimed).
  std::atomic<int64_t> cpu_attend_ns{0};
  int64_t bank_step_selected = 0;  // rows of device selections read through the device bank
  StepBankTotals bank_totals_at_reset;
  PolicyCounters policy_at_reset;  // the policy's counters at the last ResetStats
};

/// Runtime::TimeDeviceSelect: RuntimeImpl::kTimingRing (start, end) timing-event pairs a layer,
/// used in turn. A pair is pending from its end's record until its time is added to
/// stats_.ms_select_device, when the pair comes round again (stats() adds the pending ones to its
/// copy), so no step waits for its own selection. The same rings time the device step's attention
/// (Stats::ms_attend_device): the planned step of a policy whose rows are all attended on the
/// device (neither a CPU step nor host lists). Written by TimeDeviceSelect and TimedLaunch.
struct DeviceTiming {
  bool on = false;
  TimingRing select, attend;
  // What the timed calls read, for the measured rates in Stats: the selections' key bytes and the
  // K/V bytes of the rows the timed steps attended (TimedLaunch counts them).
  int64_t select_key_bytes = 0;
  int64_t attend_bytes = 0;
};

/// The scheduler's cross-layer prefetch (xl+, the device bank with two regions;
/// RuntimeConfig::xl_prefetch): layer l + 1 will take layer l's list, so once layer l's list is
/// final (after its selection and xl+'s copy) ResolveLayer copies layer l + 1's misses of it into
/// region (l + 1) % 2's stage (Device::PrefetchListRows), on dbank_.admit_stream after layer
/// l - 1's admission (the last reader of that region) and beside layer l's step. Layer l + 1's
/// planned step then waits for done and reads its misses there (StepBankView::staged). Any other
/// call waits for it before its step too; JoinAdmitSide joins it with the admissions. Set up by
/// InitBankStaging; written by ResolveLayer, JoinAdmitSide, CloseXlGap and OpenXlGap.
struct XlPrefetch {
  bool on = false;
  // Auto (xl_prefetch -1): prefetch while gap_us, the running average of the stream time from the
  // end of a planned layer's Decode to the start of the next layer's (where the next layer takes
  // the previous one's list), is at least gap_min_us or not measured yet. The prefetch overlaps
  // the step beside it and that gap; with no gap, it races the step for PCIe and the next step
  // waits for it (stop 43: 0.78-0.88x of no prefetch in an attention-only loop, 1.07-1.12x with
  // 150-300 us of engine GPU work a layer). Timed by a ring of timing-event pairs a layer
  // (gap_timing, read kTimingRing steps later, so never waited for), on eager steps.
  bool automatic = false;
  double gap_min_us = 100.0;
  double gap_us = -1.0;
  EventHandle fork = nullptr, done = nullptr;
  int layer = -1;  // the layer whose misses a prefetch in flight stages, -1: none
  // The gap's timing: pairs of layers l >= 1, started at the end of layer l - 1's Decode, ended at
  // the start of layer l's.
  TimingRing gap_timing;
  TimingPair* gap_open = nullptr;  // started, its end not recorded yet
  int gap_layer = -1;              // the layer whose Decode ends gap_open
  StreamHandle gap_stream = nullptr;
};

/// The CPU part on the runtime's own thread (RuntimeConfig::async_cpu; runtime/cpu_step.cpp). The
/// caller's Decode enqueues the device's whole layer (the resident rows' attention, then a wait for
/// word[0] to reach the job's ticket, the (o, lse) upload and the merge), counts the step, hands
/// the job over and returns; thread waits for q on the host, runs SelectOnHost and writes the
/// ticket. One job at a time: every public call collects it first (CollectCpuPart), so while it
/// runs the caller touches neither the state it reads (the policy, the pool, the batch's slots and
/// positions, stats_) nor the pinned buffers it fills. Set up by InitCpuPartBuffers; the caller's
/// side (HandOverCpuPart, CollectCpuPart) and the thread's (CpuThreadMain) as marked.
struct CpuPart {
  bool async = false;
  uint32_t* word = nullptr;  // pinned: [0] the ticket of the last part done, [1] a wait timed out
  uint32_t ticket = 0;
  StreamHandle last_stream = nullptr;  // the stream of the last asynchronous part
  EventHandle part_up = nullptr;  // the last CPU part left io_.o_cpu_host / io_.lse_cpu_host
  CpuPartJob job;
  bool job_out = false;  // handed over and not collected (the caller's side)
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<uint64_t> go{0}, done{0};  // jobs handed over / finished
  bool sleeping = false, quit = false;   // under mu
  Status job_status;                     // the finished job's, read after done
};

/// The scheduler's split of a device selection's misses (DeviceBufferSizes::split). RouteLayer
/// (RunDecodeStep's route stage), route auto: after the layer's device selection, q goes down to
/// io_.q_raw_host and SplitStepList partitions each item's list: its last SplitCpuRows(misses,
/// q10) misses to the CPU (cpu_list, pinned, written by the device), the rest to the device's list
/// (gpu_list), which the step attends into (io_.o_gpu, io_.lse_gpu); ready follows. The CPU share
/// goes to cpu_.thread as a CpuPartJob with q10 set (RunSplitPart: waits for ready, attends its
/// rows from the host store on the pool into io_.o_cpu_host / io_.lse_cpu_host, writes the
/// ticket) and the stream merges the two as for a CPU step. Allocated by InitCpuPartBuffers.
struct SplitState {
  bool on = false;
  int32_t* gpu_list = nullptr;   // device: [max_batch * Hkv][lists_.cap]
  int32_t* gpu_count = nullptr;  // device: [max_batch * Hkv]
  int32_t* cpu_list = nullptr;   // pinned, mapped: [max_batch * Hkv][lists_.cap]
  int32_t* cpu_count = nullptr;  // pinned, mapped: [max_batch * Hkv]
  EventHandle ready = nullptr;
  // The balance of the two branches, measured (CUDA, the model's share): after the step over the
  // device's share the stream records step_done (recorded = the job's ticket once it is enqueued);
  // the CPU part, done, asks whether it completed: yes moves the share (q10)
  // RuntimeImpl::kSplitShareStep down, no moves it up. -1: not moved yet (the model's).
  EventHandle step_done = nullptr;
  std::atomic<uint32_t> recorded{0};
  std::atomic<int32_t> q10{-1};
  int32_t last_q10 = 0;  // the share of the last split step (Stats::split_share)
};

/// The shadow scan on the device (DeviceBufferSizes::device_scan; runtime/cpu_step.cpp): a copy of the
/// policy's int8 shadow of K per (slot, layer, KV head), [head_dim][max_tokens] channel-major, made
/// from the policy's at priming (CopyScanShadow) and extended by each step's new row on the device;
/// the step ranks the offloaded keys there (Device::ShadowScan) and the host's Select takes the
/// ranking (SelectContext::scan) instead of scanning. Buffers allocated by InitDeviceScan; the
/// step's state written by LaunchDeviceScan, EnqueueDeviceScan, WaitScanRanking and SelectOnHost.
struct DeviceScan {
  bool on = false;
  int64_t picks_cap = 0;
  int64_t list_cap = 0;
  ShadowScanItem* items_host = nullptr;  // pinned, mapped: the scan's first pass reads it (args.item_host)
  float* scale = nullptr;              // the shadow's scales, written at priming (args.scale)
  EventHandle ready = nullptr;   // this step's ranking reached out_host
  bool live = false;             // view belongs to the step being selected
  // The first Select that needs the ranking waits for ready (WaitScanRanking, under wait_mu),
  // after its own table work.
  std::atomic<bool> arrived{false};
  std::mutex wait_mu;
  // A scan was enqueued and nobody waited for it (it only wrote rows, or the step failed): the
  // next one waits before it rewrites the pinned item table the scan reads.
  bool unwaited = false;
  int64_t step_items = 0;
  std::vector<int64_t> rows;           // per (slot, layer): shadow rows on the device, 0: none
  std::vector<DeviceScanPicks> view;   // per item of the step; count 0: host scan
  /// The scan's arguments: its buffers (shadow, scale, workspaces, the mapped item table, ranking
  /// and counts), channels and shape set once by InitDeviceScan; each step sets the rest.
  ShadowScanArgs args;
  StreamHandle stream = nullptr;
  bool pending = false;            // prepared, not enqueued
  std::atomic<int> launched{1};    // 0: being enqueued, 1: enqueued, 2: failed
  Status launch_status = Status::Ok();
  int64_t bytes_d2h = 0;
};

/// CUDA prefill: one layer's pages of one sequence staged in device memory, the tensor-core
/// kernel's descriptors and its copy streams. Allocated by InitPrefillStaging; written by
/// PrefillTensorCores, StageLayerPages, PrefetchNextHistory, CopyLayerPages (and reset by
/// AddSequence and a failed Prefill).
struct PrefillStaging {
  int64_t max_pages = 0;
  char* scratch = nullptr;      // device: [Hkv][max_pages] pages
  void** pages_host = nullptr;  // pinned: page table being built
  void** pages_dev = nullptr;   // device copy the kernel reads
  StagedRows staged;            // what scratch holds
  // CopyLayerPages' copy lists (reserved at Create).
  std::vector<void*> page_copy_dst;
  std::vector<const void*> page_copy_src;
  std::vector<size_t> page_copy_bytes;
  // Chunk-major prefill (chunk c of every layer before chunk c + 1, as an engine runs a model):
  // each call copies the history of the call it predicts next into the second staging on the copy
  // stream while it computes (PrefetchNextHistory); the next call swaps the stagings when it is
  // that call. next / next_pages_dev are the second staging and its page table, next_staged what
  // it holds or is being filled with, next_ready the copies' event.
  char* next = nullptr;
  void** next_pages_dev = nullptr;
  StagedRows next_staged;
  EventHandle next_ready = nullptr;
  EventHandle call_start = nullptr;
  LastPrefill last;
  void* items = nullptr;  // pinned: tensor-core prefill descriptors (null: paged path)
  size_t items_bytes = 0;
  // The tensor-core prefill's descriptors are double-buffered (items holds two sets of
  // items_bytes): a chunk waits only for the chunk two back to have read its set, so consecutive
  // chunks on one stream run back to back on the device.
  EventHandle items_done[2] = {nullptr, nullptr};
  int parity = 0;
  // Tensor-core prefill with the history copied by the copy engines while the chunk is attended
  // (PrefillChunkArgs::copy_stream); null stream (the CUDA-core prefill): the one-pass staging.
  StreamHandle copy_stream = nullptr;
  EventHandle fork = nullptr;
  std::vector<EventHandle> segment_done;
  std::vector<void*> copy_scratch;  // host: the copy lists
  // The chunk's write-through from the staging on the copy engines (PrefillChunkArgs::write_stream).
  StreamHandle write_stream = nullptr;
  EventHandle write_ready = nullptr, write_done = nullptr;
  std::vector<void*> write_scratch;  // host: its copy lists
};

/// Priming a policy that learns from the prompt (Policy::prime_rows, wants_prefill_queries). With
/// rows > 0 (RuntimeConfig::paths.prime: on CUDA unless kHost, on the host backend with kDevice)
/// Device::PrimeAttention computes the statistics and OnPrefillPrimed finishes on the host. The
/// pending rows are kept by DeferPrime and primed from by FlushPrime. Allocated by
/// InitPrimeBuffers and InitDeferredPrime (pending_q at a slot's first primed prefill).
struct Priming {
  int rows = 0;  // query rows primed on the device a chunk; 0: off
  std::vector<PendingPrime> pending;  // [slot * num_layers + layer]
  std::vector<char*> pending_q;       // per slot, pinned: [layer][rows][Hq][D] in q's dtype
  int pending_rows = 0;               // rows kept at most (Policy::prime_rows)
  bool eager = false;                 // RuntimeConfig::paths.prime_eager
  int64_t table_stride = 0;           // floats per head: ver [n] then sla [n]
  float* tables_dev = nullptr;        // device: [Hkv][table_stride]
  float* tables_host = nullptr;       // pinned copy the policy reads
  double* stats_dev = nullptr;        // device: [Hkv][PrimeStatsCount]
  double* stats_host = nullptr;
  void* scratch = nullptr;            // device: softmax partials
  size_t scratch_bytes = 0;
};

/// Sliding-window layers (ModelShape::layer_window; runtime/window.cpp). A sliding layer of window
/// w keeps its rows in a ring of w rows per (slot, layer, KV head), position p in row p % w: the
/// first sink + window rows are the resident tier's own rows at that layer (which a sliding layer
/// does not use otherwise), the rest in rings. InitWindowLayout sets the layout, InitWindowBuffers
/// allocates the buffers.
struct WindowLayers {
  std::vector<int> widths;     // per layer: 0 global, w sliding (empty: every layer global)
  int max = 0;                 // the widest window (0: none)
  std::vector<int64_t> ring_off;  // per layer: its rings' first row in a slot's rings
  int64_t ring_slot_rows = 0;     // rows of rings per slot
  char* rings = nullptr;  // device: [slot][layer's part: [h][K rows, V rows beyond the tier]]
  char* stage = nullptr;  // device: [h][K rows, then V rows], stage_rows each
  int64_t stage_rows = 0;  // w_max - 1 + max_prefill_chunk
  RowCopy* copies = nullptr;  // pinned descriptors, copy_cap of them
  int64_t copy_cap = 0;
  RowAttnItem* items = nullptr;  // pinned: [max_rows * Hkv]
  const void** k_rows = nullptr;  // pinned row lists, row_cap each
  const void** v_rows = nullptr;
  int64_t row_cap = 0;
};

}  // namespace kvferry::detail
