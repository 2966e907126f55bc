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
  const DeviceBufferSizes& z = sizes_;
  lists_.device_select = z.device_select;
  if (!z.selector) selector_.reset();  // the step does not select on the device
  step_.fast_path = z.fast_path;
  step_.all_resident = z.step_all_resident;
  step_.cpu_step = z.cpu_step;
  // step_.host_lists was decided with the bank (Init): a policy that selects on the host and runs
  // the planned step because its bank is on the device.
  if (!step_.fast_path && !step_.cpu_step && !step_.host_lists) return Status::Ok();
  KVF_RETURN_IF_ERROR(InitCpuPartBuffers());
  if (lists_.device_select || step_.host_lists) {
    KVF_RETURN_IF_ERROR(InitSelectLists());
  }
  return InitPlanBuffers();
}

Status RuntimeImpl::InitCpuPartBuffers() {
  const Capacity& cap = config_.capacity;
  const ModelShape& m = config_.model;
  const DeviceBufferSizes& z = sizes_;
  // The scheduler's split (route auto, a device selection without a bank): its CPU share runs on
  // the runtime's thread with a CPU step's pinned q staging, events and attention partials.
  split_.on = z.split;
  if (step_.cpu_step || step_.host_lists || split_.on) {
    // q, k and v of a step as the caller gave them (4 bytes an element at most).
    const size_t per_token = static_cast<size_t>(m.num_q_heads + 2 * m.num_kv_heads) * m.head_dim;
    KVF_ASSIGN_OR_RETURN(io_.q_raw_host,
                         Alloc(static_cast<size_t>(cap.max_batch) * per_token * sizeof(float) + 256, true));
    KVF_ASSIGN_OR_RETURN(io_.q_ready, device_->CreateEvent());
    KVF_ASSIGN_OR_RETURN(cpu_.part_up, device_->CreateEvent());
    // The CPU attention's partial results when an item's picks are split over pool threads
    // (AttendInParts).
    scratch_.attend_parts.assign(static_cast<size_t>(cap.max_batch) * m.num_kv_heads *
                                     (kAttendMaxParts - 1) * static_cast<size_t>(dims_.group) *
                                     (m.head_dim + 1),
                                 0.0f);
  }
  if (split_.on) {
    const int64_t items = int64_t{cap.max_batch} * m.num_kv_heads;
    KVF_ASSIGN_OR_RETURN(split_.ready, device_->CreateEvent());
    KVF_ASSIGN_OR_RETURN(split_.step_done, device_->CreateEvent());
    KVF_ASSIGN_OR_RETURN(split_.gpu_list, AllocAs<int32_t>(z.split_list, false));
    KVF_ASSIGN_OR_RETURN(split_.gpu_count, AllocAs<int32_t>(z.split_count, false));
    KVF_ASSIGN_OR_RETURN(split_.cpu_list, AllocAs<int32_t>(static_cast<size_t>(items * z.list_cap) * sizeof(int32_t), true));
    KVF_ASSIGN_OR_RETURN(split_.cpu_count, AllocAs<int32_t>(static_cast<size_t>(items) * sizeof(int32_t), true));
  }
  if (step_.cpu_step || split_.on) {
    // The CPU part on its own thread (RuntimeConfig::async_cpu; -1: with CUDA). The split's
    // share always runs there (SizeDeviceBuffers plans no split with async_cpu 0).
    const int want = config_.async_cpu;
    cpu_.async = want > 0 || (want < 0 && device_->backend() == Backend::kCuda) || split_.on;
    if (cpu_.async) {
      KVF_ASSIGN_OR_RETURN(cpu_.word, AllocAs<uint32_t>(2 * sizeof(uint32_t), true));
      cpu_.word[0] = cpu_.word[1] = 0;
      cpu_.thread = std::thread([this] { CpuThreadMain(); });
    }
  }
  return Status::Ok();
}

Status RuntimeImpl::InitSelectLists() {
  const Capacity& cap = config_.capacity;
  const ModelShape& m = config_.model;
  const DeviceBufferSizes& z = sizes_;
  void* p = nullptr;
  // Per layer a list region, so that any layer's last selection can be read back and no layer
  // rewrites a list an earlier launch of the step may still read.
  const int64_t items = int64_t{cap.max_batch} * m.num_kv_heads;
  lists_.cap = z.list_cap;
  KVF_ASSIGN_OR_RETURN(lists_.positions, AllocAs<int32_t>(z.step_list, false));
  KVF_ASSIGN_OR_RETURN(lists_.counts, AllocAs<int32_t>(z.step_list_count, false));
  if (step_.host_lists) {
    // The host's lists of every layer, pinned, copied up from here (UploadHostLists).
    const size_t lists = static_cast<size_t>(m.num_layers) * items;
    const size_t staged = lists * static_cast<size_t>(lists_.cap + 1) * sizeof(int32_t);
    KVF_ASSIGN_OR_RETURN(lists_.stage, AllocAs<int32_t>(staged, true));
    lists_.up.assign(static_cast<size_t>(m.num_layers), nullptr);
    for (EventHandle& e : lists_.up) {
      KVF_ASSIGN_OR_RETURN(e, device_->CreateEvent());
    }
  }
  // Host lists need no selection scratch.
  lists_.select_ld = z.select_ld;
  if (z.select_ws > 0) {
    KVF_ASSIGN_OR_RETURN(lists_.select_ws, AllocAs<float>(z.select_ws, false));
  }
  if (z.topk_ws > 0) {
    KVF_ASSIGN_OR_RETURN(lists_.topk_ws, AllocAs<unsigned long long>(z.topk_ws, false));
  }
  // The multi-CTA top-k's scratch, when an item can rank enough scores to take it.
  if (z.select_mcta > 0) {
    KVF_ASSIGN_OR_RETURN(lists_.select_mcta_ws, AllocAs<uint32_t>(z.select_mcta, false));
  }
  if (selector_ != nullptr) {  // its buffers, in the order it sized them
    std::vector<void*> buffers;
    for (const SelectorBuffer& b : z.selector_buffers) {
      KVF_ASSIGN_OR_RETURN(p, Alloc(b.bytes, false));
      buffers.push_back(p);
    }
    KVF_RETURN_IF_ERROR(selector_->Bind(buffers, *device_, stream_));
  }
  if (z.bank_stage > 0) KVF_RETURN_IF_ERROR(InitBankStaging());
  lists_.slots.assign(static_cast<size_t>(m.num_layers), {});
  for (auto& v : lists_.slots) v.reserve(static_cast<size_t>(cap.max_batch));
  lists_.n.assign(static_cast<size_t>(m.num_layers), {});
  for (auto& v : lists_.n) v.reserve(static_cast<size_t>(cap.max_batch));
  return Status::Ok();
}

Status RuntimeImpl::InitBankStaging() {
  const DeviceBufferSizes& z = sizes_;
  // The step's misses: staged at their list index, listed for the admission after the step;
  // one set a region (DeviceBufferSizes::bank_regions).
  dbank_.miss_cap = z.bank_miss_cap;
  dbank_.regions = z.bank_regions;
  const size_t regions = static_cast<size_t>(dbank_.regions);
  dbank_.stage_region = z.bank_stage / regions;
  dbank_.miss_region = z.bank_miss / regions;
  dbank_.admit_region = z.bank_admit / regions;
  KVF_ASSIGN_OR_RETURN(dbank_.stage, AllocAs<char>(z.bank_stage, false));
  KVF_ASSIGN_OR_RETURN(dbank_.miss, AllocAs<int32_t>(z.bank_miss, false));
  const std::vector<int32_t> zeros(z.bank_miss / sizeof(int32_t), 0);
  KVF_RETURN_IF_ERROR(device_->CopyAsync(dbank_.miss, zeros.data(), z.bank_miss, stream_));
  KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
  KVF_ASSIGN_OR_RETURN(dbank_.admit, Alloc(z.bank_admit, false));
  if (dbank_.regions <= 1) return Status::Ok();
  KVF_ASSIGN_OR_RETURN(dbank_.admit_stream, device_->CreateStream());
  for (int r = 0; r < 2; ++r) {
    KVF_ASSIGN_OR_RETURN(dbank_.admit_fork[r], device_->CreateEvent());
    KVF_ASSIGN_OR_RETURN(dbank_.admit_done[r], device_->CreateEvent());
  }
  KVF_ASSIGN_OR_RETURN(dbank_.admit_join, device_->CreateEvent());
  bool shares = false;  // a layer that takes the previous layer's list (xl+)
  for (int l = 1; l < config_.model.num_layers; ++l) {
    shares = shares || policy_->device_reuses_previous_layer(l);
  }
  const int mode = config_.xl_prefetch;
  if (shares && !step_.cpu_step && !step_.host_lists && mode != 0) {
    KVF_ASSIGN_OR_RETURN(xl_.fork, device_->CreateEvent());
    KVF_ASSIGN_OR_RETURN(xl_.done, device_->CreateEvent());
    xl_.on = true;
    xl_.automatic = mode < 0;
    xl_.gap_min_us = config_.xl_prefetch_gap_us;
  }
  if (xl_.automatic) {  // the gap's timing pairs (DestroyTimings frees them)
    TimingRing& r = xl_.gap_timing;
    r.pairs.resize(static_cast<size_t>(config_.model.num_layers) * kTimingRing);
    r.next.assign(static_cast<size_t>(config_.model.num_layers), 0);
    for (TimingPair& t : r.pairs) {
      for (EventHandle* e : {&t.start, &t.end}) {
        KVF_ASSIGN_OR_RETURN(*e, device_->CreateTimingEvent());
      }
    }
  }
  return Status::Ok();
}

Status RuntimeImpl::InitPlanBuffers() {
  const Capacity& cap = config_.capacity;
  const ModelShape& m = config_.model;
  const DeviceBufferSizes& z = sizes_;
  KVF_ASSIGN_OR_RETURN(step_.slots_dev, AllocAs<int32_t>(z.step_slots, false));
  const size_t positions = static_cast<size_t>(cap.max_batch) * m.num_layers;
  KVF_ASSIGN_OR_RETURN(step_.pos_dev, AllocAs<int64_t>(z.step_pos, false));
  step_.plan_stage_bytes = AlignUp(static_cast<size_t>(cap.max_batch) * sizeof(int32_t), 64) +
                           AlignUp(positions * sizeof(int64_t), 64);
  KVF_ASSIGN_OR_RETURN(step_.plan_stage, AllocAs<char>(kPlanRing * step_.plan_stage_bytes, true));
  for (int i = 0; i < kPlanRing; ++i) {
    KVF_ASSIGN_OR_RETURN(EventHandle e, device_->CreateEvent());
    step_.plan_events.push_back(e);
  }
  if (z.step_ws > 0) {
    step_.ws_floats = z.step_ws_floats;
    KVF_ASSIGN_OR_RETURN(step_.ws, AllocAs<float>(z.step_ws, false));
    const size_t counters = static_cast<size_t>(cap.max_batch) * m.num_kv_heads * dims_.group;
    KVF_ASSIGN_OR_RETURN(step_.counters, AllocAs<int32_t>(z.step_counters, false));
    const std::vector<int32_t> zeros(counters, 0);
    KVF_RETURN_IF_ERROR(
        device_->CopyAsync(step_.counters, zeros.data(), counters * sizeof(int32_t), stream_));
    KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
  }
  plan_.layer_run.assign(static_cast<size_t>(m.num_layers), 0);
  plan_.seqs.reserve(static_cast<size_t>(cap.max_batch));
  plan_.slots.reserve(static_cast<size_t>(cap.max_batch));
  plan_.positions.reserve(positions);
  scratch_.implicit_pos.reserve(positions);
  scratch_.plan_slots.reserve(static_cast<size_t>(cap.max_batch));
  scratch_.step_pos.reserve(static_cast<size_t>(cap.max_batch));
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
  EventHandle done = step_.plan_events[step_.plan_next];
  if (!device_->EventDone(done)) KVF_RETURN_IF_ERROR(HostWaitEvent(done));
  char* entry = step_.plan_stage + static_cast<size_t>(step_.plan_next) * step_.plan_stage_bytes;
  auto* slots_host = reinterpret_cast<int32_t*>(entry);
  auto* pos_host = reinterpret_cast<int64_t*>(
      entry + AlignUp(static_cast<size_t>(config_.capacity.max_batch) * sizeof(int32_t), 64));
  for (size_t b = 0; b < slots.size(); ++b) slots_host[b] = slots[b];
  std::memcpy(pos_host, positions.data(), positions.size_bytes());
  const size_t batch_cap = static_cast<size_t>(config_.capacity.max_batch);
  KVF_RETURN_IF_ERROR(device_->CopyAsync(step_.slots_dev + region * batch_cap, slots_host,
                                         slots.size() * sizeof(int32_t), stream));
  KVF_RETURN_IF_ERROR(device_->CopyAsync(
      step_.pos_dev + region * batch_cap * config_.model.num_layers, pos_host,
      positions.size_bytes(), stream));
  KVF_RETURN_IF_ERROR(device_->RecordEvent(done, stream));
  step_.plan_next = (step_.plan_next + 1) % kPlanRing;
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
  std::vector<int>& slot_of = scratch_.plan_slots;  // reserved at set-up: no allocation
  KVF_RETURN_IF_ERROR(CheckBatch(seqs, slot_of));
  KVF_RETURN_IF_ERROR(JoinSelectorSide(stream));  // a step left without its last layer
  KVF_RETURN_IF_ERROR(JoinAdmitSide(stream));
  const int layers = config_.model.num_layers;
  for (int l = 0; l < layers; ++l) KVF_RETURN_IF_ERROR(CheckNextToken(seqs, slot_of, l));
  // Policies that select on the host without a planned step plan inside each Decode.
  if (!step_.fast_path && !step_.cpu_step && !step_.host_lists) return Status::Ok();
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
  if (on && timing_.select.pairs.empty()) {
    for (TimingRing* r : {&timing_.select, &timing_.attend}) {
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
  timing_.on = on;
  return Status::Ok();
}

void RuntimeImpl::CloseXlGap(int layer, StreamHandle stream, bool capturing) {
  TimingPair* t = xl_.gap_open;
  xl_.gap_open = nullptr;
  if (t == nullptr || layer != xl_.gap_layer || stream != xl_.gap_stream || capturing) return;
  t->pending = device_->RecordEvent(t->end, stream).ok();
}

void RuntimeImpl::OpenXlGap(int layer, StreamHandle stream, bool capturing) {
  const int next = layer + 1;
  if (!xl_.automatic || capturing || next >= config_.model.num_layers ||
      xl_.gap_timing.pairs.empty() || !policy_->device_reuses_previous_layer(next)) {
    return;
  }
  TimingRing& ring = xl_.gap_timing;
  int& i = ring.next[static_cast<size_t>(next)];
  TimingPair& t = ring.pairs[static_cast<size_t>(next) * kTimingRing + i];
  i = (i + 1) % kTimingRing;
  if (t.pending) {  // recorded kTimingRing steps back, so done: no wait
    const double us = 1e3 * TimingMs(t);
    xl_.gap_us = xl_.gap_us < 0 ? us : 0.8 * xl_.gap_us + 0.2 * us;
    t.pending = false;
  }
  if (!device_->RecordEvent(t.start, stream).ok()) return;
  xl_.gap_open = &t;
  xl_.gap_layer = next;
  xl_.gap_stream = stream;
}

void RuntimeImpl::DestroyTimings(bool with_gap) {
  if (with_gap) xl_.gap_open = nullptr;
  for (TimingRing* r : {&timing_.select, &timing_.attend, &xl_.gap_timing}) {
    if (r == &xl_.gap_timing && !with_gap) continue;
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

TimingPair* RuntimeImpl::NextTiming(TimingRing& ring, int layer, double& ms) {
  int& next = ring.next[static_cast<size_t>(layer)];
  TimingPair& t = ring.pairs[static_cast<size_t>(layer) * kTimingRing + next];
  next = (next + 1) % kTimingRing;
  ms += TimingMs(t);  // recorded a few steps back, so done
  t.pending = false;
  return &t;
}

RuntimeImpl::ListRowsRule RuntimeImpl::DeviceListRowsRule(int layer) const {
  // xl+ copies the previous layer's list; psaw+'s filter refills up to the budget where it hides
  // anything (base/psaw.h); a ranked layer of a blockwise selector takes whole blocks.
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
  if (!lists_.device_select || layer <= 0 || WindowOf(layer - 1) > 0 ||
      !policy_->device_reuses_previous_layer(layer)) {
    return false;
  }
  const size_t prev = static_cast<size_t>(layer) - 1;
  if (!std::equal(slot_of.begin(), slot_of.end(), lists_.slots[prev].begin(), lists_.slots[prev].end()) ||
      lists_.n[prev].size() != pos.size()) {
    return false;
  }
  for (size_t b = 0; b < pos.size(); ++b) {
    if (lists_.n[prev][b] != pos[b] + 1) return false;
  }
  return true;
}

// One layer of a planned decode step: the call's arguments and what RunDecodeStep's stages derive
// and hand on to the next (on RunDecodeStep's stack).
struct RuntimeImpl::DecodeLayer {
  DecodeLayer(std::span<const SequenceId> seqs_in, int layer_in, const TensorView& q_in,
              const TensorView& k_in, const TensorView& v_in, const TensorView& out_in,
              StreamHandle stream_in, const std::vector<int>& slots, std::vector<int64_t>& positions)
      : seqs(seqs_in), layer(layer_in), q(q_in), k(k_in), v(v_in), out(out_in), stream(stream_in),
        slot_of(slots), batch(static_cast<int64_t>(slots.size())), pos(positions) {}

  // The call.
  std::span<const SequenceId> seqs;
  int layer;
  const TensorView& q;
  const TensorView& k;
  const TensorView& v;
  const TensorView& out;
  StreamHandle stream;
  const std::vector<int>& slot_of;  // scratch_.batch_slots
  int64_t batch;
  // Plan (PlanLayer).
  Clock::time_point t0;         // the step's start: stage "append" ends with the plan
  bool capturing = false;
  bool planned = false;         // PlanDecode's plan covers this layer (its token counted)
  std::vector<int64_t>& pos;    // scratch_.step_pos: the new token's position per b at this layer
  int region = 0;               // the plan's region: 0 PlanDecode's, 1 this call's own
  int bank_region = 0;          // the device bank's staging region of this layer
  const void* q_src = nullptr;  // the inputs as the device reads them (StageInput)
  const void* k_src = nullptr;
  const void* v_src = nullptr;
  bool out_direct = false;      // the step writes out itself (else io_.out_stage, copied after)
  DecodeStepArgs a;             // the step kernels' arguments
  bool xl_reuse = false;        // xl+: this layer's list is the previous layer's (copied)
  // Rows the items attend (CountStepRows), for the launch shape and the stats.
  int64_t resident = 0, fetched = 0, selected = 0, key_bytes = 0;
  int64_t offloaded = 0;  // selected rows beyond the resident ones, at most (the split's estimate)
  // Select (SelectLayer).
  Clock::time_point t1;  // the enqueue's start: stage "attend_gpu"
  TensorView q_host, k_host, v_host;  // the inputs on the host (a CPU step, host lists)
  bool inputs_on_host = false;
  bool async_part = false;  // a CPU step's part runs on the runtime's thread
  bool beside = false;      // a CPU step's deferred scan and step launch beside its Selects
  // Resolve (ResolveLayer).
  bool staged = false;  // the misses were staged by the previous layer's prefetch
  // Route and merge: the layer went to the runtime's thread (HandOverDecodeCpuPart's status is
  // the call's).
  bool handed_over = false;
};

Status RuntimeImpl::RunDecodeStep(std::span<const SequenceId> seqs, int layer, const TensorView& q,
                                  const TensorView& k, const TensorView& v, const TensorView& out,
                                  StreamHandle stream) {
  DecodeLayer s(seqs, layer, q, k, v, out, stream == nullptr ? stream_ : stream,
                scratch_.batch_slots, scratch_.step_pos);
  // plan: the layer's positions (the plan's, or reserved and uploaded now), the inputs staged, the
  // step's arguments. From here on a failure takes the layer's token back (FailLayer).
  KVF_RETURN_IF_ERROR(PlanLayer(s));
  // select: the device's selection, or the host's (q, k and v down first), the shadow scan on the device.
  Status st = SelectLayer(s);
  // resolve: where the misses come from (a prefetch's stage), the next layer's prefetched.
  if (st.ok()) st = ResolveLayer(s);
  // route: the scheduler's split gives the CPU its share of the misses (handed over).
  if (st.ok()) st = RouteLayer(s);
  if (s.handed_over) return st;
  // attend: the device's step.
  if (st.ok()) st = AttendLayer(s);
  // admit: the device bank takes the step's misses.
  if (st.ok()) st = AdmitLayer(s);
  // merge: a CPU step's part (handed over, or selected and attended here) merged with the device's.
  if (st.ok()) st = MergeLayer(s);
  if (s.handed_over) return st;
  // The output, the step's side work joined at its last layer, the call recorded.
  if (st.ok()) st = FinishLayer(s);
  if (!st.ok()) return FailLayer(s, std::move(st));
  CommitLayer(s);
  return Status::Ok();
}

Status RuntimeImpl::PlanLayer(DecodeLayer& s) {
  s.t0 = Clock::now();
  const int layers = config_.model.num_layers;
  const TensorView &q = s.q, &k = s.k, &v = s.v, &out = s.out;
  const int layer = s.layer;
  s.capturing = device_->IsCapturing(s.stream);
  KVF_CHECK_CODE(!s.capturing || (q.where == MemoryKind::kDevice && k.where == MemoryKind::kDevice &&
                                  v.where == MemoryKind::kDevice && out.where == MemoryKind::kDevice),
                 StatusCode::kFailedPrecondition,
                 "a Decode captured in a CUDA graph takes q, k, v and out in device memory");
  KVF_CHECK_CODE(!s.capturing || (!step_.cpu_step && !step_.host_lists), StatusCode::kFailedPrecondition,
                 "policy '", policy_->name(), "' selects on the host inside the decode step, which "
                 "a CUDA graph cannot hold (Runtime::decode_is_capture_safe() is false)");
  // The selector's work beside the step (its metadata rebuilds) of this layer or a later one is a step
  // behind: it joins before this layer's selection reads the state it writes.
  // The engine's stream time since the previous layer's Decode ends here (the auto cross-layer
  // prefetch's measure), before anything of this call is on the stream.
  if (xl_.gap_open != nullptr) CloseXlGap(layer, s.stream, s.capturing);
  if (selector_ != nullptr) KVF_RETURN_IF_ERROR(selector_->Join(layer, s.stream));
  // Likewise the bank's admissions beside the stream (a layer's tables are admitted to before
  // its next step reads them).
  if (dbank_.side_layer >= 0 && layer <= dbank_.side_layer) KVF_RETURN_IF_ERROR(JoinAdmitSide(s.stream));
  s.bank_region = layer % dbank_.regions;
  s.planned = plan_.active && plan_.layer_run[layer] == 0 &&
              std::equal(s.seqs.begin(), s.seqs.end(), plan_.seqs.begin(), plan_.seqs.end());
  s.pos.resize(static_cast<size_t>(s.batch));
  if (s.planned) {
    for (int64_t b = 0; b < s.batch; ++b) s.pos[b] = plan_.positions[b * layers + layer];
  } else {
    KVF_CHECK_CODE(!s.capturing, StatusCode::kFailedPrecondition,
                   "Decode of layer ", layer, " while capturing a CUDA graph needs a plan: call "
                   "PlanDecode(seqs) before the capture");
    KVF_RETURN_IF_ERROR(CheckNextToken(s.seqs, s.slot_of, layer));
    KVF_RETURN_IF_ERROR(ReserveNextToken(s.slot_of, layer));
    KVF_RETURN_IF_ERROR(store_->FlushTable(s.stream));
    std::vector<int64_t>& all = scratch_.implicit_pos;  // reserved at set-up: no allocation
    all.resize(static_cast<size_t>(s.batch * layers));
    for (int64_t b = 0; b < s.batch; ++b) {
      std::copy_n(lengths_.begin() + static_cast<int64_t>(s.slot_of[b]) * layers, layers,
                  all.begin() + b * layers);
      s.pos[b] = all[b * layers + layer];
    }
    s.region = 1;
    KVF_RETURN_IF_ERROR(UploadPlan(s.region, s.slot_of, all, s.stream));
  }
  // From here a failure takes this layer's token back (a planned layer committed it already).
  Result<const void*> q_src = StageInput(q, io_.q_in, s.stream);
  Result<const void*> k_src = q_src.ok() ? StageInput(k, io_.k_in, s.stream) : q_src;
  Result<const void*> v_src = k_src.ok() ? StageInput(v, io_.v_in, s.stream) : k_src;
  if (!v_src.ok()) {
    UncommitLayer(s);
    return v_src.status();
  }
  s.q_src = q_src.value();
  s.k_src = k_src.value();
  s.v_src = v_src.value();
  s.out_direct = out.where == MemoryKind::kDevice || device_->backend() == Backend::kHost;
  FillStepArgs(s);
  CountStepRows(s);
  Stage(stats_.ms_append, "append", s.t0);
  return Status::Ok();
}

void RuntimeImpl::UncommitLayer(const DecodeLayer& s) {
  if (!s.planned) return;
  plan_.layer_run[s.layer] = 1;
  const int layers = config_.model.num_layers;
  for (int slot : s.slot_of) --lengths_[static_cast<size_t>(slot) * layers + s.layer];
}

void RuntimeImpl::FillStepArgs(DecodeLayer& s) {
  const ModelShape& m = config_.model;
  const int layers = m.num_layers;
  const int layer = s.layer;
  DecodeStepArgs& a = s.a;
  a.params = AttnParams{dims_.group, m.head_dim, m.kv_dtype, dims_.scale};
  a.batch = static_cast<int32_t>(s.batch);
  a.num_kv_heads = m.num_kv_heads;
  a.num_layers = layers;
  a.layer = layer;
  a.sink = config_.tiers.sink_tokens;
  a.window = config_.tiers.window_tokens;
  a.mode = lists_.device_select || step_.host_lists ? StepRowMode::kList
                                                                      : StepRowMode::kSinksAndRecent;
  if (policy_->is_dense()) {
    a.budget_tokens = config_.capacity.max_tokens_per_sequence;
    a.budget_cap = config_.capacity.max_tokens_per_sequence;
  } else {
    a.budget_tokens = config_.policy.budget_tokens;
    a.budget_fraction = config_.policy.budget_fraction;
    a.budget_cap = std::max<int64_t>(dims_.item_cap, 1);
  }
  a.all_resident = step_.all_resident;
  const size_t batch_cap = static_cast<size_t>(config_.capacity.max_batch);
  a.slots = step_.slots_dev + s.region * batch_cap;
  a.positions = step_.pos_dev + s.region * batch_cap * layers;
  a.q = s.q_src;
  a.k = s.k_src;
  a.v = s.v_src;
  a.out = s.out_direct ? s.out.data : io_.out_stage;
  a.q_dtype = s.q.dtype;
  a.k_dtype = s.k.dtype;
  a.v_dtype = s.v.dtype;
  a.out_dtype = s.out.dtype;
  a.resident = resident_;
  a.store = store_->device_store();
  a.q_f32 = io_.q_f32;
  a.lse = io_.lse_gpu;
  a.ws = step_.ws;
  a.ws_floats = step_.ws_floats;
  a.counters = step_.counters;
  // The host writes the new token's store rows before its Select reads them (SelectOnHost).
  a.host_writes_store = step_.host_lists;
  if (lists_.device_select || step_.host_lists) FillListArgs(s);
  if (step_.cpu_step) {
    // The device's part is the resident rows (sinks + window): every selection covers them. The
    // host's selection and its attention over the offloaded picks meet them in the merge (MergeLayer).
    a.mode = StepRowMode::kSinksAndRecent;
    a.budget_tokens = std::max<int64_t>(int64_t{a.sink} + a.window, 1);
    a.budget_fraction = 0.0;
    a.budget_cap = a.budget_tokens;
    a.all_resident = true;
    a.host_writes_store = true;
    a.out = io_.o_gpu;
    a.out_dtype = DType::kF32;
    a.lse = io_.lse_gpu;
  }
}

void RuntimeImpl::FillListArgs(DecodeLayer& s) {
  const ModelShape& m = config_.model;
  const int layer = s.layer;
  DecodeStepArgs& a = s.a;
  const size_t batch_cap = static_cast<size_t>(config_.capacity.max_batch);
  const size_t lists = static_cast<size_t>(layer) * batch_cap * m.num_kv_heads;
  if (lists_.device_select) a.hide_fraction = policy_->device_hide_fraction(layer);
  // xl+ takes the previous layer's list below: a scoring whose ranking advances no state then
  // only keeps its metadata current (a 4-bit scoring selector at 128K: about 85 us a layer not spent).
  s.xl_reuse = XlReusesPrevious(s.slot_of, s.pos, layer);
  a.select_skip_ranking = s.xl_reuse && selector_ != nullptr && selector_->ranking_skippable();
  a.list = lists_.positions + lists * lists_.cap;
  a.list_count = lists_.counts + lists;
  a.list_cap = lists_.cap;
  a.select_ws = lists_.select_ws;
  a.select_ld = lists_.select_ld;
  a.topk_ws = lists_.topk_ws;
  a.select_mcta_ws = lists_.select_mcta_ws;
  if (selector_ != nullptr) {
    selector_->Fill(a);
    selector_->BeforeSelect(a, s.slot_of, s.pos, layer);
  }
  if (dbank_.stage != nullptr) {
    step_bank_->View(&a.bank);
    const size_t r = static_cast<size_t>(s.bank_region);
    a.bank.stage = dbank_.stage + r * dbank_.stage_region;
    a.bank.miss = dbank_.miss + r * dbank_.miss_region / sizeof(int32_t);
    a.bank.miss_cap = dbank_.miss_cap;
    a.bank.admit = static_cast<char*>(dbank_.admit) + r * dbank_.admit_region;
  }
}

void RuntimeImpl::CountStepRows(DecodeLayer& s) {
  // Rows each item attends, for the launch shape and the stats (the device recomputes them). A
  // device selection's split between resident and fetched rows is not known on the host: its
  // rows count as selected only.
  DecodeStepArgs& a = s.a;
  const int64_t window = config_.tiers.window_tokens;
  int64_t max_rows = 0;
  const ListRowsRule list_rule = DeviceListRowsRule(s.layer);
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t n = s.pos[b] + 1;
    a.max_len_hint = std::max(a.max_len_hint, n);
    const int64_t budget = StepBudget(a.budget_tokens, a.budget_fraction, a.budget_cap, n);
    if (step_.cpu_step) {  // counted by SelectOnHost
      max_rows = std::max(max_rows, std::min(budget, n));
      continue;
    }
    if (step_.host_lists) continue;  // counted by SelectOnHost, the hint set after it
    if (lists_.device_select) {
      const int64_t count = DeviceListRows(list_rule, n, budget);
      max_rows = std::max(max_rows, count);
      s.selected += count;
      s.offloaded += std::max<int64_t>(0, count - std::min<int64_t>(n, int64_t{a.sink} + a.window));
      if (!a.select_skip_ranking) s.key_bytes += selector_->KeyBytes(n, budget, s.layer);
      continue;
    }
    const StepRange r = SinksAndRecent(n, a.sink, budget);
    const int64_t res = r.sinks + (n - std::max(r.recent_begin, n - window));
    max_rows = std::max(max_rows, r.count);
    s.resident += res;
    s.fetched += r.count - res;
    s.selected += r.count;
  }
  a.max_rows_hint = max_rows;
}

Status RuntimeImpl::SelectLayer(DecodeLayer& s) {
  s.t1 = Clock::now();
  Status st = InputsToHost(s);
  // The shadow scan ranks the offloaded keys on the device, ahead of the host's Select. On CUDA the
  // CPU step enqueues it, and its own kernel after it, beside the Selects (SelectOnHost's
  // launch): those calls take the host tens of microseconds a layer.
  // The CPU part on the runtime's thread (RuntimeConfig::async_cpu): on CUDA only with device
  // tensors (host ones are read and written before Decode returns).
  const bool host_backend = device_->backend() == Backend::kHost;
  s.async_part = step_.cpu_step && cpu_.async &&
                 (host_backend || (!s.inputs_on_host && s.out.where == MemoryKind::kDevice));
  // (With the part on the runtime's thread the caller enqueues both right after the hand-over,
  // while the part's Selects start.)
  s.beside = step_.cpu_step && scan_.on && device_->backend() == Backend::kCuda;
  if (st.ok() && (step_.cpu_step || step_.host_lists) && scan_.on) {
    st = LaunchDeviceScan(s.slot_of, s.layer, s.pos, s.q_src, s.q.dtype, s.k_src, s.k.dtype,
                          s.stream, s.beside);
  }
  if (st.ok() && lists_.device_select) st = SelectOnDevice(s);
  if (st.ok() && step_.host_lists) {
    // The lists the step attends come from the host's Select (instead of the device's).
    const auto ts = Clock::now();
    Result<int64_t> most = UploadHostLists(s.slot_of, s.layer, s.pos, s.q_host, s.k_host, s.v_host,
                                           s.inputs_on_host, s.stream);
    Stage(stats_.ms_select, "select", ts);
    if (most.ok()) {
      s.a.max_rows_hint = most.value();
    } else {
      st = most.status();
    }
  }
  return st;
}

Status RuntimeImpl::InputsToHost(DecodeLayer& s) {
  Status st = Status::Ok();
  // A CPU-placed policy: q, k and v go to the host ahead of the step's kernels, so that the
  // host's selection runs while the device attends the resident rows.
  s.q_host = s.q;
  s.k_host = s.k;
  s.v_host = s.v;
  s.inputs_on_host = device_->backend() == Backend::kHost ||
                     (s.q.where == MemoryKind::kHost && s.k.where == MemoryKind::kHost &&
                      s.v.where == MemoryKind::kHost);
  if ((step_.cpu_step || step_.host_lists) && !s.inputs_on_host) {
    char* dst = static_cast<char*>(io_.q_raw_host);
    for (TensorView* t : {&s.q_host, &s.k_host, &s.v_host}) {
      const size_t bytes = static_cast<size_t>(t->numel()) * DTypeSize(t->dtype);
      if (t->where == MemoryKind::kDevice && st.ok()) {
        st = device_->CopyAsync(dst, t->data, bytes, s.stream);
        t->data = dst;
        t->where = MemoryKind::kHost;
      }
      dst += AlignUp(bytes, 64);
    }
    if (st.ok()) st = device_->RecordEvent(io_.q_ready, s.stream);
  } else if (step_.host_lists && st.ok()) {
    // Select reads the store rows that earlier work on the stream may still be writing (an Append
    // does not wait): the host waits for the stream's work up to here all the same.
    st = device_->RecordEvent(io_.q_ready, s.stream);
  }
  return st;
}

Status RuntimeImpl::SelectOnDevice(DecodeLayer& s) {
  const ModelShape& m = config_.model;
  const int layer = s.layer;
  DecodeStepArgs& a = s.a;
  // Runtime::TimeDeviceSelect: timing events around the launches (not while capturing).
  Status st = TimedLaunch(timing_.on && !s.capturing, timing_.select, layer, stats_.ms_select_device,
                          s.key_bytes * m.num_kv_heads, timing_.select_key_bytes, s.stream,
                          [&] { return selector_->Select(a, s.stream); });
  // Work the selection requested that runs beside the rest of the step (metadata rebuilds).
  if (st.ok()) st = selector_->AfterSelect(a, layer, s.stream);
  // Cross-layer sharing (xl+): the previous layer's list replaces this one's when the same
  // sequences selected there at the same length (this step's layer before). The selection kept
  // the inner policy's device metadata (page bounds, compact keys) what it would be without the
  // wrapper; it ranked only where that advances the policy's state (rebuilt masks, learned scores).
  if (st.ok() && s.xl_reuse) {
    const size_t batch_cap = static_cast<size_t>(config_.capacity.max_batch);
    const int64_t region = static_cast<int64_t>(batch_cap) * m.num_kv_heads;
    const int64_t items = s.batch * m.num_kv_heads;
    st = device_->CopyAsync(a.list, a.list - region * lists_.cap,
                            static_cast<size_t>(items * lists_.cap) * sizeof(int32_t), s.stream);
    if (st.ok()) {
      st = device_->CopyAsync(a.list_count, a.list_count - region,
                              static_cast<size_t>(items) * sizeof(int32_t), s.stream);
    }
  }
  lists_.slots[layer].assign(s.slot_of.begin(), s.slot_of.end());
  lists_.n[layer].resize(static_cast<size_t>(s.batch));
  for (int64_t b = 0; b < s.batch; ++b) lists_.n[layer][b] = s.pos[b] + 1;
  return st;
}

Status RuntimeImpl::ResolveLayer(DecodeLayer& s) {
  const int layers = config_.model.num_layers;
  const int layer = s.layer;
  DecodeStepArgs& a = s.a;
  Status st = Status::Ok();
  // The cross-layer prefetch (xl_.on). One in flight writes a stage region: this layer's
  // step comes after it, and reads its misses from the stage when it was this layer's.
  if (xl_.layer >= 0) {
    st = device_->WaitEvent(s.stream, xl_.done);
    s.staged = st.ok() && xl_.layer == layer && s.planned && s.xl_reuse && a.bank.rows != nullptr;
    if (st.ok()) xl_.layer = -1;
  }
  if (s.staged) a.bank.staged = 1;
  // The next layer takes this layer's list (xl+): its misses are known now, and are copied into
  // its stage beside this layer's step.
  bool prefetch_next = xl_.on && XlPrefetchWanted() && s.planned && a.bank.rows != nullptr &&
                       layer + 1 < layers && WindowOf(layer + 1) == 0 &&
                       policy_->device_reuses_previous_layer(layer + 1);
  // (XlReusesPrevious at the next layer: the same sequences, planned, at the same length.)
  for (int64_t b = 0; prefetch_next && b < s.batch; ++b) {
    prefetch_next = plan_.positions[static_cast<size_t>(b * layers + layer + 1)] == s.pos[b];
  }
  if (st.ok() && prefetch_next) {
    DecodeStepArgs nx = a;
    nx.layer = layer + 1;
    nx.bank.staged = 0;
    nx.bank.stage = dbank_.stage + static_cast<size_t>((layer + 1) % dbank_.regions) * dbank_.stage_region;
    st = device_->RecordEvent(xl_.fork, s.stream);
    if (st.ok()) st = device_->WaitEvent(dbank_.admit_stream, xl_.fork);
    if (st.ok()) st = device_->PrefetchListRows(nx, dbank_.admit_stream);
    if (st.ok()) st = device_->RecordEvent(xl_.done, dbank_.admit_stream);
    if (st.ok()) {
      xl_.layer = layer + 1;
      dbank_.side_layer = std::max(dbank_.side_layer, layer);
    }
  }
  return st;
}

Status RuntimeImpl::RouteLayer(DecodeLayer& s) {
  const ModelShape& m = config_.model;
  DecodeStepArgs& a = s.a;
  // The scheduler's split (route auto, a device selection without a bank; not in a graph, which
  // holds no host work, and on CUDA with device tensors only, as a CPU step's asynchronous part):
  // the CPU attends its share of the layer's misses on the runtime's thread while the device
  // attends the rest, and the stream merges the two (HandOverDecodeCpuPart).
  const int32_t split_q10 =
      split_.on && !s.capturing &&
              (device_->backend() == Backend::kHost ||
               (s.q.where == MemoryKind::kDevice && s.out.where == MemoryKind::kDevice))
          ? SplitShare(s.offloaded * m.num_kv_heads)
          : 0;
  if (split_q10 <= 0) return Status::Ok();
  // q down for the CPU's share, the split, then the event its part waits for.
  Status st = device_->CopyAsync(io_.q_raw_host, s.q_src,
                                 static_cast<size_t>(s.q.numel()) * DTypeSize(s.q.dtype), s.stream);
  const SplitListArgs sp{split_q10, split_.gpu_list, split_.gpu_count, split_.cpu_list, split_.cpu_count};
  if (st.ok()) st = device_->SplitStepList(a, sp, s.stream);
  if (st.ok()) st = device_->RecordEvent(split_.ready, s.stream);
  if (!st.ok()) return st;
  a.list = split_.gpu_list;
  a.list_count = split_.gpu_count;
  a.out = io_.o_gpu;
  a.out_dtype = DType::kF32;
  a.lse = io_.lse_gpu;
  TensorView q_down = s.q;
  q_down.data = io_.q_raw_host;
  q_down.where = MemoryKind::kHost;
  const int64_t hkv = m.num_kv_heads;
  stats_.rows_selected += s.selected * hkv;
  stats_.select_key_bytes += s.key_bytes * hkv;
  stats_.decode_split += 1;
  Stage(stats_.ms_attend_gpu, "attend_gpu", s.t1);
  split_.last_q10 = split_q10;
  s.handed_over = true;
  return HandOverDecodeCpuPart(a, false, s.layer, s.planned, true, q_down, s.k, s.v, s.out,
                               s.out_direct, s.stream, split_q10);
}

Status RuntimeImpl::AttendLayer(DecodeLayer& s) {
  const ModelShape& m = config_.model;
  DecodeStepArgs& a = s.a;
  Status st = Status::Ok();
  // The step rewrites its region's staging and miss lists: the admission that last read them
  // (layer - 2's) comes first.
  const bool admit_beside = a.bank.rows != nullptr && dbank_.regions > 1;
  if (admit_beside && dbank_.admit_pending[s.bank_region]) {
    st = device_->WaitEvent(s.stream, dbank_.admit_done[s.bank_region]);
    dbank_.admit_pending[s.bank_region] = false;
  }
  // Runtime::TimeDeviceSelect also times the step's attention where the device attends every
  // selected row (not a CPU step, whose device part is the resident rows; not host lists).
  if (st.ok() && !s.beside && !s.async_part) {
    st = TimedLaunch(timing_.on && !s.capturing && !step_.cpu_step && !step_.host_lists,
                     timing_.attend, s.layer, stats_.ms_attend_device,
                     s.selected * m.num_kv_heads * 2 * static_cast<int64_t>(dims_.row_bytes),
                     timing_.attend_bytes, s.stream, [&] { return device_->DecodeStep(a, s.stream); });
    if (st.ok() && s.staged) stats_.decode_prefetched += 1;
  }
  return st;
}

Status RuntimeImpl::AdmitLayer(DecodeLayer& s) {
  // The bank admits the layer's misses right after the step that read them: beside the next
  // layer's work on dbank_.admit_stream (two regions), else on the caller's stream.
  const DecodeStepArgs& a = s.a;
  if (a.bank.rows == nullptr) return Status::Ok();
  const bool admit_beside = dbank_.regions > 1;
  const auto ta = Clock::now();
  const int items = static_cast<int>(s.batch * config_.model.num_kv_heads);
  Status st = Status::Ok();
  if (admit_beside) {
    EventHandle fork = dbank_.admit_fork[s.bank_region];
    st = device_->RecordEvent(fork, s.stream);
    if (st.ok()) st = device_->WaitEvent(dbank_.admit_stream, fork);
    if (st.ok()) st = step_bank_->Admit(a.bank.admit, items, dbank_.admit_stream);
    if (st.ok()) st = device_->RecordEvent(dbank_.admit_done[s.bank_region], dbank_.admit_stream);
    if (st.ok()) {
      dbank_.admit_pending[s.bank_region] = true;
      dbank_.side_layer = std::max(dbank_.side_layer, s.layer);
    }
  } else {
    st = step_bank_->Admit(a.bank.admit, items, s.stream);
  }
  Stage(stats_.ms_admit, "admit", ta);
  return st;
}

Status RuntimeImpl::MergeLayer(DecodeLayer& s) {
  if (s.async_part) {
    Stage(stats_.ms_attend_gpu, "attend_gpu", s.t1);
    s.handed_over = true;
    return HandOverDecodeCpuPart(s.a, s.beside, s.layer, s.planned, s.inputs_on_host, s.q_host,
                                 s.k_host, s.v_host, s.out, s.out_direct, s.stream);
  }
  if (!step_.cpu_step) return Status::Ok();
  Stage(stats_.ms_attend_gpu, "attend_gpu", s.t1);
  Status st = RunCpuStepPart(s);
  const ModelShape& m = config_.model;
  const int64_t rows = s.batch * m.num_q_heads;
  const bool host = device_->backend() == Backend::kHost;
  const float* o_cpu = host ? io_.o_cpu_host : io_.o_cpu_dev;
  const float* lse_cpu = host ? io_.lse_cpu_host : io_.lse_cpu_dev;
  if (st.ok() && !host) {
    st = device_->CopyAsync(io_.o_cpu_dev, io_.o_cpu_host, static_cast<size_t>(rows) * m.head_dim * 4,
                            s.stream);
    if (st.ok()) st = device_->CopyAsync(io_.lse_cpu_dev, io_.lse_cpu_host, rows * 4, s.stream);
    if (st.ok()) st = device_->RecordEvent(cpu_.part_up, s.stream);
    stats_.bytes_h2d += rows * (m.head_dim + 1) * 4;
    stats_.bytes_d2h += static_cast<int64_t>(s.q.numel()) * static_cast<int64_t>(DTypeSize(s.q.dtype));
  }
  if (st.ok()) {
    const auto t3 = Clock::now();
    st = device_->MergeLse(io_.o_gpu, io_.lse_gpu, o_cpu, lse_cpu, rows, m.head_dim,
                           s.out_direct ? s.out.data : io_.out_stage, s.out.dtype, s.stream);
    Stage(stats_.ms_merge, "merge", t3);
  }
  return st;
}

Status RuntimeImpl::RunCpuStepPart(DecodeLayer& s) {
  const auto t2 = Clock::now();
  Status st = Status::Ok();
  if (!s.inputs_on_host) st = HostWaitEvent(io_.q_ready);
  // The pinned CPU part of the last step must have reached the device before it is rewritten
  // (it has, unless the caller switched streams).
  if (st.ok() && !device_->EventDone(cpu_.part_up)) st = HostWaitEvent(cpu_.part_up);
  // A policy failure rolls back below like any other (the window rewritten from the store).
  // The launch captures one pointer (no allocation on the step's path).
  struct Launch {
    RuntimeImpl* rt;
    const DecodeStepArgs* args;
    StreamHandle stream;
  } lc{this, &s.a, s.stream};
  std::function<Status()> launch;
  if (s.beside) {
    launch = [p = &lc] {
      TraceRecorder& tr = p->rt->trace_;
      const auto t0 = tr.on() ? TraceRecorder::Clock::now() : TraceRecorder::Clock::time_point{};
      Status r = p->rt->EnqueueDeviceScan();
      const auto t1 = tr.on() ? TraceRecorder::Clock::now() : TraceRecorder::Clock::time_point{};
      if (r.ok()) r = p->rt->device_->DecodeStep(*p->args, p->stream);
      if (tr.on()) {
        tr.Span("launch_scan", "launch", t0, t1);
        tr.Span("launch_step", "launch", t1, TraceRecorder::Clock::now());
      }
      return r;
    };
  }
  if (st.ok()) {
    st = SelectOnHost(s.slot_of, s.layer, s.pos, s.q_host, s.k_host, s.v_host, nullptr, nullptr,
                      s.beside ? &launch : nullptr);
  }
  Stage(stats_.ms_select, "select", t2);
  return st;
}

Status RuntimeImpl::FinishLayer(DecodeLayer& s) {
  const int layers = config_.model.num_layers;
  const TensorView& out = s.out;
  Status st = Status::Ok();
  if (!s.out_direct) {
    const size_t bytes = static_cast<size_t>(out.numel()) * DTypeSize(out.dtype);
    st = device_->CopyAsync(out.data, io_.out_stage, bytes, s.stream);
  }
  if (st.ok() && s.layer == layers - 1) st = JoinSelectorSide(s.stream);  // the step's side rebuilds
  if (st.ok() && s.layer == layers - 1) st = JoinAdmitSide(s.stream);  // and its admissions
  if (st.ok() && !s.capturing) st = device_->RecordEvent(call_done_, s.stream);
  // Host-memory outputs are complete when Decode returns.
  if (st.ok() && out.where == MemoryKind::kHost && device_->backend() == Backend::kCuda) {
    st = HostWaitStream(s.stream);
  }
  return st;
}

Status RuntimeImpl::FailLayer(const DecodeLayer& s, Status st) {
  UncommitLayer(s);
  const int layer = s.layer;
  // xl+ on the device: the next layer must not take this call's list (a runtime that never
  // made the call has the last step's here, of another length); nor the host wrapper its set.
  if (static_cast<size_t>(layer) < lists_.n.size()) lists_.n[layer].clear();
  for (int slot : s.slot_of) policy_->OnDecodeRolledBack(slot, layer);
  // DecodeStep may have appended the token to the ring before the failure: put the rows back
  // (not while capturing, where a failure ends the capture anyway).
  if (s.capturing) return st;
  Status restored = RestoreWindow(s.slot_of, layer, s.stream);
  // A step kernel that ran before the failure listed misses that no admission consumed: the
  // next layer's admission would read those list indices against its own list.
  if (restored.ok() && s.a.bank.rows != nullptr) restored = ClearBankMisses(s.stream);
  return WithRestore(std::move(st), restored);
}

void RuntimeImpl::CommitLayer(const DecodeLayer& s) {
  CommitDecodeStep(s.layer, s.planned);
  OpenXlGap(s.layer, s.stream, s.capturing);  // the engine's time to the next layer's Decode starts here
  const int64_t hkv = config_.model.num_kv_heads;
  if (!step_.cpu_step) Stage(stats_.ms_attend_gpu, "attend_gpu", s.t1);
  stats_.rows_resident += s.resident * hkv;
  stats_.rows_fetched += s.fetched * hkv;
  stats_.rows_selected += s.selected * hkv;
  stats_.select_key_bytes += s.key_bytes * hkv;
  // A device selection read through the device bank: its rows split into resident, bank hits and
  // misses on the device; Stats takes the resident share from the bank's counters.
  if (s.a.bank.rows != nullptr && lists_.device_select) {
    stats_aux_.bank_step_selected += s.selected * hkv;
  }
  stats_.bytes_h2d += s.fetched * hkv * 2 * static_cast<int64_t>(dims_.row_bytes);
}

void RuntimeImpl::CommitDecodeStep(int layer, bool planned) {
  const ModelShape& m = config_.model;
  const int64_t batch = static_cast<int64_t>(scratch_.batch_slots.size());
  if (planned) {
    plan_.layer_run[layer] = 1;
  } else {
    for (int slot : scratch_.batch_slots) ++lengths_[static_cast<size_t>(slot) * m.num_layers + layer];
  }
  stats_.bytes_d2h += batch * m.num_kv_heads * 2 * static_cast<int64_t>(dims_.row_bytes);  // write-through
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
  const int64_t batch = static_cast<int64_t>(scratch_.batch_slots.size());
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
  if (!host && cpu_.last_stream != nullptr && stream != cpu_.last_stream &&
      !device_->EventDone(cpu_.part_up)) {
    Status st = HostWaitEvent(cpu_.part_up);
    if (!st.ok()) return RollBackCpuPart(job, std::move(st));
  }
  // A deferred scan that only extends the device's shadow (no item takes its ranking, so no
  // Select waits for it) goes first: the part then never meets it. Failing, nothing is handed
  // over and the count is taken back as a failed Decode would.
  if (scan_deferred && !scan_.live) {
    scan_deferred = false;
    Status st = EnqueueDeviceScan();
    if (!st.ok()) return RollBackCpuPart(job, std::move(st));
  }
  if (!host) {  // (o, lse) up, q down
    stats_.bytes_h2d += rows * (m.head_dim + 1) * 4;
    stats_.bytes_d2h += rows * m.head_dim * static_cast<int64_t>(DTypeSize(q_host.dtype));
  }
  job.ticket = ++cpu_.ticket;
  HandOverCpuPart(job);
  // From here this thread touches only the device, its own events and the deferred shadow scan
  // (made to run beside the Selects: EnqueueDeviceScan). It enqueues the scan the part's Selects
  // wait for and the step over the resident rows while they start, then the stream's wait for
  // the part's ticket, the upload of its (o, lse) and their merge with the resident rows' part.
  cpu_.last_stream = stream;
  const float* o_cpu = host ? io_.o_cpu_host : io_.o_cpu_dev;
  const float* lse_cpu = host ? io_.lse_cpu_host : io_.lse_cpu_dev;
  const auto tl = trace_.on() ? TraceRecorder::Clock::now() : TraceRecorder::Clock::time_point{};
  Status st = scan_deferred ? EnqueueDeviceScan() : Status::Ok();
  if (st.ok()) st = device_->DecodeStep(a, stream);
  if (st.ok() && job.balance) {
    st = device_->RecordEvent(split_.step_done, stream);
    if (st.ok()) split_.recorded.store(job.ticket, std::memory_order_release);
  }
  if (trace_.on()) trace_.Span("launch_step", "launch", tl, TraceRecorder::Clock::now());
  if (st.ok()) st = device_->WaitHostValue(cpu_.word, job.ticket, stream);
  if (st.ok() && !host) {
    st = device_->CopyAsync(io_.o_cpu_dev, io_.o_cpu_host, static_cast<size_t>(rows) * m.head_dim * 4, stream);
    if (st.ok()) st = device_->CopyAsync(io_.lse_cpu_dev, io_.lse_cpu_host, rows * 4, stream);
    if (st.ok()) st = device_->RecordEvent(cpu_.part_up, stream);
  }
  if (st.ok()) {
    st = device_->MergeLse(io_.o_gpu, io_.lse_gpu, o_cpu, lse_cpu, rows, m.head_dim,
                           out_direct ? out.data : io_.out_stage, out.dtype, stream);
  }
  if (st.ok() && !out_direct) {
    st = device_->CopyAsync(out.data, io_.out_stage, static_cast<size_t>(out.numel()) * DTypeSize(out.dtype),
                            stream);
  }
  // A split step's policy may rebuild beside the step (on the selector's side stream): its last layer joins.
  if (st.ok() && layer == config_.model.num_layers - 1) st = JoinSelectorSide(stream);
  if (st.ok()) st = device_->RecordEvent(call_done_, stream);
  if (!st.ok()) {
    WaitCpuPart();
    cpu_.job_out = false;
    cpu_.job_status = Status::Ok();
    return RollBackCpuPart(cpu_.job, std::move(st));
  }
  // On the host backend the wait above returned with the part done: its status is this call's.
  return host ? CollectCpuPart() : Status::Ok();
}

int32_t RuntimeImpl::SplitShare(int64_t offloaded) const {
  if (config_.split_share >= 0.0) return static_cast<int32_t>(std::llround(config_.split_share * 1024.0));
  if (offloaded <= 0) return 0;
  const double frac = CpuFraction(cost_);  // both branches end together (runtime/scheduler.h)
  const double cpu_us = static_cast<double>(offloaded) * frac * 2.0 * static_cast<double>(dims_.row_bytes) /
                        (cost_.cpu_gbps * 1e3);
  if (cpu_us < config_.split_min_us) return 0;
  // The share the steps balanced (CUDA), else the model's.
  const int32_t balanced = split_.q10.load(std::memory_order_relaxed);
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
  int32_t* lists = lists_.stage + layer * layer_items * lists_.cap;
  int32_t* counts = lists_.stage + config_.model.num_layers * layer_items * lists_.cap +
                    layer * layer_items;
  KVF_RETURN_IF_ERROR(HostWaitEvent(io_.q_ready));
  // The layer's staging is rewritten only once its last upload (the step before) has run: it has,
  // unless the caller switched streams.
  EventHandle up = lists_.up[static_cast<size_t>(layer)];
  if (!device_->EventDone(up)) KVF_RETURN_IF_ERROR(HostWaitEvent(up));
  KVF_RETURN_IF_ERROR(SelectOnHost(slot_of, layer, positions, q, k, v, lists, counts));
  const size_t region = static_cast<size_t>(layer * layer_items);
  KVF_RETURN_IF_ERROR(device_->CopyAsync(lists_.positions + region * lists_.cap, lists,
                                         static_cast<size_t>(items * lists_.cap) * sizeof(int32_t),
                                         stream));
  KVF_RETURN_IF_ERROR(device_->CopyAsync(lists_.counts + region, counts,
                                         static_cast<size_t>(items) * sizeof(int32_t), stream));
  KVF_RETURN_IF_ERROR(device_->RecordEvent(up, stream));
  stats_.bytes_h2d += items * (lists_.cap + 1) * static_cast<int64_t>(sizeof(int32_t));
  if (!inputs_on_host) {
    stats_.bytes_d2h += static_cast<int64_t>(q.numel()) * static_cast<int64_t>(DTypeSize(q.dtype));
  }
  return *std::max_element(counts, counts + items);
}

Status RuntimeImpl::ClearBankMisses(StreamHandle stream) {
  KVF_RETURN_IF_ERROR(JoinAdmitSide(stream));  // admissions in flight consume their own lists
  const size_t bytes = dbank_.miss_region * static_cast<size_t>(dbank_.regions);
  const std::vector<int32_t> zeros(bytes / sizeof(int32_t), 0);
  KVF_RETURN_IF_ERROR(device_->CopyAsync(dbank_.miss, zeros.data(), bytes, stream));
  return device_->SynchronizeStream(stream);
}

Status RuntimeImpl::JoinAdmitSide(StreamHandle stream) {
  if (dbank_.side_layer < 0) return Status::Ok();
  KVF_RETURN_IF_ERROR(device_->RecordEvent(dbank_.admit_join, dbank_.admit_stream));
  KVF_RETURN_IF_ERROR(device_->WaitEvent(stream, dbank_.admit_join));
  dbank_.admit_pending[0] = dbank_.admit_pending[1] = false;
  dbank_.side_layer = -1;
  xl_.layer = -1;  // a prefetch in flight ran on the same stream
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
  const StoreTable view = store_->device_store();
  return selector_->OnStored(slot, layer, pos0, new_len, view, stream);
}

SelectorShape RuntimeImpl::SelectorShapeOf() const {
  return {.model = config_.model,
          .max_sequences = config_.capacity.max_sequences,
          .max_tokens = config_.capacity.max_tokens_per_sequence,
          .item_cap = dims_.item_cap,
          .group = dims_.group,
          .scale = dims_.scale,
          .kv_elem = dims_.kv_elem,
          .row_bytes = dims_.row_bytes,
          .sink = config_.tiers.sink_tokens,
          .window = config_.tiers.window_tokens,
          .cuda = device_->backend() == Backend::kCuda};
}

Status RuntimeImpl::RestoreWindow(std::span<const int> slots, int layer, StreamHandle stream) {
  if (WindowOf(layer) > 0) return Status::Ok();  // a sliding-window layer keeps no host copy
  const ModelShape& m = config_.model;
  const int sink = config_.tiers.sink_tokens, window = config_.tiers.window_tokens;
  KVF_RETURN_IF_ERROR(HostWaitStream(stream));
  KVF_RETURN_IF_ERROR(device_->SynchronizeEvent(call_done_));
  // At most dims_.max_rows * hkv * 2 descriptors fit in desc_.k_copies; a ring holds window rows per head,
  // so copy in rounds.
  const int64_t cap = dims_.max_rows * m.num_kv_heads * 2;
  int64_t c = 0;
  auto flush = [&]() -> Status {
    if (c == 0) return Status::Ok();
    KVF_RETURN_IF_ERROR(device_->CopyRows(desc_.k_copies, c, m.head_dim, m.kv_dtype, m.kv_dtype, stream));
    KVF_RETURN_IF_ERROR(device_->CopyRows(desc_.v_copies, c, m.head_dim, m.kv_dtype, m.kv_dtype, stream));
    c = 0;
    return HostWaitStream(stream);
  };
  for (int slot : slots) {
    const int64_t n = lengths_[static_cast<size_t>(slot) * m.num_layers + layer];
    for (int64_t pos = std::max<int64_t>(sink, n - window); pos < n; ++pos) {
      const int64_t row = ResidentRowOf(pos, n, sink, window);
      for (int h = 0; h < m.num_kv_heads; ++h) {
        if (c == cap) KVF_RETURN_IF_ERROR(flush());
        desc_.k_copies[c] = RowCopy{ResidentK(slot, layer, h, row), store_->k_row(slot, layer, h, pos)};
        desc_.v_copies[c++] = RowCopy{ResidentV(slot, layer, h, row), store_->v_row(slot, layer, h, pos)};
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
  if (static_cast<size_t>(layer) < lists_.n.size()) lists_.n[layer].clear();  // as in RunDecodeStep
  return WithRestore(std::move(failure), RestoreWindow(slot_of, layer, stream));
}

}  // namespace kvferry::detail
