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
  for (EventHandle e : plan_events_) device_->DestroyEvent(e);
  for (EventHandle e : list_up_) {
    if (e != nullptr) device_->DestroyEvent(e);
  }
  DestroyTimings();
  for (EventHandle e : {q_ready_, cpu_part_up_, scan_ready_, prefill_items_done_[0],
                        prefill_items_done_[1]}) {
    if (e != nullptr) device_->DestroyEvent(e);
  }
  if (admit_stream_ != nullptr) {  // admissions write the bank: done before it goes
    device_->SynchronizeStream(admit_stream_).IgnoreError();
    for (EventHandle e : {admit_fork_[0], admit_fork_[1], admit_done_[0], admit_done_[1], admit_join_}) {
      device_->DestroyEvent(e);
    }
    for (EventHandle e : {prefetch_fork_, prefetch_done_}) {
      if (e != nullptr) device_->DestroyEvent(e);
    }
    device_->DestroyStream(admit_stream_);
  }
  step_bank_.reset();
  if (selector_ != nullptr) selector_->Release();  // its side stream, before the buffers go
  if (prefill_copy_stream_ != nullptr) {
    device_->SynchronizeStream(prefill_copy_stream_).IgnoreError();
    device_->DestroyEvent(prefill_fork_);
    for (EventHandle e : prefill_segment_done_) device_->DestroyEvent(e);
    for (EventHandle e : {prefill_next_ready_, prefill_call_start_}) {
      if (e != nullptr) device_->DestroyEvent(e);
    }
    device_->DestroyStream(prefill_copy_stream_);
  }
  if (prefill_write_stream_ != nullptr) {
    device_->SynchronizeStream(prefill_write_stream_).IgnoreError();
    device_->DestroyEvent(prefill_write_ready_);
    device_->DestroyEvent(prefill_write_done_);
    device_->DestroyStream(prefill_write_stream_);
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
  KVF_ASSIGN_OR_RETURN(policy_, MakePolicy(config_));
  cpu::CpuPoolOptions pool_options;
  pool_options.threads = config_.cpu_threads;
  pool_options.gpu_pci_bus_id = device_->pci_bus_id();
  KVF_ASSIGN_OR_RETURN(pool_, cpu::CpuPool::Create(pool_options));

  group_ = m.num_q_heads / m.num_kv_heads;
  scale_ = m.softmax_scale > 0.0f ? m.softmax_scale : 1.0f / std::sqrt(static_cast<float>(m.head_dim));
  kv_elem_ = DTypeSize(m.kv_dtype);
  row_bytes_ = static_cast<size_t>(m.head_dim) * kv_elem_;
  const Capacity& cap = config_.capacity;
  max_rows_ = std::max<int64_t>(cap.max_prefill_chunk, cap.max_batch);
  if (!policy_->is_dense()) {
    // Room for the resident rows on top of the budget: a policy that always attends the sinks
    // and the window (lfps) may return more than a budget smaller than they are.
    budget_max_ = ItemBudgetMax(config_);
    item_cap_ = ItemListCap(config_);
  }
  // The policy's device selection state, sized below where the planned step selects on the device.
  selector_ = MakeDeviceSelector(*policy_, SelectorShapeOf());

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
  const DeviceBufferSizes& z = sizes_;

  store_ = std::make_unique<HostStore>(device_.get(), StoreShape());
  KVF_RETURN_IF_ERROR(store_->Init());
  KVF_RETURN_IF_ERROR(store_->Prepin(cap.host_bytes_at_create));

  const int64_t hq = m.num_q_heads, hkv = m.num_kv_heads;
  KVF_ASSIGN_OR_RETURN(void* resident, Alloc(z.resident, false));
  resident_ = static_cast<char*>(resident);

  const size_t act_q = static_cast<size_t>(max_rows_ * hq * m.head_dim);
  KVF_ASSIGN_OR_RETURN(q_in_, Alloc(z.q_in, false));
  KVF_ASSIGN_OR_RETURN(k_in_, Alloc(z.k_in, false));
  KVF_ASSIGN_OR_RETURN(v_in_, Alloc(z.v_in, false));
  KVF_ASSIGN_OR_RETURN(out_stage_, Alloc(z.out_stage, false));
  void* p = nullptr;
  KVF_ASSIGN_OR_RETURN(p, Alloc(z.q_f32, false));
  q_f32_ = static_cast<float*>(p);
  KVF_ASSIGN_OR_RETURN(p, Alloc(z.o_gpu, false));
  o_gpu_ = static_cast<float*>(p);
  KVF_ASSIGN_OR_RETURN(p, Alloc(z.lse_gpu, false));
  lse_gpu_ = static_cast<float*>(p);
  const size_t batch_q = static_cast<size_t>(cap.max_batch * hq * m.head_dim);
  KVF_ASSIGN_OR_RETURN(p, Alloc(z.o_cpu, false));
  o_cpu_dev_ = static_cast<float*>(p);
  KVF_ASSIGN_OR_RETURN(p, Alloc(z.lse_cpu, false));
  lse_cpu_dev_ = static_cast<float*>(p);

  KVF_ASSIGN_OR_RETURN(p, Alloc(act_q * 4, true));
  q_host_ = static_cast<float*>(p);
  KVF_ASSIGN_OR_RETURN(p, Alloc(batch_q * 4, true));
  o_cpu_host_ = static_cast<float*>(p);
  KVF_ASSIGN_OR_RETURN(p, Alloc(static_cast<size_t>(cap.max_batch * hq) * 4, true));
  lse_cpu_host_ = static_cast<float*>(p);
  const size_t rows = static_cast<size_t>(max_rows_);
  KVF_ASSIGN_OR_RETURN(p, Alloc(rows * hkv * 2 * sizeof(RowCopy), true));
  k_copies_ = static_cast<RowCopy*>(p);
  KVF_ASSIGN_OR_RETURN(p, Alloc(rows * hkv * 2 * sizeof(RowCopy), true));
  v_copies_ = static_cast<RowCopy*>(p);
  KVF_ASSIGN_OR_RETURN(p, Alloc(rows * hq * sizeof(RowCopy), true));
  q_copies_ = static_cast<RowCopy*>(p);
  KVF_ASSIGN_OR_RETURN(p, Alloc(rows * hkv * sizeof(RowCopy), true));
  o_copies_ = static_cast<RowCopy*>(p);
  KVF_ASSIGN_OR_RETURN(call_done_, device_->CreateEvent());
  const size_t items = static_cast<size_t>(std::max<int64_t>(cap.max_batch, 1) * hkv);
  KVF_ASSIGN_OR_RETURN(p, Alloc(items * sizeof(RowAttnItem), true));
  gpu_items_ = static_cast<RowAttnItem*>(p);
  KVF_ASSIGN_OR_RETURN(p, Alloc(items * sizeof(RowAttnItem), true));
  cpu_items_ = static_cast<RowAttnItem*>(p);
  KVF_ASSIGN_OR_RETURN(p, Alloc(std::max<size_t>(items, static_cast<size_t>(hkv)) * sizeof(PagedAttnItem), true));
  paged_items_ = static_cast<PagedAttnItem*>(p);
  const size_t row_ptrs = items * static_cast<size_t>(std::max<int64_t>(item_cap_, 1));
  for (const void*** dst : {&gpu_k_rows_, &gpu_v_rows_, &cpu_k_rows_, &cpu_v_rows_}) {
    KVF_ASSIGN_OR_RETURN(p, Alloc(row_ptrs * sizeof(void*), true));
    *dst = static_cast<const void**>(p);
  }

  KVF_RETURN_IF_ERROR(InitWindowBuffers());
  // Which bank (SizeDeviceBuffers says why): the device bank read by the planned step, the
  // host-managed one, or none.
  host_lists_ = z.host_lists;
  if (z.device_bank) {
    KVF_ASSIGN_OR_RETURN(step_bank_,
                         device_->CreateStepBank(StepBankConfigFor(config_.tiers.bank_slots)));
  } else if (z.host_bank) {
    KVF_ASSIGN_OR_RETURN(
        bank_, TokenBank::Create(device_.get(), TokenBankConfigFor(config_.tiers.bank_slots)));
    KVF_ASSIGN_OR_RETURN(side_stream_, device_->CreateStream());
    KVF_ASSIGN_OR_RETURN(bank_step_done_, device_->CreateEvent());
  }
  offloaded_.resize(items);
  misses_.resize(items);
  for (auto& v : offloaded_) v.reserve(static_cast<size_t>(item_cap_));
  for (auto& v : misses_) v.reserve(static_cast<size_t>(item_cap_));
  if (device_->backend() == Backend::kCuda) {
    // Prefill staging: one layer's pages of one sequence in device memory, and their page table.
    max_pages_ = z.max_pages;
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.prefill_scratch, false));
    prefill_scratch_ = static_cast<char*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(static_cast<size_t>(hkv * max_pages_) * sizeof(void*), true));
    prefill_pages_host_ = static_cast<void**>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.prefill_pages, false));
    prefill_pages_dev_ = static_cast<void**>(p);
    page_copy_dst_.reserve(static_cast<size_t>(hkv * max_pages_));
    page_copy_src_.reserve(static_cast<size_t>(hkv * max_pages_));
    page_copy_bytes_.reserve(static_cast<size_t>(hkv * max_pages_));
    if (z.prefill_prefetch) {
      KVF_ASSIGN_OR_RETURN(p, Alloc(z.prefill_next, false));
      prefill_next_ = static_cast<char*>(p);
      KVF_ASSIGN_OR_RETURN(p, Alloc(z.prefill_next_pages, false));
      prefill_next_pages_dev_ = static_cast<void**>(p);
      KVF_ASSIGN_OR_RETURN(prefill_next_ready_, device_->CreateEvent());
      KVF_ASSIGN_OR_RETURN(prefill_call_start_, device_->CreateEvent());
    }
    // Each staging's page table maps head h's page p to its fixed place in it (the kernels that
    // read a staging through a page table: priming, the CUDA-core prefill).
    {
      const int64_t page_bytes = store_->page_bytes();
      for (auto [table, staging] : {std::pair{prefill_pages_dev_, prefill_scratch_},
                                    std::pair{prefill_next_pages_dev_, prefill_next_}}) {
        if (table == nullptr) continue;
        for (int64_t i = 0; i < hkv * max_pages_; ++i) prefill_pages_host_[i] = staging + i * page_bytes;
        KVF_RETURN_IF_ERROR(device_->CopyAsync(table, prefill_pages_host_,
                                               static_cast<size_t>(hkv * max_pages_) * sizeof(void*),
                                               stream_));
        KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
      }
    }
    if (z.prefill_tensor_cores) {
      prefill_items_bytes_ =
          static_cast<size_t>((1 + kPrefillMaxSegments) * hkv) * kPrefillItemBytes;
      KVF_ASSIGN_OR_RETURN(prefill_items_, Alloc(2 * prefill_items_bytes_, true));
      for (EventHandle& e : prefill_items_done_) {
        KVF_ASSIGN_OR_RETURN(e, device_->CreateEvent());
      }
      if (z.prefill_copy_stream) {
        KVF_ASSIGN_OR_RETURN(prefill_copy_stream_, device_->CreateStream());
        KVF_ASSIGN_OR_RETURN(prefill_fork_, device_->CreateEvent());
        prefill_segment_done_.assign(kPrefillMaxSegments, nullptr);
        for (EventHandle& e : prefill_segment_done_) {
          KVF_ASSIGN_OR_RETURN(e, device_->CreateEvent());
        }
        prefill_copy_scratch_.assign(
            PrefillCopyScratchBytes(hkv, store_->max_pages()) / sizeof(void*), nullptr);
      }
      if (z.prefill_write_stream) {
        KVF_ASSIGN_OR_RETURN(prefill_write_stream_, device_->CreateStream());
        KVF_ASSIGN_OR_RETURN(prefill_write_ready_, device_->CreateEvent());
        KVF_ASSIGN_OR_RETURN(prefill_write_done_, device_->CreateEvent());
        prefill_write_scratch_.assign(
            2 * PrefillCopyScratchBytes(hkv, store_->max_pages()) / sizeof(void*), nullptr);
      }
    }
  }
  // Priming on the device (sizes and the choice: SizeDeviceBuffers).
  if (z.prime_rows > 0) {
    prime_rows_ = z.prime_rows;
    prime_table_stride_ = z.prime_table_stride;
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.prime_tables, false));
    prime_tables_dev_ = static_cast<float*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.prime_tables, true));
    prime_tables_host_ = static_cast<float*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.prime_stats, false));
    prime_stats_dev_ = static_cast<double*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.prime_stats, true));
    prime_stats_host_ = static_cast<double*>(p);
    if (z.prime_scratch > 0) {
      prime_scratch_bytes_ = z.prime_scratch;
      KVF_ASSIGN_OR_RETURN(prime_scratch_, Alloc(prime_scratch_bytes_, false));
      // The tensor-core prefill stages pages at fixed places; the priming kernel reads them
      // through the staging's page table (made above).
    }
  }
  // LFPS's scan on the device (sizes and the choice: SizeDeviceBuffers). A GPU that cannot hold
  // its shadow now (other work on it) leaves it out: the policy scans on the host.
  if (z.device_scan) {
    Result<void*> shadow = Alloc(z.scan_shadow, false);
    if (!shadow.ok()) {
      sizes_.DropScan();
      device_plan_ = sizes_.Plan(cap.gpu_bytes);
    } else {
      scan_shadow_ = static_cast<int8_t*>(shadow.value());
    }
  }
  if (z.device_scan) {
    device_scan_ = true;
    scan_picks_cap_ = z.scan_picks;
    scan_list_cap_ = z.scan_list_cap;
    scan_channels_ = static_cast<int>(std::min<int64_t>(policy_->device_scan_channels(), m.head_dim));
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.scan_scale, false));
    scan_scale_ = static_cast<float*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.scan_keys, false));
    scan_keys_ = static_cast<uint32_t*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.scan_ints, false));
    scan_ints_ = static_cast<int32_t*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.scan_hist, false));
    scan_hist_ = static_cast<uint32_t*>(p);
    {  // the histograms start at zero (each scan leaves them so)
      const std::vector<uint32_t> zeros(z.scan_hist / sizeof(uint32_t), 0u);
      KVF_RETURN_IF_ERROR(device_->CopyAsync(scan_hist_, zeros.data(), z.scan_hist, stream_));
      KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
    }
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.scan_blocks, false));
    scan_blocks_ = static_cast<int32_t*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.scan_counts, true));
    scan_counts_host_ = static_cast<int32_t*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.scan_items, false));
    scan_items_dev_ = static_cast<LfpsScanItem*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.scan_items, true));
    scan_items_host_ = static_cast<LfpsScanItem*>(p);
    KVF_ASSIGN_OR_RETURN(p, Alloc(z.scan_out, true));
    scan_out_host_ = static_cast<uint64_t*>(p);
    KVF_ASSIGN_OR_RETURN(scan_ready_, device_->CreateEvent());
    scan_rows_.assign(static_cast<size_t>(cap.max_sequences) * m.num_layers, 0);
    scan_view_.assign(static_cast<size_t>(std::max<int64_t>(cap.max_batch, 1) * hkv), {});
  }
  // Priming deferred to the first Decode (DeferPrime): the kept rows are pinned per slot, made at
  // the slot's first primed prefill.
  if (policy_->prime_rows() > 0 && (prime_rows_ > 0 || policy_->wants_prefill_queries())) {
    pending_rows_ = static_cast<int>(
        std::min<int64_t>(policy_->prime_rows(), config_.capacity.max_prefill_chunk));
    pending_prime_.assign(static_cast<size_t>(config_.capacity.max_sequences) * m.num_layers, {});
    pending_q_.assign(static_cast<size_t>(config_.capacity.max_sequences), nullptr);
    const char* eager = std::getenv("KVFERRY_PRIME_EAGER");
    prime_eager_ = eager != nullptr && std::string_view(eager) == "1";
  }
  // Off by default: on the GPU machine (lfps@2%, three runs each) 500 us of spinning
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
  selections_.resize(items);
  for (auto& s : selections_) s.reserve(static_cast<size_t>(item_cap_));
  last_selection_.resize(static_cast<size_t>(cap.max_sequences) * m.num_layers * hkv);
  item_status_.resize(items);
  lengths_.assign(static_cast<size_t>(cap.max_sequences) * m.num_layers, 0);
  for (int s = cap.max_sequences - 1; s >= 0; --s) free_slots_.push_back(s);
  return Status::Ok();
}

Status RuntimeImpl::ProbeCosts() {
  // CPU route: the pool attends random rows of a buffer larger than a core's caches, as it would
  // host-store rows; rate in GB/s of K and V rows read.
  const int d = config_.model.head_dim;
  const int64_t rows = std::max<int64_t>(4096, (int64_t{16} << 20) / static_cast<int64_t>(2 * row_bytes_));
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
  std::vector<float> q(static_cast<size_t>(threads) * group_ * d, 0.01f), o(q.size()),
      lse(static_cast<size_t>(threads) * group_);
  std::vector<RowAttnItem> items(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    items[t] = RowAttnItem{q.data() + t * group_ * d, o.data() + t * group_ * d, lse.data() + t * group_,
                           k_rows.data() + t * per_item, v_rows.data() + t * per_item,
                           static_cast<int32_t>(per_item)};
  }
  const AttnParams params{group_, d, config_.model.kv_dtype, scale_};
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    pool_->ParallelFor(threads, [&](int64_t i) { cpu::AttendRows(params, &items[i], 1); });
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double bytes = static_cast<double>(threads * per_item) * 2.0 * static_cast<double>(row_bytes_);
  cost_.cpu_gbps = std::max(0.1, bytes / best * 1e-9);
  // GPU route: the zero-copy gather rate of host rows, measured on the device, with the link's
  // contiguous H2D rate and the device memory's rate (Stats::cost_h2d_gbps, cost_hbm_gbps).
  if (device_->backend() == Backend::kCuda) {
    Result<std::unique_ptr<TransferEngine>> te = TransferEngine::Create(device_.get(), 1 << 16);
    if (te.ok()) {
      Result<TransferProbe> probe = te.value()->Probe(size_t{32} << 20, static_cast<int>(row_bytes_));
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
  return std::clamp<int64_t>(b, 1, std::max<int64_t>(item_cap_, 1));
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
  if (pending_rows_ > 0) {
    std::fill_n(pending_prime_.begin() + static_cast<int64_t>(slot) * config_.model.num_layers,
                config_.model.num_layers, PendingPrime{});
  }
  if (device_scan_) {
    std::fill_n(scan_rows_.begin() + static_cast<int64_t>(slot) * config_.model.num_layers,
                config_.model.num_layers, 0);
  }
  if (staged_.slot == slot) staged_ = {};
  if (next_staged_.slot == slot) next_staged_ = {};
  if (last_prefill_.slot == slot) last_prefill_ = {};
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
  return resident_ + static_cast<size_t>(base + row) * row_bytes_;
}

char* RuntimeImpl::ResidentV(int slot, int layer, int h, int64_t row) const {
  const int64_t slot_rows = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
  return ResidentK(slot, layer, h, row) + static_cast<size_t>(slot_rows) * row_bytes_;
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
  // The device's copy of LFPS's shadow lacks the chunk's rows: made again at the next priming.
  if (device_scan_) scan_rows_[static_cast<size_t>(slot) * m.num_layers + layer] = 0;
  Status st = PrefillReserved(slot, layer, q, k, v, out, stream, pos0, new_len);
  if (!st.ok()) {
    // The kept query rows may have been overwritten by this chunk's: nothing stays pending (the
    // layer is primed again by its next successful chunk).
    if (pending_rows_ > 0) pending_prime_[static_cast<size_t>(slot) * m.num_layers + layer] = {};
    staged_ = {};
    last_prefill_ = {};
    return WithRestore(std::move(st), RestoreWindow({&slot, 1}, layer, stream));
  }
  len = new_len;
  if (prime_eager_) KVF_RETURN_IF_ERROR(FlushPrime(slot, layer, stream, true));
  stats_.prefill_tokens += tokens;
  Stage(stats_.ms_prefill, "prefill", t0);
  return Status::Ok();
}

Status RuntimeImpl::PrefillReserved(int slot, int layer, const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& out,
                                    StreamHandle stream, int64_t pos0, int64_t new_len) {
  const ModelShape& m = config_.model;
  const int64_t tokens = new_len - pos0;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  // A tensor-core chunk whose output stays on the device and whose policy reads no queries on the
  // host follows the last call on the same stream without a host wait: its device buffers are
  // ordered by the stream, its descriptors double-buffered.
  const bool chained = prefill_items_ != nullptr && prefill_items_done_[0] != nullptr &&
                       stream == last_call_stream_ && out.where == MemoryKind::kDevice &&
                       (!policy_->wants_prefill_queries() || pending_rows_ > 0) && !prime_eager_;
  if (chained) {
    const EventHandle read = prefill_items_done_[prefill_parity_];
    if (!device_->EventDone(read)) KVF_RETURN_IF_ERROR(HostWaitEvent(read));
  } else {
    KVF_RETURN_IF_ERROR(BeginCall());
  }
  const int64_t nq = tokens * hq * d;
  KVF_ASSIGN_OR_RETURN(const void* q_src, StageInput(q, q_in_, stream));
  KVF_ASSIGN_OR_RETURN(const void* k_src, StageInput(k, k_in_, stream));
  KVF_ASSIGN_OR_RETURN(const void* v_src, StageInput(v, v_in_, stream));
  const int64_t gd = static_cast<int64_t>(group_) * d;
  // q to f32, transposed to [Hkv, T, G, D] so that each KV head's queries are contiguous.
  auto transpose_q = [&]() -> Status {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int h = 0; h < hkv; ++h) {
        q_copies_[t * hkv + h] = RowCopy{
            q_f32_ + (h * tokens + t) * gd,
            static_cast<const char*>(q_src) + (t * hq + h * group_) * d * DTypeSize(q.dtype)};
      }
    }
    return CopyRowsWide(q_copies_, tokens * hkv, static_cast<int>(gd), q.dtype, DType::kF32,
                        stream);
  };
  AttnParams params{group_, d, m.kv_dtype, scale_};
  bool tensor_cores = false;
  if (prefill_items_ != nullptr) {
    // CUDA: one staging pass and the tensor-core kernel (gpu/prefill.cuh).
    KVF_RETURN_IF_ERROR(store_->FlushTable(stream));
    const int64_t rows_per_slot = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
    const int64_t t0_index = (static_cast<int64_t>(slot) * m.num_layers + layer) * hkv;
    PrefillChunkArgs a;
    PrefillStageArgs& st = a.stage;
    st.k = k_src;
    st.v = v_src;
    st.k_dtype = k.dtype;
    st.v_dtype = v.dtype;
    st.pos0 = pos0;
    st.tokens = tokens;
    st.new_len = new_len;
    st.num_kv_heads = hkv;
    st.head_dim = d;
    st.kv_dtype = m.kv_dtype;
    st.pages = store_->device_table() + t0_index * store_->max_pages();
    st.max_pages = store_->max_pages();
    st.page_tokens = store_->shape().page_tokens;
    st.resident = resident_ + static_cast<size_t>(t0_index * 2 * rows_per_slot) * row_bytes_;
    st.sink = config_.tiers.sink_tokens;
    st.window = config_.tiers.window_tokens;
    // Chunk-major: the call before this one copied this call's history into the second staging
    // (PrefetchNextHistory); it becomes the staging, the copies ordered before this chunk.
    const bool prefetched = prefill_next_ != nullptr && pos0 > 0 &&
                            next_staged_.slot == slot && next_staged_.layer == layer &&
                            next_staged_.rows == pos0;
    next_staged_ = {};
    if (prefetched) {
      std::swap(prefill_scratch_, prefill_next_);
      std::swap(prefill_pages_dev_, prefill_next_pages_dev_);
      staged_ = {slot, layer, pos0};
      KVF_RETURN_IF_ERROR(device_->WaitEvent(stream, prefill_next_ready_));
      ++stats_.prefill_chunks_prefetched;
    }
    if (prefill_next_ != nullptr) KVF_RETURN_IF_ERROR(device_->RecordEvent(prefill_call_start_, stream));
    st.staging = prefill_scratch_;
    st.staging_cap = max_pages_ * store_->shape().page_tokens;
    // A chunk that continues the one before it (same sequence and layer, nothing appended since)
    // finds the history in the staging: no PCIe pass over it (the prompt's chunks of one layer in
    // a row, as a layer-by-layer prefill issues them). Invalid until this chunk succeeds.
    st.history_staged = pos0 > 0 && staged_.slot == slot && staged_.layer == layer &&
                        staged_.rows == pos0;
    staged_ = {};
    a.params = params;
    a.num_q_heads = hq;
    a.q = q_src;
    a.q_dtype = q.dtype;
    const bool out_direct = out.where == MemoryKind::kDevice;
    a.out = out_direct ? out.data : out_stage_;
    a.out_dtype = out.dtype;
    a.q_scratch = q_in_ == q_src ? out_stage_ : q_in_;  // a free buffer of the chunk's size
    if (!out_direct && a.q_scratch == out_stage_) a.q_scratch = q_f32_;
    a.items = static_cast<char*>(prefill_items_) + prefill_parity_ * prefill_items_bytes_;
    a.items_bytes = prefill_items_bytes_;
    if (prefill_copy_stream_ != nullptr) {
      a.copy_stream = prefill_copy_stream_;
      a.fork_done = prefill_fork_;
      a.segment_done = prefill_segment_done_.data();
      a.host_pages = store_->pages(slot, layer, 0).pages;
      a.copy_scratch = prefill_copy_scratch_.data();
      a.o_acc = o_gpu_;
      a.lse_acc = lse_gpu_;
    }
    if (prefill_write_stream_ != nullptr) {
      a.host_pages = store_->pages(slot, layer, 0).pages;
      a.write_stream = prefill_write_stream_;
      a.write_ready = prefill_write_ready_;
      a.write_done = prefill_write_done_;
      a.write_scratch = prefill_write_scratch_.data();
    }
    KVF_RETURN_IF_ERROR(device_->PrefillChunk(a, stream));
    staged_ = {slot, layer, new_len};
    if (prefill_next_ != nullptr) {
      KVF_RETURN_IF_ERROR(PrefetchNextHistory(slot, layer, pos0, new_len));
    }
    KVF_RETURN_IF_ERROR(device_->RecordEvent(prefill_items_done_[prefill_parity_], stream));
    prefill_parity_ ^= 1;
    tensor_cores = true;
    if (!out_direct) {
      KVF_RETURN_IF_ERROR(device_->CopyAsync(out.data, out_stage_, nq * DTypeSize(out.dtype), stream));
    }
    stats_.bytes_d2h += tokens * hkv * 2 * static_cast<int64_t>(row_bytes_);  // write-through
    if (!st.history_staged) {
      stats_.bytes_h2d += pos0 * hkv * 2 * static_cast<int64_t>(row_bytes_);  // earlier rows staged
    }
  }
  if (!tensor_cores) {
    const int64_t n_copies = PlanAppend(slot, layer, pos0, tokens, new_len, k_src, DTypeSize(k.dtype),
                                        v_src, DTypeSize(v.dtype), 0, k_copies_, v_copies_);
    KVF_RETURN_IF_ERROR(CopyRowsWide(k_copies_, n_copies, d, k.dtype, m.kv_dtype, stream));
    KVF_RETURN_IF_ERROR(CopyRowsWide(v_copies_, n_copies, d, v.dtype, m.kv_dtype, stream));
    stats_.bytes_d2h += tokens * hkv * 2 * static_cast<int64_t>(row_bytes_);  // write-through

    KVF_RETURN_IF_ERROR(transpose_q());
    float* o_f32 = o_gpu_;
    // On a GPU, prefill reads every stored row once per query: stage this layer's pages in device
    // memory first (one PCIe pass per chunk) instead of reading them over PCIe for every query.
    const bool stage_pages = prefill_pages_dev_ != nullptr;
    if (stage_pages) KVF_RETURN_IF_ERROR(StageLayerPages(slot, layer, new_len, stream));
    for (int h = 0; h < hkv; ++h) {
      PagedAttnItem& it = paged_items_[h];
      it.q = q_f32_ + h * tokens * gd;
      it.o = o_f32 + h * tokens * gd;
      it.lse = lse_gpu_ + h * tokens * group_;
      it.kv = stage_pages ? KvPages{prefill_pages_dev_ + h * max_pages_, store_->shape().page_tokens}
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
        PagedAttnItem it = paged_items_[u % hkv];
        it.q += t0 * gd;
        it.o += t0 * gd;
        it.lse += t0 * group_;
        it.q_pos0 += t0;
        it.num_q = static_cast<int32_t>(std::min(query_block, tokens - t0));
        cpu::AttendPaged(params, &it, 1);
      });
    } else {
      KVF_RETURN_IF_ERROR(device_->AttendPaged(params, paged_items_, hkv, stream));
    }
    const bool out_direct = out.where == MemoryKind::kDevice || device_->backend() == Backend::kHost;
    char* out_dst = static_cast<char*>(out_direct ? out.data : out_stage_);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int h = 0; h < hkv; ++h) {
        o_copies_[t * hkv + h] = RowCopy{out_dst + (t * hq + h * group_) * d * DTypeSize(out.dtype),
                                         o_f32 + (h * tokens + t) * gd};
      }
    }
    KVF_RETURN_IF_ERROR(CopyRowsWide(o_copies_, tokens * hkv, static_cast<int>(gd), DType::kF32,
                                     out.dtype, stream));
    if (!out_direct) {
      KVF_RETURN_IF_ERROR(device_->CopyAsync(out.data, out_stage_, nq * DTypeSize(out.dtype), stream));
    }
  }

  if (pending_rows_ > 0) {
    KVF_RETURN_IF_ERROR(DeferPrime(slot, layer, new_len, tokens, q_src, q.dtype, stream));
  } else if (prime_rows_ > 0 || policy_->wants_prefill_queries()) {
    // A policy that reads every query row of the chunk (no prime_rows): primed now.
    if (tensor_cores) KVF_RETURN_IF_ERROR(transpose_q());  // q_f32_: [Hkv, T, G, D]
    const auto tp = Clock::now();
    KVF_RETURN_IF_ERROR(PrimePolicy(slot, layer, new_len, static_cast<int>(tokens), stream));
    Stage(stats_.ms_prime, "prime", tp);
  }
  KVF_RETURN_IF_ERROR(SelectorStored(slot, layer, pos0, new_len, stream));
  KVF_RETURN_IF_ERROR(EndCall(stream));
  if (out.where == MemoryKind::kHost) KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream));
  return Status::Ok();
}

Status RuntimeImpl::StageLayerPages(int slot, int layer, int64_t n, StreamHandle stream) {
  KVF_RETURN_IF_ERROR(CopyLayerPages(slot, layer, n, prefill_scratch_, stream));
  staged_ = {slot, layer, n};
  return Status::Ok();
}

Status RuntimeImpl::PrefetchNextHistory(int slot, int layer, int64_t pos0, int64_t new_len) {
  const int layers = config_.model.num_layers;
  const LastPrefill prev = last_prefill_;
  last_prefill_ = {slot, layer, pos0, new_len};
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
  KVF_RETURN_IF_ERROR(device_->WaitEvent(prefill_copy_stream_, prefill_call_start_));
  KVF_RETURN_IF_ERROR(CopyLayerPages(slot, next_layer, rows, prefill_next_, prefill_copy_stream_));
  KVF_RETURN_IF_ERROR(device_->RecordEvent(prefill_next_ready_, prefill_copy_stream_));
  next_staged_ = {slot, next_layer, rows};
  return Status::Ok();
}

Status RuntimeImpl::CopyLayerPages(int slot, int layer, int64_t n, char* staging,
                                   StreamHandle stream) {
  const int hkv = config_.model.num_kv_heads;
  const int64_t num_pages = (n + store_->shape().page_tokens - 1) / store_->shape().page_tokens;
  const int64_t page_bytes = store_->page_bytes();
  // One batched enqueue: a copy per page run costs the host microseconds each, thousands of them
  // per layer at 128K, which a chunk-major prefill would pay on its critical path.
  page_copy_dst_.clear();
  page_copy_src_.clear();
  page_copy_bytes_.clear();
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
      page_copy_dst_.push_back(staging + (h * max_pages_ + pg) * page_bytes);
      page_copy_src_.push_back(src.pages[pg]);
      page_copy_bytes_.push_back(static_cast<size_t>(run * page_bytes));
      pg += run;
    }
  }
  KVF_RETURN_IF_ERROR(device_->CopyBatchAsync(page_copy_dst_.data(), page_copy_src_.data(),
                                              page_copy_bytes_.data(),
                                              static_cast<int64_t>(page_copy_dst_.size()), stream));
  stats_.bytes_h2d += num_pages * page_bytes * hkv;
  return Status::Ok();
}

Status RuntimeImpl::DeferPrime(int slot, int layer, int64_t new_len, int64_t tokens,
                               const void* q_src, DType q_dtype, StreamHandle stream) {
  const ModelShape& m = config_.model;
  const int rows = static_cast<int>(std::min<int64_t>(pending_rows_, tokens));
  const size_t row_bytes = static_cast<size_t>(m.num_q_heads) * m.head_dim * DTypeSize(q_dtype);
  char*& buf = pending_q_[static_cast<size_t>(slot)];
  if (buf == nullptr) {  // the slot's first primed prefill: its pinned rows for every layer
    KVF_ASSIGN_OR_RETURN(void* p, Alloc(PendingQBytes() * static_cast<size_t>(m.num_layers), true));
    buf = static_cast<char*>(p);
  }
  KVF_RETURN_IF_ERROR(device_->CopyAsync(
      PendingQ(slot, layer),
      static_cast<const char*>(q_src) + static_cast<size_t>(tokens - rows) * row_bytes,
      static_cast<size_t>(rows) * row_bytes, stream));
  if (device_->backend() != Backend::kHost) stats_.bytes_d2h += rows * static_cast<int64_t>(row_bytes);
  pending_prime_[static_cast<size_t>(slot) * m.num_layers + layer] = {new_len, rows, q_dtype};
  return Status::Ok();
}

Status RuntimeImpl::FlushPrime(int slot, int layer, StreamHandle stream, bool same_call) {
  const ModelShape& m = config_.model;
  PendingPrime& pp = pending_prime_[static_cast<size_t>(slot) * m.num_layers + layer];
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
    KVF_RETURN_IF_ERROR(device_->CopyAsync(q_in_, src, static_cast<size_t>(rows) * hq * d * elem, stream));
    stats_.bytes_h2d += static_cast<int64_t>(rows) * hq * d * static_cast<int64_t>(elem);
    src = static_cast<const char*>(q_in_);
  }
  // q to f32 [Hkv][rows][G][D] in q_f32_.
  const int64_t gd = static_cast<int64_t>(group_) * d;
  for (int t = 0; t < rows; ++t) {
    for (int h = 0; h < hkv; ++h) {
      q_copies_[t * hkv + h] =
          RowCopy{q_f32_ + (static_cast<int64_t>(h) * rows + t) * gd,
                  src + (static_cast<size_t>(t) * hq + static_cast<size_t>(h) * group_) * d * elem};
    }
  }
  KVF_RETURN_IF_ERROR(CopyRowsWide(q_copies_, static_cast<int64_t>(rows) * hkv,
                                   static_cast<int>(gd), pp.dtype, DType::kF32, stream));
  KVF_RETURN_IF_ERROR(PrimePolicy(slot, layer, pp.n, rows, stream));
  pp = {};
  Stage(stats_.ms_prime, "prime", t0);
  return Status::Ok();
}

Status RuntimeImpl::PrimePolicy(int slot, int layer, int64_t new_len, int rows,
                                StreamHandle stream) {
  // Policies that learn from the prompt (LFPS primes its tables) get its f32 queries on the host,
  // or the statistics the device computed from them.
  const int hkv = config_.model.num_kv_heads, d = config_.model.head_dim;
  const int64_t gd = static_cast<int64_t>(group_) * d;
  PrefillContext ctx;
  ctx.slot = slot;
  ctx.layer = layer;
  ctx.q_pos0 = new_len - rows;
  ctx.num_q = rows;
  ctx.n = new_len;
  ctx.sink = config_.tiers.sink_tokens;
  ctx.window = config_.tiers.window_tokens;
  ctx.params = AttnParams{group_, d, config_.model.kv_dtype, scale_};
  if (prime_rows_ > 0) {
    const int prime = std::min(prime_rows_, rows);
    PrimeArgs a;
    a.params = ctx.params;
    a.num_kv_heads = hkv;
    a.q = q_f32_ + static_cast<int64_t>(rows - prime) * gd;
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
      if (!(staged_.slot == slot && staged_.layer == layer && staged_.rows == new_len)) {
        KVF_RETURN_IF_ERROR(StageLayerPages(slot, layer, new_len, stream));
      }
      a.pages = prefill_pages_dev_;
      a.max_pages = max_pages_;
    } else {
      a.pages = store_->pages(slot, layer, 0).pages;
      a.max_pages = store_->max_pages();
    }
    a.page_tokens = store_->shape().page_tokens;
    a.tables = prime_tables_dev_;
    a.table_stride = prime_table_stride_;
    a.stats = prime_stats_dev_;
    a.scratch = prime_scratch_;
    a.scratch_bytes = prime_scratch_bytes_;
    KVF_RETURN_IF_ERROR(device_->PrimeAttention(a, stream));
    const int64_t stats_count = PrimeStatsCount(d, group_);
    for (int h = 0; h < hkv; ++h) {
      KVF_RETURN_IF_ERROR(device_->CopyAsync(
          prime_tables_host_ + h * prime_table_stride_, prime_tables_dev_ + h * prime_table_stride_,
          static_cast<size_t>(2 * new_len) * sizeof(float), stream));
    }
    KVF_RETURN_IF_ERROR(device_->CopyAsync(prime_stats_host_, prime_stats_dev_,
                                           static_cast<size_t>(hkv * stats_count) * sizeof(double),
                                           stream));
    KVF_RETURN_IF_ERROR(HostWaitStream(stream));
    stats_.bytes_d2h += hkv * (2 * new_len * 4 + stats_count * 8);
    // The heads' O(n) finishing (and LFPS's O(n d) scan shadow) on the pool: their states are
    // independent.
    std::vector<Status> head_status(static_cast<size_t>(hkv));
    pool_->ParallelFor(hkv, [&](int64_t h) {
      PrefillContext head_ctx = ctx;
      head_ctx.kv_head = static_cast<int>(h);
      head_ctx.kv = store_->pages(slot, layer, static_cast<int>(h));
      PrimedStats primed;
      primed.ver = prime_tables_host_ + h * prime_table_stride_;
      primed.sla = primed.ver + new_len;
      primed.stats = prime_stats_host_ + h * stats_count;
      primed.rows = prime;
      head_status[static_cast<size_t>(h)] = policy_->OnPrefillPrimed(head_ctx, primed);
    });
    for (Status& st : head_status) KVF_RETURN_IF_ERROR(std::move(st));
    KVF_RETURN_IF_ERROR(CopyScanShadow(slot, layer, stream));
  } else {
    const int64_t nq = static_cast<int64_t>(rows) * config_.model.num_q_heads * d;
    KVF_RETURN_IF_ERROR(device_->CopyAsync(q_host_, q_f32_, static_cast<size_t>(nq) * 4, stream));
    KVF_RETURN_IF_ERROR(HostWaitStream(stream));
    if (device_->backend() != Backend::kHost) stats_.bytes_d2h += nq * 4;
    for (int h = 0; h < hkv; ++h) {
      ctx.kv_head = h;
      ctx.q = q_host_ + h * rows * gd;
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
    KVF_ASSIGN_OR_RETURN(const void* k_src, StageInput(k, k_in_, stream));
    KVF_ASSIGN_OR_RETURN(const void* v_src, StageInput(v, v_in_, stream));
    const int64_t n_copies = PlanAppend(slot, layer, len, tokens, new_len, k_src,
                                        DTypeSize(k.dtype), v_src, DTypeSize(v.dtype), 0,
                                        k_copies_, v_copies_);
    KVF_RETURN_IF_ERROR(
        CopyRowsWide(k_copies_, n_copies, m.head_dim, k.dtype, m.kv_dtype, stream));
    KVF_RETURN_IF_ERROR(
        CopyRowsWide(v_copies_, n_copies, m.head_dim, v.dtype, m.kv_dtype, stream));
    KVF_RETURN_IF_ERROR(SelectorStored(slot, layer, len, new_len, stream));
    return EndCall(stream);
  };
  // As in Prefill: a failure leaves the length as it was and the ring restored for it.
  Status st = append();
  if (!st.ok()) return WithRestore(std::move(st), RestoreWindow({&slot, 1}, layer, stream));
  stats_.bytes_d2h += tokens * m.num_kv_heads * 2 * static_cast<int64_t>(row_bytes_);
  len = new_len;
  stats_.prefill_tokens += tokens;
  Stage(stats_.ms_prefill, "prefill", t0);
  return Status::Ok();
}

int RuntimeImpl::SelectThreads(int64_t items) const {
  // Fewer items than threads: each Select may split its scan and exact scoring into up to four
  // times its share of the pool, so that the threads whose items finish first steal ranges of the
  // slow ones (items differ by 2x in a step; measured on the GPU machine, 32-layer lfps step,
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
  ctx.params = AttnParams{group_, config_.model.head_dim, config_.model.kv_dtype, scale_};
  ctx.kv = store_->pages(slot, layer, kv_head);
  ctx.threads = threads;
  ctx.scan = scan;
  std::vector<int32_t>& sel = selections_[item];
  sel.clear();
  KVF_RETURN_IF_ERROR(policy_->Select(ctx, sel));
  KVF_CHECK_CODE(static_cast<int64_t>(sel.size()) <= item_cap_, StatusCode::kInternal, "policy '",
                 policy_->name(), "' selected ", sel.size(), " positions, over its capacity ",
                 item_cap_);
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
  std::vector<int>& slot_of = batch_slots_;  // thread_local would not reach the worker threads
  KVF_RETURN_IF_ERROR(CheckBatch(seqs, slot_of));
  // A sliding-window layer: its ring, no policy (runtime/window.cpp).
  if (WindowOf(layer) > 0) return WindowDecode(seqs, slot_of, layer, q, k, v, out, stream);
  // The first Decode after a prefill primes the policy (DeferPrime). Never inside a CUDA graph
  // capture (it waits for the device): the priming policies select on the host, and the planned
  // step refuses the capture below with its own message.
  // Only a step with something pending asks whether the stream is capturing.
  if (pending_rows_ > 0) {
    const StreamHandle s = stream == nullptr ? stream_ : stream;
    int8_t capturing = -1;  // not asked yet
    for (const int slot : slot_of) {
      if (pending_prime_[static_cast<size_t>(slot) * m.num_layers + layer].n == 0) continue;
      if (capturing < 0) capturing = device_->IsCapturing(s) ? 1 : 0;
      if (capturing == 1) break;
      KVF_RETURN_IF_ERROR(FlushPrime(slot, layer, s, false));
    }
  }
  // Policies that select on the device, CPU-placed ones on route cpu and host-selecting ones with
  // the device bank run the planned step (runtime/decode_plan.cpp).
  if (fast_path_ || cpu_step_ || host_lists_) {
    return RunDecodeStep(seqs, layer, q, k, v, out, stream);
  }
  KVF_RETURN_IF_ERROR(CheckNextToken(seqs, slot_of, layer));
  KVF_RETURN_IF_ERROR(ReserveNextToken(slot_of, layer));
  if (stream == nullptr) stream = stream_;
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;

  // 1 append: write the new rows through to the store and into the resident ring; q to f32.
  KVF_RETURN_IF_ERROR(BeginCall());
  KVF_ASSIGN_OR_RETURN(const void* q_src, StageInput(q, q_in_, stream));
  KVF_ASSIGN_OR_RETURN(const void* k_src, StageInput(k, k_in_, stream));
  KVF_ASSIGN_OR_RETURN(const void* v_src, StageInput(v, v_in_, stream));
  for (int64_t r = 0; r < batch * hq; ++r) {
    q_copies_[r] = RowCopy{q_f32_ + r * d, static_cast<const char*>(q_src) + r * d * DTypeSize(q.dtype)};
  }
  KVF_RETURN_IF_ERROR(device_->CopyRows(q_copies_, batch * hq, d, q.dtype, DType::kF32, stream));
  int64_t n_copies = 0;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t& len = lengths_[static_cast<size_t>(slot_of[b]) * m.num_layers + layer];
    n_copies += PlanAppend(slot_of[b], layer, len, 1, len + 1, k_src, DTypeSize(k.dtype), v_src,
                           DTypeSize(v.dtype), b, k_copies_ + n_copies, v_copies_ + n_copies);
  }
  // From here the new rows are in the ring: a failure takes the token back and restores the ring
  // (RollBackDecode), so that every sequence of the batch is as before the call.
  Status appended = device_->CopyRows(k_copies_, n_copies, d, k.dtype, m.kv_dtype, stream);
  if (appended.ok()) appended = device_->CopyRows(v_copies_, n_copies, d, v.dtype, m.kv_dtype, stream);
  for (int64_t b = 0; b < batch; ++b) ++lengths_[static_cast<size_t>(slot_of[b]) * m.num_layers + layer];
  if (!appended.ok()) return RollBackDecode(slot_of, layer, stream, std::move(appended));
  stats_.bytes_d2h += batch * hkv * 2 * static_cast<int64_t>(row_bytes_);
  Stage(stats_.ms_append, "append", t0);
  Status attended = AttendAppended(seqs, slot_of, layer, out, stream);
  if (!attended.ok()) return RollBackDecode(slot_of, layer, stream, std::move(attended));
  stats_.decode_steps += 1;
  stats_.decode_tokens += batch;
  return Status::Ok();
}

Status RuntimeImpl::AttendAppended(std::span<const SequenceId> seqs, std::span<const int> slot_of,
                                   int layer, const TensorView& out, StreamHandle stream) {
  auto t0 = Clock::now();
  const ModelShape& m = config_.model;
  const int64_t batch = static_cast<int64_t>(seqs.size());
  const int hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t nq = batch * hq * d;
  const int64_t gd = static_cast<int64_t>(group_) * d;

  const AttnParams params{group_, d, m.kv_dtype, scale_};
  const int64_t items = batch * hkv;
  // A policy that selects on the CPU has q there already: in auto its misses stay on the CPU
  // (only q went down; only (o, lse) comes back), as LFPS prescribes.
  const Route route = PlannedRoute();

  if (policy_->is_dense()) {
    // Dense: every position read from the host store (full streaming), on the chosen route.
    t0 = Clock::now();
    const bool on_cpu = route == Route::kCpu;
    if (on_cpu) {
      KVF_RETURN_IF_ERROR(device_->CopyAsync(q_host_, q_f32_, nq * 4, stream));
      KVF_RETURN_IF_ERROR(HostWaitStream(stream));
    }
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t n = lengths_[static_cast<size_t>(slot_of[b]) * m.num_layers + layer];
      for (int h = 0; h < hkv; ++h) {
        PagedAttnItem& it = paged_items_[b * hkv + h];
        const int64_t off = b * hq * d + h * gd;
        it.q = (on_cpu ? q_host_ : q_f32_) + off;
        it.o = (on_cpu ? o_cpu_host_ : o_gpu_) + off;
        it.lse = (on_cpu ? lse_cpu_host_ : lse_gpu_) + b * hq + h * group_;
        it.kv = store_->pages(slot_of[b], layer, h);
        it.q_pos0 = n - 1;
        it.num_q = 1;
        if (on_cpu) {
          stats_.rows_cpu += n;
        } else {
          stats_.rows_fetched += n;
          stats_.bytes_h2d += n * 2 * static_cast<int64_t>(row_bytes_);
        }
        stats_.rows_selected += n;
      }
    }
    if (on_cpu) {
      pool_->ParallelFor(items, [&](int64_t i) {
        AttendTimed([&] { cpu::AttendPaged(params, &paged_items_[i], 1); });
      });
      KVF_RETURN_IF_ERROR(device_->CopyAsync(o_gpu_, o_cpu_host_, nq * 4, stream));
      KVF_RETURN_IF_ERROR(device_->CopyAsync(lse_gpu_, lse_cpu_host_, batch * hq * 4, stream));
      stats_.bytes_d2h += nq * 4;
      stats_.bytes_h2d += (nq + batch * hq) * 4;
      Stage(stats_.ms_attend_cpu, "attend_cpu", t0);
    } else {
      KVF_RETURN_IF_ERROR(device_->AttendPaged(params, paged_items_, items, stream));
      Stage(stats_.ms_attend_gpu, "attend_gpu", t0);
    }
    t0 = Clock::now();
    KVF_RETURN_IF_ERROR(WriteOutput(nullptr, nullptr, batch * hq, out, stream));
    Stage(stats_.ms_merge, "merge", t0);
    return Status::Ok();
  }

  // 2 select: the policy runs on the host over the f32 queries.
  t0 = Clock::now();
  KVF_RETURN_IF_ERROR(device_->CopyAsync(q_host_, q_f32_, nq * 4, stream));
  KVF_RETURN_IF_ERROR(HostWaitStream(stream));
  stats_.bytes_d2h += nq * 4;
  const int select_threads = SelectThreads(items);
  pool_->ParallelFor(items, [&](int64_t i) {
    const int64_t b = i / hkv;
    const int h = static_cast<int>(i % hkv);
    item_status_[i] = SelectItem(i, slot_of[b], layer, h,
                                 lengths_[static_cast<size_t>(slot_of[b]) * m.num_layers + layer],
                                 q_host_ + b * hq * d + h * gd, select_threads);
  });
  for (int64_t i = 0; i < items; ++i) {
    // The step failed in the policy; Decode rolls the append back.
    if (!item_status_[i].ok()) return item_status_[i];
  }
  Stage(stats_.ms_select, "select", t0);

  // 3 resolve (resident tier, then token bank) + 4 route the remaining misses.
  t0 = Clock::now();
  int64_t cpu_items = 0;
  const int64_t hits_before = bank_ ? bank_->counters().hits : 0;
  for (int64_t i = 0; i < items; ++i) {
    const int64_t b = i / hkv;
    const int h = static_cast<int>(i % hkv);
    const int slot = slot_of[b];
    const int64_t n = lengths_[static_cast<size_t>(slot) * m.num_layers + layer];
    const std::vector<int32_t>& sel = selections_[i];
    last_selection_[(static_cast<size_t>(slot) * m.num_layers + layer) * hkv + h].assign(sel.begin(), sel.end());
    const void** gk = gpu_k_rows_ + i * item_cap_;
    const void** gv = gpu_v_rows_ + i * item_cap_;
    int32_t n_gpu = 0;
    std::vector<int32_t>& offloaded = offloaded_[i];
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
    std::vector<int32_t>& misses = misses_[i];
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
    const int64_t to_cpu = CpuShare(route, cost_, n_miss);
    const int64_t to_gpu = n_miss - to_cpu;
    const void** ck = cpu_k_rows_ + cpu_items * item_cap_;
    const void** cv = cpu_v_rows_ + cpu_items * item_cap_;
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
    stats_.bytes_h2d += to_gpu * 2 * static_cast<int64_t>(row_bytes_);
    stats_.rows_selected += static_cast<int64_t>(sel.size());
    const int64_t off = b * hq * d + h * gd;
    gpu_items_[i] = RowAttnItem{q_f32_ + off, o_gpu_ + off, lse_gpu_ + b * hq + h * group_, gk, gv, n_gpu};
    if (n_cpu > 0) {
      cpu_items_[cpu_items++] =
          RowAttnItem{q_host_ + off, o_cpu_host_ + off, lse_cpu_host_ + b * hq + h * group_, ck, cv, n_cpu};
    }
  }
  if (bank_ != nullptr) {
    stats_.rows_bank_hit += bank_->counters().hits - hits_before;
    KVF_RETURN_IF_ERROR(bank_->WaitReady(stream));
  }
  Stage(stats_.ms_resolve, "resolve", t0);

  // 5 attend: the GPU part is issued first so that the CPU part overlaps it.
  t0 = Clock::now();
  KVF_RETURN_IF_ERROR(device_->AttendRows(params, gpu_items_, items, stream));
  Stage(stats_.ms_attend_gpu, "attend_gpu", t0);
  const bool have_cpu = cpu_items > 0;
  if (have_cpu) {
    t0 = Clock::now();
    // Items without a CPU share contribute nothing: lse = -inf.
    std::fill_n(lse_cpu_host_, batch * hq, -std::numeric_limits<float>::infinity());
    std::fill_n(o_cpu_host_, nq, 0.0f);
    pool_->ParallelFor(cpu_items, [&](int64_t i) {
      AttendTimed([&] { cpu::AttendRows(params, &cpu_items_[i], 1); });
    });
    KVF_RETURN_IF_ERROR(device_->CopyAsync(o_cpu_dev_, o_cpu_host_, nq * 4, stream));
    KVF_RETURN_IF_ERROR(device_->CopyAsync(lse_cpu_dev_, lse_cpu_host_, batch * hq * 4, stream));
    stats_.bytes_h2d += (nq + batch * hq) * 4;
    Stage(stats_.ms_attend_cpu, "attend_cpu", t0);
  }
  // 6 merge, and the output in its dtype.
  t0 = Clock::now();
  KVF_RETURN_IF_ERROR(WriteOutput(have_cpu ? o_cpu_dev_ : nullptr, have_cpu ? lse_cpu_dev_ : nullptr,
                                  batch * hq, out, stream));
  Stage(stats_.ms_merge, "merge", t0);
  t0 = Clock::now();
  // 7 admit: rows that crossed PCIe this step may enter the bank, copied on the side stream after
  // the step's reads of the bank (off the critical path).
  if (bank_ != nullptr) {
    // Admission only saves later fetches: when the bank cannot take the rows (an event or copy
    // fails), the step's output stands, the bank forgets the batch (TokenBank::CommitAdmit) and
    // later steps fetch those rows from the host store again. No token is lost.
    Status admit = device_->RecordEvent(bank_step_done_, stream);
    if (admit.ok()) admit = bank_->BeginAdmit(side_stream_, bank_step_done_);
    for (int64_t i = 0; admit.ok() && i < items; ++i) {
      const std::vector<int32_t>& fetched = misses_[i];
      if (fetched.empty()) continue;
      const int slot = slot_of[i / hkv];
      const int h = static_cast<int>(i % hkv);
      // The fetched rows' addresses are the first entries after the resident and hit rows.
      const RowAttnItem& it = gpu_items_[i];
      const int64_t first = it.count - static_cast<int64_t>(fetched.size());
      bank_->Admit(bank_->TableIndex(slot, layer, h), fetched,
                   it.k_rows + first, it.v_rows + first);
    }
    if (admit.ok()) admit = bank_->CommitAdmit();
    if (!admit.ok()) ++stats_.bank_admit_failures;
    stats_.bank_admitted = bank_->counters().admitted;
    stats_.bank_evicted = bank_->counters().evicted;
  }
  Stage(stats_.ms_admit, "admit", t0);
  return Status::Ok();
}

Status RuntimeImpl::WriteOutput(const float* o_b, const float* lse_b, int64_t rows,
                                const TensorView& out, StreamHandle stream) {
  const bool direct = out.where == MemoryKind::kDevice || device_->backend() == Backend::kHost;
  void* dst = direct ? out.data : out_stage_;
  KVF_RETURN_IF_ERROR(device_->MergeLse(o_gpu_, lse_gpu_, o_b, lse_b, rows, config_.model.head_dim,
                                        dst, out.dtype, stream));
  if (!direct) {
    const size_t bytes = static_cast<size_t>(rows) * config_.model.head_dim * DTypeSize(out.dtype);
    KVF_RETURN_IF_ERROR(device_->CopyAsync(out.data, out_stage_, bytes, stream));
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
  if (fast_path_ && scoring_ != SelectScoring::kNone) {
    // The device's list of the last step that ran this layer for the sequence.
    const std::vector<int>& slots = list_slots_[static_cast<size_t>(layer)];
    const auto it = std::find(slots.begin(), slots.end(), slot);
    if (it == slots.end()) return std::vector<int32_t>{};
    const size_t item = static_cast<size_t>(layer) * config_.capacity.max_batch *
                            config_.model.num_kv_heads +
                        static_cast<size_t>(it - slots.begin()) * config_.model.num_kv_heads +
                        kv_head;
    // The last Decode's work (on whatever stream it ran) is done once call_done_ is.
    KVF_RETURN_IF_ERROR(device_->SynchronizeEvent(call_done_));
    int32_t count = 0;
    KVF_RETURN_IF_ERROR(device_->CopyAsync(&count, step_list_count_ + item, sizeof(int32_t),
                                           stream_));
    KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
    std::vector<int32_t> sel(static_cast<size_t>(count));
    if (count > 0) {
      KVF_RETURN_IF_ERROR(device_->CopyAsync(sel.data(), step_list_ + item * list_cap_,
                                             sel.size() * sizeof(int32_t), stream_));
      KVF_RETURN_IF_ERROR(device_->SynchronizeStream(stream_));
    }
    return sel;
  }
  if (fast_path_) {
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
  s.split_share = static_cast<double>(split_last_q10_) / 1024.0;
  s.xl_gap_us = xl_gap_us_;
  s.cost_cpu_gbps = cost_.cpu_gbps;
  s.ms_cpu_attend_busy = static_cast<double>(cpu_attend_ns_.load(std::memory_order_relaxed)) * 1e-6;
  const PolicyCounters pc = policy_->counters();
  s.prhs_select_calls = pc.select_calls - policy_counters_at_reset_.select_calls;
  s.prhs_select_reused = pc.select_reused - policy_counters_at_reset_.select_reused;
  s.lfps_scans_device = pc.scans_device - policy_counters_at_reset_.scans_device;
  s.lfps_scans_device_short = pc.scans_device_short - policy_counters_at_reset_.scans_device_short;
  // Selections timed but not yet read back (their pairs stay pending: stats_ adds them later).
  for (const TimingPair& t : select_timing_.pairs) s.ms_select_device += TimingMs(t);
  for (const TimingPair& t : attend_timing_.pairs) s.ms_attend_device += TimingMs(t);
  s.cost_h2d_gbps = cost_.h2d_gbps;
  s.cost_hbm_gbps = cost_.hbm_gbps;
  // The device's rates as the timed calls measured them, beside the model's (cost_hbm_gbps,
  // cost_pcie_gbps): key bytes a device selection read, K/V bytes a step attended.
  const auto gbps = [](double bytes, double ms) { return ms > 0 && bytes > 0 ? bytes / (ms * 1e-3) * 1e-9 : 0.0; };
  s.cost_select_gbps_measured = gbps(static_cast<double>(timed_select_key_bytes_), s.ms_select_device);
  s.cost_attend_gbps_measured = gbps(static_cast<double>(timed_attend_bytes_), s.ms_attend_device);
  if (step_bank_ != nullptr) {
    // The device bank's counters (a read-back that waits for the device). Its misses are the rows
    // the step read from the host store.
    Result<StepBankTotals> t = step_bank_->Totals();
    if (t.ok()) {
      const StepBankTotals& z = bank_totals_at_reset_;
      s.rows_bank_hit += t.value().hits - z.hits;
      s.rows_fetched += t.value().misses - z.misses;
      // (Host lists count their resident rows on the host.)
      if (scoring_ != SelectScoring::kNone) {
        s.rows_resident +=
            bank_step_selected_ - (t.value().hits - z.hits) - (t.value().misses - z.misses);
      }
      s.bytes_h2d += (t.value().misses - z.misses) * 2 * static_cast<int64_t>(row_bytes_);
      s.bank_admitted += t.value().admitted - z.admitted;
      s.bank_evicted += t.value().evicted - z.evicted;
    }
  }
  // The CPU route's rate as the steps measured it, beside the probed one.
  if (s.ms_cpu_attend_busy > 0 && s.rows_cpu > 0) {
    const double bytes = static_cast<double>(s.rows_cpu) * 2.0 * static_cast<double>(row_bytes_);
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
// whole call (see the contract on Runtime). config() and backend() read what Create fixed.

Status Runtime::AddSequence(SequenceId seq) {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->AddSequence(seq);
}
Status Runtime::RemoveSequence(SequenceId seq) {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->RemoveSequence(seq);
}
Result<int64_t> Runtime::SequenceLength(SequenceId seq, int layer) const {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->SequenceLength(seq, layer);
}
Status Runtime::Prefill(SequenceId seq, int layer, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, StreamHandle stream) {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->Prefill(seq, layer, q, k, v, out, stream);
}
Status Runtime::Decode(std::span<const SequenceId> seqs, int layer, const TensorView& q,
                       const TensorView& k, const TensorView& v, const TensorView& out,
                       StreamHandle stream) {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->Decode(seqs, layer, q, k, v, out, stream);
}
Status Runtime::Append(SequenceId seq, int layer, const TensorView& k, const TensorView& v,
                       StreamHandle stream) {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->Append(seq, layer, k, v, stream);
}
Status Runtime::PlanDecode(std::span<const SequenceId> seqs, StreamHandle stream) {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->PlanDecode(seqs, stream);
}
bool Runtime::decode_is_capture_safe() const { return impl_->decode_is_capture_safe(); }
Result<std::vector<int32_t>> Runtime::LastSelection(SequenceId seq, int layer, int kv_head) const {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->LastSelection(seq, layer, kv_head);
}
Status Runtime::Synchronize() {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->Synchronize();
}
Status Runtime::TimeDeviceSelect(bool on) {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->TimeDeviceSelect(on);
}
Status Runtime::StartTrace(int64_t max_events) {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->StartTrace(max_events);
}
Status Runtime::WriteTrace(const std::string& path) {
  const std::lock_guard<std::mutex> lock(impl_->mutex());
  KVF_RETURN_IF_ERROR(impl_->CollectCpuPart());
  return impl_->WriteTrace(path);
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
