// Copyright kvferry authors. Apache-2.0.
// The runtime's device memory: the sizes of every buffer Create allocates (one function, which
// both the allocations and the plan that the GPU memory cap is checked against read), the auto
// token bank, and the cap's refusal.
#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <string_view>

#include "base/check.h"
#include "runtime/runtime_impl.h"

namespace kvferry {

std::string DeviceMemoryPlan::ToString() const {
  std::string s = detail::StrCat(total_bytes, " bytes");
  for (size_t i = 0; i < parts.size(); ++i) {
    s += detail::StrCat(i == 0 ? ": " : ", ", parts[i].name, " ", parts[i].bytes);
  }
  return s;
}

namespace detail {
namespace {

constexpr int kStepMaxSplits = 127;  // split partials per item the step workspace holds
// Slot ids are uint16 with 0xffff for "none" in both bank forms (TokenBank, cuda::DeviceBank).
constexpr int kMaxBankSlots = 65534;

}  // namespace

DeviceMemoryPlan DeviceBufferSizes::Plan(int64_t cap_bytes) const {
  DeviceMemoryPlan plan;
  plan.cap_bytes = cap_bytes;
  plan.bank_slots = bank_slots;
  auto part = [&](const char* name, std::initializer_list<size_t> bytes) {
    int64_t sum = 0;
    for (size_t b : bytes) sum += static_cast<int64_t>(b);
    if (sum > 0) plan.parts.push_back({name, sum});
    plan.total_bytes += sum;
  };
  part("resident tier", {resident});
  part("bank rows", {bank_rows});
  part("bank page tables", {bank_page_tables});
  part("bank slot state", {bank_slot_state});
  part("bank miss staging", {bank_stage, bank_miss, bank_admit});
  // The device selector's buffers, one part per name it gives (policies/<name>/device_selector.cpp).
  for (size_t i = 0; i < selector_buffers.size(); ++i) {
    const std::string& name = selector_buffers[i].part;
    bool first = true;
    for (size_t j = 0; j < i; ++j) first = first && selector_buffers[j].part != name;
    if (!first) continue;
    int64_t sum = 0;
    for (size_t j = i; j < selector_buffers.size(); ++j) {
      if (selector_buffers[j].part == name) sum += static_cast<int64_t>(selector_buffers[j].bytes);
    }
    if (sum > 0) plan.parts.push_back({name, sum});
    plan.total_bytes += sum;
  }
  part("selection lists", {step_list, step_list_count});
  part("selection scores", {select_ws, topk_ws, select_mcta});
  part("split lists (the device's share)", {split_list, split_count});
  part("input staging (q, k, v, out)", {q_in, k_in, v_in, out_stage});
  part("attention partials (q, o, lse)", {q_f32, o_gpu, lse_gpu, o_cpu, lse_cpu});
  part("step plan (slots, positions)", {step_slots, step_pos});
  part("step workspace", {step_ws, step_counters});
  part("prefill staging", {prefill_scratch, prefill_pages});
  part("prefill prefetch staging", {prefill_next, prefill_next_pages});
  part("priming tables and partials", {prime_tables, prime_stats, prime_scratch});
  part("shadow scan (int8 shadow of K, scores)",
       {scan_shadow, scan_scale, scan_keys, scan_ints, scan_hist, scan_blocks, scan_items});
  part("host-store page table", {store_table});
  part("stream workspaces", {stream_scratch});
  part("sliding-window rings", {window_rings});
  part("sliding-window prefill staging", {window_stage});
  plan.layer_bytes = layer_bytes;
  std::stable_sort(plan.parts.begin(), plan.parts.end(),
                   [](const DeviceMemoryPlan::Part& a, const DeviceMemoryPlan::Part& b) {
                     return a.bytes > b.bytes;
                   });
  return plan;
}

size_t RuntimeImpl::AllocBytes(size_t bytes) { return std::max<size_t>(bytes, 64); }

bool RuntimeImpl::OnDevicePath(PathChoice choice) const {
  if (choice == PathChoice::kAuto) return device_->backend() == Backend::kCuda;
  return choice == PathChoice::kDevice;
}

HostStoreShape RuntimeImpl::StoreShape() const {
  const ModelShape& m = config_.model;
  const Capacity& cap = config_.capacity;
  return {.max_slots = cap.max_sequences,
          .num_layers = m.num_layers,
          .num_kv_heads = m.num_kv_heads,
          .head_dim = m.head_dim,
          .kv_dtype = m.kv_dtype,
          .page_tokens = kPageTokens,
          .max_tokens = cap.max_tokens_per_sequence,
          .max_bytes = cap.max_host_bytes};
}

StepBankConfig RuntimeImpl::StepBankConfigFor(int bank_slots) const {
  const ModelShape& m = config_.model;
  StepBankConfig bank;
  bank.num_tables = config_.capacity.max_sequences * m.num_layers * m.num_kv_heads;
  bank.slots = bank_slots;
  bank.max_positions = config_.capacity.max_tokens_per_sequence;
  bank.head_dim = m.head_dim;
  bank.kv_dtype = m.kv_dtype;
  bank.hash_map = config_.tiers.bank_map == "hash";
  return bank;
}

TokenBankConfig RuntimeImpl::TokenBankConfigFor(int bank_slots) const {
  const ModelShape& m = config_.model;
  TokenBankConfig bank;
  bank.max_sequences = config_.capacity.max_sequences;
  bank.num_layers = m.num_layers;
  bank.num_kv_heads = m.num_kv_heads;
  bank.slots = bank_slots;
  bank.max_positions = config_.capacity.max_tokens_per_sequence;
  bank.head_dim = m.head_dim;
  bank.kv_dtype = m.kv_dtype;
  bank.map = config_.tiers.bank_map == "hash" ? BankMapKind::kHash : BankMapKind::kVector;
  return bank;
}

Status RuntimeImpl::SizeDeviceBuffers(int bank_slots, DeviceBufferSizes& z) const {
  const ModelShape& m = config_.model;
  const Capacity& cap = config_.capacity;
  const bool cuda = device_->backend() == Backend::kCuda;
  const int64_t hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  z = DeviceBufferSizes{};
  z.bank_slots = bank_slots;
  z.streams = 1;  // the device's default stream

  // Resident tier: [slot][layer][kv_head][K rows (S+W), V rows (S+W)].
  const int64_t slot_rows = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
  z.resident = AllocBytes(static_cast<size_t>(cap.max_sequences) * m.num_layers * hkv *
                          slot_rows * 2 * dims_.row_bytes);
  // Inputs and outputs staged in f32 (the largest activation dtype), for a prefill chunk or a
  // batch; the attention's partial results.
  const size_t act_q = static_cast<size_t>(dims_.max_rows * hq * d);
  const size_t act_kv = static_cast<size_t>(dims_.max_rows * hkv * d);
  const size_t batch_q = static_cast<size_t>(cap.max_batch * hq * d);
  z.q_in = AllocBytes(act_q * 4);
  z.k_in = AllocBytes(act_kv * 4);
  z.v_in = AllocBytes(act_kv * 4);
  z.out_stage = AllocBytes(act_q * 4);
  z.q_f32 = AllocBytes(act_q * 4);
  z.o_gpu = AllocBytes(act_q * 4);
  z.lse_gpu = AllocBytes(static_cast<size_t>(dims_.max_rows * hq) * 4);
  z.o_cpu = AllocBytes(batch_q * 4);
  z.lse_cpu = AllocBytes(static_cast<size_t>(cap.max_batch * hq) * 4);
  const HostStoreShape store = StoreShape();
  z.store_table = static_cast<size_t>(HostStore::DeviceTableBytes(store));

  KVF_RETURN_IF_ERROR(SizeBank(bank_slots, z));
  if (cuda) SizePrefillStaging(store, z);
  SizePriming(z);
  KVF_RETURN_IF_ERROR(SizePlannedStep(z));
  z.stream_scratch = static_cast<size_t>(z.streams) * device_->stream_scratch_bytes();
  SizeWindowBuffers(z);  // sliding-window layers' rings and staging, every layer's bytes
  SizeDeviceScan(z);
  return Status::Ok();
}

Status RuntimeImpl::SizeBank(int bank_slots, DeviceBufferSizes& z) const {
  const bool cuda = device_->backend() == Backend::kCuda;
  // Which token bank a configuration with bank_slots > 0 gets. The host backend: the host-managed
  // TokenBank (rows in device memory, maps on the host, a side stream for admissions), always.
  // CUDA: none where a bank would never be read or filled (dense reads the store by pages; route
  // cpu, and auto for a CPU-placed policy, move no row over PCIe, and only fetched rows are
  // admitted), so the runtime is the one without a bank; else the device bank, read by the
  // planned step: a policy that selects on the device, or one that selects on the host
  // (Policy::Select; host_lists) with route gpu or auto. With auto such a GPU-placed policy's
  // misses are read over PCIe by the step (zero-copy, then admitted), not split row by row with
  // the CPU as the host path did: the planned step has no CPU branch for them, and a bank the
  // step reads is what the auto route's PCIe side needs (issue 14's scheduler brings the split
  // back inside the step).
  const bool bank_used =
      bank_slots > 0 && !(cuda && (policy_->is_dense() || PlannedRoute() == Route::kCpu));
  const bool selects_on_device = selector_ != nullptr;
  z.host_lists = cuda && bank_used && !selects_on_device;
  z.device_bank = cuda && bank_used && (selects_on_device || z.host_lists);
  z.host_bank = bank_used && !z.device_bank;
  if (z.device_bank) {
    KVF_ASSIGN_OR_RETURN(const StepBankSizes b,
                         device_->StepBankSizesFor(StepBankConfigFor(bank_slots)));
    z.bank_rows = b.rows;
    z.bank_page_tables = b.page_tables;
    z.bank_slot_state = b.slot_state;
    z.bank_admit_item_bytes = b.admit_item_bytes;
    z.bank_max_admit = b.max_admit;
  } else if (z.host_bank) {
    const TokenBank::DeviceSizes b = TokenBank::DeviceSizesFor(TokenBankConfigFor(bank_slots));
    z.bank_rows = b.rows;
    z.bank_page_tables = b.page_tables + b.ref_bits;
    ++z.streams;
  }
  return Status::Ok();
}

void RuntimeImpl::SizePrefillStaging(const HostStoreShape& store, DeviceBufferSizes& z) const {
  const Capacity& cap = config_.capacity;
  const int64_t hkv = config_.model.num_kv_heads;
  // Prefill staging: one layer's pages of one sequence in device memory, and their page table.
  z.max_pages = HostStore::MaxPages(store);
  z.prefill_scratch = AllocBytes(static_cast<size_t>(hkv * z.max_pages) *
                                 static_cast<size_t>(HostStore::PageBytes(store)));
  z.prefill_pages = AllocBytes(static_cast<size_t>(hkv * z.max_pages) * sizeof(void*));
  // Tensor cores unless ReferencePaths::cuda_prefill_paged asks for the CUDA-core kernel (the
  // reference it is tested against); with them, chunks after the first copy their history on a
  // stream of their own.
  z.prefill_tensor_cores = !config_.paths.cuda_prefill_paged;
  z.prefill_copy_stream = z.prefill_tensor_cores;
  if (z.prefill_copy_stream) ++z.streams;
  // The chunk's write-through on a stream of its own, from the staging, while the chunk is
  // attended.
  z.prefill_write_stream = z.prefill_copy_stream;
  if (z.prefill_write_stream) ++z.streams;
  // The chunk-major prefetch's second staging (Capacity::prefill_prefetch).
  z.prefill_prefetch = z.prefill_copy_stream && cap.prefill_prefetch;
  if (z.prefill_prefetch) {
    z.prefill_next = z.prefill_scratch;
    z.prefill_next_pages = z.prefill_pages;
  }
}

void RuntimeImpl::SizePriming(DeviceBufferSizes& z) const {
  const ModelShape& m = config_.model;
  const Capacity& cap = config_.capacity;
  const bool cuda = device_->backend() == Backend::kCuda;
  const int64_t hkv = m.num_kv_heads;
  // Priming on the device: on CUDA unless ReferencePaths::prime is kHost (the host loop, for
  // comparison); on the host backend only with kDevice (the CPU reference of the same path, so
  // that machines without a GPU run it). Per KV head a table pair (vertical, slash) of 2 n floats and
  // the stats; on CUDA the softmax partials of up to 256 key splits per head, at most about
  // 16 MiB (fewer splits for many rows).
  const bool device_prime = OnDevicePath(config_.paths.prime);
  if (policy_->prime_rows() > 0 && device_prime) {
    z.prime_rows = static_cast<int>(std::min<int64_t>(policy_->prime_rows(), cap.max_prefill_chunk));
    z.prime_table_stride = 2 * cap.max_tokens_per_sequence;
    z.prime_tables = AllocBytes(static_cast<size_t>(hkv * z.prime_table_stride) * sizeof(float));
    z.prime_stats =
        AllocBytes(static_cast<size_t>(hkv * PrimeStatsCount(m.head_dim, dims_.group)) * sizeof(double));
    if (cuda) {
      const size_t per_split = PrimeScratchBytes(static_cast<int>(hkv), z.prime_rows, dims_.group, 0);
      const size_t splits = std::clamp<size_t>((size_t{16} << 20) / per_split, 2, 257) - 1;
      z.prime_scratch = AllocBytes(
          PrimeScratchBytes(static_cast<int>(hkv), z.prime_rows, dims_.group, static_cast<int>(splits)));
    }
  }
}

Status RuntimeImpl::SizePlannedStep(DeviceBufferSizes& z) const {
  const ModelShape& m = config_.model;
  const Capacity& cap = config_.capacity;
  const bool cuda = device_->backend() == Backend::kCuda;
  const int64_t hkv = m.num_kv_heads, d = m.head_dim;
  const int64_t slot_rows = int64_t{config_.tiers.sink_tokens} + config_.tiers.window_tokens;
  const bool device_select = selector_ != nullptr;
  // The planned decode step (runtime/decode_plan.cpp).
  z.device_select = device_select;
  // host_lists: a policy that selects on the host runs the planned step because its bank is on
  // the device.
  z.fast_path = (policy_->selects_sinks_and_recent() || device_select) &&
                !z.host_bank && !z.host_lists && config_.route != Route::kCpu;
  // A device or host selection may pick any position: its rows are all resident only when every
  // position is.
  z.step_all_resident = policy_->is_dense() || device_select || z.host_lists
                            ? slot_rows >= cap.max_tokens_per_sequence
                            : dims_.budget_max <= slot_rows;
  z.cpu_step = !z.fast_path && !z.host_lists && policy_->placement() == Placement::kCpu &&
               policy_->selection_covers_resident() && !policy_->is_dense() && !z.host_bank &&
               PlannedRoute() == Route::kCpu;
  if (!z.fast_path && !z.cpu_step && !z.host_lists) return Status::Ok();
  const int64_t items = int64_t{cap.max_batch} * hkv;
  KVF_RETURN_IF_ERROR(SizeStepLists(z));
  // The scheduler's split (RunDecodeStep, SplitShare): with a device selection and no token
  // bank, the step's misses are its list's non-resident rows, so the host knows their number
  // before the step and can give the CPU its share of them; with a bank, only the step knows
  // which of them it holds, and every miss is read over PCIe, then admitted. Route auto only,
  // with the CPU part on the runtime's thread (async_cpu), so that Decode does not wait for it.
  z.split = device_select && z.fast_path && !z.device_bank &&
            !z.step_all_resident && config_.route == Route::kAuto && config_.async_cpu != 0;
  if (z.split) {
    z.split_list = AllocBytes(static_cast<size_t>(items * z.list_cap) * sizeof(int32_t));
    z.split_count = AllocBytes(static_cast<size_t>(items) * sizeof(int32_t));
  }
  z.step_slots = AllocBytes(size_t{2} * cap.max_batch * sizeof(int32_t));
  z.step_pos = AllocBytes(2 * static_cast<size_t>(cap.max_batch) * m.num_layers *
                          sizeof(int64_t));
  if (cuda) {
    z.step_ws_floats =
        static_cast<int64_t>(cap.max_batch) * hkv * kStepMaxSplits * dims_.group * (d + 1);
    z.step_ws = AllocBytes(static_cast<size_t>(z.step_ws_floats) * sizeof(float));
    z.step_counters = AllocBytes(static_cast<size_t>(cap.max_batch) * hkv * dims_.group *
                                 sizeof(int32_t));
  }
  return Status::Ok();
}

Status RuntimeImpl::SizeStepLists(DeviceBufferSizes& z) const {
  const ModelShape& m = config_.model;
  const Capacity& cap = config_.capacity;
  const bool cuda = device_->backend() == Backend::kCuda;
  const bool device_select = z.device_select;
  const int64_t items = int64_t{cap.max_batch} * m.num_kv_heads;
  if (device_select || z.host_lists) {
    // Per layer a list region, so that any layer's last selection can be read back and no
    // layer rewrites a list an earlier launch of the step may still read.
    z.list_cap = std::max<int64_t>(dims_.item_cap, 1);
    const size_t lists = static_cast<size_t>(m.num_layers) * items;
    z.step_list = AllocBytes(lists * static_cast<size_t>(z.list_cap) * sizeof(int32_t));
    z.step_list_count = AllocBytes(lists * sizeof(int32_t));
  }
  if (device_select) {  // host lists need no selection scratch
    z.select_ld = cap.max_tokens_per_sequence;
    z.select_ws = AllocBytes(static_cast<size_t>(items) * dims_.group * z.select_ld * sizeof(float));
    int64_t sort_cap = 1;
    while (sort_cap < z.list_cap) sort_cap <<= 1;
    // The selector's own state (its parameters checked against the shape).
    const DeviceSelector& sel = *selector_;
    KVF_RETURN_IF_ERROR(sel.Size(z.selector_buffers));
    for (SelectorBuffer& b : z.selector_buffers) b.bytes = AllocBytes(b.bytes);
    z.selector = true;
    z.streams += sel.extra_streams();
    if (sort_cap > 4096 && sel.uses_topk_ws()) z.topk_ws = AllocBytes(static_cast<size_t>(items * sort_cap) * 8);
    // The multi-CTA top-k's scratch (CUDA), when an item can rank enough scores (positions, or
    // pages) to take it.
    const int64_t ranked_cap = sel.RankedCap(z.select_ld);
    const size_t mcta_bytes =
        ranked_cap > 0 ? SelectMctaWorkspaceBytes(items, dims_.group, ranked_cap, sel.MctaMinRanked()) : 0;
    if (cuda && mcta_bytes > 0) z.select_mcta = AllocBytes(mcta_bytes);
  }
  if (device_select || z.host_lists) {
    if (z.device_bank && !z.step_all_resident) {
      // The step's misses: staged at their list index, listed for the admission after the
      // step. With two regions the admission of layer l runs on its own stream beside layer
      // l + 1's step (which writes the other region); layer l + 2 waits for it. Two regions
      // unless the selector runs work beside the step itself (the measurement that chose this:
      // docs/runtime.md, the bank's admission).
      const bool side = !(z.selector && selector_->runs_beside_step());
      z.bank_regions = cuda && side ? 2 : 1;
      if (z.bank_regions > 1) ++z.streams;  // the admissions' stream
      const size_t regions = static_cast<size_t>(z.bank_regions);
      z.bank_miss_cap = static_cast<int32_t>(std::min<int64_t>(z.list_cap, z.bank_max_admit));
      z.bank_stage = regions * AllocBytes(static_cast<size_t>(items * z.list_cap) * 2 * dims_.row_bytes);
      z.bank_miss = regions * AllocBytes(static_cast<size_t>(items) * (1 + z.bank_miss_cap) *
                                         sizeof(int32_t));
      z.bank_admit = regions * AllocBytes(static_cast<size_t>(items) * z.bank_admit_item_bytes);
    }
  }
  return Status::Ok();
}

void RuntimeImpl::SizeDeviceScan(DeviceBufferSizes& z) const {
  const ModelShape& m = config_.model;
  const Capacity& cap = config_.capacity;
  const int64_t hkv = m.num_kv_heads, d = m.head_dim;
  // The shadow scan on the device: a copy of the policy's int8 shadow of K (head_dim bytes per token
  // and KV head, a quarter of a bf16 K + V row pair) and its scales, the scan's scores and
  // workspace (its ranking and counts: mapped host memory, scan_out / scan_counts).
  const int channels = policy_->device_scan_channels();
  const bool scan_env = OnDevicePath(config_.paths.shadow_scan);
  if ((z.cpu_step || z.host_lists) && channels > 0 && scan_env && dims_.group <= kShadowScanMaxGroup &&
      d <= 256) {
    const int64_t items = int64_t{cap.max_batch} * hkv;
    const int64_t heads = int64_t{cap.max_sequences} * m.num_layers * hkv;
    const int64_t len = cap.max_tokens_per_sequence;
    z.device_scan = true;
    z.scan_picks = std::clamp<int64_t>(policy_->device_scan_picks(dims_.budget_max), 1, len);
    z.scan_list_cap = ScanListCap(z.scan_picks);
    z.scan_shadow = AllocBytes(static_cast<size_t>(heads * d * len));
    z.scan_scale = AllocBytes(static_cast<size_t>(heads * d) * sizeof(float));
    z.scan_keys = AllocBytes(static_cast<size_t>(items * len) * sizeof(uint32_t));
    z.scan_ints = AllocBytes(static_cast<size_t>(ShadowScanInts(items, dims_.group, channels)) * 4);
    z.scan_hist = AllocBytes(static_cast<size_t>(ShadowScanHistWords(items)) * sizeof(uint32_t));
    // Per item a count per block of keys, then the items' thresholds.
    z.scan_blocks = AllocBytes(static_cast<size_t>(
        items * ((len + kShadowScanBlockKeys - 1) / kShadowScanBlockKeys + 1)) * sizeof(int32_t));
    z.scan_items = AllocBytes(static_cast<size_t>(items) * sizeof(ShadowScanItem));
    // The ranking and its counts go straight to mapped host memory: not the device's.
    z.scan_out = AllocBytes(static_cast<size_t>(items * z.scan_list_cap) * sizeof(uint64_t));
    z.scan_counts = AllocBytes(static_cast<size_t>(items) * sizeof(int32_t));
    // Under a cap the scan is what gives way (the policy then scans on the host); with no cap it
    // takes at most a quarter of the GPU (an engine's weights and activations share it), unless
    // ReferencePaths::shadow_scan = kDevice asks for it.
    const int64_t scan_bytes = static_cast<int64_t>(z.scan_shadow + z.scan_scale + z.scan_keys +
                                                    z.scan_ints + z.scan_hist + z.scan_blocks +
                                                    z.scan_items);
    const int64_t total = device_->total_device_bytes();
    const bool too_big = cap.gpu_bytes > 0
                             ? z.Plan(cap.gpu_bytes).total_bytes > cap.gpu_bytes
                             : total > 0 && scan_bytes > total / 4 &&
                                   config_.paths.shadow_scan != PathChoice::kDevice;
    if (too_big) z.DropScan();
  }
}

Result<int> RuntimeImpl::ChooseBankSlots() const {
  const int64_t cap = config_.capacity.gpu_bytes;
  DeviceBufferSizes z;
  auto fits = [&](int slots) -> Result<bool> {
    KVF_RETURN_IF_ERROR(SizeDeviceBuffers(slots, z));
    return z.Plan(cap).total_bytes <= cap;
  };
  // A table never holds more rows than a sequence has positions. From one slot up the total
  // grows with the slots (the rows, the hash maps); no bank at all may take less or more than
  // one slot (a bank changes the planned step's buffers), so 0 is the answer only when 1 fails.
  const int hi_bound = static_cast<int>(
      std::min<int64_t>(kMaxBankSlots, config_.capacity.max_tokens_per_sequence));
  KVF_ASSIGN_OR_RETURN(const bool one_fits, fits(1));
  if (!one_fits) return 0;
  int lo = 1, hi = hi_bound;  // lo fits; find the largest that does
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    KVF_ASSIGN_OR_RETURN(const bool mid_fits, fits(mid));
    if (mid_fits) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

Status RuntimeImpl::CheckDeviceCap(const DeviceMemoryPlan& plan, bool auto_bank) const {
  const int64_t cap = config_.capacity.gpu_bytes;
  if (cap == 0 || plan.total_bytes <= cap) return Status::Ok();
  return ResourceExhausted(StrCat(
      "capacity.gpu_bytes ", cap, " is below the ", plan.total_bytes,
      " bytes of device memory this configuration needs on the ",
      BackendName(device_->backend()), " backend, ", plan.total_bytes - cap, " over (",
      plan.ToString(), ")",
      auto_bank ? "; bank_slots -1 (auto): not even one slot fits" : "",
      "; lower max_sequences, max_tokens_per_sequence, max_batch, max_prefill_chunk, "
      "sink_tokens + window_tokens or bank_slots, or raise the cap"));
}

}  // namespace detail
}  // namespace kvferry
