// Copyright kvferry authors. Apache-2.0.
// The CPU half of a planned decode step for a CPU-placed policy, docs/design.md's stages 2-5 on
// the host: select, resolve against the resident tier, attend the offloaded picks on the CPU next
// to the memory. The device half (runtime/decode_plan.cpp RunDecodeStep) has already enqueued the
// attention over the resident rows; this runs while it executes, and the two parts meet in the
// exact log-sum-exp merge on the device.
//
// One pool task per (sequence, KV head) does all three stages back to back, so the rows the
// policy's exact scoring just read are still in cache when the same task attends them, and the
// step pays one fork-join of the pool, not three.
//
// The same tasks serve a host-selecting policy with the device bank (step_.host_lists): there they stop
// after the select stage, writing each selection into the pinned list the device step reads
// (UploadHostLists copies it up), and the device attends every selected row.

#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <mutex>
#include <thread>

#include "base/check.h"
#include "cpu/attention.h"
#include "cpu/dtype.h"
#include "cpu/reference.h"
#include "runtime/runtime_impl.h"

namespace kvferry::detail {

Status RuntimeImpl::CopyScanShadow(int slot, int layer, StreamHandle stream) {
  if (!scan_.on) return Status::Ok();
  const ModelShape& m = config_.model;
  const int hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t len = config_.capacity.max_tokens_per_sequence;
  int64_t& rows = scan_.rows[static_cast<size_t>(slot) * m.num_layers + layer];
  rows = 0;
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> bytes;
  const size_t copies = static_cast<size_t>(hkv) * (d + 1);
  dst.reserve(copies);
  src.reserve(copies);
  bytes.reserve(copies);
  int64_t n = -1;
  for (int h = 0; h < hkv; ++h) {
    ScanShadowView view;
    // A head without a shadow (or heads of different lengths): the host scans this layer.
    if (!policy_->ScanShadow(slot, layer, h, &view) || view.n > len || (n >= 0 && view.n != n)) {
      return Status::Ok();
    }
    n = view.n;
    const int64_t head = (static_cast<int64_t>(slot) * m.num_layers + layer) * hkv + h;
    int8_t* shadow = scan_.args.shadow + head * d * len;
    for (int c = 0; c < d; ++c) {
      dst.push_back(shadow + c * len);
      src.push_back(view.k8 + c * view.cap);
      bytes.push_back(static_cast<size_t>(view.n));
    }
    dst.push_back(scan_.scale + head * d);
    src.push_back(view.scale);
    bytes.push_back(static_cast<size_t>(d) * sizeof(float));
  }
  if (n <= 0) return Status::Ok();
  KVF_RETURN_IF_ERROR(device_->CopyBatchAsync(dst.data(), src.data(), bytes.data(),
                                              static_cast<int64_t>(dst.size()), stream));
  // The sources are the policy's pageable memory, which its next Select may grow (reallocate).
  KVF_RETURN_IF_ERROR(HostWaitStream(stream));
  if (device_->backend() != Backend::kHost) stats_.bytes_h2d += hkv * (n * d + d * 4);
  rows = n;
  return Status::Ok();
}

Status RuntimeImpl::LaunchDeviceScan(std::span<const int> slot_of, int layer,
                                     std::span<const int64_t> positions, const void* q,
                                     DType q_dtype, const void* k, DType k_dtype,
                                     StreamHandle stream, bool defer) {
  scan_.live = false;
  scan_.pending = false;
  if (!scan_.on) return Status::Ok();
  // The last scan's first pass must have read the pinned item table before it is rewritten.
  if (scan_.unwaited) {
    if (!device_->EventDone(scan_.ready)) KVF_RETURN_IF_ERROR(HostWaitEvent(scan_.ready));
    scan_.unwaited = false;
  }
  const ModelShape& m = config_.model;
  const int hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t len_cap = config_.capacity.max_tokens_per_sequence;
  const int64_t batch = static_cast<int64_t>(slot_of.size());
  const int64_t sink = config_.tiers.sink_tokens, window = config_.tiers.window_tokens;
  int64_t max_len = 0, max_picks = 0;
  bool any = false;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = positions[b] + 1;
    int64_t& rows = scan_.rows[static_cast<size_t>(slot_of[b]) * m.num_layers + layer];
    // The device's shadow has rows [0, n - 1) (or [0, n): this token's row again, after a failed
    // step): this step adds row n - 1. Otherwise it has none, or a gap: the host scans.
    const bool live = rows == n - 1 || rows == n;
    const int64_t off_lo = std::min(sink, n);
    const int64_t off_hi = std::max(off_lo, n - window);
    const int64_t len = off_hi - off_lo;
    const int64_t k_off = BudgetFor(n) - (off_lo + (n - off_hi));
    const int64_t picks =
        live && len > 0 && k_off > 0
            ? std::min({len, policy_->device_scan_picks(k_off), scan_.picks_cap})
            : 0;
    for (int h = 0; h < hkv; ++h) {
      const int64_t i = b * hkv + h;
      const int64_t head = (static_cast<int64_t>(slot_of[b]) * m.num_layers + layer) * hkv + h;
      ShadowScanItem& it = scan_.items_host[i];
      it = ShadowScanItem{};
      it.shadow = head * d * len_cap;
      it.scale = head * d;
      it.off_lo = off_lo;
      it.len = picks > 0 ? len : 0;
      it.new_pos = live ? n - 1 : -1;
      it.picks = picks;
      scan_.view[i] = DeviceScanPicks{};
      if (picks > 0) {
        scan_.view[i].count = picks;
        scan_.view[i].off_lo = off_lo;
        scan_.view[i].len = len;
        scan_.view[i].channels = scan_.args.channels;
      }
    }
    if (live) rows = n;
    any = any || live;
    if (picks > 0) max_len = std::max(max_len, len), max_picks = std::max(max_picks, picks);
  }
  if (!any) return Status::Ok();
  const int64_t items = batch * hkv;
  // Each list holds every key of the threshold's bin: room for more than the picks.
  const int64_t stride = std::min(scan_.list_cap, ScanListCap(max_picks));
  scan_.step_items = items;
  for (int64_t i = 0; i < items; ++i) {
    if (scan_.view[i].count > 0) scan_.view[i].picks = scan_.args.out + i * stride;
  }
  const bool host = device_->backend() == Backend::kHost;
  ShadowScanArgs& a = scan_.args;  // its buffers and shape: InitDeviceScan
  a.items = items;
  a.cap = len_cap;
  a.q = q;
  a.q_dtype = q_dtype;
  a.k = k;
  a.k_dtype = k_dtype;
  a.max_len = max_len;
  a.max_picks = stride;
  scan_.live = max_picks > 0;
  scan_.arrived.store(false, std::memory_order_release);
  scan_.launched.store(0, std::memory_order_release);
  scan_.stream = stream;
  if (!host) {
    for (int64_t i = 0; i < items; ++i) {
      scan_.view[i].wait = [](void* self) { return static_cast<RuntimeImpl*>(self)->WaitScanRanking(); };
      scan_.view[i].wait_arg = this;
    }
  }
  scan_.pending = true;
  // The host backend ranks at once (its "device" is this thread).
  return defer && !host ? Status::Ok() : EnqueueDeviceScan();
}

Status RuntimeImpl::EnqueueDeviceScan() {
  if (!scan_.pending) return Status::Ok();
  scan_.pending = false;
  const ShadowScanArgs& a = scan_.args;
  const bool host = device_->backend() == Backend::kHost;
  scan_.bytes_d2h = 0;
  Status st = device_->ShadowScan(a, scan_.stream);
  if (st.ok()) st = device_->RecordEvent(scan_.ready, scan_.stream);
  scan_.unwaited = !host;
  if (st.ok() && host) {
    TakeScanCounts();
    scan_.arrived.store(true, std::memory_order_release);
  }
  if (!st.ok()) scan_.launch_status = st;
  // Selects waiting for the ranking (WaitScanRanking) go on from here.
  scan_.launched.store(st.ok() ? 1 : 2, std::memory_order_release);
  return st;
}

Status RuntimeImpl::WaitScanRanking() {
  if (scan_.arrived.load(std::memory_order_acquire)) return Status::Ok();
  // Enqueued by the calling thread beside the Selects (SelectOnHost's launch), or before them.
  int launched = 0;
  while ((launched = scan_.launched.load(std::memory_order_acquire)) == 0) std::this_thread::yield();
  if (launched == 2) return scan_.launch_status;
  std::lock_guard<std::mutex> lock(scan_.wait_mu);  // one thread waits, the others then find it done
  if (scan_.arrived.load(std::memory_order_acquire)) return Status::Ok();
  KVF_RETURN_IF_ERROR(HostWaitEvent(scan_.ready));
  TakeScanCounts();
  scan_.arrived.store(true, std::memory_order_release);
  return Status::Ok();
}

void RuntimeImpl::TakeScanCounts() {
  const bool mapped = device_->backend() != Backend::kHost;
  for (int64_t i = 0; i < scan_.step_items; ++i) {
    // -1: more keys than the list holds (the policy then scans on the host).
    if (scan_.view[i].picks == nullptr) continue;
    scan_.view[i].count = std::max(scan_.args.counts[i], 0);
    // Written into mapped memory: what crossed PCIe is the listed entries and the count.
    if (mapped) scan_.bytes_d2h += scan_.view[i].count * int64_t{8} + 4;
  }
}

void RuntimeImpl::AttendInParts(int64_t item, const float* q32, float* o, float* lse,
                                const void** ck, const void** cv, int32_t n, int threads) {
  // Over the item's share of the pool when the rows are many: each range its own (o, lse),
  // merged exactly in range order (the rows are scattered: DRAM-latency bound).
  const int d = config_.model.head_dim;
  const int64_t gd = static_cast<int64_t>(dims_.group) * d;
  const AttnParams params{dims_.group, d, config_.model.kv_dtype, dims_.scale};
  const int parts = std::clamp<int>(std::min<int>(threads, n / kAttendMinRows), 1, kAttendMaxParts);
  const int64_t part_floats = static_cast<int64_t>(dims_.group) * (d + 1);
  float* spill = scratch_.attend_parts.data() + item * (kAttendMaxParts - 1) * part_floats;
  auto attend = [&](int part) {
    const int32_t lo = static_cast<int32_t>(int64_t{n} * part / parts);
    const int32_t hi = static_cast<int32_t>(int64_t{n} * (part + 1) / parts);
    float* po = part == 0 ? o : spill + (part - 1) * part_floats;
    float* pl = part == 0 ? lse : po + gd;
    const RowAttnItem it{q32, po, pl, ck + lo, cv + lo, hi - lo};
    AttendTimed([&] { cpu::AttendRows(params, &it, 1); });
  };
  if (parts == 1) {
    attend(0);
    return;
  }
  tbb::this_task_arena::isolate([&] { tbb::parallel_for(0, parts, attend); });
  for (int part = 1; part < parts; ++part) {
    const float* po = spill + (part - 1) * part_floats;
    cpu::MergeLseRef(o, lse, po, po + gd, dims_.group, d);
  }
}

Status RuntimeImpl::SelectOnHost(std::span<const int> slot_of, int layer,
                                 std::span<const int64_t> positions, const TensorView& q,
                                 const TensorView& k, const TensorView& v, int32_t* lists,
                                 int32_t* counts, const std::function<Status()>* launch) {
  const ModelShape& m = config_.model;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t batch = static_cast<int64_t>(slot_of.size());
  const int64_t gd = static_cast<int64_t>(dims_.group) * d;
  const int64_t items = batch * hkv;
  const size_t q_elem = DTypeSize(q.dtype), k_elem = DTypeSize(k.dtype), v_elem = DTypeSize(v.dtype);
  const auto* q_src = static_cast<const char*>(q.data);
  const auto* k_src = static_cast<const char*>(k.data);
  const auto* v_src = static_cast<const char*>(v.data);

  // The device's ranking for the scans (LaunchDeviceScan) must have arrived.
  const bool scan = scan_.live;
  scan_.live = false;
  // Fewer items than pool threads: each Select may split its O(n) scan over the idle ones.
  const int select_threads = SelectThreads(items);
  Status launch_status = Status::Ok();
  auto item_fn = [&](int64_t i) {
    // One span per (sequence, KV head) task on its pool thread: append, select, CPU attention.
    struct ItemSpan {
      TraceRecorder& trace;
      int64_t item;
      TraceRecorder::Clock::time_point t0 = TraceRecorder::Clock::now();
      ~ItemSpan() { trace.Span("cpu_item", "cpu", t0, TraceRecorder::Clock::now(), item); }
    } span{trace_, i};
    const int64_t b = i / hkv;
    const int h = static_cast<int>(i % hkv);
    const int slot = slot_of[b];
    const int64_t pos = positions[b];
    const int64_t n = pos + 1;
    // 1 append (host half): the new token's store rows, which the policy may read below.
    const int64_t kv_off = (b * hkv + h) * d;
    cpu::ConvertSpan(store_->k_row(slot, layer, h, pos), m.kv_dtype, k_src + kv_off * k_elem,
                     k.dtype, d);
    cpu::ConvertSpan(store_->v_row(slot, layer, h, pos), m.kv_dtype, v_src + kv_off * v_elem,
                     v.dtype, d);
    float* q32 = io_.q_host + b * hq * d + h * gd;
    cpu::ConvertSpan(q32, DType::kF32, q_src + (b * hq * d + h * gd) * q_elem, q.dtype, gd);
    // 2 select.
    const auto ts = trace_.on() ? TraceRecorder::Clock::now() : TraceRecorder::Clock::time_point{};
    scratch_.item_status[i] = SelectItem(i, slot, layer, h, n, q32, select_threads,
                                         scan && scan_.view[i].picks != nullptr ? &scan_.view[i] : nullptr);
    if (trace_.on()) trace_.Span("cpu_select", "cpu", ts, TraceRecorder::Clock::now(), i);
    const std::vector<int32_t>& sel = scratch_.selections[i];
    if (!scratch_.item_status[i].ok()) return;
    if (lists != nullptr) {
      // The device step reads every listed position's rows: one outside [0, n) would send it
      // past the page table, so the Select contract (ascending, unique, in range) is checked
      // here, where the host path would have read a wrong host row. The offloaded count is kept
      // for the stats only.
      int32_t offloaded = 0, prev = -1;
      for (const int32_t p : sel) {
        if (p <= prev || p >= n) {
          scratch_.item_status[i] = Internal(StrCat("policy '", policy_->name(), "' selected position ",
                                                    p, " after ", prev, " of ", n, " (layer ", layer,
                                                    ", KV head ", h, "): not ascending in [0, n)"));
          return;
        }
        prev = p;
        offloaded += ResidentRow(p, n) < 0 ? 1 : 0;
      }
      std::copy(sel.begin(), sel.end(), lists + i * lists_.cap);
      counts[i] = static_cast<int32_t>(sel.size());
      desc_.cpu_items[i].count = offloaded;
      return;
    }
    float* o = io_.o_cpu_host + b * hq * d + h * gd;
    float* lse = io_.lse_cpu_host + b * hq + h * dims_.group;
    std::fill_n(lse, dims_.group, -std::numeric_limits<float>::infinity());
    std::fill_n(o, gd, 0.0f);
    // 3 resolve: the resident positions are the device's part (the policy covers all of them);
    // 5 attend the others here, straight from the host store.
    const void** ck = desc_.cpu_k_rows + i * dims_.item_cap;
    const void** cv = desc_.cpu_v_rows + i * dims_.item_cap;
    int32_t n_cpu = 0;
    for (const int32_t p : sel) {
      if (ResidentRow(p, n) >= 0) continue;
      ck[n_cpu] = store_->k_row(slot, layer, h, p);
      cv[n_cpu++] = store_->v_row(slot, layer, h, p);
    }
    if (n_cpu > 0) {
      const auto ta = trace_.on() ? TraceRecorder::Clock::now() : TraceRecorder::Clock::time_point{};
      AttendInParts(i, q32, o, lse, ck, cv, n_cpu, select_threads);
      if (trace_.on()) trace_.Span("cpu_attend", "cpu", ta, TraceRecorder::Clock::now(), i);
    }
    desc_.cpu_items[i].count = n_cpu;  // the stats below read the split back
  };
  if (launch != nullptr) {
    struct Beside {
      const std::function<Status()>* launch;
      Status* status;
    } beside{launch, &launch_status};
    pool_->ParallelForBeside(items, item_fn, [b = &beside] { *b->status = (*b->launch)(); });
  } else {
    pool_->ParallelFor(items, item_fn);
  }
  // The next layer's items usually come within tens of microseconds (merge, append, the GPU's
  // launch, the wait for its q): RuntimeConfig::cpu_spin_us keeps the workers spinning until then,
  // so that they start at once instead of waking one after another (off by default: runtime.cpp).
  pool_->KeepWarm(pool_->num_threads(), pool_warm_us_);
  KVF_RETURN_IF_ERROR(launch_status);
  // The ranking's buffers are rewritten by the next step's scan: this one's writes must be done.
  if (scan) {
    KVF_RETURN_IF_ERROR(WaitScanRanking());
    scan_.unwaited = false;
  }
  stats_.bytes_d2h += scan_.bytes_d2h;  // counted at the ranking's arrival when it was mapped
  scan_.bytes_d2h = 0;

  for (int64_t i = 0; i < items; ++i) {
    if (!scratch_.item_status[i].ok()) return scratch_.item_status[i];
  }
  int64_t selected = 0, on_cpu = 0;
  for (int64_t i = 0; i < items; ++i) {
    const int64_t b = i / hkv;
    const int h = static_cast<int>(i % hkv);
    const std::vector<int32_t>& sel = scratch_.selections[i];
    last_selection_[(static_cast<size_t>(slot_of[b]) * m.num_layers + layer) * hkv + h].assign(
        sel.begin(), sel.end());
    selected += static_cast<int64_t>(sel.size());
    on_cpu += desc_.cpu_items[i].count;  // lists: the offloaded rows
  }
  stats_.rows_selected += selected;
  stats_.rows_resident += selected - on_cpu;
  // The device's bank counters tell its offloaded rows apart (hits, fetched: RuntimeImpl::stats).
  if (lists == nullptr) stats_.rows_cpu += on_cpu;
  return Status::Ok();
}

// ---- the CPU part on the runtime's own thread (RuntimeConfig::async_cpu) ----------------------

namespace {
// How long either side spins for the other before it sleeps on the condition variable: a layer's
// next job (or its end) usually comes within tens of microseconds.
constexpr auto kCpuPartSpin = std::chrono::microseconds(50);
inline void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}
}  // namespace

void RuntimeImpl::CpuThreadMain() {
  uint64_t seen = 0;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    while (cpu_.go.load(std::memory_order_acquire) == seen &&
           std::chrono::steady_clock::now() - t0 < kCpuPartSpin) {
      Relax();
    }
    if (cpu_.go.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(cpu_.mu);
      cpu_.sleeping = true;
      cpu_.cv.wait(lock, [&] { return cpu_.go.load(std::memory_order_acquire) != seen || cpu_.quit; });
      cpu_.sleeping = false;
      if (cpu_.go.load(std::memory_order_acquire) == seen) return;  // quit, nothing handed over
    }
    seen = cpu_.go.load(std::memory_order_acquire);
    Status st = RunCpuPart(cpu_.job);
    // The device's wait ends here: the part's (o, lse) are in the pinned buffers (or it failed,
    // and the caller's next call rolls the layer back). Never left unwritten, or the stream
    // would wait until its timeout.
    std::atomic_ref<uint32_t>(cpu_.word[0]).store(cpu_.job.ticket, std::memory_order_release);
    cpu_.job_status = std::move(st);
    {
      const std::lock_guard<std::mutex> lock(cpu_.mu);
      cpu_.done.store(seen, std::memory_order_release);
    }
    cpu_.cv.notify_all();
  }
}

void RuntimeImpl::HandOverCpuPart(const CpuPartJob& job) {
  cpu_.job = job;
  cpu_.job_out = true;
  bool wake = false;
  {
    const std::lock_guard<std::mutex> lock(cpu_.mu);
    cpu_.go.fetch_add(1, std::memory_order_acq_rel);
    wake = cpu_.sleeping;
  }
  if (wake) cpu_.cv.notify_all();
}

Status RuntimeImpl::RunCpuPart(const CpuPartJob& job) {
  if (job.q10 > 0) return RunSplitPart(job);
  const auto t0 = TraceRecorder::Clock::now();
  Status st = job.inputs_on_host ? Status::Ok() : HostWaitEvent(io_.q_ready);
  if (st.ok()) {
    st = SelectOnHost(scratch_.batch_slots, job.layer, scratch_.step_pos, job.q, job.k, job.v);
  }
  if (trace_.on()) trace_.Span("cpu_part", "cpu", t0, TraceRecorder::Clock::now(), job.layer);
  Stage(stats_.ms_select, "select", t0);
  return st;
}

Status RuntimeImpl::RunSplitPart(const CpuPartJob& job) {
  const auto t0 = TraceRecorder::Clock::now();
  // The split's CPU lists and q reach the host with split_.ready, microseconds after the
  // hand-over on a stream that is not behind: spin on it first, then block. (The host backend's
  // streams are synchronous: they are there.)
  if (device_->backend() != Backend::kHost) {
    while (!device_->EventDone(split_.ready) && TraceRecorder::Clock::now() - t0 < kCpuPartSpin) {
      Relax();
    }
    KVF_RETURN_IF_ERROR(device_->SynchronizeEvent(split_.ready));
  }
  const ModelShape& m = config_.model;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t items = job.batch * hkv, gd = static_cast<int64_t>(dims_.group) * d;
  const size_t q_elem = DTypeSize(job.q.dtype);
  const auto* q_src = static_cast<const char*>(job.q.data);
  const int threads = SelectThreads(items);
  // One pool task an item, as a CPU step's (SelectOnHost): its q to fp32, its rows' addresses
  // from the host store, their attention (AttendInParts); an item without a share contributes
  // nothing to the merge (lse = -inf).
  pool_->ParallelFor(items, [&](int64_t i) {
    const int64_t b = i / hkv;
    const int h = static_cast<int>(i % hkv);
    const int slot = scratch_.batch_slots[static_cast<size_t>(b)];
    float* q32 = io_.q_host + b * hq * d + h * gd;
    float* o = io_.o_cpu_host + b * hq * d + h * gd;
    float* lse = io_.lse_cpu_host + b * hq + h * dims_.group;
    std::fill_n(lse, dims_.group, -std::numeric_limits<float>::infinity());
    std::fill_n(o, gd, 0.0f);
    const int32_t c = split_.cpu_count[i];
    if (c <= 0) return;
    cpu::ConvertSpan(q32, DType::kF32, q_src + (b * hq * d + h * gd) * q_elem, job.q.dtype, gd);
    const int32_t* list = split_.cpu_list + i * lists_.cap;
    const void** ck = desc_.cpu_k_rows + i * dims_.item_cap;
    const void** cv = desc_.cpu_v_rows + i * dims_.item_cap;
    for (int32_t j = 0; j < c; ++j) {
      ck[j] = store_->k_row(slot, job.layer, h, list[j]);
      cv[j] = store_->v_row(slot, job.layer, h, list[j]);
    }
    AttendInParts(i, q32, o, lse, ck, cv, c, threads);
  });
  int64_t rows = 0;
  for (int64_t i = 0; i < items; ++i) rows += split_.cpu_count[i];
  stats_.rows_cpu += rows;
  // The branches' balance: the device's part done before this one means the CPU took too much.
  // (Unknown when the caller has not enqueued its event yet: no move.)
  if (job.balance && split_.recorded.load(std::memory_order_acquire) == job.ticket) {
    const int32_t was = split_.q10.load(std::memory_order_relaxed);
    const int32_t from = was >= 0 ? was : job.q10;
    const int32_t step = device_->EventDone(split_.step_done) ? -kSplitShareStep : kSplitShareStep;
    split_.q10.store(std::clamp(from + step, kSplitShareStep, 1024 - kSplitShareStep),
                     std::memory_order_relaxed);
  }
  if (trace_.on()) trace_.Span("cpu_split", "cpu", t0, TraceRecorder::Clock::now(), job.layer);
  Stage(stats_.ms_attend_cpu, "attend_cpu", t0);
  return Status::Ok();
}

void RuntimeImpl::WaitCpuPart() {
  if (!cpu_.job_out) return;
  const uint64_t want = cpu_.go.load(std::memory_order_acquire);
  const auto t0 = std::chrono::steady_clock::now();
  while (cpu_.done.load(std::memory_order_acquire) != want &&
         std::chrono::steady_clock::now() - t0 < kCpuPartSpin) {
    Relax();
  }
  if (cpu_.done.load(std::memory_order_acquire) != want) {
    std::unique_lock<std::mutex> lock(cpu_.mu);
    cpu_.cv.wait(lock, [&] { return cpu_.done.load(std::memory_order_acquire) == want; });
  }
}

Status RuntimeImpl::CollectCpuPart() {
  if (!cpu_.job_out) return Status::Ok();
  WaitCpuPart();
  cpu_.job_out = false;
  Status st = std::move(cpu_.job_status);
  cpu_.job_status = Status::Ok();
  if (st.ok() && cpu_.word[1] != 0) {
    st = Internal("the device stopped waiting for the CPU part of a decode step after " +
                  std::to_string(Device::kHostValueTimeoutS) + " s");
  }
  if (st.ok()) return st;
  return RollBackCpuPart(cpu_.job, std::move(st));
}

Status RuntimeImpl::RollBackCpuPart(const CpuPartJob& job, Status failure) {
  // The hand-over counted the layer as done (CommitDecodeStep; a planned layer stays run, as a
  // failed one does): the step's counters come back, then its token as any failed Decode's.
  stats_.bytes_d2h -= job.batch * config_.model.num_kv_heads * 2 * static_cast<int64_t>(dims_.row_bytes);
  stats_.decode_steps -= 1;
  stats_.decode_tokens -= job.batch;
  stats_.decode_planned -= job.planned ? 1 : 0;
  stats_.decode_split -= job.q10 > 0 ? 1 : 0;
  return RollBackDecode(scratch_.batch_slots, job.layer, job.stream, std::move(failure));
}

void RuntimeImpl::StopCpuThread() {
  if (!cpu_.thread.joinable()) return;
  WaitCpuPart();
  {
    const std::lock_guard<std::mutex> lock(cpu_.mu);
    cpu_.quit = true;
  }
  cpu_.cv.notify_all();
  cpu_.thread.join();
}

}  // namespace kvferry::detail
