// Copyright kvferry authors. Apache-2.0.
// The planned decode step (plan / run, docs/design.md): PlanDecode does the host work of a token step
// once for all layers; each Decode of the step then enqueues the device's append, attend and
// combine (Device::DecodeStep) and nothing else. Policies whose selection is a function of the
// length (dense, streaming) run here; the others take the host path in runtime.cpp.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "base/check.h"
#include "base/psaw.h"
#include "policies/select_util.h"
#include "runtime/runtime_impl.h"

namespace kvferry::detail {
namespace {

constexpr int kPlanRing = 16;  // pinned staging entries for plans in flight

using Clock = std::chrono::steady_clock;

size_t AlignUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace

Status WithRestore(Status failure, const Status& restored) {
  if (restored.ok()) return failure;
  return Status(failure.code(),
                StrCat(failure.message(), "; restoring the window ring after it failed too (",
                       restored.ToString(), "): the call's sequences are in an unspecified state"));
}

Status RuntimeImpl::InitStepBuffers() {
  // Which step this runtime plans and its buffers' sizes come from SizeDeviceBuffers
  // (runtime/device_memory.cpp), the one place they are computed.
  const Capacity& cap = config_.capacity;
  const ModelShape& m = config_.model;
  const DeviceBufferSizes& z = sizes_;
  scoring_ = z.scoring;
  if (!z.selector) selector_.reset();  // the step does not select on the device
  fast_path_ = z.fast_path;
  step_all_resident_ = z.step_all_resident;
  cpu_step_ = z.cpu_step;
  // host_lists_ was decided with the bank (Init): a policy that selects on the host and runs the
  // planned step because its bank is on the device.
  if (!fast_path_ && !cpu_step_ && !host_lists_) return Status::Ok();
  void* p = nullptr;
  // The scheduler's split (route auto, a device selection without a bank): its CPU share runs on
  // the runtime's thread with a CPU step's pinned q staging, events and attention partials.
  split_ = z.split;
  if (cpu_step_ || host_lists_ || split_) {
    // q, k and v of a step as the caller gave them (4 bytes an element at most).
    const size_t per_token = static_cast<size_t>(m.num_q_heads + 2 * m.num_kv_heads) * m.head_dim;
    KVF_ASSIGN_OR_RETURN(q_raw_host_,
                         Alloc(static_cast<size_t>(cap.max_batch) * per_token * sizeof(float) + 256, true));
    KVF_ASSIGN_OR_RETURN(q_ready_, device_->CreateEvent());
    KVF_ASSIGN_OR_RETURN(cpu_part_up_, device_->CreateEvent());
    // The CPU attention's partial results when an item's picks are split over pool threads
    // (AttendInParts).
    attend_parts_.assign(static_cast<size_t>(cap.max_batch) * m.num_kv_heads * (kAttendMaxParts - 1) *
                             static_cast<size_t>(group_) * (m.head_dim + 1),
                         0.0f);
  }
  if (split_) {
    const int64_t items = int64_t{cap.max_batch} * m.num_kv_heads;
    KVF_ASSIGN_OR_RETURN(split_ready_, device_->CreateEvent());
    KVF_ASSIGN_OR_RETURN(split_step_done_, device_->CreateEvent());
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.split_list, false));
    split_gpu_list_ = static_cast<int32_t*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.split_count, false));
    split_gpu_count_ = static_cast<int32_t*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(static_cast<size_t>(items * z.list_cap) * sizeof(int32_t), true));
    split_cpu_list_ = static_cast<int32_t*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(static_cast<size_t>(items) * sizeof(int32_t), true));
    split_cpu_count_ = static_cast<int32_t*>(p);
  }
  if (cpu_step_ || split_) {
    // The CPU part on its own thread (RuntimeConfig::async_cpu; -1: with CUDA). The split's
    // share always runs there (SizeDeviceBuffers plans no split with async_cpu 0).
    const int want = config_.async_cpu;
    cpu_async_ = want > 0 || (want < 0 && device_->backend() == Backend::kCuda) || split_;
    if (cpu_async_) {
      KVF_ASSIGN_OR_RETURN(p, Alloc(2 * sizeof(uint32_t), true));
      cpu_word_ = static_cast<uint32_t*>(p);
      cpu_word_[0] = cpu_word_[1] = 0;
      cpu_thread_ = std::thread([this] { CpuThreadMain(); });
    }
  }
  if (scoring_ != SelectScoring::kNone || host_lists_) {
    // Per layer a list region, so that any layer's last selection can be read back and no layer
    // rewrites a list an earlier launch of the step may still read.
    const int64_t items = int64_t{cap.max_batch} * m.num_kv_heads;
    list_cap_ = z.list_cap;
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.step_list, false));
    step_list_ = static_cast<int32_t*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.step_list_count, false));
    step_list_count_ = static_cast<int32_t*>(p);
    if (host_lists_) {
      // The host's lists of every layer, pinned, copied up from here (UploadHostLists).
      const size_t lists = static_cast<size_t>(m.num_layers) * items;
      const size_t staged = lists * static_cast<size_t>(list_cap_ + 1) * sizeof(int32_t);
      KVF_ASSIGN_OR_RETURN(p, Alloc(staged, true));
      list_stage_ = static_cast<int32_t*>(p);
      list_up_.assign(static_cast<size_t>(m.num_layers), nullptr);
      for (EventHandle& e : list_up_) {
        KVF_ASSIGN_OR_RETURN(e, device_->CreateEvent());
      }
    }
    // Host lists need no selection scratch.
    select_ld_ = z.select_ld;
    if (z.select_ws > 0) {
      KVF_ASSIGN_OR_RETURN(p, Alloc(z.select_ws, false));
      select_ws_ = static_cast<float*>(p);
    }
    if (z.topk_ws > 0) {
      KVF_ASSIGN_OR_RETURN(p, Alloc(z.topk_ws, false));
      topk_ws_ = static_cast<unsigned long long*>(p);
    }
    // The multi-CTA top-k's scratch, when an item can rank enough scores to take it.
    if (z.select_mcta > 0) {
      KVF_ASSIGN_OR_RETURN(p, Alloc(z.select_mcta, false));
      select_mcta_ws_ = static_cast<uint32_t*>(p);
    }
    if (selector_ != nullptr) {  // its buffers, in the order it sized them
      std::vector<void*> buffers;
      for (const SelectorBuffer& b : z.selector_buffers) {
        KVF_ASSIGN_OR_RETURN(p, Alloc(b.bytes, false));
        buffers.push_back(p);
      }
      KVF_RETURN_IF_ERROR(selector_->Bind(buffers, *device_, stream_));
    }
    if (z.bank_stage > 0) {
      // The step's misses: staged at their list index, listed for the admission after the step;
      // one set a region (DeviceBufferSizes::bank_regions).
      bank_miss_cap_ = z.bank_miss_cap;
      bank_regions_ = z.bank_regions;
      const size_t regions = static_cast<size_t>(bank_regions_);
      bank_stage_region_ = z.bank_stage / regions;
      bank_miss_region_ = z.bank_miss / regions;
      bank_admit_region_ = z.bank_admit / regions;
      KVF_ASSIGN_OR_RETURN(p, Alloc(z.bank_stage, false));
      bank_stage_ = static_cast<char*>(p);
      KVF_ASSIGN_OR_RETURN(p, Alloc(z.bank_miss, false));
      bank_miss_ = static_cast<int32_t*>(p);
      const std::vector<int32_t> zeros(z.bank_miss / sizeof(int32_t), 0);
      KVF_RETURN_IF_ERROR(device_->CopyAsync(bank_miss_, zeros.data(), z.bank_miss, stream_));
      KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
      KVF_ASSIGN_OR_RETURN(bank_admit_, Alloc(z.bank_admit, false));
      if (bank_regions_ > 1) {
        KVF_ASSIGN_OR_RETURN(admit_stream_, device_->CreateStream());
        for (int r = 0; r < 2; ++r) {
          KVF_ASSIGN_OR_RETURN(admit_fork_[r], device_->CreateEvent());
          KVF_ASSIGN_OR_RETURN(admit_done_[r], device_->CreateEvent());
        }
        KVF_ASSIGN_OR_RETURN(admit_join_, device_->CreateEvent());
        bool shares = false;  // a layer that takes the previous layer's list (xl+)
        for (int l = 1; l < config_.model.num_layers; ++l) shares = shares || policy_->device_reuses_previous_layer(l);
        const int mode = config_.xl_prefetch;
        if (shares && !cpu_step_ && !host_lists_ && mode != 0) {
          KVF_ASSIGN_OR_RETURN(prefetch_fork_, device_->CreateEvent());
          KVF_ASSIGN_OR_RETURN(prefetch_done_, device_->CreateEvent());
          xl_prefetch_ = true;
          xl_prefetch_auto_ = mode < 0;
          xl_gap_min_us_ = config_.xl_prefetch_gap_us;
        }
        if (xl_prefetch_auto_) {  // the gap's timing pairs (DestroyTimings frees them)
          TimingRing& r = xl_gap_timing_;
          r.pairs.resize(static_cast<size_t>(config_.model.num_layers) * kTimingRing);
          r.next.assign(static_cast<size_t>(config_.model.num_layers), 0);
          for (TimingPair& t : r.pairs) {
            for (EventHandle* e : {&t.start, &t.end}) {
              KVF_ASSIGN_OR_RETURN(*e, device_->CreateTimingEvent());
            }
          }
        }
      }
    }
    list_slots_.assign(static_cast<size_t>(m.num_layers), {});
    for (auto& v : list_slots_) v.reserve(static_cast<size_t>(cap.max_batch));
    list_n_.assign(static_cast<size_t>(m.num_layers), {});
    for (auto& v : list_n_) v.reserve(static_cast<size_t>(cap.max_batch));
  }
  KVF_ASSIGN_OR_RETURN(p, Alloc(z.step_slots, false));
  step_slots_dev_ = static_cast<int32_t*>(p);
  const size_t positions = static_cast<size_t>(cap.max_batch) * m.num_layers;
  KVF_ASSIGN_OR_RETURN(p, Alloc(z.step_pos, false));
  step_pos_dev_ = static_cast<int64_t*>(p);
  plan_stage_bytes_ = AlignUp(static_cast<size_t>(cap.max_batch) * sizeof(int32_t), 64) +
                      AlignUp(positions * sizeof(int64_t), 64);
  KVF_ASSIGN_OR_RETURN(p, Alloc(kPlanRing * plan_stage_bytes_, true));
  plan_stage_ = static_cast<char*>(p);
  for (int i = 0; i < kPlanRing; ++i) {
    KVF_ASSIGN_OR_RETURN(EventHandle e, device_->CreateEvent());
    plan_events_.push_back(e);
  }
  if (z.step_ws > 0) {
    step_ws_floats_ = z.step_ws_floats;
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.step_ws, false));
    step_ws_ = static_cast<float*>(p);
    const size_t counters = static_cast<size_t>(cap.max_batch) * m.num_kv_heads * group_;
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.step_counters, false));
    step_counters_ = static_cast<int32_t*>(p);
    const std::vector<int32_t> zeros(counters, 0);
    KVF_RETURN_IF_ERROR(device_->CopyAsync(step_counters_, zeros.data(), counters * sizeof(int32_t), stream_));
    KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
  }
  plan_.layer_run.assign(static_cast<size_t>(m.num_layers), 0);
  plan_.seqs.reserve(static_cast<size_t>(cap.max_batch));
  plan_.slots.reserve(static_cast<size_t>(cap.max_batch));
  plan_.positions.reserve(positions);
  implicit_pos_scratch_.reserve(positions);
  plan_slots_scratch_.reserve(static_cast<size_t>(cap.max_batch));
  step_pos_scratch_.reserve(static_cast<size_t>(cap.max_batch));
  return Status::Ok();
}

Status RuntimeImpl::HostWaitStream(StreamHandle stream) {
  ++stats_.host_syncs;
  return device_->SynchronizeStream(stream);
}

Status RuntimeImpl::HostWaitEvent(EventHandle event) {
  ++stats_.host_syncs;
  if (!trace_.on()) return device_->SynchronizeEvent(event);
  const auto t0 = TraceRecorder::Clock::now();
  Status st = device_->SynchronizeEvent(event);
  trace_.Span("host_wait", "sync", t0, TraceRecorder::Clock::now());
  return st;
}

Status RuntimeImpl::CheckBatch(std::span<const SequenceId> seqs, std::vector<int>& slot_of) const {
  const int64_t batch = static_cast<int64_t>(seqs.size());
  KVF_CHECK_ARG(batch >= 1 && batch <= config_.capacity.max_batch, "batch of ", batch,
                " sequences out of range [1, max_batch=", config_.capacity.max_batch, "]");
  slot_of.resize(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    KVF_ASSIGN_OR_RETURN(slot_of[b], SlotOf(seqs[b]));
    for (int64_t c = 0; c < b; ++c) {
      KVF_CHECK_ARG(seqs[c] != seqs[b], "sequence ", seqs[b], " appears twice in one batch");
    }
  }
  return Status::Ok();
}

Status RuntimeImpl::UploadPlan(int region, std::span<const int> slots,
                               std::span<const int64_t> positions, StreamHandle stream) {
  // A staging entry is rewritten only after the copies that read it ran: kPlanRing plans back.
  EventHandle done = plan_events_[plan_next_];
  if (!device_->EventDone(done)) KVF_RETURN_IF_ERROR(HostWaitEvent(done));
  char* entry = plan_stage_ + static_cast<size_t>(plan_next_) * plan_stage_bytes_;
  auto* slots_host = reinterpret_cast<int32_t*>(entry);
  auto* pos_host = reinterpret_cast<int64_t*>(
      entry + AlignUp(static_cast<size_t>(config_.capacity.max_batch) * sizeof(int32_t), 64));
  for (size_t b = 0; b < slots.size(); ++b) slots_host[b] = slots[b];
  std::memcpy(pos_host, positions.data(), positions.size_bytes());
  const size_t batch_cap = static_cast<size_t>(config_.capacity.max_batch);
  KVF_RETURN_IF_ERROR(device_->CopyAsync(step_slots_dev_ + region * batch_cap, slots_host,
                                         slots.size() * sizeof(int32_t), stream));
  KVF_RETURN_IF_ERROR(device_->CopyAsync(
      step_pos_dev_ + region * batch_cap * config_.model.num_layers, pos_host,
      positions.size_bytes(), stream));
  KVF_RETURN_IF_ERROR(device_->RecordEvent(done, stream));
  plan_next_ = (plan_next_ + 1) % kPlanRing;
  ++stats_.decode_plans;
  return Status::Ok();
}

void RuntimeImpl::RetirePlan() {
  if (!plan_.active) return;
  plan_.active = false;
  const bool any_run = std::any_of(plan_.layer_run.begin(), plan_.layer_run.end(),
                                   [](uint8_t r) { return r != 0; });
  // No layer ran on the host: the step was replayed from a CUDA graph (or will not run at all,
  // which the API forbids). Some ran: the others never will, so their tokens are taken back.
  if (!any_run) return;
  const int layers = config_.model.num_layers;
  for (int l = 0; l < layers; ++l) {
    if (plan_.layer_run[l] != 0) continue;
    for (int slot : plan_.slots) --lengths_[static_cast<size_t>(slot) * layers + l];
  }
}

Status RuntimeImpl::PlanDecode(std::span<const SequenceId> seqs, StreamHandle stream) {
  if (stream == nullptr) stream = stream_;
  KVF_CHECK_CODE(!device_->IsCapturing(stream), StatusCode::kFailedPrecondition,
                 "PlanDecode is called outside a CUDA graph capture (before capturing and "
                 "before each replay)");
  std::vector<int>& slot_of = plan_slots_scratch_;  // reserved at set-up: no allocation
  KVF_RETURN_IF_ERROR(CheckBatch(seqs, slot_of));
  KVF_RETURN_IF_ERROR(JoinSelectorSide(stream));  // a step left without its last layer
  KVF_RETURN_IF_ERROR(JoinAdmitSide(stream));
  const int layers = config_.model.num_layers;
  for (int l = 0; l < layers; ++l) KVF_RETURN_IF_ERROR(CheckNextToken(seqs, slot_of, l));
  // Policies that select on the host without a planned step plan inside each Decode.
  if (!fast_path_ && !cpu_step_ && !host_lists_) return Status::Ok();
  const auto t0 = Clock::now();
  RetirePlan();
  for (int l = 0; l < layers; ++l) KVF_RETURN_IF_ERROR(ReserveNextToken(slot_of, l));
  KVF_RETURN_IF_ERROR(store_->FlushTable(stream));
  plan_.positions.resize(slot_of.size() * layers);
  for (size_t b = 0; b < slot_of.size(); ++b) {
    std::copy_n(lengths_.begin() + static_cast<int64_t>(slot_of[b]) * layers, layers,
                plan_.positions.begin() + static_cast<int64_t>(b) * layers);
  }
  KVF_RETURN_IF_ERROR(UploadPlan(0, slot_of, plan_.positions, stream));
  // Committed: every layer's length includes the new token from here on.
  for (int slot : slot_of) {
    for (int l = 0; l < layers; ++l) ++lengths_[static_cast<size_t>(slot) * layers + l];
  }
  plan_.active = true;
  plan_.seqs.assign(seqs.begin(), seqs.end());
  plan_.slots = slot_of;
  std::fill(plan_.layer_run.begin(), plan_.layer_run.end(), 0);
  Stage(stats_.ms_append, "append", t0);
  return Status::Ok();
}

Status RuntimeImpl::TimeDeviceSelect(bool on) {
  if (on && select_timing_.pairs.empty()) {
    for (TimingRing* r : {&select_timing_, &attend_timing_}) {
      r->pairs.resize(static_cast<size_t>(config_.model.num_layers) * kTimingRing);
      for (TimingPair& t : r->pairs) {
        for (EventHandle* e : {&t.start, &t.end}) {
          Result<EventHandle> made = device_->CreateTimingEvent();
          if (!made.ok()) {
            DestroyTimings(false);
            return made.status();
          }
          *e = made.value();
        }
      }
      r->next.assign(static_cast<size_t>(config_.model.num_layers), 0);
    }
  }
  time_select_ = on;
  return Status::Ok();
}

void RuntimeImpl::CloseXlGap(int layer, StreamHandle stream, bool capturing) {
  TimingPair* t = xl_gap_open_;
  xl_gap_open_ = nullptr;
  if (t == nullptr || layer != xl_gap_layer_ || stream != xl_gap_stream_ || capturing) return;
  t->pending = device_->RecordEvent(t->end, stream).ok();
}

void RuntimeImpl::OpenXlGap(int layer, StreamHandle stream, bool capturing) {
  const int next = layer + 1;
  if (!xl_prefetch_auto_ || capturing || next >= config_.model.num_layers ||
      xl_gap_timing_.pairs.empty() || !policy_->device_reuses_previous_layer(next)) {
    return;
  }
  TimingRing& ring = xl_gap_timing_;
  int& i = ring.next[static_cast<size_t>(next)];
  TimingPair& t = ring.pairs[static_cast<size_t>(next) * kTimingRing + i];
  i = (i + 1) % kTimingRing;
  if (t.pending) {  // recorded kTimingRing steps back, so done: no wait
    const double us = 1e3 * TimingMs(t);
    xl_gap_us_ = xl_gap_us_ < 0 ? us : 0.8 * xl_gap_us_ + 0.2 * us;
    t.pending = false;
  }
  if (!device_->RecordEvent(t.start, stream).ok()) return;
  xl_gap_open_ = &t;
  xl_gap_layer_ = next;
  xl_gap_stream_ = stream;
}

void RuntimeImpl::DestroyTimings(bool with_gap) {
  if (with_gap) xl_gap_open_ = nullptr;
  for (TimingRing* r : {&select_timing_, &attend_timing_, &xl_gap_timing_}) {
    if (r == &xl_gap_timing_ && !with_gap) continue;
    for (const TimingPair& t : r->pairs) {
      if (t.start != nullptr) device_->DestroyEvent(t.start);
      if (t.end != nullptr) device_->DestroyEvent(t.end);
    }
    r->pairs.clear();
  }
}

double RuntimeImpl::TimingMs(const TimingPair& t) const {
  // A measurement aid never fails a call: a time that cannot be read is left out.
  if (!t.pending || !device_->SynchronizeEvent(t.end).ok()) return 0.0;
  const Result<double> ms = device_->ElapsedMs(t.start, t.end);
  return ms.ok() ? ms.value() : 0.0;
}

RuntimeImpl::TimingPair* RuntimeImpl::NextTiming(TimingRing& ring, int layer, double& ms) {
  int& next = ring.next[static_cast<size_t>(layer)];
  TimingPair& t = ring.pairs[static_cast<size_t>(layer) * kTimingRing + next];
  next = (next + 1) % kTimingRing;
  ms += TimingMs(t);  // recorded a few steps back, so done
  t.pending = false;
  return &t;
}

RuntimeImpl::ListRowsRule RuntimeImpl::DeviceListRowsRule(int layer) const {
  // xl+ copies the previous layer's list; psaw+'s filter refills up to the budget where it hides
  // anything (base/psaw.h); HiP's ranked layers take whole blocks.
  while (layer > 0 && policy_->device_reuses_previous_layer(layer)) --layer;
  ListRowsRule r;
  r.blocks = selector_ != nullptr ? selector_->ListBlock(layer) : 0;
  r.hide_fraction = r.blocks > 0 ? policy_->device_hide_fraction(layer) : 0.0;
  return r;
}

int64_t RuntimeImpl::DeviceListRows(const ListRowsRule& rule, int64_t n, int64_t budget) const {
  const int sink = config_.tiers.sink_tokens;
  if (rule.blocks == 0 || PsawHiddenEndOf(rule.hide_fraction, n) > sink) return std::min(budget, n);
  // The sinks, floor(k_off / bk) blocks and the window. The host does not read the device's mask:
  // one that holds the offloaded range's last block, cut short, has up to bk - 1 rows fewer.
  const OffloadSplit s = SplitPositions(n, sink, config_.tiers.window_tokens, budget);
  if (s.all) return n;
  return s.sink + (s.k_off >= rule.blocks ? s.k_off / rule.blocks * rule.blocks : 0) +
         (n - s.off_hi);
}

bool RuntimeImpl::XlReusesPrevious(std::span<const int> slot_of, std::span<const int64_t> pos,
                                   int layer) const {
  if (scoring_ == SelectScoring::kNone || layer <= 0 || WindowOf(layer - 1) > 0 ||
      !policy_->device_reuses_previous_layer(layer)) {
    return false;
  }
  const size_t prev = static_cast<size_t>(layer) - 1;
  if (!std::equal(slot_of.begin(), slot_of.end(), list_slots_[prev].begin(), list_slots_[prev].end()) ||
      list_n_[prev].size() != pos.size()) {
    return false;
  }
  for (size_t b = 0; b < pos.size(); ++b) {
    if (list_n_[prev][b] != pos[b] + 1) return false;
  }
  return true;
}

Status RuntimeImpl::RunDecodeStep(std::span<const SequenceId> seqs, int layer, const TensorView& q,
                                  const TensorView& k, const TensorView& v, const TensorView& out,
                                  StreamHandle stream) {
  const auto t0 = Clock::now();
  const ModelShape& m = config_.model;
  const int layers = m.num_layers;
  const std::vector<int>& slot_of = batch_slots_;
  const int64_t batch = static_cast<int64_t>(slot_of.size());
  if (stream == nullptr) stream = stream_;
  const bool capturing = device_->IsCapturing(stream);
  KVF_CHECK_CODE(!capturing || (q.where == MemoryKind::kDevice && k.where == MemoryKind::kDevice &&
                                v.where == MemoryKind::kDevice && out.where == MemoryKind::kDevice),
                 StatusCode::kFailedPrecondition,
                 "a Decode captured in a CUDA graph takes q, k, v and out in device memory");
  KVF_CHECK_CODE(!capturing || (!cpu_step_ && !host_lists_), StatusCode::kFailedPrecondition,
                 "policy '", policy_->name(), "' selects on the host inside the decode step, which "
                 "a CUDA graph cannot hold (Runtime::decode_is_capture_safe() is false)");
  // The selector's work beside the step (HiP's rebuilds) of this layer or a later one is a step
  // behind: it joins before this layer's selection reads the state it writes.
  // The engine's stream time since the previous layer's Decode ends here (the auto cross-layer
  // prefetch's measure), before anything of this call is on the stream.
  if (xl_gap_open_ != nullptr) CloseXlGap(layer, stream, capturing);
  if (selector_ != nullptr) KVF_RETURN_IF_ERROR(selector_->Join(layer, stream));
  // Likewise the bank's admissions beside the stream (a layer's tables are admitted to before
  // its next step reads them).
  if (admit_side_layer_ >= 0 && layer <= admit_side_layer_) KVF_RETURN_IF_ERROR(JoinAdmitSide(stream));
  const int bank_region = layer % bank_regions_;
  const bool planned = plan_.active && plan_.layer_run[layer] == 0 &&
                       std::equal(seqs.begin(), seqs.end(), plan_.seqs.begin(), plan_.seqs.end());
  std::vector<int64_t>& pos = step_pos_scratch_;  // new token's position per b at this layer
  pos.resize(static_cast<size_t>(batch));
  int region = 0;
  if (planned) {
    for (int64_t b = 0; b < batch; ++b) pos[b] = plan_.positions[b * layers + layer];
  } else {
    KVF_CHECK_CODE(!capturing, StatusCode::kFailedPrecondition,
                   "Decode of layer ", layer, " while capturing a CUDA graph needs a plan: call "
                   "PlanDecode(seqs) before the capture");
    KVF_RETURN_IF_ERROR(CheckNextToken(seqs, slot_of, layer));
    KVF_RETURN_IF_ERROR(ReserveNextToken(slot_of, layer));
    KVF_RETURN_IF_ERROR(store_->FlushTable(stream));
    std::vector<int64_t>& all = implicit_pos_scratch_;  // reserved at set-up: no allocation
    all.resize(static_cast<size_t>(batch * layers));
    for (int64_t b = 0; b < batch; ++b) {
      std::copy_n(lengths_.begin() + static_cast<int64_t>(slot_of[b]) * layers, layers,
                  all.begin() + b * layers);
      pos[b] = all[b * layers + layer];
    }
    region = 1;
    KVF_RETURN_IF_ERROR(UploadPlan(region, slot_of, all, stream));
  }
  // From here a failure takes this layer's token back (a planned layer committed it already).
  auto uncommit = [&] {
    if (!planned) return;
    plan_.layer_run[layer] = 1;
    for (int slot : slot_of) --lengths_[static_cast<size_t>(slot) * layers + layer];
  };

  Result<const void*> q_src = StageInput(q, q_in_, stream);
  Result<const void*> k_src = q_src.ok() ? StageInput(k, k_in_, stream) : q_src;
  Result<const void*> v_src = k_src.ok() ? StageInput(v, v_in_, stream) : k_src;
  if (!v_src.ok()) {
    uncommit();
    return v_src.status();
  }
  const bool out_direct = out.where == MemoryKind::kDevice || device_->backend() == Backend::kHost;

  DecodeStepArgs a;
  a.params = AttnParams{group_, m.head_dim, m.kv_dtype, scale_};
  a.batch = static_cast<int32_t>(batch);
  a.num_kv_heads = m.num_kv_heads;
  a.num_layers = layers;
  a.layer = layer;
  a.sink = config_.tiers.sink_tokens;
  a.window = config_.tiers.window_tokens;
  a.mode = scoring_ != SelectScoring::kNone || host_lists_ ? StepRowMode::kList
                                                           : StepRowMode::kSinksAndRecent;
  if (policy_->is_dense()) {
    a.budget_tokens = config_.capacity.max_tokens_per_sequence;
    a.budget_cap = config_.capacity.max_tokens_per_sequence;
  } else {
    a.budget_tokens = config_.policy.budget_tokens;
    a.budget_fraction = config_.policy.budget_fraction;
    a.budget_cap = std::max<int64_t>(item_cap_, 1);
  }
  a.all_resident = step_all_resident_;
  const size_t batch_cap = static_cast<size_t>(config_.capacity.max_batch);
  a.slots = step_slots_dev_ + region * batch_cap;
  a.positions = step_pos_dev_ + region * batch_cap * layers;
  a.q = q_src.value();
  a.k = k_src.value();
  a.v = v_src.value();
  a.out = out_direct ? out.data : out_stage_;
  a.q_dtype = q.dtype;
  a.k_dtype = k.dtype;
  a.v_dtype = v.dtype;
  a.out_dtype = out.dtype;
  a.resident = resident_;
  a.pages = store_->device_table();
  a.max_pages = store_->max_pages();
  a.page_tokens = store_->shape().page_tokens;
  a.q_f32 = q_f32_;
  a.lse = lse_gpu_;
  a.ws = step_ws_;
  a.ws_floats = step_ws_floats_;
  a.counters = step_counters_;
  // The host writes the new token's store rows before its Select reads them (SelectOnHost).
  a.host_writes_store = host_lists_;
  bool xl_reuse = false;  // xl+: this layer's list is the previous layer's (copied below)
  if (scoring_ != SelectScoring::kNone || host_lists_) {
    const size_t lists = static_cast<size_t>(layer) * batch_cap * m.num_kv_heads;
    a.scoring = scoring_;
    if (scoring_ != SelectScoring::kNone) a.hide_fraction = policy_->device_hide_fraction(layer);
    // xl+ takes the previous layer's list below: a scoring whose ranking advances no state then
    // only keeps its metadata current (SparCas at 128K: about 85 us a layer not spent).
    xl_reuse = XlReusesPrevious(slot_of, pos, layer);
    a.select_skip_ranking = xl_reuse && selector_ != nullptr && selector_->ranking_skippable();
    a.list = step_list_ + lists * list_cap_;
    a.list_count = step_list_count_ + lists;
    a.list_cap = list_cap_;
    a.select_ws = select_ws_;
    a.select_ld = select_ld_;
    a.topk_ws = topk_ws_;
    a.select_mcta_ws = select_mcta_ws_;
    if (selector_ != nullptr) {
      selector_->Fill(a);
      selector_->BeforeSelect(a, slot_of, pos, layer);
    }
    if (bank_stage_ != nullptr) {
      step_bank_->View(&a.bank);
      const size_t r = static_cast<size_t>(bank_region);
      a.bank.stage = bank_stage_ + r * bank_stage_region_;
      a.bank.miss = bank_miss_ + r * bank_miss_region_ / sizeof(int32_t);
      a.bank.miss_cap = bank_miss_cap_;
      a.bank.admit = static_cast<char*>(bank_admit_) + r * bank_admit_region_;
    }
  }

  if (cpu_step_) {
    // The device's part is the resident rows (sinks + window): every selection covers them. The
    // host's selection and its attention over the offloaded picks meet them in the merge below.
    a.mode = StepRowMode::kSinksAndRecent;
    a.budget_tokens = std::max<int64_t>(int64_t{a.sink} + a.window, 1);
    a.budget_fraction = 0.0;
    a.budget_cap = a.budget_tokens;
    a.all_resident = true;
    a.host_writes_store = true;
    a.out = o_gpu_;
    a.out_dtype = DType::kF32;
    a.lse = lse_gpu_;
  }
  // Rows each item attends, for the launch shape and the stats (the device recomputes them). A
  // device selection's split between resident and fetched rows is not known on the host: its
  // rows count as selected only.
  const int64_t window = config_.tiers.window_tokens;
  int64_t max_rows = 0, resident = 0, fetched = 0, selected = 0, key_bytes = 0;
  int64_t offloaded = 0;  // selected rows beyond the resident ones, at most (the split's estimate)
  const ListRowsRule list_rule = DeviceListRowsRule(layer);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = pos[b] + 1;
    a.max_len_hint = std::max(a.max_len_hint, n);
    const int64_t budget = StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n);
    if (cpu_step_) {  // counted by SelectOnHost
      max_rows = std::max(max_rows, std::min(budget, n));
      continue;
    }
    if (host_lists_) continue;  // counted by SelectOnHost, the hint set after it
    if (scoring_ != SelectScoring::kNone) {
      const int64_t count = DeviceListRows(list_rule, n, budget);
      max_rows = std::max(max_rows, count);
      selected += count;
      offloaded += std::max<int64_t>(0, count - std::min<int64_t>(n, int64_t{a.sink} + a.window));
      if (!a.select_skip_ranking) key_bytes += selector_->KeyBytes(n, budget, layer);
      continue;
    }
    const StepRange r = SinksAndRecent(n, a.sink, budget);
    const int64_t res = r.sinks + (n - std::max(r.recent_begin, n - window));
    max_rows = std::max(max_rows, r.count);
    resident += res;
    fetched += r.count - res;
    selected += r.count;
  }
  a.max_rows_hint = max_rows;
  Stage(stats_.ms_append, "append", t0);

  const auto t1 = Clock::now();
  Status st = Status::Ok();
  // A CPU-placed policy: q, k and v go to the host ahead of the step's kernels, so that the
  // host's selection runs while the device attends the resident rows.
  TensorView q_host = q, k_host = k, v_host = v;
  const bool inputs_on_host = device_->backend() == Backend::kHost ||
                              (q.where == MemoryKind::kHost && k.where == MemoryKind::kHost &&
                               v.where == MemoryKind::kHost);
  if ((cpu_step_ || host_lists_) && !inputs_on_host) {
    char* dst = static_cast<char*>(q_raw_host_);
    for (TensorView* t : {&q_host, &k_host, &v_host}) {
      const size_t bytes = static_cast<size_t>(t->numel()) * DTypeSize(t->dtype);
      if (t->where == MemoryKind::kDevice && st.ok()) {
        st = device_->CopyAsync(dst, t->data, bytes, stream);
        t->data = dst;
        t->where = MemoryKind::kHost;
      }
      dst += AlignUp(bytes, 64);
    }
    if (st.ok()) st = device_->RecordEvent(q_ready_, stream);
  } else if (host_lists_ && st.ok()) {
    // Select reads the store rows that earlier work on the stream may still be writing (an Append
    // does not wait): the host waits for the stream's work up to here all the same.
    st = device_->RecordEvent(q_ready_, stream);
  }
  // LFPS's scan ranks the offloaded keys on the device, ahead of the host's Select. On CUDA the
  // CPU step enqueues it, and its own kernel after it, beside the Selects (SelectOnHost's
  // launch): those calls take the host tens of microseconds a layer.
  // The CPU part on the runtime's thread (RuntimeConfig::async_cpu): on CUDA only with device
  // tensors (host ones are read and written before Decode returns).
  const bool host_backend = device_->backend() == Backend::kHost;
  const bool async_part = cpu_step_ && cpu_async_ &&
                          (host_backend || (!inputs_on_host && out.where == MemoryKind::kDevice));
  // (With the part on the runtime's thread the caller enqueues both right after the hand-over,
  // while the part's Selects start.)
  const bool beside = cpu_step_ && device_scan_ &&
                      device_->backend() == Backend::kCuda;
  if (st.ok() && (cpu_step_ || host_lists_) && device_scan_) {
    st = LaunchDeviceScan(slot_of, layer, pos, q_src.value(), q.dtype, k_src.value(), k.dtype,
                          stream, beside);
  }
  if (st.ok() && scoring_ != SelectScoring::kNone) {
    // Runtime::TimeDeviceSelect: timing events around the launches (not while capturing).
    st = TimedLaunch(time_select_ && !capturing, select_timing_, layer, stats_.ms_select_device,
                     key_bytes * m.num_kv_heads, timed_select_key_bytes_, stream,
                     [&] { return device_->DecodeSelect(a, stream); });
    // Work the selection requested that runs beside the rest of the step (HiP's rebuilds).
    if (st.ok()) st = selector_->AfterSelect(a, layer, stream);
    // Cross-layer sharing (xl+): the previous layer's list replaces this one's when the same
    // sequences selected there at the same length (this step's layer before). The selection kept
    // the inner policy's device metadata (page bounds, compact keys) what it would be without the
    // wrapper; it ranked only where that advances the policy's state (HiP, KVpop).
    if (st.ok() && xl_reuse) {
      const int64_t region = static_cast<int64_t>(batch_cap) * m.num_kv_heads;
      const int64_t items = batch * m.num_kv_heads;
      st = device_->CopyAsync(a.list, a.list - region * list_cap_,
                              static_cast<size_t>(items * list_cap_) * sizeof(int32_t), stream);
      if (st.ok()) {
        st = device_->CopyAsync(a.list_count, a.list_count - region,
                                static_cast<size_t>(items) * sizeof(int32_t), stream);
      }
    }
    list_slots_[layer].assign(slot_of.begin(), slot_of.end());
    list_n_[layer].resize(static_cast<size_t>(batch));
    for (int64_t b = 0; b < batch; ++b) list_n_[layer][b] = pos[b] + 1;
  }
  if (st.ok() && host_lists_) {
    // The lists the step attends come from the host's Select (instead of DecodeSelect).
    const auto ts = Clock::now();
    Result<int64_t> most = UploadHostLists(slot_of, layer, pos, q_host, k_host, v_host,
                                           inputs_on_host, stream);
    Stage(stats_.ms_select, "select", ts);
    if (most.ok()) {
      a.max_rows_hint = most.value();
    } else {
      st = most.status();
    }
  }
  // The cross-layer prefetch (xl_prefetch_). One in flight writes a stage region: this layer's
  // step comes after it, and reads its misses from the stage when it was this layer's.
  bool staged = false;
  if (st.ok() && prefetch_layer_ >= 0) {
    st = device_->WaitEvent(stream, prefetch_done_);
    staged = st.ok() && prefetch_layer_ == layer && planned && xl_reuse && a.bank.rows != nullptr;
    if (st.ok()) prefetch_layer_ = -1;
  }
  if (staged) a.bank.staged = 1;
  // The next layer takes this layer's list (xl+): its misses are known now, and are copied into
  // its stage beside this layer's step.
  bool prefetch_next = xl_prefetch_ && XlPrefetchWanted() && planned && a.bank.rows != nullptr && layer + 1 < layers &&
                       WindowOf(layer + 1) == 0 && policy_->device_reuses_previous_layer(layer + 1);
  // (XlReusesPrevious at the next layer: the same sequences, planned, at the same length.)
  for (int64_t b = 0; prefetch_next && b < batch; ++b) {
    prefetch_next = plan_.positions[static_cast<size_t>(b * layers + layer + 1)] == pos[b];
  }
  if (st.ok() && prefetch_next) {
    DecodeStepArgs nx = a;
    nx.layer = layer + 1;
    nx.bank.staged = 0;
    nx.bank.stage = bank_stage_ + static_cast<size_t>((layer + 1) % bank_regions_) * bank_stage_region_;
    st = device_->RecordEvent(prefetch_fork_, stream);
    if (st.ok()) st = device_->WaitEvent(admit_stream_, prefetch_fork_);
    if (st.ok()) st = device_->PrefetchListRows(nx, admit_stream_);
    if (st.ok()) st = device_->RecordEvent(prefetch_done_, admit_stream_);
    if (st.ok()) {
      prefetch_layer_ = layer + 1;
      admit_side_layer_ = std::max(admit_side_layer_, layer);
    }
  }
  // The scheduler's split (route auto, a device selection without a bank; not in a graph, which
  // holds no host work, and on CUDA with device tensors only, as a CPU step's asynchronous part):
  // the CPU attends its share of the layer's misses on the runtime's thread while the device
  // attends the rest, and the stream merges the two (HandOverDecodeCpuPart).
  const int32_t split_q10 =
      split_ && st.ok() && !capturing &&
              (device_->backend() == Backend::kHost ||
               (q.where == MemoryKind::kDevice && out.where == MemoryKind::kDevice))
          ? SplitShare(offloaded * m.num_kv_heads)
          : 0;
  if (st.ok() && split_q10 > 0) {
    // q down for the CPU's share, the split, then the event its part waits for.
    st = device_->CopyAsync(q_raw_host_, q_src.value(),
                            static_cast<size_t>(q.numel()) * DTypeSize(q.dtype), stream);
    const SplitListArgs sp{split_q10, split_gpu_list_, split_gpu_count_, split_cpu_list_, split_cpu_count_};
    if (st.ok()) st = device_->SplitStepList(a, sp, stream);
    if (st.ok()) st = device_->RecordEvent(split_ready_, stream);
    if (st.ok()) {
      a.list = split_gpu_list_;
      a.list_count = split_gpu_count_;
      a.out = o_gpu_;
      a.out_dtype = DType::kF32;
      a.lse = lse_gpu_;
      TensorView q_down = q;
      q_down.data = q_raw_host_;
      q_down.where = MemoryKind::kHost;
      const int64_t hkv = m.num_kv_heads;
      stats_.rows_selected += selected * hkv;
      stats_.select_key_bytes += key_bytes * hkv;
      stats_.decode_split += 1;
      Stage(stats_.ms_attend_gpu, "attend_gpu", t1);
      split_last_q10_ = split_q10;
      return HandOverDecodeCpuPart(a, false, layer, planned, true, q_down, k, v, out, out_direct,
                                   stream, split_q10);
    }
  }
  // The step rewrites its region's staging and miss lists: the admission that last read them
  // (layer - 2's) comes first.
  const bool admit_beside = a.bank.rows != nullptr && bank_regions_ > 1;
  if (st.ok() && admit_beside && admit_pending_[bank_region]) {
    st = device_->WaitEvent(stream, admit_done_[bank_region]);
    admit_pending_[bank_region] = false;
  }
  // Runtime::TimeDeviceSelect also times the step's attention where the device attends every
  // selected row (not a CPU step, whose device part is the resident rows; not host lists).
  if (st.ok() && !beside && !async_part) {
    st = TimedLaunch(time_select_ && !capturing && !cpu_step_ && !host_lists_, attend_timing_, layer,
                     stats_.ms_attend_device, selected * m.num_kv_heads * 2 * static_cast<int64_t>(row_bytes_),
                     timed_attend_bytes_, stream, [&] { return device_->DecodeStep(a, stream); });
    if (st.ok() && staged) stats_.decode_prefetched += 1;
  }
  // The bank admits the layer's misses right after the step that read them: beside the next
  // layer's work on admit_stream_ (two regions), else on the caller's stream.
  if (st.ok() && a.bank.rows != nullptr) {
    const auto ta = Clock::now();
    const int items = static_cast<int>(batch * m.num_kv_heads);
    if (admit_beside) {
      EventHandle fork = admit_fork_[bank_region];
      st = device_->RecordEvent(fork, stream);
      if (st.ok()) st = device_->WaitEvent(admit_stream_, fork);
      if (st.ok()) st = step_bank_->Admit(a.bank.admit, items, admit_stream_);
      if (st.ok()) st = device_->RecordEvent(admit_done_[bank_region], admit_stream_);
      if (st.ok()) {
        admit_pending_[bank_region] = true;
        admit_side_layer_ = std::max(admit_side_layer_, layer);
      }
    } else {
      st = step_bank_->Admit(a.bank.admit, items, stream);
    }
    Stage(stats_.ms_admit, "admit", ta);
  }
  if (st.ok() && async_part) {
    Stage(stats_.ms_attend_gpu, "attend_gpu", t1);
    return HandOverDecodeCpuPart(a, beside, layer, planned, inputs_on_host, q_host, k_host, v_host,
                                 out, out_direct, stream);
  }
  if (st.ok() && cpu_step_) {
    Stage(stats_.ms_attend_gpu, "attend_gpu", t1);
    const auto t2 = Clock::now();
    if (!inputs_on_host) st = HostWaitEvent(q_ready_);
    // The pinned CPU part of the last step must have reached the device before it is rewritten
    // (it has, unless the caller switched streams).
    if (st.ok() && !device_->EventDone(cpu_part_up_)) st = HostWaitEvent(cpu_part_up_);
    // A policy failure rolls back below like any other (the window rewritten from the store).
    // The launch captures one pointer (no allocation on the step's path).
    struct Launch {
      RuntimeImpl* rt;
      const DecodeStepArgs* args;
      StreamHandle stream;
    } lc{this, &a, stream};
    std::function<Status()> launch;
    if (beside) {
      launch = [p = &lc] {
        TraceRecorder& tr = p->rt->trace_;
        const auto t0 = tr.on() ? TraceRecorder::Clock::now() : TraceRecorder::Clock::time_point{};
        Status s = p->rt->EnqueueDeviceScan();
        const auto t1 = tr.on() ? TraceRecorder::Clock::now() : TraceRecorder::Clock::time_point{};
        if (s.ok()) s = p->rt->device_->DecodeStep(*p->args, p->stream);
        if (tr.on()) {
          tr.Span("launch_scan", "launch", t0, t1);
          tr.Span("launch_step", "launch", t1, TraceRecorder::Clock::now());
        }
        return s;
      };
    }
    if (st.ok()) {
      st = SelectOnHost(slot_of, layer, pos, q_host, k_host, v_host, nullptr, nullptr,
                        beside ? &launch : nullptr);
    }
    Stage(stats_.ms_select, "select", t2);
    const int64_t rows = batch * m.num_q_heads;
    const bool host = device_->backend() == Backend::kHost;
    const float* o_cpu = host ? o_cpu_host_ : o_cpu_dev_;
    const float* lse_cpu = host ? lse_cpu_host_ : lse_cpu_dev_;
    if (st.ok() && !host) {
      st = device_->CopyAsync(o_cpu_dev_, o_cpu_host_, static_cast<size_t>(rows) * m.head_dim * 4,
                              stream);
      if (st.ok()) st = device_->CopyAsync(lse_cpu_dev_, lse_cpu_host_, rows * 4, stream);
      if (st.ok()) st = device_->RecordEvent(cpu_part_up_, stream);
      stats_.bytes_h2d += rows * (m.head_dim + 1) * 4;
      stats_.bytes_d2h += static_cast<int64_t>(q.numel()) * static_cast<int64_t>(DTypeSize(q.dtype));
    }
    if (st.ok()) {
      const auto t3 = Clock::now();
      st = device_->MergeLse(o_gpu_, lse_gpu_, o_cpu, lse_cpu, rows, m.head_dim,
                             out_direct ? out.data : out_stage_, out.dtype, stream);
      Stage(stats_.ms_merge, "merge", t3);
    }
  }
  if (st.ok() && !out_direct) {
    const size_t bytes = static_cast<size_t>(out.numel()) * DTypeSize(out.dtype);
    st = device_->CopyAsync(out.data, out_stage_, bytes, stream);
  }
  if (st.ok() && layer == layers - 1) st = JoinSelectorSide(stream);  // the step's side rebuilds
  if (st.ok() && layer == layers - 1) st = JoinAdmitSide(stream);  // and its admissions
  if (st.ok() && !capturing) st = device_->RecordEvent(call_done_, stream);
  // Host-memory outputs are complete when Decode returns.
  if (st.ok() && out.where == MemoryKind::kHost && device_->backend() == Backend::kCuda) {
    st = HostWaitStream(stream);
  }
  if (!st.ok()) {
    uncommit();
    // xl+ on the device: the next layer must not take this call's list (a runtime that never
    // made the call has the last step's here, of another length); nor the host wrapper its set.
    if (static_cast<size_t>(layer) < list_n_.size()) list_n_[layer].clear();
    for (int slot : slot_of) policy_->OnDecodeRolledBack(slot, layer);
    // DecodeStep may have appended the token to the ring before the failure: put the rows back
    // (not while capturing, where a failure ends the capture anyway).
    if (capturing) return st;
    Status restored = RestoreWindow(slot_of, layer, stream);
    // A step kernel that ran before the failure listed misses that no admission consumed: the
    // next layer's admission would read those list indices against its own list.
    if (restored.ok() && a.bank.rows != nullptr) restored = ClearBankMisses(stream);
    return WithRestore(std::move(st), restored);
  }
  CommitDecodeStep(layer, planned);
  OpenXlGap(layer, stream, capturing);  // the engine's time to the next layer's Decode starts here
  const int64_t hkv = m.num_kv_heads;
  if (!cpu_step_) Stage(stats_.ms_attend_gpu, "attend_gpu", t1);
  stats_.rows_resident += resident * hkv;
  stats_.rows_fetched += fetched * hkv;
  stats_.rows_selected += selected * hkv;
  stats_.select_key_bytes += key_bytes * hkv;
  // A device selection read through the device bank: its rows split into resident, bank hits and
  // misses on the device; Stats takes the resident share from the bank's counters.
  if (a.bank.rows != nullptr && scoring_ != SelectScoring::kNone) {
    bank_step_selected_ += selected * hkv;
  }
  stats_.bytes_h2d += fetched * hkv * 2 * static_cast<int64_t>(row_bytes_);
  return Status::Ok();
}

void RuntimeImpl::CommitDecodeStep(int layer, bool planned) {
  const ModelShape& m = config_.model;
  const int64_t batch = static_cast<int64_t>(batch_slots_.size());
  if (planned) {
    plan_.layer_run[layer] = 1;
  } else {
    for (int slot : batch_slots_) ++lengths_[static_cast<size_t>(slot) * m.num_layers + layer];
  }
  stats_.bytes_d2h += batch * m.num_kv_heads * 2 * static_cast<int64_t>(row_bytes_);  // write-through
  stats_.decode_steps += 1;
  stats_.decode_tokens += batch;
  stats_.decode_planned += planned ? 1 : 0;
}

Status RuntimeImpl::HandOverDecodeCpuPart(const DecodeStepArgs& a, bool scan_deferred, int layer,
                                          bool planned, bool inputs_on_host,
                                          const TensorView& q_host, const TensorView& k_host,
                                          const TensorView& v_host, const TensorView& out,
                                          bool out_direct, StreamHandle stream,
                                          int32_t split_q10) {
  const ModelShape& m = config_.model;
  const int64_t batch = static_cast<int64_t>(batch_slots_.size());
  const int64_t rows = batch * m.num_q_heads;
  const bool host = device_->backend() == Backend::kHost;
  // The step counted before the hand-over (the part then owns stats_ until it is collected);
  // RollBackCpuPart takes it back on a failure. (Neither a CPU step nor a split one has a token
  // bank.)
  CommitDecodeStep(layer, planned);
  CpuPartJob job;
  const bool split = split_q10 > 0;
  job.q10 = split_q10;
  job.balance = split && !host && config_.split_share < 0.0;
  job.layer = layer;
  job.inputs_on_host = inputs_on_host;
  job.stream = stream;
  job.q = q_host;
  job.k = k_host;
  job.v = v_host;
  job.batch = batch;
  job.planned = planned;
  // The last part's (o, lse) must have reached the device before this part rewrites them: the
  // stream's order says so on the same stream (this layer's q, which the part waits for, follows
  // that upload); on another, the host waits here, before the hand-over.
  if (!host && cpu_last_stream_ != nullptr && stream != cpu_last_stream_ &&
      !device_->EventDone(cpu_part_up_)) {
    Status st = HostWaitEvent(cpu_part_up_);
    if (!st.ok()) return RollBackCpuPart(job, std::move(st));
  }
  // A deferred scan that only extends the device's shadow (no item takes its ranking, so no
  // Select waits for it) goes first: the part then never meets it. Failing, nothing is handed
  // over and the count is taken back as a failed Decode would.
  if (scan_deferred && !scan_live_) {
    scan_deferred = false;
    Status st = EnqueueDeviceScan();
    if (!st.ok()) return RollBackCpuPart(job, std::move(st));
  }
  if (!host) {  // (o, lse) up, q down
    stats_.bytes_h2d += rows * (m.head_dim + 1) * 4;
    stats_.bytes_d2h += rows * m.head_dim * static_cast<int64_t>(DTypeSize(q_host.dtype));
  }
  job.ticket = ++cpu_ticket_;
  HandOverCpuPart(job);
  // From here this thread touches only the device, its own events and LFPS's deferred scan
  // (made to run beside the Selects: EnqueueDeviceScan). It enqueues the scan the part's Selects
  // wait for and the step over the resident rows while they start, then the stream's wait for
  // the part's ticket, the upload of its (o, lse) and their merge with the resident rows' part.
  cpu_last_stream_ = stream;
  const float* o_cpu = host ? o_cpu_host_ : o_cpu_dev_;
  const float* lse_cpu = host ? lse_cpu_host_ : lse_cpu_dev_;
  const auto tl = trace_.on() ? TraceRecorder::Clock::now() : TraceRecorder::Clock::time_point{};
  Status st = scan_deferred ? EnqueueDeviceScan() : Status::Ok();
  if (st.ok()) st = device_->DecodeStep(a, stream);
  if (st.ok() && job.balance) {
    st = device_->RecordEvent(split_step_done_, stream);
    if (st.ok()) split_recorded_.store(job.ticket, std::memory_order_release);
  }
  if (trace_.on()) trace_.Span("launch_step", "launch", tl, TraceRecorder::Clock::now());
  if (st.ok()) st = device_->WaitHostValue(cpu_word_, job.ticket, stream);
  if (st.ok() && !host) {
    st = device_->CopyAsync(o_cpu_dev_, o_cpu_host_, static_cast<size_t>(rows) * m.head_dim * 4, stream);
    if (st.ok()) st = device_->CopyAsync(lse_cpu_dev_, lse_cpu_host_, rows * 4, stream);
    if (st.ok()) st = device_->RecordEvent(cpu_part_up_, stream);
  }
  if (st.ok()) {
    st = device_->MergeLse(o_gpu_, lse_gpu_, o_cpu, lse_cpu, rows, m.head_dim,
                           out_direct ? out.data : out_stage_, out.dtype, stream);
  }
  if (st.ok() && !out_direct) {
    st = device_->CopyAsync(out.data, out_stage_, static_cast<size_t>(out.numel()) * DTypeSize(out.dtype),
                            stream);
  }
  // A split step's policy may rebuild beside the step (HiP's side stream): its last layer joins.
  if (st.ok() && layer == config_.model.num_layers - 1) st = JoinSelectorSide(stream);
  if (st.ok()) st = device_->RecordEvent(call_done_, stream);
  if (!st.ok()) {
    WaitCpuPart();
    cpu_job_out_ = false;
    cpu_job_status_ = Status::Ok();
    return RollBackCpuPart(cpu_job_, std::move(st));
  }
  // On the host backend the wait above returned with the part done: its status is this call's.
  return host ? CollectCpuPart() : Status::Ok();
}

int32_t RuntimeImpl::SplitShare(int64_t offloaded) const {
  if (config_.split_share >= 0.0) return static_cast<int32_t>(std::llround(config_.split_share * 1024.0));
  if (offloaded <= 0) return 0;
  const double frac = CpuFraction(cost_);  // both branches end together (runtime/scheduler.h)
  const double cpu_us = static_cast<double>(offloaded) * frac * 2.0 * static_cast<double>(row_bytes_) /
                        (cost_.cpu_gbps * 1e3);
  if (cpu_us < config_.split_min_us) return 0;
  // The share the steps balanced (CUDA), else the model's.
  const int32_t balanced = split_q10_.load(std::memory_order_relaxed);
  if (balanced >= 0) return balanced;
  return static_cast<int32_t>(std::clamp<int64_t>(std::llround(frac * 1024.0), 0, 1024));
}

Route RuntimeImpl::PlannedRoute() const {
  return config_.route == Route::kAuto && policy_->placement() == Placement::kCpu ? Route::kCpu
                                                                                  : config_.route;
}

Result<int64_t> RuntimeImpl::UploadHostLists(std::span<const int> slot_of, int layer,
                                             std::span<const int64_t> positions,
                                             const TensorView& q, const TensorView& k,
                                             const TensorView& v, bool inputs_on_host,
                                             StreamHandle stream) {
  const int64_t items = static_cast<int64_t>(slot_of.size()) * config_.model.num_kv_heads;
  const int64_t layer_items = int64_t{config_.capacity.max_batch} * config_.model.num_kv_heads;
  int32_t* lists = list_stage_ + layer * layer_items * list_cap_;
  int32_t* counts = list_stage_ + config_.model.num_layers * layer_items * list_cap_ +
                    layer * layer_items;
  KVF_RETURN_IF_ERROR(HostWaitEvent(q_ready_));
  // The layer's staging is rewritten only once its last upload (the step before) has run: it has,
  // unless the caller switched streams.
  EventHandle up = list_up_[static_cast<size_t>(layer)];
  if (!device_->EventDone(up)) KVF_RETURN_IF_ERROR(HostWaitEvent(up));
  KVF_RETURN_IF_ERROR(SelectOnHost(slot_of, layer, positions, q, k, v, lists, counts));
  const size_t region = static_cast<size_t>(layer * layer_items);
  KVF_RETURN_IF_ERROR(device_->CopyAsync(step_list_ + region * list_cap_, lists,
                                         static_cast<size_t>(items * list_cap_) * sizeof(int32_t),
                                         stream));
  KVF_RETURN_IF_ERROR(device_->CopyAsync(step_list_count_ + region, counts,
                                         static_cast<size_t>(items) * sizeof(int32_t), stream));
  KVF_RETURN_IF_ERROR(device_->RecordEvent(up, stream));
  stats_.bytes_h2d += items * (list_cap_ + 1) * static_cast<int64_t>(sizeof(int32_t));
  if (!inputs_on_host) {
    stats_.bytes_d2h += static_cast<int64_t>(q.numel()) * static_cast<int64_t>(DTypeSize(q.dtype));
  }
  return *std::max_element(counts, counts + items);
}

Status RuntimeImpl::ClearBankMisses(StreamHandle stream) {
  KVF_RETURN_IF_ERROR(JoinAdmitSide(stream));  // admissions in flight consume their own lists
  const size_t bytes = bank_miss_region_ * static_cast<size_t>(bank_regions_);
  const std::vector<int32_t> zeros(bytes / sizeof(int32_t), 0);
  KVF_RETURN_IF_ERROR(device_->CopyAsync(bank_miss_, zeros.data(), bytes, stream));
  return device_->SynchronizeStream(stream);
}

Status RuntimeImpl::JoinAdmitSide(StreamHandle stream) {
  if (admit_side_layer_ < 0) return Status::Ok();
  KVF_RETURN_IF_ERROR(device_->RecordEvent(admit_join_, admit_stream_));
  KVF_RETURN_IF_ERROR(device_->WaitEvent(stream, admit_join_));
  admit_pending_[0] = admit_pending_[1] = false;
  admit_side_layer_ = -1;
  prefetch_layer_ = -1;  // a prefetch in flight ran on the same stream
  return Status::Ok();
}

Status RuntimeImpl::JoinSelectorSide(StreamHandle stream) {
  return selector_ != nullptr ? selector_->Join(-1, stream) : Status::Ok();
}

Status RuntimeImpl::ResetSelectState(int slot) {
  return selector_ != nullptr ? selector_->Reset(slot, stream_) : Status::Ok();
}

Status RuntimeImpl::SelectorStored(int slot, int layer, int64_t pos0, int64_t new_len,
                                   StreamHandle stream) {
  if (selector_ == nullptr || !selector_->tracks_store()) return Status::Ok();
  KVF_RETURN_IF_ERROR(store_->FlushTable(stream));
  const StoreTableView view{store_->device_table(), store_->max_pages(), store_->shape().page_tokens};
  return selector_->OnStored(slot, layer, pos0, new_len, view, stream);
}

SelectorShape RuntimeImpl::SelectorShapeOf() const {
  SelectorShape s;
  s.model = config_.model;
  s.max_sequences = config_.capacity.max_sequences;
  s.max_tokens = config_.capacity.max_tokens_per_sequence;
  s.item_cap = item_cap_;
  s.group = group_;
  s.scale = scale_;
  s.kv_elem = kv_elem_;
  s.row_bytes = row_bytes_;
  s.sink = config_.tiers.sink_tokens;
  s.window = config_.tiers.window_tokens;
  s.cuda = device_->backend() == Backend::kCuda;
  return s;
}

Status RuntimeImpl::RestoreWindow(std::span<const int> slots, int layer, StreamHandle stream) {
  if (WindowOf(layer) > 0) return Status::Ok();  // a sliding-window layer keeps no host copy
  const ModelShape& m = config_.model;
  const int sink = config_.tiers.sink_tokens, window = config_.tiers.window_tokens;
  KVF_RETURN_IF_ERROR(HostWaitStream(stream));
  KVF_RETURN_IF_ERROR(device_->SynchronizeEvent(call_done_));
  // At most max_rows_ * hkv * 2 descriptors fit in k_copies_; a ring holds window rows per head,
  // so copy in rounds.
  const int64_t cap = max_rows_ * m.num_kv_heads * 2;
  int64_t c = 0;
  auto flush = [&]() -> Status {
    if (c == 0) return Status::Ok();
    KVF_RETURN_IF_ERROR(device_->CopyRows(k_copies_, c, m.head_dim, m.kv_dtype, m.kv_dtype, stream));
    KVF_RETURN_IF_ERROR(device_->CopyRows(v_copies_, c, m.head_dim, m.kv_dtype, m.kv_dtype, stream));
    c = 0;
    return HostWaitStream(stream);
  };
  for (int slot : slots) {
    const int64_t n = lengths_[static_cast<size_t>(slot) * m.num_layers + layer];
    for (int64_t pos = std::max<int64_t>(sink, n - window); pos < n; ++pos) {
      const int64_t row = ResidentRowOf(pos, n, sink, window);
      for (int h = 0; h < m.num_kv_heads; ++h) {
        if (c == cap) KVF_RETURN_IF_ERROR(flush());
        k_copies_[c] = RowCopy{ResidentK(slot, layer, h, row), store_->k_row(slot, layer, h, pos)};
        v_copies_[c++] = RowCopy{ResidentV(slot, layer, h, row), store_->v_row(slot, layer, h, pos)};
      }
    }
  }
  return flush();
}

Status RuntimeImpl::RollBackDecode(std::span<const int> slot_of, int layer, StreamHandle stream,
                                   Status failure) {
  for (int slot : slot_of) {
    --lengths_[static_cast<size_t>(slot) * config_.model.num_layers + layer];
    policy_->OnDecodeRolledBack(slot, layer);
  }
  if (static_cast<size_t>(layer) < list_n_.size()) list_n_[layer].clear();  // as in RunDecodeStep
  return WithRestore(std::move(failure), RestoreWindow(slot_of, layer, stream));
}

}  // namespace kvferry::detail
