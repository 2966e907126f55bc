// Copyright kvferry authors. Apache-2.0.
// The runtime: validation, sequence slots, and the prefill and decode steps of docs/design.md.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <limits>
#include <mutex>
#include <numeric>

#include "cpu/attention.h"
#include "offload/transfer.h"
#include "policies/basic.h"
#include "base/check.h"
#include "base/offload_split.h"
#include "runtime/runtime_impl.h"

namespace kvferry {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

bool SupportedActivation(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
}

Status ValidateConfig(const RuntimeConfig& c) {
  const ModelShape& m = c.model;
  KVF_CHECK_ARG(m.num_layers >= 1, "num_layers ", m.num_layers, " must be >= 1");
  KVF_CHECK_ARG(m.num_kv_heads >= 1, "num_kv_heads ", m.num_kv_heads, " must be >= 1");
  KVF_CHECK_ARG(m.num_q_heads >= m.num_kv_heads && m.num_q_heads % m.num_kv_heads == 0,
                "num_q_heads ", m.num_q_heads, " must be a positive multiple of num_kv_heads ",
                m.num_kv_heads);
  KVF_CHECK_ARG(m.head_dim >= 8 && m.head_dim <= 256 && m.head_dim % 8 == 0, "head_dim ",
                m.head_dim, " unsupported (64, 128, 256; or a multiple of 8 up to 256 on host)");
  KVF_CHECK_ARG(m.kv_dtype == DType::kBF16 || m.kv_dtype == DType::kF16, "kv_dtype ",
                DTypeName(m.kv_dtype), " unsupported (bf16 or f16)");
  KVF_CHECK_ARG(std::isfinite(m.softmax_scale) && m.softmax_scale >= 0.0f, "softmax_scale ",
                m.softmax_scale, " must be finite and >= 0");
  const Capacity& cap = c.capacity;
  KVF_CHECK_ARG(cap.max_sequences >= 1, "max_sequences ", cap.max_sequences, " must be >= 1");
  KVF_CHECK_ARG(cap.max_tokens_per_sequence >= 1 && cap.max_tokens_per_sequence <= (int64_t{1} << 30),
                "max_tokens_per_sequence ", cap.max_tokens_per_sequence, " out of range [1, 2^30]");
  KVF_CHECK_ARG(cap.max_batch >= 1 && cap.max_batch <= cap.max_sequences, "max_batch ",
                cap.max_batch, " out of range [1, max_sequences=", cap.max_sequences, "]");
  KVF_CHECK_ARG(cap.max_prefill_chunk >= 1, "max_prefill_chunk ", cap.max_prefill_chunk,
                " must be >= 1");
  KVF_CHECK_ARG(cap.max_host_bytes >= 0, "max_host_bytes ", cap.max_host_bytes, " must be >= 0");
  KVF_CHECK_ARG(cap.host_bytes_at_create >= 0 &&
                    (cap.max_host_bytes == 0 || cap.host_bytes_at_create <= cap.max_host_bytes),
                "host_bytes_at_create ", cap.host_bytes_at_create,
                " must be in [0, max_host_bytes=", cap.max_host_bytes, "] (0: no cap)");
  // Per-layer attention types: empty, or one window per layer (0: global).
  KVF_CHECK_ARG(m.layer_window.empty() ||
                    static_cast<int64_t>(m.layer_window.size()) == m.num_layers,
                "layer_window has ", m.layer_window.size(), " entries; expected num_layers=",
                m.num_layers, " (0: global, w > 0: sliding window of w tokens) or none (all global)");
  for (size_t l = 0; l < m.layer_window.size(); ++l) {
    const int w = m.layer_window[l];
    KVF_CHECK_ARG(w >= 0, "layer_window[", l, "] = ", w,
                  " must be >= 0 (0: global, w > 0: sliding window of w tokens)");
    KVF_CHECK_ARG(w <= cap.max_tokens_per_sequence, "layer_window[", l, "] = ", w,
                  " exceeds max_tokens_per_sequence ", cap.max_tokens_per_sequence,
                  " (a window that wide is the whole sequence: make the layer global, 0)");
  }
  const Tiers& t = c.tiers;
  // Positions stay below 2^30 (max_tokens_per_sequence), so no tier needs more rows. Larger counts
  // used to reach the tier's arithmetic, where sink + window overflowed int; the sum (up to 2^31)
  // is taken in 64 bits everywhere now.
  KVF_CHECK_ARG(t.sink_tokens >= 0 && t.sink_tokens <= (1 << 30), "sink_tokens ", t.sink_tokens,
                " out of range [0, 2^30]");
  KVF_CHECK_ARG(t.window_tokens >= 1 && t.window_tokens <= (1 << 30), "window_tokens ",
                t.window_tokens, " out of range [1, 2^30] (the new token is always resident)");
  KVF_CHECK_ARG(cap.gpu_bytes >= 0, "gpu_bytes ", cap.gpu_bytes, " must be >= 0 (0: no cap)");
  KVF_CHECK_ARG(t.bank_slots >= -1 && t.bank_slots <= 65534, "bank_slots ", t.bank_slots,
                " out of range [-1, 65534] (0: no bank, -1: the largest that fits gpu_bytes)");
  KVF_CHECK_ARG(t.bank_slots != -1 || cap.gpu_bytes > 0,
                "bank_slots -1 (the largest bank that fits) needs capacity.gpu_bytes > 0");
  KVF_CHECK_ARG(t.bank_map == "vector" || t.bank_map == "hash", "bank_map '", t.bank_map,
                "' unknown (vector or hash)");
  const PolicyConfig& p = c.policy;
  if (p.name != "dense") {
    KVF_CHECK_ARG(p.budget_tokens >= 0, "budget_tokens ", p.budget_tokens, " must be >= 0");
    KVF_CHECK_ARG(p.budget_tokens > 0 || p.budget_fraction > 0.0, "policy '", p.name,
                  "' needs a budget: budget_tokens 0 and budget_fraction 0 (set budget_tokens "
                  ">= 1 or budget_fraction in (0, 1])");
    KVF_CHECK_ARG(p.budget_fraction >= 0.0 && p.budget_fraction <= 1.0, "budget_fraction ",
                  p.budget_fraction, " out of range [0, 1]");
  }
  KVF_CHECK_ARG(c.cpu_threads >= 0, "cpu_threads ", c.cpu_threads, " must be >= 0");
  KVF_CHECK_ARG(c.xl_prefetch >= -1 && c.xl_prefetch <= 1, "xl_prefetch ", c.xl_prefetch,
                " must be -1 (auto), 0 (off) or 1 (on)");
  KVF_CHECK_ARG(c.xl_prefetch_gap_us >= 0.0 && c.xl_prefetch_gap_us <= 1e9, "xl_prefetch_gap_us ",
                c.xl_prefetch_gap_us, " out of range [0, 1e9] (microseconds)");
  KVF_CHECK_ARG(c.split_share == -1.0 || (c.split_share >= 0.0 && c.split_share <= 1.0),
                "split_share ", c.split_share, " must be -1 (the cost model's) or in [0, 1]");
  KVF_CHECK_ARG(c.split_min_us >= 0.0 && c.split_min_us <= 1e9, "split_min_us ", c.split_min_us,
                " out of range [0, 1e9] (microseconds)");
  KVF_CHECK_ARG(c.cpu_spin_us >= 0 && c.cpu_spin_us <= 1000000, "cpu_spin_us ", c.cpu_spin_us,
                " out of range [0, 1000000] (microseconds)");
  return Status::Ok();
}

}  // namespace

namespace {
thread_local const DeviceDecorator* current_decorator = nullptr;
}  // namespace

ScopedDeviceDecorator::ScopedDeviceDecorator(DeviceDecorator decorator)
    : decorator_(std::move(decorator)), previous_(current_decorator) {
  current_decorator = &decorator_;
}
ScopedDeviceDecorator::~ScopedDeviceDecorator() { current_decorator = previous_; }
const DeviceDecorator* ScopedDeviceDecorator::Current() { return current_decorator; }

Result<std::unique_ptr<RuntimeImpl>> RuntimeImpl::Create(const RuntimeConfig& config) {
  KVF_RETURN_IF_ERROR(ValidateConfig(config));
  std::unique_ptr<RuntimeImpl> impl(new RuntimeImpl(config));
  KVF_RETURN_IF_ERROR(impl->Init());
  return impl;
}

RuntimeImpl::~RuntimeImpl() {
  StopCpuThread();  // an outstanding CPU part ends first: the device may be waiting for it
  if (device_ == nullptr) return;
  device_->SynchronizeStream(stream_).IgnoreError();
  if (call_done_ != nullptr) device_->DestroyEvent(call_done_);
  for (EventHandle e : step_.plan_events) device_->DestroyEvent(e);
  for (EventHandle e : lists_.up) {
    if (e != nullptr) device_->DestroyEvent(e);
  }
  DestroyTimings();
  for (EventHandle e : {io_.q_ready, cpu_.part_up, scan_.ready, prefill_.items_done[0],
                        prefill_.items_done[1]}) {
    if (e != nullptr) device_->DestroyEvent(e);
  }
  if (dbank_.admit_stream != nullptr) {  // admissions write the bank: done before it goes
    device_->SynchronizeStream(dbank_.admit_stream).IgnoreError();
    for (EventHandle e : {dbank_.admit_fork[0], dbank_.admit_fork[1], dbank_.admit_done[0], dbank_.admit_done[1], dbank_.admit_join}) {
      device_->DestroyEvent(e);
    }
    for (EventHandle e : {xl_.fork, xl_.done}) {
      if (e != nullptr) device_->DestroyEvent(e);
    }
    device_->DestroyStream(dbank_.admit_stream);
  }
  step_bank_.reset();
  if (selector_ != nullptr) selector_->Release();  // its side stream, before the buffers go
  if (prefill_.copy_stream != nullptr) {
    device_->SynchronizeStream(prefill_.copy_stream).IgnoreError();
    device_->DestroyEvent(prefill_.fork);
    for (EventHandle e : prefill_.segment_done) device_->DestroyEvent(e);
    for (EventHandle e : {prefill_.next_ready, prefill_.call_start}) {
      if (e != nullptr) device_->DestroyEvent(e);
    }
    device_->DestroyStream(prefill_.copy_stream);
  }
  if (prefill_.write_stream != nullptr) {
    device_->SynchronizeStream(prefill_.write_stream).IgnoreError();
    device_->DestroyEvent(prefill_.write_ready);
    device_->DestroyEvent(prefill_.write_done);
    device_->DestroyStream(prefill_.write_stream);
  }
  if (bank_ != nullptr) {
    device_->SynchronizeStream(side_stream_).IgnoreError();
    bank_.reset();
    device_->DestroyEvent(bank_step_done_);
    device_->DestroyStream(side_stream_);
  }
  store_.reset();
  for (const DeviceBuffer& b : buffers_) {
    if (b.host) {
      device_->FreeHost(b.ptr);
    } else {
      device_->FreeDevice(b.ptr);
    }
  }
}

Result<void*> RuntimeImpl::Alloc(size_t bytes, bool host) {
  bytes = AllocBytes(bytes);
  Result<void*> r = host ? device_->AllocHost(bytes) : device_->AllocDevice(bytes);
  if (!r.ok()) return r.status();
  buffers_.push_back(DeviceBuffer{r.value(), bytes, host});
  return r.value();
}

Status RuntimeImpl::Init() {
  const ModelShape& m = config_.model;
  KVF_RETURN_IF_ERROR(CreateDevice());
  KVF_ASSIGN_OR_RETURN(policy_, MakePolicy(config_));
  cpu::CpuPoolOptions pool_options;
  pool_options.threads = config_.cpu_threads;
  pool_options.gpu_pci_bus_id = device_->pci_bus_id();
  KVF_ASSIGN_OR_RETURN(pool_, cpu::CpuPool::Create(pool_options));

  DeriveDims();
  const Capacity& cap = config_.capacity;
  // The policy's device selection state, sized below where the planned step selects on the device.
  selector_ = policy_->MakeDeviceSelector(SelectorShapeOf());

  InitWindowLayout();  // sliding-window layers (runtime/window.cpp)
  // Every device buffer's size, once (runtime/device_memory.cpp): the plan the cap is checked
  // against here, before anything large is allocated, and the sizes allocated below.
  const bool auto_bank = config_.tiers.bank_slots == -1;
  if (auto_bank) {
    KVF_ASSIGN_OR_RETURN(config_.tiers.bank_slots, ChooseBankSlots());
  }
  KVF_RETURN_IF_ERROR(SizeDeviceBuffers(config_.tiers.bank_slots, sizes_));
  device_plan_ = sizes_.Plan(cap.gpu_bytes);
  KVF_RETURN_IF_ERROR(CheckDeviceCap(device_plan_, auto_bank));

  store_ = std::make_unique<HostStore>(device_.get(), StoreShape());
  KVF_RETURN_IF_ERROR(store_->Init());
  KVF_RETURN_IF_ERROR(store_->Prepin(cap.host_bytes_at_create));

  KVF_RETURN_IF_ERROR(InitCallBuffers());
  KVF_RETURN_IF_ERROR(InitWindowBuffers());
  KVF_RETURN_IF_ERROR(InitBanks());
  const int64_t hkv = m.num_kv_heads;
  const size_t items = static_cast<size_t>(std::max<int64_t>(cap.max_batch, 1) * hkv);
  scratch_.offloaded.resize(items);
  scratch_.misses.resize(items);
  for (auto& v : scratch_.offloaded) v.reserve(static_cast<size_t>(dims_.item_cap));
  for (auto& v : scratch_.misses) v.reserve(static_cast<size_t>(dims_.item_cap));
  if (device_->backend() == Backend::kCuda) KVF_RETURN_IF_ERROR(InitPrefillStaging());
  // Priming on the device (sizes and the choice: SizeDeviceBuffers).
  if (sizes_.prime_rows > 0) KVF_RETURN_IF_ERROR(InitPrimeBuffers());
  KVF_RETURN_IF_ERROR(InitDeviceScan());
  InitDeferredPrime();
  // Off by default: on the GPU machine (a host-selecting policy at 2%, three runs each) 500 us of spinning
  // started the last of a layer's 8 items 25 us after the first instead of 67-82 us and took 32K
  // from 19.4 to 17.2 ms a step, but 64K from 29.1 to 30.8 ms (its longer items ran slower beside
  // the spinners). With the scan on the GPU the items wait for its ranking anyway,
  // and spinning slowed the launches beside them (43 -> 45-72 us a layer): 32K 13.7-15.0 ms
  // (spinning twice the last gap between layers) and 12.6-14.4 (300 us) against 11.9-13.3 without.
  // Off by default (RuntimeConfig::cpu_spin_us).
  pool_warm_us_ = config_.cpu_spin_us;
  KVF_RETURN_IF_ERROR(InitStepBuffers());
  // The cap again, against the device's own count of what it holds now: a buffer allocated
  // outside the plan would show here (the tests hold the count equal to the plan's total).
  const int64_t held = device_->device_bytes_held();
  KVF_CHECK_CODE(cap.gpu_bytes == 0 || held <= cap.gpu_bytes, StatusCode::kResourceExhausted,
                 "capacity.gpu_bytes ", cap.gpu_bytes, " exceeded: the device holds ", held,
                 " bytes after Create's allocations, planned ", device_plan_.ToString());
  if (config_.probe_at_start) KVF_RETURN_IF_ERROR(ProbeCosts());
  scratch_.selections.resize(items);
  for (auto& s : scratch_.selections) s.reserve(static_cast<size_t>(dims_.item_cap));
  last_selection_.resize(static_cast<size_t>(cap.max_sequences) * m.num_layers * hkv);
  scratch_.item_status.resize(items);
  lengths_.assign(static_cast<size_t>(cap.max_sequences) * m.num_layers, 0);
  for (int s = cap.max_sequences - 1; s >= 0; --s) free_slots_.push_back(s);
  return Status::Ok();
}

void RuntimeImpl::DeriveDims() {
  const ModelShape& m = config_.model;
  const Capacity& cap = config_.capacity;
  dims_.group = m.num_q_heads / m.num_kv_heads;
  dims_.scale = m.softmax_scale > 0.0f ? m.softmax_scale : 1.0f / std::sqrt(static_cast<float>(m.head_dim));
  dims_.kv_elem = DTypeSize(m.kv_dtype);
  dims_.row_bytes = static_cast<size_t>(m.head_dim) * dims_.kv_elem;
  dims_.max_rows = std::max<int64_t>(cap.max_prefill_chunk, cap.max_batch);
  if (!policy_->is_dense()) {
    // Room for the resident rows on top of the budget: a policy that always attends the sinks
    // and the window (a host selection's) may return more than a budget smaller than they are.
    dims_.budget_max = ItemBudgetMax(config_);
    dims_.item_cap = ItemListCap(config_);
  }
}

void RuntimeImpl::InitDeferredPrime() {
  const ModelShape& m = config_.model;
  // Priming deferred to the first Decode (DeferPrime): the kept rows are pinned per slot, made at
  // the slot's first primed prefill.
  if (policy_->prime_rows() > 0 && (prime_.rows > 0 || policy_->wants_prefill_queries())) {
    prime_.pending_rows = static_cast<int>(
        std::min<int64_t>(policy_->prime_rows(), config_.capacity.max_prefill_chunk));
    prime_.pending.assign(static_cast<size_t>(config_.capacity.max_sequences) * m.num_layers, {});
    prime_.pending_q.assign(static_cast<size_t>(config_.capacity.max_sequences), nullptr);
    prime_.eager = config_.paths.prime_eager;
  }
}

Status RuntimeImpl::CreateDevice() {
  const ModelShape& m = config_.model;
  switch (config_.backend) {
    case Backend::kHost: device_ = MakeHostDevice(); break;
    case Backend::kCuda: {
      KVF_ASSIGN_OR_RETURN(device_, MakeCudaDevice(config_.device_id));
      break;
    }
    case Backend::kAuto: {
      // The CUDA kernels cover head_dim 64/128/256; other shapes (tiny test models) stay on host.
      const bool cuda_shape = m.head_dim == 64 || m.head_dim == 128 || m.head_dim == 256;
      if (cuda_shape && CudaAvailable()) {
        Result<std::unique_ptr<Device>> cuda = MakeCudaDevice(config_.device_id);
        if (cuda.ok()) device_ = std::move(cuda).value();
      }
      if (device_ == nullptr) device_ = MakeHostDevice();
      break;
    }
  }
  if (const DeviceDecorator* decorate = ScopedDeviceDecorator::Current()) {
    device_ = (*decorate)(std::move(device_));
    KVF_CHECK_CODE(device_ != nullptr, StatusCode::kInternal, "device decorator returned null");
  }
  stream_ = device_->default_stream();
  return Status::Ok();
}

Status RuntimeImpl::InitCallBuffers() {
  const ModelShape& m = config_.model;
  const Capacity& cap = config_.capacity;
  const DeviceBufferSizes& z = sizes_;
  const int64_t hq = m.num_q_heads, hkv = m.num_kv_heads;
  KVF_ASSIGN_OR_RETURN(void* resident, Alloc(z.resident, false));
  resident_ = static_cast<char*>(resident);

  const size_t act_q = static_cast<size_t>(dims_.max_rows * hq * m.head_dim);
  KVF_ASSIGN_OR_RETURN(io_.q_in, Alloc(z.q_in, false));
  KVF_ASSIGN_OR_RETURN(io_.k_in, Alloc(z.k_in, false));
  KVF_ASSIGN_OR_RETURN(io_.v_in, Alloc(z.v_in, false));
  KVF_ASSIGN_OR_RETURN(io_.out_stage, Alloc(z.out_stage, false));
  KVF_ASSIGN_OR_RETURN(io_.q_f32, AllocAs<float>(z.q_f32, false));
  KVF_ASSIGN_OR_RETURN(io_.o_gpu, AllocAs<float>(z.o_gpu, false));
  KVF_ASSIGN_OR_RETURN(io_.lse_gpu, AllocAs<float>(z.lse_gpu, false));
  const size_t batch_q = static_cast<size_t>(cap.max_batch * hq * m.head_dim);
  KVF_ASSIGN_OR_RETURN(io_.o_cpu_dev, AllocAs<float>(z.o_cpu, false));
  KVF_ASSIGN_OR_RETURN(io_.lse_cpu_dev, AllocAs<float>(z.lse_cpu, false));

  KVF_ASSIGN_OR_RETURN(io_.q_host, AllocAs<float>(act_q * 4, true));
  KVF_ASSIGN_OR_RETURN(io_.o_cpu_host, AllocAs<float>(batch_q * 4, true));
  KVF_ASSIGN_OR_RETURN(io_.lse_cpu_host, AllocAs<float>(static_cast<size_t>(cap.max_batch * hq) * 4, true));
  const size_t rows = static_cast<size_t>(dims_.max_rows);
  KVF_ASSIGN_OR_RETURN(desc_.k_copies, AllocAs<RowCopy>(rows * hkv * 2 * sizeof(RowCopy), true));
  KVF_ASSIGN_OR_RETURN(desc_.v_copies, AllocAs<RowCopy>(rows * hkv * 2 * sizeof(RowCopy), true));
  KVF_ASSIGN_OR_RETURN(desc_.q_copies, AllocAs<RowCopy>(rows * hq * sizeof(RowCopy), true));
  KVF_ASSIGN_OR_RETURN(desc_.o_copies, AllocAs<RowCopy>(rows * hkv * sizeof(RowCopy), true));
  KVF_ASSIGN_OR_RETURN(call_done_, device_->CreateEvent());
  const size_t items = static_cast<size_t>(std::max<int64_t>(cap.max_batch, 1) * hkv);
  KVF_ASSIGN_OR_RETURN(desc_.gpu_items, AllocAs<RowAttnItem>(items * sizeof(RowAttnItem), true));
  KVF_ASSIGN_OR_RETURN(desc_.cpu_items, AllocAs<RowAttnItem>(items * sizeof(RowAttnItem), true));
  KVF_ASSIGN_OR_RETURN(desc_.paged_items,
                       AllocAs<PagedAttnItem>(std::max<size_t>(items, hkv) * sizeof(PagedAttnItem), true));
  const size_t row_ptrs = items * static_cast<size_t>(std::max<int64_t>(dims_.item_cap, 1));
  for (const void*** dst :
       {&desc_.gpu_k_rows, &desc_.gpu_v_rows, &desc_.cpu_k_rows, &desc_.cpu_v_rows}) {
    KVF_ASSIGN_OR_RETURN(*dst, AllocAs<const void*>(row_ptrs * sizeof(void*), true));
  }
  return Status::Ok();
}

Status RuntimeImpl::InitBanks() {
  const DeviceBufferSizes& z = sizes_;
  // Which bank (SizeDeviceBuffers says why): the device bank read by the planned step, the
  // host-managed one, or none.
  step_.host_lists = z.host_lists;
  if (z.device_bank) {
    KVF_ASSIGN_OR_RETURN(step_bank_,
                         device_->CreateStepBank(StepBankConfigFor(config_.tiers.bank_slots)));
  } else if (z.host_bank) {
    KVF_ASSIGN_OR_RETURN(
        bank_, TokenBank::Create(device_.get(), TokenBankConfigFor(config_.tiers.bank_slots)));
    KVF_ASSIGN_OR_RETURN(side_stream_, device_->CreateStream());
    KVF_ASSIGN_OR_RETURN(bank_step_done_, device_->CreateEvent());
  }
  return Status::Ok();
}

Status RuntimeImpl::InitPrefillStaging() {
  const DeviceBufferSizes& z = sizes_;
  const int64_t hkv = config_.model.num_kv_heads;
  // Prefill staging: one layer's pages of one sequence in device memory, and their page table.
  prefill_.max_pages = z.max_pages;
  KVF_ASSIGN_OR_RETURN(prefill_.scratch, AllocAs<char>(z.prefill_scratch, false));
  KVF_ASSIGN_OR_RETURN(prefill_.pages_host, AllocAs<void*>(static_cast<size_t>(hkv * prefill_.max_pages) * sizeof(void*), true));
  KVF_ASSIGN_OR_RETURN(prefill_.pages_dev, AllocAs<void*>(z.prefill_pages, false));
  prefill_.page_copy_dst.reserve(static_cast<size_t>(hkv * prefill_.max_pages));
  prefill_.page_copy_src.reserve(static_cast<size_t>(hkv * prefill_.max_pages));
  prefill_.page_copy_bytes.reserve(static_cast<size_t>(hkv * prefill_.max_pages));
  if (z.prefill_prefetch) {
    KVF_ASSIGN_OR_RETURN(prefill_.next, AllocAs<char>(z.prefill_next, false));
    KVF_ASSIGN_OR_RETURN(prefill_.next_pages_dev, AllocAs<void*>(z.prefill_next_pages, false));
    KVF_ASSIGN_OR_RETURN(prefill_.next_ready, device_->CreateEvent());
    KVF_ASSIGN_OR_RETURN(prefill_.call_start, device_->CreateEvent());
  }
  // Each staging's page table maps head h's page p to its fixed place in it (the kernels that
  // read a staging through a page table: priming, the CUDA-core prefill).
  const int64_t page_bytes = store_->page_bytes();
  for (auto [table, staging] : {std::pair{prefill_.pages_dev, prefill_.scratch},
                                std::pair{prefill_.next_pages_dev, prefill_.next}}) {
    if (table == nullptr) continue;
    for (int64_t i = 0; i < hkv * prefill_.max_pages; ++i) prefill_.pages_host[i] = staging + i * page_bytes;
    KVF_RETURN_IF_ERROR(device_->CopyAsync(table, prefill_.pages_host,
                                           static_cast<size_t>(hkv * prefill_.max_pages) * sizeof(void*),
                                           stream_));
    KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
  }
  if (!z.prefill_tensor_cores) return Status::Ok();
  prefill_.items_bytes = static_cast<size_t>((1 + kPrefillMaxSegments) * hkv) * kPrefillItemBytes;
  KVF_ASSIGN_OR_RETURN(prefill_.items, Alloc(2 * prefill_.items_bytes, true));
  for (EventHandle& e : prefill_.items_done) {
    KVF_ASSIGN_OR_RETURN(e, device_->CreateEvent());
  }
  if (z.prefill_copy_stream) {
    KVF_ASSIGN_OR_RETURN(prefill_.copy_stream, device_->CreateStream());
    KVF_ASSIGN_OR_RETURN(prefill_.fork, device_->CreateEvent());
    prefill_.segment_done.assign(kPrefillMaxSegments, nullptr);
    for (EventHandle& e : prefill_.segment_done) {
      KVF_ASSIGN_OR_RETURN(e, device_->CreateEvent());
    }
    prefill_.copy_scratch.assign(
        PrefillCopyScratchBytes(hkv, store_->max_pages()) / sizeof(void*), nullptr);
  }
  if (z.prefill_write_stream) {
    KVF_ASSIGN_OR_RETURN(prefill_.write_stream, device_->CreateStream());
    KVF_ASSIGN_OR_RETURN(prefill_.write_ready, device_->CreateEvent());
    KVF_ASSIGN_OR_RETURN(prefill_.write_done, device_->CreateEvent());
    prefill_.write_scratch.assign(
        2 * PrefillCopyScratchBytes(hkv, store_->max_pages()) / sizeof(void*), nullptr);
  }
  return Status::Ok();
}

Status RuntimeImpl::InitPrimeBuffers() {
  const DeviceBufferSizes& z = sizes_;
  prime_.rows = z.prime_rows;
  prime_.table_stride = z.prime_table_stride;
  KVF_ASSIGN_OR_RETURN(prime_.tables_dev, AllocAs<float>(z.prime_tables, false));
  KVF_ASSIGN_OR_RETURN(prime_.tables_host, AllocAs<float>(z.prime_tables, true));
  KVF_ASSIGN_OR_RETURN(prime_.stats_dev, AllocAs<double>(z.prime_stats, false));
  KVF_ASSIGN_OR_RETURN(prime_.stats_host, AllocAs<double>(z.prime_stats, true));
  if (z.prime_scratch > 0) {
    prime_.scratch_bytes = z.prime_scratch;
    KVF_ASSIGN_OR_RETURN(prime_.scratch, Alloc(prime_.scratch_bytes, false));
    // The tensor-core prefill stages pages at fixed places; the priming kernel reads them
    // through the staging's page table (InitPrefillStaging).
  }
  return Status::Ok();
}

Status RuntimeImpl::InitDeviceScan() {
  const ModelShape& m = config_.model;
  const Capacity& cap = config_.capacity;
  const DeviceBufferSizes& z = sizes_;  // DropScan below clears z.device_scan
  const int64_t hkv = m.num_kv_heads;
  // The shadow scan on the device (sizes and the choice: SizeDeviceBuffers). A GPU that cannot hold
  // its shadow now (other work on it) leaves it out: the policy scans on the host.
  if (z.device_scan) {
    Result<void*> shadow = Alloc(z.scan_shadow, false);
    if (!shadow.ok()) {
      sizes_.DropScan();
      device_plan_ = sizes_.Plan(cap.gpu_bytes);
    } else {
      scan_.args.shadow = static_cast<int8_t*>(shadow.value());
    }
  }
  if (!z.device_scan) return Status::Ok();
  scan_.on = true;
  scan_.picks_cap = z.scan_picks;
  scan_.list_cap = z.scan_list_cap;
  ShadowScanArgs& a = scan_.args;
  a.channels = static_cast<int32_t>(std::min<int64_t>(policy_->device_scan_channels(), m.head_dim));
  a.group = dims_.group;
  a.head_dim = m.head_dim;
  a.kv_dtype = m.kv_dtype;
  KVF_ASSIGN_OR_RETURN(scan_.scale, AllocAs<float>(z.scan_scale, false));
  a.scale = scan_.scale;
  KVF_ASSIGN_OR_RETURN(a.keys, AllocAs<uint32_t>(z.scan_keys, false));
  KVF_ASSIGN_OR_RETURN(a.ints, AllocAs<int32_t>(z.scan_ints, false));
  KVF_ASSIGN_OR_RETURN(a.hist, AllocAs<uint32_t>(z.scan_hist, false));
  {  // the histograms start at zero (each scan leaves them so)
    const std::vector<uint32_t> zeros(z.scan_hist / sizeof(uint32_t), 0u);
    KVF_RETURN_IF_ERROR(device_->CopyAsync(a.hist, zeros.data(), z.scan_hist, stream_));
    KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
  }
  KVF_ASSIGN_OR_RETURN(a.block_counts, AllocAs<int32_t>(z.scan_blocks, false));
  // The passes read the item table from, and write the ranking into, mapped host memory: no
  // copies to enqueue (on the GPU machine: 32K 13.1-13.8 ms a step against
  // 13.6-15.2 with a copy each way, 64K 21.7-22.3 against 23.3-24.3).
  KVF_ASSIGN_OR_RETURN(a.counts, AllocAs<int32_t>(z.scan_counts, true));
  KVF_ASSIGN_OR_RETURN(a.item, AllocAs<ShadowScanItem>(z.scan_items, false));
  KVF_ASSIGN_OR_RETURN(scan_.items_host, AllocAs<ShadowScanItem>(z.scan_items, true));
  a.item_host = scan_.items_host;
  KVF_ASSIGN_OR_RETURN(a.out, AllocAs<uint64_t>(z.scan_out, true));
  KVF_ASSIGN_OR_RETURN(scan_.ready, device_->CreateEvent());
  scan_.rows.assign(static_cast<size_t>(cap.max_sequences) * m.num_layers, 0);
  scan_.view.assign(static_cast<size_t>(std::max<int64_t>(cap.max_batch, 1) * hkv), {});
  return Status::Ok();
}

Status RuntimeImpl::ProbeCosts() {
  // CPU route: the pool attends random rows of a buffer larger than a core's caches, as it would
  // host-store rows; rate in GB/s of K and V rows read.
  const int d = config_.model.head_dim;
  const int64_t rows = std::max<int64_t>(4096, (int64_t{16} << 20) / static_cast<int64_t>(2 * dims_.row_bytes));
  std::vector<uint16_t> kv(static_cast<size_t>(rows) * 2 * d);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<uint16_t>(0x3c00 + (i * 2654435761u >> 22) % 512);
  const int threads = std::max(1, pool_->num_threads());
  const int64_t per_item = 1024;
  std::vector<const void*> k_rows(static_cast<size_t>(threads * per_item)), v_rows(k_rows.size());
  uint64_t x = 88172645463325252ull;
  for (size_t i = 0; i < k_rows.size(); ++i) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    const int64_t r = static_cast<int64_t>(x % static_cast<uint64_t>(rows));
    k_rows[i] = kv.data() + r * 2 * d;
    v_rows[i] = kv.data() + (r * 2 + 1) * d;
  }
  std::vector<float> q(static_cast<size_t>(threads) * dims_.group * d, 0.01f), o(q.size()),
      lse(static_cast<size_t>(threads) * dims_.group);
  std::vector<RowAttnItem> items(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    items[t] = RowAttnItem{q.data() + t * dims_.group * d, o.data() + t * dims_.group * d, lse.data() + t * dims_.group,
                           k_rows.data() + t * per_item, v_rows.data() + t * per_item,
                           static_cast<int32_t>(per_item)};
  }
  const AttnParams params{dims_.group, d, config_.model.kv_dtype, dims_.scale};
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    pool_->ParallelFor(threads, [&](int64_t i) { cpu::AttendRows(params, &items[i], 1); });
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double bytes = static_cast<double>(threads * per_item) * 2.0 * static_cast<double>(dims_.row_bytes);
  cost_.cpu_gbps = std::max(0.1, bytes / best * 1e-9);
  // GPU route: the zero-copy gather rate of host rows, measured on the device, with the link's
  // contiguous H2D rate and the device memory's rate (Stats::cost_h2d_gbps, cost_hbm_gbps).
  if (device_->backend() == Backend::kCuda) {
    Result<std::unique_ptr<TransferEngine>> te = TransferEngine::Create(device_.get(), 1 << 16);
    if (te.ok()) {
      Result<TransferProbe> probe = te.value()->Probe(size_t{32} << 20, static_cast<int>(dims_.row_bytes));
      if (probe.ok() && probe->zero_copy_gather_gbps > 0) cost_.pcie_gbps = probe->zero_copy_gather_gbps;
      if (probe.ok() && probe->h2d_gbps > 0) cost_.h2d_gbps = probe->h2d_gbps;
      if (probe.ok() && probe->d2d_gbps > 0) cost_.hbm_gbps = probe->d2d_gbps;
    }
  }
  return Status::Ok();
}

Result<int> RuntimeImpl::SlotOf(SequenceId seq) const {
  auto it = slots_.find(seq);
  if (it == slots_.end()) return NotFound(StrCat("sequence ", seq, " is not live"));
  return it->second;
}

Status RuntimeImpl::CheckLayer(int layer) const {
  KVF_CHECK_ARG(layer >= 0 && layer < config_.model.num_layers, "layer ", layer,
                " out of range [0, ", config_.model.num_layers, ")");
  return Status::Ok();
}

Status RuntimeImpl::CheckTensor(const TensorView& t, const char* name, int64_t rows,
                                int heads) const {
  const int d = config_.model.head_dim;
  KVF_CHECK_ARG(t.data != nullptr, name, " is null");
  KVF_CHECK_ARG(t.ndim == 3 && t.shape[0] == rows && t.shape[1] == heads && t.shape[2] == d, name,
                " has shape [", t.ndim > 0 ? t.shape[0] : 0, ", ", t.ndim > 1 ? t.shape[1] : 0,
                ", ", t.ndim > 2 ? t.shape[2] : 0, "] (ndim ", t.ndim, "), expected [", rows, ", ",
                heads, ", ", d, "]");
  KVF_CHECK_ARG(SupportedActivation(t.dtype), name, " dtype ", DTypeName(t.dtype),
                " unsupported (f32, bf16, f16)");
  KVF_CHECK_ARG(t.is_contiguous(), name, " must be contiguous");
  KVF_CHECK_ARG(t.where == MemoryKind::kHost || device_->backend() == Backend::kCuda, name,
                " is in device memory but the backend is host");
  return Status::Ok();
}

int64_t RuntimeImpl::BudgetFor(int64_t n) const {
  int64_t b = config_.policy.budget_tokens;
  if (b <= 0) {
    b = static_cast<int64_t>(std::ceil(config_.policy.budget_fraction * static_cast<double>(n)));
  }
  return std::clamp<int64_t>(b, 1, std::max<int64_t>(dims_.item_cap, 1));
}

Status RuntimeImpl::AddSequence(SequenceId seq) {
  KVF_CHECK_ARG(slots_.find(seq) == slots_.end(), "sequence ", seq, " is already live");
  KVF_CHECK_CODE(!free_slots_.empty(), StatusCode::kResourceExhausted, "max_sequences ",
                 config_.capacity.max_sequences, " are live; remove one before adding ", seq);
  const int slot = free_slots_.back();
  free_slots_.pop_back();
  slots_.emplace(seq, slot);
  std::fill_n(lengths_.begin() + static_cast<int64_t>(slot) * config_.model.num_layers,
              config_.model.num_layers, 0);
  if (prime_.pending_rows > 0) {
    std::fill_n(prime_.pending.begin() + static_cast<int64_t>(slot) * config_.model.num_layers,
                config_.model.num_layers, PendingPrime{});
  }
  if (scan_.on) {
    std::fill_n(scan_.rows.begin() + static_cast<int64_t>(slot) * config_.model.num_layers,
                config_.model.num_layers, 0);
  }
  if (prefill_.staged.slot == slot) prefill_.staged = {};
  if (prefill_.next_staged.slot == slot) prefill_.next_staged = {};
  if (prefill_.last.slot == slot) prefill_.last = {};
  return Status::Ok();
}

Status RuntimeImpl::RemoveSequence(SequenceId seq) {
  KVF_ASSIGN_OR_RETURN(int slot, SlotOf(seq));
  if (plan_.active && std::find(plan_.slots.begin(), plan_.slots.end(), slot) != plan_.slots.end()) {
    // A step that has run some of its layers but not all is under way on the engine's thread
    // (its Decode calls come one per layer): taking a sequence out of it would leave the others
    // of the batch with the step's token at some layers only.
    const int layers = config_.model.num_layers;
    const auto ran = std::count(plan_.layer_run.begin(), plan_.layer_run.end(), uint8_t{1});
    KVF_CHECK_CODE(ran == 0 || ran == layers, StatusCode::kFailedPrecondition, "sequence ", seq,
                   " is in the decode step planned by PlanDecode, which has run ", ran, " of ",
                   layers, " layers; remove it after the step's last Decode");
    RetirePlan();
  }
  // In-flight work may read its rows: wait for the runtime's stream and for the last call, which
  // may have been issued on a caller's stream.
  KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
  KVF_RETURN_IF_ERROR(device_->SynchronizeEvent(call_done_));
  store_->Release(slot);
  policy_->OnSequenceRemoved(slot);
  KVF_RETURN_IF_ERROR(ResetSelectState(slot));
  if (bank_ != nullptr) {
    KVF_RETURN_IF_ERROR(device_->SynchronizeStream(side_stream_));
    bank_->ResetSequence(slot);
  }
  if (step_bank_ != nullptr) {
    const int per_slot = config_.model.num_layers * config_.model.num_kv_heads;
    KVF_RETURN_IF_ERROR(JoinAdmitSide(stream_));  // admissions of a step left unfinished
    KVF_RETURN_IF_ERROR(step_bank_->ResetTables(slot * per_slot, per_slot, stream_));
    KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
  }
  const int hkv = config_.model.num_kv_heads;
  for (int l = 0; l < config_.model.num_layers; ++l) {
    lengths_[static_cast<size_t>(slot) * config_.model.num_layers + l] = 0;
    for (int h = 0; h < hkv; ++h) {
      last_selection_[(static_cast<size_t>(slot) * config_.model.num_layers + l) * hkv + h].clear();
    }
  }
  slots_.erase(seq);
  free_slots_.push_back(slot);
  return Status::Ok();
}

Result<int64_t> RuntimeImpl::SequenceLength(SequenceId seq, int layer) const {
  KVF_RETURN_IF_ERROR(CheckLayer(layer));
  KVF_ASSIGN_OR_RETURN(int slot, SlotOf(seq));
  return lengths_[static_cast<size_t>(slot) * config_.model.num_layers + layer];
}

char* RuntimeImpl::ResidentK(int slot, int layer, int h, int64_t row) const {
  const int64_t slot_rows = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
  const int64_t base =
      ((static_cast<int64_t>(slot) * config_.model.num_layers + layer) * config_.model.num_kv_heads + h) *
      slot_rows * 2;
  return resident_ + static_cast<size_t>(base + row) * dims_.row_bytes;
}

char* RuntimeImpl::ResidentV(int slot, int layer, int h, int64_t row) const {
  const int64_t slot_rows = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
  return ResidentK(slot, layer, h, row) + static_cast<size_t>(slot_rows) * dims_.row_bytes;
}

int64_t RuntimeImpl::ResidentRow(int64_t pos, int64_t n) const {
  const int sink = config_.tiers.sink_tokens, window = config_.tiers.window_tokens;
  return ResidentRowOf(pos, n, sink, window);
}

int64_t RuntimeImpl::PlanAppend(int slot, int layer, int64_t pos0, int64_t count, int64_t new_len,
                                const void* k_src, size_t k_elem, const void* v_src, size_t v_elem,
                                int64_t src_row0, RowCopy* k_copies, RowCopy* v_copies) {
  const int hkv = config_.model.num_kv_heads, d = config_.model.head_dim;
  const int sink = config_.tiers.sink_tokens, window = config_.tiers.window_tokens;
  int64_t c = 0;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t pos = pos0 + t;
    for (int h = 0; h < hkv; ++h) {
      const int64_t src_row = (src_row0 + t) * hkv + h;
      const void* ks = static_cast<const char*>(k_src) + src_row * d * k_elem;
      const void* vs = static_cast<const char*>(v_src) + src_row * d * v_elem;
      k_copies[c] = RowCopy{store_->k_row(slot, layer, h, pos), ks};
      v_copies[c++] = RowCopy{store_->v_row(slot, layer, h, pos), vs};
      const int64_t row = ResidentRowOf(pos, new_len, sink, window);
      if (row >= 0) {
        k_copies[c] = RowCopy{ResidentK(slot, layer, h, row), ks};
        v_copies[c++] = RowCopy{ResidentV(slot, layer, h, row), vs};
      }
    }
  }
  return c;
}

Result<const void*> RuntimeImpl::StageInput(const TensorView& t, void* staging, StreamHandle stream) {
  if (t.where == MemoryKind::kDevice || device_->backend() == Backend::kHost) return static_cast<const void*>(t.data);
  KVF_RETURN_IF_ERROR(device_->CopyAsync(staging, t.data, static_cast<size_t>(t.numel()) * DTypeSize(t.dtype), stream));
  return static_cast<const void*>(staging);
}

Status RuntimeImpl::BeginCall() {
  // The descriptor buffers are single-buffered: the previous call's launches must have read them.
  // (Host-side selection synchronises every step anyway; double buffering would lift this.)
  if (device_->EventDone(call_done_)) return Status::Ok();
  return HostWaitEvent(call_done_);
}

Status RuntimeImpl::CopyRowsWide(const RowCopy* rows, int64_t num_rows, int elems, DType src_dtype,
                                 DType dst_dtype, StreamHandle stream) {
  if (device_->backend() != Backend::kHost) {
    return device_->CopyRows(rows, num_rows, elems, src_dtype, dst_dtype, stream);
  }
  constexpr int64_t kRowsPerTask = 256;
  const int64_t tasks = (num_rows + kRowsPerTask - 1) / kRowsPerTask;
  if (tasks <= 1) return device_->CopyRows(rows, num_rows, elems, src_dtype, dst_dtype, stream);
  pool_->ParallelFor(tasks, [&](int64_t task) {
    const int64_t end = std::min(num_rows, (task + 1) * kRowsPerTask);
    for (int64_t i = task * kRowsPerTask; i < end; ++i) {
      cpu::Convert(rows[i].dst, dst_dtype, rows[i].src, src_dtype, elems);
    }
  });
  return Status::Ok();
}

Status RuntimeImpl::EndCall(StreamHandle stream) {
  last_call_stream_ = stream;
  return device_->RecordEvent(call_done_, stream);
}

Status RuntimeImpl::Prefill(SequenceId seq, int layer, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, StreamHandle stream) {
  const auto t0 = Clock::now();
  const ModelShape& m = config_.model;
  KVF_RETURN_IF_ERROR(CheckLayer(layer));
  KVF_ASSIGN_OR_RETURN(int slot, SlotOf(seq));
  KVF_CHECK_ARG(q.ndim == 3 && q.shape[0] >= 1, "q must be [T, ", m.num_q_heads, ", ", m.head_dim,
                "] with T >= 1");
  const int64_t tokens = q.shape[0];
  KVF_CHECK_ARG(tokens <= config_.capacity.max_prefill_chunk, "prefill chunk of ", tokens,
                " tokens exceeds max_prefill_chunk ", config_.capacity.max_prefill_chunk);
  KVF_RETURN_IF_ERROR(CheckTensor(q, "q", tokens, m.num_q_heads));
  KVF_RETURN_IF_ERROR(CheckTensor(k, "k", tokens, m.num_kv_heads));
  KVF_RETURN_IF_ERROR(CheckTensor(v, "v", tokens, m.num_kv_heads));
  KVF_RETURN_IF_ERROR(CheckTensor(out, "out", tokens, m.num_q_heads));
  int64_t& len = lengths_[static_cast<size_t>(slot) * m.num_layers + layer];
  const int64_t pos0 = len, new_len = len + tokens;
  KVF_RETURN_IF_ERROR(ReserveChunk(seq, slot, layer, new_len));
  if (stream == nullptr) stream = stream_;
  if (WindowOf(layer) > 0) {  // a sliding-window layer: its ring only (runtime/window.cpp)
    KVF_RETURN_IF_ERROR(WindowChunk(slot, layer, &q, k, v, &out, stream, pos0, new_len));
    len = new_len;
    stats_.prefill_tokens += tokens;
    Stage(stats_.ms_prefill, "prefill", t0);
    return Status::Ok();
  }
  // The chunk's rows may have reached the ring before a failure: restore it for the old length,
  // which a failed call leaves unchanged.
  // The device's copy of the policy's shadow lacks the chunk's rows: made again at the next priming.
  if (scan_.on) scan_.rows[static_cast<size_t>(slot) * m.num_layers + layer] = 0;
  Status st = PrefillReserved(slot, layer, q, k, v, out, stream, pos0, new_len);
  if (!st.ok()) {
    // The kept query rows may have been overwritten by this chunk's: nothing stays pending (the
    // layer is primed again by its next successful chunk).
    if (prime_.pending_rows > 0) prime_.pending[static_cast<size_t>(slot) * m.num_layers + layer] = {};
    prefill_.staged = {};
    prefill_.last = {};
    return WithRestore(std::move(st), RestoreWindow({&slot, 1}, layer, stream));
  }
  len = new_len;
  if (prime_.eager) KVF_RETURN_IF_ERROR(FlushPrime(slot, layer, stream, true));
  stats_.prefill_tokens += tokens;
  Stage(stats_.ms_prefill, "prefill", t0);
  return Status::Ok();
}

// One chunk of a prefill (PrefillReserved): the call and the inputs as the device reads them.
struct RuntimeImpl::PrefillCall {
  int slot, layer;
  const TensorView& q;
  const TensorView& k;
  const TensorView& v;
  const TensorView& out;
  StreamHandle stream;
  int64_t pos0, new_len, tokens;
  const void* q_src = nullptr;  // StageInput's
  const void* k_src = nullptr;
  const void* v_src = nullptr;
  AttnParams params{};
  int64_t gd = 0;  // group * head_dim
};

Status RuntimeImpl::PrefillReserved(int slot, int layer, const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& out,
                                    StreamHandle stream, int64_t pos0, int64_t new_len) {
  const ModelShape& m = config_.model;
  PrefillCall c{slot, layer, q, k, v, out, stream, pos0, new_len, new_len - pos0};
  // A tensor-core chunk whose output stays on the device and whose policy reads no queries on the
  // host follows the last call on the same stream without a host wait: its device buffers are
  // ordered by the stream, its descriptors double-buffered.
  const bool chained = prefill_.items != nullptr && prefill_.items_done[0] != nullptr &&
                       stream == last_call_stream_ && out.where == MemoryKind::kDevice &&
                       (!policy_->wants_prefill_queries() || prime_.pending_rows > 0) && !prime_.eager;
  if (chained) {
    const EventHandle read = prefill_.items_done[prefill_.parity];
    if (!device_->EventDone(read)) KVF_RETURN_IF_ERROR(HostWaitEvent(read));
  } else {
    KVF_RETURN_IF_ERROR(BeginCall());
  }
  KVF_ASSIGN_OR_RETURN(c.q_src, StageInput(q, io_.q_in, stream));
  KVF_ASSIGN_OR_RETURN(c.k_src, StageInput(k, io_.k_in, stream));
  KVF_ASSIGN_OR_RETURN(c.v_src, StageInput(v, io_.v_in, stream));
  c.gd = static_cast<int64_t>(dims_.group) * m.head_dim;
  c.params = AttnParams{dims_.group, m.head_dim, m.kv_dtype, dims_.scale};
  // CUDA: one staging pass and the tensor-core kernel (gpu/prefill.cuh); else the paged kernel.
  const bool tensor_cores = prefill_.items != nullptr;
  if (tensor_cores) {
    KVF_RETURN_IF_ERROR(PrefillTensorCores(c));
  } else {
    KVF_RETURN_IF_ERROR(PrefillPaged(c));
  }

  if (prime_.pending_rows > 0) {
    KVF_RETURN_IF_ERROR(DeferPrime(slot, layer, new_len, c.tokens, c.q_src, q.dtype, stream));
  } else if (prime_.rows > 0 || policy_->wants_prefill_queries()) {
    // A policy that reads every query row of the chunk (no prime_rows): primed now.
    if (tensor_cores) KVF_RETURN_IF_ERROR(TransposePrefillQ(c));  // io_.q_f32: [Hkv, T, G, D]
    const auto tp = Clock::now();
    KVF_RETURN_IF_ERROR(PrimePolicy(slot, layer, new_len, static_cast<int>(c.tokens), stream));
    Stage(stats_.ms_prime, "prime", tp);
  }
  KVF_RETURN_IF_ERROR(SelectorStored(slot, layer, pos0, new_len, stream));
  KVF_RETURN_IF_ERROR(EndCall(stream));
  if (out.where == MemoryKind::kHost) KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream));
  return Status::Ok();
}

Status RuntimeImpl::TransposePrefillQ(const PrefillCall& c) {
  const ModelShape& m = config_.model;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t tokens = c.tokens, gd = c.gd;
  // q to f32, transposed to [Hkv, T, G, D] so that each KV head's queries are contiguous.
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < hkv; ++h) {
      desc_.q_copies[t * hkv + h] = RowCopy{
          io_.q_f32 + (h * tokens + t) * gd,
          static_cast<const char*>(c.q_src) + (t * hq + h * dims_.group) * d * DTypeSize(c.q.dtype)};
    }
  }
  return CopyRowsWide(desc_.q_copies, tokens * hkv, static_cast<int>(gd), c.q.dtype, DType::kF32,
                      c.stream);
}

Status RuntimeImpl::PrefillTensorCores(const PrefillCall& c) {
  const ModelShape& m = config_.model;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int slot = c.slot, layer = c.layer;
  const int64_t pos0 = c.pos0;
  KVF_RETURN_IF_ERROR(store_->FlushTable(c.stream));
  PrefillChunkArgs a;
  PrefillStageArgs& st = a.stage;
  FillPrefillStageArgs(c, st);
  // Chunk-major: the call before this one copied this call's history into the second staging
  // (PrefetchNextHistory); it becomes the staging, the copies ordered before this chunk.
  const bool prefetched = prefill_.next != nullptr && pos0 > 0 &&
                          prefill_.next_staged.slot == slot && prefill_.next_staged.layer == layer &&
                          prefill_.next_staged.rows == pos0;
  prefill_.next_staged = {};
  if (prefetched) {
    std::swap(prefill_.scratch, prefill_.next);
    std::swap(prefill_.pages_dev, prefill_.next_pages_dev);
    prefill_.staged = {slot, layer, pos0};
    KVF_RETURN_IF_ERROR(device_->WaitEvent(c.stream, prefill_.next_ready));
    ++stats_.prefill_chunks_prefetched;
  }
  if (prefill_.next != nullptr) KVF_RETURN_IF_ERROR(device_->RecordEvent(prefill_.call_start, c.stream));
  st.staging = prefill_.scratch;
  st.staging_cap = prefill_.max_pages * store_->shape().page_tokens;
  // A chunk that continues the one before it (same sequence and layer, nothing appended since)
  // finds the history in the staging: no PCIe pass over it (the prompt's chunks of one layer in
  // a row, as a layer-by-layer prefill issues them). Invalid until this chunk succeeds.
  st.history_staged = pos0 > 0 && prefill_.staged.slot == slot && prefill_.staged.layer == layer &&
                      prefill_.staged.rows == pos0;
  prefill_.staged = {};
  FillPrefillChunkArgs(c, a);
  KVF_RETURN_IF_ERROR(device_->PrefillChunk(a, c.stream));
  prefill_.staged = {slot, layer, c.new_len};
  if (prefill_.next != nullptr) {
    KVF_RETURN_IF_ERROR(PrefetchNextHistory(slot, layer, pos0, c.new_len));
  }
  KVF_RETURN_IF_ERROR(device_->RecordEvent(prefill_.items_done[prefill_.parity], c.stream));
  prefill_.parity ^= 1;
  if (c.out.where != MemoryKind::kDevice) {  // (not out_direct: a.out was the staging)
    const int64_t nq = c.tokens * hq * d;
    KVF_RETURN_IF_ERROR(
        device_->CopyAsync(c.out.data, io_.out_stage, nq * DTypeSize(c.out.dtype), c.stream));
  }
  stats_.bytes_d2h += c.tokens * hkv * 2 * static_cast<int64_t>(dims_.row_bytes);  // write-through
  if (!st.history_staged) {
    stats_.bytes_h2d += pos0 * hkv * 2 * static_cast<int64_t>(dims_.row_bytes);  // earlier rows staged
  }
  return Status::Ok();
}

void RuntimeImpl::FillPrefillStageArgs(const PrefillCall& c, PrefillStageArgs& st) const {
  const ModelShape& m = config_.model;
  const int hkv = m.num_kv_heads;
  const int64_t rows_per_slot = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
  const int64_t t0_index = (static_cast<int64_t>(c.slot) * m.num_layers + c.layer) * hkv;
  st.k = c.k_src;
  st.v = c.v_src;
  st.k_dtype = c.k.dtype;
  st.v_dtype = c.v.dtype;
  st.pos0 = c.pos0;
  st.tokens = c.tokens;
  st.new_len = c.new_len;
  st.num_kv_heads = hkv;
  st.head_dim = m.head_dim;
  st.kv_dtype = m.kv_dtype;
  st.store = store_->device_store(t0_index);
  st.resident = resident_ + static_cast<size_t>(t0_index * 2 * rows_per_slot) * dims_.row_bytes;
  st.sink = config_.tiers.sink_tokens;
  st.window = config_.tiers.window_tokens;
}

void RuntimeImpl::FillPrefillChunkArgs(const PrefillCall& c, PrefillChunkArgs& a) {
  a.params = c.params;
  a.num_q_heads = config_.model.num_q_heads;
  a.q = c.q_src;
  a.q_dtype = c.q.dtype;
  const bool out_direct = c.out.where == MemoryKind::kDevice;
  a.out = out_direct ? c.out.data : io_.out_stage;
  a.out_dtype = c.out.dtype;
  a.q_scratch = io_.q_in == c.q_src ? io_.out_stage : io_.q_in;  // a free buffer of the chunk's size
  if (!out_direct && a.q_scratch == io_.out_stage) a.q_scratch = io_.q_f32;
  a.items = static_cast<char*>(prefill_.items) + prefill_.parity * prefill_.items_bytes;
  a.items_bytes = prefill_.items_bytes;
  if (prefill_.copy_stream != nullptr) {
    a.copy_stream = prefill_.copy_stream;
    a.fork_done = prefill_.fork;
    a.segment_done = prefill_.segment_done.data();
    a.host_pages = store_->pages(c.slot, c.layer, 0).pages;
    a.copy_scratch = prefill_.copy_scratch.data();
    a.o_acc = io_.o_gpu;
    a.lse_acc = io_.lse_gpu;
  }
  if (prefill_.write_stream != nullptr) {
    a.host_pages = store_->pages(c.slot, c.layer, 0).pages;
    a.write_stream = prefill_.write_stream;
    a.write_ready = prefill_.write_ready;
    a.write_done = prefill_.write_done;
    a.write_scratch = prefill_.write_scratch.data();
  }
}

Status RuntimeImpl::PrefillPaged(const PrefillCall& c) {
  const ModelShape& m = config_.model;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int slot = c.slot, layer = c.layer;
  const int64_t pos0 = c.pos0, new_len = c.new_len, tokens = c.tokens, gd = c.gd;
  const TensorView &k = c.k, &v = c.v, &out = c.out;
  const int64_t n_copies = PlanAppend(slot, layer, pos0, tokens, new_len, c.k_src, DTypeSize(k.dtype),
                                      c.v_src, DTypeSize(v.dtype), 0, desc_.k_copies, desc_.v_copies);
  KVF_RETURN_IF_ERROR(CopyRowsWide(desc_.k_copies, n_copies, d, k.dtype, m.kv_dtype, c.stream));
  KVF_RETURN_IF_ERROR(CopyRowsWide(desc_.v_copies, n_copies, d, v.dtype, m.kv_dtype, c.stream));
  stats_.bytes_d2h += tokens * hkv * 2 * static_cast<int64_t>(dims_.row_bytes);  // write-through

  KVF_RETURN_IF_ERROR(TransposePrefillQ(c));
  float* o_f32 = io_.o_gpu;
  // On a GPU, prefill reads every stored row once per query: stage this layer's pages in device
  // memory first (one PCIe pass per chunk) instead of reading them over PCIe for every query.
  const bool stage_pages = prefill_.pages_dev != nullptr;
  if (stage_pages) KVF_RETURN_IF_ERROR(StageLayerPages(slot, layer, new_len, c.stream));
  for (int h = 0; h < hkv; ++h) {
    PagedAttnItem& it = desc_.paged_items[h];
    it.q = io_.q_f32 + h * tokens * gd;
    it.o = o_f32 + h * tokens * gd;
    it.lse = io_.lse_gpu + h * tokens * dims_.group;
    it.kv = stage_pages ? KvPages{prefill_.pages_dev + h * prefill_.max_pages, store_->shape().page_tokens}
                        : store_->pages(slot, layer, h);
    it.q_pos0 = pos0;
    it.num_q = static_cast<int32_t>(tokens);
  }
  if (device_->backend() == Backend::kHost) {
    // The host device runs kernels on the calling thread: spread all (KV head, query block)
    // units of the chunk over the pool in one loop. Rows are independent, so the blocks give
    // the single call's results. Later query blocks attend more keys: they come first, so the
    // short ones fill in at the end.
    const int64_t query_block = cpu::PrefillQueryBlock(tokens, hkv, pool_->num_threads());
    const int64_t blocks = (tokens + query_block - 1) / query_block;
    pool_->ParallelFor(hkv * blocks, [&](int64_t u) {
      const int64_t t0 = (blocks - 1 - u / hkv) * query_block;
      PagedAttnItem it = desc_.paged_items[u % hkv];
      it.q += t0 * gd;
      it.o += t0 * gd;
      it.lse += t0 * dims_.group;
      it.q_pos0 += t0;
      it.num_q = static_cast<int32_t>(std::min(query_block, tokens - t0));
      cpu::AttendPaged(c.params, &it, 1);
    });
  } else {
    KVF_RETURN_IF_ERROR(device_->AttendPaged(c.params, desc_.paged_items, hkv, c.stream));
  }
  const bool out_direct = out.where == MemoryKind::kDevice || device_->backend() == Backend::kHost;
  char* out_dst = static_cast<char*>(out_direct ? out.data : io_.out_stage);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < hkv; ++h) {
      desc_.o_copies[t * hkv + h] = RowCopy{out_dst + (t * hq + h * dims_.group) * d * DTypeSize(out.dtype),
                                            o_f32 + (h * tokens + t) * gd};
    }
  }
  KVF_RETURN_IF_ERROR(CopyRowsWide(desc_.o_copies, tokens * hkv, static_cast<int>(gd), DType::kF32,
                                   out.dtype, c.stream));
  if (!out_direct) {
    const int64_t nq = tokens * hq * d;
    KVF_RETURN_IF_ERROR(device_->CopyAsync(out.data, io_.out_stage, nq * DTypeSize(out.dtype), c.stream));
  }
  return Status::Ok();
}

Status RuntimeImpl::StageLayerPages(int slot, int layer, int64_t n, StreamHandle stream) {
  KVF_RETURN_IF_ERROR(CopyLayerPages(slot, layer, n, prefill_.scratch, stream));
  prefill_.staged = {slot, layer, n};
  return Status::Ok();
}

Status RuntimeImpl::PrefetchNextHistory(int slot, int layer, int64_t pos0, int64_t new_len) {
  const int layers = config_.model.num_layers;
  const LastPrefill prev = prefill_.last;
  prefill_.last = {slot, layer, pos0, new_len};
  // Chunk-major: the call before was this chunk's previous layer, or (layer 0) the previous
  // chunk's last layer. The next call is then the next layer's chunk, or the next chunk's layer 0.
  const bool chunk_major =
      prev.slot == slot && layers > 1 &&
      ((layer > 0 && prev.layer == layer - 1 && prev.pos0 == pos0) ||
       (layer == 0 && prev.layer == layers - 1 && prev.new_len == pos0));
  if (!chunk_major) return Status::Ok();
  const int next_layer = layer + 1 < layers ? layer + 1 : 0;
  const int64_t rows = layer + 1 < layers ? pos0 : new_len;
  if (WindowOf(next_layer) > 0) return Status::Ok();  // a sliding-window layer: no pages to stage
  if (rows <= 0 || lengths_[static_cast<size_t>(slot) * layers + next_layer] < rows) {
    return Status::Ok();
  }
  // After the work before this call (the rows' write-through, the last reader of this staging).
  KVF_RETURN_IF_ERROR(device_->WaitEvent(prefill_.copy_stream, prefill_.call_start));
  KVF_RETURN_IF_ERROR(CopyLayerPages(slot, next_layer, rows, prefill_.next, prefill_.copy_stream));
  KVF_RETURN_IF_ERROR(device_->RecordEvent(prefill_.next_ready, prefill_.copy_stream));
  prefill_.next_staged = {slot, next_layer, rows};
  return Status::Ok();
}

Status RuntimeImpl::CopyLayerPages(int slot, int layer, int64_t n, char* staging,
                                   StreamHandle stream) {
  const int hkv = config_.model.num_kv_heads;
  const int64_t num_pages = (n + store_->shape().page_tokens - 1) / store_->shape().page_tokens;
  const int64_t page_bytes = store_->page_bytes();
  // One batched enqueue: a copy per page run costs the host microseconds each, thousands of them
  // per layer at 128K, which a chunk-major prefill would pay on its critical path.
  prefill_.page_copy_dst.clear();
  prefill_.page_copy_src.clear();
  prefill_.page_copy_bytes.clear();
  for (int h = 0; h < hkv; ++h) {
    const KvPages src = store_->pages(slot, layer, h);
    // Pages adjacent in the host store (and in the staging) go in one copy.
    for (int64_t pg = 0; pg < num_pages;) {
      int64_t run = 1;
      while (pg + run < num_pages &&
             static_cast<const char*>(src.pages[pg + run]) ==
                 static_cast<const char*>(src.pages[pg]) + run * page_bytes) {
        ++run;
      }
      prefill_.page_copy_dst.push_back(staging + (h * prefill_.max_pages + pg) * page_bytes);
      prefill_.page_copy_src.push_back(src.pages[pg]);
      prefill_.page_copy_bytes.push_back(static_cast<size_t>(run * page_bytes));
      pg += run;
    }
  }
  KVF_RETURN_IF_ERROR(device_->CopyBatchAsync(prefill_.page_copy_dst.data(), prefill_.page_copy_src.data(),
                                              prefill_.page_copy_bytes.data(),
                                              static_cast<int64_t>(prefill_.page_copy_dst.size()), stream));
  stats_.bytes_h2d += num_pages * page_bytes * hkv;
  return Status::Ok();
}

Status RuntimeImpl::DeferPrime(int slot, int layer, int64_t new_len, int64_t tokens,
                               const void* q_src, DType q_dtype, StreamHandle stream) {
  const ModelShape& m = config_.model;
  const int rows = static_cast<int>(std::min<int64_t>(prime_.pending_rows, tokens));
  const size_t row_bytes = static_cast<size_t>(m.num_q_heads) * m.head_dim * DTypeSize(q_dtype);
  char*& buf = prime_.pending_q[static_cast<size_t>(slot)];
  if (buf == nullptr) {  // the slot's first primed prefill: its pinned rows for every layer
    KVF_ASSIGN_OR_RETURN(void* p, Alloc(PendingQBytes() * static_cast<size_t>(m.num_layers), true));
    buf = static_cast<char*>(p);
  }
  KVF_RETURN_IF_ERROR(device_->CopyAsync(
      PendingQ(slot, layer),
      static_cast<const char*>(q_src) + static_cast<size_t>(tokens - rows) * row_bytes,
      static_cast<size_t>(rows) * row_bytes, stream));
  if (device_->backend() != Backend::kHost) stats_.bytes_d2h += rows * static_cast<int64_t>(row_bytes);
  prime_.pending[static_cast<size_t>(slot) * m.num_layers + layer] = {new_len, rows, q_dtype};
  return Status::Ok();
}

Status RuntimeImpl::FlushPrime(int slot, int layer, StreamHandle stream, bool same_call) {
  const ModelShape& m = config_.model;
  PendingPrime& pp = prime_.pending[static_cast<size_t>(slot) * m.num_layers + layer];
  if (pp.n == 0) return Status::Ok();
  const auto t0 = Clock::now();
  // The rows were copied on their Prefill's stream. Every call waits for its predecessor or
  // follows it on the same stream (a chained prefill), so once the last call is done, so is the
  // copy.
  if (same_call) {
    KVF_RETURN_IF_ERROR(HostWaitStream(stream));
  } else if (!device_->EventDone(call_done_)) {
    KVF_RETURN_IF_ERROR(HostWaitEvent(call_done_));
  }
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int rows = pp.rows;
  const size_t elem = DTypeSize(pp.dtype);
  const char* src = PendingQ(slot, layer);
  if (device_->backend() != Backend::kHost) {
    KVF_RETURN_IF_ERROR(device_->CopyAsync(io_.q_in, src, static_cast<size_t>(rows) * hq * d * elem, stream));
    stats_.bytes_h2d += static_cast<int64_t>(rows) * hq * d * static_cast<int64_t>(elem);
    src = static_cast<const char*>(io_.q_in);
  }
  // q to f32 [Hkv][rows][G][D] in io_.q_f32.
  const int64_t gd = static_cast<int64_t>(dims_.group) * d;
  for (int t = 0; t < rows; ++t) {
    for (int h = 0; h < hkv; ++h) {
      desc_.q_copies[t * hkv + h] =
          RowCopy{io_.q_f32 + (static_cast<int64_t>(h) * rows + t) * gd,
                  src + (static_cast<size_t>(t) * hq + static_cast<size_t>(h) * dims_.group) * d * elem};
    }
  }
  KVF_RETURN_IF_ERROR(CopyRowsWide(desc_.q_copies, static_cast<int64_t>(rows) * hkv,
                                   static_cast<int>(gd), pp.dtype, DType::kF32, stream));
  KVF_RETURN_IF_ERROR(PrimePolicy(slot, layer, pp.n, rows, stream));
  pp = {};
  Stage(stats_.ms_prime, "prime", t0);
  return Status::Ok();
}

Status RuntimeImpl::PrimePolicy(int slot, int layer, int64_t new_len, int rows,
                                StreamHandle stream) {
  // Policies that learn from the prompt (priming tables from it) get its f32 queries on the host,
  // or the statistics the device computed from them.
  const int hkv = config_.model.num_kv_heads, d = config_.model.head_dim;
  const int64_t gd = static_cast<int64_t>(dims_.group) * d;
  PrefillContext ctx;
  ctx.slot = slot;
  ctx.layer = layer;
  ctx.q_pos0 = new_len - rows;
  ctx.num_q = rows;
  ctx.n = new_len;
  ctx.sink = config_.tiers.sink_tokens;
  ctx.window = config_.tiers.window_tokens;
  ctx.params = AttnParams{dims_.group, d, config_.model.kv_dtype, dims_.scale};
  if (prime_.rows > 0) {
    const int prime = std::min(prime_.rows, rows);
    PrimeArgs a;
    a.params = ctx.params;
    a.num_kv_heads = hkv;
    a.q = io_.q_f32 + static_cast<int64_t>(rows - prime) * gd;
    a.q_head_stride = rows * gd;
    a.rows = prime;
    a.t_first = new_len - prime;
    a.n = new_len;
    a.sink = std::min<int64_t>(ctx.sink, new_len);
    a.off_hi = std::max<int64_t>(a.sink, new_len - ctx.window);
    if (device_->backend() == Backend::kCuda) {
      // The kernel reads every row two or three times: stage the layer's rows in device memory
      // first (one PCIe pass; the staging belongs to whichever chunk ran last). Read through the
      // host store's page table instead, over PCIe, it took 46 ms a layer at 32K on the H100.
      // (Unless the chunk that just ran left them there.)
      if (!(prefill_.staged.slot == slot && prefill_.staged.layer == layer && prefill_.staged.rows == new_len)) {
        KVF_RETURN_IF_ERROR(StageLayerPages(slot, layer, new_len, stream));
      }
      a.store = StoreTable{prefill_.pages_dev, prefill_.max_pages, store_->shape().page_tokens};
    } else {
      a.store = StoreTable{store_->pages(slot, layer, 0).pages, store_->max_pages(), store_->shape().page_tokens};
    }
    a.tables = prime_.tables_dev;
    a.table_stride = prime_.table_stride;
    a.stats = prime_.stats_dev;
    a.scratch = prime_.scratch;
    a.scratch_bytes = prime_.scratch_bytes;
    KVF_RETURN_IF_ERROR(device_->PrimeAttention(a, stream));
    const int64_t stats_count = PrimeStatsCount(d, dims_.group);
    for (int h = 0; h < hkv; ++h) {
      KVF_RETURN_IF_ERROR(device_->CopyAsync(
          prime_.tables_host + h * prime_.table_stride, prime_.tables_dev + h * prime_.table_stride,
          static_cast<size_t>(2 * new_len) * sizeof(float), stream));
    }
    KVF_RETURN_IF_ERROR(device_->CopyAsync(prime_.stats_host, prime_.stats_dev,
                                           static_cast<size_t>(hkv * stats_count) * sizeof(double),
                                           stream));
    KVF_RETURN_IF_ERROR(HostWaitStream(stream));
    stats_.bytes_d2h += hkv * (2 * new_len * 4 + stats_count * 8);
    // The heads' O(n) finishing (and an O(n d) scan shadow) on the pool: their states are
    // independent.
    std::vector<Status> head_status(static_cast<size_t>(hkv));
    pool_->ParallelFor(hkv, [&](int64_t h) {
      PrefillContext head_ctx = ctx;
      head_ctx.kv_head = static_cast<int>(h);
      head_ctx.kv = store_->pages(slot, layer, static_cast<int>(h));
      PrimedStats primed;
      primed.ver = prime_.tables_host + h * prime_.table_stride;
      primed.sla = primed.ver + new_len;
      primed.stats = prime_.stats_host + h * stats_count;
      primed.rows = prime;
      head_status[static_cast<size_t>(h)] = policy_->OnPrefillPrimed(head_ctx, primed);
    });
    for (Status& st : head_status) KVF_RETURN_IF_ERROR(std::move(st));
    KVF_RETURN_IF_ERROR(CopyScanShadow(slot, layer, stream));
  } else {
    const int64_t nq = static_cast<int64_t>(rows) * config_.model.num_q_heads * d;
    KVF_RETURN_IF_ERROR(device_->CopyAsync(io_.q_host, io_.q_f32, static_cast<size_t>(nq) * 4, stream));
    KVF_RETURN_IF_ERROR(HostWaitStream(stream));
    if (device_->backend() != Backend::kHost) stats_.bytes_d2h += nq * 4;
    for (int h = 0; h < hkv; ++h) {
      ctx.kv_head = h;
      ctx.q = io_.q_host + h * rows * gd;
      ctx.kv = store_->pages(slot, layer, h);
      KVF_RETURN_IF_ERROR(policy_->OnPrefill(ctx));
    }
    KVF_RETURN_IF_ERROR(CopyScanShadow(slot, layer, stream));
  }
  return Status::Ok();
}

Status RuntimeImpl::ReserveChunk(SequenceId seq, int slot, int layer, int64_t new_len) {
  KVF_CHECK_CODE(new_len <= config_.capacity.max_tokens_per_sequence,
                 StatusCode::kResourceExhausted, "sequence ", seq, " would hold ", new_len,
                 " tokens at layer ", layer, ", over max_tokens_per_sequence ",
                 config_.capacity.max_tokens_per_sequence);
  RetirePlan();
  if (WindowOf(layer) > 0) return Status::Ok();  // a sliding-window layer has no host-store page
  return store_->Reserve(slot, layer, new_len);
}

Status RuntimeImpl::CheckNextToken(std::span<const SequenceId> seqs, std::span<const int> slot_of,
                                   int layer) const {
  for (size_t b = 0; b < seqs.size(); ++b) {
    const int64_t len = lengths_[static_cast<size_t>(slot_of[b]) * config_.model.num_layers + layer];
    KVF_CHECK_CODE(len > 0, StatusCode::kFailedPrecondition, "sequence ", seqs[b],
                   " has no prefill at layer ", layer, ": decode before prefill");
    KVF_CHECK_CODE(len + 1 <= config_.capacity.max_tokens_per_sequence,
                   StatusCode::kResourceExhausted, "sequence ", seqs[b], " is full at layer ",
                   layer, " (max_tokens_per_sequence ", config_.capacity.max_tokens_per_sequence, ")");
  }
  return Status::Ok();
}

Status RuntimeImpl::ReserveNextToken(std::span<const int> slot_of, int layer) {
  if (WindowOf(layer) > 0) return Status::Ok();  // a sliding-window layer has no host-store page
  for (int slot : slot_of) {
    const int64_t len = lengths_[static_cast<size_t>(slot) * config_.model.num_layers + layer];
    KVF_RETURN_IF_ERROR(store_->Reserve(slot, layer, len + 1));
  }
  return Status::Ok();
}

Status RuntimeImpl::Append(SequenceId seq, int layer, const TensorView& k, const TensorView& v,
                           StreamHandle stream) {
  const auto t0 = Clock::now();
  const ModelShape& m = config_.model;
  KVF_RETURN_IF_ERROR(CheckLayer(layer));
  KVF_ASSIGN_OR_RETURN(int slot, SlotOf(seq));
  KVF_CHECK_ARG(k.ndim == 3 && k.shape[0] >= 1, "k must be [T, ", m.num_kv_heads, ", ",
                m.head_dim, "] with T >= 1");
  const int64_t tokens = k.shape[0];
  KVF_CHECK_ARG(tokens <= config_.capacity.max_prefill_chunk, "append of ", tokens,
                " tokens exceeds max_prefill_chunk ", config_.capacity.max_prefill_chunk);
  KVF_RETURN_IF_ERROR(CheckTensor(k, "k", tokens, m.num_kv_heads));
  KVF_RETURN_IF_ERROR(CheckTensor(v, "v", tokens, m.num_kv_heads));
  int64_t& len = lengths_[static_cast<size_t>(slot) * m.num_layers + layer];
  const int64_t new_len = len + tokens;
  KVF_RETURN_IF_ERROR(ReserveChunk(seq, slot, layer, new_len));
  if (stream == nullptr) stream = stream_;
  if (WindowOf(layer) > 0) {  // a sliding-window layer: its ring only (runtime/window.cpp)
    KVF_RETURN_IF_ERROR(WindowChunk(slot, layer, nullptr, k, v, nullptr, stream, len, new_len));
    len = new_len;
    stats_.prefill_tokens += tokens;
    Stage(stats_.ms_prefill, "prefill", t0);
    return Status::Ok();
  }
  KVF_RETURN_IF_ERROR(BeginCall());
  auto append = [&]() -> Status {
    KVF_ASSIGN_OR_RETURN(const void* k_src, StageInput(k, io_.k_in, stream));
    KVF_ASSIGN_OR_RETURN(const void* v_src, StageInput(v, io_.v_in, stream));
    const int64_t n_copies = PlanAppend(slot, layer, len, tokens, new_len, k_src,
                                        DTypeSize(k.dtype), v_src, DTypeSize(v.dtype), 0,
                                        desc_.k_copies, desc_.v_copies);
    KVF_RETURN_IF_ERROR(
        CopyRowsWide(desc_.k_copies, n_copies, m.head_dim, k.dtype, m.kv_dtype, stream));
    KVF_RETURN_IF_ERROR(
        CopyRowsWide(desc_.v_copies, n_copies, m.head_dim, v.dtype, m.kv_dtype, stream));
    KVF_RETURN_IF_ERROR(SelectorStored(slot, layer, len, new_len, stream));
    return EndCall(stream);
  };
  // As in Prefill: a failure leaves the length as it was and the ring restored for it.
  Status st = append();
  if (!st.ok()) return WithRestore(std::move(st), RestoreWindow({&slot, 1}, layer, stream));
  stats_.bytes_d2h += tokens * m.num_kv_heads * 2 * static_cast<int64_t>(dims_.row_bytes);
  len = new_len;
  stats_.prefill_tokens += tokens;
  Stage(stats_.ms_prefill, "prefill", t0);
  return Status::Ok();
}

int RuntimeImpl::SelectThreads(int64_t items) const {
  // Fewer items than threads: each Select may split its scan and exact scoring into up to four
  // times its share of the pool, so that the threads whose items finish first steal ranges of the
  // slow ones (items differ by 2x in a step; measured on the GPU machine, 32-layer host-selecting step,
  // 15 pool threads: 18.7 -> 17.0 ms at 32K, and 38.5 -> 31.7 ms at 64K with 16, against the
  // even share). Enough items keep every thread busy unsplit.
  const int64_t threads = pool_->num_threads();
  if (items >= threads) return 1;
  const int64_t share = (threads + items - 1) / std::max<int64_t>(items, 1);
  return static_cast<int>(std::min<int64_t>(threads, 4 * share));
}

Status RuntimeImpl::SelectItem(int64_t item, int slot, int layer, int kv_head, int64_t n,
                               const float* q, int threads, const DeviceScanPicks* scan) {
  SelectContext ctx;
  ctx.slot = slot;
  ctx.layer = layer;
  ctx.kv_head = kv_head;
  ctx.n = n;
  ctx.sink = config_.tiers.sink_tokens;
  ctx.window = config_.tiers.window_tokens;
  ctx.budget = BudgetFor(n);
  ctx.q = q;
  ctx.params = AttnParams{dims_.group, config_.model.head_dim, config_.model.kv_dtype, dims_.scale};
  ctx.kv = store_->pages(slot, layer, kv_head);
  ctx.threads = threads;
  ctx.scan = scan;
  std::vector<int32_t>& sel = scratch_.selections[item];
  sel.clear();
  KVF_RETURN_IF_ERROR(policy_->Select(ctx, sel));
  KVF_CHECK_CODE(static_cast<int64_t>(sel.size()) <= dims_.item_cap, StatusCode::kInternal, "policy '",
                 policy_->name(), "' selected ", sel.size(), " positions, over its capacity ",
                 dims_.item_cap);
  return Status::Ok();
}

Status RuntimeImpl::Decode(std::span<const SequenceId> seqs, int layer, const TensorView& q,
                           const TensorView& k, const TensorView& v, const TensorView& out,
                           StreamHandle stream) {
  auto t0 = Clock::now();
  const ModelShape& m = config_.model;
  KVF_RETURN_IF_ERROR(CheckLayer(layer));
  const int64_t batch = static_cast<int64_t>(seqs.size());
  KVF_CHECK_ARG(batch >= 1 && batch <= config_.capacity.max_batch, "batch of ", batch,
                " sequences out of range [1, max_batch=", config_.capacity.max_batch, "]");
  KVF_RETURN_IF_ERROR(CheckTensor(q, "q", batch, m.num_q_heads));
  KVF_RETURN_IF_ERROR(CheckTensor(k, "k", batch, m.num_kv_heads));
  KVF_RETURN_IF_ERROR(CheckTensor(v, "v", batch, m.num_kv_heads));
  KVF_RETURN_IF_ERROR(CheckTensor(out, "out", batch, m.num_q_heads));
  std::vector<int>& slot_of = scratch_.batch_slots;  // thread_local would not reach the worker threads
  KVF_RETURN_IF_ERROR(CheckBatch(seqs, slot_of));
  // A sliding-window layer: its ring, no policy (runtime/window.cpp).
  if (WindowOf(layer) > 0) return WindowDecode(seqs, slot_of, layer, q, k, v, out, stream);
  // The first Decode after a prefill primes the policy (DeferPrime). Never inside a CUDA graph
  // capture (it waits for the device): the priming policies select on the host, and the planned
  // step refuses the capture below with its own message.
  // Only a step with something pending asks whether the stream is capturing.
  if (prime_.pending_rows > 0) {
    const StreamHandle s = stream == nullptr ? stream_ : stream;
    int8_t capturing = -1;  // not asked yet
    for (const int slot : slot_of) {
      if (prime_.pending[static_cast<size_t>(slot) * m.num_layers + layer].n == 0) continue;
      if (capturing < 0) capturing = device_->IsCapturing(s) ? 1 : 0;
      if (capturing == 1) break;
      KVF_RETURN_IF_ERROR(FlushPrime(slot, layer, s, false));
    }
  }
  // Policies that select on the device, CPU-placed ones on route cpu and host-selecting ones with
  // the device bank run the planned step (runtime/decode_plan.cpp).
  if (step_.fast_path || step_.cpu_step || step_.host_lists) {
    return RunDecodeStep(seqs, layer, q, k, v, out, stream);
  }
  KVF_RETURN_IF_ERROR(CheckNextToken(seqs, slot_of, layer));
  KVF_RETURN_IF_ERROR(ReserveNextToken(slot_of, layer));
  if (stream == nullptr) stream = stream_;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;

  // 1 append: write the new rows through to the store and into the resident ring; q to f32.
  KVF_RETURN_IF_ERROR(BeginCall());
  KVF_ASSIGN_OR_RETURN(const void* q_src, StageInput(q, io_.q_in, stream));
  KVF_ASSIGN_OR_RETURN(const void* k_src, StageInput(k, io_.k_in, stream));
  KVF_ASSIGN_OR_RETURN(const void* v_src, StageInput(v, io_.v_in, stream));
  for (int64_t r = 0; r < batch * hq; ++r) {
    desc_.q_copies[r] = RowCopy{io_.q_f32 + r * d, static_cast<const char*>(q_src) + r * d * DTypeSize(q.dtype)};
  }
  KVF_RETURN_IF_ERROR(device_->CopyRows(desc_.q_copies, batch * hq, d, q.dtype, DType::kF32, stream));
  int64_t n_copies = 0;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t& len = lengths_[static_cast<size_t>(slot_of[b]) * m.num_layers + layer];
    n_copies += PlanAppend(slot_of[b], layer, len, 1, len + 1, k_src, DTypeSize(k.dtype), v_src,
                           DTypeSize(v.dtype), b, desc_.k_copies + n_copies, desc_.v_copies + n_copies);
  }
  // From here the new rows are in the ring: a failure takes the token back and restores the ring
  // (RollBackDecode), so that every sequence of the batch is as before the call.
  Status appended = device_->CopyRows(desc_.k_copies, n_copies, d, k.dtype, m.kv_dtype, stream);
  if (appended.ok()) appended = device_->CopyRows(desc_.v_copies, n_copies, d, v.dtype, m.kv_dtype, stream);
  for (int64_t b = 0; b < batch; ++b) ++lengths_[static_cast<size_t>(slot_of[b]) * m.num_layers + layer];
  if (!appended.ok()) return RollBackDecode(slot_of, layer, stream, std::move(appended));
  stats_.bytes_d2h += batch * hkv * 2 * static_cast<int64_t>(dims_.row_bytes);
  Stage(stats_.ms_append, "append", t0);
  Status attended = AttendAppended(seqs, slot_of, layer, out, stream);
  if (!attended.ok()) return RollBackDecode(slot_of, layer, stream, std::move(attended));
  stats_.decode_steps += 1;
  stats_.decode_tokens += batch;
  return Status::Ok();
}

// One layer of the host path's decode (AttendAppended): the call and what its stages hand on.
struct RuntimeImpl::HostLayer {
  std::span<const int> slot_of;
  int layer;
  const TensorView& out;
  StreamHandle stream;
  int64_t batch;       // sequences
  int64_t items;       // batch * Hkv
  int64_t nq;          // batch * Hq * head_dim: the queries' (and outputs') floats
  int64_t gd;          // group * head_dim
  AttnParams params;
  Route route;         // PlannedRoute()
  int64_t cpu_items = 0;  // desc_.cpu_items in use: the items with a CPU share (HostResolve)
};

Status RuntimeImpl::AttendAppended(std::span<const SequenceId> seqs, std::span<const int> slot_of,
                                   int layer, const TensorView& out, StreamHandle stream) {
  const ModelShape& m = config_.model;
  const int64_t batch = static_cast<int64_t>(seqs.size());
  const int d = m.head_dim;
  // A policy that selects on the CPU has q there already: in auto its misses stay on the CPU
  // (only q went down; only (o, lse) comes back), as a CPU-placed policy prescribes.
  HostLayer s{slot_of, layer, out, stream, batch, batch * m.num_kv_heads,
              batch * m.num_q_heads * d, static_cast<int64_t>(dims_.group) * d,
              AttnParams{dims_.group, d, m.kv_dtype, dims_.scale}, PlannedRoute()};
  if (policy_->is_dense()) return HostDense(s);
  KVF_RETURN_IF_ERROR(HostSelect(s));   // 2 select
  KVF_RETURN_IF_ERROR(HostResolve(s));  // 3 resolve + 4 route
  KVF_RETURN_IF_ERROR(HostAttend(s));   // 5 attend
  // 6 merge, and the output in its dtype.
  const auto t0 = Clock::now();
  const bool have_cpu = s.cpu_items > 0;
  KVF_RETURN_IF_ERROR(WriteOutput(have_cpu ? io_.o_cpu_dev : nullptr,
                                  have_cpu ? io_.lse_cpu_dev : nullptr, batch * m.num_q_heads, out,
                                  stream));
  Stage(stats_.ms_merge, "merge", t0);
  HostAdmit(s);  // 7 admit
  return Status::Ok();
}

Status RuntimeImpl::HostDense(const HostLayer& s) {
  const ModelShape& m = config_.model;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t batch = s.batch, nq = s.nq, gd = s.gd;
  // Dense: every position read from the host store (full streaming), on the chosen route.
  auto t0 = Clock::now();
  const bool on_cpu = s.route == Route::kCpu;
  if (on_cpu) {
    KVF_RETURN_IF_ERROR(device_->CopyAsync(io_.q_host, io_.q_f32, nq * 4, s.stream));
    KVF_RETURN_IF_ERROR(HostWaitStream(s.stream));
  }
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = lengths_[static_cast<size_t>(s.slot_of[b]) * m.num_layers + s.layer];
    for (int h = 0; h < hkv; ++h) {
      PagedAttnItem& it = desc_.paged_items[b * hkv + h];
      const int64_t off = b * hq * d + h * gd;
      it.q = (on_cpu ? io_.q_host : io_.q_f32) + off;
      it.o = (on_cpu ? io_.o_cpu_host : io_.o_gpu) + off;
      it.lse = (on_cpu ? io_.lse_cpu_host : io_.lse_gpu) + b * hq + h * dims_.group;
      it.kv = store_->pages(s.slot_of[b], s.layer, h);
      it.q_pos0 = n - 1;
      it.num_q = 1;
      if (on_cpu) {
        stats_.rows_cpu += n;
      } else {
        stats_.rows_fetched += n;
        stats_.bytes_h2d += n * 2 * static_cast<int64_t>(dims_.row_bytes);
      }
      stats_.rows_selected += n;
    }
  }
  if (on_cpu) {
    pool_->ParallelFor(s.items, [&](int64_t i) {
      AttendTimed([&] { cpu::AttendPaged(s.params, &desc_.paged_items[i], 1); });
    });
    KVF_RETURN_IF_ERROR(device_->CopyAsync(io_.o_gpu, io_.o_cpu_host, nq * 4, s.stream));
    KVF_RETURN_IF_ERROR(device_->CopyAsync(io_.lse_gpu, io_.lse_cpu_host, batch * hq * 4, s.stream));
    stats_.bytes_d2h += nq * 4;
    stats_.bytes_h2d += (nq + batch * hq) * 4;
    Stage(stats_.ms_attend_cpu, "attend_cpu", t0);
  } else {
    KVF_RETURN_IF_ERROR(device_->AttendPaged(s.params, desc_.paged_items, s.items, s.stream));
    Stage(stats_.ms_attend_gpu, "attend_gpu", t0);
  }
  t0 = Clock::now();
  KVF_RETURN_IF_ERROR(WriteOutput(nullptr, nullptr, batch * hq, s.out, s.stream));
  Stage(stats_.ms_merge, "merge", t0);
  return Status::Ok();
}

Status RuntimeImpl::HostSelect(const HostLayer& s) {
  const ModelShape& m = config_.model;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  // 2 select: the policy runs on the host over the f32 queries.
  const auto t0 = Clock::now();
  KVF_RETURN_IF_ERROR(device_->CopyAsync(io_.q_host, io_.q_f32, s.nq * 4, s.stream));
  KVF_RETURN_IF_ERROR(HostWaitStream(s.stream));
  stats_.bytes_d2h += s.nq * 4;
  const int select_threads = SelectThreads(s.items);
  pool_->ParallelFor(s.items, [&](int64_t i) {
    const int64_t b = i / hkv;
    const int h = static_cast<int>(i % hkv);
    scratch_.item_status[i] = SelectItem(i, s.slot_of[b], s.layer, h,
                                         lengths_[static_cast<size_t>(s.slot_of[b]) * m.num_layers + s.layer],
                                         io_.q_host + b * hq * d + h * s.gd, select_threads);
  });
  for (int64_t i = 0; i < s.items; ++i) {
    // The step failed in the policy; Decode rolls the append back.
    if (!scratch_.item_status[i].ok()) return scratch_.item_status[i];
  }
  Stage(stats_.ms_select, "select", t0);
  return Status::Ok();
}

Status RuntimeImpl::HostResolve(HostLayer& s) {
  // 3 resolve (resident tier, then token bank) + 4 route the remaining misses.
  const auto t0 = Clock::now();
  s.cpu_items = 0;
  const int64_t hits_before = bank_ ? bank_->counters().hits : 0;
  for (int64_t i = 0; i < s.items; ++i) HostResolveItem(s, i);
  if (bank_ != nullptr) {
    stats_.rows_bank_hit += bank_->counters().hits - hits_before;
    KVF_RETURN_IF_ERROR(bank_->WaitReady(s.stream));
  }
  Stage(stats_.ms_resolve, "resolve", t0);
  return Status::Ok();
}

void RuntimeImpl::HostResolveItem(HostLayer& s, int64_t i) {
  const ModelShape& m = config_.model;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int layer = s.layer;
  const int64_t b = i / hkv;
  const int h = static_cast<int>(i % hkv);
  const int slot = s.slot_of[b];
  const int64_t n = lengths_[static_cast<size_t>(slot) * m.num_layers + layer];
  const std::vector<int32_t>& sel = scratch_.selections[i];
  last_selection_[(static_cast<size_t>(slot) * m.num_layers + layer) * hkv + h].assign(sel.begin(), sel.end());
  const void** gk = desc_.gpu_k_rows + i * dims_.item_cap;
  const void** gv = desc_.gpu_v_rows + i * dims_.item_cap;
  int32_t n_gpu = 0;
  std::vector<int32_t>& offloaded = scratch_.offloaded[i];
  offloaded.clear();
  for (int32_t pos : sel) {
    const int64_t row = ResidentRow(pos, n);
    if (row >= 0) {
      gk[n_gpu] = ResidentK(slot, layer, h, row);
      gv[n_gpu++] = ResidentV(slot, layer, h, row);
    } else {
      offloaded.push_back(pos);
    }
  }
  stats_.rows_resident += n_gpu;
  std::vector<int32_t>& misses = scratch_.misses[i];
  misses.resize(offloaded.size());
  int64_t n_miss = static_cast<int64_t>(offloaded.size());
  if (bank_ != nullptr && !offloaded.empty()) {
    const TokenBank::ResolveCounts rc =
        bank_->Resolve(bank_->TableIndex(slot, layer, h), offloaded, gk + n_gpu, gv + n_gpu,
                       nullptr, misses.data());
    n_gpu += static_cast<int32_t>(rc.hits);
    n_miss = rc.misses;
  } else {
    std::copy(offloaded.begin(), offloaded.end(), misses.begin());
  }
  misses.resize(static_cast<size_t>(n_miss));
  const int64_t to_cpu = CpuShare(s.route, cost_, n_miss);
  const int64_t to_gpu = n_miss - to_cpu;
  const void** ck = desc_.cpu_k_rows + s.cpu_items * dims_.item_cap;
  const void** cv = desc_.cpu_v_rows + s.cpu_items * dims_.item_cap;
  int32_t n_cpu = 0;
  for (int64_t j = 0; j < n_miss; ++j) {
    const int32_t pos = misses[j];
    if (j < to_gpu) {
      gk[n_gpu] = store_->k_row(slot, layer, h, pos);
      gv[n_gpu++] = store_->v_row(slot, layer, h, pos);
    } else {
      ck[n_cpu] = store_->k_row(slot, layer, h, pos);
      cv[n_cpu++] = store_->v_row(slot, layer, h, pos);
    }
  }
  misses.resize(static_cast<size_t>(to_gpu));  // what crossed PCIe: candidates for the bank
  stats_.rows_fetched += to_gpu;
  stats_.rows_cpu += to_cpu;
  stats_.bytes_h2d += to_gpu * 2 * static_cast<int64_t>(dims_.row_bytes);
  stats_.rows_selected += static_cast<int64_t>(sel.size());
  const int64_t off = b * hq * d + h * s.gd;
  desc_.gpu_items[i] = RowAttnItem{io_.q_f32 + off, io_.o_gpu + off,
                                   io_.lse_gpu + b * hq + h * dims_.group, gk, gv, n_gpu};
  if (n_cpu > 0) {
    desc_.cpu_items[s.cpu_items++] = RowAttnItem{io_.q_host + off, io_.o_cpu_host + off,
                                                 io_.lse_cpu_host + b * hq + h * dims_.group, ck,
                                                 cv, n_cpu};
  }
}

Status RuntimeImpl::HostAttend(const HostLayer& s) {
  const int64_t batch = s.batch, nq = s.nq, hq = config_.model.num_q_heads;
  // 5 attend: the GPU part is issued first so that the CPU part overlaps it.
  auto t0 = Clock::now();
  KVF_RETURN_IF_ERROR(device_->AttendRows(s.params, desc_.gpu_items, s.items, s.stream));
  Stage(stats_.ms_attend_gpu, "attend_gpu", t0);
  if (s.cpu_items == 0) return Status::Ok();
  t0 = Clock::now();
  // Items without a CPU share contribute nothing: lse = -inf.
  std::fill_n(io_.lse_cpu_host, batch * hq, -std::numeric_limits<float>::infinity());
  std::fill_n(io_.o_cpu_host, nq, 0.0f);
  pool_->ParallelFor(s.cpu_items, [&](int64_t i) {
    AttendTimed([&] { cpu::AttendRows(s.params, &desc_.cpu_items[i], 1); });
  });
  KVF_RETURN_IF_ERROR(device_->CopyAsync(io_.o_cpu_dev, io_.o_cpu_host, nq * 4, s.stream));
  KVF_RETURN_IF_ERROR(device_->CopyAsync(io_.lse_cpu_dev, io_.lse_cpu_host, batch * hq * 4, s.stream));
  stats_.bytes_h2d += (nq + batch * hq) * 4;
  Stage(stats_.ms_attend_cpu, "attend_cpu", t0);
  return Status::Ok();
}

void RuntimeImpl::HostAdmit(const HostLayer& s) {
  const int hkv = config_.model.num_kv_heads;
  const auto t0 = Clock::now();
  // 7 admit: rows that crossed PCIe this step may enter the bank, copied on the side stream after
  // the step's reads of the bank (off the critical path).
  if (bank_ != nullptr) {
    // Admission only saves later fetches: when the bank cannot take the rows (an event or copy
    // fails), the step's output stands, the bank forgets the batch (TokenBank::CommitAdmit) and
    // later steps fetch those rows from the host store again. No token is lost.
    Status admit = device_->RecordEvent(bank_step_done_, s.stream);
    if (admit.ok()) admit = bank_->BeginAdmit(side_stream_, bank_step_done_);
    for (int64_t i = 0; admit.ok() && i < s.items; ++i) {
      const std::vector<int32_t>& fetched = scratch_.misses[i];
      if (fetched.empty()) continue;
      const int slot = s.slot_of[i / hkv];
      const int h = static_cast<int>(i % hkv);
      // The fetched rows' addresses are the first entries after the resident and hit rows.
      const RowAttnItem& it = desc_.gpu_items[i];
      const int64_t first = it.count - static_cast<int64_t>(fetched.size());
      bank_->Admit(bank_->TableIndex(slot, s.layer, h), fetched,
                   it.k_rows + first, it.v_rows + first);
    }
    if (admit.ok()) admit = bank_->CommitAdmit();
    if (!admit.ok()) ++stats_.bank_admit_failures;
    stats_.bank_admitted = bank_->counters().admitted;
    stats_.bank_evicted = bank_->counters().evicted;
  }
  Stage(stats_.ms_admit, "admit", t0);
}

Status RuntimeImpl::WriteOutput(const float* o_b, const float* lse_b, int64_t rows,
                                const TensorView& out, StreamHandle stream) {
  const bool direct = out.where == MemoryKind::kDevice || device_->backend() == Backend::kHost;
  void* dst = direct ? out.data : io_.out_stage;
  KVF_RETURN_IF_ERROR(device_->MergeLse(io_.o_gpu, io_.lse_gpu, o_b, lse_b, rows, config_.model.head_dim,
                                        dst, out.dtype, stream));
  if (!direct) {
    const size_t bytes = static_cast<size_t>(rows) * config_.model.head_dim * DTypeSize(out.dtype);
    KVF_RETURN_IF_ERROR(device_->CopyAsync(out.data, io_.out_stage, bytes, stream));
  }
  KVF_RETURN_IF_ERROR(EndCall(stream));
  // Host-memory outputs are complete when Decode returns.
  if (out.where == MemoryKind::kHost) KVF_RETURN_IF_ERROR(HostWaitStream(stream));
  return Status::Ok();
}

Result<std::vector<int32_t>> RuntimeImpl::LastSelection(SequenceId seq, int layer,
                                                        int kv_head) const {
  KVF_RETURN_IF_ERROR(CheckLayer(layer));
  KVF_ASSIGN_OR_RETURN(int slot, SlotOf(seq));
  KVF_CHECK_ARG(kv_head >= 0 && kv_head < config_.model.num_kv_heads, "kv_head ", kv_head,
                " out of range [0, ", config_.model.num_kv_heads, ")");
  if (const int w = WindowOf(layer); w > 0) {  // a sliding-window layer attends its last w
    const int64_t n = lengths_[static_cast<size_t>(slot) * config_.model.num_layers + layer];
    std::vector<int32_t> window(static_cast<size_t>(std::min<int64_t>(n, w)));
    std::iota(window.begin(), window.end(), static_cast<int32_t>(n - static_cast<int64_t>(window.size())));
    return window;
  }
  if (policy_->is_dense()) {
    const int64_t n = lengths_[static_cast<size_t>(slot) * config_.model.num_layers + layer];
    std::vector<int32_t> all(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) all[i] = static_cast<int32_t>(i);
    return all;
  }
  if (step_.fast_path && lists_.device_select) {
    // The device's list of the last step that ran this layer for the sequence.
    const std::vector<int>& slots = lists_.slots[static_cast<size_t>(layer)];
    const auto it = std::find(slots.begin(), slots.end(), slot);
    if (it == slots.end()) return std::vector<int32_t>{};
    const size_t item = static_cast<size_t>(layer) * config_.capacity.max_batch *
                            config_.model.num_kv_heads +
                        static_cast<size_t>(it - slots.begin()) * config_.model.num_kv_heads +
                        kv_head;
    // The last Decode's work (on whatever stream it ran) is done once call_done_ is.
    KVF_RETURN_IF_ERROR(device_->SynchronizeEvent(call_done_));
    int32_t count = 0;
    KVF_RETURN_IF_ERROR(device_->CopyAsync(&count, lists_.counts + item, sizeof(int32_t),
                                           stream_));
    KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
    std::vector<int32_t> sel(static_cast<size_t>(count));
    if (count > 0) {
      KVF_RETURN_IF_ERROR(device_->CopyAsync(sel.data(), lists_.positions + item * lists_.cap,
                                             sel.size() * sizeof(int32_t), stream_));
      KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
    }
    return sel;
  }
  if (step_.fast_path) {
    // The device selected from the length alone: the same rows, recomputed.
    const int64_t n = lengths_[static_cast<size_t>(slot) * config_.model.num_layers + layer];
    std::vector<int32_t> sel;
    if (n > 0) StreamingSelect(n, config_.tiers.sink_tokens, BudgetFor(n), sel);
    return sel;
  }
  return last_selection_[(static_cast<size_t>(slot) * config_.model.num_layers + layer) *
                             config_.model.num_kv_heads + kv_head];
}

Stats RuntimeImpl::stats() const {
  Stats s = stats_;
  s.host_bytes_reserved = store_->bytes_reserved();
  s.device_bytes_reserved = device_->device_bytes_held();
  s.cost_pcie_gbps = cost_.pcie_gbps;
  s.split_share = static_cast<double>(split_.last_q10) / 1024.0;
  s.xl_gap_us = xl_.gap_us;
  s.cost_cpu_gbps = cost_.cpu_gbps;
  s.ms_cpu_attend_busy = static_cast<double>(stats_aux_.cpu_attend_ns.load(std::memory_order_relaxed)) * 1e-6;
  const PolicyCounters pc = policy_->counters();
  s.select_calls = pc.select_calls - stats_aux_.policy_at_reset.select_calls;
  s.select_reused = pc.select_reused - stats_aux_.policy_at_reset.select_reused;
  s.scans_device = pc.scans_device - stats_aux_.policy_at_reset.scans_device;
  s.scans_device_short = pc.scans_device_short - stats_aux_.policy_at_reset.scans_device_short;
  // Selections timed but not yet read back (their pairs stay pending: stats_ adds them later).
  for (const TimingPair& t : timing_.select.pairs) s.ms_select_device += TimingMs(t);
  for (const TimingPair& t : timing_.attend.pairs) s.ms_attend_device += TimingMs(t);
  s.cost_h2d_gbps = cost_.h2d_gbps;
  s.cost_hbm_gbps = cost_.hbm_gbps;
  // The device's rates as the timed calls measured them, beside the model's (cost_hbm_gbps,
  // cost_pcie_gbps): key bytes a device selection read, K/V bytes a step attended.
  const auto gbps = [](double bytes, double ms) { return ms > 0 && bytes > 0 ? bytes / (ms * 1e-3) * 1e-9 : 0.0; };
  s.cost_select_gbps_measured = gbps(static_cast<double>(timing_.select_key_bytes), s.ms_select_device);
  s.cost_attend_gbps_measured = gbps(static_cast<double>(timing_.attend_bytes), s.ms_attend_device);
  if (step_bank_ != nullptr) {
    // The device bank's counters (a read-back that waits for the device). Its misses are the rows
    // the step read from the host store.
    Result<StepBankTotals> t = step_bank_->Totals();
    if (t.ok()) {
      const StepBankTotals& z = stats_aux_.bank_totals_at_reset;
      s.rows_bank_hit += t.value().hits - z.hits;
      s.rows_fetched += t.value().misses - z.misses;
      // (Host lists count their resident rows on the host.)
      if (lists_.device_select) {
        s.rows_resident +=
            stats_aux_.bank_step_selected - (t.value().hits - z.hits) - (t.value().misses - z.misses);
      }
      s.bytes_h2d += (t.value().misses - z.misses) * 2 * static_cast<int64_t>(dims_.row_bytes);
      s.bank_admitted += t.value().admitted - z.admitted;
      s.bank_evicted += t.value().evicted - z.evicted;
    }
  }
  // The CPU route's rate as the steps measured it, beside the probed one.
  if (s.ms_cpu_attend_busy > 0 && s.rows_cpu > 0) {
    const double bytes = static_cast<double>(s.rows_cpu) * 2.0 * static_cast<double>(dims_.row_bytes);
    s.cost_cpu_gbps_measured = gbps(bytes, s.ms_cpu_attend_busy) * std::max(1, pool_->num_threads());
  }
  return s;
}

}  // namespace detail

// ---- public facade ---------------------------------------------------------------------------

Runtime::Runtime(std::unique_ptr<detail::RuntimeImpl> impl) : impl_(std::move(impl)) {}
Runtime::~Runtime() = default;

Result<std::unique_ptr<Runtime>> Runtime::Create(const RuntimeConfig& config) {
  KVF_ASSIGN_OR_RETURN(auto impl, detail::RuntimeImpl::Create(config));
  return std::unique_ptr<Runtime>(new Runtime(std::move(impl)));
}
// Every call that reads or writes the runtime's state takes the runtime's mutex once, for the
// whole call (see the contract on Runtime), and first collects a CPU part still running from the
// call before (RuntimeConfig::async_cpu). config() and backend() read what Create fixed.
namespace {
template <class F>
auto Locked(detail::RuntimeImpl& impl, F&& call) -> decltype(call()) {
  const std::lock_guard<std::mutex> lock(impl.mutex());
  KVF_RETURN_IF_ERROR(impl.CollectCpuPart());
  return call();
}
}  // namespace

Status Runtime::AddSequence(SequenceId seq) {
  return Locked(*impl_, [&] { return impl_->AddSequence(seq); });
}
Status Runtime::RemoveSequence(SequenceId seq) {
  return Locked(*impl_, [&] { return impl_->RemoveSequence(seq); });
}
Result<int64_t> Runtime::SequenceLength(SequenceId seq, int layer) const {
  return Locked(*impl_, [&] { return impl_->SequenceLength(seq, layer); });
}
Status Runtime::Prefill(SequenceId seq, int layer, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, StreamHandle stream) {
  return Locked(*impl_, [&] { return impl_->Prefill(seq, layer, q, k, v, out, stream); });
}
Status Runtime::Decode(std::span<const SequenceId> seqs, int layer, const TensorView& q,
                       const TensorView& k, const TensorView& v, const TensorView& out,
                       StreamHandle stream) {
  return Locked(*impl_, [&] { return impl_->Decode(seqs, layer, q, k, v, out, stream); });
}
Status Runtime::Append(SequenceId seq, int layer, const TensorView& k, const TensorView& v,
                       StreamHandle stream) {
  return Locked(*impl_, [&] { return impl_->Append(seq, layer, k, v, stream); });
}
Status Runtime::PlanDecode(std::span<const SequenceId> seqs, StreamHandle stream) {
  return Locked(*impl_, [&] { return impl_->PlanDecode(seqs, stream); });
}
bool Runtime::decode_is_capture_safe() const { return impl_->decode_is_capture_safe(); }
bool Runtime::prefill_reads_queries() const { return impl_->prefill_reads_queries(); }
Result<std::vector<int32_t>> Runtime::LastSelection(SequenceId seq, int layer, int kv_head) const {
  return Locked(*impl_, [&] { return impl_->LastSelection(seq, layer, kv_head); });
}
Status Runtime::Synchronize() {
  return Locked(*impl_, [&] { return impl_->Synchronize(); });
}
Status Runtime::TimeDeviceSelect(bool on) {
  return Locked(*impl_, [&] { return impl_->TimeDeviceSelect(on); });
}
Status Runtime::StartTrace(int64_t max_events) {
  return Locked(*impl_, [&] { return impl_->StartTrace(max_events); });
}
Status Runtime::WriteTrace(const std::string& path) {
  return Locked(*impl_, [&] { return impl_->WriteTrace(path); });
}
Stats Runtime::GetStats() const {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  impl_->WaitCpuPart();
  return impl_->stats();
}
void Runtime::ResetStats() {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  impl_->WaitCpuPart();
  impl_->ResetStats();
}
const RuntimeConfig& Runtime::config() const { return impl_->config(); }
const DeviceMemoryPlan& Runtime::device_memory() const { return impl_->device_memory(); }
Backend Runtime::backend() const { return impl_->backend(); }

}  // namespace kvferry
